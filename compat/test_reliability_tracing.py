"""Reliability faults found from outside (issue 9: 2, 9, 13-16; issue 14:
3, 5, 7): tapes around pfor jacobians in tf.function, recompute_grad with
stop_recording, and the exception types users match on.

Each case runs under tf.GradientTape and fasttape (``harness``); where TF
is wrong, ``fd.tf_wrong_here`` judges with float64 finite differences and
fails the day TF is fixed.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import fasttape
import fd
import harness
from harness import Raised


def _fresh(n):
    """tf.function, traced anew for each implementation (a function traced
    with one tape class must not be reused with the other)."""
    return tf.function(n)


# -- issue 9 fault 2: ops built by pfor, seen by an outer tape ----------------

@pytest.mark.parametrize("in_function", [True, False], ids=["function", "eager"])
@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "loop"])
@pytest.mark.parametrize("persistent", [True, False],
                         ids=["persistent", "once"])
def test_outer_tape_sees_batch_jacobian(in_function, pfor, persistent):
    """The issue's case: gradient of a sum of a batch_jacobian (TF [[6, 12]]
    for x**3; fasttape gave None in tf.function with pfor)."""
    x0 = tf.constant([[1., 2.], [0.5, -1.5]])
    w = tf.constant([[[1., -2.], [3., 0.5]], [[0.25, 1.], [-1., 2.]]])

    def case(Tape):
        def body(x):
            with Tape(persistent=persistent) as g:
                g.watch(x)
                with Tape(persistent=persistent) as gg:
                    gg.watch(x)
                    y = x ** 3 * tf.sin(x)
                j = gg.batch_jacobian(y, x, experimental_use_pfor=pfor)
                s = tf.reduce_sum(j * w)
            return g.gradient(s, x)
        return (_fresh(body) if in_function else body)(x0)

    out = harness.assert_parity(case)
    if in_function or persistent:
        assert not isinstance(out, Raised) and out is not None


@pytest.mark.parametrize("in_function", [True, False], ids=["function", "eager"])
@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "loop"])
@pytest.mark.parametrize("outer", ["jacobian", "batch_jacobian", "gradient"])
def test_outer_tape_sees_jacobian(in_function, pfor, outer):
    """A nested jacobian, then jacobian / batch_jacobian / gradient of it
    (TF 2*I for x**2; fasttape gave zeros in tf.function with pfor)."""
    x0 = tf.constant([[1.], [2.], [-0.5]])

    def case(Tape):
        def body(x):
            with Tape(persistent=True) as g:
                g.watch(x)
                with Tape(persistent=True) as gg:
                    gg.watch(x)
                    y = x ** 2 + tf.sin(x) * x[0]
                j = gg.jacobian(y, x, experimental_use_pfor=pfor)
                if outer == "gradient":
                    j = tf.reduce_sum(j * tf.reshape(tf.range(9.), [3, 1, 3, 1]))
            if outer == "gradient":
                return g.gradient(j, x)
            return getattr(g, outer)(j, x, experimental_use_pfor=pfor)
        return (_fresh(body) if in_function else body)(x0)

    out = harness.assert_parity(case, allow_tf_error=False)
    assert np.any(out.numpy() != 0)


def test_outer_tape_sees_jacobian_issue_case():
    """The issue's second form, exactly: 2*I from a nested jacobian then
    batch_jacobian in a tf.function."""
    def case(Tape):
        @tf.function
        def f(x):
            with Tape() as g:
                g.watch(x)
                with Tape() as gg:
                    gg.watch(x)
                    y = x ** 2
                j = gg.jacobian(y, x)
            return g.batch_jacobian(j, x)
        return f(tf.constant([[1., 2.]]))

    out = harness.assert_parity(case, allow_tf_error=False)
    assert np.any(out.numpy() != 0)



def test_outer_tape_sees_tiled_pfor_jacobian():
    """pfor with parallel_iterations tiles its loop (a while_loop of pfors):
    those ops too are seen by the outer tape."""
    def case(Tape):
        @tf.function
        def f(x):
            with Tape() as g:
                g.watch(x)
                with Tape(persistent=True) as gg:
                    gg.watch(x)
                    y = tf.sin(x) * x
                j = gg.jacobian(y, x, parallel_iterations=2)
                s = tf.reduce_sum(j * tf.reshape(tf.range(25.), [5, 5]))
            return g.gradient(s, x)
        return f(tf.constant([0.1, 0.5, 1.0, 1.5, 2.0]))

    out = harness.assert_parity(case, allow_tf_error=False)
    assert out is not None

@pytest.mark.parametrize("in_function", [True, False], ids=["function", "eager"])
@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "loop"])
@pytest.mark.parametrize("method", ["jacobian", "batch_jacobian"])
def test_accumulator_sees_pfor_jacobian(method, pfor, in_function):
    """Forward-over-reverse: a ForwardAccumulator around a (batch_)jacobian
    (fasttape's JVP was None in tf.function with pfor: the same unrecorded
    pfor ops)."""
    x0 = tf.constant([[1., 2.], [-0.5, 0.25]])

    def case(Acc, Tape):
        def body(x):
            with Acc(x, tf.constant([[1., -1.], [0.5, 2.]])) as acc:
                with Tape(persistent=True) as g:
                    g.watch(x)
                    y = x ** 3 * tf.cos(x)
                j = getattr(g, method)(y, x, experimental_use_pfor=pfor)
            return acc.jvp(j)
        return (_fresh(body) if in_function else body)(x0)

    if in_function and not pfor:
        # TF's while_loop under an accumulator in a tf.function raises a
        # TypeError (variant vs int64): TF is wrong here.
        def jac(x):
            d = 3 * x ** 2 * np.cos(x) - x ** 3 * np.sin(x)
            if method == "batch_jacobian":
                return np.stack([np.diag(row) for row in d])
            return np.diag(d.ravel()).reshape(2, 2, 2, 2)
        oracle = fd.jvp_oracle(jac, [x0.numpy()], [[[1., -1.], [0.5, 2.]]])
        fd.tf_wrong_here(case, oracle, tf_raises=TypeError)
        return
    expected = fd.run(case, "tf")
    harness.compare(expected, fd.run(case, "fasttape"), allow_tf_error=False)

# -- issue 9 fault 9: recompute_grad, stop_recording, a new Variable a step ----

def _recompute_steps(Tape, steps=4):
    @tf.recompute_grad
    @tf.function
    def outer(x):
        @tf.function
        def middle(y):
            @tf.function
            def inner(z):
                return z * 1.5 + tf.sin(z)
            i = tf.constant(0.0)
            y, i = tf.while_loop(lambda y, i: i < 3.0,
                                 lambda y, i: (inner(y), i + 1.0), [y, i])
            return y
        return middle(x)

    out = []
    for step in range(steps):
        x = tf.Variable(0.3 + step, name="x")   # the last step's one dies
        with Tape() as t:
            y = outer(x)
        out.append((y, t.gradient(y, x)))
    return out


def test_recompute_grad_nested_functions_new_variable_each_step():
    """TF's testRecomputeGradWithNestedFunctionAndWhileLoop, with a gradient:
    fasttape failed on step 2 (its could_possibly_record ignored
    stop_recording, so the function call touched the deleted Variable of
    step 1)."""
    out = harness.assert_parity(_recompute_steps, allow_tf_error=False)

    def g(z):
        return z * 1.5 + np.sin(z)

    for step, (_, grad) in enumerate(out):
        [oracle] = fd.central_difference(lambda x: g(g(g(x))), [0.3 + step])
        np.testing.assert_allclose(grad.numpy(), oracle, rtol=1e-4)


def test_could_possibly_record_honours_stop_recording():
    from tensorflow.python.eager import record
    for Tape in harness.IMPLEMENTATIONS.values():
        with Tape():
            assert record.could_possibly_record()
            with record.stop_recording():
                assert not record.could_possibly_record(), Tape


# -- issue 9 faults 13 and 14: jacobian's exception types and messages --------

_BAD_SOURCES = {
    "none_in_list": lambda x: [x, None],
    "object_in_list": lambda x: [x, object()],
    "string_in_list": lambda x: [x, "abc"],
    "none": lambda x: None,
    "object": lambda x: object(),
    "string": lambda x: "abc",
}


def _assert_same_error(case, message):
    """TF and fasttape raise the same type, and both say ``message``."""
    tf_out = harness.assert_parity(case)
    ft_out = harness.run_case(case, "fasttape")
    assert isinstance(tf_out, Raised), tf_out
    assert message in str(tf_out.exc), tf_out
    assert message in str(ft_out.exc), ft_out


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "loop"])
@pytest.mark.parametrize("source", sorted(_BAD_SOURCES))
@pytest.mark.parametrize("method", ["jacobian", "batch_jacobian"])
def test_jacobian_non_tensor_source_error(method, source, pfor, in_function):
    """jacobian: TF's TypeError from IsTrainable (fasttape's eager row loop
    raised AttributeError); batch_jacobian: AttributeError on .shape."""
    def case(Tape):
        def body(x):
            with Tape(persistent=True) as t:
                t.watch(x)
                y = x * x
            return getattr(t, method)(y, _BAD_SOURCES[source](x),
                                      experimental_use_pfor=pfor)
        return (_fresh(body) if in_function else body)(tf.ones([2, 2]))

    message = ("to a TensorFlow DType" if method == "jacobian"
               else "has no attribute 'shape'")
    if method == "batch_jacobian" and source.endswith("in_list"):
        if not in_function:
            # fasttape's eager batch_jacobian takes a nest of sources (an
            # extension; TF's has no .shape on a list): a non-tensor in it
            # is then the TypeError that jacobian and gradient raise.
            tf_out = harness.run_case(case, "tf")
            ft_out = harness.run_case(case, "fasttape")
            assert isinstance(tf_out.exc, AttributeError), tf_out
            assert "'list' object has no attribute 'shape'" in str(tf_out.exc)
            assert isinstance(ft_out.exc, TypeError), ft_out
            assert "to a TensorFlow DType" in str(ft_out.exc)
            return
        message = "'list' object has no attribute 'shape'"
    _assert_same_error(case, message)


_BATCH_SHAPES = {   # (target, source): TF's message
    "rank1_target": ([2], [2, 3], "must have rank at least 2"),
    "rank1_both": ([3], [3], "must have rank at least 2"),
    "rank1_source": ([2, 2], [2], "must have rank at least 2"),
    "rank1_target_scalar_batch": ([1], [1, 1], "must have rank at least 2"),
    "batch_mismatch": ([3, 2], [2, 2], "Need first dimension"),
}


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "loop"])
@pytest.mark.parametrize("shapes", sorted(_BATCH_SHAPES))
def test_batch_jacobian_bad_rank_error(shapes, pfor, in_function):
    target_shape, source_shape, message = _BATCH_SHAPES[shapes]

    def case(Tape):
        def body(x):
            with Tape(persistent=True) as t:
                t.watch(x)
                y = tf.ones(target_shape) * tf.reduce_sum(x)
            return t.batch_jacobian(y, x, experimental_use_pfor=pfor)
        return (_fresh(body) if in_function else body)(tf.ones(source_shape))

    _assert_same_error(case, message)


# -- issue 9 fault 15: a backward function returning the wrong count ----------

def _record_operation_case(n_returned, in_function):
    from tensorflow.python.eager import record

    def case(Tape):
        def body(x, z):
            with Tape() as t:
                t.watch([x, z])
                out = tf.identity(x * z)
                record.record_operation(
                    "WrongCount", [out], [x, z],
                    lambda dy: [dy * 2.0] * n_returned)
            return t.gradient(out, [x, z])
        fn = _fresh(body) if in_function else body
        # Three calls: fasttape's compiled backward takes over after the
        # first passes of a repeated step.
        return [fn(tf.constant(2.), tf.constant(3.)) for _ in range(3)][-1]
    return case


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("n_returned", [0, 1, 3])
def test_record_operation_wrong_gradient_count(n_returned, in_function):
    """TF's tape raises InternalError "returned too few gradients" (also for
    too many); fasttape raised ValueError."""
    _assert_same_error(_record_operation_case(n_returned, in_function),
                       "'WrongCount' returned too few gradients. Expected 2 "
                       f"but received {n_returned}")
    assert isinstance(harness.run_case(_record_operation_case(
        n_returned, in_function), "fasttape").exc, tf.errors.InternalError)


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_custom_gradient_too_few_gradients(in_function):
    """tf.custom_gradient: its own ValueError eagerly; in a tf.function the
    tape's InternalError (TF's custom_gradient checks only eagerly)."""
    def case(Tape):
        @tf.custom_gradient
        def f(a, b):
            return a * b, lambda dy: [dy]

        def body(a, b):
            with Tape() as t:
                t.watch([a, b])
                y = f(a, b)
            return t.gradient(y, [a, b])
        return (_fresh(body) if in_function else body)(tf.constant(2.),
                                                       tf.constant(3.))

    _assert_same_error(case, "too few gradients" if in_function
                       else "expected to return 2 gradients")


def test_record_operation_right_count_still_works():
    out = harness.assert_parity(_record_operation_case(2, False),
                                allow_tf_error=False)
    np.testing.assert_allclose([g.numpy() for g in out], [2.0, 2.0])


# -- issue 9 fault 16: gradient() again after a gradient function raised ------

def test_second_gradient_after_grad_fn_raised_differs_on_purpose():
    """A deliberate difference (README): TF's second gradient() on a
    non-persistent tape whose first pass raised is an InternalError about an
    invalid tape state; fasttape's is the RuntimeError every reuse of a
    consumed tape gives. Both raise the grad_fn's error the first time. Fails
    the day TF's behaviour changes."""
    def case(Tape):
        @tf.custom_gradient
        def f(a):
            def grad(dy):
                raise KeyError("grad_fn failed")
            return a * 2.0, grad

        x = tf.constant(1.0)
        with Tape() as t:
            t.watch(x)
            y = f(x)
        raised = []
        for _ in range(2):
            try:
                t.gradient(y, x)
                raised.append(None)
            except Exception as exc:  # noqa: BLE001 - recorded and compared
                raised.append(exc)
        return raised

    tf_first, tf_second = case(tf.GradientTape)
    ft_first, ft_second = case(fasttape.GradientTape)
    assert isinstance(tf_first, KeyError) and isinstance(ft_first, KeyError)
    assert isinstance(tf_second, tf.errors.InternalError), tf_second
    assert "Internal state of the gradient tape is invalid" in str(tf_second)
    assert type(ft_second) is RuntimeError, ft_second
    assert "non-persistent GradientTape can only be used to compute one" in str(
        ft_second)
    # The same RuntimeError, in both, after a first pass that succeeded.
    assert harness.assert_parity(_reuse_after_success).__class__ is Raised


