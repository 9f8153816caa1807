"""per_example_gradients, per_example_norms and dp_gradient inside
tf.function and under jit_compile, on a tape recorded in the function:
against a loop of B single-example tf.GradientTape's (eager), for every op
rule and for the rows fallback; noise, mixing, an unknown batch,
retracing, TF's leak checks."""

import functools

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import fasttape
from fasttape.backward import _per_example
from compat.test_per_example import (ALL, B, _close, _mlp, _ref_norms, _reference,
                                     assert_standard_normal)

MODES = {"function": {}, "jit": {"jit_compile": True}}

# One case per rule (MatMul with AddV2 and BiasAdd; BatchMatMul with Mul;
# Einsum; Conv2D; depthwise; Gather on a resource and on a read; MatMul
# over rows folded with time), and the rows fallback (a tied weight).
RULED = ["mlp", "sequence_gram", "einsum_heads", "conv_same",
         "depthwise_valid_strided", "embedding_resource", "embedding_read",
         "folded_rows"]


def _expected_dp(ref, m, n=B):
    """TF Privacy's clipped mean (noise 0) from per-example gradients (of
    the first n examples), at a clip norm between the microbatches' norms
    (some clipped, some not)."""
    micro = [tf.reduce_mean(tf.reshape(g[:n], [m, n // m] + g.shape[1:].as_list()), 1)
             for g in ref]
    norms = tf.sqrt(tf.add_n([tf.reduce_sum(tf.reshape(g, [m, -1]) ** 2, 1)
                              for g in micro]))
    clip = float(np.median(norms.numpy()))
    scale = clip / tf.maximum(norms, clip)
    return clip, [tf.tensordot(scale, g, 1) / m for g in micro]


def _step(loss, variables, clip, rows_seen, microbatches=None):
    def step(*xs):
        with fasttape.GradientTape(persistent=True) as tape:
            losses = loss(*xs)
        per_example = tape.per_example_gradients(losses, variables)
        norms = tape.per_example_norms(losses, variables)
        dp = tape.dp_gradient(losses, variables, clip,
                              num_microbatches=microbatches)
        rows_seen.append(tape._per_example_rows)  # pylint: disable=protected-access
        return per_example, norms, dp
    return step


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", RULED + ["fallback"])
def test_traced_equals_single_example_loop(case, mode):
    xs, loss, variables = ALL[case](tf.float32)
    ref = _reference(loss, xs, variables)
    clip, expected = _expected_dp(ref, B)
    rows_seen = []
    per_example, norms, dp = tf.function(
        _step(loss, variables, clip, rows_seen), **MODES[mode])(*xs)
    for g, r, v in zip(per_example, ref, variables):
        assert g.shape == [B] + v.shape
        _close(g, r, tf.float32)
    _close(norms, _ref_norms(ref), tf.float32)
    for g, e in zip(dp, expected):
        _close(g, e, tf.float32)
    # the rules ran on the traced ops: rows only for the tied weight
    what, rows = rows_seen[-1]
    assert what == "dp_gradient"
    if case == "fallback":
        assert [name for name, _ in rows] == [f"{variables[1].name} (2, 2)"]
    else:
        assert rows == ()


@pytest.mark.parametrize("mode", MODES)
def test_traced_table_gradient_without_noise_stays_sparse(mode):
    """With noise 0, a table's clipped rows come back as IndexedSlices, as
    the plain step's gradient of a Gather does, of the eager (dense)
    result's values; with noise, a dense tensor."""
    xs, loss, variables = ALL["embedding_resource"](tf.float32)

    def dp(noise):
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, 0.5, noise, seed=3)

    with tf.GradientTape() as tape:
        mean = tf.reduce_mean(loss(*xs))
    plain = tape.gradient(mean, variables)
    fn = tf.function(dp, **MODES[mode])
    traced, eager = fn(0.0), dp(0.0)
    assert [type(g) for g in traced] == [type(g) for g in plain]
    assert isinstance(traced[0], tf.IndexedSlices)
    for t, e in zip(traced, eager):
        _close(t, e, tf.float32)
    assert all(isinstance(g, tf.Tensor) for g in fn(1.0))


def test_traced_dp_step_holds_no_per_example_gradient():
    """Where a rule applies, the traced DP step forms the clipped sums
    directly: no op in it outputs a [B, ...weight shape] tensor."""
    xs, loss, variables = _mlp(tf.float32)

    @tf.function
    def step(x, y):
        with fasttape.GradientTape() as tape:
            losses = loss(x, y)
        return tape.dp_gradient(losses, variables, 1.0, 1.0)

    graph = step.get_concrete_function(*xs).graph
    shapes = {tuple(t.shape.as_list()) for op in graph.get_operations()
              for t in op.outputs if t.shape.rank is not None}
    for v in variables:
        if len(v.shape) == 2:
            assert (B,) + tuple(v.shape) not in shapes, v.name


@pytest.mark.parametrize("microbatches", [3, 1])
def test_traced_microbatches(microbatches):
    xs, loss, variables = ALL["mlp"](tf.float32)
    ref = _reference(loss, xs, variables)
    clip, expected = _expected_dp(ref, microbatches)

    @tf.function
    def step(*xs):
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, clip,
                                num_microbatches=microbatches)

    for g, e in zip(step(*xs), expected):
        _close(g, e, tf.float32)


def _wide(dtype):
    """A weight of more than _NOISE_CHUNK values (its noise drawn and added
    a block of rows at a time) beside small ones (one vector)."""
    rng = np.random.default_rng(14)
    x, y = rng.normal(size=(B, 300)), rng.normal(size=(B, 3))
    w1, b1 = (tf.Variable(rng.normal(size=s) * 0.05, dtype=dtype)
              for s in ((300, 256), (256,)))
    w2 = tf.Variable(rng.normal(size=(256, 3)) * 0.05, dtype=dtype)

    def loss(x, y):
        return tf.reduce_sum((tf.tanh(x @ w1 + b1) @ w2 - y) ** 2, axis=-1)
    return [tf.constant(x, dtype), tf.constant(y, dtype)], loss, [w1, b1, w2]


@pytest.mark.parametrize("mode", MODES)
def test_traced_noise_seeded_and_unseeded(mode):
    xs, loss, variables = _wide(tf.float32)
    assert variables[0].shape.num_elements() > _per_example._NOISE_CHUNK
    clip, multiplier = 0.5, 2.0

    def dp(x, y, seed=None, noise=multiplier):
        with fasttape.GradientTape() as tape:
            losses = loss(x, y)
        return tape.dp_gradient(losses, variables, clip, noise, seed=seed)

    def flat(grads):
        return np.concatenate([np.ravel(g) for g in grads])

    unseeded = tf.function(dp, **MODES[mode])
    seeded = tf.function(lambda x, y: dp(x, y, seed=7), **MODES[mode])
    by_tensor = tf.function(lambda x, y, s: dp(x, y, seed=s), **MODES[mode])
    clean = flat(tf.function(lambda x, y: dp(x, y, noise=0.0))(*xs))
    first, second = flat(unseeded(*xs)), flat(unseeded(*xs))
    assert not np.allclose(first, second)       # fresh noise at each call
    np.testing.assert_array_equal(flat(seeded(*xs)), flat(seeded(*xs)))
    step1 = flat(by_tensor(*xs, tf.constant([7, 1])))
    np.testing.assert_array_equal(step1, flat(by_tensor(*xs, tf.constant([7, 1]))))
    assert not np.allclose(step1, flat(by_tensor(*xs, tf.constant([7, 2]))))
    # a seed beside a step counter (a variable, as an optimizer's iterations)
    step = tf.Variable(0, dtype=tf.int64)
    by_step = tf.function(lambda x, y: dp(x, y, seed=(7, step)), **MODES[mode])
    at0 = flat(by_step(*xs))
    np.testing.assert_array_equal(at0, flat(by_step(*xs)))
    step.assign_add(1)
    assert not np.allclose(at0, flat(by_step(*xs)))
    # normal noise of standard deviation C * multiplier / B on every value,
    # independent between the blocks of the large weight and the sources
    sigma = clip * multiplier / B
    noise = (first - clean) / sigma
    assert abs(np.std(noise) - 1) < 0.02 and abs(np.mean(noise)) < 0.02
    for part in (noise[:256 * 256], noise[256 * 256:300 * 256], noise[300 * 256:]):
        assert abs(np.std(part) - 1) < 0.1
    block = 256 * 256
    assert abs(np.corrcoef(noise[:1000], noise[block:block + 1000])[0, 1]) < 0.15
    # and independent between steps, the large weight's blocks and the
    # small sources' vector alike (n values: a correlation's std 1/sqrt(n))
    later = (second - clean) / sigma
    for part in (slice(0, 300 * 256), slice(300 * 256, None)):
        n = noise[part].size
        assert abs(np.corrcoef(noise[part], later[part])[0, 1]) < 5 / np.sqrt(n)
    assert abs(np.corrcoef(noise[:256], noise[300 * 256:300 * 256 + 256])[0, 1]) < 0.3


@pytest.mark.parametrize("mode,block", [("eager", None), ("function", None),
                                        ("function", 1 << 16), ("jit", None),
                                        ("jit", 1 << 16)])
def test_noise_is_normal_of_its_standard_deviation(mode, block, monkeypatch):
    """dp_gradient's noise over C * multiplier / B follows N(0, 1) (mean,
    variance, kurtosis, Kolmogorov-Smirnov), eagerly (numpy), in a
    tf.function (Box-Muller over TF's stateless uniforms) and under
    jit_compile (the inverse normal CDF of them); each draw's two halves
    independent: the large weight's (one draw, or traced blocks of rows
    as the eager path's, ``block`` values at most) and the small sources'
    vector (the weight and bias, one draw)."""
    if block is not None:
        monkeypatch.setattr(_per_example, "_TRACED_NOISE_BLOCK", block)
    rng = np.random.default_rng(3)
    big = tf.Variable(rng.normal(size=(300, 512)) * 0.05, dtype=tf.float32)
    w = tf.Variable(rng.normal(size=(512, 48)) * 0.05, dtype=tf.float32)
    b = tf.Variable(np.zeros(48), dtype=tf.float32)
    x = tf.constant(rng.normal(size=(B, 300)), tf.float32)
    clip, multiplier = 0.5, 3.0

    def dp(noise):
        with fasttape.GradientTape() as tape:
            losses = tf.reduce_sum(tf.tanh(x @ big) @ w + b, -1)
        grads = tape.dp_gradient(losses, [big, w, b], clip, noise, seed=11)
        return tf.concat([tf.reshape(g, [-1]) for g in grads], 0)

    step = dp if mode == "eager" else tf.function(dp, **MODES[mode])
    noise = (step(multiplier).numpy() - step(0.0).numpy()) / (clip * multiplier / B)
    rows = (block or _per_example._NOISE_CHUNK if mode == "eager"
            else block or _per_example._TRACED_NOISE_BLOCK) // 512
    draws = [(first * 512, (min(300, first + rows) - first) * 512)
             for first in range(0, 300, rows)]
    assert len(draws) == (1 if mode != "eager" and block is None else 3)
    assert_standard_normal(noise, draws + [(300 * 512, 512 * 48 + 48)])
    for (a, size), (b, _) in zip(draws, draws[1:]):     # blocks: other keys
        assert abs(np.corrcoef(noise[a:a + size // 2],
                               noise[b:b + size // 2])[0, 1]) < 3.3 / np.sqrt(size // 2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float64, tf.float16, tf.bfloat16])
def test_traced_noise_of_other_float_dtypes(mode, dtype):
    """The traced draw in float64 (TF's normal kernel without XLA, the
    inverse CDF under it) and float16/bfloat16 (drawn in float32, cast):
    the variable's dtype, N(0, sigma^2) to the dtype's precision, the same
    values for the same seed, others for another."""
    n, sigma = 20_001, 0.25
    draw = tf.function(lambda seed: _per_example._traced_normal(
        tf.TensorShape([n]), seed,
        tf.constant(sigma, _per_example._DRAWN_AS.get(dtype, dtype)), dtype,
        mode == "jit"), **MODES[mode])
    first = draw(tf.constant([4, 1], tf.int64))
    assert first.dtype == dtype
    x = first.numpy().astype(np.float64) / sigma
    if dtype == tf.float64:
        assert_standard_normal(x, [(0, n)] if mode == "function" else [])
    else:         # (a KS test would see the half dtype's rounding)
        assert abs(x.mean()) < 0.025 and abs(x.var() - 1) < 0.035
        assert abs(np.mean(x ** 4) - 3) < 0.25 and np.abs(x).max() < 6
    np.testing.assert_array_equal(first, draw(tf.constant([4, 1], tf.int64)))
    assert abs(np.corrcoef(x, draw(tf.constant([4, 2], tf.int64)).numpy()
                           .astype(np.float64))[0, 1]) < 0.03


@pytest.mark.parametrize("mode", MODES)
def test_traced_unseeded_noise_and_set_seed_as_tf_random_normal(mode):
    """Unseeded noise under tf.random.set_seed does what TF's own
    tf.random.normal does in the same mode, side by side: in a tf.function
    a new function's draws repeat after set_seed (TF's op seeds key the
    draw); under jit_compile they do not, for TF's normal as for fasttape's
    noise: XLA's stateful random ops take their state from XLA, not from
    TF's op seeds. A compiled step whose noise must repeat passes ``seed``
    (e.g. a seed beside a step variable, as above)."""
    xs, loss, variables = _mlp(tf.float32)

    def dp():
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, 1.0, 1.0)

    def tf_noise():
        return [tf.random.normal(v.shape) for v in variables]

    def repeats(fn):
        draws, old = [], context.global_seed()
        try:
            for _ in range(2):
                tf.random.set_seed(5)
                step = tf.function(fn, **MODES[mode])
                draws.append(np.concatenate([np.ravel(g) for g in step()]))
        finally:
            tf.random.set_seed(old)
        return np.array_equal(draws[0], draws[1])

    assert repeats(dp) == repeats(tf_noise) == (mode == "function")


def _tables(dtype, rows):
    """Two embedding tables (Gather rules: clipped sums as IndexedSlices),
    one of ``rows`` x 256 values, one small, and a dense weight."""
    rng = np.random.default_rng(15)
    ids = tf.constant(rng.integers(0, 40, (B, 5)))
    big = tf.Variable(rng.normal(size=(rows, 256)) * 0.1, dtype=dtype)
    small = tf.Variable(rng.normal(size=(50, 4)) * 0.1, dtype=dtype)
    w = tf.Variable(rng.normal(size=(256, 2)) * 0.1, dtype=dtype)

    def loss(ids, scale):
        e = tf.reduce_mean(tf.gather(big, ids), 1) @ w
        e += tf.reduce_mean(tf.gather(small, ids), 1)[:, :2]
        return tf.reduce_sum(e * scale, -1) ** 2
    return [ids], loss, [big, small, w]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [100, 300])
@pytest.mark.parametrize("seed", [5, None])
def test_traced_noise_on_tables_covers_every_row(mode, rows, seed):
    """A table's clipped rows are scattered into its noise (a table of
    300 x 256 values: more than _NOISE_CHUNK, one draw): the noise covers
    rows no example gathers, and the clipped sum is added exactly once, at
    every call (with a seed, the noise does not depend on the gradient and
    repeats; unseeded, at a tiny multiplier, every value is within a few
    standard deviations of the clean sum)."""
    xs, loss, variables = _tables(tf.float32, rows)
    clip = 0.5
    multiplier = 2.0 if seed is not None else 1e-4
    sigma = clip * multiplier / B

    def dp(ids, scale, noise):
        with fasttape.GradientTape() as tape:
            losses = loss(ids, scale)
        return tape.dp_gradient(losses, variables, clip, noise, seed=seed)

    with fasttape.GradientTape() as tape:    # (rules for every source)
        losses = loss(*xs, 1.0)
    tape.dp_gradient(losses, variables, clip)
    assert tape._per_example_rows == ("dp_gradient", ())  # pylint: disable=protected-access
    fn = tf.function(dp, **MODES[mode])
    noises = []
    for scale in (1.0, 3.0, 3.0):
        clean = [np.asarray(tf.convert_to_tensor(g))
                 for g in tf.function(dp)(*xs, scale, 0.0)]
        assert np.abs(clean[0][:40]).max() > 100 * sigma or seed is not None
        assert not clean[0][40:].any()
        noisy = [np.asarray(g) for g in fn(*xs, scale, multiplier)]
        noises.append([(n - c) / sigma for n, c in zip(noisy, clean)])
    first = noises[0]
    for later in noises[1:]:
        for a, b in zip(first, later):
            if seed is not None:
                np.testing.assert_allclose(a, b, atol=1e-3)
            else:
                assert np.abs(b).max() < 7 and not np.allclose(a, b)
    big, small = first[:2]
    assert abs(np.std(big) - 1) < 0.05 and abs(np.mean(big)) < 0.05
    assert abs(np.std(big[:40]) - 1) < 0.1 and abs(np.std(big[40:]) - 1) < 0.05
    assert abs(np.std(small) - 1) < 0.25 and abs(np.std(small[40:]) - 1) < 0.5


def test_traced_batch_norm_in_training_raises_while_tracing():
    import keras  # pylint: disable=import-outside-toplevel
    x = tf.random.normal([B, 4])
    dense, bn = keras.layers.Dense(3), keras.layers.BatchNormalization()
    bn(dense(x), training=True)

    @tf.function
    def step(x):
        with fasttape.GradientTape() as tape:
            z = bn(dense(x), training=True)
            losses = tf.reduce_sum(z * z, axis=-1)
        return tape.dp_gradient(losses, dense.trainable_variables, 1.0)

    with pytest.raises(ValueError, match="mixes examples: a (Mean|FusedBatchNorm[A-Za-z0-9]*) op .*batch axis"):
        step(x)


def test_traced_unknown_batch_takes_rows():
    xs, loss, variables = _mlp(tf.float32)
    ref = _reference(loss, xs, variables)
    clip, expected = _expected_dp(ref, B)
    rows_seen = []
    spec = [tf.TensorSpec([None] + x.shape[1:].as_list(), x.dtype) for x in xs]
    step = tf.function(_step(loss, variables, clip, rows_seen),
                       input_signature=spec)
    per_example, norms, dp = step(*xs)
    for g, r in zip(per_example, ref):
        _close(g, r, tf.float32)
    _close(norms, _ref_norms(ref), tf.float32)
    for g, e in zip(dp, expected):
        _close(g, e, tf.float32)
    assert len(rows_seen[-1][1]) == len(variables)
    # the same function on another batch size
    half = [x[:3] for x in xs]
    for g, r in zip(step(*half)[0], ref):
        _close(g, r[:3], tf.float32)


@pytest.mark.parametrize("mode", ["eager"] + list(MODES))
def test_microbatches_of_a_batch_known_at_run_time(mode):
    """num_microbatches where the batch is unknown while tracing (as
    Keras' fit traces its step): the microbatches cut at run time, each
    batch's as eagerly; a batch they do not divide raises
    InvalidArgumentError in every mode (eagerly and while tracing
    IndivisibleBatchError, also a ValueError)."""
    xs, loss, variables = _mlp(tf.float32)
    ref = _reference(loss, xs, variables)
    spec = [tf.TensorSpec([None] + x.shape[1:].as_list(), x.dtype) for x in xs]

    def micro(clip, *xs):
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, clip, num_microbatches=2)

    for n in (6, 4):
        clip, expected = _expected_dp(ref, 2, n)
        step = functools.partial(micro, clip)
        if mode != "eager":
            step = tf.function(step, input_signature=spec, **MODES[mode])
        for g, e in zip(step(*[x[:n] for x in xs]), expected):
            _close(g, e, tf.float32)
    # (under XLA, which drops assertions, the reshape that cuts them fails,
    # named for it)
    with pytest.raises(tf.errors.InvalidArgumentError, match=(
            "num_microbatches_must_divide_the_batch_size" if mode == "jit"
            else r"num_microbatches \(2\) must divide the batch size")):
        step(*[x[:3] for x in xs])


@pytest.mark.parametrize("microbatches", [None, 2])
@pytest.mark.parametrize("mode", ["eager"] + list(MODES))
def test_a_batch_of_no_examples_is_refused(mode, microbatches):
    """No example, no microbatch to divide by: InvalidArgumentError in
    every mode, its message the eager one (under XLA, which drops
    assertions and so their messages, a reshape named for it fails, with
    microbatches too: TF's pfor over their empty rows failed first, with
    "Incompatible shapes"), not a gradient of zeros or of noise over 0."""
    xs, loss, variables = _mlp(tf.float32)
    spec = [tf.TensorSpec([None] + x.shape[1:].as_list(), x.dtype) for x in xs]

    def step(*xs):
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, 1.0, 1.0,
                                num_microbatches=microbatches)

    if mode != "eager":
        step = tf.function(step, input_signature=spec, **MODES[mode])
    with pytest.raises(tf.errors.InvalidArgumentError, match=(
            "a batch of no examples" if mode != "jit"
            else "dp_gradient_needs_a_batch_of_examples")):
        step(*[x[:0] for x in xs])


def test_an_empty_shard_of_microbatches_sums_to_zeros_under_jit():
    """A replica's share of no examples (divide=False, as _dp_replicas
    asks for it), its size read at run time, under jit_compile: zeros, as
    in a tf.function (with microbatches, TF's pfor over their empty rows
    failed to compile)."""
    xs, loss, variables = _mlp(tf.float32)
    spec = [tf.TensorSpec([None] + x.shape[1:].as_list(), x.dtype) for x in xs]

    @tf.function(input_signature=spec, jit_compile=True)
    def share(*xs):
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return _per_example.dp_gradient(tape, losses, variables, 1.0,
                                        num_microbatches=2, divide=False)

    for g, v in zip(share(*[x[:0] for x in xs]), variables):
        np.testing.assert_array_equal(g.numpy(), np.zeros(v.shape))


@pytest.mark.parametrize("mode", MODES)
def test_microbatches_refused_while_tracing_a_known_batch(mode):
    """A batch known while tracing that num_microbatches does not divide:
    the eager error, raised while tracing (autograph raises it again as
    itself: InvalidArgumentError and ValueError)."""
    xs, loss, variables = _mlp(tf.float32)

    @tf.function(**MODES[mode])
    def micro(*xs):
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, 1.0, num_microbatches=4)

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"num_microbatches \(4\) must divide the batch size") as e:
        micro(*xs)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("case", [
    "embedding_resource", "sequence_gram",
    pytest.param("folded_rows", marks=pytest.mark.xfail(
        strict=True, raises=ValueError, reason=(
            "rows folded with a sequence length unknown while tracing, "
            "unfolded to a constant length ([-1, 5, n]): whether each row "
            "stays within one example cannot be told while tracing, refused"))),
    "einsum_heads"])
