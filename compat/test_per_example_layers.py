"""Per-example gradients and the DP step on Keras 3 layers the other
per-example tests do not build: PReLU, RMSNormalization, TimeDistributed,
UpSampling, Bidirectional recurrent layers, causal attention, LoRA
(``enable_lora``: a product of two weights before the batch), an output
projection tied to the embedding table, and make_private with several
steps an execution. Kept from a wider generated search (models drawn from
these layers and the others, every mode, float32 and float64), which
came out clean; each against a loop of single-example tf.GradientTape's."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import fasttape
from compat.test_per_example_programs import _check_path, _loop, _stepped
from fasttape.privacy import make_private

L = keras.layers


def _perturbed(model, rng):
    for w in model.weights:
        v = w.numpy()
        w.assign((v + 0.3 * rng.normal(size=v.shape)).astype(v.dtype))


def _text_model(dt, batch):
    """Embedding (mask_zero) -> TimeDistributed(Dense, LoRA) ->
    RMSNormalization -> causal attention -> logits tied to the table."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((4,), dtype="int32")
    emb = L.Embedding(6, 4, mask_zero=True, dtype=dt)
    dense = L.Dense(4, activation="tanh", dtype=dt)
    h = L.TimeDistributed(dense, dtype=dt)(emb(inp))
    h = L.RMSNormalization(dtype=dt)(h)
    h = L.MultiHeadAttention(2, 2, dtype=dt)(h, h, use_causal_mask=True)
    h = L.GlobalAveragePooling1D(dtype=dt)(h)
    logits = keras.ops.matmul(L.Dense(4, dtype=dt)(h), keras.ops.transpose(emb.embeddings))
    model = keras.Model(inp, logits)
    dense.enable_lora(2)
    rng = np.random.default_rng(3)
    _perturbed(model, rng)
    ids = rng.integers(0, 6, size=(batch, 4))
    ids[0, 2:] = 0
    return tf.constant(ids, tf.int32), model


def _wave_model(dt, batch):
    """PReLU -> UpSampling1D -> Bidirectional(GRU, merged by sum)."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((3, 2), dtype=dt)
    h = L.PReLU(shared_axes=[1], dtype=dt)(inp)
    h = L.UpSampling1D(2, dtype=dt)(h)
    h = L.Bidirectional(L.GRU(2, return_sequences=True, reset_after=False, dtype=dt),
                        merge_mode="sum", dtype=dt)(h)
    model = keras.Model(inp, L.Dense(2, dtype=dt)(L.Flatten(dtype=dt)(h)))
    rng = np.random.default_rng(4)
    _perturbed(model, rng)
    return tf.constant(rng.normal(size=(batch, 3, 2)), dt), model


@pytest.mark.parametrize("build,dt", [(_text_model, "float32"), (_wave_model, "float64")],
                         ids=["text", "wave"])
def test_layers_per_example(build, dt):
    """Eagerly (traced, the wave model's two loops take rows by pfor: over
    a minute)."""
    x, model = build(dt, 3)

    def loss(x):
        return tf.reduce_sum(tf.sin(model(x)), axis=1)
    _check_path(x, loss, model.trainable_variables, "eager", "some")
    keras.backend.clear_session()


def _dp_rows(x, loss, variables, mode):
    """The sources dp_gradient (in ``mode``) gives per-example rows."""
    rows = []

    def body(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        out = tape.dp_gradient(losses, variables, 1.0)
        rows[:] = [name for name, _ in tape.summary().per_example_rows[1]]
        return out
    _stepped(body, x, mode, False)
    return rows


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_recurrent_layers_after_upsampling_take_rules(mode):
    """The wave model's weights take op rules, no per-example rows: its
    recurrent layers run time-major (Transpose, Unpack, Split; the
    backward one reversed in time by a ReverseV2, whose gradient saves
    no input: its rank is the analysis' shape), after UpSampling1D (a
    Tile whose multiples are computed while tracing: one multiple along
    the batch, its output as long as its input there). Eagerly, GRU's
    recurrent kernel (reset_after=False) is read through two StridedSlice's
    of it: each a link of a chain, its gradient padded back. Values equal
    the loop's."""
    x, model = _wave_model("float64", 3)

    def loss(x):
        return tf.reduce_sum(tf.sin(model(x)), axis=1)
    assert _dp_rows(x, loss, model.trainable_variables, mode) == []
    # (under jit_compile the same analysis of the same graph: 12 s more)
    _check_path(x, loss, model.trainable_variables, mode, "some",
                with_norms=mode == "eager")
    keras.backend.clear_session()


