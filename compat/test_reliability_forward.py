"""Forward mode where an outside check found fasttape departing from TF
(issue 9, faults 3, 10, 11, 12): each case runs under TF's classes and
fasttape's and is compared (values, None positions, exception types).

- 3: forward-over-backward through FusedBatchNorm with ``fasttape.patch()``
  on: TF's own ``_FusedBatchNormGradGrad`` then runs a (fasttape) GradientTape
  inside the gradient function the accumulator transposes; that tape, pushed
  while the JVP was computed, saw none of its ops (None).
- 10: an accumulator around a tf.function whose gradient is IndexedSlices
  (a gather): the transposition took the IndexedSlices' id (AttributeError).
- 11: an accumulator inside a tf.function around tf.cond: fasttape told TF
  a lone accumulator needs higher-order gradients, so cond_v2 wrapped the op
  in a function TF never builds there, whose gradient it cannot resolve.
- 12: a tangent whose shape is not its primal's: TF does not check it when
  watching; a scalar broadcasts (``jvp(x * x) == 2x``), a (3,) tangent for a
  (2,) primal raises ValueError when an op runs.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gradients_util

import fasttape
import fd
from harness import Raised, SaturatedTraceCount, fresh_tf_jvp_trace_state
from test_forwardprop import attempt, const, fwd_error, fwd_parity

_TF_CLASSES = (tf.autodiff.ForwardAccumulator, tf.GradientTape)


pytestmark = pytest.mark.usefixtures("fresh_tf_jvp_traces")


# -- fault 3: forward-over-backward through FusedBatchNorm, patch() on ---------

def _bn_inputs():
    rng = np.random.default_rng(3)
    f = lambda *s: tf.constant(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    return f(2, 2, 2, 3), f(3), f(3), f(2, 2, 2, 3), f(2, 2, 2, 3)


def _fused_bn_fwd_over_back(FA, GT):
    x0, scale, offset, tangent, weights = _bn_inputs()
    x = tf.identity(x0)
    with FA(x, tangent) as acc:
        with GT() as tape:
            tape.watch(x)
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(
                x, scale, offset, is_training=True)
            loss = tf.reduce_sum(y * y * weights)
        g = tape.gradient(loss, x)
    return g, acc.jvp(g)


def _keras_bn_fwd_over_back(FA, GT):
    import tf_keras
    x0, _, _, tangent, weights = _bn_inputs()
    layer = tf_keras.layers.BatchNormalization(fused=True)
    layer.build(x0.shape)
    x = tf.identity(x0)
    with FA(x, tangent) as acc:
        with GT() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) ** 2 * weights)
        g = tape.gradient(loss, x)
    return g, acc.jvp(g)


def _under_patch(case):
    """The case with TF's class names, fasttape.patch() on."""
    with fasttape.patched():
        fa, gt = tf.autodiff.ForwardAccumulator, tf.GradientTape
        assert fa is fasttape.ForwardAccumulator and gt is fasttape.GradientTape
        return case(fa, gt)


@pytest.mark.parametrize("case", [_fused_bn_fwd_over_back, _keras_bn_fwd_over_back],
                         ids=["fused_batch_norm", "tf_keras_BatchNormalization"])
