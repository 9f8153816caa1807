"""fasttape.privacy.make_private: Keras 3 `fit` trains with DP-SGD.

Each case fits a few steps and compares the weights with a hand-written DP
step: a loop of single-example tf.GradientTape gradients, clipped to the
global norm, summed, averaged, applied with the same optimizer.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from fasttape import privacy  # noqa: E402

CLIP = 0.3
BATCH = 8
STEPS = 3


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.out(self.hidden(x))


def _sequential():
    return keras.Sequential([keras.Input((6,)),
                             keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def _functional():
    # with a weight regularizer: added after clipping, as TF Privacy does
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(h))


def _subclassed():
    model = Subclassed()
    model(np.zeros((1, 6), "float32"))
    return model


def _sequence():
    # [B, 4, 6] -> [B, 4, 3]: a loss with a time axis, averaged per example
    return keras.Sequential([keras.Input((4, 6)), keras.layers.Dense(3)])


def _build(make):
    keras.utils.set_random_seed(1)
    return make()


def _data(make, n=BATCH * STEPS):
    rng = np.random.default_rng(0)
    if make is _sequence:
        return (rng.normal(size=(n, 4, 6)).astype("float32"),
                rng.normal(size=(n, 4, 3)).astype("float32"))
    return rng.normal(size=(n, 6)).astype("float32"), np.arange(n) % 3


def _loss(make, reduction="sum_over_batch_size"):
    if make is _sequence:
        return keras.losses.MeanSquaredError(reduction=reduction)
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=reduction)


def _reference(make, optimizer, sample_weight=None, microbatches=None,
               loss_weight=1.0, n=BATCH * STEPS):
    """Weights and per-step mean losses of the hand-written DP-SGD steps
    (n examples: a last batch of fewer than BATCH)."""
    model = _build(make)
    x, y = _data(make, n)
    loss_fn = _loss(make, reduction=None)
    step_losses = []
    for s in range(0, n, BATCH):
        rows = slice(s, s + BATCH)
        xb, yb = x[rows], y[rows]
        m = microbatches or len(xb)
        size = len(xb) // m
        wb = None if sample_weight is None else sample_weight[rows]
        total = [tf.zeros_like(v) for v in model.trainable_variables]
        losses = []
        for j in range(m):
            part = slice(j * size, (j + 1) * size)
            with tf.GradientTape() as tape:
                values = loss_fn(yb[part], model(xb[part], training=True))
                if wb is not None:   # a weight per example, over its positions
                    values *= tf.reshape(wb[part], [-1] + [1] * (
                        len(values.shape) - 1))
                if len(values.shape) > 1:
                    values = tf.reduce_mean(values, axis=1)
                values *= loss_weight
                loss = tf.reduce_mean(values)
            losses.append(values)
            grads = tape.gradient(loss, model.trainable_variables)
            grads, _ = tf.clip_by_global_norm(grads, CLIP)
            total = [t + g for t, g in zip(total, grads)]
        grads = [t / m for t in total]
        step_loss = float(tf.reduce_mean(tf.concat(losses, 0)))
        if model.losses:
            with tf.GradientTape() as tape:
                regularization = tf.add_n(model.losses)
            grads = [g if r is None else g + r for g, r in zip(
                grads, tape.gradient(regularization, model.trainable_variables))]
            step_loss += float(regularization)
        step_losses.append(step_loss)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return [v.numpy() for v in model.trainable_variables], step_losses


def _fit(make, optimizer, run_eagerly=True, sample_weight=None,
         loss_weights=None, jit_compile=False, n=BATCH * STEPS, **dp):
    model = _build(make)
    x, y = _data(make, n)
    model.compile(optimizer, _loss(make), run_eagerly=run_eagerly,
                  jit_compile=jit_compile, loss_weights=loss_weights,
                  metrics=[] if make is _sequence else ["accuracy"])
    privacy.make_private(model, l2_norm_clip=CLIP, **dict(
        dict(noise_multiplier=0.0), **dp))
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=BATCH,
                        epochs=1, shuffle=False, verbose=0)
    return model, history.history


def _assert_same(model, want):
    got = [v.numpy() for v in model.trainable_variables]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("make", [_sequential, _functional, _subclassed])
def test_fit_equals_the_reference_dp_step(make):
    model, history = _fit(make, keras.optimizers.Adam(0.05))
    want, step_losses = _reference(make, keras.optimizers.Adam(0.05))
    _assert_same(model, want)
    # the loss and the metric, reported as Keras reports them
    assert history["loss"][0] == pytest.approx(np.mean(step_losses), rel=1e-5)
    assert 0 <= history["accuracy"][0] <= 1
    # clipping mattered: a plain step moves the weights elsewhere
    plain = _build(make)
    plain.compile(keras.optimizers.Adam(0.05), _loss(make), run_eagerly=True)
    plain.fit(*_data(make), batch_size=BATCH, shuffle=False, verbose=0)
    assert not np.allclose(plain.trainable_variables[0].numpy(), want[0],
                           atol=1e-3)


def test_sample_weight_and_a_time_axis():
    # [B, 1]: Keras' loss multiplies [B, T] values by it ([B] would not
    # broadcast, in Keras' plain step either)
    weights = np.linspace(0.2, 2.0, BATCH * STEPS).astype("float32")[:, None]
    model, history = _fit(_sequence, keras.optimizers.SGD(0.5),
                          sample_weight=weights)
    want, step_losses = _reference(_sequence, keras.optimizers.SGD(0.5),
                                   sample_weight=weights)
    _assert_same(model, want)
    assert history["loss"][0] == pytest.approx(np.mean(step_losses), rel=1e-5)


def test_microbatches_and_loss_weights():
    model, _ = _fit(_sequential, keras.optimizers.SGD(0.5), num_microbatches=4,
                    loss_weights=0.05)
    want, _ = _reference(_sequential, keras.optimizers.SGD(0.5), microbatches=4,
                         loss_weight=0.05)
    _assert_same(model, want)


@pytest.mark.parametrize("mode", ["eager", "compiled", "jit"])
def test_microbatches_with_a_smaller_last_batch(mode):
    """Batches of 8, 8 and 4 in 4 microbatches: compiled, fit traces its
    step with the batch unknown, and each batch's microbatches are cut at
    run time, as eagerly."""
    model, _ = _fit(_sequential, keras.optimizers.SGD(0.5), num_microbatches=4,
                    run_eagerly=mode == "eager", jit_compile=mode == "jit",
                    n=2 * BATCH + 4)
    want, _ = _reference(_sequential, keras.optimizers.SGD(0.5), microbatches=4,
                         n=2 * BATCH + 4)
    _assert_same(model, want)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_last_batch_the_microbatches_do_not_divide(mode):
    """Batches of 8, 8 and 3 in 2 microbatches: TF's InvalidArgumentError
    at the last batch, eagerly (also a ValueError) and compiled alike."""
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"num_microbatches \(2\) must divide the batch size"):
        _fit(_sequential, keras.optimizers.SGD(0.5), num_microbatches=2,
             run_eagerly=mode == "eager", n=2 * BATCH + 3)


def test_seeded_noise_repeats_and_differs_step_to_step():
    def weights(seed):
        model, _ = _fit(_sequential, keras.optimizers.SGD(0.5),
                        noise_multiplier=1.0, seed=seed)
        return [v.numpy() for v in model.trainable_variables]

    first, again, other = weights(5), weights(5), weights(6)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(first[0], other[0])
    # A kernel whose gradient is 0 (its input is 0): it moves by the noise
    # alone, new noise at each step (the same seed for every step would
    # move it by one vector, three times).
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(1, use_bias=False,
                                                 kernel_initializer="zeros")])
    model.compile(keras.optimizers.SGD(1.0), "mse", run_eagerly=True)
    privacy.make_private(model, l2_norm_clip=CLIP, noise_multiplier=1.0, seed=3)
    kernels = []
    for _ in range(3):
        model.fit(np.zeros((BATCH, 6), "float32"), np.zeros((BATCH, 1), "float32"),
                  batch_size=BATCH, verbose=0)
        kernels.append(model.trainable_variables[0].numpy().ravel())
    steps = np.diff([np.zeros(6)] + kernels, axis=0)
    assert not np.allclose(steps[0], steps[1])
    assert not np.allclose(steps[1], steps[2])
    # noise of standard deviation CLIP * noise_multiplier / BATCH
    assert 0.3 < np.std(steps) / (CLIP / BATCH) < 3


@pytest.mark.parametrize("make", [_sequential, _functional, _subclassed])
def test_compiled_fit_equals_the_reference_dp_step(make):
    model, _ = _fit(make, keras.optimizers.Adam(0.05), run_eagerly=False)
    want, _ = _reference(make, keras.optimizers.Adam(0.05))
    _assert_same(model, want)


@pytest.mark.parametrize("regularizer", [None, "l2"])
def test_compiled_fit_of_a_table_without_noise_equals_eager(regularizer):
    """Without noise the compiled step's table gradient is IndexedSlices
    (as the plain step's; a regularizer's gradient added to it densely):
    the weights trained equal the eager step's."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 20, (2 * BATCH, 5)).astype("int32")
    y = np.arange(2 * BATCH) % 3
    trained = []
    for eager in (True, False):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(20, 4, embeddings_regularizer=regularizer),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.5), _loss(_sequential),
                      run_eagerly=eager)
        privacy.make_private(model, l2_norm_clip=0.05, noise_multiplier=0.0)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        trained.append(model.get_weights())
    for a, b in zip(*trained):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_fit_seeded_noise_repeats():
    def weights(seed):
        model, _ = _fit(_sequential, keras.optimizers.SGD(0.5),
                        run_eagerly=False, noise_multiplier=1.0, seed=seed)
        return [v.numpy() for v in model.trainable_variables]

    for a, b in zip(weights(5), weights(5)):
        np.testing.assert_array_equal(a, b)


