"""Per-example gradients and the DP step on drawn programs nobody tuned
the rules to: chains of Keras 3 layers (dense, convolutions strided,
dilated, depthwise and transposed, normalizations in inference, recurrent
layers, attention, pooling) and of raw TF ops (einsum, gather with
batch_dims, a while loop over time, segment sums, linear algebra, moves
across the batch axis), batches of 1, 2 and odd sizes, inside tf.function
(traced) in float64, against a loop of single-example tf.GradientTape's.
The drawing is fixed (derandomized) and small: wider searches over the
same draws, in every mode, came out clean."""

import keras
import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fasttape

L = keras.layers
DT = "float64"
K = 6


def _keras_layer(kind):
    """kind -> (layer(s) as a function of the running tensor, rank after)."""
    return {
        "dense": lambda h: L.Dense(4, activation="tanh", dtype=DT)(h),
        "conv1d_dilated": lambda h: L.Conv1D(3, 2, dilation_rate=2, padding="same",
                                             dtype=DT)(h),
        "conv1d_strided": lambda h: L.Conv1D(3, 2, strides=2, padding="same",
                                             dtype=DT)(h),
        "conv1d_transpose": lambda h: L.Conv1DTranspose(2, 2, strides=2, dtype=DT)(h),
        "separable1d": lambda h: L.SeparableConv1D(3, 2, padding="same", dtype=DT)(h),
        "layer_norm": lambda h: L.LayerNormalization(dtype=DT)(h),
        "group_norm": lambda h: L.GroupNormalization(groups=h.shape[-1],
                                                     dtype=DT)(h),
        "batch_norm": lambda h: L.BatchNormalization(dtype=DT)(h, training=False),
        "gru": lambda h: L.GRU(3, return_sequences=True, dtype=DT)(h),
        "simple_rnn": lambda h: L.SimpleRNN(2, return_sequences=True, dtype=DT)(h),
        "attention": lambda h: L.MultiHeadAttention(2, 2, dtype=DT)(h, h),
        "max_pool": lambda h: L.MaxPooling1D(2, padding="same", dtype=DT)(h),
    }[kind]


KERAS_KINDS = ["dense", "conv1d_dilated", "conv1d_strided", "conv1d_transpose",
               "separable1d", "layer_norm", "group_norm", "batch_norm", "gru",
               "simple_rnn", "attention", "max_pool"]


def _keras_program(kinds, batch, seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4, 2), dtype=DT)
    h = inp
    for kind in kinds:
        h = _keras_layer(kind)(h)
    out = L.Dense(3, dtype=DT)(L.Flatten(dtype=DT)(h))
    model = keras.Model(inp, out)
    rng = np.random.default_rng(seed)
    for w in model.weights:     # moving statistics too: nothing trivial
        v = w.numpy()
        w.assign(np.abs(rng.normal(size=v.shape)) + 0.5 if "variance" in w.path
                 else v + 0.3 * rng.normal(size=v.shape))
    x = tf.constant(rng.normal(size=(batch, 4, 2)), DT)

    def loss(x):
        return tf.reduce_sum(tf.sin(model(x, training=False)), axis=1)
    return x, loss, model.trainable_variables


def _raw_op(kind, rng, batch, variables):
    def var(shape):
        v = tf.Variable(rng.normal(size=shape) * 0.5, dtype=DT)
        variables.append(v)
        return v
    if kind == "dense":
        w, b = var((K, K)), var((K,))
        return lambda h: tf.tanh(h @ w + b)
    if kind == "einsum_outer":
        w = var((K, K))
        return lambda h: tf.reduce_sum(tf.einsum("bi,bj->bij", h, h) * w, 2) * 0.1
    if kind == "gather_batch_dims":
        idx = tf.constant(rng.integers(0, K, size=(batch, K)), tf.int32)
        return lambda h: tf.gather(h, idx, batch_dims=1)
    if kind == "while_over_time":
        u, wi = var((2, 2)), var((3, 2))

        def loop(h):
            x = tf.reshape(h, [-1, 2, 3])
            _, s = tf.while_loop(
                lambda t, s: t < 2,
                lambda t, s: (t + 1, tf.tanh(s @ u + x[:, t] @ wi)),
                (tf.constant(0), tf.zeros_like(x[:, 0, :2])))
            return tf.concat([s, s * 2, s ** 2], 1)
        return loop
    if kind == "segment_sum_then_einsum":
        seg = tf.constant([0, 0, 1, 2, 2, 3], tf.int32)
        w = var((4, K))
        return lambda h: tf.einsum("bi,ij->bj", tf.transpose(
            tf.math.segment_sum(tf.transpose(h), seg)), w)
    if kind == "cholesky":
        def chol(h):
            a = tf.reshape(h[:, :4], [-1, 2, 2])
            m = a @ tf.linalg.matrix_transpose(a) + tf.eye(2, dtype=DT)
            return tf.concat([tf.reshape(tf.linalg.cholesky(m), [-1, 4]), h[:, 4:]], 1)
        return chol
    if kind == "roll_batch":
        return lambda h: tf.roll(h, 1, axis=0)
    if kind == "scan_batch":
        return lambda h: tf.scan(lambda a, r: a * 0.5 + r, h)
    if kind == "matvec":
        w = var((K, K))
        return lambda h: tf.linalg.matvec(w, h)
    assert kind == "param_per_row"
    p = var((batch, K))        # a parameter as long as the batch
    return lambda h: h * p + p


