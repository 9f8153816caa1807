"""Per-example op rules for dilated, 1-D/3-D and transposed convolutions
and batch norms (BatchNormalization in inference, tf_keras'
LayerNormalization's fused form): per_example_gradients, per_example_norms
and dp_gradient against B single-example tf.GradientTape's, each with its
rule and no per-example rows; eagerly, and in tf.function and under
jit_compile (mode "function", "jit": float32, the traced values against the
eager path's and the loop's, the summary's rules against the eager one's)."""

import numpy as np
import pytest
import tensorflow as tf

import fasttape
from compat.test_per_example import B, DTYPES, _close, _ref_norms, _reference


def _keras_model(kind, name):
    import keras  # pylint: disable=import-outside-toplevel
    L = keras.layers
    if kind == "conv_dilated":
        # the second convolution's input is on the path: SpaceToBatchND too
        return (8, 8, 2), [L.Conv2D(3, 3, activation="tanh", dtype=name),
                           L.Conv2D(2, 2, dilation_rate=2, padding="same",
                                    activation="tanh", dtype=name),
                           L.Conv2D(2, 3, dilation_rate=(2, 1), dtype=name),
                           L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "conv_dilated_wide":
        # (few positions, many channels: the ghost norm, and the clipped
        # sum by TF's kernel gradient of the reweighted blocks)
        return (5, 5, 16), [L.Conv2D(16, 3, dilation_rate=2, padding="same",
                                     dtype=name),
                            L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "conv_many_inputs":
        # many input channels to few outputs, many positions: each
        # example's kernel gradient at stride 1 from the output gradient's
        # shifts (8 channels to 2) or patches of slices (2 to 2; SAME with
        # an odd and an even kernel), from TF's kernel gradient of each
        # example at stride 2
        return (7, 7, 3), [L.Conv2D(8, 1, activation="tanh", dtype=name),
                           L.Conv2D(2, 3, padding="same", activation="tanh",
                                    dtype=name),
                           L.Conv2D(2, 2, padding="same", activation="tanh",
                                    dtype=name),
                           L.Conv2D(2, 3, strides=2, dtype=name),
                           L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "conv_groups":
        # Keras 3 runs a grouped convolution as a call of a jit_compile
        # function: its kernel takes rows, built while tracing by a loop of
        # backward passes (pfor's grouped kernel gradient mixes the
        # examples with the groups)
        return (6, 6, 4), [L.Conv2D(4, 3, groups=2, activation="tanh",
                                    dtype=name),
                           L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "conv1d_dilated":        # WaveNet-style, causal
        return (11, 2), [L.Conv1D(3, 2, dilation_rate=2, padding="causal",
                                  activation="tanh", dtype=name),
                         L.Conv1D(2, 2, dilation_rate=4, padding="causal",
                                  dtype=name),
                         L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "depthwise_dilated":
        return (9, 9, 2), [L.Conv2D(2, 1, activation="tanh", dtype=name),
                           L.DepthwiseConv2D(3, dilation_rate=2,
                                             depth_multiplier=2, dtype=name),
                           L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "depthwise_wide":
        # kernels of 16 taps and more: each example's gradient by a
        # correlation (a stride where oneDNN runs, float32), also on the
        # blocks of a dilated one
        return (9, 9, 2), [L.DepthwiseConv2D(5, padding="same", activation="tanh",
                                             dtype=name),
                           L.DepthwiseConv2D(4, strides=2, padding="same",
                                             activation="tanh", dtype=name),
                           L.DepthwiseConv2D(4, dilation_rate=2, padding="same",
                                             dtype=name),
                           L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "conv3d":
        return (4, 5, 4, 2), [L.Conv3D(3, (2, 3, 2), activation="tanh", dtype=name),
                              # (8 positions: the ghost norm)
                              L.Conv3D(8, 2, strides=2, padding="same", dtype=name),
                              L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "conv3d_dilated":
        # (TF runs it as SpaceToBatchND, Conv3D, BatchToSpaceND: the blocks)
        # (the second: few positions, many channels: the ghost norm, and
        # the clipped sum by TF's kernel gradient of the reweighted blocks)
        return (5, 5, 4, 2), [L.Conv3D(3, 2, dilation_rate=2, padding="same",
                                       activation="tanh", dtype=name),
                              L.Conv3D(8, (3, 3, 2), dilation_rate=2, dtype=name),
                              L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "conv3d_transpose":
        # (the first transposed: 2 positions, the ghost norm and TF's
        # kernel gradient; the second: each example's gradient built)
        return (2, 1, 1, 2), [L.Conv3D(3, 1, activation="tanh", dtype=name),
                              L.Conv3DTranspose(3, 2, strides=2, activation="tanh",
                                                dtype=name),
                              L.Conv3DTranspose(2, (3, 2, 2), padding="same",
                                                dtype=name),
                              L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "conv_transpose":
        return (4, 4, 2), [L.Conv2D(3, 1, activation="tanh", dtype=name),
                           L.Conv2DTranspose(3, 3, strides=2, activation="tanh",
                                             dtype=name),
                           L.Conv2DTranspose(2, 2, padding="same", dtype=name),
                           L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "conv1d_transpose":
        return (5, 2), [L.Conv1DTranspose(3, 3, strides=2, activation="tanh",
                                          dtype=name),
                        L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "lstm":
        return (4, 2), [L.LSTM(3, dtype=name), L.Dense(2, dtype=name)]
    if kind == "simple_rnn":
        return (5, 2), [L.SimpleRNN(3, dtype=name), L.Dense(2, dtype=name)]
    if kind == "gru_sequences":
        # a Dense first: the time-major Transpose and Unpack on the path
        return (4, 2), [L.Dense(3, activation="tanh", dtype=name),
                        L.GRU(3, return_sequences=True, dtype=name),
                        L.GlobalAveragePooling1D(dtype=name),
                        L.Dense(2, dtype=name)]
    if kind == "batchnorm":
        # 6 channels, as many as examples: gamma and beta hold no batch
        return (5, 5, 2), [L.Conv2D(6, 3, dtype=name),
                           L.BatchNormalization(dtype=name),
                           L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "groupnorm":
        return (3, 4), [L.Dense(4, dtype=name), L.GroupNormalization(2, dtype=name),
                        L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    if kind == "groupnorm_dilated":
        # GroupNormalization on the input, then a dilated convolution: the
        # shape of its Reshape back, which no op saved, from
        # SpaceToBatchND's output (else gamma and beta take rows)
        return (7, 7, 2), [L.GroupNormalization(1, dtype=name),
                           L.Conv2D(2, 2, dilation_rate=2, dtype=name),
                           L.Flatten(dtype=name), L.Dense(2, dtype=name)]
    raise KeyError(kind)


def _keras_case(kind):
    def build(dtype):
        import keras  # pylint: disable=import-outside-toplevel
        keras.utils.set_random_seed(0)
        name = tf.as_dtype(dtype).name
        shape, layers = _keras_model(kind, name)
        model = keras.Sequential([keras.Input(shape, dtype=name)] + layers)
        rng = np.random.default_rng(16)
        for layer in layers:        # statistics of a model trained a while
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.moving_mean.assign(rng.normal(size=layer.moving_mean.shape))
                layer.moving_variance.assign(rng.uniform(0.5, 2.0, size=layer.moving_variance.shape))
                layer.gamma.assign(rng.normal(size=layer.gamma.shape))
        x = np.random.default_rng(12).normal(size=(B,) + shape)

        def loss(x):
            return tf.reduce_sum(tf.square(model(x)), axis=-1)
        return [tf.constant(x, dtype)], loss, model.trainable_variables
    return build


def _tf_keras_layernorm(dtype):
    """tf_keras' LayerNormalization after a Dense on a sequence: a fused
    batch norm in training mode over [1, B*T, d, 1] (NCHW), then gamma and
    beta."""
    import tf_keras  # pylint: disable=import-outside-toplevel
    tf_keras.utils.set_random_seed(0)
    name = tf.as_dtype(dtype).name
    model = tf_keras.Sequential([
        tf_keras.Input((3, 4), dtype=name),
        tf_keras.layers.Dense(5, dtype=name),
        tf_keras.layers.LayerNormalization(dtype=name),
        tf_keras.layers.Flatten(dtype=name),
        tf_keras.layers.Dense(2, dtype=name)])
    x = np.random.default_rng(13).normal(size=(B, 3, 4))

    def loss(x):
        return tf.reduce_sum(tf.square(model(x, training=True)), axis=-1)
    return [tf.constant(x, dtype)], loss, model.trainable_variables


def _tf_keras_batchnorm(dtype):
    """tf_keras' BatchNormalization in inference after a Conv2D: one
    FusedBatchNormV3 (is_training false) with gamma and beta as its scale
    and offset (float32: TF's kernel; float64 runs other ops)."""
    import tf_keras  # pylint: disable=import-outside-toplevel
    tf_keras.utils.set_random_seed(0)
    name = tf.as_dtype(dtype).name
    bn = tf_keras.layers.BatchNormalization(dtype=name)
    model = tf_keras.Sequential([
        tf_keras.Input((5, 5, 2), dtype=name),
        tf_keras.layers.Conv2D(3, 3, dtype=name), bn,
        tf_keras.layers.Flatten(dtype=name),
        tf_keras.layers.Dense(2, dtype=name)])
    rng = np.random.default_rng(15)
    bn.moving_mean.assign(rng.normal(size=3))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, size=3))
    x = rng.normal(size=(B, 5, 5, 2))

    def loss(x):
        return tf.reduce_sum(tf.square(model(x, training=False)), axis=-1)
    return [tf.constant(x, dtype)], loss, model.trainable_variables


CASES = {
    "keras_batchnorm_inference": _keras_case("batchnorm"),
    "keras_groupnorm": _keras_case("groupnorm"),
    "keras_groupnorm_dilated": _keras_case("groupnorm_dilated"),
    "keras_lstm": _keras_case("lstm"),
    "keras_simple_rnn": _keras_case("simple_rnn"),
    "keras_gru_sequences": _keras_case("gru_sequences"),
    "keras_conv3d": _keras_case("conv3d"),
    "keras_conv3d_dilated": _keras_case("conv3d_dilated"),
    "keras_conv3d_transpose": _keras_case("conv3d_transpose"),
    "keras_conv_transpose": _keras_case("conv_transpose"),
    "keras_conv1d_transpose": _keras_case("conv1d_transpose"),
    "tf_keras_batchnorm": _tf_keras_batchnorm,
    "keras_conv_dilated": _keras_case("conv_dilated"),
    "keras_conv_dilated_wide": _keras_case("conv_dilated_wide"),
    "keras_conv_many_inputs": _keras_case("conv_many_inputs"),
    "keras_conv_groups": _keras_case("conv_groups"),
    "keras_conv1d_dilated": _keras_case("conv1d_dilated"),
    "keras_depthwise_dilated": _keras_case("depthwise_dilated"),
    "keras_depthwise_wide": _keras_case("depthwise_wide"),
    "tf_keras_layernorm": _tf_keras_layernorm,
}
# Sources that still take rows: a grouped convolution's kernel (its op a
# function call).
ROWS = {"keras_conv_groups": ("kernel (3, 3, 2, 4)",)}
# Keras 3's RNNs in a tf.function are one While op (its steps inside it,
# unseen by the tape): the variables its body reads take the loop's rule
# (the body's MatMul, BiasAdd and Add rules, summed over its iterations),
# where eagerly (the steps unrolled) they take the rules of each step's ops.
RECURRENT = ("keras_lstm", "keras_simple_rnn", "keras_gru_sequences")
MODES = {"eager": None, "function": {}, "jit": {"jit_compile": True}}
PAIRS = [pytest.param(c, d, "eager", id=f"{c}-{d.name}")
         for c in sorted(CASES) for d in DTYPES]
TRACED = [pytest.param(c, tf.float32, m, id=f"{c}-float32-{m}")
          for c in sorted(CASES) for m in ("function", "jit")]


def _expected_rows(case, mode, variables):
    return ROWS.get(case, ())


def _run(mode, fn, *xs):
    """fn(*xs): eagerly, or in a tf.function (with jit_compile)."""
    if MODES[mode] is None:
        return fn(*xs)
    return tf.function(fn, **MODES[mode])(*xs)


def _calls(case, dtype, mode, methods):
    """{method: (its result, the tape's summary)} for each (method, *args),
    each on its own tape, all in one call in ``mode``; and the spy of the
    sources that took traced rows (by method)."""
    xs, loss, variables = CASES[case](dtype)
    summaries, traced_rows = {}, {}

    def step(*xs):
        out = []
        for method, *args in methods:
            with fasttape.GradientTape() as tape:
                losses = loss(*xs)
            with _spy_rows() as keys:
                out.append(getattr(tape, method)(losses, variables, *args))
            summaries[method] = tape.summary()
            traced_rows[method] = sorted(keys)
        return out

    got = _run(mode, step, *xs)
    return dict(zip([m for m, *_ in methods], got)), summaries, traced_rows, (
        xs, loss, variables)


class _spy_rows:
    """The sources _graph_rows builds rows for while tracing (what the
    summary must name as per-example rows)."""

    def __enter__(self):
        from fasttape.backward import _per_example  # pylint: disable=import-outside-toplevel
        self.module, self.keys = _per_example, []
        self.original = original = _per_example._graph_rows  # pylint: disable=protected-access

        def spy(tape, losses, flat_raw, keys, basis=None):
            self.keys += keys
            return original(tape, losses, flat_raw, keys, basis)
        _per_example._graph_rows = spy  # pylint: disable=protected-access
        return self.keys

    def __exit__(self, *exc):
        self.module._graph_rows = self.original  # pylint: disable=protected-access


def _check_summary(summary, method, case, mode, variables, traced_keys):
    what, rows = summary.per_example_rows
    assert what == method
    expected = _expected_rows(case, mode, variables)
    assert tuple(name for name, _ in rows) == expected, case
    what, rules = summary.per_example_rules
    assert what == method
    rows_named = [k for k, (_, how) in enumerate(rules) if how == "per-example rows"]
    assert len(rows_named) == len(expected)
    if mode != "eager":
        # the summary says the truth: rows exactly for the sources the
        # trace built rows for (a source of summed rules took none)
        assert traced_keys == rows_named, (case, traced_keys, rules)
    return [how for _, how in rules]    # (tf_keras names its layers anew)


def _same_rules(case, traced, eager):
    """The traced rules are the eager ones, but for a recurrent layer's
    variables: the loop's rule where eagerly each step's."""
    eager = [how for _, how in eager]
    if case in RECURRENT:
        loop = [k for k, how in enumerate(traced) if how.startswith("While: ")]
        assert loop and all(eager[k].endswith("ops, summed") for k in loop), (
            traced, eager)
        traced = [how for k, how in enumerate(traced) if k not in loop]
        eager = [how for k, how in enumerate(eager) if k not in loop]
    assert traced == eager


@pytest.mark.parametrize("case,dtype,mode", PAIRS + TRACED)
def test_per_example_gradients_and_norms(case, dtype, mode):
    methods = [("per_example_gradients",), ("per_example_norms",)]
    got, summaries, traced, (xs, loss, variables) = _calls(case, dtype, mode, methods)
    ref = _reference(loss, xs, variables, key=("rules", case))
    for g, r, v in zip(got["per_example_gradients"], ref, variables):
        assert g.shape == [B] + v.shape
        _close(g, r, dtype)
    _close(got["per_example_norms"], _ref_norms(ref), dtype)
    rules = {m: _check_summary(summaries[m], m, case, mode, variables, traced[m])
             for m, in methods}
    if mode != "eager":
        # the same rules as eagerly, and the same values
        eager, eager_summaries, _, _ = _calls(case, dtype, "eager", methods)
        for m, in methods:
            _same_rules(case, rules[m], eager_summaries[m].per_example_rules[1])
            for g, e in zip(tf.nest.flatten(got[m]), tf.nest.flatten(eager[m])):
                _close(g, e, dtype)


@pytest.mark.parametrize("case,dtype,mode", PAIRS + TRACED)
def test_dp_gradient(case, dtype, mode):
    xs, loss, variables = CASES[case](dtype)
    ref = _reference(loss, xs, variables, key=("rules", case))
    norms = _ref_norms(ref)
    clip = float(np.median(norms.numpy()))     # some clipped, some not
    scale = clip / tf.maximum(norms, clip)
    expected = [tf.tensordot(scale, g, 1) / B for g in ref]
    eager = None
    for step in range(2):       # the second: the fused, remembered pass
        got, summaries, traced, _ = _calls(case, dtype, mode, [("dp_gradient", clip)])
        rules = _check_summary(summaries["dp_gradient"], "dp_gradient", case,
                               mode, variables, traced["dp_gradient"])
        for g, e in zip(got["dp_gradient"], expected):
            _close(g, e, dtype)
        if mode == "eager":
            continue
        if eager is None:
            eager, eager_summaries, _, _ = _calls(case, dtype, "eager",
                                                  [("dp_gradient", clip)])
        for g, e in zip(got["dp_gradient"], eager["dp_gradient"]):
            _close(g, e, dtype)
        _same_rules(case, rules, eager_summaries["dp_gradient"].per_example_rules[1])
        break           # (traced: one trace; a second would only retrace)


def _folded_batch_norm(shape, data_format):
    """A training batch norm over x [B, 3, 4] reshaped to ``shape`` and
    back: whether it mixes examples depends on its channels."""
    rng = np.random.default_rng(14)
    x = tf.constant(rng.normal(size=(B, 3, 4)), tf.float32)
    w = tf.Variable(rng.normal(size=(4, 4)), dtype=tf.float32)

    def loss(x):
        z = tf.matmul(x, w)
        h = tf.reshape(z, shape)
        # (read at run time: a batch unknown while tracing)
        channels = tf.shape(h)[1] if data_format == "NCHW" else tf.shape(h)[-1]
        ones = tf.ones([channels])      # (float32 only: TF's kernel)
        zeros = tf.zeros([channels])
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(
            h, ones, zeros, data_format=data_format, is_training=True)
        return tf.reduce_sum(tf.sin(tf.reshape(y, tf.shape(z))), axis=[1, 2])
    return x, w, loss


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_norm_folded_per_row_does_not_mix(mode):
    """Each channel one row of one example (tf_keras' LayerNormalization's
    layout): its own rule, the loop's values."""
    x, w, loss = _folded_batch_norm([1, -1, 4, 1], "NCHW")
    summaries = []

    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        got = tape.per_example_gradients(losses, [w])
        summaries.append(tape.summary())
        return got
    got = _run(mode, step, x)
    assert summaries[-1].per_example_rows == ("per_example_gradients", ())
    assert summaries[-1].per_example_rules[1] == (
        (f"{w.name} (4, 4)", "BatchMatMulV2"),)
    _close(got[0], _reference(loss, [x], [w])[0], tf.float32)


@pytest.mark.parametrize("spec", [[None, 3, 4], [B, None, 4]], ids=["batch", "length"])
def test_a_folded_batch_norm_with_shapes_unknown_while_tracing(spec):
    """A batch or sequence length unknown while tracing: a channel of one
    row still lies within one example (its size divides the example's
    known axes): no mixing error, the loop's values (rows or rules); one
    straddling two examples is refused as eagerly."""
    signature = [tf.TensorSpec(spec, tf.float32)]
    x, w, loss = _folded_batch_norm([1, -1, 4, 1], "NCHW")

    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        return tape.per_example_gradients(losses, [w])
    got = tf.function(step, input_signature=signature)(x)
    _close(got[0], _reference(loss, [x], [w])[0], tf.float32)
    x, w, loss = _folded_batch_norm([1, -1, 8, 1], "NCHW")
    with pytest.raises(ValueError, match="mixes examples: a FusedBatchNormV3 op"):
        tf.function(step, input_signature=signature)(x)


def _spy_taken(monkeypatch, cls, name):
    """The kernel shapes for which cls.name (a path of a convolution's
    rule, None where not taken) returns a value, from now on."""
    original, taken = getattr(cls, name), []

    def spy(self, payload, g, src_shape):
        out = original(self, payload, g, src_shape)
        if out is not None:
            taken.append(tuple(src_shape))
        return out
    monkeypatch.setattr(cls, name, spy)
    return taken


@pytest.mark.parametrize("cap", ["default", "small"])
def test_the_sliced_patches_keep_to_their_cap(cap, monkeypatch):
    """At stride 1, a convolution of many input channels to few outputs
    (float64: float32 takes the grouped convolution) builds each example's
    kernel gradient from the output gradient's shifts where they are fewer
    values to copy than the patches (8 channels to 2: _shifted), else from
    gathered patches (eagerly at any stride), while they take at most
    _MAX_SLICED_BYTES (B T K values); beyond, by TF's kernel gradient of
    one example at a time. All
    equal the loop of single-example tapes."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    if cap == "small":      # (the two stride-1 kernels' patches: 18.8 and 2.4 KB)
        monkeypatch.setattr(_norm_rules, "_MAX_SLICED_BYTES", 1024)
    blocks = _norm_rules._Conv2DBlocks  # pylint: disable=protected-access
    sliced, original_sliced = [], blocks._sliced  # pylint: disable=protected-access

    def spy_sliced(self, x, *args):
        sliced.append(tuple(x.shape))
        return original_sliced(self, x, *args)
    monkeypatch.setattr(blocks, "_sliced", spy_sliced)
    looped = _spy_taken(monkeypatch, blocks, "_looped")
    shifted = _spy_taken(monkeypatch, blocks, "_shifted")
    xs, loss, variables = CASES["keras_conv_many_inputs"](tf.float64)
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    got = tape.per_example_gradients(losses, variables)
    for g, r in zip(got, _reference(loss, xs, variables)):
        _close(g, r, tf.float64)
    # the 3x3 and 2x2 kernels at stride 1, and the 3x3 one at stride 2
    # (eagerly gathered too, traced TF's kernel gradient of each example)
    if cap == "default":
        assert shifted == [(3, 3, 8, 2)]
        assert sorted(looped) == [(2, 2, 2, 2), (3, 3, 2, 2)]
        assert len(sliced) == 2
    else:
        assert not shifted and not sliced
        assert sorted(looped) == [(2, 2, 2, 2), (3, 3, 2, 2), (3, 3, 8, 2)]


def _conv_case(rng, x_shape, w_shape, scale, strides=(1, 1), padding="SAME",
               transposed_to=None):
    """x (float64), the kernel w, and each example's loss sum(tanh(y)^2)
    of y = conv2d(x, w) at ``strides``, or conv2d_transpose(x, w) at
    stride 1 to an output of ``transposed_to`` [H, W, C]."""
    x = tf.constant(rng.normal(size=x_shape), tf.float64)
    w = tf.Variable(rng.normal(size=w_shape) * scale, dtype=tf.float64)

    def loss(x):
        if transposed_to is not None:
            y = tf.nn.conv2d_transpose(x, w, [x.shape[0], *transposed_to], 1, padding)
        else:
            y = tf.nn.conv2d(x, w, [1, strides[0], strides[1], 1], padding)
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2, 3])
    return x, w, loss


@pytest.mark.parametrize("kernel,padding,transposed", [
    ((2, 4), "SAME", False), ((3, 2), "VALID", False), ((1, 5), "SAME", False),
    ((2, 3), "SAME", True)])
def test_kernel_gradients_from_the_output_gradients_shifts(kernel, padding, transposed,
                                                           monkeypatch):
    """At stride 1, many input channels to few outputs (float64), each
    example's kernel gradient by the shifts of its output gradient
    (_shifted; a transposed convolution's the other way round, as its
    forward convolution's): even kernels (SAME pads one more after),
    VALID, one row (Conv1D's); per-example gradients, norms and the
    clipped sum equal the loop's."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    shifted = _spy_taken(monkeypatch, _norm_rules._Conv2DBlocks, "_shifted")  # pylint: disable=protected-access
    kh, kw = kernel
    rng = np.random.default_rng(kh * 10 + kw)
    if transposed:      # K [kh, kw, cy 8, cx 2]: its forward convolution 8 -> 2
        x, w, loss = _conv_case(rng, (B, 5, 6, 2), (kh, kw, 8, 2), 0.3, padding=padding,
                                transposed_to=(5, 6, 8))
    else:
        x, w, loss = _conv_case(rng, (B, 5, 7, 9), (kh, kw, 9, 2), 0.3, padding=padding)
    ref = _reference(loss, [x], [w])[0]
    with fasttape.GradientTape(persistent=True) as tape:
        losses = loss(x)
    _close(tape.per_example_gradients(losses, [w])[0], ref, tf.float64)
    norms = _ref_norms([ref])
    clip = float(np.median(norms.numpy()))
    expected = tf.tensordot(clip / tf.maximum(norms, clip), ref, 1) / B
    _close(tape.dp_gradient(losses, [w], clip, 0.0)[0], expected, tf.float64)
    assert shifted and set(shifted) == {(kh, kw, 8 if transposed else 9, 2)}


@pytest.mark.parametrize("kernel,strides,rates,padding", [
    ((3, 2), (2, 3), (1, 1), "SAME"), ((2, 2), (1, 1), (2, 3), "SAME"),
    ((3, 3), (3, 2), (1, 2), "VALID")])
@pytest.mark.parametrize("channels", ["known", "unknown"])
def test_gathered_patches_are_tfs(kernel, strides, rates, padding, channels):
    """_slices' gather gives TF's extract_patches values (any stride and
    dilation, SAME padding one more after), eagerly and traced with the
    batch and, in one case, the channels unknown."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    x = tf.constant(np.random.default_rng(sum(kernel)).normal(size=(3, 7, 8, 5)), tf.float64)
    ref = tf.image.extract_patches(x, [1, *kernel, 1], [1, *strides, 1], [1, *rates, 1],
                                   padding)

    def patches(x):
        return _norm_rules._slices(x, *kernel, ref.shape[1:3], [1, *strides, 1],  # pylint: disable=protected-access
                                   [1, *rates, 1], padding)
    spec = tf.TensorSpec([None, 7, 8, None if channels == "unknown" else 5], tf.float64)
    for got in (patches(x), tf.function(patches, input_signature=[spec])(x)):
        np.testing.assert_array_equal(tf.reshape(got, ref.shape).numpy(), ref.numpy())


@pytest.mark.parametrize("strides,padding", [((2, 2), "SAME"), ((2, 3), "VALID"),
                                            ((3, 2), "SAME")])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_strided_many_inputs_gathered_eagerly(strides, padding, mode, monkeypatch):
    """A strided convolution of many input channels to few outputs over
    many positions (float64: no grouped kernel gradient), eagerly: each
    example's kernel gradient from gathered patches and one batched product
    (_sliced at the op's strides, not B kernel gradients dispatched one by
    one); traced, TF's kernel gradient of each example. Per-example
    gradients, norms and the clipped sum equal the loop's."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    blocks = _norm_rules._Conv2DBlocks  # pylint: disable=protected-access
    sliced, original_sliced = [], blocks._sliced  # pylint: disable=protected-access

    def spy_sliced(self, x, g, src_shape, nb, padding, strides=(1, 1, 1, 1)):
        sliced.append(tuple(strides))
        return original_sliced(self, x, g, src_shape, nb, padding, strides)
    monkeypatch.setattr(blocks, "_sliced", spy_sliced)
    looped = _spy_taken(monkeypatch, blocks, "_looped")
    rng = np.random.default_rng(strides[0] * 10 + strides[1])
    # T 24 to 49 positions: T^2 >= K N 288 (no ghost norm), K 144 > 2 N
    x, w, loss = _conv_case(rng, (B, 13, 14, 16), (3, 3, 16, 2), 0.2, strides, padding)
    _assert_loops_values(mode, loss, x, w)
    assert looped and set(looped) == {(3, 3, 16, 2)}
    if mode == "eager":
        assert sliced and set(sliced) == {(1, strides[0], strides[1], 1)}
    else:
        assert not sliced


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_dilated_patches_in_chunks(mode, monkeypatch):
    """A dilated convolution of many input channels to few outputs (16 to
    6, float64: its space-to-batch blocks' patches gathered, _sliced),
    its patches built a chunk of examples at a time where all of them
    would take more than _CHUNKED_FROM_BYTES (here, chunks of at most 4
    examples' of 6: 4 and 2, each with its 4 blocks); per-example gradients, norms and
    the clipped sum equal the loop's, eagerly, traced and under
    jit_compile."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    # 9x9 SAME, 3x3 dilated 2: 4 blocks of 7x7 to 5x5, 3x3x16 patches
    monkeypatch.setattr(_norm_rules, "_PATCH_CHUNK_BYTES", 4 * 4 * 25 * 144 * 8)
    monkeypatch.setattr(_norm_rules, "_CHUNKED_FROM_BYTES", 1024)
    chunks = _dilated_values_and_patched_rows(mode, monkeypatch, (9, 9, 16),
                                              (3, 3, 16, 6), 2, seed=9, scale=0.2)
    assert chunks and set(chunks) == {4 * 4, 4 * (B - 4)}, chunks


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_dilated_blocks_side_by_side(mode, monkeypatch):
    """A large dilation of a small image (8x8 SAME, 5x5 dilated 3, 8 to
    32 channels, float64: 9 space-to-batch blocks of a few rows each):
    each example's rows of every block side by side in one product, not
    one product a block summed after; per-example gradients, norms and the
    clipped sum equal the loop's. (Mutation tried: the blocks left in
    block-major order, Transpose (0, 1, 2, 3), fails it.)"""
    calls = _dilated_values_and_patched_rows(mode, monkeypatch, (8, 8, 8),
                                             (5, 5, 8, 32), 3, seed=11, scale=0.1)
    assert calls, "the blocks' patches route (_sliced) was not taken"


def _dilated_values_and_patched_rows(mode, monkeypatch, image, kernel, dilations,
                                     seed, scale):
    """_assert_loops_values on a float64 SAME convolution of B images
    ``image`` by ``kernel`` at ``dilations``; returns the rows of each
    patches gather the rules made (_slices)."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    original, rows = _norm_rules._slices, []  # pylint: disable=protected-access

    def spy(x, *args):
        rows.append(x.shape[0])
        return original(x, *args)
    monkeypatch.setattr(_norm_rules, "_slices", spy)
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(B,) + image), tf.float64)
    w = tf.Variable(rng.normal(size=kernel) * scale, dtype=tf.float64)

    def loss(x):
        y = tf.nn.convolution(x, w, padding="SAME", dilations=dilations)
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2, 3])
    _assert_loops_values(mode, loss, x, w)
    return rows


def _assert_loops_values(mode, loss, x, w, dtype=tf.float64):
    """Per-example gradients, norms and the clipped sum of w (float64,
    or ``dtype``'s tolerance), from one tape each in ``mode``, equal the
    loop of single-example tapes'."""
    ref = _reference(loss, [x], [w])[0]
    norms = _ref_norms([ref])
    clip = float(np.median(norms.numpy()))

    def step(x):
        with fasttape.GradientTape(persistent=True) as tape:
            losses = loss(x)
        return (tape.per_example_gradients(losses, [w])[0],
                tape.per_example_norms(losses, [w]),
                tape.dp_gradient(losses, [w], clip, 0.0)[0])
    got, got_norms, clipped = _run(mode, step, x)
    _close(got, ref, dtype)
    _close(got_norms, norms, dtype)
    _close(clipped, tf.tensordot(clip / tf.maximum(norms, clip), ref, 1) / B, dtype)


@pytest.mark.parametrize("kernel,strides,padding,transposed", [
    ((3, 3), (2, 2), "SAME", False), ((2, 4), (2, 3), "SAME", False),
    ((3, 2), (2, 1), "VALID", False), ((4, 4), (1, 1), "SAME", True),
    ((1, 3), (1, 2), "VALID", False)])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_patches_gathered_at_any_stride(kernel, strides, padding, transposed, mode,
                                        monkeypatch):
    """Float64 patches over 8 channels or more, taken by one gather of the
    padded input's positions (_slices): strided (the ghost norm's or the
    batched product's patches, _Conv2D._flat: 3x3 at stride 2, an even kernel with
    unequal strides, SAME padding one more after), VALID, one row, and a
    transposed convolution's at stride 1 (its forward convolution 16 -> 4
    channels: _sliced); per-example gradients, norms and the clipped sum
    equal the loop's (float64, eagerly and in a tf.function)."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    original, sliced = _norm_rules._slices, []  # pylint: disable=protected-access

    def spy(x, *args):
        sliced.append(tuple(x.shape))
        return original(x, *args)
    monkeypatch.setattr(_norm_rules, "_slices", spy)
    kh, kw = kernel
    rng = np.random.default_rng(kh * 10 + kw)
    if transposed:      # K [kh, kw, cy 16, cx 4]
        x, w, loss = _conv_case(rng, (B, 6, 5, 4), (kh, kw, 16, 4), 0.2, padding=padding,
                                transposed_to=(6, 5, 16))
    else:   # (K = 8 kh kw at most 2 N: the patches, not the loop's (_looped))
        x, w, loss = _conv_case(rng, (B, 9, 8, 8), (kh, kw, 8, 4 * kh * kw), 0.2,
                                strides, padding)
    _assert_loops_values(mode, loss, x, w)
    assert sliced and set(sliced) == {(B, 6, 5, 16) if transposed else (B, 9, 8, 8)}


@pytest.mark.parametrize("kernel,strides,dilations,channels,padding,transposed", [
    ((3, 2, 2), 1, 1, 8, "SAME", False), ((2, 3, 1), 1, 1, 8, "VALID", False),
    ((3, 3, 2), 1, 1, 2, "SAME", True), ((3, 2, 3), (2, 1, 2), 1, 2, "SAME", False),
    ((2, 2, 3), 2, 1, 1, "VALID", False), ((2, 3, 2), 1, (2, 1, 2), 3, "SAME", False)])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_volume_patches_gathered(kernel, strides, dilations, channels, padding, transposed,
                                 mode, monkeypatch):
    """A Conv3D's volume patches (a Conv3DTranspose's forward convolution:
    its output gradient's), in float64 at any stride, dilation and number
    of channels, gathered from the padded input's positions (_gathered:
    no identity kernel, which Eigen's float64 convolution runs slowly;
    even kernels: SAME pads one more after); per-example gradients, norms
    and the clipped sum equal the loop's (float64), eagerly and in a
    tf.function."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    original, sliced = _norm_rules._gathered, []  # pylint: disable=protected-access

    def spy(x, *args):
        sliced.append(tuple(x.shape))
        return original(x, *args)
    monkeypatch.setattr(_norm_rules, "_gathered", spy)
    # (the patches, not the slices of many inputs to few outputs: _Conv3D._sliced)
    monkeypatch.setattr(_norm_rules._Conv3D, "_looped", lambda *args: None)  # pylint: disable=protected-access
    rng = np.random.default_rng(sum(kernel))
    cx = 2 if transposed else channels
    x = tf.constant(rng.normal(size=(B, 4, 5, 3, cx)), tf.float64)
    w = tf.Variable(rng.normal(size=kernel + ((channels, 2) if transposed else (channels, 3)))
                    * 0.3, dtype=tf.float64)

    def loss(x):
        if transposed:
            y = tf.nn.conv3d_transpose(x, w, [x.shape[0], 4, 5, 3, channels], 1, padding)
        elif dilations == 1:
            step = strides if isinstance(strides, tuple) else (strides,) * 3
            y = tf.nn.conv3d(x, w, (1,) + step + (1,), padding)
        else:
            y = tf.nn.convolution(x, w, strides, padding, dilations=dilations)
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2, 3, 4])
    _assert_loops_values(mode, loss, x, w)
    # (a dilated one as TF runs it: on SpaceToBatchND's blocks)
    assert sliced and all(shape[-1] == channels for shape in sliced)


@pytest.mark.parametrize("kernel,dilations,padding", [
    ((3, 3, 3), 1, "SAME"), ((2, 3, 1), 1, "VALID"), ((2, 2, 3), (2, 1, 2), "SAME"),
    ((2, 1, 2), 2, "VALID")])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_volume_kernel_gradients_from_the_inputs_slices(kernel, dilations, padding, mode,
                                                        monkeypatch):
    """A Conv3D of many input channels to few outputs at stride 1
    (float64): each example's kernel gradient without volume patches, per
    kernel offset the padded input's slice against the output gradient
    (_Conv3D._sliced: odd and even kernels, SAME and VALID, a dilated one
    on SpaceToBatchND's blocks); per-example gradients, norms and the
    clipped sum equal the loop's, eagerly and in a tf.function."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    conv3d, taken = _norm_rules._Conv3D, []  # pylint: disable=protected-access
    original = conv3d._sliced  # pylint: disable=protected-access

    def spy(self, x, g, src_shape, *args):
        taken.append(tuple(src_shape))
        return original(self, x, g, src_shape, *args)
    monkeypatch.setattr(conv3d, "_sliced", spy)
    monkeypatch.setattr(_norm_rules, "_gathered", None)     # (no patches)
    rng = np.random.default_rng(sum(kernel))
    x = tf.constant(rng.normal(size=(B, 5, 4, 6, 6)), tf.float64)
    w = tf.Variable(rng.normal(size=kernel + (6, 2)) * 0.3, dtype=tf.float64)

    def loss(x):
        if dilations == 1:
            y = tf.nn.conv3d(x, w, [1] * 5, padding)
        else:
            y = tf.nn.convolution(x, w, padding=padding, dilations=dilations)
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2, 3, 4])
    _assert_loops_values(mode, loss, x, w)
    assert taken and set(taken) == {kernel + (6, 2)}


def _assert_volume_loops_values(cin, cout, dtype):
    """A 3x2x2 Conv3D at stride 1, SAME, of cin channels to cout, eagerly:
    per-example gradients, norms and the clipped sum equal the loop's."""
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=(B, 4, 5, 3, cin)), dtype)
    w = tf.Variable(rng.normal(size=(3, 2, 2, cin, cout)) * 0.3, dtype=dtype)

    def loss(x):
        return tf.reduce_sum(tf.tanh(tf.nn.conv3d(x, w, [1] * 5, "SAME")) ** 2,
                             axis=[1, 2, 3, 4])
    _assert_loops_values("eager", loss, x, w, dtype)


def _spy_sliced(monkeypatch):
    """The input shapes of the Conv3D offsets' slices (_Conv3D._sliced)
    taken from now on."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    original, sliced = _norm_rules._Conv3D._sliced, []  # pylint: disable=protected-access

    def spy(self, x, *args, **kwargs):
        sliced.append(tuple(x.shape))
        return original(self, x, *args, **kwargs)
    monkeypatch.setattr(_norm_rules._Conv3D, "_sliced", spy)  # pylint: disable=protected-access
    return sliced


def test_volume_offsets_only_with_more_input_channels(monkeypatch):
    """A Conv3D at stride 1 with K > 2 N but fewer input channels than
    outputs (2 to 8, float64: no loop of examples) takes the gathered
    volume patches, not the offsets' slices (_Conv3D._sliced, whose
    products [kw cout, T'] x [T', cin] run slowly with few input channels);
    per-example gradients, norms and the clipped sum equal the loop's."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    sliced, gathered = _spy_sliced(monkeypatch), []
    original_gathered = _norm_rules._gathered  # pylint: disable=protected-access

    def spy_gathered(x, *args):
        gathered.append(tuple(x.shape))
        return original_gathered(x, *args)
    monkeypatch.setattr(_norm_rules, "_gathered", spy_gathered)
    _assert_volume_loops_values(2, 8, tf.float64)
    assert gathered and not sliced


def test_volume_offsets_before_one_example_at_a_time(monkeypatch):
    """Float32 where oneDNN runs, past the thresholds of one example at a
    time (0 here), a Conv3D at stride 1 of more input channels than
    outputs (8 to 2, K > 2 N) takes the offsets' slices (_Conv3D._sliced),
    faster there than a kernel gradient an example; the loop's values."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    if not _norm_rules._groups_run():  # pylint: disable=protected-access
        pytest.skip("one example at a time where TF's oneDNN kernels run")
    monkeypatch.setattr(_norm_rules, "_LOOPED_3D_MIN_POSITIONS", 0)
    monkeypatch.setattr(_norm_rules, "_LOOPED_3D_MIN_MACS", 0)
    by_example = _spy_taken(monkeypatch, _norm_rules._Conv3D, "_by_example")  # pylint: disable=protected-access
    sliced = _spy_sliced(monkeypatch)
    _assert_volume_loops_values(8, 2, tf.float32)
    assert sliced and not by_example


@pytest.mark.parametrize("kernel,strides,dilations,padding,transposed", [
    ((3, 3, 3), 1, 1, "SAME", False), ((2, 3, 2), (2, 1, 2), 1, "VALID", False),
    ((2, 2, 3), 1, (2, 1, 2), "SAME", False), ((3, 2, 2), 2, 1, "SAME", True)])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_volume_kernel_gradients_one_example_at_a_time(kernel, strides, dilations, padding,
                                                       transposed, mode, monkeypatch):
    """Float32 where oneDNN runs, past _LOOPED_3D_MIN_POSITIONS and
    _LOOPED_3D_MIN_MACS (0 here): each example's Conv3D kernel gradient by
    TF's kernel gradient of its rows alone (_Conv3D._by_example: stride 1
    and unequal strides, SAME and VALID, a dilated one on SpaceToBatchND's
    blocks, a Conv3DTranspose's forward convolution); per-example
    gradients, norms and the clipped sum equal the loop's, eagerly and in
    a tf.function."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    if not _norm_rules._groups_run():  # pylint: disable=protected-access
        pytest.skip("one example at a time where TF's oneDNN kernels run")
    monkeypatch.setattr(_norm_rules, "_LOOPED_3D_MIN_POSITIONS", 0)
    monkeypatch.setattr(_norm_rules, "_LOOPED_3D_MIN_MACS", 0)
    taken = _spy_taken(monkeypatch, _norm_rules._Conv3D, "_by_example")  # pylint: disable=protected-access
    rng = np.random.default_rng(sum(kernel) + 7)
    x = tf.constant(rng.normal(size=(B, 6, 5, 4, 3)), tf.float32)
    w = tf.Variable(rng.normal(size=kernel + (3, 4)) * 0.3, dtype=tf.float32)
    step = strides if isinstance(strides, tuple) else (strides,) * 3

    def loss(x):
        if transposed:      # (K [kd, kh, kw, cy 3, cx 4]: x's 3 channels to 4)
            y = tf.nn.conv3d_transpose(
                tf.nn.conv3d(x, tf.ones((1, 1, 1, 3, 4)) * 0.1, [1] * 5, "SAME"), w,
                [x.shape[0], 12, 10, 8, 3], (1,) + step + (1,), padding)
        elif dilations == 1:
            y = tf.nn.conv3d(x, w, (1,) + step + (1,), padding)
        else:
            y = tf.nn.convolution(x, w, padding=padding, dilations=dilations)
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2, 3, 4])
    _assert_loops_values(mode, loss, x, w, tf.float32)
    assert taken and set(taken) == {kernel + (3, 4)}


@pytest.mark.parametrize("kernel,dilation,padding", [
    ((3, 2), 2, "SAME"), ((2, 2), (3, 2), "VALID")])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_dilated_kernel_gradients_from_the_output_gradients_shifts(kernel, dilation, padding,
                                                                   mode, monkeypatch):
    """A dilated convolution of many input channels to few outputs
    (float64), as TF runs it on SpaceToBatchND's blocks: each block's
    kernel gradient from its output gradient's shifts (_shifted), summed
    over each example's blocks; per-example gradients, norms and the
    clipped sum equal the loop's, eagerly and in a tf.function."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    shifted = _spy_taken(monkeypatch, _norm_rules._Conv2DBlocks, "_shifted")  # pylint: disable=protected-access
    rng = np.random.default_rng(kernel[0] * 10 + kernel[1])
    x = tf.constant(rng.normal(size=(B, 9, 10, 9)), tf.float64)
    w = tf.Variable(rng.normal(size=kernel + (9, 2)) * 0.3, dtype=tf.float64)

    def loss(x):
        y = tf.nn.convolution(x, w, padding=padding, dilations=dilation)
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2, 3])
    _assert_loops_values(mode, loss, x, w)
    assert shifted and set(shifted) == {kernel + (9, 2)}


@pytest.mark.parametrize("kernel,strides,mult,dilation,padding,chunk", [
    (5, 1, 1, 1, "SAME", 2), (3, 2, 2, 1, "VALID", 3), (2, 1, 2, 2, "SAME", 2),
    (1, 1, 1, 1, "SAME", 1), (4, 2, 1, 1, "SAME", 6)])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_depthwise_kernel_gradients_by_chunks_of_examples(kernel, strides, mult, dilation,
                                                          padding, chunk, mode, monkeypatch):
    """Where every example's depthwise kernels take more than
    _MAX_GROUPED_DW_BYTES_SLOW (float64; 0 here), each example's kernel
    gradient by TF's kernel gradient of ``chunk`` examples side by side in
    the channels (_chunked): a 5x5 kernel in float64 (no correlation: float32 only), a
    depth multiplier and a stride, VALID, a dilated one's blocks, 1x1, an
    even kernel at stride 2 with all examples in one chunk; per-example
    gradients, norms and the clipped sum equal the loop's (float64, eagerly
    and in a tf.function)."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    blocks = _norm_rules._DepthwiseBlocks  # pylint: disable=protected-access
    chunked = _spy_taken(monkeypatch, blocks, "_chunked")
    correlated = _spy_taken(monkeypatch, blocks, "_correlated")
    monkeypatch.setattr(_norm_rules, "_MAX_GROUPED_DW_BYTES_SLOW", 0)
    monkeypatch.setattr(_norm_rules, "_DW_CHUNK_BYTES", chunk * kernel * kernel * 3 * mult * 8)
    rng = np.random.default_rng(kernel * 10 + strides)
    x = tf.constant(rng.normal(size=(B, 7, 8, 3)), tf.float64)
    w = tf.Variable(rng.normal(size=(kernel, kernel, 3, mult)) * 0.5, dtype=tf.float64)

    def loss(x):
        y = tf.nn.depthwise_conv2d(x, w, [1, strides, strides, 1], padding,
                                   dilations=[dilation, dilation])
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2, 3])
    _assert_loops_values(mode, loss, x, w)
    assert chunked and set(chunked) == {(kernel, kernel, 3, mult)} and not correlated