def test_fused_batch_norm_forward_over_backward_with_patch_on(case):
    expected = case(*_TF_CLASSES)
    assert expected[1] is not None
    for actual in (_under_patch(case),
                   case(fasttape.ForwardAccumulator, fasttape.GradientTape)):
        assert actual[1] is not None, "JVP of FusedBatchNormGradV3 is None"
        np.testing.assert_allclose(actual[0], expected[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(actual[1], expected[1], rtol=1e-4, atol=1e-5)


def test_fused_batch_norm_forward_over_backward_in_tf_function_with_patch_on():
    def case(FA, GT):
        @tf.function
        def f(x, tangent):
            x0, scale, offset, _, weights = _bn_inputs()
            with FA(x, tangent) as acc:
                with GT() as tape:
                    tape.watch(x)
                    y, _, _ = tf.compat.v1.nn.fused_batch_norm(
                        x, scale, offset, is_training=True)
                    loss = tf.reduce_sum(y * y * weights)
                g = tape.gradient(loss, x)
            return g, acc.jvp(g)
        x0, _, _, tangent, _ = _bn_inputs()
        return f(x0, tangent)
    expected = case(*_TF_CLASSES)
    actual = _under_patch(case)
    assert actual[1] is not None
    np.testing.assert_allclose(actual[1], expected[1], rtol=1e-4, atol=1e-5)


# The same mechanism without patch() (a custom_gradient whose grad_fn runs its
# own GradientTape, transposed by the accumulator) is a case where TF's own
# accumulator gives None: test_tf_differences.py::
# test_custom_gradient_with_a_tape_inside_its_grad_fn.


# -- fault 10: IndexedSlices gradients of tf.function calls --------------------

def test_accumulator_around_tf_function_that_gathers():
    def case(FA, GT):
        p = const(3, 2, seed=1)

        @tf.function
        def f(p):
            return tf.reduce_sum(tf.gather(p, [0, 2, 0]) ** 2, axis=1)
        with FA(p, const(3, 2, seed=2)) as acc:
            y = f(p)
        return y, acc.jvp(y)
    fwd_parity(case)


def test_accumulator_around_tf_function_that_gathers_a_variable():
    def case(FA, GT):
        v = tf.Variable(const(3, 2, seed=1))

        @tf.function
        def f():
            return tf.gather(v, [2, 0]) * 3.
        with FA(v, const(3, 2, seed=2)) as acc:
            y = f()
        return y, acc.jvp(y)
    fwd_parity(case)


def test_accumulator_around_tf_function_embedding_lookup():
    def case(FA, GT):
        table = const(5, 3, seed=6)
        ids = tf.constant([[0, 4], [4, 1]])

        @tf.function
        def f(table):
            return tf.tanh(tf.nn.embedding_lookup(table, ids))
        with FA(table, const(5, 3, seed=7)) as acc:
            y = f(table)
        return acc.jvp(y)
    fwd_parity(case)


def test_accumulator_over_eager_resource_gather():
    def case(FA, GT):
        v = tf.Variable(const(3, 2, seed=1))
        with FA(v, const(3, 2, seed=2)) as acc:
            y = tf.gather(v, [0, 2, 2])
        return acc.jvp(y)
    fwd_parity(case)


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 2)])
def test_forward_over_reverse_of_tanh_then_gather(shape):
    """Found by the fuzzer: the gather's IndexedSlices gradient, densified
    into TanhGrad, has an IndexedSlices tangent; fasttape seeded its
    transposition of TanhGrad's gradient with it, and _TanhGradGrad cannot
    multiply IndexedSlices (TypeError). TF gives the Hessian-vector product,
    as do finite differences."""
    x0 = np.linspace(-0.8, 0.9, int(np.prod(shape))).reshape(shape)
    v0 = np.ones(shape)

    def case(FA, GT):
        x = tf.constant(x0, tf.float64)
        with FA(x, tf.constant(v0, tf.float64)) as acc:
            with GT() as tape:
                tape.watch(x)
                y = tf.reduce_sum(tf.sin(tf.gather(tf.tanh(x), [0], axis=0)))
            g = tape.gradient(y, x)
        return acc.jvp(g)
    fwd_parity(case)

    def grad_np(x):
        g = np.zeros_like(x)
        t = np.tanh(x[:1])
        g[:1] = np.cos(t) * (1 - t ** 2)
        return g
    assert fd.matches(fd.run(case, "fasttape"),
                      fd.jvp_oracle(grad_np, [x0], [v0]), 1e-6, 1e-8)


# -- fault 11: control flow inside a tf.function, accumulator inside too -------

