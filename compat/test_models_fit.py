"""model.fit parity under ``fasttape.patched()`` (Keras 3 and tf_keras).

Each test trains the same model (identical, seeded initial weights and data,
no shuffling) twice: once unpatched with TF's tape, once inside
``fasttape.patched()``, eagerly (run_eagerly=True) and through the compiled
train_function (run_eagerly=False, tf.function, no XLA). It compares the
per-batch losses and all final weights (optimizer slots excluded, BN moving
statistics included), and counts tape constructions / gradient calls on both
classes to prove that the patched run really went through fasttape (and the
reference run through TF).
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
import keras
import tf_keras as keras2

import fasttape
import fasttape.tape as fasttape_tape

# Held in a dict: patch() swaps module attributes, so a module-level
# ``TF_TAPE = tf.GradientTape`` in this module would be swapped as well.
_TF = {"GradientTape": tf.GradientTape}
assert _TF["GradientTape"].__module__ == "tensorflow.python.eager.backprop"

RTOL, ATOL = 1e-5, 1e-6
STEPS = 4  # 8 samples, batch 4, 2 epochs


# -- proof of use ---------------------------------------------------------------

@pytest.fixture
def counts(monkeypatch):
    """Count tapes built / gradients taken on fasttape's class and on TF's."""
    c = {"fasttape_init": 0, "fasttape_gradient": 0, "tf_init": 0,
         "tf_gradient": 0}

    def counting(cls, name, key):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            c[key] += 1
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, wrapper)

    counting(fasttape_tape.GradientTape, "__init__", "fasttape_init")
    counting(fasttape_tape.GradientTape, "gradient", "fasttape_gradient")
    counting(_TF["GradientTape"], "__init__", "tf_init")
    counting(_TF["GradientTape"], "gradient", "tf_gradient")
    return c


def _run_both(counts, fit, trainer_module):
    """fit() unpatched (reference) then patched; returns both results."""
    assert tf.GradientTape is _TF["GradientTape"]
    expected = fit()
    assert counts["tf_gradient"] > 0, counts
    assert counts["fasttape_init"] == 0 and counts["fasttape_gradient"] == 0, counts

    for k in counts:
        counts[k] = 0
    with fasttape.patched():
        assert fasttape.is_patched()
        assert tf.GradientTape is fasttape.GradientTape
        # The name the trainer actually resolves at call time:
        assert trainer_module.tf.GradientTape is fasttape.GradientTape
        actual = fit()
    assert not fasttape.is_patched()
    assert tf.GradientTape is _TF["GradientTape"]
    assert trainer_module.tf.GradientTape is _TF["GradientTape"]
    assert counts["fasttape_init"] > 0 and counts["fasttape_gradient"] > 0, counts
    assert counts["tf_init"] == 0 and counts["tf_gradient"] == 0, counts
    return expected, actual


def _compare(expected, actual, rtol=RTOL, atol=ATOL, n_logged=STEPS):
    e_losses, e_weights = expected
    a_losses, a_weights = actual
    assert len(e_losses) == n_logged, e_losses
    assert np.all(np.isfinite(e_losses))
    np.testing.assert_allclose(a_losses, e_losses, rtol=rtol, atol=atol,
                               err_msg="per-step losses")
    assert len(a_weights) == len(e_weights)
    for i, (a, e) in enumerate(zip(a_weights, e_weights)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol,
                                   err_msg=f"weight {i}")


def _tolerance(kind):
    # float16 compute: allow for a different (but valid) summation order.
    return dict(rtol=1e-3, atol=1e-4) if kind == "mlp_mixed16" else {}


@contextlib.contextmanager
def _policy(lib, kind):
    """mixed_float16 for kind "mlp_mixed16" (Keras' LossScaleOptimizer and,
    in tf_keras, AutoCastVariable), float32 otherwise."""
    if kind != "mlp_mixed16":
        yield
        return
    lib.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        lib.mixed_precision.set_global_policy("float32")


# -- data -------------------------------------------------------------------------

def _dense_data():
    rs = np.random.RandomState(0)
    x = rs.randn(8, 4).astype("float32")
    y = (np.sin(x).sum(axis=1, keepdims=True)).astype("float32")
    return x, y


def _ids_data():
    rs = np.random.RandomState(1)
    return (rs.randint(0, 6, size=(8, 4)).astype("int32"),
            rs.randn(8, 1).astype("float32"))


def _image_data():
    rs = np.random.RandomState(2)
    return (rs.randn(8, 6, 6, 2).astype("float32"),
            rs.randn(8, 1).astype("float32"))


DATA = {"mlp": _dense_data, "mlp_mixed16": _dense_data,
        "embedding": _ids_data, "cnn_bn": _image_data}


# -- Keras 3 ------------------------------------------------------------------------

def _keras3_model(kind):
    keras.utils.set_random_seed(42)
    glorot = keras.initializers.GlorotUniform
    if kind in ("mlp", "mlp_mixed16"):
        layers = [keras.Input((4,)),
                  keras.layers.Dense(8, activation="tanh", kernel_initializer=glorot(1),
                                     bias_initializer=keras.initializers.Constant(0.1)),
                  keras.layers.Dense(1, kernel_initializer=glorot(2), dtype="float32")]
    elif kind == "embedding":
        layers = [keras.Input((4,), dtype="int32"),
                  keras.layers.Embedding(6, 3, embeddings_initializer=glorot(3)),
                  keras.layers.GlobalAveragePooling1D(),
                  keras.layers.Dense(1, kernel_initializer=glorot(4))]
    else:
        layers = [keras.Input((6, 6, 2)),
                  keras.layers.Conv2D(3, 3, padding="same", kernel_initializer=glorot(5)),
                  keras.layers.MaxPooling2D(2),
                  keras.layers.BatchNormalization(momentum=0.5),
                  keras.layers.Activation("relu"),
                  keras.layers.Flatten(),
                  keras.layers.Dense(1, kernel_initializer=glorot(6))]
    return keras.Sequential(layers)


def _keras3_fit(kind, run_eagerly, steps_per_execution=1):
    def fit():
        with _policy(keras, kind):
            return _fit(kind, run_eagerly)

    def _fit(kind, run_eagerly):
        x, y = DATA[kind]()
        model = _keras3_model(kind)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss="mse", run_eagerly=run_eagerly, jit_compile=False,
                      steps_per_execution=steps_per_execution)
        losses = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                  callbacks=[record])
        return losses, [w.value.numpy() for w in model.weights]
    return fit


@pytest.mark.parametrize("kind", ["mlp", "mlp_mixed16", "embedding", "cnn_bn"])
@pytest.mark.parametrize("run_eagerly", [True, False], ids=["eager", "compiled"])
def test_keras3_fit(counts, kind, run_eagerly):
    """Keras 3's train_step: tape.gradient(loss, trainable_variables) with
    keras.Variable sources (under mixed_float16 with LossScaleOptimizer)."""
    import keras.src.backend.tensorflow.trainer as trainer
    expected, actual = _run_both(counts, _keras3_fit(kind, run_eagerly), trainer)
    _compare(expected, actual, **_tolerance(kind))


# -- tf_keras ------------------------------------------------------------------------

def _keras2_model(kind):
    keras2.utils.set_random_seed(42)
    glorot = keras2.initializers.GlorotUniform
    if kind in ("mlp", "mlp_mixed16"):
        layers = [keras2.layers.Dense(8, activation="tanh", input_shape=(4,),
                                      kernel_initializer=glorot(1),
                                      bias_initializer=keras2.initializers.Constant(0.1)),
                  keras2.layers.Dense(1, kernel_initializer=glorot(2), dtype="float32")]
    elif kind == "embedding":
        layers = [keras2.layers.Embedding(6, 3, input_length=4,
                                          embeddings_initializer=glorot(3)),
                  keras2.layers.GlobalAveragePooling1D(),
                  keras2.layers.Dense(1, kernel_initializer=glorot(4))]
    else:  # fused BatchNormalization (FusedBatchNormV3) on a 4-D input
        layers = [keras2.layers.Conv2D(3, 3, padding="same", input_shape=(6, 6, 2),
                                       kernel_initializer=glorot(5)),
                  keras2.layers.MaxPooling2D(2),
                  keras2.layers.BatchNormalization(momentum=0.5),
                  keras2.layers.Activation("relu"),
                  keras2.layers.Flatten(),
                  keras2.layers.Dense(1, kernel_initializer=glorot(6))]
    return keras2.Sequential(layers)


def _keras2_fit(kind, run_eagerly, steps_per_execution=1):
    def fit():
        with _policy(keras2, kind):
            return _fit(kind, run_eagerly)

    def _fit(kind, run_eagerly):
        x, y = DATA[kind]()
        model = _keras2_model(kind)
        model.compile(optimizer=keras2.optimizers.SGD(0.05, momentum=0.9),
                      loss="mse", run_eagerly=run_eagerly,
                      steps_per_execution=steps_per_execution)
        losses = []
        record = keras2.callbacks.LambdaCallback(
            on_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                  callbacks=[record])
        return losses, [w.numpy() for w in model.weights]
    return fit


@pytest.mark.parametrize("kind", ["mlp", "mlp_mixed16", "embedding", "cnn_bn"])
@pytest.mark.parametrize("run_eagerly", [True, False], ids=["eager", "compiled"])
def test_tf_keras_fit(counts, kind, run_eagerly):
    """tf_keras' train_step: optimizer.minimize(loss, vars, tape=tape); under
    mixed_float16 the variables are AutoCastVariables."""
    import tf_keras.src.engine.training as trainer
    expected, actual = _run_both(counts, _keras2_fit(kind, run_eagerly), trainer)
    _compare(expected, actual, **_tolerance(kind))


@pytest.mark.parametrize("lib", ["tf_keras", "keras3"])
def test_fit_compiled_steps_per_execution(counts, lib):
    """steps_per_execution=2: the tape is built inside the body of a
    tf.while_loop of the compiled train function."""
    if lib == "keras3":
        import keras.src.backend.tensorflow.trainer as trainer
        fit = _keras3_fit("mlp", False, steps_per_execution=2)
    else:
        import tf_keras.src.engine.training as trainer
        fit = _keras2_fit("mlp", False, steps_per_execution=2)
    expected, actual = _run_both(counts, fit, trainer)
    _compare(expected, actual, n_logged=STEPS // 2)