def _reuse_after_success(Tape):
    x = tf.constant(1.0)
    with Tape() as t:
        t.watch(x)
        y = x * x
    t.gradient(y, x)
    return t.gradient(y, x)


# -- issue 14 item 3: jacobian without pfor, a source dtype not the target's ---

@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("sources", ["float32", "float32_and_int32"])
def test_jacobian_loop_source_dtype_differs_tf_wrong(sources, in_function):
    """TF's jacobian(experimental_use_pfor=False) declares the target's
    dtype for every source's rows: its TensorArray raises
    InvalidArgumentError for a float32 source of a float64 target (or an
    int32 source beside it). fasttape gives the float64 finite differences'
    values (and None for the int source), eager and in a tf.function."""
    x0 = np.array([0.5, 1.5])
    n0 = np.array([2, 3])

    def case(_, Tape):
        def body(x, n):
            with Tape(persistent=True) as t:
                t.watch(x)
                t.watch(n)
                y = tf.sin(tf.cast(x, tf.float64)) * tf.cast(n, tf.float64)
            src = [x, n] if sources != "float32" else [x]
            return t.jacobian(y, src, experimental_use_pfor=False)
        return (_fresh(body) if in_function else body)(
            tf.constant(x0, tf.float32), tf.constant(n0, tf.int32))

    [jac] = fd.central_difference(lambda x: np.sin(x) * n0, [x0])
    oracle = [jac] if sources == "float32" else [jac, None]
    fd.tf_wrong_here(case, oracle, tf_raises=tf.errors.InvalidArgumentError)


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_batch_jacobian_loop_source_dtype_differs_tf_wrong(in_function):
    """The same in batch_jacobian(experimental_use_pfor=False)."""
    x0 = np.array([[0.5, 1.5], [-0.25, 2.0]])

    def case(_, Tape):
        def body(x):
            with Tape(persistent=True) as t:
                t.watch(x)
                y = tf.sin(tf.cast(x, tf.float64)) * 3.0
            return t.batch_jacobian(y, x, experimental_use_pfor=False)
        return (_fresh(body) if in_function else body)(
            tf.constant(x0, tf.float32))

    oracle = np.stack([np.diag(3 * np.cos(row)) for row in x0])
    fd.tf_wrong_here(case, oracle, tf_raises=tf.errors.InvalidArgumentError)