def test_accumulator_inside_tf_function_around_cond():
    def case(FA, GT):
        @tf.function
        def f(x):
            with FA(x, tf.ones_like(x) * 0.5) as acc:
                y = tf.cond(x > 0, lambda: x * x * x, lambda: x * 3.)
            return y, acc.jvp(y)
        return f(tf.constant(2.0)), f(tf.constant(-1.5))
    fwd_parity(case)


def test_accumulator_inside_tf_function_around_cond_on_a_vector():
    def case(FA, GT):
        @tf.function
        def f(x, t):
            with FA(x, t) as acc:
                y = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.sin(x) * x,
                            lambda: tf.exp(x))
            return acc.jvp(y)
        return f(const(4, seed=8), const(4, seed=9))
    fwd_parity(case)


def _cond_under_two_watchers(FA, GT, watchers):
    @tf.function
    def f(x):
        if watchers == "two_accumulators":
            with FA(x, tf.ones(2)) as a1, FA(x, tf.ones(2)) as a2:
                y = tf.cond(x[0] > 0, lambda: x * x, lambda: x)
            return a1.jvp(y), a2.jvp(y)
        if watchers == "accumulator_over_tape":
            with FA(x, tf.ones(2)) as acc:
                with GT() as tape:
                    tape.watch(x)
                    y = tf.cond(x[0] > 0, lambda: tf.cos(x), lambda: 2.0 * tf.cos(x))
                g = tape.gradient(y, x)
            return g, acc.jvp(g)
        with GT() as tape:
            tape.watch(x)
            with FA(x, tf.ones(2)) as acc:
                y = tf.cond(x[0] > 0, lambda: x * x, lambda: x)
            jvp = acc.jvp(y)
        return jvp, tape.gradient(jvp, x)
    return f(tf.constant([1., 2.]))


def test_tape_and_accumulator_inside_tf_function_around_cond():
    """TF's cond_v2 cannot build this (an assertion in its gradient-input
    resolution); fasttape fails the same way."""
    fwd_error(lambda FA, GT: _cond_under_two_watchers(FA, GT, "tape_and_accumulator"),
              AssertionError)


def test_two_accumulators_inside_tf_function_around_cond():
    """Both fail, with different types: TF's autograph reports an IndexError
    from cond_v2 as StagingError; fasttape's cond_v2 call trips the
    AssertionError the tape-and-accumulator case gives in TF. A known
    difference in the exception type of a case TF cannot run either."""
    tf_result = fd.run(lambda FA, GT: _cond_under_two_watchers(
        FA, GT, "two_accumulators"), "tf")
    ft_result = fd.run(lambda FA, GT: _cond_under_two_watchers(
        FA, GT, "two_accumulators"), "fasttape")
    assert isinstance(tf_result, Raised) and type(tf_result.exc).__name__ == (
        "StagingError"), tf_result
    assert isinstance(ft_result, Raised) and isinstance(
        ft_result.exc, AssertionError), ft_result


def test_accumulator_over_tape_inside_tf_function_around_cond():
    """Forward-over-reverse: both fail, with different types. TF raises
    TypeError ("`dtype` <dtype: 'variant'> is not compatible"); fasttape's
    accumulator makes cond_v2 run the cond as a function call for the
    tapes, whose gradient trips the AssertionError above. Found by the
    fuzzer (BOTH_FAIL_COND)."""
    tf_result = fd.run(lambda FA, GT: _cond_under_two_watchers(
        FA, GT, "accumulator_over_tape"), "tf")
    ft_result = fd.run(lambda FA, GT: _cond_under_two_watchers(
        FA, GT, "accumulator_over_tape"), "fasttape")
    assert isinstance(tf_result, Raised) and isinstance(
        tf_result.exc, TypeError), tf_result
    assert isinstance(ft_result, Raised) and isinstance(
        ft_result.exc, AssertionError), ft_result


