"""dp_gradient inside strategy.run under MirroredStrategy on two logical CPUs.

Two logical CPUs must be configured before TensorFlow initializes its
context, which another test module of the same worker may have done: the
cases run in one subprocess of their own (about 10 s with TF's import),
which prints each case's result as JSON; the tests read it.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = textwrap.dedent('''
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2)
    import fasttape

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    with strategy.scope():
        w = tf.Variable(rng.normal(size=(5, 3)).astype("float32"))
        b = tf.Variable(tf.zeros(3))

    def step(xs, ys, noise, seed, microbatches):
        with fasttape.GradientTape() as tape:
            losses = tf.reduce_sum((tf.matmul(xs, w) + b - ys) ** 2, axis=1)
        return tape.dp_gradient(losses, [w, b], 0.5, noise, microbatches, seed)

    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8))))
    out = {}

    def compare(name, run, noise, seed, microbatches):
        try:
            got = run(*batch, noise, seed, microbatches)
        except Exception as e:
            out[name] = {"error": type(e).__name__, "message": str(e)[:300]}
            return
        # one device, the whole batch: its microbatches are twice as many
        want = step(x, y, noise, seed, microbatches and 2 * microbatches)
        out[name] = {
            "devices": sorted({v.device[-5:] for g in got
                               for v in strategy.experimental_local_results(g)}),
            "diff": max(float(np.max(np.abs(v.numpy() - r.numpy())))
                        for g, r in zip(got, want)
                        for v in strategy.experimental_local_results(g)),
            "scale": max(float(np.max(np.abs(r.numpy()))) for r in want)}

    eager = lambda *a: strategy.run(step, args=a)
    compare("noise 0", eager, 0.0, None, None)
    # 7 examples: 4 on one replica, 3 on the other; the division is by 7
    uneven = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:7], y[:7])).batch(7))))
    got = eager(*uneven, 0.0, None, None)
    want = step(x[:7], y[:7], 0.0, None, None)
    out["uneven"] = max(float(np.max(np.abs(v.numpy() - r.numpy())))
                        for g, r in zip(got, want)
                        for v in strategy.experimental_local_results(g))
    # float64, 4 and 3 examples: the division by 7 in float64's precision
    with strategy.scope():
        w64 = tf.Variable(rng.normal(size=(5, 3)))
        b64 = tf.Variable(rng.normal(size=3))

    def step64(xs, ys):
        with fasttape.GradientTape() as tape:
            losses = tf.reduce_sum(tf.sin(tf.matmul(xs, w64) + b64 - ys), axis=1)
        return tape.dp_gradient(losses, [w64, b64], 0.5)
    x64, y64 = x[:7].astype("float64"), y[:7].astype("float64")
    got = strategy.run(step64, args=next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x64, y64)).batch(7)))))
    want = step64(x64, y64)
    out["uneven float64"] = max(
        float(np.max(np.abs(v.numpy() - r.numpy())) / np.max(np.abs(r.numpy())))
        for g, r in zip(got, want) for v in strategy.experimental_local_results(g))
    # 4 examples in 2 microbatches on one replica, 2 in 2 on the other:
    # the sum of the 4 clipped microbatch gradients over 4
    shards = [(x[:4], y[:4]), (x[4:6], y[4:6])]
    per_replica = [strategy.experimental_distribute_values_from_function(
        lambda ctx, k=k: tf.constant(shards[ctx.replica_id_in_sync_group][k]))
        for k in (0, 1)]
    got = eager(*per_replica, 0.0, None, 2)
    halves = [step(xs, ys, 0.0, None, 2) for xs, ys in shards]
    out["uneven microbatches"] = max(
        float(np.max(np.abs(v.numpy() - (a.numpy() + c.numpy()) / 2)))
        for g, a, c in zip(got, *halves)
        for v in strategy.experimental_local_results(g))
    compare("microbatches", eager, 0.0, None, 2)
    compare("seeded noise", eager, 1.0, 3, None)
    unseeded = eager(*batch, 1.0, None, None)
    out["unseeded replicas agree"] = all(
        np.array_equal(*[v.numpy() for v in strategy.experimental_local_results(g)])
        for g in unseeded)
    compiled = tf.function(lambda xs, ys: strategy.run(
        step, args=(xs, ys, 0.0, None, None)))
    compare("compiled", lambda xs, ys, *_: compiled(xs, ys), 0.0, None, None)
    # a distributed iterator inside tf.function: each shard's batch is
    # unknown while tracing (None), known only at run time
    next_step = tf.function(lambda it: strategy.run(
        step, args=(*next(it), 0.0, None, None)))
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    compare("compiled, batch unknown", lambda *_: next_step(iter(dataset)),
            0.0, None, None)

    # Where a compiled strategy.run's results live, with TF's own tape: a
    # tf.function hands every replica's result back on its default device.
    def tf_step(xs, ys):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((tf.matmul(xs, w) + b - ys) ** 2)
        return tf.distribute.get_replica_context().all_reduce(
            "SUM", tape.gradient(loss, [w, b]))
    tf_compiled = tf.function(lambda xs, ys: strategy.run(tf_step, args=(xs, ys)))
    out["compiled"]["tf devices"] = sorted(
        {v.device[-5:] for g in tf_compiled(*batch)
         for v in strategy.experimental_local_results(g)})

    # make_private: Keras 3 fit (run_eagerly) on the two replicas
    import keras
    from fasttape import privacy

    def fitted(scope):
        with scope:
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
            model.compile(keras.optimizers.SGD(0.5), "mse", run_eagerly=True)
            privacy.make_private(model, l2_norm_clip=0.5, noise_multiplier=0.0)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        return [v.numpy() for v in model.trainable_variables]

    import contextlib
    out["fit"] = max(float(np.max(np.abs(a - c))) for a, c in zip(
        fitted(strategy.scope()), fitted(contextlib.nullcontext())))

    # tf_keras' fit, compiled, with a sample weight: the same on two replicas
    import tf_keras

    def tf_keras_fitted(scope):
        with scope:
            tf_keras.utils.set_random_seed(1)
            model = tf_keras.Sequential([tf_keras.layers.Dense(3, input_shape=(5,))])
            model.compile(tf_keras.optimizers.SGD(0.5), "mse")
            privacy.make_private(model, l2_norm_clip=0.5, noise_multiplier=0.0)
        history = model.fit(x, y, sample_weight=np.linspace(0.5, 2, 8),
                            batch_size=4, shuffle=False, verbose=0).history
        return [v.numpy() for v in model.trainable_variables], history["loss"][0]

    (two, two_loss), (one, one_loss) = (tf_keras_fitted(strategy.scope()),
                                        tf_keras_fitted(contextlib.nullcontext()))
    out["tf_keras fit"] = {
        "diff": max(float(np.max(np.abs(a - c))) for a, c in zip(two, one)),
        "loss": [two_loss, one_loss]}
    # Last: a case that fails in a collective aborts the later ones
    # ("Restart your program to reset").
    # One example over the two replicas: the other's shard is empty, adds
    # zeros and no microbatch; the step is the one-device step on that
    # example. Eagerly, in a function (shards known while tracing), from an
    # iterator in a function (each shard's size read at run time), and with
    # the example on replica 1: replica 0, empty, still adds the noise once.
    def one_example(run, noise=0.0, seed=None, microbatches=None, one=step):
        try:
            got = run(noise, seed, microbatches)
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)[:300]}
        want = one(x[:1], y[:1], noise, seed, microbatches)
        return {"devices": sorted({v.device[-5:] for g in got
                                   for v in strategy.experimental_local_results(g)}),
                "diff": max(float(np.max(np.abs(v.numpy() - r.numpy())))
                            for g, r in zip(got, want)
                            for v in strategy.experimental_local_results(g)),
                "scale": max(float(np.max(np.abs(r.numpy()))) for r in want)}
    single = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:1], y[:1])).batch(1))
    one = next(iter(single))
    out["one example"] = one_example(lambda *a: eager(*one, *a))
    out["one example, microbatches"] = one_example(
        lambda *a: eager(*one, *a), microbatches=1)
    static = tf.function(lambda xs, ys: strategy.run(
        step, args=(xs, ys, 0.0, None, None)))
    out["one example, compiled"] = one_example(lambda *_: static(*one))
    from_iterator = tf.function(lambda it, m: strategy.run(
        step, args=(*next(it), 0.0, None, m)))
    out["one example, compiled, batch unknown"] = one_example(
        lambda *_: from_iterator(iter(single), None))
    out["one example, compiled, batch unknown, microbatches"] = one_example(
        lambda *_: from_iterator(iter(single), 1), microbatches=1)
    second = [strategy.experimental_distribute_values_from_function(
        lambda ctx, k=k: tf.constant(((x[:0], y[:0]), (x[:1], y[:1]))[
            ctx.replica_id_in_sync_group][k])) for k in (0, 1)]
    out["one example on replica 1, seeded noise"] = one_example(
        lambda *a: eager(*second, *a), 1.0, 3)
    # (traced noise: a function's draw for that seed)
    noised = tf.function(lambda xs, ys: strategy.run(
        step, args=(xs, ys, 1.0, 3, None)))
    out["one example on replica 1, seeded noise, compiled"] = one_example(
        lambda *_: noised(*second), 1.0, 3, one=tf.function(step))

    # compiled fit, 9 examples in batches of 4: the last one's single
    # example leaves a replica an empty shard
    def fitted_nine(scope):
        with scope:
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
            model.compile(keras.optimizers.SGD(0.5), "mse")
            privacy.make_private(model, l2_norm_clip=0.5, noise_multiplier=0.0)
        x9, y9 = np.concatenate([x, x[:1]]), np.concatenate([y, y[:1]])
        model.fit(x9, y9, batch_size=4, shuffle=False, verbose=0)
        return [v.numpy() for v in model.trainable_variables]
    try:
        out["compiled fit, last batch of one"] = max(
            float(np.max(np.abs(a - c))) for a, c in zip(
                fitted_nine(strategy.scope()), fitted_nine(contextlib.nullcontext())))
    except Exception as e:
        out["compiled fit, last batch of one"] = {
            "error": type(e).__name__, "message": str(e)[:300]}

    # no example on either replica: one device's error for an empty batch,
    # raised by every replica after the collectives
    empty = [strategy.experimental_distribute_values_from_function(
        lambda ctx, k=k: tf.constant((x[:0], y[:0])[k])) for k in (0, 1)]
    for name, run in (("eager", eager), ("compiled", lambda *a: static(*a[:2]))):
        try:
            run(*empty, 0.0, None, None)
            out["no example, " + name] = "no error"
        except Exception as e:
            out["no example, " + name] = [
                type(e).__name__, isinstance(e, tf.errors.InvalidArgumentError),
                "a batch of no examples" in str(e)]

    print("RESULT" + json.dumps(out))
''')


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", CASES], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT")]
    assert run.returncode == 0 and lines, run.stdout + run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


def _check(case, devices=("CPU:0", "CPU:1")):
    if "error" in case:
        raise {"RuntimeError": RuntimeError}.get(case["error"], AssertionError)(
            f"{case['error']}: {case['message']}")
    # both replicas hold the result, equal to the one-device step
    assert case["devices"] == list(devices)
    assert case["scale"] > 0.01
    assert case["diff"] <= 1e-6 * case["scale"]


@pytest.mark.parametrize("name", ["noise 0", "microbatches", "seeded noise"])
def test_replicas_equal_the_one_device_step(results, name):
    """noise 0: the clipped sums are summed across replicas and divided by
    the global number of microbatches. Seeded noise: the same noise as on
    one device, so it is added once (twice would differ by a factor of
    sqrt(2) in its deviation, and between seeds)."""
    _check(results[name])


def test_uneven_replicas_divide_by_the_global_count(results):
    assert results["uneven"] < 1e-7
    assert results["uneven microbatches"] < 1e-7
    # (a float32 count rounded it to 3e-8)
    assert results["uneven float64"] < 1e-13


@pytest.mark.parametrize("name", [
    "one example", "one example, microbatches", "one example, compiled",
    "one example, compiled, batch unknown",
    "one example, compiled, batch unknown, microbatches",
    "one example on replica 1, seeded noise",
    "one example on replica 1, seeded noise, compiled"])
def test_one_example_over_two_replicas(results, name):
    """An empty shard adds zeros and no microbatch (it may be replica 0's,
    which still adds the noise once): the one-device step on the example,
    eagerly and traced."""
    case = results[name]
    _check(case, devices=case.get("devices", ()) if "compiled" in name
           else ("CPU:0", "CPU:1"))


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_no_example_on_any_replica(results, mode):
    assert results["no example, " + mode][1:] == [True, True], results[
        "no example, " + mode]


def test_compiled_fit_with_a_last_batch_of_one_on_two_replicas(results):
    case = results["compiled fit, last batch of one"]
    assert not isinstance(case, dict), case
    assert case < 1e-6


def test_make_private_fit_on_two_replicas(results):
    """Keras' optimizer sums the replicas' gradients: make_private gives it
    each replica's share of the whole batch's gradient."""
    assert results["fit"] < 1e-6


def test_tf_keras_make_private_fit_on_two_replicas(results):
    """tf_keras' compiled fit: the weights and the reported loss as on one
    device."""
    case = results["tf_keras fit"]
    assert case["diff"] < 1e-6
    assert case["loss"][0] == pytest.approx(case["loss"][1], rel=1e-5)


def test_unseeded_noise_is_the_same_on_every_replica(results):
    assert results["unseeded replicas agree"] is True


def test_replicas_in_tf_function(results):
    """The results sit where TF's own tape's do in the same compiled
    strategy.run (a tf.function returns them on its default device)."""
    case = results["compiled"]
    _check(case, devices=case.get("tf devices", ()))


def test_replicas_in_tf_function_with_the_batch_unknown_while_tracing(results):
    case = results["compiled, batch unknown"]
    _check(case, devices=results["compiled"].get("tf devices", ()))


def test_a_replica_id_unknown_while_tracing_is_refused():
    """Which replica adds the noise must be known while tracing: a guess
    would add it on none of them (no privacy) or on all."""
    import tensorflow as tf
    import fasttape
    from fasttape.backward import _dp_replicas

    class _Replica:   # a replica context whose id is a traced input
        num_replicas_in_sync = 2

        def __init__(self, replica_id):
            self.replica_id_in_sync_group = replica_id

    w = tf.Variable(tf.ones((3, 2)))

    @tf.function(input_signature=[tf.TensorSpec([], tf.int32)])
    def step(replica_id):
        with fasttape.GradientTape() as tape:
            losses = tf.reduce_sum(tf.matmul(tf.ones((4, 3)), w), axis=1)
        return _dp_replicas.dp_gradient(_Replica(replica_id), tape, losses, [w],
                                        1.0, 1.0, None, None)

    with pytest.raises(NotImplementedError, match="exactly one replica"):
        step(tf.constant(0))
