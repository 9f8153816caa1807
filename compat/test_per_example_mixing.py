"""Ops that mix the examples along the batch axis without reducing over
it (a softmax or a cumsum along it, a sort, a [B, B] product, a tile of
the batch, a roll, reverse or gather of it) make each loss depend on the
other examples: per-example gradients, norms and DP gradients refuse them
("`losses` mixes examples"), eagerly and traced. The same op along a
feature axis keeps the examples apart: its per-example gradients equal a
loop over single examples, each through the model alone."""

import functools

import numpy as np
import pytest
import tensorflow as tf

import fasttape

B, D, K = 4, 3, 6
DTYPE = tf.float64
MIXES = "mix(es)? examples"


def _carried(h, step):
    """A while loop whose carry goes through ``step`` (traced: one While
    op on the path, its body checked)."""
    return tf.while_loop(lambda i, s: i < 2, lambda i, s: (i + 1, step(s)),
                         (0, h), maximum_iterations=2)[1]


# name -> (op along the batch axis, the same op along the features)
OPS = {
    "softmax": (lambda h: tf.nn.softmax(h, axis=0), tf.nn.softmax),
    "softmax_of_a_vector": (lambda h: h * tf.nn.softmax(h[:, 0])[:, None],
                            lambda h: h * tf.nn.softmax(h[:, :2])[:, :1]),
    "log_softmax": (lambda h: tf.nn.log_softmax(h, axis=0), tf.nn.log_softmax),
    "cumsum": (lambda h: tf.cumsum(h, axis=0), lambda h: tf.cumsum(h, axis=1)),
    "cumulative_logsumexp": (lambda h: tf.math.cumulative_logsumexp(h, axis=0),
                             lambda h: tf.math.cumulative_logsumexp(h, axis=1)),
    "sort": (lambda h: tf.sort(h, axis=0), lambda h: tf.sort(h, axis=1)),
    "product_with_itself": (lambda h: h @ tf.transpose(h),
                            lambda h: tf.matmul(h[:, :, None], h[:, None, :])),
    "einsum_over_the_batch": (lambda h: tf.einsum("ij,jk->ik", tf.ones([B, B], DTYPE), h),
                              lambda h: tf.einsum("bi,ij->bj", h, tf.ones([K, 2], DTYPE))),
    "tile_reshaped_back": (lambda h: tf.reshape(tf.tile(h, [2, 1]), [B, 2 * K]),
                           lambda h: tf.tile(h, [1, 2])),
    "roll": (lambda h: tf.roll(h, 1, axis=0), lambda h: tf.roll(h, 1, axis=1)),
    "reverse": (lambda h: tf.reverse(h, [0]), lambda h: tf.reverse(h, [1])),
    "gather": (lambda h: tf.gather(h, [1, 0, 3, 2]),
               lambda h: tf.gather(h, [2, 0, 5], axis=1)),
    "while_carry_rolled": (lambda h: _carried(h, lambda s: s + 0.5 * tf.roll(s, 1, 0)),
                           lambda h: _carried(h, lambda s: s + 0.5 * tf.roll(s, 1, 1))),
}


def _model(op):
    rng = np.random.default_rng(11)
    x = tf.constant(rng.normal(size=(B, D)), DTYPE)
    w = tf.Variable(rng.normal(size=(D, K)) * 0.5, dtype=DTYPE, name="w")
    head = tf.Variable([0.7], dtype=DTYPE, name="head")

    def loss(x):
        z = op(tf.tanh(x @ w))
        z = tf.reshape(z, [tf.shape(x)[0], -1])
        return tf.reduce_sum(tf.sin(z * head + z), axis=1)
    return x, loss, [w, head]


def _loop(loss, x, variables):
    """Each example's own gradient: the model applied to it alone."""
    rows = []
    for i in range(B):
        with tf.GradientTape() as tape:
            li = loss(x[i:i + 1])[0]
        rows.append(tape.gradient(li, variables))
    return [np.stack([r[k].numpy() for r in rows]) for k in range(len(variables))]


def _per_example(loss, x, variables, traced):
    def step(x):
        with fasttape.GradientTape(persistent=True) as tape:
            losses = loss(x)
        return (tape.per_example_gradients(losses, variables),
                tape.per_example_norms(losses, variables))
    return tf.function(step)(x) if traced else step(x)


