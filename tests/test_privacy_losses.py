"""make_private's losses: several outputs, masks, and what it refuses.

Each fit is compared with a hand-written DP step (noise 0): example i's
loss written out by hand, its gradient by tf.GradientTape on that example
alone, clipped to the global norm, summed, averaged, applied with the same
optimizer.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from fasttape import privacy  # noqa: E402

CLIP = 0.2
# Clipping norms between the examples' gradient norms (some clipped, some
# not: a loss off by a factor for every example changes the step)
OUTPUTS_CLIP = 6.0
TOKENS_CLIP = 0.6
BATCH = 6
STEPS = 2
LOSS_WEIGHTS = {"cls": 0.3, "reg": 2.0}


def _reference(model, optimizer, x, y, loss_of, clip):
    """The hand-written DP-SGD steps: loss_of(model, rows) is the loss of
    the example in `rows` (a slice of one)."""
    for s in range(STEPS):
        total = [tf.zeros_like(v) for v in model.trainable_variables]
        for i in range(s * BATCH, (s + 1) * BATCH):
            with tf.GradientTape() as tape:
                loss = loss_of(model, slice(i, i + 1))
            # dense: the global norm of an embedding's IndexedSlices counts
            # a repeated id's rows apart
            grads, _ = tf.clip_by_global_norm(
                [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(tape.gradient(loss, model.trainable_variables),
                                 model.trainable_variables)], clip)
            total = [t + g for t, g in zip(total, grads)]
        optimizer.apply_gradients(zip([t / BATCH for t in total],
                                      model.trainable_variables))
    return [v.numpy() for v in model.trainable_variables]


def _assert_same(model, want):
    got = [v.numpy() for v in model.trainable_variables]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


def _fit(model, x, y, sample_weight=None, clip=CLIP):
    privacy.make_private(model, l2_norm_clip=clip, noise_multiplier=0.0)
    return model.fit(x, y, sample_weight=sample_weight, batch_size=BATCH,
                     shuffle=False, verbose=0).history


# -- several outputs ----------------------------------------------------------

def _two_outputs(k, as_dict):
    """x [n, 5] -> a classifier's logits [n, 3] ("cls") and a regression
    [n, 2] ("reg"), in a list or a dict (keys not in the outputs' order)."""
    k.utils.set_random_seed(1)
    inputs = k.Input((5,))
    h = k.layers.Dense(6, activation="tanh")(inputs)
    cls = k.layers.Dense(3, name="cls")(h)
    reg = k.layers.Dense(2, name="reg")(h)
    return k.Model(inputs, {"reg": reg, "cls": cls} if as_dict else [cls, reg])


def _two_output_data():
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    return (rng.normal(size=(n, 5)).astype("float32"), np.arange(n) % 3,
            rng.normal(size=(n, 2)).astype("float32"))


def _two_output_loss(k, losses):
    """Example i's loss, by hand: each output's loss on it times its weight."""
    x, y_cls, y_reg = _two_output_data()

    def loss_of(model, rows):
        out = model(x[rows], training=True)
        cls, reg = (out["cls"], out["reg"]) if isinstance(out, dict) else out
        total = 0.0
        if "cls" in losses:
            total += LOSS_WEIGHTS["cls"] * k.losses.sparse_categorical_crossentropy(
                y_cls[rows], cls, from_logits=True)[0]
        if "reg" in losses:
            total += LOSS_WEIGHTS["reg"] * tf.reduce_mean((reg - y_reg[rows]) ** 2)
        return total

    return loss_of


@pytest.mark.filterwarnings("ignore:Gradients do not exist")  # (no loss on "cls")
@pytest.mark.parametrize("framework, structure, losses, run_eagerly", [
    ("keras", "list", ("cls", "reg"), True),
    ("keras", "list", ("cls", "reg"), False),
    ("keras", "dict", ("cls", "reg"), True),
    ("keras", "dict", ("reg",), True),          # an output with no loss
    ("tf_keras", "list", ("cls", "reg"), True),
    ("tf_keras", "list", ("cls", "reg"), False),
    ("tf_keras", "dict", ("cls", "reg"), True),
    ("tf_keras", "dict", ("reg",), True),
])
def test_several_outputs(framework, structure, losses, run_eagerly):
    """Each example's loss is the weighted sum of its outputs' losses, as
    Keras combines them; Keras reports each output's loss."""
    import tf_keras
    k = keras if framework == "keras" else tf_keras
    as_dict = structure == "dict"
    x, y_cls, y_reg = _two_output_data()
    fns = {"cls": k.losses.SparseCategoricalCrossentropy(from_logits=True),
           "reg": k.losses.MeanSquaredError()}
    if as_dict:
        loss = {name: fns[name] for name in losses}
        weights = {name: LOSS_WEIGHTS[name] for name in losses}
        # (Keras 3 takes the targets of the outputs with a loss; tf_keras all)
        y = {name: {"cls": y_cls, "reg": y_reg}[name]
             for name in (losses if k is keras else ("cls", "reg"))}
    else:
        loss = [fns["cls"], fns["reg"]]
        weights = [LOSS_WEIGHTS["cls"], LOSS_WEIGHTS["reg"]]
        y = [y_cls, y_reg]
    model = _two_outputs(k, as_dict)
    model.compile(k.optimizers.SGD(0.05), loss, loss_weights=weights,
                  run_eagerly=run_eagerly)
    history = _fit(model, x, y, clip=OUTPUTS_CLIP)
    want = _reference(_two_outputs(k, as_dict), k.optimizers.SGD(0.05),
                      x, y, _two_output_loss(k, losses), OUTPUTS_CLIP)
    _assert_same(model, want)
    if len(losses) > 1:
        assert {"loss", "cls_loss", "reg_loss"} <= set(history)


# -- masks and weights along time ---------------------------------------------

def _tokens():
    """Ids [n, 5] with 0 (masked) at the end of most rows: each example has
    its own number of valid positions (one has none)."""
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    x = rng.integers(1, 10, size=(n, 5)).astype("int32")
    for i, valid in enumerate([5, 2, 1, 0, 3, 4] * STEPS):
        x[i, valid:] = 0
    y = rng.integers(0, 3, size=(n, 5)).astype("int32")
    return x, y


def _tagger(k):
    """Embedding(mask_zero=True) and a Dense per position: the mask reaches
    the loss."""
    k.utils.set_random_seed(1)
    inputs = k.Input((5,), dtype="int32")
    h = k.layers.Embedding(10, 4, mask_zero=True)(inputs)
    return k.Model(inputs, k.layers.Dense(3)(h))


@pytest.mark.parametrize("framework, mode, run_eagerly", [
    ("keras", "mask", True), ("keras", "mask", False), ("keras", "weights", True),
    ("keras", "ignore_class", True),
    ("tf_keras", "mask", True), ("tf_keras", "weights", True)])
def test_masked_and_time_weighted_losses(framework, mode, run_eagerly):
    """A masked example's loss is the mean over its own valid positions
    (Keras' loss averages over the batch's valid positions, which would tie
    each example's loss to the others'): a mask from Embedding(mask_zero),
    or from the loss's ignore_class. With sample weights [B, T] (zeros
    along time) and no mask, the weighted mean over its T positions, as
    Keras' loss per position."""
    import tf_keras
    k = keras if framework == "keras" else tf_keras
    x, y = _tokens()
    valid = x != 0
    weights = ignore_class = None
    if mode != "mask":
        x = np.maximum(x, 1)    # no mask from the embedding
    if mode == "weights":
        weights = np.where(np.arange(5) < 3, 1.5, 0.0) * np.ones((len(x), 1))
        weights = weights.astype("float32")
    elif mode == "ignore_class":
        ignore_class = -1
        y = np.where(valid, y, ignore_class)
    model = _tagger(k)

    def compiled(model):
        kwargs = {} if ignore_class is None else {"ignore_class": ignore_class}
        model.compile(k.optimizers.SGD(1.0), k.losses.SparseCategoricalCrossentropy(
            from_logits=True, **kwargs), run_eagerly=run_eagerly)
        return model

    history = _fit(compiled(model), x, y, weights, TOKENS_CLIP)

    def loss_of(model, rows):
        values = k.losses.sparse_categorical_crossentropy(
            np.maximum(y[rows], 0), model(x[rows], training=True),
            from_logits=True)[0]
        if mode == "weights":
            return tf.reduce_sum(values * weights[rows][0]) / 5
        mask = tf.cast(valid[rows][0], values.dtype)
        return tf.math.divide_no_nan(tf.reduce_sum(values * mask),
                                     tf.reduce_sum(mask))

    want = _reference(_tagger(k), k.optimizers.SGD(1.0), x, y, loss_of,
                      TOKENS_CLIP)
    _assert_same(model, want)
    if mode == "mask":
        # the loss reported is Keras' own: over the batch's valid positions
        # (here not the mean of the examples' losses)
        first = _tagger(k)
        values = k.losses.sparse_categorical_crossentropy(
            y[:BATCH], first(x[:BATCH]), from_logits=True).numpy()
        keras_loss = values[valid[:BATCH]].sum() / valid[:BATCH].sum()
        assert keras_loss != pytest.approx(np.mean(
            [float(loss_of(first, slice(i, i + 1))) for i in range(BATCH)]), rel=1e-2)
        reported = _fit(compiled(first), x[:BATCH], y[:BATCH])["loss"][0]
        assert reported == pytest.approx(keras_loss, rel=1e-5)


# -- refused: what the DP step would not compute as Keras does ---------------

class _OwnLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        return keras.ops.mean((y_pred - y) ** 2) * 2.0


class _OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


class _OwnMetrics(keras.Model):
    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return {"largest": keras.ops.max(y_pred)}


def _dense(cls=keras.Model):
    inputs = keras.Input((4,))
    if cls is _OwnStep:
        return _OwnStep([inputs, keras.layers.Dense(2)])
    return cls(inputs, keras.layers.Dense(2)(inputs))


@pytest.mark.parametrize("cls, name", [(_OwnLoss, "_OwnLoss.compute_loss"),
                                       (_OwnStep, "_OwnStep.train_step")])
def test_an_overridden_loss_or_step_is_refused(cls, name):
    """The DP step computes the compiled loss per example, and replaces
    train_step: an override would be silently bypassed."""
    with pytest.raises(TypeError, match=name):
        privacy.make_private(_dense(cls), l2_norm_clip=1.0, noise_multiplier=1.0)
    model = _dense()
    model.compute_loss = lambda *a, **k: 0.0
    with pytest.raises(TypeError, match="own compute_loss"):
        privacy.make_private(model, l2_norm_clip=1.0, noise_multiplier=1.0)


def test_tf_keras_overrides_are_refused():
    import tf_keras

    class OwnLoss(tf_keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            return tf.reduce_mean((y_pred - y) ** 2)

    class OwnStep(tf_keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    for cls in (OwnLoss, OwnStep):
        inputs = tf_keras.Input((4,))
        model = cls(inputs, tf_keras.layers.Dense(2)(inputs))
        with pytest.raises(TypeError, match=cls.__name__):
            privacy.make_private(model, l2_norm_clip=1.0, noise_multiplier=1.0)


def test_an_overridden_compute_metrics_is_run():
    model = _dense(_OwnMetrics)
    model.compile("sgd", "mse", run_eagerly=True)
    privacy.make_private(model, l2_norm_clip=1.0, noise_multiplier=0.0)
    history = model.fit(np.ones((4, 4), "float32"), np.ones((4, 2), "float32"),
                        verbose=0).history
    assert set(history) == {"largest"}


class _CallOverridden(keras.losses.Loss):
    def __call__(self, y_true, y_pred, sample_weight=None):
        return keras.ops.mean((y_pred - y_true) ** 2)


@pytest.mark.parametrize("loss, error, match", [
    (_CallOverridden(), TypeError, "_CallOverridden"),
    # two losses for one output: Keras' plain step trains on the first alone
    (["mse", "mae"], ValueError, "2 losses for the model's one output"),
    (lambda y, p: keras.ops.mean((p - y) ** 2), ValueError, "one value for the whole batch"),
    (keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
     ValueError, "mean_with_sample_weight"),
])
def test_losses_with_no_value_per_example_are_refused(loss, error, match):
    model = _dense()
    model.compile("sgd", loss, run_eagerly=True)
    privacy.make_private(model, l2_norm_clip=1.0, noise_multiplier=0.0)
    with pytest.raises(error, match=match):
        model.fit(np.ones((4, 4), "float32"), np.ones((4, 2), "float32"),
                  sample_weight=np.ones(4, "float32"), verbose=0)


def _build_elsewhere(build):
    def patched(self, *args):
        build(self, *args)
        self._losses_elsewhere = self.__dict__.pop("_flat_losses")
    return patched


def _call_twice(call):
    def patched(self, *args):
        call(self, *args)
        return call(self, *args)
    return patched


@pytest.mark.parametrize("method, patch, match", [
    ("build", _build_elsewhere, "_flat_losses is missing"),
    ("call", _call_twice, "computed 2 losses for 1 compiled ones")])
def test_a_changed_keras_is_refused_naming_the_version(monkeypatch, method,
                                                       patch, match):
    """A Keras whose compiled loss keeps its losses elsewhere, or computes
    one twice: a RuntimeError naming what changed and the version, where
    the per-example losses would be missing or differ from Keras' loss."""
    from keras.src.trainers import compile_utils
    monkeypatch.setattr(compile_utils.CompileLoss, method,
                        patch(getattr(compile_utils.CompileLoss, method)))
    model = _dense()
    model.compile("sgd", "mse", run_eagerly=True)
    privacy.make_private(model, l2_norm_clip=1.0, noise_multiplier=0.0)
    with pytest.raises(RuntimeError, match=f"{match} in Keras {keras.__version__}"):
        model.fit(np.ones((4, 4), "float32"), np.ones((4, 2), "float32"), verbose=0)


def test_loss_scale_optimizer_is_refused():
    model = _dense()
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
                  "mse", run_eagerly=True)
    privacy.make_private(model, l2_norm_clip=1.0, noise_multiplier=0.0)
    with pytest.raises(NotImplementedError, match="LossScaleOptimizer"):
        model.fit(np.ones((4, 4), "float32"), np.ones((4, 2), "float32"), verbose=0)


def test_evaluate_after_private_fit_is_keras_own():
    """Outside the DP step the wrapped losses are Keras' own: evaluate
    equals a plain model's with the same weights (make_private twice is one
    make_private)."""
    x, y_cls, y_reg = _two_output_data()
    losses = ["sparse_categorical_crossentropy", "mse"]
    model = _two_outputs(keras, False)
    model.compile("sgd", losses, loss_weights=[0.3, 2.0], run_eagerly=True)
    privacy.make_private(model, l2_norm_clip=CLIP, noise_multiplier=0.0)
    _fit(model, x, [y_cls, y_reg])
    plain = _two_outputs(keras, False)
    plain.compile("sgd", losses, loss_weights=[0.3, 2.0], run_eagerly=True)
    plain.set_weights(model.get_weights())
    got = model.evaluate(x, [y_cls, y_reg], verbose=0, return_dict=True)
    want = plain.evaluate(x, [y_cls, y_reg], verbose=0, return_dict=True)
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("framework, fmt", [
    ("keras", "m.keras"), ("tf_keras", "m.h5"), ("tf_keras", "saved_model")])
def test_a_saved_private_model_loads_as_keras_own(tmp_path, framework, fmt):
    """make_private is not saved with the model: the loaded one has Keras'
    own loss class (no per-example wrapper), Keras' own train step, the
    same evaluate, and make_private on it trains with DP again."""
    import tf_keras
    k = keras if framework == "keras" else tf_keras
    x, y_cls, y_reg = _two_output_data()
    losses = [k.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"]
    model = _two_outputs(k, False)
    model.compile(k.optimizers.SGD(0.1), losses, loss_weights=[0.3, 2.0])
    _fit(model, x, [y_cls, y_reg])
    path = str(tmp_path / fmt)
    model.save(path)
    loaded = k.models.load_model(path)
    assert not getattr(loaded.train_step, "_fasttape_dp_step", False)
    assert type(loaded).train_step is loaded.train_step.__func__
    for loss in tf.nest.flatten(loaded.loss):
        assert not isinstance(loss, privacy._PerExampleLoss), loss
        assert "fasttape" not in type(loss).__module__, type(loss)
    want = model.evaluate(x, [y_cls, y_reg], verbose=0)
    got = loaded.evaluate(x, [y_cls, y_reg], verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # the loaded model trains privately again: its step is the DP reference's
    clipped = _two_outputs(k, False)
    clipped.set_weights(loaded.get_weights())
    want = _reference(clipped, k.optimizers.SGD(0.1), x, [y_cls, y_reg],
                      _two_output_loss(k, ("cls", "reg")), CLIP)
    _fit(loaded, x, [y_cls, y_reg])
    _assert_same(loaded, want)