def test_traced_sequence_length_unknown_while_tracing(case):
    """A batch known while tracing, a sequence length not (input_signature
    [B, None, ...]): the rules that read it at run time, rows for the
    others; the values are the loop's either way."""
    xs, loss, variables = ALL[case](tf.float32)
    ref = _reference(loss, xs, variables)
    clip, expected = _expected_dp(ref, B)
    spec = [tf.TensorSpec([B, None] + x.shape[2:].as_list(), x.dtype) for x in xs]
    per_example, norms, dp = tf.function(
        _step(loss, variables, clip, []), input_signature=spec)(*xs)
    for g, r in zip(per_example, ref):
        _close(g, r, tf.float32)
    _close(norms, _ref_norms(ref), tf.float32)
    for g, e in zip(dp, expected):
        _close(g, e, tf.float32)


def test_traced_step_retraces_on_a_new_batch_size():
    xs, loss, variables = ALL["conv_same"](tf.float32)
    ref = _reference(loss, xs, variables)
    rows_seen = []
    step = tf.function(_step(loss, variables, 1.0, rows_seen))
    for n in (B, 4, B):
        per_example, norms, _ = step(*[x[:n] for x in xs])
        _close(per_example[0], ref[0][:n], tf.float32)
        _close(norms, _ref_norms(ref)[:n], tf.float32)
    assert len(rows_seen) == 2      # two traces: B and 4


