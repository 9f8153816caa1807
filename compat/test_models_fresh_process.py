"""Model cases that need a fresh interpreter.

Some behaviour depends on process-wide state that the other tests have
already set (what ran first, logical devices, AutoGraph's once-per-process
warnings), so these cases run a script in a subprocess. Each script runs the
same training with tf.GradientTape and with fasttape.GradientTape and prints
the results as JSON on its last line; the comparison happens here.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL, ATOL = 1e-5, 1e-6

_PRELUDE = '''
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
'''


def _run_script(tmp_path, name, body, timeout=240):
    """Run body in a fresh interpreter (from a real file: AutoGraph only
    converts code whose source it can read); return its last-line JSON."""
    script = tmp_path / f"{name}.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_close(expected, actual, path="result"):
    """Compare JSON nests; None must match None exactly."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (
            f"{path}: tf gave {expected!r:.200}, fasttape gave {actual!r:.200}")
        for k in expected:
            _assert_close(expected[k], actual[k], f"{path}[{k!r}]")
        return
    if expected is None or actual is None or isinstance(expected, str) \
            or isinstance(actual, str):
        assert actual == expected, (
            f"{path}: tf gave {expected!r:.200}, fasttape gave {actual!r:.200}")
        return
    try:
        e = np.asarray(expected, dtype=np.float64)
    except (TypeError, ValueError):  # ragged: a list of differently shaped arrays
        assert isinstance(actual, list) and len(actual) == len(expected), path
        for i, (ei, ai) in enumerate(zip(expected, actual)):
            _assert_close(ei, ai, f"{path}[{i}]")
        return
    try:
        a = np.asarray(actual, dtype=np.float64)
    except (TypeError, ValueError):
        raise AssertionError(f"{path}: fasttape gave {actual!r:.200}") from None
    assert a.shape == e.shape, f"{path}: shape {a.shape} != tf's {e.shape}"
    np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg=path)


# -- the first fasttape tape of a process entered inside a tf.function --------

_FIRST_TAPE_IN_FUNCTION = '''
import numpy as np
import tensorflow as tf
import keras
import fasttape

rs = np.random.RandomState(0)
x = rs.randn(8, 4).astype("float32")
y = np.sin(x).sum(axis=1, keepdims=True).astype("float32")


def run(GradientTape):
    keras.utils.set_random_seed(0)
    glorot = keras.initializers.GlorotUniform
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="tanh", kernel_initializer=glorot(1)),
        keras.layers.Dense(1, kernel_initializer=glorot(2))])
    optimizer = keras.optimizers.SGD(0.1)
    # The tf.Variables behind the keras.Variables, so that this case does
    # not depend on keras.Variable sources (covered in test_models_loops).
    sources = [v.value for v in model.trainable_variables]

    @tf.function
    def train_step():
        with GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, sources)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = [float(train_step()) for _ in range(3)]

    # Afterwards, eagerly: gradients w.r.t. weights and inputs (saliency).
    xin = tf.constant(x)
    with GradientTape() as tape:
        tape.watch(xin)
        loss = tf.reduce_mean(tf.square(model(xin) - y))
    grads = tape.gradient(loss, sources + [xin])
    return {"losses": losses, "eager_loss": float(loss),
            "eager_grads": [None if g is None else g.numpy().tolist()
                            for g in grads]}


# TF's tape first: it adds no op callback, so fasttape's first tape of the
# process is the one inside train_step.
print(json.dumps({"tf": run(tf.GradientTape),
                  "fasttape": run(fasttape.GradientTape)}))
'''


def _require_tf_ok(result):
    """The reference run must work; otherwise the test itself is broken."""
    if not isinstance(result, dict):
        pytest.fail(f"tf.GradientTape run failed: {result}")


def test_tf_function_training_then_eager_gradients(tmp_path):
    """Regression: when a process's first fasttape tape is entered inside a
    tf.function, fasttape's op callback is added while building a graph, and
    op_callbacks.add_op_callback only switches execute.execute to
    execute_with_callbacks when called eagerly; later eager ops on the Python
    slow path (execute.execute, e.g. the BiasAdd of a Keras 3 Dense) then
    went unrecorded and eager gradients came back None."""
    result = _run_script(tmp_path, "first_tape_in_function", _FIRST_TAPE_IN_FUNCTION)
    _require_tf_ok(result["tf"])
    if any(g is None for g in result["tf"]["eager_grads"]):
        pytest.fail("tf.GradientTape gave None gradients")
    _assert_close(result["tf"], result["fasttape"])


# -- tf.distribute.MirroredStrategy (two logical CPUs, replica threads) --------