@pytest.mark.parametrize("mode", ["traced", "jit"])
def test_recurrent_loops_differentiated_once(mode):
    """Traced, the wave model's DP step holds as many loops as its plain
    step: the pass to PReLU's output gradient goes through the recurrent
    loops by their per-example backward loops (no second backward loop of
    TF's for it). Values equal the loop's."""
    x, model = _wave_model("float64", 3)
    variables = model.trainable_variables

    def loss(x):
        return tf.reduce_sum(tf.sin(model(x)), axis=1)
    ref = _loop(loss, x, variables)
    norms = np.sqrt(sum((r.reshape(3, -1) ** 2).sum(1) for r in ref))
    clip = float(np.median(norms))
    expected = [np.tensordot(np.minimum(1.0, clip / norms), r, 1) / 3 for r in ref]

    def plain(x):
        with fasttape.GradientTape() as tape:
            total = tf.reduce_sum(loss(x))
        return tape.gradient(total, variables)

    def dp(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        return tape.dp_gradient(losses, variables, clip)
    loops = []
    for step in (plain, dp):
        fn = tf.function(step, jit_compile=mode == "jit")
        graph = fn.get_concrete_function(x).graph
        loops.append(sum(op.type in ("While", "StatelessWhile")
                         for op in graph.get_operations()))
    assert loops[0] == loops[1] == 4, loops
    for got, want in zip(fn(x), expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-9,
                                   atol=1e-9 * np.abs(want).max())
    keras.backend.clear_session()


def _mixing_case(mix):
    """x [B, T, d] scaled by w (a Mul rule's), then rows moved across the
    batch: reversed along it (time-major: Transpose, ReverseV2 of the
    batch axis, Transpose back), or tiled along it by multiples computed
    while tracing and reshaped back to B rows (row i then holds examples
    2i and 2i + 1 modulo B)."""
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=(4, 3, 2)), tf.float64)
    w = tf.Variable(rng.normal(size=(2,)), dtype=tf.float64, name="w")
    c = tf.constant(rng.normal(size=(3, 2)), tf.float64)

    def loss(x):
        h = x * w
        if mix == "reverse_batch":
            h = tf.transpose(tf.reverse(tf.transpose(h, [1, 0, 2]), [1]), [1, 0, 2])
        elif mix == "reverse_time":     # (keeps examples apart: a rule)
            h = tf.transpose(tf.reverse(tf.transpose(h, [1, 0, 2]), [0]), [1, 0, 2])
        elif mix == "tile_batch":
            multiples = tf.concat([[2], tf.ones_like(tf.shape(h)[1:])], 0)
            h = tf.reshape(tf.tile(h, multiples), [h.shape[0], -1, h.shape[2]])
            h = h[:, :3]
        else:   # (multiples known only at run time; the tiled length while tracing)
            one = tf.shape(h)[1] // tf.shape(h)[1]
            h = tf.reshape(tf.tile(h, tf.stack([2, one, 1])), [h.shape[0], -1, h.shape[2]])
            h = h[:, :3]
        return tf.reduce_sum(tf.sin(h * c), axis=[1, 2])
    return x, w, loss


@pytest.mark.parametrize("mix,mode", [
    ("reverse_batch", "eager"), ("reverse_batch", "traced"), ("reverse_time", "eager"),
    ("tile_batch", "traced"), ("tile_batch", "jit"), ("tile_batch_runtime", "traced"),
    ("tile_batch_runtime", "jit")])
