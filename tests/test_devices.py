"""Device placement: gradients of ops placed on a second (logical) CPU.

Two logical CPU devices must be configured before TensorFlow initializes its
context, so this module does it at import time; if TF was already
initialized (another module ran an op first) the module is skipped with the
reason. Every case runs under tf.GradientTape and fasttape.GradientTape and
compares values and the ``.device`` of every gradient tensor.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_CONFIG_ERROR = None
try:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2)
except RuntimeError as exc:  # TF's context was initialized already
    _CONFIG_ERROR = str(exc)

import fasttape  # noqa: E402

_CPUS = [d.name for d in tf.config.list_logical_devices("CPU")]
pytestmark = pytest.mark.skipif(
    len(_CPUS) < 2,
    reason=("needs two logical CPU devices, which must be configured before "
            "TensorFlow initializes its context; it was initialized before "
            f"this module was imported ({_CONFIG_ERROR}); run this module "
            "on its own or first"))

IMPLS = {"tf": tf.GradientTape, "fasttape": fasttape.GradientTape}


def _describe(x):
    if x is None:
        return None
    if isinstance(x, tf.IndexedSlices):
        return ("IndexedSlices", x.values.device, tf.convert_to_tensor(x).numpy())
    return (x.dtype, x.device, x.numpy())


def assert_same_placement(case):
    """case(GradientTape) -> {name: gradient}; compares values and devices."""
    expected = {k: _describe(v) for k, v in case(IMPLS["tf"]).items()}
    actual = {k: _describe(v) for k, v in case(IMPLS["fasttape"]).items()}
    assert set(expected) == set(actual)
    problems = []
    for name in expected:
        e, a = expected[name], actual[name]
        if e is None or a is None:
            if not (e is None and a is None):
                problems.append(f"{name}: tf {e!r}, fasttape {a!r}")
            continue
        if e[0] != a[0]:
            problems.append(f"{name}: type/dtype tf {e[0]}, fasttape {a[0]}")
        if e[1] != a[1]:
            problems.append(f"{name}: device tf {e[1]}, fasttape {a[1]}")
        if not np.allclose(e[2], a[2], rtol=1e-5, atol=1e-6):
            problems.append(f"{name}: value tf {e[2]}, fasttape {a[2]}")
    assert not problems, "\n".join(problems)
    return expected


def test_two_cpus_configured():
    assert len(_CPUS) >= 2
    with tf.device("/CPU:1"):
        x = tf.constant(1.0)
    assert x.device.endswith("CPU:1")


def test_gradients_of_ops_on_second_cpu():
    def case(GradientTape):
        with tf.device("/CPU:1"):
            x = tf.constant([1.0, 2.0])
            v = tf.Variable([3.0, 4.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            with tf.device("/CPU:1"):
                y = x * x * v
                z = tf.reduce_sum(tf.sin(y))
                g = tf.gather(v, [1, 1])
        out = {"y_x": t.gradient(y, x), "y_v": t.gradient(y, v),
               "z_x": t.gradient(z, x), "g_v": t.gradient(g, v)}
        with tf.device("/CPU:1"):
            out["z_x_in_scope"] = t.gradient(z, x)
            out["g_v_in_scope"] = t.gradient(g, v)
        return out

    r = assert_same_placement(case)
    np.testing.assert_allclose(r["y_x"][2], [6.0, 16.0])
    assert r["z_x_in_scope"][1].endswith("CPU:1")


def test_missing_output_gradients_zeros_on_second_cpu():
    # tf.split's unused outputs get zeros; the gradient is a concat of them.
    def case(GradientTape):
        with tf.device("/CPU:1"):
            x = tf.constant([1.0, 2.0, 3.0, 4.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            with tf.device("/CPU:1"):
                a, b = tf.split(x * 2.0, 2)
                vals, _ = tf.math.top_k(x, k=2)
        out = {"a_x": t.gradient(a, x), "vals_x": t.gradient(vals, x)}
        with tf.device("/CPU:1"):
            out["a_x_in_scope"] = t.gradient(a, x)
        return out

    assert_same_placement(case)


def test_unconnected_zero_on_second_cpu():
    def case(GradientTape):
        with tf.device("/CPU:1"):
            x = tf.constant([1.0, 2.0])
            u = tf.constant([5.0])
            v = tf.Variable([[1.0]])
        with GradientTape(persistent=True) as t:
            t.watch([x, u])
            with tf.device("/CPU:1"):
                y = x * 3.0
        out = {}
        for name, src in (("u", u), ("v", v)):
            out[name] = t.gradient(y, src, unconnected_gradients="zero")
            with tf.device("/CPU:1"):
                out[name + "_in_scope"] = t.gradient(
                    y, src, unconnected_gradients="zero")
        return out

    assert_same_placement(case)


def test_output_gradients_on_second_cpu():
    def case(GradientTape):
        with tf.device("/CPU:1"):
            x = tf.constant([1.0, 2.0])
            dy = tf.constant([10.0, 100.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            with tf.device("/CPU:1"):
                y = tf.exp(x)
        return {"y_x": t.gradient(y, x, output_gradients=dy)}

    assert_same_placement(case)


def test_function_on_second_cpu():
    def case(GradientTape):
        @tf.function
        def f(a):
            with tf.device("/CPU:1"):
                return tf.sin(a) * a

        x = tf.constant([0.5, 1.5])
        with GradientTape() as t:
            t.watch(x)
            y = f(x)
        return {"y_x": t.gradient(y, x)}

    assert_same_placement(case)




def test_source_that_is_target_on_second_cpu():
    def case(GradientTape):
        with tf.device("/CPU:1"):
            x = tf.constant([1.0, 2.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            with tf.device("/CPU:1"):
                y = x * 2.0
        return {"x_x": t.gradient(x, x), "y_y": t.gradient(y, y)}

    assert_same_placement(case)


def test_identity_passes_ones_through_on_second_cpu():
    def case(GradientTape):
        with tf.device("/CPU:1"):
            x = tf.constant([1.0, 2.0])
        with GradientTape() as t:
            t.watch(x)
            with tf.device("/CPU:1"):
                y = tf.identity(x)
        return {"y_x": t.gradient(y, x)}

    assert_same_placement(case)


def test_ones_follow_device_scope_like_tf():
    # Inside a device scope TF and fasttape agree, ones included.
    def case(GradientTape):
        with tf.device("/CPU:1"):
            x = tf.constant([1.0, 2.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            with tf.device("/CPU:1"):
                y = tf.identity(x)
        with tf.device("/CPU:1"):
            return {"y_x": t.gradient(y, x), "x_x": t.gradient(x, x)}

    assert_same_placement(case)


# -- MirroredStrategy: replica threads on two devices -------------------------------

@pytest.fixture(scope="module")
def strategy():
    return tf.distribute.MirroredStrategy(_CPUS[:2])


def _replica_values(strategy, fn, x):
    result = strategy.run(fn, args=(x,))
    return [(t.device, t.numpy()) for t in strategy.experimental_local_results(result)]


def _distributed_x(strategy):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([1.0, 2.0]) * float(ctx.replica_id_in_sync_group + 1))


def _assert_replicas_match(strategy, make_step, compiled):
    got = {}
    for name, Tape in IMPLS.items():
        step = make_step(Tape)
        if compiled:
            step = tf.function(step)
        got[name] = _replica_values(strategy, step, _distributed_x(strategy))
    assert len(got["tf"]) == 2
    for (td, tv), (fd, fv) in zip(got["tf"], got["fasttape"]):
        assert td == fd
        np.testing.assert_allclose(fv, tv, rtol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "function"])
def test_mirrored_strategy_gradient_wrt_inputs(strategy, compiled):
    with strategy.scope():
        v = tf.Variable([1.0, 2.0])

    def make_step(Tape):
        def step(x):
            with Tape() as t:
                t.watch(x)
                y = tf.reduce_sum(tf.sin(x * v) * x)
            return t.gradient(y, x)
        return step

    _assert_replicas_match(strategy, make_step, compiled)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "function"])
def test_mirrored_strategy_gradient_wrt_mirrored_variable(strategy, compiled):
    with strategy.scope():
        v = tf.Variable([1.0, 2.0])

    def make_step(Tape):
        def step(x):
            with Tape() as t:
                y = tf.reduce_sum(tf.sin(x * v) * x)
            return t.gradient(y, v)
        return step

    _assert_replicas_match(strategy, make_step, compiled)


def test_mirrored_strategy_watches_what_tf_watches(strategy):
    """In a replica: a MirroredVariable, its own replica's component and a
    plain variable, each read by a fast-path op (``x * v``): the tape
    watches what TF's does (the component as the MirroredVariable, whose
    handle it is there), and the gradients agree."""
    with strategy.scope():
        v = tf.Variable([1.0, 2.0])
    plain = tf.Variable([3.0, 4.0], name="plain")
    got = {}
    for name, Tape in IMPLS.items():
        def step(x, Tape=Tape):
            ctx = tf.distribute.get_replica_context()
            component = v._get_replica(ctx.replica_id_in_sync_group)  # pylint: disable=protected-access
            with Tape() as t:
                y = (tf.reduce_sum(tf.sin(x * v) * x)
                     + tf.reduce_sum(x * component) + tf.reduce_sum(x * plain))
            watched = [f"{type(w).__name__}:{w.name}" for w in t.watched_variables()]
            return watched, t.gradient(y, [v, plain])
        watched, grads = strategy.run(step, args=(tf.constant([1.0, 2.0]),))
        got[name] = (
            [strategy.experimental_local_results(w) for w in watched],
            [[g.numpy() for g in strategy.experimental_local_results(grad)]
             for grad in grads])
    assert got["fasttape"][0] == got["tf"][0]
    assert [names[0] for names in got["tf"][0]] == [
        "MirroredVariable:Variable:0", "ResourceVariable:plain:0"]
    np.testing.assert_allclose(got["fasttape"][1], got["tf"][1], rtol=1e-6)


def test_dp_gradient_alternating_device_scopes():
    """dp_gradient steps of one structure, alternately under CPU:0 and
    CPU:1 scopes, in the compiled cache's default mode (a fused pass per
    scope, built and replayed, the kept plan remembering the last one
    replayed): each step's clipped sums equal the eager pass's under the
    same scope (cache off) and are placed like them."""
    from compat.harness import compiled_mode

    fasttape.clear_caches()
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(5, 3)))
    b = tf.Variable(rng.normal(size=(3,)))

    def step(device, n):
        x = tf.constant(rng.normal(size=(4, 5)) * (1.0 + n))
        with tf.device(device):
            with fasttape.GradientTape() as tape:
                losses = tf.reduce_sum(tf.tanh(x @ w + b) ** 2, axis=1)
            return tape.dp_gradient(losses, [w, b], 0.5), x

    for n in range(10):
        device = _CPUS[n % 2]
        got, x = step(device, n)
        with compiled_mode("off"), tf.device(device):
            with fasttape.GradientTape() as tape:
                losses = tf.reduce_sum(tf.tanh(x @ w + b) ** 2, axis=1)
            want = tape.dp_gradient(losses, [w, b], 0.5)
        for g, e in zip(got, want):
            assert g.device == e.device, (n, g.device, e.device)
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-12)
    from fasttape.gradients import _compiled
    assert _compiled.CACHE.stats["post_replayed"] >= 4, _compiled.CACHE.stats
    fasttape.clear_caches()