@pytest.mark.parametrize("flow", ["cond", "switch_case"])
def test_accumulator_with_a_variable_into_a_tf_function_around_control_flow(flow):
    """A Variable primal passed into a tf.function holding a tf.cond or
    tf.switch_case, under an accumulator: TF raises (its known Variable
    fault: AttributeError for the cond, TypeError for the switch_case);
    fasttape, which returns the JVP without the control flow, transposes
    TF's _IfGrad / _CaseGrad eagerly and raises its AttributeError ("Tensor.graph
    is undefined when eager execution is enabled"). Found by the fuzzer."""
    def case(FA, GT):
        v = tf.Variable([0.5, -1.5])
        x = tf.constant([2.0, 0.3])

        @tf.function(autograph=False)
        def f(v, x):
            taken = tf.reduce_all(tf.math.is_finite(x))
            if flow == "cond":
                return tf.cond(taken, lambda: v * x, lambda: 2.0 * v * x)
            return tf.switch_case(tf.cast(taken, tf.int32),
                                  [lambda: 2.0 * v * x, lambda: v * x])
        with FA(v, tf.constant([1.0, 1.0])) as acc:
            y = f(v, x)
        return acc.jvp(y)
    tf_result, ft_result = fd.run(case, "tf"), fd.run(case, "fasttape")
    assert isinstance(tf_result, Raised) and isinstance(
        tf_result.exc, AttributeError if flow == "cond" else TypeError), tf_result
    assert isinstance(ft_result, Raised) and isinstance(
        ft_result.exc, AttributeError), ft_result


def test_accumulator_inside_tf_function_around_while_loop():
    def case(FA, GT):
        @tf.function
        def f(x):
            with FA(x, tf.ones_like(x)) as acc:
                _, y = tf.while_loop(lambda i, y: i < 3,
                                     lambda i, y: (i + 1, tf.sin(y) * x), [0, x])
            return acc.jvp(y)
        return f(tf.constant(2.0))
    fwd_parity(case)


@pytest.mark.parametrize("watchers", [
    "accumulator", "two_accumulators", "tape_and_accumulator",
    "persistent_tape", "tape", "unwatched_accumulator"])
def test_possible_tape_gradient_types_counts_accumulators_like_tf(watchers):
    """What a tf.function call or cond_v2/while_v2 asks before choosing how
    to record itself (0: nothing watches, 1: one non-persistent tape or one
    accumulator, 2: more): fasttape's answer must be TF's."""
    def case(FA, GT):
        x, other = const(2), const(2, seed=1)
        items = {
            "accumulator": [lambda: FA(x, tf.ones(2))],
            "two_accumulators": [lambda: FA(x, tf.ones(2)), lambda: FA(x, tf.ones(2))],
            "tape_and_accumulator": [GT, lambda: FA(x, tf.ones(2))],
            "persistent_tape": [lambda: GT(persistent=True)],
            "tape": [GT],
            "unwatched_accumulator": [lambda: FA(other, tf.ones(2))],
        }[watchers]
        entered = []
        try:
            for make in items:
                item = make()
                item.__enter__()
                entered.append(item)
                if isinstance(item, GT):
                    item.watch(x)
            return gradients_util.PossibleTapeGradientTypes([x])
        finally:
            for item in reversed(entered):
                item.__exit__(None, None, None)
    fwd_parity(case)


# -- fault 12: tangents whose shape is not the primal's -------------------------

@pytest.mark.parametrize("op", ["mul_self", "sin", "square", "exp_times_x"])
def test_scalar_tangent_broadcasts_like_tf(op):
    fn = {"mul_self": lambda x: x * x, "sin": tf.sin, "square": tf.square,
          "exp_times_x": lambda x: tf.exp(x) * x}[op]

    def case(FA, GT):
        x = tf.constant([1., 2., 3.])
        with FA(x, tf.constant(1.0)) as acc:
            y = fn(x)
        return acc.jvp(x), acc.jvp(y)
    fwd_parity(case)