@pytest.mark.parametrize("dtype,kernel,mult,path", [
    (tf.float32, 3, 1, "_grouped"), (tf.float32, 5, 1, "_correlated"),
    (tf.float32, 5, 2, "_chunked"), (tf.float32, 3, 2, "_chunked"),
    (tf.float64, 3, 1, "_chunked"), (tf.float64, 5, 1, "_chunked"),
    (tf.float64, 1, 1, "_grouped")])
def test_depthwise_paths_by_dtype_and_size(dtype, kernel, mult, path, monkeypatch):
    """At the default sizes, B 32 over 40 channels: float32 with fewer than
    16 taps (46 KiB of kernels, at most 640) one grouped kernel gradient; 16
    taps or more a correlation; with a depth multiplier (2560 channels side
    by side, more than _DW_CHUNK_CHANNELS) chunks where oneDNN runs; float64
    chunks (its correlation and its grouped kernel gradient over many
    channels are slow), but for 1x1 kernels (10 KiB); each the loop's."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    blocks = _norm_rules._DepthwiseBlocks  # pylint: disable=protected-access
    if path == "_correlated" and not _norm_rules._groups_run():  # pylint: disable=protected-access
        pytest.skip("the correlation runs where TF's oneDNN kernels do")
    if (dtype, kernel, mult) == (tf.float32, 3, 2) and not _norm_rules._groups_run():  # pylint: disable=protected-access
        path = "_grouped"   # (the chunks of channels: where oneDNN runs)
    taken = {name: _spy_taken(monkeypatch, blocks, name)
             for name in ("_correlated", "_chunked", "_grouped")}
    n = 32
    rng = np.random.default_rng(kernel)
    x = tf.constant(rng.normal(size=(n, 6, 6, 40)), dtype)
    w = tf.Variable(rng.normal(size=(kernel, kernel, 40, mult)) * 0.3, dtype=dtype)

    def loss(x):
        return tf.reduce_sum(tf.tanh(tf.nn.depthwise_conv2d(x, w, [1, 1, 1, 1], "SAME")) ** 2,
                             axis=[1, 2, 3])
    with fasttape.GradientTape() as tape:
        losses = loss(x)
    got = tape.per_example_gradients(losses, [w])[0]
    ref = []
    for i in range(n):
        with tf.GradientTape() as t:
            li = loss(x[i:i + 1])[0]
        ref.append(t.gradient(li, w))
    _close(got, tf.stack(ref), dtype)
    assert {name for name, shapes in taken.items() if shapes} == {path}


@pytest.mark.parametrize("case", ["keras_conv_dilated_wide", "keras_conv1d_dilated"])
def test_dilated_convolutions_with_positions_unknown_while_tracing(case):
    """Height and width (or length) unknown while tracing: the blocks'
    rows are regrouped by shapes read at run time; the loop's values."""
    xs, loss, variables = CASES[case](tf.float32)
    ref = _reference(loss, xs, variables)
    spec = [tf.TensorSpec([B] + [None] * (x.shape.rank - 2) + [x.shape[-1]])
            for x in xs]

    def step(*xs):
        with fasttape.GradientTape(persistent=True) as tape:
            losses = loss(*xs)
        return (tape.per_example_gradients(losses, variables),
                tape.per_example_norms(losses, variables))
    got, norms = tf.function(step, input_signature=spec)(*xs)
    for g, r in zip(got, ref):
        _close(g, r, tf.float32)
    _close(norms, _ref_norms(ref), tf.float32)


