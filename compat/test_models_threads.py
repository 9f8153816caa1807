"""Threads: several threads each train their own small model, each with its
own fasttape tape, at the same time; the results must equal the same runs
done one after another with tf.GradientTape.

Barriers inside the ``with tape:`` block make every thread's tape record
while all the others are recording too, so a tape stack or op callback
shared across threads (instead of per thread) shows up as wrong gradients,
foreign watched variables or an exception.
"""

import threading

import numpy as np
import pytest
import tensorflow as tf
import keras
import tf_keras as keras2

import fasttape

# Held in a dict: patch() swaps module attributes, so a module-level
# ``TF_TAPE = tf.GradientTape`` in this module would be swapped as well.
_TF = {"GradientTape": tf.GradientTape}
assert _TF["GradientTape"].__module__ == "tensorflow.python.eager.backprop"

N_THREADS = 3
STEPS = 4
RTOL, ATOL = 1e-5, 1e-6


def _data(i):
    rs = np.random.RandomState(100 + i)
    x = rs.randn(6, 4).astype("float32")
    y = (np.cos(x).sum(axis=1, keepdims=True) * (i + 1)).astype("float32")
    return tf.constant(x), tf.constant(y)


def _sync(barrier):
    if barrier is not None:
        barrier.wait()


def _run_threads(work, n=N_THREADS):
    """Run work(i, barrier) in n threads at once; return results in order."""
    barrier = threading.Barrier(n, timeout=60)
    results, errors = [None] * n, [None] * n

    def target(i):
        try:
            results[i] = work(i, barrier)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[i] = exc
            barrier.abort()

    threads = [threading.Thread(target=target, args=(i,), name=f"train-{i}")
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a training thread hung"
    for i, exc in enumerate(errors):
        if exc is not None and not isinstance(exc, threading.BrokenBarrierError):
            raise AssertionError(f"thread {i} raised {exc!r}") from exc
    for i, exc in enumerate(errors):
        if exc is not None:
            raise AssertionError(f"thread {i} raised {exc!r}") from exc
    return results


def _compare(expected, actual):
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual)):
        np.testing.assert_allclose(a["losses"], e["losses"], rtol=RTOL,
                                   atol=ATOL, err_msg=f"thread {i} losses")
        assert len(a["weights"]) == len(e["weights"])
        for j, (aw, ew) in enumerate(zip(a["weights"], e["weights"])):
            np.testing.assert_allclose(aw, ew, rtol=RTOL, atol=ATOL,
                                       err_msg=f"thread {i} weight {j}")


# -- raw variables, hand-written momentum SGD -------------------------------------

def _raw_params(i):
    rs = np.random.RandomState(i)
    return [tf.Variable(rs.randn(4, 6).astype("float32") * 0.5, name=f"w1_{i}"),
            tf.Variable(np.full((6,), 0.1, "float32"), name=f"b1_{i}"),
            tf.Variable(rs.randn(6, 1).astype("float32") * 0.5, name=f"w2_{i}")]


def _train_raw(GradientTape, i, barrier):
    params = _raw_params(i)
    velocity = [tf.Variable(tf.zeros_like(p)) for p in params]
    x, y = _data(i)
    w1, b1, w2 = params
    losses = []
    for _ in range(STEPS):
        with GradientTape() as tape:
            h = tf.tanh(tf.matmul(x, w1) + b1)
            _sync(barrier)          # every thread's tape is recording now
            pred = tf.matmul(h, w2)
            _sync(barrier)
            loss = tf.reduce_mean(tf.square(pred - y))
        watched = tape.watched_variables()
        assert {id(v) for v in watched} == {id(p) for p in params}, (
            f"thread {i} tape watched {[v.name for v in watched]}")
        grads = tape.gradient(loss, params)
        for p, v, g in zip(params, velocity, grads):
            v.assign(0.9 * v + g)
            p.assign_sub(0.05 * v)
        losses.append(float(loss))
    return {"losses": losses, "weights": [p.numpy() for p in params],
            "tape": type(tape)}


