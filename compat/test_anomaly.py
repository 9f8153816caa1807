"""Anomaly mode (fasttape.detect_anomaly): a NaN/Inf gradient names the
forward op, its shapes and the user's line that created it; off, nothing
changes (TF's results, under both implementations)."""

import sys

import numpy as np
import pytest
import tensorflow as tf

import fasttape
from fasttape.gradients import _compiled
from fasttape.diagnostics import anomaly

from harness import assert_leaks_nothing, assert_parity


def _here():
    """The caller's line number (the next line is the one named)."""
    return sys._getframe(1).f_lineno + 1  # pylint: disable=protected-access


@pytest.fixture(autouse=True)
def _anomaly_off_after():
    yield
    anomaly._set(False)  # pylint: disable=protected-access


# -- the three cases of the issue, each as a user would hit it -------------------

def log_where(GradientTape):
    """The tf.where trap: log(0) is masked out in the forward pass, but its
    gradient there is 0 * (1/0) = NaN, which the where passes on."""
    x = tf.Variable([0.0, 1.0, 2.0])
    with GradientTape() as tape:
        y = tf.where(x > 0, tf.math.log(x), tf.zeros_like(x))
        loss = tf.reduce_sum(y)
    return tape.gradient(loss, x)


LOG_LINE = log_where.__code__.co_firstlineno + 5


def sqrt_negative(GradientTape):
    """A standard deviation of a shifted input that goes negative: the
    forward pass is NaN already, and so is Sqrt's gradient, 0.5 / NaN."""
    x = tf.constant([1.0, 4.0])
    with GradientTape() as tape:
        tape.watch(x)
        y = tf.sqrt(x - 2.0)
        loss = tf.reduce_sum(y)
    return tape.gradient(loss, x)


SQRT_LINE = sqrt_negative.__code__.co_firstlineno + 6


@tf.custom_gradient
def unit_vector(x):
    n = tf.norm(x)

    def grad(dy):
        # 0/0 at x = 0: the gradient of a norm there is undefined.
        return dy * x / n - x * tf.reduce_sum(dy * x) / n ** 3

    return x / tf.maximum(n, 1e-12), grad


def custom_zero_over_zero(GradientTape):
    x = tf.zeros([3])
    with GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(unit_vector(x) * 2.0)
    return tape.gradient(loss, x)


CUSTOM_LINE = custom_zero_over_zero.__code__.co_firstlineno + 4

CASES = [(log_where, "Log", LOG_LINE, "tf.math.log(x)"),
         (sqrt_negative, "Sqrt", SQRT_LINE, "tf.sqrt(x - 2.0)"),
         (custom_zero_over_zero, "unit_vector", CUSTOM_LINE, "unit_vector(x)")]


@pytest.mark.parametrize("case,op_type,line,text", CASES,
                         ids=[c[1] for c in CASES])
def test_anomaly_names_the_op_and_the_users_line(case, op_type, line, text):
    with fasttape.detect_anomaly():
        with pytest.raises(fasttape.AnomalyError) as info:
            case(fasttape.GradientTape)
    err = info.value
    assert isinstance(err, tf.errors.InvalidArgumentError)
    assert err.op_type == op_type
    assert err.kind == "NaN"
    assert err.filename == __file__ and err.lineno == line, err.stack
    message = str(err)
    assert f"'{op_type}'" in message
    assert f'File "{__file__}", line {line}' in message
    assert text in message      # the source line itself
    # The shapes of the forward op.
    assert err.input_shapes and err.output_shapes
    assert err.output_shapes[0][1] == "float32"


@pytest.mark.parametrize("case,op_type,line,text", CASES,
                         ids=[c[1] for c in CASES])
def test_anomaly_off_gives_tfs_nan(case, op_type, line, text):
    """Off (the default), the same programs return TF's NaN gradients."""
    del op_type, line, text
    assert not fasttape.is_anomaly_enabled()
    result = assert_parity(case, allow_tf_error=False)
    assert np.isnan(result.numpy()).any()


@pytest.mark.parametrize("case", [c[0] for c in CASES],
                         ids=[c[1] for c in CASES])
def test_tf_tape_unchanged_in_anomaly_mode(case):
    """Anomaly mode is fasttape's: TF's own tape still returns its NaN."""
    expected = case(tf.GradientTape).numpy()
    with fasttape.detect_anomaly():
        got = case(tf.GradientTape).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(got, expected)   # (NaNs equal in place)


