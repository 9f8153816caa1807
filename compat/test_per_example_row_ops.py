"""Per-example gradients whatever op follows a dense layer: a probe over
many TF ops (row-wise ones, ones that move or mix rows across the batch
axis, ones on no list), eager and traced (a few under jit_compile),
against the gradient of each loss of the full batch by tf.GradientTape,
in float64. An op rule reads row j of its op's output gradient as example
j's; the analysis trusts only the ops it knows keep the rows
(backward._row_ops), sends the parameters read before an op that keeps
the examples apart while it moves them to the exact per-example rows,
and refuses an op not known to keep them apart."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow.experimental.numpy as tnp

import fasttape
from fasttape.backward import _row_ops
from compat.harness import TOLERANCES

B, K = 4, 6
DTYPE = tf.float64
# (an op known to mix the examples says what it does; any other not known
# to keep them apart "may mix" them)
MIXES = "mix(es)? examples"
_V = tf.constant(np.random.default_rng(5).normal(size=(B, B)), DTYPE)
_SCALE = tf.Variable(2.0, dtype=DTYPE)
_KERNEL = tf.constant(np.random.default_rng(6).normal(size=(3, 1, 1, 1)), DTYPE)


def _image(h):
    return tf.reshape(h, [B, 2, 3, 1])


def _over_the_batch(h):
    """h as one [1, B, K, 1] image: the batch is its height."""
    return tf.expand_dims(tf.expand_dims(h, 0), -1)


def _back(img):
    return tf.squeeze(img, [0, 3])


# name -> (h [B, K] -> a tensor leading with B, what the dense layer before
# it takes: "rule" where the op provably keeps the rows, "rows" where it
# keeps the examples apart but moves them (exact, slower), "any"; "mixes"
# where the op mixes the examples along the batch axis, or is not known to
# keep them apart: the analysis raises)
PROBES = {
    # row-wise
    "softmax": (tf.nn.softmax, "rule"),
    "logsumexp_rows": (lambda h: tf.reduce_logsumexp(h, axis=1), "rule"),
    "l2_normalize_rows": (lambda h: tf.math.l2_normalize(h, axis=1), "rule"),
    "concat_features": (lambda h: tf.concat([h, h ** 2], 1), "rule"),
    "pad_features": (lambda h: tf.pad(h, [[0, 0], [1, 2]]), "rule"),
    "gather_features": (lambda h: tf.gather(h, [2, 0, 5], axis=1), "rule"),
    "tile_features": (lambda h: tf.tile(h, [1, 2]), "rule"),
    "split_features": (lambda h: tf.concat(tf.split(h, 2, axis=1)[::-1], 1), "rule"),
    "cumsum_features": (lambda h: tf.cumsum(h, axis=1), "rule"),
    "where": (lambda h: tf.where(h > 0, h, 0.1 * h), "rule"),
    "expand_squeeze": (lambda h: tf.squeeze(tf.expand_dims(h, 1) * 2.0, 1), "rule"),
    "folded_rows": (lambda h: tf.reshape(
        tf.reshape(h, [B * 3, 2]) * tf.constant([1.0, 2.0], DTYPE), [B, K]), "rule"),
    "outer_per_row": (lambda h: h[:, :, None] * h[:, None, :], "rule"),
    "einsum_rows": (lambda h: tf.einsum("bi,ij->bj", h, tf.ones([K, 3], DTYPE)),
                    "rule"),
    "image_flip_left_right": (lambda h: tf.image.flip_left_right(_image(h)), "rule"),
    "image_brightness_crop": (lambda h: tf.image.central_crop(
        tf.image.adjust_brightness(_image(h), 0.1), 0.5), "rule"),
    "tnp_fliplr": (tnp.fliplr, "rule"),
    "band_part_per_example": (
        lambda h: tf.linalg.band_part(tf.reshape(h, [B, 2, 3]), 0, -1), "any"),
    "top_k_per_row": (lambda h: tf.math.top_k(h, 3).values, "any"),
    "sort_per_row": (lambda h: tf.sort(h, axis=1), "any"),
    "cross_per_row": (lambda h: tf.linalg.cross(h[:, :3], h[:, 3:]), "any"),
    # across the batch axis
    "sort_batch_vector": (lambda h: tf.sort(h[:, 0]), "mixes"),
    "sort_axis0": (lambda h: tf.sort(h, axis=0), "mixes"),
    "top_k_batch_vector": (lambda h: tf.math.top_k(h[:, 1], B).values, "mixes"),
    "top_k_transposed": (
        lambda h: tf.transpose(tf.math.top_k(tf.transpose(h), B).values), "mixes"),
    "roll_batch": (lambda h: tf.roll(h, 1, axis=0), "mixes"),
    # (while tracing, rows by a loop: pfor's Roll converter moves an axis
    # counted from the end to the next one)
    "roll_batch_from_the_end": (lambda h: tf.roll(h, [1, 2], axis=[-2, -1]), "mixes"),
    # (a leading ellipsis that stands for no axis: the batch reversed)
    "ellipsis_reverse_batch": (lambda h: h[..., ::-1, :], "mixes"),
    "ellipsis_features": (lambda h: h[..., ::-1], "rule"),
    # (a shape read from the rows, the value broadcast no example's: a
    # weight, so that the tape records it)
    "broadcast_to_shape_of_rows": (
        lambda h: h * tf.broadcast_to(_SCALE, tf.shape(h)), "rule"),
    "reverse_v1_batch": (
        lambda h: tf.raw_ops.Reverse(tensor=h, dims=[True, False]), "mixes"),
    "softmax_batch_vector": (lambda h: tf.nn.softmax(h[:, 0]), "mixes"),
    "softmax_axis0": (lambda h: tf.nn.softmax(h, axis=0), "mixes"),
    "band_part_of_product": (
        lambda h: tf.linalg.band_part(h @ tf.transpose(h), -1, 0), "mixes"),
    "fft_batch_vector": (lambda h: tf.math.real(
        tf.signal.fft(tf.cast(h[:, 0], tf.complex128))), "mixes"),
    "fft_axis0_via_transpose": (lambda h: tf.transpose(tf.math.real(
        tf.signal.fft(tf.cast(tf.transpose(h), tf.complex128)))), "mixes"),
    "scan_batch": (lambda h: tf.scan(lambda a, r: a * 0.5 + r, h), "mixes"),
    "einsum_ij_jk": (lambda h: tf.einsum("ij,jk->ik", _V, h), "mixes"),
    "pool_over_batch": (lambda h: tf.squeeze(tf.nn.avg_pool1d(
        tf.expand_dims(h, 0), 2, 1, "SAME"), 0), "mixes"),
    "conv_over_batch": (lambda h: _back(tf.nn.conv2d(
        _over_the_batch(h), _KERNEL, 1, "SAME")), "mixes"),
    "resize_over_batch": (lambda h: _back(tf.image.resize(tf.image.resize(
        _over_the_batch(h), [2, K], "nearest"), [B, K], "nearest")), "mixes"),
    "image_rot90_batch": (
        lambda h: tf.squeeze(tf.image.rot90(h[:, :B, None]), -1), "mixes"),
    "tnp_flipud": (tnp.flipud, "mixes"),
    "tnp_cumsum_axis0": (lambda h: tnp.cumsum(h, axis=0), "mixes"),
    "tnp_diff_axis0": (lambda h: tf.concat([tnp.diff(h, axis=0), h[:1]], 0), "mixes"),
    "tnp_outer": (lambda h: tnp.outer(h[:, 0], h[:, 1]), "mixes"),
    "scatter_row": (lambda h: tf.tensor_scatter_nd_update(h, [[0]], h[1:2]), "mixes"),
}


def _model(probe):
    rng = np.random.default_rng(7)
    x = tf.constant(rng.normal(size=(B, 5)), DTYPE)
    w = tf.Variable(rng.normal(size=(5, K)), dtype=DTYPE, name="w")
    b = tf.Variable(rng.normal(size=(K,)), dtype=DTYPE, name="b")
    head = tf.Variable(rng.normal(size=(1,)), dtype=DTYPE, name="head")

    def loss(x):
        h = tf.tanh(x @ w + b)
        out = tf.reshape(tf.sin(probe(h)), [B, -1])
        # a scale after the probe: its rule reads only the head's rows
        return tf.reduce_sum(out[:, :1] * head + out, axis=1)
    return x, loss, [w, b, head]


def _reference(loss, x, variables):
    rows = []
    for i in range(B):
        with tf.GradientTape() as tape:
            li = loss(x)[i]
        rows.append(tape.gradient(li, variables))
    return [tf.stack([r[k] for r in rows]) for k in range(len(variables))]


def _per_example(loss, x, variables, traced):
    rules = []

    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        out = tape.per_example_gradients(losses, variables)
        rules.append(dict(tape.summary().per_example_rules[1]))
        return out
    if traced == "jit":
        got = tf.function(step, jit_compile=True)(x)
    else:
        got = tf.function(step)(x) if traced else step(x)
    return got, list(rules[-1].values())


# Under jit_compile, a few of each kind (compiling all of them costs a
# minute): rules, rows by an op that moves them, rows by a loop over the
# batch. (ResizeNearestNeighborGrad has no XLA kernel: TF's tape raises too.)
JIT_PROBES = ["softmax", "folded_rows", "outer_per_row", "roll_batch",
              "scan_batch", "einsum_ij_jk"]


@pytest.mark.parametrize("name,traced", [
    pytest.param(name, traced, id=f"{name}-{'function' if traced else 'eager'}")
    for name in PROBES for traced in (False, True)])
def test_any_op_after_a_rule_is_exact(name, traced):
    _check_probe(name, traced)


@pytest.mark.parametrize("name", JIT_PROBES)
def test_any_op_after_a_rule_is_exact_under_jit(name):
    _check_probe(name, "jit")


def _check_probe(name, traced):
    probe, expected = PROBES[name]
    x, loss, variables = _model(probe)
    if expected == "mixes":
        with pytest.raises(ValueError, match=MIXES):
            _per_example(loss, x, variables, traced)
        return
    ref = _reference(loss, x, variables)
    got, rules = _per_example(loss, x, variables, traced)
    rtol, atol = TOLERANCES[DTYPE]
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=rtol * 20,
                                   atol=atol * 20)
    dense = rules[:2]
    if expected == "rule":
        assert "per-example rows" not in dense, rules
    elif expected == "rows":
        assert dense == ["per-example rows"] * 2, rules


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
def test_moments_over_the_batch_mix_examples(traced):
    def probe(h):
        mean, variance = tf.nn.moments(h, [0])
        return (h - mean) * tf.math.rsqrt(variance + 1e-3)
    x, loss, variables = _model(probe)
    with pytest.raises(ValueError, match=MIXES):
        _per_example(loss, x, variables, traced)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
def test_an_op_on_no_list_is_refused_by_name(traced):
    """Dawson's integral, elementwise, is on no list: the analysis cannot
    tell that it keeps the examples apart, and refuses it (rows taken
    across it would be wrong for an op that mixes them), naming it."""
    assert "Dawsn" not in _row_ops.ROW_OPS
    x, loss, variables = _model(tf.math.special.dawsn)
    with pytest.raises(ValueError, match="may mix examples: a Dawsn op .*"
                       "not known to keep examples apart"):
        _per_example(loss, x, variables, traced)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
def test_a_reverse_by_mask_over_the_features_keeps_the_rules(traced):
    """Reverse (TF's first reverse, by a mask of axes) over the features
    keeps each example's row: every parameter keeps its rule."""
    def probe(h):
        return tf.raw_ops.Reverse(tensor=h, dims=[False, True])
    x, loss, variables = _model(probe)
    ref = _reference(loss, x, variables)
    got, rules = _per_example(loss, x, variables, traced)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-9)
    assert "per-example rows" not in rules


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
def test_a_product_of_parameters_has_no_examples_rows(traced):
    """A learned position table times a weight ([T, d] @ [d, n], T == B)
    added to every example: the product's rows are positions, not
    examples, so the weight's MatMul rule does not apply (it read them as
    examples' rows: errors near 3); both take rows."""
    rng = np.random.default_rng(8)
    x = tf.constant(rng.normal(size=(B, B, 2)), DTYPE)
    pos = tf.Variable(rng.normal(size=(B, 3)), dtype=DTYPE)
    w = tf.Variable(rng.normal(size=(3, 2)), dtype=DTYPE)

    def loss(x):
        return tf.reduce_sum(tf.tanh(x + (pos @ w)[None]) ** 2, axis=[1, 2])
    ref = _reference(loss, x, [pos, w])
    got, rules = _per_example(loss, x, [pos, w], traced)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-9, atol=1e-12)
    assert rules == ["per-example rows"] * 2


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
def test_a_softmax_over_the_batch_mixes_examples(traced):
    x, loss, variables = _model(PROBES["softmax_axis0"][0])
    with pytest.raises(ValueError, match=MIXES):
        _per_example(loss, x, variables, traced)