def _raised(mode, step, *xs):
    """The ValueError's message, its whitespace folded (tf.function's
    autograph quotes it indented, after the user's frames)."""
    with pytest.raises(ValueError) as info:
        _run(mode, step, *xs)
    return " ".join(str(info.value).split())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,data_format", [
    ([1, -1, 4, 1], "NHWC"),        # one channel over every example
    ([1, -1, 8, 1], "NCHW"),        # channels across two examples
    ([-1, 4, 1, 1], "NCHW"),        # the batch on the statistics' axis
], ids=["nhwc", "nchw-straddling", "nchw-batch"])
def test_a_batch_norm_that_mixes_examples_is_refused(shape, data_format, mode):
    x, w, loss = _folded_batch_norm(shape, data_format)

    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        return tape.per_example_norms(losses, [w])
    message = _raised(mode, step, x)
    assert "mixes examples: a FusedBatchNormV3 op" in message, message
    if mode != "eager":     # (the same error while tracing)
        assert _raised("eager", step, x) in message


@pytest.mark.parametrize("mode", ["function", "jit"])
@pytest.mark.parametrize("library", ["keras", "tf_keras"])
def test_batch_normalization_in_training_raises_as_eagerly(library, mode):
    """A model's BatchNormalization in training mode: the same ValueError
    while tracing a DP step as eagerly (Keras 3's by its Mean ops, tf_keras'
    by a FusedBatchNormV3)."""
    lib = __import__(library)
    lib.utils.set_random_seed(0)
    layers = lib.layers
    model = lib.Sequential([lib.Input((5, 5, 2)), layers.Conv2D(3, 3),
                            layers.BatchNormalization(), layers.Flatten(),
                            layers.Dense(2)])
    x = tf.constant(np.random.default_rng(18).normal(size=(B, 5, 5, 2)), tf.float32)

    def step(x):
        with fasttape.GradientTape() as tape:
            losses = tf.reduce_sum(tf.square(model(x, training=True)), axis=-1)
        return tape.dp_gradient(losses, model.trainable_variables, 1.0)
    op = "Mean" if library == "keras" else "FusedBatchNormV3"
    message = _raised(mode, step, x)
    assert f"mixes examples: a {op} op" in message, message
    assert _raised("eager", step, x) in message


