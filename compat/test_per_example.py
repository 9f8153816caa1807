"""Per-example gradients, their norms and DP-SGD gradients
(GradientTape.per_example_gradients / per_example_norms / dp_gradient)
against a loop of B single-example tf.GradientTape's, for every op rule,
the rows fallback, and Keras 3 models."""

import gc
import hashlib
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import test_util

import fasttape
from fasttape.backward import _per_example
from fasttape.gradients import _compiled
from compat.harness import TOLERANCES

B = 6
DTYPES = [tf.float32, tf.float64]


def _var(rng, shape, dtype):
    return tf.Variable(rng.normal(size=shape), dtype=dtype)


# Each case: (build(dtype) -> (xs, loss_fn, variables), ops the rules cover).
# loss_fn(*xs) maps a batch to its [batch] losses; the reference calls it on
# slices [i:i+1].

def _mlp(dtype):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(B, 5)), rng.normal(size=(B, 3))
    w1, b1 = _var(rng, (5, 4), dtype), _var(rng, (4,), dtype)
    w2, b2 = _var(rng, (4, 3), dtype), _var(rng, (3,), dtype)

    def loss(x, y):
        h = tf.tanh(x @ w1 + b1)                     # MatMul, AddV2
        out = tf.nn.bias_add(tf.matmul(h, w2, transpose_b=False), b2)  # BiasAdd
        return tf.reduce_sum((out - y) ** 2, axis=-1)
    return [tf.constant(x, dtype), tf.constant(y, dtype)], loss, [w1, b1, w2, b2]


def _transposed(dtype):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, 5))
    w = _var(rng, (3, 5), dtype)
    bias = _var(rng, (1, 3), dtype)       # rank 2, broadcast over the batch

    def loss(x):
        return tf.reduce_sum(tf.sin(tf.matmul(x, w, transpose_b=True) - bias), -1)
    return [tf.constant(x, dtype)], loss, [w, bias]


def _sequence(t, k, n):
    def build(dtype):
        rng = np.random.default_rng(2)
        x = rng.normal(size=(B, t, k))
        w, bias = _var(rng, (k, n), dtype), _var(rng, (n,), dtype)
        gamma = _var(rng, (n,), dtype)

        def loss(x):
            z = tf.matmul(x, w) + bias          # BatchMatMulV2, AddV2
            z = tf.tanh(z) * gamma              # Mul (a scale)
            return tf.reduce_sum(z * z, axis=[1, 2])
        return [tf.constant(x, dtype)], loss, [w, bias, gamma]
    return build


def _embedding(read_first):
    def build(dtype):
        rng = np.random.default_rng(3)
        ids = np.array([[1, 2, 1, 4], [0, 0, 0, 0], [3, 2, 3, 5],
                        [5, 4, 3, 2], [1, 1, 2, 2], [0, 5, 0, 5]])
        table = _var(rng, (6, 3), dtype)
        w = _var(rng, (3, 2), dtype)

        def loss(ids):
            src = table.read_value() if read_first else table
            e = tf.gather(src, ids)             # GatherV2 / ResourceGather
            z = tf.reduce_mean(e, axis=1) @ w
            return tf.reduce_sum(tf.cos(z), axis=-1)
        return [tf.constant(ids)], loss, [table, w]
    return build


def _conv(strides, padding, dilations, cin=2, cout=3):
    def build(dtype):
        rng = np.random.default_rng(6)
        x = rng.normal(size=(B, 7, 6, cin))
        kernel = _var(rng, (3, 2, cin, cout), dtype)

        def loss(x):
            z = tf.nn.conv2d(x, kernel, strides, padding, dilations=dilations)
            return tf.reduce_sum(tf.sin(z), axis=[1, 2, 3])
        return [tf.constant(x, dtype)], loss, [kernel]
    return build