TRACED = pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])


@TRACED
@pytest.mark.parametrize("name", list(OPS))
def test_an_op_along_the_batch_axis_mixes_examples(name, traced):
    x, loss, variables = _model(OPS[name][0])
    with pytest.raises(ValueError, match=MIXES):
        _per_example(loss, x, variables, traced)


# (a few: each traces its model and runs the loop)
TWINS = ["softmax", "cumsum", "sort", "product_with_itself",
         "tile_reshaped_back", "roll", "gather"]


def test_the_error_says_what_the_op_does():
    x, loss, variables = _model(OPS["cumsum"][0])
    with pytest.raises(ValueError, match="Cumsum op .* accumulates along the "
                       "batch axis .* Compute one loss per example"):
        _per_example(loss, x, variables, False)


@TRACED
def test_a_sum_over_time_of_a_time_major_tensor_as_long_as_the_batch(traced):
    """[T, B, d] with T == B: a Sum over axis 0 sums over time (the batch
    axis followed through the Transpose is 1), not over the examples."""
    rng = np.random.default_rng(12)
    x = tf.constant(rng.normal(size=(B, B, D)), DTYPE)
    w = tf.Variable(rng.normal(size=(D, 2)), dtype=DTYPE)

    def loss(x):
        h = tf.transpose(tf.tanh(x @ w), [1, 0, 2])
        return tf.reduce_sum(tf.sin(tf.reduce_sum(h, 0)), 1)
    want = _loop(loss, x, [w])
    got, _ = _per_example(loss, x, [w], traced)
    np.testing.assert_allclose(got[0].numpy(), want[0], rtol=1e-9, atol=1e-12)