def test_summary_names_the_rule_of_each_source():
    """tape.summary().per_example_rules: each source with the op type of
    its rule, the ops whose rules were summed (a recurrent kernel), or
    per-example rows (a tied weight)."""
    xs, loss, variables = CASES["keras_simple_rnn"](tf.float32)
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    tape.per_example_norms(losses, variables)
    what, rules = tape.summary().per_example_rules
    assert what == "per_example_norms"
    assert dict(rules) == {
        "kernel (2, 3)": "MatMul: the rules of 5 ops, summed",
        "recurrent_kernel (3, 3)": "MatMul: the rules of 5 ops, summed",
        "bias (3,)": "BiasAdd: the rules of 5 ops, summed",
        "kernel (3, 2)": "MatMul", "bias (2,)": "BiasAdd"}
    w = tf.Variable(np.ones((3, 3)))
    x = tf.constant(np.random.default_rng(17).normal(size=(B, 3)))
    with fasttape.GradientTape() as tape:
        losses = tf.reduce_sum(tf.tanh(x @ w) @ tf.transpose(w), axis=1)
    tape.per_example_norms(losses, [w])
    assert tape.summary().per_example_rules[1] == (
        (f"{w.name} (3, 3)", "per-example rows"),)


def _gather_case(ids_shape, row_shape, vocab, dtype):
    """A table gathered at ids of ``ids_shape`` per example, each example's
    first id repeated as its last (where it has several)."""
    rng = np.random.default_rng(19)
    ids = rng.integers(0, vocab, (B,) + ids_shape)
    flat = ids.reshape(B, -1)
    flat[:, -1] = flat[:, 0]
    table = tf.Variable(rng.normal(size=(vocab,) + row_shape), dtype=dtype)
    width = int(np.prod(row_shape))
    w = tf.Variable(rng.normal(size=(width, 2)), dtype=dtype)

    def loss(ids):
        e = tf.reshape(tf.gather(table, ids), [tf.shape(ids)[0], -1, width])
        return tf.reduce_sum(tf.cos(tf.reduce_mean(e, 1) @ w), axis=-1)
    return [tf.constant(flat.reshape(ids.shape))], loss, [table, w]