def test_rows_moved_across_the_batch_raise(mix, mode):
    """Rows moved across the batch (a reversal along it, a tile along it
    reshaped back to B rows, by multiples known or computed while
    tracing) give each loss other examples' rows: refused (rows would
    hand each example another's gradient, its op's rule pair each
    example's input with another's output gradient). Reversed in time
    only, the weight takes its rule; values equal the loop of each
    example's loss on the whole batch."""
    x, w, loss = _mixing_case(mix)
    if mix != "reverse_time":
        with pytest.raises(ValueError, match="mixes examples"):
            _dp_rows(x, loss, [w], mode)
        return
    rows = _dp_rows(x, loss, [w], mode)
    assert rows == ([] if mix == "reverse_time" else ["w:0 (2,)"]), rows
    _check_path(x, loss, [w], mode, "some")


@pytest.mark.parametrize("mode", ["eager", "traced", "jit"])
@pytest.mark.parametrize("sliced", ["ranges", "strided"])
def test_slices_of_a_weight(sliced, mode):
    """A weight read eagerly through slices of it before its products
    (GRU(reset_after=False)'s recurrent kernel): plain ranges (negative
    and open bounds too) take the products' rules, each example's
    gradient padded back (traced, the graph's own route); a strided slice
    takes rows. Values equal the loop's."""
    rng = np.random.default_rng(6)
    x = tf.constant(rng.normal(size=(4, 3)), tf.float64)
    w = tf.Variable(rng.normal(size=(3, 7)), dtype=tf.float64, name="w")

    def loss(x):
        if sliced == "ranges":
            parts = [w[:, :2], w[:, 2:-1], w[1:, -1:]]
            h = tf.concat([x @ parts[0], x @ parts[1], x[:, 1:] @ parts[2]], 1)
        else:
            h = x @ w[:, ::2]
        return tf.reduce_sum(tf.sin(h), axis=1)
    rows = _dp_rows(x, loss, [w], mode)
    assert rows == ([] if sliced == "ranges" else ["w:0 (3, 7)"]), rows
    _check_path(x, loss, [w], mode, "some")


@pytest.fixture
def float64_keras():
    """Keras' floatx float64 (fit's inputs and the compiled loss)."""
    floatx = keras.config.floatx()
    keras.config.set_floatx("float64")
    yield
    keras.config.set_floatx(floatx)


def test_make_private_several_steps_an_execution(float64_keras):  # pylint: disable=unused-argument,redefined-outer-name
    """fit with steps_per_execution=2 (the DP step inside a loop's body)
    trains the weights a hand-written DP-SGD loop does."""
    rng = np.random.default_rng(0)
    batch, steps, clip, lr = 3, 4, 0.3, 0.1
    x = rng.normal(size=(batch * steps, 5))
    y = rng.normal(size=(batch * steps, 2))

    def build():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((5,), dtype="float64"),
                                 L.Dense(4, activation="tanh", dtype="float64"),
                                 L.Dense(2, dtype="float64")])
    model = build()
    weights = model.trainable_variables
    for s in range(steps):
        rows = []
        for i in range(s * batch, (s + 1) * batch):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x[i:i + 1]) - y[i:i + 1]))
            rows.append([g.numpy() for g in tape.gradient(loss, weights)])
        norms = np.array([np.sqrt(sum((g ** 2).sum() for g in r)) for r in rows])
        scale = np.minimum(1, clip / norms)
        assert 0 < (scale < 1).sum() < batch or s > 0   # some clipped, not all
        for k, w in enumerate(weights):
            w.assign(w.numpy() - lr * sum(c * r[k] for c, r in zip(scale, rows)) / batch)
    want = [w.numpy() for w in weights]
    model = build()
    model.compile(keras.optimizers.SGD(lr), "mse", steps_per_execution=2)
    make_private(model, l2_norm_clip=clip, noise_multiplier=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == steps
    for w, expected in zip(model.trainable_variables, want):
        np.testing.assert_allclose(w.numpy(), expected, rtol=1e-9, atol=1e-12)
    keras.backend.clear_session()