@pytest.mark.parametrize("op", ["mul_self", "exp_times_x"])
def test_scalar_tangent_after_tf_relaxes_its_jvp_shapes(op, monkeypatch):
    """Once an op's JVP has been traced 32 times in a process, TF retraces it
    with relaxed shapes and a scalar tangent raises InvalidArgumentError
    where a fresh process broadcasts it; fasttape's answer does not depend
    on history (judged by finite differences)."""
    fresh_tf_jvp_trace_state(monkeypatch, SaturatedTraceCount())
    fn, np_fn = {"mul_self": (lambda x: x * x, lambda x: x * x),
                 "exp_times_x": (lambda x: tf.exp(x) * x,
                                 lambda x: np.exp(x) * x)}[op]

    def case(FA, GT):
        # One broadcasting Mul traced first (as any model's bias or scale
        # would): TF's relaxed trace then serves the scalar tangent's call.
        w = tf.ones([2, 3], tf.float64)
        with FA(w, tf.ones([2, 3], tf.float64)):
            w * tf.ones([3], tf.float64)
        x = tf.constant(_X12)
        with FA(x, tf.constant(0.7, tf.float64)) as acc:
            y = fn(x)
        return acc.jvp(y)
    oracle = fd.jvp_oracle(np_fn, [_X12], [np.full(3, 0.7)])
    fd.tf_wrong_here(case, [oracle], tf_raises=tf.errors.InvalidArgumentError)


def test_scalar_tangent_for_a_variable():
    def case(FA, GT):
        v = tf.Variable([1., 2., 3.])
        with FA(v, tf.constant(0.5)) as acc:
            y = v * v
        return acc.jvp(v), acc.jvp(y)
    fwd_parity(case)


_X12 = np.array([0.3, -1.2, 2.0])
_BROADCAST_CASES = {
    # TF's JVPs are traced per op with the scalar's shape: elementwise ops
    # with a second (broadcast) operand, reductions and reshapes fail there.
    "sum": (lambda x: tf.reduce_sum(x), lambda x: np.sum(x),
            tf.errors.InvalidArgumentError),
    "reshape": (lambda x: tf.reshape(tf.tanh(x), [3, 1]),
                lambda x: np.tanh(x).reshape(3, 1), tf.errors.InvalidArgumentError),
    "affine": (lambda x: 2. * x + 1., lambda x: 2. * x + 1., ValueError),
    "div": (lambda x: x / (x + 3.), lambda x: x / (x + 3.), ValueError),
}


@pytest.mark.parametrize("name", sorted(_BROADCAST_CASES))
def test_scalar_tangent_is_the_same_tangent_at_every_element(name):
    """Beyond the ops where TF's broadcast happens to work, a scalar tangent
    stands for that tangent at every element (fasttape broadcasts it once,
    when watching): judged by finite differences; TF raises here."""
    fn, np_fn, tf_raises = _BROADCAST_CASES[name]

    def case(FA, GT):
        x = tf.constant(_X12)
        with FA(x, tf.constant(0.7, tf.float64)) as acc:
            y = fn(x)
        return acc.jvp(y)
    oracle = fd.jvp_oracle(np_fn, [_X12], [np.full(3, 0.7)])
    fd.tf_wrong_here(case, [oracle], tf_raises=tf_raises)


def test_tangent_of_a_wrong_shape_raises_only_when_an_op_runs():
    def case(FA, GT):
        steps = []
        x = tf.constant([1., 2.])
        acc = FA(x, tf.constant([1., 1., 1.]))
        steps.append("constructed")
        with acc:
            steps.append("entered")
            steps.append(attempt(lambda: acc.jvp(x)))
            steps.append(attempt(lambda: x * x))
            steps.append(attempt(lambda: tf.sin(x)))
        return steps
    result = fwd_parity(case)
    assert result[3] == ("raised", "ValueError"), result


def test_tangent_of_a_wrong_shape_in_a_fallback_op_raises_value_error():
    def case(FA, GT):
        x = tf.constant([[1., 2.], [3., 4.]])
        with FA(x, tf.ones([3, 2])) as acc:
            tf.linalg.det(x + 3. * tf.eye(2))  # no direct rule: transposed
        return acc.jvp(x)
    fwd_error(case, ValueError)