def test_shapes_in_the_message():
    x = tf.Variable(tf.fill([2, 3], -1.0))
    w = tf.constant(np.ones((3, 4), "float32"))
    with fasttape.detect_anomaly():
        with fasttape.GradientTape() as tape:
            line = _here()
            h = tf.sqrt(tf.matmul(x, w) * 0.0)   # sqrt(0): gradient inf * 0
            loss = tf.reduce_sum(h)
        with pytest.raises(fasttape.AnomalyError) as info:
            tape.gradient(loss, x)
    err = info.value
    assert err.op_type == "Sqrt" and err.lineno == line
    assert err.input_shapes == (((2, 4), "float32"),)
    assert err.output_shapes == (((2, 4), "float32"),)
    assert "inputs: [(2, 4) float32], outputs: [(2, 4) float32]" in str(err)


def test_inf_kind():
    x = tf.constant([0.0, 1.0])
    with fasttape.detect_anomaly():
        with fasttape.GradientTape() as tape:
            tape.watch(x)
            line = _here()
            y = tf.sqrt(x)          # gradient 0.5 / sqrt(0) = inf
            loss = tf.reduce_sum(y)
        with pytest.raises(fasttape.AnomalyError) as info:
            tape.gradient(loss, x)
    assert info.value.kind == "Inf" and info.value.lineno == line


def test_keras_layer_names_the_users_lambda():
    """In a Keras model, Keras' frames are left out: the line named is the
    user's (here, the Lambda's body), not Keras' call machinery."""
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(4, kernel_initializer="ones"),
        tf.keras.layers.Lambda(lambda h: tf.sqrt(tf.nn.relu(h - 10.0))),  # sqrt(0)
        tf.keras.layers.Dense(1, kernel_initializer="ones"),
    ])
    lambda_line = test_keras_layer_names_the_users_lambda.__code__.co_firstlineno + 5
    x = tf.ones((2, 3))
    model(x)
    with fasttape.detect_anomaly():
        with fasttape.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))   # finite; Sqrt's gradient 0.5 / 0
        with pytest.raises(fasttape.AnomalyError) as info:
            tape.gradient(loss, model.trainable_variables)
    err = info.value
    assert err.op_type == "Sqrt" and err.kind == "Inf"
    assert err.filename == __file__ and err.lineno == lambda_line, err.stack
    assert all("keras" not in f for f, _, _ in err.stack)


def test_compiled_backward_is_bypassed():
    """Anomaly mode runs the eager pass even where a compiled one is cached
    (a compiled pass would not check each op)."""
    x = tf.constant([0.0, 1.0, 2.0])

    def step():
        with fasttape.GradientTape() as tape:
            tape.watch(x)
            y = tf.where(x > 0, tf.math.log(x), 0.0)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, x)

    previous = _compiled.set_mode("always")
    try:
        replayed = _compiled.CACHE.stats["replayed"]
        for _ in range(3):
            assert np.isnan(step().numpy()).any()
        assert _compiled.CACHE.stats["replayed"] > replayed   # it was compiled
        replayed = _compiled.CACHE.stats["replayed"]
        with fasttape.detect_anomaly():
            for _ in range(2):
                with pytest.raises(fasttape.AnomalyError):
                    step()
        assert _compiled.CACHE.stats["replayed"] == replayed
    finally:
        _compiled.set_mode(previous)


def test_recorded_outside_anomaly_mode_says_so():
    x = tf.constant([0.0, 1.0])
    with fasttape.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(tf.where(x > 0, tf.math.log(x), 0.0))
    with fasttape.detect_anomaly():
        with pytest.raises(fasttape.AnomalyError) as info:
            tape.gradient(loss, x)
    assert info.value.op_type == "Log" and info.value.stack == ()
    assert "recorded while anomaly mode was off" in str(info.value)


def test_inside_tf_function_the_check_is_a_checknumerics_op():
    x = tf.constant([0.0, 1.0])

    @tf.function
    def grad(x):
        with fasttape.GradientTape() as tape:
            tape.watch(x)
            y = tf.math.log(x)
            loss = tf.reduce_sum(tf.where(x > 0, y, 0.0))
        return tape.gradient(loss, x)

    with fasttape.detect_anomaly():
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            grad(x)
        checked = tf.function(grad.python_function).get_concrete_function(x)
        # Finite input: the checked function gives TF's gradient.
        finite = tf.constant([0.5, 2.0])
        np.testing.assert_allclose(checked(finite).numpy(), [2.0, 0.5])
    assert "'Log'" in str(info.value)
    assert "fasttape anomaly mode" in str(info.value)
    # The check is a CheckNumerics op in the traced backward pass, on the
    # gradient of Log's input, and only while the mode is on.
    ops = checked.graph.get_operations()
    numerics = [op for op in ops if op.type == "CheckNumerics"]
    assert numerics, [op.type for op in ops]
    assert any("'Log'" in op.get_attr("message").decode() for op in numerics)
    assert numerics[0].inputs[0].dtype == tf.float32
    plain = tf.function(grad.python_function).get_concrete_function(x)
    assert not [op for op in plain.graph.get_operations()
                if op.type == "CheckNumerics"]