def _fallback(dtype):
    """A tied weight (two uses): rows, not rules; beside a convolution."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(B, 5, 5, 2))
    kernel = _var(rng, (3, 3, 2, 2), dtype)
    tied = _var(rng, (2, 2), dtype)

    def loss(x):
        z = tf.nn.conv2d(x, kernel, 1, "SAME")
        z = tf.reshape(z, [-1, 25, 2]) @ tied
        z = tf.tanh(z) @ tf.transpose(tied)
        return tf.reduce_sum(z * z, axis=[1, 2])
    return [tf.constant(x, dtype)], loss, [kernel, tied]


def _einsum(equation, x_shape, w_shape):
    """tf.einsum with a variable operand (tf_keras' EinsumDense): the
    Einsum rule (equations with the batch on x's leading index)."""
    def build(dtype):
        rng = np.random.default_rng(7)
        x = rng.normal(size=(B,) + x_shape)
        w = _var(rng, w_shape, dtype)
        w_first = not equation.startswith("a")

        def loss(x):
            z = tf.einsum(equation, *((w, x) if w_first else (x, w)))
            return tf.reduce_sum(tf.sin(z), axis=list(range(1, len(z.shape))))
        return [tf.constant(x, dtype)], loss, [w]
    return build


def _folded_rows(transpose_b):
    """Dense on a sequence as Keras runs it: [B, T, K] -> [B*T, K] @ W ->
    [B, T, N] (the MatMul rule on rows folded with time)."""
    def build(dtype):
        rng = np.random.default_rng(11)
        x = rng.normal(size=(B, 5, 4))
        w = _var(rng, (3, 4) if transpose_b else (4, 3), dtype)
        bias = _var(rng, (3,), dtype)

        def loss(x):
            z = tf.matmul(tf.reshape(x, [-1, 4]), w, transpose_b=transpose_b)
            z = tf.nn.bias_add(tf.reshape(z, [-1, 5, 3]), bias)
            return tf.reduce_sum(tf.sin(z), axis=[1, 2])
        return [tf.constant(x, dtype)], loss, [w, bias]
    return build


def _depthwise(strides, padding, multiplier):
    def build(dtype):
        rng = np.random.default_rng(8)
        x = rng.normal(size=(B, 7, 6, 3))
        kernel = _var(rng, (3, 2, 3, multiplier), dtype)

        def loss(x):
            z = tf.nn.depthwise_conv2d(x, kernel, [1, strides, strides, 1],
                                       padding)
            return tf.reduce_sum(tf.sin(z), axis=[1, 2, 3])
        return [tf.constant(x, dtype)], loss, [kernel]
    return build


CASES = {
    "mlp": _mlp,
    "transposed": _transposed,
    "sequence_gram": _sequence(2, 4, 3),       # T^2 < K N: the ghost norm
    "sequence_built": _sequence(5, 2, 2),      # T^2 >= K N: built per example
    "embedding_resource": _embedding(False),
    "embedding_read": _embedding(True),
    "fallback": _fallback,
    "conv_same": _conv(1, "SAME", 1),
    "conv_strided_valid": _conv(2, "VALID", 1),
    "conv_dilated": _conv(1, "SAME", 2),
    # many input channels to few outputs (no patches)
    "conv_wide": _conv(2, "SAME", 1, cin=64),
    # patches from slices of the input (8 channels or more, padded one more
    # at the end where SAME pads an odd total): the per-example gradients
    # built where T^2 < K N (strided), the ghost norm where T is smaller
    # still (VALID, strided: T = 9)
    "conv_sliced_same": _conv(1, "SAME", 1, cin=8, cout=32),
    "conv_sliced_strided": _conv(2, "SAME", 1, cin=8, cout=32),
    "conv_sliced_dilated": _conv(1, "SAME", 2, cin=8, cout=32),
    "conv_sliced_ghost": _conv(2, "VALID", 1, cin=8, cout=64),
    # EinsumDense's and MultiHeadAttention's equations; the variable first;
    # a transposed kernel; the output's letters reordered
    "einsum_dense": _einsum("abc,cd->abd", (5, 4), (4, 3)),
    "einsum_heads": _einsum("abc,cde->abde", (5, 4), (4, 2, 3)),
    "einsum_heads_out": _einsum("abcd,cde->abe", (5, 2, 3), (2, 3, 4)),
    "einsum_weight_first": _einsum("cde,abc->abde", (5, 4), (4, 2, 3)),
    "einsum_reordered": _einsum("abc,dc->adb", (5, 4), (3, 4)),
    "einsum_flat": _einsum("ab,bc->ac", (4,), (4, 3)),
    "folded_rows": _folded_rows(False),
    "folded_rows_transposed": _folded_rows(True),
    "depthwise_same": _depthwise(1, "SAME", 1),
    "depthwise_valid_strided": _depthwise(2, "VALID", 2),
}


def _keras_case(kind):
    def build(dtype):
        import keras  # pylint: disable=import-outside-toplevel
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(5)
        name = tf.as_dtype(dtype).name
        if kind == "dense":
            x = rng.normal(size=(B, 4))
            layers = [keras.layers.Dense(5, activation="tanh", dtype=name),
                      keras.layers.Dense(2, dtype=name)]
        elif kind == "conv":
            x = rng.normal(size=(B, 6, 6, 2))
            layers = [keras.layers.Conv2D(3, 3, activation="relu", dtype=name),
                      keras.layers.Flatten(dtype=name),
                      keras.layers.Dense(2, dtype=name)]
        elif kind == "embedding":
            x = rng.integers(0, 7, size=(B, 5))
            layers = [keras.layers.Embedding(7, 3, dtype=name),
                      keras.layers.GlobalAveragePooling1D(dtype=name),
                      keras.layers.Dense(2, dtype=name)]
        elif kind == "layernorm":
            x = rng.normal(size=(B, 3, 4))
            layers = [keras.layers.Dense(4, dtype=name),
                      keras.layers.LayerNormalization(dtype=name),
                      keras.layers.Flatten(dtype=name),
                      keras.layers.Dense(2, dtype=name)]
        elif kind == "conv1d":
            x = rng.normal(size=(B, 6, 3))
            layers = [keras.layers.Conv1D(4, 3, activation="tanh", dtype=name),
                      keras.layers.Flatten(dtype=name),
                      keras.layers.Dense(2, dtype=name)]
        elif kind == "depthwise":
            x = rng.normal(size=(B, 6, 6, 2))
            layers = [keras.layers.DepthwiseConv2D(3, depth_multiplier=2,
                                                   padding="same",
                                                   activation="tanh", dtype=name),
                      keras.layers.SeparableConv2D(3, 3, dtype=name),
                      keras.layers.Flatten(dtype=name),
                      keras.layers.Dense(2, dtype=name)]
        elif kind == "einsumdense":
            x = rng.normal(size=(B, 3, 4))
            layers = [keras.layers.EinsumDense("abc,cde->abde", (3, 2, 3),
                                               bias_axes="de", activation="tanh",
                                               dtype=name),
                      keras.layers.EinsumDense("abcd,cde->abe", (3, 2),
                                               bias_axes="e", dtype=name),
                      keras.layers.Flatten(dtype=name),
                      keras.layers.Dense(2, dtype=name)]
        elif kind == "transformer":
            # a transformer block: attention, then Dense layers on the
            # sequence (each one MatMul over B*T rows), LayerNormalization
            x = rng.normal(size=(B, 3, 4))
            mha = keras.layers.MultiHeadAttention(2, 2, dtype=name)
            ffn = [keras.layers.Dense(6, activation="relu", dtype=name),
                   keras.layers.Dense(4, dtype=name)]
            norms = [keras.layers.LayerNormalization(dtype=name)
                     for _ in range(2)]
            inp = keras.Input(x.shape[1:], dtype=name)
            h = norms[0](inp + mha(inp, inp))
            h = norms[1](h + ffn[1](ffn[0](h)))
            out = keras.layers.Dense(2, dtype=name)(
                keras.layers.GlobalAveragePooling1D(dtype=name)(h))
            model = keras.Model(inp, out)

            def loss(x):
                return tf.reduce_sum(tf.square(model(x)), axis=-1)
            return [tf.constant(x, dtype)], loss, model.trainable_variables
        else:   # attention
            x = rng.normal(size=(B, 3, 4))
            mha = keras.layers.MultiHeadAttention(2, 2, dtype=name)
            layers = [lambda z: mha(z, z), keras.layers.Flatten(dtype=name),
                      keras.layers.Dense(2, dtype=name)]
        xs = [tf.constant(x) if kind == "embedding" else tf.constant(x, dtype)]
        model = keras.Sequential([keras.Input(x.shape[1:], dtype="int64" if kind == "embedding" else name)]
                                 + [l for l in layers if not callable(l) or hasattr(l, "weights")]) \
            if kind != "attention" else None
        if model is None:
            inp = keras.Input(x.shape[1:], dtype=name)
            out = inp
            for l in layers:
                out = l(out)
            model = keras.Model(inp, out)

        def loss(x):
            return tf.reduce_sum(tf.square(model(x)), axis=-1)
        return xs, loss, model.trainable_variables
    return build


KERAS = {f"keras_{k}": _keras_case(k)
         for k in ("dense", "conv", "embedding", "layernorm", "attention",
                   "conv1d", "depthwise", "einsumdense", "transformer")}


def _tf_keras_attention(dtype):
    """tf_keras' MultiHeadAttention (Einsum ops on the kernels:
    "abc,cde->abde", "abcd,cde->abe") and Dense on a sequence (a tensordot:
    one MatMul over B*T rows)."""
    import tf_keras  # pylint: disable=import-outside-toplevel
    tf_keras.utils.set_random_seed(0)
    name = tf.as_dtype(dtype).name
    x = np.random.default_rng(9).normal(size=(B, 3, 4))
    inp = tf_keras.Input((3, 4), dtype=name)
    mha = tf_keras.layers.MultiHeadAttention(2, 3, dtype=name)
    # (not tf_keras' LayerNormalization: it folds the batch into a fused
    # batch norm's second axis, so every source takes rows)
    h = tf_keras.layers.Dense(4, activation="tanh", dtype=name)(
        inp + mha(inp, inp))
    out = tf_keras.layers.Dense(2, dtype=name)(tf_keras.layers.Flatten(dtype=name)(h))
    model = tf_keras.Model(inp, out)

    def loss(x):
        return tf.reduce_sum(tf.square(model(x)), axis=-1)
    return [tf.constant(x, dtype)], loss, model.trainable_variables


ALL = {**CASES, **KERAS, "tf_keras_attention": _tf_keras_attention}


# TF's CPU kernels have no float64 Conv2D backprop with dilations (TF's own
# loop fails there too).
PAIRS = [(c, d) for c in sorted(ALL) for d in DTYPES
         if not (c in ("conv_dilated", "conv_sliced_dilated") and d == tf.float64)]
PAIR_IDS = [f"{c}-{d.name}" for c, d in PAIRS]


_REFERENCES = {}     # (case key, digest of inputs and values) -> numpy arrays


def _digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        a = np.asarray(tf.convert_to_tensor(t))
        h.update(repr((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _reference(loss, xs, variables, key=None):
    """Per-example gradients from B single-example tf.GradientTape's.

    With ``key`` (the case's name: what ``loss`` computes) the loop runs
    once per key and inputs and variable values (a digest of them is part
    of the key): several tests of one case compare with the same TF
    reference, as fresh tensors each time. Only TF runs here, so sharing it
    cannot hide a fasttape fault."""
    if key is not None:
        full = (key, _digest(list(xs) + list(variables)))
        if full not in _REFERENCES:
            _REFERENCES[full] = [g.numpy() for g in _reference(loss, xs, variables)]
        return [tf.constant(a) for a in _REFERENCES[full]]
    rows = []
    for i in range(B):
        with tf.GradientTape() as tape:
            li = loss(*[x[i:i + 1] for x in xs])[0]
        rows.append([tf.convert_to_tensor(g) for g in tape.gradient(li, variables)])
    return [tf.stack([r[k] for r in rows]) for k in range(len(variables))]


def _ref_norms(ref):
    return tf.sqrt(tf.add_n([
        tf.reduce_sum(tf.reshape(g, [B, -1]) ** 2, axis=1) for g in ref]))


def _close(actual, expected, dtype):
    rtol, atol = TOLERANCES[dtype]
    if isinstance(actual, tf.IndexedSlices):    # (a table's, traced, no noise)
        actual = tf.convert_to_tensor(actual)
    # Per-example sums are taken in another order than the loop's.
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected),
                               rtol=rtol * 20, atol=atol * 20)


@pytest.mark.parametrize("case,dtype", PAIRS, ids=PAIR_IDS)
def test_per_example_gradients(case, dtype):
    xs, loss, variables = ALL[case](dtype)
    ref = _reference(loss, xs, variables, key=case)
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    got = tape.per_example_gradients(losses, variables)
    assert len(got) == len(ref)
    for g, r, v in zip(got, ref, variables):
        assert g.shape == [B] + v.shape
        _close(g, r, dtype)


@pytest.mark.parametrize("case,dtype", PAIRS, ids=PAIR_IDS)
def test_per_example_norms(case, dtype):
    xs, loss, variables = ALL[case](dtype)
    ref = _reference(loss, xs, variables, key=case)
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    norms = tape.per_example_norms(losses, variables)
    assert norms.shape == [B]
    _close(norms, _ref_norms(ref), dtype)


@pytest.mark.parametrize("microbatches", [None, 3, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case", ["mlp", "embedding_resource", "fallback",
                                  "keras_dense", "keras_conv", "einsum_heads",
                                  "depthwise_valid_strided", "keras_depthwise",
                                  "tf_keras_attention", "folded_rows",
                                  "keras_transformer"])
def test_dp_gradient_without_noise(case, dtype, microbatches):
    xs, loss, variables = ALL[case](dtype)
    ref = _reference(loss, xs, variables, key=case)
    m = B if microbatches is None else microbatches
    # TF Privacy: microbatch j's gradient is the mean of its examples'.
    micro = [tf.reduce_mean(tf.reshape(g, [m, B // m] + g.shape[1:].as_list()), 1)
             for g in ref]
    norms = tf.sqrt(tf.add_n([tf.reduce_sum(tf.reshape(g, [m, -1]) ** 2, 1)
                              for g in micro]))
    clip = float(np.median(norms.numpy()))     # some clipped, some not
    scale = clip / tf.maximum(norms, clip)
    expected = [tf.tensordot(scale, g, 1) / m for g in micro]
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    got = tape.dp_gradient(losses, variables, clip,
                           num_microbatches=microbatches)
    for g, e in zip(got, expected):
        assert isinstance(g, tf.Tensor)
        _close(g, e, dtype)


@pytest.mark.parametrize("microbatches", [None, 3])
@pytest.mark.parametrize("case,dtype", PAIRS, ids=PAIR_IDS)
def test_traced_post_pass_equals_eager(case, dtype, microbatches):
    """dp_gradient's post-pass (norms, clip factors, weighted sums, noise)
    traced into one function gives what it gives run eagerly, noise
    included (a seed draws the same): verify mode builds it at first use
    and checks the two agree; the mode off runs it eagerly."""
    from compat.harness import compiled_mode
    xs, loss, variables = ALL[case](dtype)

    def step():
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, 0.3, 1.1, seed=5,
                                num_microbatches=microbatches)

    with compiled_mode("off"):
        eager = step()
    fasttape.clear_caches()
    with compiled_mode("verify"):
        traced = step()
        assert _compiled.CACHE.stats["post_built"] == 1
        again = step()
        assert _compiled.CACHE.stats["post_replayed"] >= 1
    for e, t, a in zip(eager, traced, again):
        _close(t, e, dtype)
        np.testing.assert_array_equal(t, a)


@pytest.mark.parametrize("mode", ["auto", "verify"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_fused_post_pass_declined_by_a_rule(dtype, mode, monkeypatch):
    """A bias added over a batch folded with time ([B*T, n] + b): its
    output's shape is not recorded, so dp_gradient first tries the backward
    pass fused with the post-pass; the BiasAdd rule declines the output
    gradient ([B*T, n], not [B, n]) there, and the step takes the two-step
    path (the bias through per-example rows). Same values as B
    single-example tapes, the fused attempt remembered as declined."""
    from compat.harness import compiled_mode
    # (the analysis carries shapes across CheckNumerics, as across any
    # elementwise op: here it does not, as for an op it cannot read)
    monkeypatch.setattr(_per_example, "_SAME_SHAPE",
                        _per_example._SAME_SHAPE - {"CheckNumerics"})
    _per_example._ANALYSES.clear()
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(B, 4, 5)), dtype)
    w = tf.constant(rng.normal(size=(5, 3)), dtype)
    bias = _var(rng, (3,), dtype)

    def loss(x):
        # (CheckNumerics saves nothing: the recording knows no shape of the
        # BiasAdd's output)
        h = tf.reshape(tf.debugging.check_numerics(
            tf.nn.bias_add(tf.reshape(x, [-1, 5]) @ w, bias), "h"), [-1, 4, 3])
        return tf.reduce_sum(tf.tanh(h) ** 2, axis=[1, 2])

    variables = [bias]
    ref = _reference(loss, [x], variables)
    norms = _ref_norms(ref)
    clip = float(np.median(norms.numpy()))
    scale = clip / tf.maximum(norms, clip)
    expected = [tf.tensordot(scale, g, 1) / B for g in ref]
    _per_example._DECLINED.clear()
    with compiled_mode(mode):
        for _ in range(3):
            with fasttape.GradientTape() as tape:
                losses = loss(x)
            got = tape.dp_gradient(losses, variables, clip)
            for g, e in zip(got, expected):
                _close(g, e, dtype)
            assert len(_per_example._DECLINED) == 1


def test_rules_cover_dense_and_embedding_without_rows():
    """MatMul, bias adds, Mul scales and gathers take no per-example rows,
    also through a reshape of the weight (MultiHeadAttention's kernels);
    nor do Conv2D kernels."""
    for case in ("mlp", "sequence_gram", "embedding_resource", "embedding_read",
                 "keras_dense", "keras_embedding", "keras_attention",
                 "keras_conv", "conv_strided_valid", "conv_dilated",
                 "conv_wide", "keras_conv1d", "keras_einsumdense",
                 "keras_layernorm", "keras_transformer", "folded_rows",
                 "folded_rows_transposed"):
        xs, loss, variables = ALL[case](tf.float32)
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        flat = [v.handle for v in variables]
        analysis = _per_example._analyse("test", tape._tape, losses, flat,
                                         variables, B)
        _per_example._ruled_pass("test", tape._tape, losses, flat, analysis)
        assert not analysis.fallback, (case, analysis.fallback)


@pytest.mark.parametrize("method", ["per_example_norms", "dp_gradient"])
def test_rules_cover_einsum_and_depthwise_without_rows(method):
    """Einsum with a variable operand (tf_keras' EinsumDense and
    MultiHeadAttention) and DepthwiseConv2dNative (Keras' DepthwiseConv2D
    and SeparableConv2D) take their op rules: tape.summary() names no
    source that took per-example rows."""
    for case in ("einsum_dense", "einsum_heads", "einsum_heads_out",
                 "einsum_weight_first", "einsum_reordered", "einsum_flat",
                 "depthwise_same", "depthwise_valid_strided",
                 "keras_depthwise", "tf_keras_attention"):
        xs, loss, variables = ALL[case](tf.float32)
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        args = (1.0,) if method == "dp_gradient" else ()
        getattr(tape, method)(losses, variables, *args)
        assert tape.summary().per_example_rows == (method, ()), case


def test_einsum_rule_declines_other_equations():
    """An Einsum the rule does not cover (the weight shares a letter with
    the batch operand and the output: a per-head weight) takes rows, with
    the same values as B single-example tapes."""
    rng = np.random.default_rng(10)
    x = tf.constant(rng.normal(size=(B, 5, 2, 3)))
    w = _var(rng, (2, 3, 4), tf.float64)

    def loss(x):
        z = tf.einsum("abnh,nhd->abnd", x, w)
        return tf.reduce_sum(tf.sin(z), axis=[1, 2, 3])
    ref = _reference(loss, [x], [w])
    with fasttape.GradientTape() as tape:
        losses = loss(x)
    got = tape.per_example_gradients(losses, [w])
    _close(got[0], ref[0], tf.float64)
    assert [types for _, types in tape.summary().per_example_rows[1]] == [("Einsum",)]


def assert_standard_normal(x, halves=()):
    """x (noise over its standard deviation) follows N(0, 1): its mean,
    variance and kurtosis, and Kolmogorov-Smirnov against the normal CDF,
    each at about p = 0.001 for its size; and for each (start, size) in
    ``halves``, one draw's two halves (the normals of each Box-Muller pair)
    are uncorrelated, and so are their squares (a shared radius)."""
    import math
    x = np.ravel(np.asarray(x, np.float64))
    n = x.size
    assert abs(x.mean()) < 3.3 / math.sqrt(n), x.mean()
    assert abs(x.var() - 1) < 3.3 * math.sqrt(2 / n), x.var()
    assert abs(np.mean(x ** 4) - 3) < 3.3 * math.sqrt(96 / n), np.mean(x ** 4)
    z = np.sort(x)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
    ranks = np.arange(1, n + 1) / n
    ks = max(np.max(ranks - cdf), np.max(cdf - (ranks - 1 / n)))
    assert ks < 1.95 / math.sqrt(n), ks      # p = 0.001
    for start, size in halves:
        half = size // 2
        a, b = x[start:start + half], x[start + size - half:start + size]
        bound = 3.3 / math.sqrt(half)
        assert abs(np.corrcoef(a, b)[0, 1]) < bound, (start, size)
        assert abs(np.corrcoef(a * a, b * b)[0, 1]) < bound, (start, size)


def test_float32_noise_generator_is_standard_normal():
    """float32 noise is drawn by Box-Muller (_standard_normal): its values
    follow N(0, 1), the two normals of each uniform pair are independent."""
    n = 400_001
    x = _per_example._standard_normal(
        np.random.Generator(np.random.Philox(key=5)), n, np.float32)
    assert x.dtype == np.float32 and x.shape == (n,)
    assert_standard_normal(x, [(0, n)])


def test_noise_std_and_seed():
    xs, loss, variables = _mlp(tf.float64)
    clip, multiplier, m = 0.5, 1.3, 3

    def step(seed):
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, clip, multiplier,
                                num_microbatches=m, seed=seed)

    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    clean = tape.dp_gradient(losses, variables, clip, num_microbatches=m)
    noise = np.concatenate([
        np.concatenate([np.ravel(g - c) for g, c in zip(step(s), clean)])
        for s in range(40)])
    expected = clip * multiplier / m
    assert noise.size > 1000
    assert abs(noise.std() / expected - 1) < 0.06, (noise.std(), expected)
    assert abs(noise.mean()) < 0.1 * expected
    for a, b in zip(step(7), step(7)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(step((1, 2)), step((1, 2))):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(step(7)[0], step(8)[0])
    # Unseeded noise differs call to call.
    assert not np.array_equal(step(None)[0], step(None)[0])


@pytest.fixture
def unseeded():
    """No global seed (an earlier test's keras.utils.set_random_seed would
    make every call's noise seeded), restored after."""
    old = context.global_seed()
    tf.random.set_seed(None)
    yield
    tf.random.set_seed(old)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_unseeded_noise_is_drawn_ahead_and_each_vector_used_once(dtype, unseeded):
    """Unseeded noise vectors come from a pool drawn ahead (_Pool): each
    call gets a vector of its own (no two calls' noise is equal), the noise
    has the stddev asked for, a fill draws one vector first and then twice
    as many each time up to the pool's bound, and clear_caches() (TF's
    context._clear_caches too) empties it."""
    xs, loss, variables = _mlp(dtype)
    clip, multiplier = 0.5, 1.3
    pool = _per_example._pool

    def step(multiplier):
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, clip, multiplier)

    clean = np.concatenate([np.ravel(g) for g in step(0.0)])
    fasttape.clear_caches()
    assert not pool.rows()
    noises, fills = [], []
    for _ in range(40):
        noises.append(np.concatenate([np.ravel(g) for g in step(multiplier)])
                      - clean)
        (rows, _), = pool.rows().values()
        fills.append(rows)
    assert fills[:8] == [1, 2, 2, 4, 4, 4, 4, 8], fills
    size = clean.size
    assert max(fills) <= max(1, _per_example._Pool.POOL_VALUES // size)
    for i, a in enumerate(noises):
        for b in noises[i + 1:]:
            assert not np.allclose(a, b)
    noise = np.concatenate(noises)
    expected = clip * multiplier / B
    assert abs(noise.std() / expected - 1) < 0.06, (noise.std(), expected)
    assert abs(noise.mean()) < 0.1 * expected
    context.context()._clear_caches()  # pylint: disable=protected-access
    assert not pool.rows()


def test_unseeded_noise_pool_keeps_a_few_keys_and_holds_large_sizes_not():
    """The pool keeps at most MAX_KEYS sizes (the last used), and a vector
    over half its bound is drawn one at a time (nothing held ahead)."""
    pool = _per_example._Pool()
    for n in (10, 20, 30, 40, 50):
        pool.take(n, np.float32, 1.0)
        pool.take(n, np.float32, 1.0)
    assert sorted(k[0] for k in pool.rows()) == [20, 30, 40, 50]
    big = _per_example._Pool.POOL_VALUES // 2 + 1
    for _ in range(3):
        t = pool.take(big, np.float32, 1.0)
        assert t.shape == (big,)
    assert pool.rows()[(big, np.float32, 1.0, context.context().device_name)] == (1, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_draws_noise_of_its_own(unseeded):
    """After os.fork the child does not replay the parent's unseeded noise
    (its generator and pool are new), as a data-parallel DP job's workers
    forked from one parent would otherwise add the same noise."""
    rng = _per_example._unseeded_rng()
    rng.random(3)
    _per_example._pool.take(5, np.float32, 1.0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:    # the child: numpy only
        try:
            fresh = (not _per_example._unseeded
                     and not _per_example._pool.rows())
            x = _per_example._unseeded_rng().standard_normal(16)
            os.write(write, bytes([fresh]) + x.tobytes())
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while len(data) < 1 + 16 * 8:
        chunk = os.read(read, 4096)
        if not chunk:
            break
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    assert data[0] == 1
    child = np.frombuffer(data[1:], np.float64)
    parent = rng.standard_normal(16)
    assert child.shape == (16,)
    assert not np.array_equal(child, parent)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_noise_of_a_large_source_in_blocks(dtype):
    """A source larger than one noise block gets its noise a block of rows
    at a time, added into the gradient's buffer: every block has its own
    draws, the noise has the stddev asked for, a seed (or tf.random.set_seed)
    repeats it, and the clipped sum under it is unchanged."""
    rows, cols = 300, 256          # two blocks of rows: [0, 256), [256, 300)
    assert rows * cols > _per_example._NOISE_CHUNK
    rng = np.random.default_rng(5)
    w = tf.Variable(rng.normal(size=(rows, cols)) / 20, dtype=dtype)
    x = tf.constant(rng.normal(size=(B, rows)), dtype=dtype)
    clip, multiplier = 0.5, 2.0

    def step(multiplier, seed=None):
        with fasttape.GradientTape() as tape:
            losses = tf.reduce_sum(tf.tanh(x @ w), axis=1)
        return tape.dp_gradient(losses, [w], clip, multiplier, seed=seed)[0]

    clean = step(0.0).numpy()
    noisy = step(multiplier, seed=3).numpy()
    np.testing.assert_array_equal(noisy, step(multiplier, seed=3).numpy())
    noise = noisy - clean
    expected = clip * multiplier / B
    assert abs(noise.std() / expected - 1) < 0.03, (noise.std(), expected)
    tail = noise[256:]
    assert not np.allclose(tail, noise[:tail.shape[0]])
    tf.random.set_seed(11)
    first = step(multiplier).numpy()
    tf.random.set_seed(11)
    np.testing.assert_array_equal(first, step(multiplier).numpy())
    assert not np.array_equal(first, step(multiplier).numpy())


def test_mixing_raises_value_error():
    xs, loss, variables = _mlp(tf.float32)
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
        losses = losses - tf.reduce_mean(losses, axis=0)
    with pytest.raises(ValueError, match="Mean op .*batch axis"):
        tape.per_example_gradients(losses, variables)


def test_mixing_names_the_line_under_anomaly_mode():
    import keras  # pylint: disable=import-outside-toplevel
    x = tf.random.normal([B, 4])
    dense = keras.layers.Dense(3)
    bn = keras.layers.BatchNormalization()
    dense(x)
    bn(dense(x), training=True)
    with fasttape.detect_anomaly():
        with fasttape.GradientTape() as tape:
            z = bn(dense(x), training=True)  # the mixing line
            losses = tf.reduce_sum(z * z, axis=-1)
    with pytest.raises(ValueError, match="test_per_example.py:[0-9]+ reduces"):
        tape.dp_gradient(losses, dense.trainable_variables, 1.0)


def test_losses_must_be_per_example():
    xs, loss, variables = _mlp(tf.float32)
    with fasttape.GradientTape() as tape:
        total = tf.reduce_sum(loss(*xs))
    with pytest.raises(ValueError, match=r"shape \[batch\]"):
        tape.per_example_norms(total, variables)


def test_tape_use_follows_gradient():
    xs, loss, variables = _mlp(tf.float32)
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    tape.per_example_norms(losses, variables)
    with pytest.raises(RuntimeError, match="only be used to compute one"):
        tape.gradient(losses, variables)
    with fasttape.GradientTape(persistent=True) as tape:
        losses = loss(*xs)
    g1 = tape.gradient(losses, variables)
    pe = tape.per_example_gradients(losses, variables)
    tape.dp_gradient(losses, variables, 1.0)
    tape.per_example_norms(losses, variables)
    g2 = tape.gradient(losses, variables)
    for a, b, p in zip(g1, g2, pe):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(tf.reduce_sum(p, 0), a, rtol=1e-5, atol=1e-6)


def test_graph_mode_no_longer_refused():
    """Inside tf.function the methods run (compat/test_per_example_traced.py
    checks their values)."""
    xs, loss, variables = _mlp(tf.float32)

    @tf.function
    def step():
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, 1.0)

    assert [g.shape for g in step()] == [v.shape for v in variables]


def test_unconnected_source_is_none():
    xs, loss, variables = _mlp(tf.float32)
    other = tf.Variable(1.0)
    with fasttape.GradientTape(persistent=True) as tape:
        losses = loss(*xs)
    assert tape.per_example_gradients(losses, [other])[0] is None
    assert tape.dp_gradient(losses, {"a": other}, 1.0) == {"a": None}
    np.testing.assert_array_equal(tape.per_example_norms(losses, [other]),
                                  np.zeros(B))


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_source_listed_twice(mode):
    """A variable listed twice among the sources: per_example_gradients
    gives its rows at both places, as gradient() gives its gradient (the
    second listing came back None); per_example_norms and dp_gradient,
    where it would count once or twice in each example's norm, raise."""
    xs, loss, variables = _mlp(tf.float64)
    w1, b1, w2, _ = variables
    sources = [w1, b1, w2, w1, {"again": b1}]
    ref = _reference(loss, xs, [w1, b1, w2], key="mlp")

    def rows():
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.per_example_gradients(losses, sources)
    got = rows() if mode == "eager" else tf.function(rows)()
    for g, r in zip(tf.nest.flatten(got), ref + [ref[0], ref[1]]):
        _close(g, r, tf.float64)
    for method, args in (("per_example_norms", ()), ("dp_gradient", (1.0,))):
        def refused(method=method, args=args):
            with fasttape.GradientTape() as tape:
                losses = loss(*xs)
            return getattr(tape, method)(losses, sources, *args)
        with pytest.raises(ValueError, match="source 3 .* is source 0 listed again"):
            refused() if mode == "eager" else tf.function(refused)()


def _dp_step(dtype=tf.float32, noise=1.0, case="mlp"):
    xs, loss, variables = ALL[case](dtype)
    for x in xs:
        # (an eager tensor makes its TensorShape on first use and keeps it:
        # the inputs' own, made now, not counted as new by leak checks run
        # over a step that traces a pass and reads them first)
        x.shape  # pylint: disable=pointless-statement

    def step():
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, 1.0, noise, seed=1)

    return step


@pytest.mark.parametrize("case", ["mlp", "embedding_resource"])
def test_dp_step_leaks_nothing(case):
    """The eager step (no traced post-pass: building one leaves a traced
    graph's reference cycles once)."""
    from compat.harness import assert_leaks_nothing, compiled_mode
    with compiled_mode("off"):
        assert_leaks_nothing(_dp_step(case=case))


def test_unseeded_noise_pool_passes_leak_checks(unseeded):
    """The pool of unseeded noise holds eager tensors between calls: TF's
    leak decorators (which empty caches through context._clear_caches, as
    fasttape's are) see no new tensor and no uncollectable garbage, and no
    step leaves a reference cycle."""
    from compat.harness import assert_leaks_nothing
    xs, loss, variables = _mlp(tf.float32)

    def steps():
        for _ in range(5):
            with fasttape.GradientTape() as tape:
                losses = loss(*xs)
            tape.dp_gradient(losses, variables, 1.0, 1.0)
        assert _per_example._pool.rows()

    assert_leaks_nothing(steps)


# mlp: the post-pass fused to the backward pass; fallback: traced after
# it (a source takes per-example rows); the Einsum, depthwise and folded
# rows rules (the last on a payload the analysis copies each step)
@pytest.mark.parametrize("case", ["mlp", "fallback", "einsum_heads",
                                  "depthwise_same", "folded_rows",
                                  "embedding_resource"])
@pytest.mark.parametrize("mode", ["auto", "verify"])
def test_traced_post_pass_passes_leak_checks(mode, case):
    """dp_gradient's traced post-pass (one cached function per structure):
    TF's leak decorators see no new tensor and no uncollectable garbage
    (building included), a replayed step leaves no reference cycle, and
    clear_caches() releases the function."""
    from compat.harness import _cyclic_garbage, compiled_mode
    step = _dp_step(case=case)
    with compiled_mode(mode):
        # TF's process-wide state of a first trace (as compat/test_leaks.py
        # warms up)
        for _ in range(3):
            step()
        fasttape.clear_caches()
        for check in (test_util.assert_no_new_tensors,
                      test_util.assert_no_garbage_created):
            def body(self):
                del self
                # built, replayed (and remembered), called as remembered
                for _ in range(5):
                    step()
            check(body)(tf.test.TestCase())
        before = context.context().list_function_names()
        fasttape.clear_caches()
        # (the backward pass is compiled too, on some step: its output
        # gradients come apart then, and the post-pass's key changes once)
        for _ in range(6):
            step()
        assert _compiled.CACHE.stats["post_replayed"] >= 1, _compiled.CACHE.stats
        built = context.context().list_function_names() - before
        assert any(name.startswith(("__inference_traced",
                                    "__inference_backward")) for name in built)
        assert not _cyclic_garbage(step)
        fasttape.clear_caches()
        gc.collect()
        assert not context.context().list_function_names() & built


# -- ops that move rows across the batch axis: rules stand down ---------------
# Each loss_i still depends on one example only, but some op on the path
# moves rows across axis 0, so an op rule reading row j as example j would
# be wrong with no error. The reference is the definition itself: the
# gradient of losses[i] on the full batch, for each i.


def _time_major(dtype):
    """x [B, T, d] run time-major ([T, B, d], T == B) through a matmul."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(B, B, 4))
    w, bias = _var(rng, (4, 3), dtype), _var(rng, (3,), dtype)

    def loss(x):
        z = tf.matmul(tf.transpose(x, [1, 0, 2]), w) + bias   # [T, B, 3]
        return tf.reduce_sum(tf.tanh(tf.transpose(z, [1, 0, 2])) ** 2, [1, 2])
    return [tf.constant(x, dtype)], loss, [w, bias]


def _permuted(dtype):
    """A dense layer whose rows are permuted before the loss."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(B, 5))
    w = _var(rng, (5, 3), dtype)
    perm = tf.constant([3, 0, 5, 1, 4, 2])

    def loss(x):
        return tf.reduce_sum(tf.sin(tf.gather(x @ w, perm)), -1)
    return [tf.constant(x, dtype)], loss, [w]


def _mixed_by_a_product(dtype):
    """A dense layer whose rows a [B, B] constant mixes before the loss
    (V @ h): every example's loss reads every example's row."""
    rng = np.random.default_rng(9)
    x = rng.normal(size=(B, 5))
    w = _var(rng, (5, 3), dtype)
    v = tf.constant(rng.normal(size=(B, B)), dtype)

    def loss(x):
        return tf.reduce_sum(tf.sin(v @ tf.tanh(x @ w)), -1)
    return [tf.constant(x, dtype)], loss, [w]


def _mixed_by_a_transposed_product(dtype):
    """h [B, B] computed from the weight, then h^T @ V: each row of the
    product is a column of h, which holds one value of every example."""
    rng = np.random.default_rng(10)
    x = rng.normal(size=(B, 5))
    w = _var(rng, (5, B), dtype)
    v = tf.constant(rng.normal(size=(B, 2)), dtype)

    def loss(x):
        h = tf.tanh(x @ w)
        return tf.reduce_sum(tf.sin(tf.linalg.matmul(h, v, transpose_a=True)), -1)
    return [tf.constant(x, dtype)], loss, [w]


def _full_batch_reference(loss, xs, variables):
    rows = []
    for i in range(B):
        with tf.GradientTape() as t:
            li = loss(*xs)[i]
        rows.append(t.gradient(li, variables))
    return [tf.stack([r[k] for r in rows]) for k in range(len(variables))]


@pytest.mark.parametrize("build", [_permuted, _mixed_by_a_product,
                                   _mixed_by_a_transposed_product],
                         ids=["permuted", "mixed_by_a_product",
                              "mixed_by_a_transposed_product"])
def test_rows_permuted_or_mixed_across_the_batch_axis_raise(build):
    """A gather that permutes the rows (each loss another example's), a
    [B, B] product summing over the batch axis: refused."""
    xs, loss, variables = build(tf.float32)
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    with pytest.raises(ValueError, match="mixes examples"):
        tape.per_example_norms(losses, variables)


# (an input run time-major before any recorded op reads it, T == B: its
# batch axis cannot be told from time's, and a sum over either may mix
# the examples: refused)
_AMBIGUOUS = pytest.mark.xfail(strict=True, raises=ValueError, reason=(
    "a time-major input as long as the batch, transposed before any "
    "recorded op: which axis is the batch's is ambiguous, refused"))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@_AMBIGUOUS
@pytest.mark.parametrize("build", [_time_major], ids=["time_major"])
def test_rows_moved_across_the_batch_axis(build, dtype):
    xs, loss, variables = build(dtype)
    ref = _full_batch_reference(loss, xs, variables)
    with fasttape.GradientTape(persistent=True) as tape:
        losses = loss(*xs)
    for g, r in zip(tape.per_example_gradients(losses, variables), ref):
        _close(g, r, dtype)
    _close(tape.per_example_norms(losses, variables), _ref_norms(ref), dtype)
    flat = [v.handle for v in variables]
    analysis = _per_example._analyse("test", tape._tape, losses, flat,
                                     variables, B)
    assert not analysis.ruled and analysis.fallback


_ROW_MIXERS = {
    "cumsum_over_the_batch": lambda h: tf.cumsum(h, axis=0),
    "segments_of_rows": lambda h: tf.math.unsorted_segment_sum(
        h, [0, 0, 1, 1, 2, 2], B),
    "gather_nd_of_rows": lambda h: tf.gather_nd(h, [[1], [0], [3], [2], [5], [4]]),
    "padded_along_the_batch": lambda h: tf.pad(h, [[1, 0], [0, 0]])[:B],
    "solved_against": lambda h: tf.linalg.solve(
        tf.eye(B) * 4.0 + tf.ones([B, B]), h),
    "triangular_solved_against": lambda h: tf.linalg.triangular_solve(
        tf.eye(B) * 4.0 + tf.linalg.band_part(tf.ones([B, B]), -1, 0), h),
    "sparse_product": lambda h: tf.sparse.sparse_dense_matmul(
        tf.sparse.from_dense(tf.eye(B) + tf.roll(tf.eye(B), 1, 0)), h),
}




@pytest.mark.parametrize("mode,mixer", [
    pytest.param(mode, mixer, id=f"{name}-{mixer}")
    for name, mode in (("eager", None), ("function", {}),
                       ("jit", {"jit_compile": True}))
    for mixer in [None] + list(_ROW_MIXERS)
    # (XLA compiles no sparse product: TF's own step fails there too)
    if not (name == "jit" and mixer == "sparse_product")])
def test_rows_mixed_after_a_rule_are_refused(mode, mixer):
    """V @ h with V [B, B] (mixer None), a cumsum or segment sum over the
    batch, a gather_nd of rows, a pad along the batch, a linear solve or a
    sparse product against the rows, after a dense layer: eager, traced
    and jit, refused (the known mixers say what they do; the others are
    not known to keep the examples apart): rows taken over the whole
    batch would be no example's own gradients."""
    xs, loss, variables = _mixed_by_a_product(tf.float32)
    if mixer is not None:
        w = variables[0]

        def loss(x):
            return tf.reduce_sum(tf.sin(_ROW_MIXERS[mixer](tf.tanh(x @ w))), -1)

    def step(x):
        with fasttape.GradientTape(persistent=True) as tape:
            losses = loss(x)
        return tape.per_example_gradients(losses, variables)
    run = step if mode is None else tf.function(step, **mode)
    with pytest.raises(ValueError, match="mix(es)? examples"):
        run(*xs)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_rows_permuted_before_a_rule_raise(mode):
    """Rows permuted (after a time-major transpose) before a dense layer:
    loss i reads another example's row, so it is not example i's loss:
    refused (its rows and norms would go to the wrong examples)."""
    rng = np.random.default_rng(18)
    x = tf.constant(rng.normal(size=(B, B, 4)), tf.float32)
    w0, w, bias = (_var(rng, s, tf.float32) for s in ((4, 4), (4, 3), (3,)))
    perm = tf.constant([3, 0, 5, 1, 4, 2])

    def loss(x):
        h = tf.transpose(tf.tanh(x @ w0), [1, 0, 2])     # [T, B, 4], T == B
        z = tf.gather(tf.reduce_sum(h, 1), perm) @ w + bias
        return tf.reduce_sum(tf.sin(z), -1)
    variables = [w0, w, bias]

    def step(x):
        with fasttape.GradientTape(persistent=True) as tape:
            losses = loss(x)
        return tape.per_example_norms(losses, variables)
    with pytest.raises(ValueError, match="mixes examples"):
        step(x) if mode == "eager" else tf.function(step)(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.xfail(strict=True, raises=ValueError, reason=(
    "a batch folded with time in the middle ([T*B, d], time-major) is not "
    "followed through the reshape: refused"))
def test_time_major_rows_folded_into_one_matmul(dtype):
    """x [B, T, d] run time-major and folded ([T*B, d] @ W, T = 2B, so every
    leading axis on the path is a multiple of B), reshaped to [T, B, n] and
    summed over time: the MatMul's rows are not grouped by example, and
    neither W nor the bias takes a rule (the values are B single-example
    tapes')."""
    rng = np.random.default_rng(12)
    t = 2 * B
    x = tf.constant(rng.normal(size=(B, t, 4)), dtype)
    w, bias = _var(rng, (4, 3), dtype), _var(rng, (3,), dtype)

    def loss(x):
        rows = tf.reshape(tf.transpose(x, [1, 0, 2]), [-1, 4])
        z = tf.reshape(rows @ w, [t, -1, 3]) + bias            # [T, B, 3]
        return tf.reduce_sum(tf.reduce_sum(tf.tanh(z) ** 2, 0), -1)
    variables = [w, bias]
    ref = _full_batch_reference(loss, [x], variables)
    with fasttape.GradientTape(persistent=True) as tape:
        losses = loss(x)
    for g, r in zip(tape.per_example_gradients(losses, variables), ref):
        _close(g, r, dtype)
    _close(tape.per_example_norms(losses, variables), _ref_norms(ref), dtype)
    assert len(tape.summary().per_example_rows[1]) == 2


@pytest.mark.parametrize("method", ["per_example_gradients", "per_example_norms",
                                    "dp_gradient"])
def test_memory_budget_is_refused_loudly(method):
    """A budget may drop the saved tensors the rules read: refused with a
    clear error, never a wrong value."""
    xs, loss, variables = ALL["mlp"](tf.float32)
    with fasttape.GradientTape(memory_budget=0) as tape:
        losses = loss(*xs)
    args = (1.0,) if method == "dp_gradient" else ()
    with pytest.raises(NotImplementedError, match="memory_budget"):
        getattr(tape, method)(losses, variables, *args)


@pytest.mark.parametrize("method", ["per_example_gradients", "per_example_norms",
                                    "dp_gradient"])
def test_summary_and_debug_log_name_the_rows_sources(method, caplog):
    """The sources that took per-example rows (a tied weight: two uses, no
    op rule) are named in tape.summary() and in a DEBUG log line, with the
    op types using them; a source with a rule is not."""
    import logging
    xs, loss, variables = _fallback(tf.float32)
    kernel, tied = variables
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    assert tape.summary().per_example_rows is None
    args = (1.0,) if method == "dp_gradient" else ()
    tf_logger = logging.getLogger("tensorflow")
    level = tf_logger.level
    tf_logger.setLevel(logging.DEBUG)
    try:
        with caplog.at_level(logging.DEBUG, logger="tensorflow"):
            getattr(tape, method)(losses, variables, *args)
    finally:
        tf_logger.setLevel(level)
    summary = tape.summary()
    assert summary.consumed
    what, rows = summary.per_example_rows
    assert what == method
    assert [name for name, _ in rows] == [f"{tied.name} (2, 2)"]
    assert "BatchMatMulV2" in rows[0][1]
    text = str(summary)
    assert (f"per-example rows (no op rule) for 1 source(s): {tied.name} (2, 2)"
            in text)
    assert "(3, 3, 2, 2)" not in text
    logged = [r.getMessage() for r in caplog.records
              if "per-example rows" in r.getMessage()]
    assert len(logged) == 1 and f"{tied.name} (2, 2)" in logged[0], logged

    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    getattr(tape, method)(losses, [kernel], *args)
    assert tape.summary().per_example_rows == (method, ())
    assert "an op rule for every source" in str(tape.summary())


@pytest.mark.parametrize("case", ["mlp", "fallback"])
def test_compiled_post_pass_replays_after_a_reseed(case):
    """tf.random.set_seed drops every traced function's kernels: a built
    post-pass (fused or traced) is instantiated again and replayed, not
    left eager from then on."""
    from compat.harness import compiled_mode
    step = _dp_step(case=case)
    fasttape.clear_caches()
    with compiled_mode("auto"):
        for _ in range(4):
            step()
        stats = _compiled.CACHE.stats
        assert stats["post_built"] >= 1
        tf.random.set_seed(3)
        replayed = stats["post_replayed"]
        for _ in range(3):
            step()
        assert stats["post_replayed"] == replayed + 3, stats


# -- the analysis and fused plan kept per structure ---------------------------

def _checked_dp_step(xs, loss, variables, n):
    """dp_gradient on step n (new variable values and inputs from step 1
    on), checked against the loop of single-example tapes."""
    if n:
        for v in variables:
            v.assign(v * 0.5 + 0.1)
        xs = [x * (1.0 + n) for x in xs]
    ref = _reference(loss, xs, variables)
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    got = tape.dp_gradient(losses, variables, 0.7)
    weights = tf.minimum(1.0, 0.7 / _ref_norms(ref)) / B
    for g, r in zip(got, ref):
        _close(g, tf.tensordot(weights, r, 1), tf.float64)


def test_cached_analysis_serves_new_values():
    """A second step of the same structure takes the kept analysis and
    fused plan, on its own tensors: its gradients are this step's (checked
    against the loop of single-example tapes), not the first step's."""
    fasttape.clear_caches()
    xs, loss, variables = _mlp(tf.float64)
    for n in range(3):
        _checked_dp_step(xs, loss, variables, n)
    assert len(_per_example._ANALYSES) == 1
    assert len(_per_example._FUSED_PLANS) == 1
    fasttape.clear_caches()
    assert not _per_example._ANALYSES and not _per_example._FUSED_PLANS


def test_remembered_fused_pass_serves_new_values_and_leaves_with_the_cache(
        monkeypatch):
    """Once the fused pass was replayed for a kept plan, later steps of the
    structure call it on their own tensors without a plan of their own:
    their gradients are theirs (new inputs and variables each step, against
    the loop of single-example tapes). A pass the cache dropped is not
    called again: the step goes through the cache (and builds it again)."""
    fasttape.clear_caches()
    xs, loss, variables = _mlp(tf.float64)

    def step(n):
        _checked_dp_step(xs, loss, variables, n)

    stats = _compiled.CACHE.stats
    for n in range(4):      # eager, built, replayed (and remembered), ...
        step(n)
    (record,) = _per_example._FUSED_PLANS.values()
    remembered = record[-1]
    assert remembered is not None and remembered.payloads is None
    replayed, failed = stats["post_replayed"], stats["replay_failed"]
    through_the_cache = []
    gradient = _compiled.gradient
    monkeypatch.setattr(_compiled, "gradient", lambda *a, **k: (
        through_the_cache.append(1), gradient(*a, **k))[1])
    for n in range(4, 7):
        step(n)
    assert not through_the_cache
    assert stats["post_replayed"] == replayed + 3
    assert stats["replay_failed"] == failed
    assert record[-1] is remembered
    # the cache drops it (other keys pushed it out): built again
    for i in range(_compiled._MAX_ENTRIES):
        _compiled.CACHE.store(("another key", i), _compiled._FAILED)
    assert remembered.compiled.evicted
    built = stats["post_built"]
    for n in range(7, 10):
        step(n)
    assert stats["post_built"] == built + 1
    assert record[-1] is not remembered and not record[-1].compiled.evicted
    fasttape.clear_caches()
    assert record[-1].compiled.evicted and not _per_example._FUSED_PLANS


def test_cached_analysis_keys_on_reduction_axes():
    """Two losses of equal shapes and op types that differ in a reduction
    axis alone: after the one over axis 1 was analysed (and kept), the one
    over the batch axis still raises, and the first still gives the loop's
    norms (the axes' values are part of the key)."""
    fasttape.clear_caches()
    x = tf.constant(np.random.default_rng(0).normal(size=(B, B)))
    w = tf.Variable(np.eye(B))

    def run(ax):
        with fasttape.GradientTape() as tape:
            losses = tf.reduce_sum(tf.sin(x @ w), axis=ax)
        return tape.per_example_norms(losses, [w])

    def one(x1):
        return tf.reduce_sum(tf.sin(x1 @ w), axis=1)
    expected = _ref_norms(_reference(one, [x], [w]))
    _close(run(1), expected, tf.float64)
    assert len(_per_example._ANALYSES) == 1
    with pytest.raises(ValueError, match="batch axis"):
        run(0)
    _close(run(1), expected, tf.float64)
    fasttape.clear_caches()