@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "loop"])
def test_jacobian_variable_and_handle_sources_in_function(pfor):
    """Row dtypes from a Variable and from its resource handle (the dtype in
    its handle data): the same values as TF."""
    def case(Tape):
        v = tf.Variable([1., 2.])

        @tf.function
        def f():
            with Tape(persistent=True) as t:
                y = v * v * 3.
            return t.jacobian(y, [v, v.handle], experimental_use_pfor=pfor)
        return f()

    harness.assert_parity(case, allow_tf_error=False)


def test_jacobian_loop_of_a_keras_variable_in_function():
    """A Keras 3 variable as the source of a loop jacobian in a tf.function
    (its dtype is a str): the same values as TF (fasttape raised
    AttributeError there)."""
    import keras  # noqa: PLC0415 - Keras 3

    def case(Tape):
        layer = keras.layers.Dense(3, dtype="float64")
        layer.build((2, 4))

        @tf.function
        def f(x):
            with Tape() as t:
                y = layer(x)
            return t.jacobian(y, layer.kernel, experimental_use_pfor=False)
        return f(tf.constant(np.arange(8.).reshape(2, 4) / 7, tf.float64))

    harness.assert_parity(case, allow_tf_error=False)

# -- issue 14 item 5: more or fewer output_gradients than targets -------------