@pytest.mark.parametrize("mode", MODES)
def test_traced_dp_step_leaks_nothing(mode):
    """A compiled DP step, noise included (the unseeded key drawn in the
    function), under TF's assert_no_new_tensors and
    assert_no_garbage_created, and no reference cycle left per call. (The
    inputs are captured: a tf.function called with a tensor keeps a
    TensorSpec of its last call's argument, with TF's own tape too.)"""
    from compat.harness import assert_leaks_nothing
    xs, loss, variables = ALL["embedding_resource"](tf.float32)

    @tf.function(**MODES[mode])
    def step():
        with fasttape.GradientTape() as tape:
            losses = loss(*xs)
        return tape.dp_gradient(losses, variables, 1.0, 1.0)

    step()
    assert_leaks_nothing(step)


@pytest.mark.parametrize("product", ["einsum", "batch_matmul"])
def test_traced_contracted_axis_unknown_while_tracing(product):
    """The rule's operand has an axis unknown while tracing (after a
    SegmentSum, or an input_signature [B, None, k]) but the source's shape
    is known: the Einsum and BatchMatMul rules take the sizes from the
    source (they read the operand's static shape and raised TypeError)."""
    rng = np.random.default_rng(11)
    seg = tf.constant([0, 0, 1, 2, 2], tf.int32)
    w0 = tf.Variable(rng.normal(size=(4, 5)), dtype=tf.float64)
    w = tf.Variable(rng.normal(size=(3, 2)), dtype=tf.float64)
    variables = [w0, w]

    def loss(x):
        # the segments' count is a run-time value: [B, None] while tracing
        h = tf.transpose(tf.math.segment_sum(tf.transpose(tf.tanh(x @ w0)), seg))
        if product == "einsum":
            z = tf.einsum("bi,ij->bj", h, w)
        else:
            z = tf.matmul(tf.stack([h, 2.0 * h], 1), w)
        return tf.reduce_sum(tf.sin(z), axis=list(range(1, len(z.shape))))
    xs = [tf.constant(rng.normal(size=(B, 4)), tf.float64)]
    ref = _reference(loss, xs, variables)
    clip, expected = _expected_dp(ref, B)
    rows_seen = []
    per_example, norms, dp = tf.function(
        _step(loss, variables, clip, rows_seen))(*xs)
    for g, r in zip(per_example, ref):
        _close(g, r, tf.float64)
    _close(norms, _ref_norms(ref), tf.float64)
    for g, e in zip(dp, expected):
        _close(g, e, tf.float64)
    assert len(rows_seen[-1][1]) == 1, rows_seen[-1]     # w by its rule