GATHERS = {"ids [B, 5], vocab 4": ((5,), (3,), 4),
           "ids [B, 2, 3], rows [2, 2]": ((2, 3), (2, 2), 7)}


@pytest.fixture
def gather_method(monkeypatch, request):
    """The Gather rule's norm forced to one method (the cost model's
    choice counted); compiled passes built under it are dropped after."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    chosen = []

    def forced(b, t, d):
        chosen.append((b, t, d))
        return request.param == "ghost"
    monkeypatch.setattr(_norm_rules, "_ghost_cheaper", forced)
    fasttape.clear_caches()
    yield chosen
    fasttape.clear_caches()


def _check_gather(mode, dtype, ids_shape, row_shape, vocab):
    """per_example_norms and dp_gradient (some examples clipped) of
    _gather_case in ``mode`` against single-example tapes."""
    from compat.test_per_example_traced import _expected_dp  # pylint: disable=import-outside-toplevel
    xs, loss, variables = _gather_case(ids_shape, row_shape, vocab, dtype)
    ref = _reference(loss, xs, variables)
    clip, expected = _expected_dp(ref, B)

    def step(*xs):
        with fasttape.GradientTape(persistent=True) as tape:
            losses = loss(*xs)
        return (tape.per_example_norms(losses, variables),
                tape.dp_gradient(losses, variables, clip))
    norms, dp = _run(mode, step, *xs)
    _close(norms, _ref_norms(ref), dtype)
    for g, e in zip(dp, expected):
        _close(g, e, dtype)


@pytest.mark.parametrize("gather_method", ["ghost", "segments"], indirect=True)
@pytest.mark.parametrize("case,dtype,mode", [
    pytest.param(c, d, m, id=f"{c}-{d.name}-{m}") for c in GATHERS
    for d, m in ((tf.float32, "eager"), (tf.float64, "eager"),
                 (tf.float32, "function"), (tf.float32, "jit"))])
def test_gather_norm_methods_equal_the_loop(case, dtype, mode, gather_method):
    """Both ways to a Gather's per-example norms (the ghost norm, the rows
    summed per example and id) against single-example tapes, with repeated
    ids: per_example_norms and dp_gradient, eagerly, traced and jit."""
    _check_gather(mode, dtype, *GATHERS[case])
    assert gather_method, "the Gather rule chose no method"


@pytest.mark.parametrize("mode", MODES)
def test_gather_of_one_id_per_example(mode):
    """ids [B]: each example's gradient is its one row (no sum)."""
    _check_gather(mode, tf.float32, (), (3,), 4)