def _two_targets(Tape, seeds):
    x = tf.constant([1., 2.])
    with Tape() as t:
        t.watch(x)
        a, b = x * x, x * 3.0
    return t.gradient([a, b], x, output_gradients=seeds)


def test_more_output_gradients_than_targets_differs_on_purpose():
    """A deliberate difference (README): TF uses the first seeds and
    silently ignores the rest; fasttape raises ValueError (a misaligned
    seed list is a bug worth hearing about). Fails the day TF changes."""
    seeds = [tf.ones([2]), tf.fill([2], 2.0), tf.fill([2], 5.0)]
    tf_out = harness.run_case(lambda T: _two_targets(T, seeds), "tf")
    np.testing.assert_allclose(tf_out.numpy(), [2 + 6, 4 + 6])
    ft_out = harness.run_case(lambda T: _two_targets(T, seeds), "fasttape")
    assert type(ft_out.exc) is ValueError, ft_out
    assert "Number of output gradients (3) does not match number of " \
        "targets (2)" in str(ft_out.exc)


_FEWER_SEEDS_UNDER_TF = textwrap.dedent("""
    import tensorflow as tf
    x = tf.constant([1., 2.])
    with tf.GradientTape() as t:
        t.watch(x)
        a, b = x * x, x * 3.0
    try:
        print("RESULT", t.gradient([a, b], x, output_gradients=[tf.ones([2])]))
    except Exception as exc:
        print("RAISED", type(exc).__name__, exc)
""")