def test_bad_arguments():
    model = _sequential()
    with pytest.raises(ValueError, match="l2_norm_clip"):
        privacy.make_private(model, l2_norm_clip=0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        privacy.make_private(model, l2_norm_clip=1.0, noise_multiplier=-1)
    with pytest.raises(ValueError, match="num_microbatches"):
        privacy.make_private(model, l2_norm_clip=1.0, noise_multiplier=1,
                             num_microbatches=0)
    with pytest.raises(TypeError, match="Keras 3"):
        privacy.make_private(keras.layers.Dense(3), l2_norm_clip=1.0,
                             noise_multiplier=1.0)
    # a batch the microbatches do not divide: dp_gradient's ValueError
    model.compile("sgd", "mse", run_eagerly=True)
    privacy.make_private(model, l2_norm_clip=1.0, noise_multiplier=0.0,
                         num_microbatches=3)
    with pytest.raises(ValueError, match="num_microbatches"):
        model.fit(np.zeros((8, 6), "float32"), np.zeros((8, 3), "float32"),
                  batch_size=8, verbose=0)


def test_compile_after_and_a_step_built_before():
    """make_private before compile, and on a model whose plain train step
    was built by an earlier fit: both take DP steps (with SGD(1.0), a step
    moves the weights by at most l2_norm_clip, noise 0)."""
    x, y = _data(_sequential)

    def moved(model):
        before = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
        after = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
        return np.linalg.norm(after - before)

    loss = _loss(_sequential)
    early = privacy.make_private(_build(_sequential), l2_norm_clip=1e-3,
                                 noise_multiplier=0.0)
    early.compile(keras.optimizers.SGD(1.0), loss, run_eagerly=True)
    late = _build(_sequential)
    late.compile(keras.optimizers.SGD(1.0), loss, run_eagerly=True)
    assert moved(late) > 1e-2                        # the plain step
    privacy.make_private(late, l2_norm_clip=1e-3, noise_multiplier=0.0)
    for model in (early, late):
        assert 1e-4 < moved(model) <= 1e-3 * (1 + 1e-5)


def test_tf_keras_fit_equals_the_reference_dp_step():
    """tf_keras (Keras 2) models too: its own losses, unreduced; its loss
    metric as tf_keras reports it."""
    import tf_keras

    def build():
        tf_keras.utils.set_random_seed(1)
        return tf_keras.Sequential([
            tf_keras.layers.Dense(8, activation="tanh", input_shape=(6,),
                                  kernel_regularizer=tf_keras.regularizers.L2(0.01)),
            tf_keras.layers.Dense(3)])

    x, y = _data(_sequential)
    weights = np.linspace(0.01, 0.3, len(x)).astype("float32")   # some unclipped
    model = build()
    model.compile(tf_keras.optimizers.SGD(0.5),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], run_eagerly=True)
    privacy.make_private(model, l2_norm_clip=CLIP, noise_multiplier=0.0)
    history = model.fit(x, y, sample_weight=weights, batch_size=BATCH,
                        shuffle=False, verbose=0).history

    ref = build()
    optimizer = tf_keras.optimizers.SGD(0.5)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none")
    for s in range(STEPS):
        total = [tf.zeros_like(v) for v in ref.trainable_variables]
        for i in range(s * BATCH, (s + 1) * BATCH):
            with tf.GradientTape() as tape:
                loss = loss_fn(y[i:i + 1], ref(x[i:i + 1], training=True))[0] * weights[i]
            grads, _ = tf.clip_by_global_norm(
                tape.gradient(loss, ref.trainable_variables), CLIP)
            total = [t + g for t, g in zip(total, grads)]
        with tf.GradientTape() as tape:
            regularization = tf.add_n(ref.losses)
        reg = tape.gradient(regularization, ref.trainable_variables)
        optimizer.apply_gradients(zip(
            [t / BATCH if r is None else t / BATCH + r for t, r in zip(total, reg)],
            ref.trainable_variables))
    for a, b in zip(model.trainable_variables, ref.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-5, atol=2e-6)
    assert set(history) == {"loss", "accuracy"} and history["loss"][0] > 0