# -- a traced loop's variables: the While rule -------------------------------
# Keras 3 RNNs in tf.function (one While each): every variable its body
# reads takes the loop's rule; values against B single-example tapes.

def _rnn_model(kind, sequences, mask, stacked, dense_first, backwards):
    import keras  # pylint: disable=import-outside-toplevel
    L = keras.layers
    keras.utils.set_random_seed(0)
    rnn = {"lstm": L.LSTM, "gru": L.GRU, "simple_rnn": L.SimpleRNN,
           # the kernels read through slices, one per gate, in the body
           # (the recurrent one by two products of different inputs when
           # the reset gate comes first)
           "gru_reset_before": lambda *a, **k: L.GRU(*a, reset_after=False, **k),
           "gru_implementation_1": lambda *a, **k: L.GRU(*a, implementation=1, **k),
           }[kind]
    layers = [L.Masking(0.0)] if mask else []
    if dense_first:
        layers.append(L.Dense(3, activation="tanh"))
    if stacked:
        layers.append(rnn(4, return_sequences=True, go_backwards=backwards))
    layers.append(rnn(3, return_sequences=sequences, go_backwards=backwards))
    if sequences:
        layers.append(L.GlobalAveragePooling1D())
    model = keras.Sequential([keras.Input((4, 2))] + layers + [L.Dense(2)])
    x = np.random.default_rng(19).normal(size=(B, 4, 2))
    if mask:                # two examples shorter than the others
        x[1, 2:] = 0.0
        x[3, 3:] = 0.0

    def loss(x):
        return tf.reduce_sum(tf.square(model(x)), axis=-1)
    return [tf.constant(x, tf.float32)], loss, model.trainable_variables