# (not converted by AutoGraph, which reads a function's source from disk
# when it first traces it: this one's first trace comes late in the file,
# and an edit to the file in between once made it convert another def and
# raise TypeError; the root conftest also keeps the imported source)
@tf.function(autograph=False)
def _centered(h):
    return h - tf.reduce_mean(h, 0)


_BODIES = {
    "cond": lambda h: tf.cond(tf.constant(True), lambda: h - tf.reduce_mean(h, 0),
                              lambda: h),
    "while": lambda h: tf.while_loop(
        lambda i, s: i < 1, lambda i, s: (i + 1, s - tf.reduce_mean(s, 0)), (0, h),
        maximum_iterations=1)[1],
    "function": _centered,
}


@pytest.mark.parametrize("where", list(_BODIES))
def test_a_mean_over_the_batch_inside_a_traced_body_mixes_examples(where):
    """Traced, a tf.cond's branch, a while loop's body and a nested
    tf.function are one op on the path (an If, a While, a call): a mean
    over the batch inside it mixes the examples, and raises as it does
    eagerly, where its ops are on the path (it took rows: the gradients of
    losses that each depend on every example)."""
    x, loss, variables = _model(_BODIES[where])
    with pytest.raises(ValueError, match=MIXES):
        _per_example(loss, x, variables, True)