RAW_KINDS = ["dense", "einsum_outer", "gather_batch_dims", "while_over_time",
             "segment_sum_then_einsum", "cholesky", "roll_batch", "scan_batch",
             "matvec", "param_per_row"]


def _raw_program(kinds, batch, seed):
    rng = np.random.default_rng(seed)
    variables = []
    fns = [_raw_op(kind, rng, batch, variables) for kind in kinds]
    head = tf.Variable(rng.normal(size=(K, 2)), dtype=DT)
    variables.append(head)
    x = tf.constant(rng.normal(size=(batch, K)), DT)

    def loss(x):
        h = x
        for f in fns:
            h = f(h)
        return tf.reduce_logsumexp(h @ head, axis=1)
    return x, loss, variables


def _loop(loss, x, variables):
    rows = []
    for i in range(x.shape[0]):
        with tf.GradientTape() as tape:
            li = loss(x)[i]
        rows.append([tf.convert_to_tensor(g) for g in tape.gradient(
            li, variables, unconnected_gradients="zero")])
    return [np.stack([r[k].numpy() for r in rows]) for k in range(len(variables))]


def _check(x, loss, variables):
    ref = _loop(loss, x, variables)
    batch = x.shape[0]
    norms = np.sqrt(sum((r.reshape(batch, -1) ** 2).sum(1) for r in ref))
    clip = float(np.median(norms)) if batch > 1 else float(norms[0]) / 2
    scale = np.minimum(1.0, clip / norms)
    expected = [np.tensordot(scale, r, 1) / batch for r in ref]

    @tf.function
    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        per_example = tape.per_example_gradients(losses, variables)
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        return per_example, tape.dp_gradient(losses, variables, clip)
    per_example, dp = step(x)
    size = max(np.abs(r).max() for r in ref)
    for g, r in zip(per_example, ref):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-9, atol=1e-11 * size)
    size = max(np.abs(e).max() for e in expected)
    for g, e in zip(dp, expected):
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), e, rtol=1e-9,
                                   atol=1e-11 * size)


_SETTINGS = settings(max_examples=3, derandomize=True, database=None,
                     deadline=None, suppress_health_check=list(HealthCheck))


# (a derandomized draw starts from its simplest programs: these first)
@_SETTINGS
@given(kinds=st.lists(st.sampled_from(KERAS_KINDS), min_size=1, max_size=3),
       batch=st.sampled_from([1, 2, 3]), seed=st.integers(0, 100))
@example(kinds=["conv1d_dilated", "attention", "layer_norm"], batch=3, seed=4)
@example(kinds=["group_norm", "gru", "batch_norm"], batch=2, seed=5)
def test_drawn_keras_chains_traced(kinds, batch, seed):
    _check(*_keras_program(kinds, batch, seed))
    keras.backend.clear_session()


@_SETTINGS
@given(kinds=st.lists(st.sampled_from(RAW_KINDS), min_size=1, max_size=4),
       batch=st.sampled_from([1, 2, 5]), seed=st.integers(0, 100))
@example(kinds=["roll_batch", "einsum_outer"], batch=3, seed=1)
@example(kinds=["segment_sum_then_einsum", "while_over_time"], batch=2, seed=2)
@example(kinds=["gather_batch_dims", "param_per_row", "scan_batch", "matvec"],
         batch=5, seed=3)
def test_drawn_raw_op_chains_traced(kinds, batch, seed):
    _check(*_raw_program(["dense"] + kinds, batch, seed))