def _diagonal():
    """h = tanh(x * w), x [4, 4]; example i's loss is h[i, i] (Einsum
    "ii->i"): each reads its own row alone, and the Einsum's gradient
    ("i->ii") is one TF's pfor cannot vectorize (its converter's "ai->aii"
    repeats an output label, which tf.einsum refuses)."""
    rng = np.random.default_rng(21)
    x = tf.constant(rng.normal(size=(4, 4)), tf.float64)
    w = tf.Variable(rng.normal(size=(4,)) * 0.5, dtype=tf.float64)

    def losses_of(x):
        return tf.einsum("ii->i", tf.tanh(x * w))
    return x, w, losses_of


@pytest.mark.parametrize("mode", ["eager"] + list(MODES))
def test_a_diagonal_einsum_takes_rows_in_every_mode(mode):
    """num_microbatches over the diagonal: a microbatch's gradient is that
    of its losses' mean (TF Privacy's, for any loss), so every mode gives
    the loop of tf.GradientTape's over the microbatches (clipped, summed,
    divided); and the per-example gradients are the loop's over the
    examples. (Traced, they went through pfor, which raised TF's
    ValueError: they run as a loop there.)"""
    x, w, losses_of = _diagonal()
    m, size, clip = 2, 2, 0.6

    def step(x):
        with fasttape.GradientTape(persistent=True) as tape:
            tape.watch(x)
            losses = losses_of(x)
        return (tape.dp_gradient(losses, [w, x], clip, num_microbatches=m),
                tape.per_example_gradients(losses, [w, x]))

    micro, rows = [], []
    for j in range(4):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            losses = losses_of(x)
            mean = tf.reduce_mean(losses[j * size:(j + 1) * size])
            mine = losses[j]
        if j < m:
            micro.append(tape.gradient(mean, [w, x]))
        rows.append(tape.gradient(mine, [w, x]))
    norms = [tf.sqrt(sum(tf.reduce_sum(g ** 2) for g in gs)) for gs in micro]
    expected = [sum(gs[k] * min(1.0, clip / float(n)) for gs, n in zip(micro, norms)) / m
                for k in range(2)]
    assert min(norms) < clip < max(norms)      # (one clipped, one not)
    if mode != "eager":
        step = tf.function(step, **MODES[mode])
    dp, per_example = step(x)
    for g, e in zip(dp, expected):
        _close(g, e, tf.float64)
    for g, k in zip(per_example, range(2)):
        _close(g, tf.stack([r[k] for r in rows]), tf.float64)