def test_tf_keras_compiled_fit_microbatches_with_a_smaller_last_batch():
    """tf_keras traces its step with the batch unknown after the first
    batch's size changes: the microbatches cut at run time."""
    import tf_keras
    model = tf_keras.Sequential([
        tf_keras.layers.Dense(8, activation="tanh", input_shape=(6,)),
        tf_keras.layers.Dense(3)])
    model.set_weights(_build(_sequential).get_weights())
    model.compile(tf_keras.optimizers.SGD(0.5),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    privacy.make_private(model, l2_norm_clip=CLIP, noise_multiplier=0.0,
                         num_microbatches=4)
    model.fit(*_data(_sequential, 2 * BATCH + 4), batch_size=BATCH,
              shuffle=False, verbose=0)
    want, _ = _reference(_sequential, keras.optimizers.SGD(0.5), microbatches=4,
                         n=2 * BATCH + 4)
    _assert_same(model, want)


@pytest.mark.parametrize("run_eagerly", [True, False])
def test_a_batch_normalization_on_the_input_is_refused(run_eagerly):
    """BatchNormalization in training mode normalizes by the batch's
    statistics, so each example's gradient depends on the others and
    clipping bounds no example's share. Placed on the input, before any
    weight, its statistics are ops the tape never records (dp_gradient
    cannot see them): make_private refuses the layer. Frozen, Keras
    normalizes by its moving statistics, and the model trains."""
    x, y = _data(_sequential)

    def model(trainable):
        bn = keras.layers.BatchNormalization(name="input_norm")
        bn.trainable = trainable
        m = keras.Sequential([keras.Input((6,)), bn, keras.layers.Dense(3)])
        m.compile("sgd", _loss(_sequential), run_eagerly=run_eagerly)
        return privacy.make_private(m, l2_norm_clip=1.0, noise_multiplier=0.0)

    with pytest.raises(ValueError, match="'input_norm'.*BatchNormalization"):
        model(True).fit(x, y, batch_size=BATCH, verbose=0)
    frozen = model(False)
    moving = [v.numpy() for v in frozen.layers[0].non_trainable_weights]
    kernel = frozen.layers[1].kernel.numpy()
    frozen.fit(x, y, batch_size=BATCH, verbose=0)
    assert not np.allclose(frozen.layers[1].kernel.numpy(), kernel)
    for before, v in zip(moving, frozen.layers[0].non_trainable_weights):
        np.testing.assert_array_equal(before, v.numpy())


def test_a_tf_keras_batch_normalization_is_refused():
    import tf_keras
    m = tf_keras.Sequential([tf_keras.layers.BatchNormalization(input_shape=(6,)),
                             tf_keras.layers.Dense(3)])
    m.compile("sgd", "mse", run_eagerly=True)
    privacy.make_private(m, l2_norm_clip=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match="BatchNormalization"):
        m.fit(np.zeros((8, 6), "float32"), np.zeros((8, 3), "float32"),
              batch_size=8, verbose=0)