def test_an_input_whose_batch_is_unknown_while_tracing_moved_across_it():
    """The input's batch unknown while tracing ([None, B, 2]) but the
    losses' known (a reshape to constant sizes): a Transpose that moves
    the input's batch axis, then reshaped to [B, B, 2] (each row mixes
    examples): refused at the Reshape."""
    rng = np.random.default_rng(9)
    x = tf.constant(rng.normal(size=(B, B, 2)), DTYPE)
    w = tf.Variable(rng.normal(size=(2,)), dtype=DTYPE)
    c = tf.constant(rng.normal(size=(B, 2)), DTYPE)

    def loss(x):
        z = tf.reshape(tf.transpose(x * w, [1, 0, 2]), [B, B, 2])
        return tf.reduce_sum(tf.sin(z * c), axis=[1, 2])

    @tf.function(input_signature=[tf.TensorSpec([None, B, 2], DTYPE)])
    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        return tape.per_example_gradients(losses, [w])[0]
    with pytest.raises(ValueError, match="a Reshape op .* not known to keep"):
        step(x)


# (op on x [3, 4, 5], the batch's axis in x -> its axis after the op; None:
# not known to keep the examples apart there)
_AXES = [
    # on axis 0 an op keeps the batch there or is refused (the walk takes
    # it to stay): a new axis before it is refused, off axis 0 followed
    ("expand_before_batch", lambda x: tf.expand_dims(x, 0), 0, None),
    ("expand_before_time_major_batch", lambda x: tf.expand_dims(x, 0), 1, 2),
    ("expand_after_batch", lambda x: tf.expand_dims(x, -1), 1, 1),
    ("sum_over_time", lambda x: tf.reduce_sum(x, 0), 1, 0),
    ("sum_over_features", lambda x: tf.reduce_sum(x, -1), 0, 0),
    ("sum_over_batch", lambda x: tf.reduce_sum(x, 1), 1, None),
    ("sum_kept", lambda x: tf.reduce_sum(x, 0, keepdims=True), 1, 1),
    ("softmax_time_major", tf.nn.softmax, 1, 1),
    ("softmax_over_batch", tf.nn.softmax, 2, None),
    ("cumsum_time_major", lambda x: tf.cumsum(x, -1), 1, 1),
    ("cumsum_over_batch", lambda x: tf.cumsum(x, 1), 1, None),
    ("squeeze_before_batch", lambda x: tf.squeeze(x[:1], 0), 1, 0),
    ("transpose_on_axis0", lambda x: tf.transpose(x, [0, 2, 1]), 0, 0),
    ("transpose_off_axis0", lambda x: tf.transpose(x, [0, 2, 1]), 1, None),
]


@pytest.mark.parametrize("make, axis, want", [a[1:] for a in _AXES],
                         ids=[a[0] for a in _AXES])
def test_the_table_takes_the_batch_axis(make, axis, want):
    """_row_ops.batch_axis: one condition per op for the batch on any
    axis; with it on axis 0, an op keeps it there or is refused (the walk
    on the recorded path takes an op there to keep it, and _row_ops'
    keeps_apart asks whether it does)."""
    from fasttape.backward._per_example import _BodyEntry
    graph = tf.function(make).get_concrete_function(
        tf.TensorSpec([3, 4, 5], tf.float32)).graph
    op = [o for o in graph.get_operations()
          if o.type not in ("Placeholder", "Const", "Identity")][-1]
    ins = [axis] + [-1] * (len(op.inputs) - 1)
    assert _row_ops.batch_axis(_BodyEntry(op), {}, 4, ins) == want