def test_threads_raw_variables_fasttape_vs_sequential_tf():
    expected = [_train_raw(_TF["GradientTape"], i, None) for i in range(N_THREADS)]
    actual = _run_threads(
        lambda i, barrier: _train_raw(fasttape.GradientTape, i, barrier))
    assert all(r["tape"] is fasttape.GradientTape for r in actual)
    _compare(expected, actual)


# -- Keras models in threads, under fasttape.patched() -------------------------------

def _build(lib, i):
    """Model + optimizer for thread i (built in the main thread)."""
    if lib == "tf_keras":
        keras2.utils.set_random_seed(i)
        glorot = keras2.initializers.GlorotUniform
        model = keras2.Sequential([
            keras2.layers.Dense(6, activation="tanh", input_shape=(4,),
                                kernel_initializer=glorot(10 + i)),
            keras2.layers.Dense(1, kernel_initializer=glorot(20 + i))])
        optimizer = keras2.optimizers.Adam(0.05)
        optimizer.build(model.trainable_variables)
        sources = model.trainable_variables
    else:
        keras.utils.set_random_seed(i)
        glorot = keras.initializers.GlorotUniform
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(6, activation="tanh", kernel_initializer=glorot(10 + i)),
            keras.layers.Dense(1, kernel_initializer=glorot(20 + i))])
        optimizer = keras.optimizers.Adam(0.05)
        optimizer.build(model.trainable_variables)
        sources = model.trainable_variables  # keras.Variables
    return model, optimizer, sources


def _train_keras(built, i, barrier):
    model, optimizer, sources = built
    x, y = _data(i)
    losses = []
    for _ in range(STEPS):
        with tf.GradientTape() as tape:   # whatever tf.GradientTape is now
            h = model.layers[0](x, training=True)
            _sync(barrier)
            pred = model.layers[1](h, training=True)
            _sync(barrier)
            loss = tf.reduce_mean(tf.square(pred - y))
        grads = tape.gradient(loss, sources)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    weights = [w.value if isinstance(w, keras.Variable) else w
               for w in model.weights]
    return {"losses": losses, "weights": [w.numpy() for w in weights],
            "tape": type(tape)}


@pytest.mark.parametrize("lib", ["tf_keras", "keras3"])
def test_threads_keras_models_under_patch_vs_sequential_tf(lib):
    assert tf.GradientTape is _TF["GradientTape"]
    expected = [_train_keras(_build(lib, i), i, None) for i in range(N_THREADS)]
    assert all(r["tape"] is _TF["GradientTape"] for r in expected)
    built = [_build(lib, i) for i in range(N_THREADS)]
    with fasttape.patched():
        actual = _run_threads(lambda i, barrier: _train_keras(built[i], i, barrier))
    assert tf.GradientTape is _TF["GradientTape"]
    assert all(r["tape"] is fasttape.GradientTape for r in actual)
    _compare(expected, actual)


def test_threads_tape_in_tf_function_concurrently():
    """Each thread traces and runs its own @tf.function step with a fasttape
    tape inside, concurrently."""

    def train(GradientTape, i, barrier):
        params = _raw_params(i)
        x, y = _data(i)

        @tf.function
        def step():
            with GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(
                    tf.matmul(tf.tanh(tf.matmul(x, params[0]) + params[1]),
                              params[2]) - y))
            grads = tape.gradient(loss, params)
            for p, g in zip(params, grads):
                p.assign_sub(0.1 * g)
            return loss

        losses = []
        for _ in range(STEPS):
            _sync(barrier)
            losses.append(float(step()))
        return {"losses": losses, "weights": [p.numpy() for p in params]}

    expected = [train(_TF["GradientTape"], i, None) for i in range(N_THREADS)]
    actual = _run_threads(lambda i, barrier: train(fasttape.GradientTape, i, barrier))
    _compare(expected, actual)