RNNS = {
    "lstm_sequences": ("lstm", True, False, False, False, False),
    "lstm_masked": ("lstm", False, True, False, False, False),
    "gru_masked_stacked": ("gru", False, True, True, False, False),
    "gru_reset_before": ("gru_reset_before", True, False, False, False, False),
    "gru_implementation_1_masked": ("gru_implementation_1", False, True, False, False, False),
    "simple_rnn_dense_first_masked": ("simple_rnn", True, True, False, True, False),
    "simple_rnn_stacked_backwards": ("simple_rnn", False, False, True, False, True),
}


@pytest.mark.parametrize("case,mode", [(c, "function") for c in sorted(RNNS)]
                         + [("lstm_masked", "jit"), ("gru_reset_before", "jit"),
                            ("gru_implementation_1_masked", "jit")])
def test_keras_rnn_variables_take_the_loop_rule(case, mode):
    xs, loss, variables = _rnn_model(*RNNS[case])
    ref = _reference(loss, xs, variables)
    norms = _ref_norms(ref)
    clip = float(np.median(norms.numpy()))
    scale = clip / tf.maximum(norms, clip)
    expected = [tf.tensordot(scale, g, 1) / B for g in ref]
    rules = []

    def step(x):
        out = []
        for method, *args in [("per_example_gradients",), ("dp_gradient", clip)]:
            with fasttape.GradientTape() as tape:
                losses = loss(x)
            out.append(getattr(tape, method)(losses, variables, *args))
            rules.append(tape.summary().per_example_rules[1])
        return out

    per_example, dp = _run(mode, step, *xs)
    for g, r in zip(per_example, ref):
        _close(g, r, tf.float32)
    for g, e in zip(dp, expected):
        _close(g, e, tf.float32)
    for summary in rules:
        hows = [how for _, how in summary]
        assert hows[-2:] == ["MatMul", "BiasAdd"]
        loop = [how for how in hows[:-2] if how.startswith("While: ")]
        assert len(loop) == (6 if "stacked" in case else 3), hows
        assert hows[:-2] == (["MatMul", "BiasAdd"] if "dense_first" in case
                             else []) + loop


def _loop_case(body_kind):
    """A hand-written tf.while_loop over time (a TensorArray of the
    steps, as Keras' RNNs), whose body reads w: through a MatMul (the
    rule), or in a way the rule does not cover (rows)."""
    rng = np.random.default_rng(20)
    x = tf.constant(rng.normal(size=(B, 4, 3)), tf.float32)
    w = tf.Variable(rng.normal(size=(3, 3)) * 0.5, dtype=tf.float32)
    v = tf.Variable(rng.normal(size=(3, 2)), dtype=tf.float32)

    def loss(x):
        steps = tf.TensorArray(tf.float32, size=4).unstack(tf.transpose(x, [1, 0, 2]))

        def body(t, h):
            x_t = steps.read(t)
            z = x_t @ w + h
            if body_kind == "mixes_rows":           # each row reads its neighbour's
                z = z + 0.5 * tf.roll(h, 1, axis=0)
            elif body_kind == "squares_the_weight":
                z = z + tf.reduce_sum(tf.square(w))
            elif body_kind == "weight_elementwise":
                z = z * w[0]
            elif body_kind == "read_twice":             # two reads of w
                z = z + h @ w
            elif body_kind == "row_slices":     # w's rows in two products
                z = x_t[:, :2] @ w[:2] + x_t[:, 2:] @ w[2:] + h @ w[:, 1:2]
            return t + 1, tf.tanh(z)
        _, h = tf.while_loop(lambda t, h: t < 4, body,
                             [tf.constant(0), tf.zeros([tf.shape(x)[0], 3])])
        return tf.reduce_sum(tf.square(h @ v), -1)
    return x, loss, [w, v]