def test_finite_gradients_are_tfs_in_anomaly_mode():
    """On, with nothing to report: the same gradients as TF's tape."""
    def case(GradientTape):
        rng = np.random.default_rng(0)
        w = tf.Variable(rng.normal(size=(4, 3)).astype("float32"))
        b = tf.Variable(np.zeros(3, "float32"))
        x = tf.constant(rng.normal(size=(5, 4)).astype("float32"))
        table = tf.Variable(rng.normal(size=(10, 4)).astype("float32"))
        with GradientTape(persistent=True) as tape:
            h = tf.nn.relu(tf.matmul(x + tf.gather(table, [1, 2, 1, 0, 9]), w) + b)
            loss = tf.reduce_mean(tf.nn.softmax(h) * tf.math.log(h + 1.0))
        return [tape.gradient(loss, [w, b, table]),
                tape.jacobian(h[0], w)]

    with fasttape.detect_anomaly():
        assert_parity(case, allow_tf_error=False)


def test_detect_anomaly_modes():
    assert not fasttape.is_anomaly_enabled()
    with fasttape.detect_anomaly():
        assert fasttape.is_anomaly_enabled()
        with fasttape.detect_anomaly(False):
            assert not fasttape.is_anomaly_enabled()
        assert fasttape.is_anomaly_enabled()
    assert not fasttape.is_anomaly_enabled()
    fasttape.detect_anomaly(True)
    assert fasttape.is_anomaly_enabled()
    fasttape.detect_anomaly(False)
    assert not fasttape.is_anomaly_enabled()


def test_off_records_nothing():
    x = tf.constant([1.0, 2.0])
    before = len(anomaly._RECORDS)  # pylint: disable=protected-access
    with fasttape.GradientTape() as tape:
        tape.watch(x)
        y = tf.sin(x) * x
    assert len(anomaly._RECORDS) == before  # pylint: disable=protected-access
    with fasttape.detect_anomaly():
        with fasttape.GradientTape() as tape2:
            tape2.watch(x)
            y2 = tf.sin(x) * x
        assert len(anomaly._RECORDS) == before + 2  # pylint: disable=protected-access
    del tape, y, tape2, y2


def _anomaly_step():
    x = tf.Variable([1.0, 2.0, 3.0])
    with fasttape.detect_anomaly():
        with fasttape.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sqrt(x) * tf.math.log(x))
        g = tape.gradient(loss, x)
        with fasttape.GradientTape() as tape:
            loss = tf.reduce_sum(tf.where(x > 1.0, tf.math.log(x - 1.0), 0.0))
        raised = False
        try:
            tape.gradient(loss, x)
        except fasttape.AnomalyError:
            raised = True     # (no pytest.raises: its info would hold the traceback)
        assert raised, "anomaly mode let log(0)'s NaN through"
    del g


def test_anomaly_mode_leaks_nothing():
    assert_leaks_nothing(_anomaly_step)


def test_anomaly_and_explain_name_the_same_user_line():
    """One finder of the user's line: an op run from inside the standard
    library (functools' singledispatch wrapper) is named at the user's line
    that called it, by anomaly mode as by explain_none (the stdlib frame is
    no more the user's than TF's)."""
    import functools
    from fasttape.diagnostics import _frames
    sqrt = functools.singledispatch(tf.sqrt)
    x = tf.constant([0.0, 4.0])
    with fasttape.detect_anomaly():
        with fasttape.GradientTape() as tape:
            tape.watch(x)
            line = _here()
            y = sqrt(x)
        with pytest.raises(anomaly.AnomalyError) as info:
            tape.gradient(y, x)
    assert (info.value.filename, info.value.lineno) == (__file__, line)
    assert _frames.kind(functools.__file__) == _frames.LIBRARY
    assert _frames.kind(__file__) == _frames.USER


def test_the_bench_workloads_are_user_code():
    """The bench's step functions stand for a user's program: their frames
    are the user's (a tape pushed there is placed at once, as in a user's
    loop, not after a walk to the stack's top); fasttape's own are not."""
    from fasttape.bench import privacy, workloads
    from fasttape.diagnostics import _frames
    assert _frames.kind(privacy.__file__) == _frames.USER
    assert _frames.kind(workloads.__file__) == _frames.USER
    assert _frames.kind(fasttape.tape.__file__) == _frames.FASTTAPE
    assert _frames.kind(_frames.__file__) == _frames.FASTTAPE


def test_the_mode_is_a_property_of_the_vspace():
    """Anomaly mode is the vspace's check_gradients (as the profiler is its
    profile_stats): set while the mode is on, and what the compiled cache
    declines."""
    from fasttape.recording import _recording
    vspace = _recording.VSPACE
    assert vspace.check_gradients is None
    with fasttape.detect_anomaly():
        assert vspace.check_gradients is anomaly.check_gradients
    assert vspace.check_gradients is None