def test_fewer_output_gradients_than_targets_differs_on_purpose():
    """TF 2.21 reads past its list of output gradients: it usually crashes
    the process (a segmentation fault in its C++ tape, run here in a
    subprocess), and now and then (1 run in 8, measured) returns a result
    made with whatever it read. fasttape raises ValueError. Fails the day
    TF raises an error of its own (fasttape should then raise its type)."""
    ft_out = harness.run_case(lambda T: _two_targets(T, [tf.ones([2])]),
                              "fasttape")
    assert type(ft_out.exc) is ValueError, ft_out
    assert "Number of output gradients (1) does not match number of " \
        "targets (2)" in str(ft_out.exc)
    proc = subprocess.run([sys.executable, "-c", _FEWER_SEEDS_UNDER_TF],
                          capture_output=True, text=True, timeout=600,
                          check=False)
    crashed = proc.returncode < 0
    returned = proc.returncode == 0 and "RESULT" in proc.stdout
    assert crashed or returned, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "RAISED" not in proc.stdout, proc.stdout


# -- issue 14 item 7: a missing second-order gradient under a pfor jacobian ----

@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "loop"])
@pytest.mark.parametrize("method", ["jacobian", "batch_jacobian"])
def test_missing_second_order_gradient_error(method, pfor, in_function):
    """SoftsignGrad has no gradient. TF's eager pfor jacobian traces a
    tf.function, whose AutoGraph turns the LookupError into a StagingError;
    fasttape's eager row loop raised the bare LookupError. Without pfor both
    raise LookupError."""
    def case(Tape):
        def body(x):
            with Tape(persistent=True) as t2:
                t2.watch(x)
                with Tape() as t1:
                    t1.watch(x)
                    y = tf.reduce_sum(tf.math.softsign(x))
                g = t1.gradient(y, x)
            return getattr(t2, method)(g, x, experimental_use_pfor=pfor)
        return (_fresh(body) if in_function else body)(
            tf.reshape(tf.linspace(0.1, 1., 4), [2, 2]))

    _assert_same_error(case, "gradient registry has no entry for: SoftsignGrad")


class _PlainError(Exception):
    pass


@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "loop"])
@pytest.mark.parametrize("error", [ZeroDivisionError, IndexError, ValueError,
                                   _PlainError, tf.errors.InvalidArgumentError])
def test_grad_fn_error_type_under_eager_jacobian(error, pfor):
    """AutoGraph keeps some exception types (ValueError, OpErrors, plain
    Exception subclasses) and turns the others into StagingError: the same
    types from fasttape's untraced eager row loop."""
    def case(Tape):
        @tf.custom_gradient
        def f(a):
            def grad(dy):
                if error is tf.errors.InvalidArgumentError:
                    raise error(None, None, "grad_fn failed")
                raise error("grad_fn failed")
            return a * 2.0, grad

        x = tf.constant([1.0, 2.0])
        with Tape(persistent=True) as t:
            t.watch(x)
            y = f(x)
        return t.jacobian(y, x, experimental_use_pfor=pfor)

    _assert_same_error(case, "while vectorizing the jacobian" if (
        pfor and error is ValueError) else "grad_fn failed")