def _traced_step_and_its_rules(loss, variables, **function_kwargs):
    """A tf.function of per_example_gradients, and the list each trace
    appends its summary's per_example_rules to."""
    rules = []

    @tf.function(**function_kwargs)
    def step(x):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        out = tape.per_example_gradients(losses, variables)
        rules.append(tape.summary().per_example_rules[1])
        return out
    return step, rules


@pytest.mark.parametrize("body_kind", ["matmul", "mixes_rows", "squares_the_weight",
                                       "weight_elementwise", "read_twice",
                                       "row_slices"])
def test_a_loop_the_rule_does_not_prove_takes_rows(body_kind):
    """Only a body the analysis proves (each example's rows its own, the
    variable read, once or more, by batch-major MatMul, BiasAdd or Add)
    takes the loop's rule: any other loop's variable takes the exact rows;
    a body that rolls the carry along the batch raises."""
    x, loss, variables = _loop_case(body_kind)
    step, rules = _traced_step_and_its_rules(loss, variables)
    if body_kind == "mixes_rows":   # (a carry rolled along the batch)
        with pytest.raises(ValueError, match="mixes examples"):
            step(x)
        return
    ref = _reference(loss, [x], variables)
    for g, r in zip(step(x), ref):
        _close(g, r, tf.float32)
    expected = ("While: the rules of its body's MatMul, summed over its iterations"
                if body_kind in ("matmul", "read_twice", "row_slices")
                else "per-example rows")
    assert [how for _, how in rules[-1]] == [expected, "MatMul"]


def test_keras_rnn_with_its_length_unknown_while_tracing():
    """A sequence length unknown while tracing (an input_signature with
    None): the loop rule still applies, exact at two lengths."""
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None, 2)), keras.layers.GRU(3),
                              keras.layers.Dense(2)])
    variables = model.trainable_variables

    def loss(x):
        return tf.reduce_sum(tf.square(model(x)), axis=-1)
    step, rules = _traced_step_and_its_rules(
        loss, variables, input_signature=[tf.TensorSpec([B, None, 2], tf.float32)])
    for t in (5, 7):
        x = tf.constant(np.random.default_rng(t).normal(size=(B, t, 2)), tf.float32)
        for g, r in zip(step(x), _reference(loss, [x], variables)):
            _close(g, r, tf.float32)
    assert len(rules) == 1 and [how.split(":")[0] for _, how in rules[0]] == [
        "While", "While", "While", "MatMul", "BiasAdd"]


@pytest.mark.parametrize("method", ["per_example_gradients", "per_example_norms",
                                    "dp_gradient"])
def test_summed_rules_share_the_ruled_ops_backward_pass(method, monkeypatch):
    """A batch norm's gamma and beta in inference (a chain: their rules
    summed) get their output gradients from the one backward pass that the
    other sources' ruled ops take: not a second pass over the model."""
    from fasttape.backward import _per_example  # pylint: disable=import-outside-toplevel
    xs, loss, variables = CASES["keras_batchnorm_inference"](tf.float32)
    passes = []
    original = _per_example._pass_to  # pylint: disable=protected-access

    def counted(*args, **kwargs):
        passes.append(args[2])
        return original(*args, **kwargs)
    monkeypatch.setattr(_per_example, "_pass_to", counted)
    with fasttape.GradientTape() as tape:
        losses = loss(*xs)
    args = (1.0,) if method == "dp_gradient" else ()
    getattr(tape, method)(losses, variables, *args)
    assert len(passes) == 1, passes
    rules = dict(tape.summary().per_example_rules[1])
    assert sum("summed" in how for how in rules.values()) == 2, rules


@pytest.mark.parametrize("dtype,mode", [(tf.float64, "eager"), (tf.float32, "eager"),
                                        (tf.float32, "function")], ids=str)
def test_per_example_gradients_larger_than_the_activations_take_the_ghost_norm(
        dtype, mode, monkeypatch):
    """A convolution whose per-example kernel gradients (144 x 96 values an
    example) outgrow its input and output gradient (7 x 7 x 16 and
    5 x 5 x 96) and the ghost norm's products (2 x 25 x 25) takes the
    ghost norm, though it costs more products: no route that builds them
    runs, so the step's peak stays near the plain step's; per-example
    gradients, norms and the clipped sum equal the loop's."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    blocks = _norm_rules._Conv2DBlocks  # pylint: disable=protected-access
    taken = [_spy_taken(monkeypatch, blocks, name)
             for name in ("_grouped", "_shifted", "_looped")]
    chosen, original = [], _norm_rules._Conv2D._ghost  # pylint: disable=protected-access

    def spy(self, *args):
        chosen.append(original(self, *args))
        return chosen[-1]
    monkeypatch.setattr(_norm_rules._Conv2D, "_ghost", spy)  # pylint: disable=protected-access
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=(B, 7, 7, 16)), dtype)
    w = tf.Variable(rng.normal(size=(3, 3, 16, 96)) * 0.1, dtype=dtype)

    def loss(x):
        return tf.reduce_sum(tf.tanh(tf.nn.conv2d(x, w, 1, "VALID")) ** 2, axis=[1, 2, 3])
    ref = _reference(loss, [x], [w])[0]
    norms = _ref_norms([ref])
    clip = float(np.median(norms.numpy()))

    def step(x, method, *args):
        with fasttape.GradientTape() as tape:
            losses = loss(x)
        return getattr(tape, method)(losses, [w], *args)
    got_norms = _run(mode, lambda x: step(x, "per_example_norms"), x)
    got_dp = _run(mode, lambda x: step(x, "dp_gradient", clip, 0.0), x)
    assert chosen and all(chosen), chosen
    assert taken == [[], [], []]
    _close(got_norms, norms, dtype)
    _close(got_dp[0], tf.tensordot(clip / tf.maximum(norms, clip), ref, 1) / B, dtype)
    _close(_run(mode, lambda x: step(x, "per_example_gradients"), x)[0], ref, dtype)


@pytest.mark.parametrize("rank,dilation", [(2, 1), (3, 1), (2, 2)])
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_patches_over_the_cap_in_chunks_of_examples(rank, dilation, mode, monkeypatch):
    """Where a convolution's per-example gradients serve but the whole
    batch's patches would take more than _CHUNKED_FROM_BYTES (here a few
    examples' worth), each example's kernel gradient from the patches of a
    chunk of examples at a time (_patches_in_chunks: 2 at a time);
    per-example gradients, norms and the clipped sum equal the loop's
    (float64, a Conv2D, a dilated one's space-to-batch blocks and a
    Conv3D, eagerly, in a tf.function and under jit_compile)."""
    from fasttape.gradients import _norm_rules  # pylint: disable=import-outside-toplevel
    blocks = _norm_rules._Conv2DBlocks  # pylint: disable=protected-access
    chunked, original = [], blocks._patches_in_chunks  # pylint: disable=protected-access

    def spy(self, payload, g, src_shape):
        out = original(self, payload, g, src_shape)
        chunked.append(out is not None)
        return out
    monkeypatch.setattr(blocks, "_patches_in_chunks", spy)
    rng = np.random.default_rng(rank)
    spatial = {(2, 1): (5, 4), (3, 1): (5, 4, 3), (2, 2): (7, 6)}[rank, dilation]
    kernel = (2,) * rank
    k = int(np.prod(kernel)) * 3
    positions = int(np.prod([s - dilation for s in spatial]))
    # two examples' patches a chunk
    monkeypatch.setattr(_norm_rules, "_CHUNKED_FROM_BYTES", 2 * positions * k * 8)
    monkeypatch.setattr(_norm_rules, "_PATCH_CHUNK_BYTES", 2 * positions * k * 8)
    x = tf.constant(rng.normal(size=(B,) + spatial + (3,)), tf.float64)
    # (K 12 or 24 to 8 or 12 outputs: not the many-inputs routes; T^2 >= K N:
    # no ghost norm)
    w = tf.Variable(rng.normal(size=kernel + (3, 8 if rank == 2 else 12)) * 0.3,
                    dtype=tf.float64)

    def loss(x):
        if dilation > 1:    # (SpaceToBatchND, the convolution, BatchToSpaceND)
            y = tf.nn.convolution(x, w, padding="VALID", dilations=dilation)
        else:
            conv = tf.nn.conv2d if rank == 2 else tf.nn.conv3d
            y = conv(x, w, [1] * (rank + 2), "VALID")
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=list(range(1, rank + 2)))
    _assert_loops_values(mode, loss, x, w)
    assert chunked and all(chunked)