_MIRRORED = '''
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import tf_keras as keras2
import fasttape

rs = np.random.RandomState(0)
x = rs.randn(8, 4).astype("float32")
y = np.sin(x).sum(axis=1, keepdims=True).astype("float32")


# One strategy for every run: several MirroredStrategy objects in one process
# can collide on collective keys (TF's own runs then fail).
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def run(GradientTape, mode):
    with strategy.scope():
        keras2.utils.set_random_seed(0)
        glorot = keras2.initializers.GlorotUniform
        model = keras2.Sequential([
            keras2.layers.Dense(8, activation="tanh", input_shape=(4,),
                                kernel_initializer=glorot(1)),
            keras2.layers.Dense(1, kernel_initializer=glorot(2))])
        optimizer = keras2.optimizers.SGD(0.1, momentum=0.5)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(4))

    def replica_step(xb, yb):
        with GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(xb, training=True) - yb)) / 4.0
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def step(xb, yb):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(xb, yb)),
                               axis=None)
    if mode == "function":
        step = tf.function(step)
    try:
        losses = [float(step(xb, yb)) for _ in range(2) for xb, yb in dataset]
    except Exception as exc:  # compared as a string
        return "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0])
    return {"losses": losses,
            "weights": [w.numpy().tolist() for w in model.weights]}


out = {}
for mode in ("eager", "function"):
    out[mode] = {"tf": run(tf.GradientTape, mode),
                 "fasttape": run(fasttape.GradientTape, mode)}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def mirrored_results(tmp_path_factory):
    return _run_script(tmp_path_factory.mktemp("mirrored"), "mirrored", _MIRRORED)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_mirrored_strategy_custom_loop(mirrored_results, mode):
    """Replica threads, MirroredVariable sources (tape.gradient must unwrap
    them as TF's is_resource_variable does), cross-replica reduction."""
    result = mirrored_results[mode]
    _require_tf_ok(result["tf"])
    _assert_close(result["tf"], result["fasttape"])


# -- AutoGraph: a tape inside a user's @tf.function ----------------------------

_AUTOGRAPH = '''
import logging
import tensorflow as tf
import fasttape

messages = []


class Collect(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())


logging.getLogger("tensorflow").addHandler(Collect())


def autograph_warnings(GradientTape):
    del messages[:]
    w = tf.Variable([[0.5], [-0.25]])
    x = tf.constant([[1.0, 2.0]])

    @tf.function
    def step():
        with GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss

    step()
    return [m.splitlines()[0] for m in messages if "AutoGraph" in m]


print(json.dumps({"tf": autograph_warnings(tf.GradientTape),
                  "fasttape": autograph_warnings(fasttape.GradientTape)}))
'''


def test_tape_in_user_tf_function_is_not_autograph_converted(tmp_path):
    """Regression: AutoGraph used to convert fasttape's own Python code inside
    a user's @tf.function (tensorflow.* is on its do-not-convert list), which
    re-parsed fasttape's source at trace time and logged "AutoGraph could not
    transform <bound method GradientTapeCore.compute_gradient ...> ... Please
    report this to the TensorFlow team"; TF's tape logs nothing."""
    result = _run_script(tmp_path, "autograph_case", _AUTOGRAPH)
    if result["tf"]:
        pytest.fail(f"AutoGraph warned with TF's tape too: {result['tf']}")
    assert result["fasttape"] == result["tf"], result


def test_a_first_tape_inside_tf_function_installs_the_death_hook(tmp_path):
    """fasttape's hooks go in at the first tape, which may be inside a
    trace: the death hook still reads eager tensors to find the id's place,
    and then eager tapes forget what dies, as TF's do."""
    out = _run_script(tmp_path, "first_tape_traced", """
        import tensorflow as tf
        import fasttape
        from fasttape.recording import _recording

        @tf.function
        def traced(x):
            with fasttape.GradientTape() as t:
                t.watch(x)
                y = tf.sin(x)
            return t.gradient(y, x)

        g = float(traced(tf.constant(0.5)))
        x = tf.constant(1.0)
        with fasttape.GradientTape() as t:
            t.watch(x)
            for i in range(500):
                y = x * float(i)
            held = t._tape.core.num_ops
        print(json.dumps({"g": g, "held": held,
                          "hooked": "EagerTensor.tp_dealloc"
                                    in _recording.installed_hooks()}))
    """)
    assert out["hooked"] and out["held"] == 1, out
    np.testing.assert_allclose(out["g"], np.cos(0.5), rtol=1e-6)


def test_conv_kernel_rule_where_tf_groups_no_convolution(tmp_path):
    """With oneDNN off (TF_ENABLE_ONEDNN_OPTS=0: TF's Eigen kernels, whose
    kernel gradient has no groups), a float32 Conv2D of many input channels
    to few outputs keeps its rule without the grouped kernel gradient:
    per-example gradients equal single-example tapes."""
    out = _run_script(tmp_path, "conv_without_onednn", """
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
        import numpy as np
        import tensorflow as tf
        import fasttape

        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=(3, 6, 6, 8)), tf.float32)
        kernel = tf.Variable(rng.normal(size=(3, 3, 8, 2)), dtype=tf.float32)

        def loss(x):
            z = tf.nn.conv2d(x, kernel, 1, "SAME")
            return tf.reduce_sum(tf.sin(z), axis=[1, 2, 3])
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        got = tape.per_example_gradients(losses, [kernel])[0]
        rules = tape.summary().per_example_rules[1]
        ref = []
        for i in range(3):
            with tf.GradientTape() as t:
                one = loss(x[i:i + 1])[0]
            ref.append(t.gradient(one, kernel).numpy().tolist())
        print(json.dumps({"got": got.numpy().tolist(), "ref": ref,
                          "rules": [how for _, how in rules]}))
    """)
    assert out["rules"] == ["Conv2D"], out["rules"]
    np.testing.assert_allclose(out["got"], out["ref"], rtol=1e-4, atol=1e-5)