# Ops that move the examples' rows across the batch axis without being
# known mixers: no table says they keep the examples apart, so the
# analysis refuses them ("may mix examples", naming the op); each the
# same along the features, known to keep them apart, equals the loop.
def _fold_batch(h):
    """The batch folded into another axis and back in another order."""
    return tf.reshape(tf.transpose(tf.reshape(h, [2, B // 2, K]), [1, 0, 2]),
                      [B, K])


def _over_rows(fn):
    """fn along the rows of h: h's transpose, and back."""
    return lambda h: tf.transpose(fn(tf.transpose(h)))


def _fft(h):
    return tf.math.real(tf.signal.fft(tf.cast(h, tf.complex128)))


_EYE = tf.eye(2, dtype=DTYPE)
MOVERS = {
    "negative_stride_slice": (lambda h: h[::-1], lambda h: h[:, ::-1], "StridedSlice"),
    "concat_of_slices": (lambda h: tf.concat([h[1:], h[:1]], 0),
                         lambda h: tf.concat([h[:, 1:], h[:, :1]], 1), "StridedSlice"),
    "unstack_stack": (lambda h: tf.stack(tf.unstack(h)[::-1]),
                      lambda h: tf.stack(tf.unstack(h, axis=1)[::-1], 1), "Unpack"),
    "split_concat": (lambda h: tf.concat(tf.split(h, 2, 0)[::-1], 0),
                     lambda h: tf.concat(tf.split(h, 2, 1)[::-1], 1), "Split"),
    "broadcast_of_one_row": (lambda h: tf.broadcast_to(h[:1], [B, K]) + h,
                             lambda h: tf.broadcast_to(h[:, :1], [B, K]) + h,
                             "StridedSlice"),
    "batch_folded_and_back": (_fold_batch, lambda h: tf.reshape(
        tf.transpose(tf.reshape(h, [-1, 2, K // 2]), [0, 2, 1]), [-1, K]), "Reshape"),
    "fft_over_the_batch": (_over_rows(_fft), _fft, "FFT"),
    "inverse_of_a_batch_matrix": (
        lambda h: tf.linalg.inv(h[:, :B] + 3 * tf.eye(B, dtype=DTYPE)),
        lambda h: tf.reshape(tf.linalg.inv(tf.reshape(h[:, :4], [-1, 2, 2]) + 3 * _EYE),
                             [-1, 4]), "MatrixInverse"),
    # (inside a traced loop's body, or a tf.function called eagerly: its
    # ops checked the same way)
    "while_carry_flipped": (lambda h: _carried(h, lambda s: s[::-1] * 0.5 + s),
                            lambda h: _carried(h, lambda s: s[:, ::-1] * 0.5 + s),
                            "StridedSlice"),
    "function_flips_the_batch": (tf.function(lambda h: h[::-1]),
                                 tf.function(lambda h: h[:, ::-1]), "StridedSlice"),
}


@TRACED
@pytest.mark.parametrize("name", list(MOVERS))
def test_an_op_not_known_to_keep_examples_apart_is_refused(name, traced):
    x, loss, variables = _model(MOVERS[name][0])
    with pytest.raises(ValueError, match=f"may mix examples: a {MOVERS[name][2]} op"
                       " .*not known to keep examples apart"):
        _per_example(loss, x, variables, traced)


def _unknown_batch(loss, variables):
    @tf.function(input_signature=[tf.TensorSpec([None, D], DTYPE)])
    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        return tape.per_example_gradients(losses, variables)
    return step


def test_a_move_across_a_batch_unknown_while_tracing_is_refused():
    """The batch unknown while tracing (every source takes rows by pfor):
    a negative-stride slice of it is refused as eagerly, the same along the
    features equals the loop."""
    x, loss, variables = _model(MOVERS["negative_stride_slice"][0])
    with pytest.raises(ValueError, match="a StridedSlice op .*not known to keep"):
        _unknown_batch(loss, variables)(x)
    x, loss, variables = _model(MOVERS["negative_stride_slice"][1])
    want = _loop(loss, x, variables)
    for g, r in zip(_unknown_batch(loss, variables)(x), want):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-9, atol=1e-12)


# (the same moves along the features: a few)
MOVING_TWINS = ["negative_stride_slice", "unstack_stack", "batch_folded_and_back",
                "fft_over_the_batch", "inverse_of_a_batch_matrix",
                "while_carry_flipped", "function_flips_the_batch"]


@TRACED
@pytest.mark.parametrize("name", TWINS + MOVING_TWINS)
def test_the_same_op_along_the_features_equals_the_loop(name, traced):
    x, loss, variables = _model(OPS[name][1] if name in OPS else MOVERS[name][1])
    want = _loop(loss, x, variables)
    got, norms = _per_example(loss, x, variables, traced)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-9, atol=1e-12)
    flat = np.concatenate([r.reshape(B, -1) for r in want], 1)
    np.testing.assert_allclose(norms.numpy(), np.linalg.norm(flat, axis=1),
                               rtol=1e-9)


@pytest.mark.parametrize("layers", [1, 2])
def test_a_dense_on_a_sequence_with_the_batch_unknown_equals_the_loop(layers):
    """tf.tensordot on [B, T, d] with B unknown while tracing (Keras'
    Dense on a sequence): [B*T, d] @ W reshaped back to [B, T, n] keeps
    each example's rows together (their count read off the fold that made
    them): not refused, the loop's values. A second one folds a recorded
    tensor, to a target made from its shape ([prod(B, T), prod(n)]: read
    as far as known while tracing)."""
    rng = np.random.default_rng(13)
    x = tf.constant(rng.normal(size=(B, 5, D)), DTYPE)
    w = tf.Variable(rng.normal(size=(D, 2)), dtype=DTYPE)
    w2 = tf.Variable(rng.normal(size=(2, 3)), dtype=DTYPE)
    variables = [w, w2][:layers]

    def loss(x):
        h = tf.tensordot(x, w, [[2], [0]])
        if layers == 2:
            h = tf.tensordot(tf.tanh(h), w2, [[2], [0]])
        return tf.reduce_sum(tf.sin(h), axis=[1, 2])

    @tf.function(input_signature=[tf.TensorSpec([None, 5, D], DTYPE)])
    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        return tape.per_example_gradients(losses, variables)
    for g, r in zip(step(x), _loop(loss, x, variables)):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-9, atol=1e-12)


def test_rows_folded_time_major_then_unfolded_to_the_batch():
    """x [B, T, d] run time-major and folded outside the tape ([T*B, d] @ W),
    reshaped to [B, T, n] by a target read from tf.shape(x): each example's
    row holds other examples' values, so the per-example gradients must
    equal the loop's or raise (the reshape is refused: its rows are no
    example-major fold's)."""
    t = 4
    rng = np.random.default_rng(21)
    x = tf.constant(rng.normal(size=(B, t, D)), DTYPE)
    w = tf.Variable(rng.normal(size=(D, 3)), dtype=DTYPE)
    weights = np.arange(t * 3, dtype=np.float64).reshape(1, t, 3)

    def loss(x):
        rows = tf.reshape(tf.transpose(x, [1, 0, 2]), [-1, D])
        z = tf.reshape(tf.tanh(rows @ w), [tf.shape(x)[0], -1, 3])
        return tf.reduce_sum(tf.sin(z) * weights, axis=[1, 2])

    @tf.function(input_signature=[tf.TensorSpec([None, t, D], DTYPE)])
    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        return tape.per_example_gradients(losses, [w])
    with pytest.raises(ValueError, match="may mix examples: a Reshape"):
        step(x)


# An input laid out time-major before any recorded op reads it ([T, B, d],
# T not a multiple of B, no input leading with the batch): its batch axis
# is the one of the batch's size, followed as a time-major transpose's.
_TIME_MAJOR = {
    "apart": lambda h: h,
    "roll": lambda h: tf.roll(h, 1, axis=1),
    "moments": lambda h: h - tf.reduce_mean(h, axis=[0, 1]),
    "cumsum": lambda h: tf.cumsum(h, axis=1),
}


@TRACED
@pytest.mark.parametrize("name", list(_TIME_MAJOR))
def test_an_input_time_major_before_the_tape(name, traced):
    """The three ops along the batch axis (1) mix the examples: refused; the
    model without them equals the loop."""
    rng = np.random.default_rng(22)
    x = tf.constant(rng.normal(size=(B, B + 1, D)), DTYPE)
    w = tf.Variable(rng.normal(size=(D, 2)), dtype=DTYPE)

    def loss(x):
        # (x is no source: its transpose is not recorded)
        h = tf.tanh(tf.transpose(x, [1, 0, 2]) @ w)          # [T, B, 2]
        return tf.reduce_sum(tf.sin(_TIME_MAJOR[name](h)), axis=[0, 2])
    if name != "apart":
        with pytest.raises(ValueError, match=MIXES):
            _per_example(loss, x, [w], traced)
        return
    got, _ = _per_example(loss, x, [w], traced)
    np.testing.assert_allclose(got[0].numpy(), _loop(loss, x, [w])[0],
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", [None, {}, {"jit_compile": True}],
                         ids=["eager", "function", "jit"])
def test_losses_as_long_as_no_input_axis_are_refused(mode):
    """losses from h^T h ([K, K] from h [B, K]): K losses, and no input has
    an axis of K, so no row is an example's (each depends on every
    example): refused by each call, where the rows would be silent."""
    rng = np.random.default_rng(23)
    x = tf.constant(rng.normal(size=(B, D)), DTYPE)
    w = tf.Variable(rng.normal(size=(D, K)), dtype=DTYPE)

    def step(x, call):
        with fasttape.GradientTape() as tape:
            h = tf.tanh(x @ w)
            losses = tf.reduce_sum(tf.sin(tf.matmul(h, h, adjoint_a=True)), 1)
        args = (1.0,) if call == "dp_gradient" else ()
        return getattr(tape, call)(losses, [w], *args)
    for call in ("per_example_gradients", "per_example_norms", "dp_gradient"):
        run = functools.partial(step, call=call)
        with pytest.raises(ValueError, match="holds no example's values"):
            run(x) if mode is None else tf.function(run, **mode)(x)


@TRACED
def test_losses_reshaped_last_equals_the_loop(traced):
    """`losses` reshaped to a vector by the last op (tf.reshape(s, [-1])):
    no op reads its output, so only the shape of `losses` says that the
    reshape keeps the batch leading (eagerly it was refused)."""
    rng = np.random.default_rng(24)
    x = tf.constant(rng.normal(size=(B, D)), DTYPE)
    w = tf.Variable(rng.normal(size=(D, K)), dtype=DTYPE)

    def loss(x):
        return tf.reshape(tf.reduce_sum(tf.sin(tf.tanh(x @ w)), 1), [-1])
    got, _ = _per_example(loss, x, [w], traced)
    np.testing.assert_allclose(got[0].numpy(), _loop(loss, x, [w])[0],
                               rtol=1e-9, atol=1e-12)


# Losses whose ops' shapes no recorded op saves eagerly: the analysis
# carries them across (a ZerosLike, a broadcast, a Pack) or reads them from
# the op that saved its output (a Tanh read only by a comparison).
_UNSAVED_SHAPES = {
    "sigmoid_cross_entropy": lambda h: tf.squeeze(
        tf.nn.sigmoid_cross_entropy_with_logits(tf.ones_like(h[:, :1]), h[:, :1]), -1),
    "stacked_and_summed": lambda h: tf.reduce_sum(
        tf.stack([h + 1.0, 2.0 * h], -1), [1, 2]),
    "where_of_a_comparison": lambda h: tf.reduce_sum(
        tf.where(tf.tanh(h @ tf.ones([K, K], DTYPE)) > 0, h, 0.1 * h), 1),
}


@TRACED
@pytest.mark.parametrize("name", list(_UNSAVED_SHAPES))
def test_losses_through_ops_whose_shapes_none_saved_equal_the_loop(name, traced):
    rng = np.random.default_rng(25)
    x = tf.constant(rng.normal(size=(B, D)), DTYPE)
    w = tf.Variable(rng.normal(size=(D, K)), dtype=DTYPE)

    def loss(x):
        return _UNSAVED_SHAPES[name](tf.tanh(x @ w))
    got, _ = _per_example(loss, x, [w], traced)
    np.testing.assert_allclose(got[0].numpy(), _loop(loss, x, [w])[0],
                               rtol=1e-9, atol=1e-12)


def test_a_cross_entropy_over_time_with_the_batch_unknown_equals_the_loop():
    """TF's sparse cross-entropy of [B, T, C] logits and its dense one of
    [B, C] logits, B unknown while tracing (Keras' fit, its last batch
    uneven): they fold the logits to [-1, shape[rank - 1]] (an index and
    a slice computed from the rank); read while tracing, each example's
    rows stay together: not refused, the loop's values."""
    rng = np.random.default_rng(26)
    x = tf.constant(rng.normal(size=(B, 5, D)), DTYPE)
    y = tf.constant(rng.integers(0, 3, size=(B, 5)), tf.int32)
    w = tf.Variable(rng.normal(size=(D, 3)), dtype=DTYPE)

    def loss(x, y):
        logits = tf.tanh(x) @ w
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
        dense = tf.nn.softmax_cross_entropy_with_logits(
            tf.one_hot(y[:, 0], 3, dtype=DTYPE), logits[:, 0])
        return tf.reduce_sum(ce, 1) + dense

    @tf.function(input_signature=[tf.TensorSpec([None, 5, D], DTYPE),
                                  tf.TensorSpec([None, 5], tf.int32)])
    def step(x, y):
        with fasttape.GradientTape() as tape:
            losses = loss(x, y)
        return tape.per_example_gradients(losses, [w])
    want = []
    for i in range(B):
        with tf.GradientTape() as tape:
            li = loss(x[i:i + 1], y[i:i + 1])[0]
        want.append(tape.gradient(li, w).numpy())
    np.testing.assert_allclose(step(x, y)[0].numpy(), np.stack(want),
                               rtol=1e-9, atol=1e-12)


def test_a_repeat_over_time_with_the_batch_unknown_equals_the_loop():
    """tf.repeat of [B, 1, d] along time (Keras' RepeatVector), B unknown
    while tracing: its Tile's multiples are constant ones packed around the
    repeat, computed while tracing; read as far as known, the batch's is 1:
    not refused, the loop's values."""
    rng = np.random.default_rng(27)
    x = tf.constant(rng.normal(size=(B, D)), DTYPE)
    w = tf.Variable(rng.normal(size=(D, 2)), dtype=DTYPE)
    weights = np.arange(8, dtype=np.float64).reshape(1, 4, 2)

    def loss(x):
        h = tf.repeat(tf.expand_dims(tf.tanh(x @ w), 1), 4, axis=1)
        return tf.reduce_sum(tf.sin(h) * weights, axis=[1, 2])

    @tf.function(input_signature=[tf.TensorSpec([None, D], DTYPE)])
    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        return tape.per_example_gradients(losses, [w])
    np.testing.assert_allclose(step(x)[0].numpy(), _loop(loss, x, [w])[0],
                               rtol=1e-9, atol=1e-12)
