"""The bench's DP-SGD workloads: one model step four ways, side by side.

  plain     fasttape: the mean loss's gradient (a non-private step)
  dp        fasttape: tape.dp_gradient (per-example clip, sum, noise)
  vmap fn   tf.function(vectorized_map) over single-example tf.GradientTape's,
            clipped, summed and noised (how TF Privacy's Keras optimizers do it)
  vmap eager  the same vectorized_map step, not wrapped in tf.function

The dp and vmap steps are checked equal without noise before anything is
timed. Ratios are printed of medians and of means: unseeded noise is drawn
a few steps ahead (see backward._per_example._Pool), so a few dp steps pay
for the next ones' noise and the median alone leaves that cost out (the
means leave out the steps that built a compiled pass). plain, dp and vmap fn run in one alternation, each round in a rotated
order; the eager vectorized_map step (a trace per call) after them; medians,
with ratios to the plain step.
Each arm's extra peak memory (TF's CPU allocator's peak over one step, less
what was allocated before it: the forward pass's activations, the backward
pass, the gradients) is measured once, after the timing.
"""

import gc
import time

import numpy as np

from fasttape.bench.report import with_spread
from fasttape.bench.timing import check_equal, iqr_ms

CLIP = 1.0
NOISE = 1.1
BATCH = 32
# The eager vectorized_map step traces a function each call (tens of ms):
# timed on at most this many steps.
EAGER_VMAP_REPEATS = 5


class DPWorkload:
    """name, description, and ``make(tf)`` -> (params, batch, per_example_losses):
    ``per_example_losses(*batch)`` gives one loss per example."""

    def __init__(self, name, make, description):
        self.name = name
        self.make = make
        self.description = description


def _mlp(tf):
    rng = np.random.default_rng(10)
    sizes = [64, 128, 10]
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        params += [tf.Variable(rng.normal(0, 1 / np.sqrt(n_in), (n_in, n_out)).astype("float32")),
                   tf.Variable(np.zeros(n_out, "float32"))]
    x = tf.constant(rng.normal(size=(BATCH, 64)).astype("float32"))
    labels = tf.constant(rng.integers(0, 10, BATCH))

    def losses(x, labels):
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, params[0]), params[1]))
        logits = tf.nn.bias_add(tf.matmul(h, params[2]), params[3])
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

    return params, (x, labels), losses


def _convnet(tf):
    rng = np.random.default_rng(11)
    params = [tf.Variable(rng.normal(0, 0.2, (3, 3, 3, 8)).astype("float32")),
              tf.Variable(np.zeros(8, "float32")),
              tf.Variable(rng.normal(0, 0.2, (3, 3, 8, 16)).astype("float32")),
              tf.Variable(np.zeros(16, "float32")),
              tf.Variable(rng.normal(0, 0.1, (16 * 4 * 4, 10)).astype("float32")),
              tf.Variable(np.zeros(10, "float32"))]
    x = tf.constant(rng.normal(size=(BATCH, 16, 16, 3)).astype("float32"))
    labels = tf.constant(rng.integers(0, 10, BATCH))

    def losses(x, labels):
        h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, params[0], 1, "SAME"), params[1]))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, params[2], 1, "SAME"), params[3]))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        logits = tf.nn.bias_add(
            tf.matmul(tf.reshape(h, (-1, 16 * 4 * 4)), params[4]), params[5])
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

    return params, (x, labels), losses


def _text(tf):
    rng = np.random.default_rng(12)
    params = [tf.Variable(rng.normal(0, 0.1, (1000, 32)).astype("float32")),
              tf.Variable(rng.normal(0, 0.2, (32, 10)).astype("float32")),
              tf.Variable(np.zeros(10, "float32"))]
    ids = tf.constant(rng.integers(0, 1000, (BATCH, 16)))
    labels = tf.constant(rng.integers(0, 10, BATCH))

    def losses(ids, labels):
        e = tf.reduce_mean(tf.gather(params[0], ids), axis=1)
        logits = tf.nn.bias_add(tf.matmul(e, params[1]), params[2])
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

    return params, (ids, labels), losses


def _wide_mlp(tf):
    """The issue's memory case: MLP 1024-1024-1024-10 at batch 64 (2.1M
    parameters; vectorized_map holds 64 copies of their gradient)."""
    rng = np.random.default_rng(13)
    sizes = [1024, 1024, 1024, 10]
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        params += [tf.Variable(rng.normal(0, 1 / np.sqrt(n_in), (n_in, n_out)).astype("float32")),
                   tf.Variable(np.zeros(n_out, "float32"))]
    x = tf.constant(rng.normal(size=(64, 1024)).astype("float32"))
    labels = tf.constant(rng.integers(0, 10, 64))

    def losses(x, labels):
        h = x
        for i in range(0, len(params) - 2, 2):
            h = tf.nn.relu(tf.nn.bias_add(tf.matmul(h, params[i]), params[i + 1]))
        logits = tf.nn.bias_add(tf.matmul(h, params[-2]), params[-1])
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

    return params, (x, labels), losses


def peak_mb(tf, step):
    """Extra peak memory of one ``step(NOISE)`` in MB, from TF's CPU
    allocator (its peak less what was allocated before the step), or None
    where TF keeps no such statistics."""
    gc.collect()
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None
    out = step(NOISE)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    del out
    return (peak - base) / 2 ** 20


def _steps(tf, fasttape, params, batch, losses, plain_tape=None):
    """The four steps, each ``step(noise_multiplier) -> gradients``; the
    plain one on ``plain_tape`` (default fasttape's)."""

    def plain(noise):
        del noise
        with (plain_tape or fasttape.GradientTape)() as tape:
            loss = tf.reduce_mean(losses(*batch))
        return tape.gradient(loss, params)

    def dp(noise):
        with fasttape.GradientTape() as tape:
            per_example = losses(*batch)
        return tape.dp_gradient(per_example, params, CLIP, noise)

    def vmap(noise):
        def one(example):
            with tf.GradientTape() as tape:
                loss = losses(*[t[None] for t in example])[0]
            return [tf.convert_to_tensor(g) for g in tape.gradient(loss, params)]
        grads = tf.vectorized_map(one, batch)
        size = int(batch[0].shape[0])
        norms = tf.sqrt(tf.add_n([
            tf.reduce_sum(tf.reshape(g, [size, -1]) ** 2, axis=1) for g in grads]))
        scale = CLIP / tf.maximum(norms, CLIP)
        out = []
        for g in grads:
            summed = tf.tensordot(scale, g, 1)
            summed += tf.random.normal(tf.shape(summed), stddev=CLIP * noise)
            out.append(summed / size)
        return out

    vmap_fn = tf.function(vmap)
    return {"plain": plain, "dp": dp, "vmap fn": vmap_fn, "vmap eager": vmap}


def run_dp_workload(tf, fasttape, workload, repeats, warmup):
    """One row: median ms per arm (with spreads) and the ratios."""
    from fasttape.gradients import _compiled  # pylint: disable=import-outside-toplevel
    params, batch, losses = workload.make(tf)
    steps = _steps(tf, fasttape, params, batch, losses)
    equal = check_equal(tf, steps["vmap fn"](0.0), steps["dp"](0.0))
    for _ in range(warmup):
        for step in steps.values():
            step(NOISE)
    times = {name: [] for name in steps}
    # The three compared steps alternate, each round in a rotated order: each
    # follows each of the others as often (a step runs slower after the
    # traced one), and a machine's drift over the run falls on all three
    # alike (timed in groups of their own, the dp/vmap fn ratio moved by
    # the drift between the groups). The eager vectorized_map step, which
    # traces a function per call and slows whatever follows it, is timed
    # after them.
    arms = ("plain", "dp", "vmap fn")
    building = {name: [] for name in steps}   # per timed step: it built a pass
    for i in range(repeats):
        k = i % len(arms)
        for name in arms[k:] + arms[:k]:
            builds = _compiled.builds()
            t0 = time.perf_counter()
            steps[name](NOISE)
            times[name].append(time.perf_counter() - t0)
            building[name].append(_compiled.builds() != builds)
    for _ in range(min(repeats, EAGER_VMAP_REPEATS)):
        t0 = time.perf_counter()
        steps["vmap eager"](NOISE)
        times["vmap eager"].append(time.perf_counter() - t0)
        building["vmap eager"].append(False)
    return _row(tf, workload, equal, steps, times, building)


def _row(tf, workload, equal, steps, times, building=None):
    """A table row: per arm its median ms, spread (and, given ``building``,
    its mean over the steps that built no compiled pass), extra peak MB."""
    row = {"workload": workload.name, "grads_equal": bool(equal)}
    for name, seconds in times.items():
        row[name] = float(np.median(seconds) * 1e3)
        row[name + " spread"] = iqr_ms(seconds)
        if building is not None:
            # (a step that built a compiled pass, a one-time cost the main
            # table reports, is left out of the mean)
            kept = [t for t, built in zip(seconds, building[name]) if not built]
            row[name + " mean"] = float(np.mean(kept or seconds) * 1e3)
    for name, step in steps.items():
        row[name + " MB"] = peak_mb(tf, step)
    return row


def format_dp_table(rows):
    arms = ["plain", "dp", "vmap fn", "vmap eager"]
    header = (f"{'workload':<14}" + "".join(f"{a:>16}" for a in arms)
              + f"{'dp/plain':>10}{'dp/vmap fn':>12}{'vfn/plain':>11}"
              f"{'veager/plain':>14}  means: {'dp/plain':>8}{'dp/vmap fn':>12}")
    lines = [header]
    for r in rows:
        cells = "".join(f"{with_spread(r[a], r[a + ' spread']):>16}" for a in arms)
        lines.append(
            f"{r['workload']:<14}{cells}"
            f"{r['dp'] / r['plain']:>10.2f}{r['dp'] / r['vmap fn']:>12.2f}"
            f"{r['vmap fn'] / r['plain']:>11.2f}{r['vmap eager'] / r['plain']:>14.1f}"
            f"  {'':>6}{r['dp mean'] / r['plain mean']:>8.2f}"
            f"{r['dp mean'] / r['vmap fn mean']:>12.2f}")
    if any(r.get("plain MB") is not None for r in rows):
        lines += ["", f"{'extra peak MB':<14}" + "".join(f"{a:>16}" for a in arms)
                  + f"{'dp/plain':>10}{'vfn/plain':>11}"]
        for r in rows:
            if r.get("plain MB") is None:
                continue
            mb = [r[a + " MB"] for a in arms]
            # (TF's CPU allocator counts in blocks: a small model's step
            # may read 0)
            ratios = (f"{mb[1] / mb[0]:>10.2f}{mb[2] / mb[0]:>11.2f}" if mb[0]
                      else f"{'-':>10}{'-':>11}")
            lines.append(f"{r['workload']:<14}" + "".join(f"{m:>16.1f}" for m in mb)
                         + ratios)
    return "\n".join(lines)


DP_WORKLOADS = [
    DPWorkload("dp_mlp", _mlp, "DP-SGD step: MLP 64-128-10, batch 32"),
    DPWorkload("dp_convnet", _convnet, "DP-SGD step: 2 Conv2D + dense, batch 32, 16x16"),
    DPWorkload("dp_text", _text, "DP-SGD step: embedding 1000x32 + dense, batch 32"),
    DPWorkload("dp_wide_mlp", _wide_mlp,
               "DP-SGD step: MLP 1024-1024-1024-10, batch 64 (time and peak memory)"),
]
DP_BY_NAME = {w.name: w for w in DP_WORKLOADS}


# -- compiled DP steps ---------------------------------------------------------
# Keras 3 models, each step in tf.function, gradients only (no optimizer):
#   plain fn   tf.GradientTape, the mean loss's gradient (a non-private step)
#   +noise fn  the same, plus TF's normal noise on every gradient: the floor
#              of any DP step (drawing the noise costs what it costs)
#   dp fn      fasttape.GradientTape recorded in the function, dp_gradient
#   vmap fn    vectorized_map over single-example tf.GradientTape's (as above)
# timed side by side in one process, in rotated order each round; medians.

COMPILED_BATCH = 64


def _keras_model(tf, layers, input_shape, input_dtype="float32"):
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(input_shape, dtype=input_dtype)] + layers)
    return model


def _compiled_case(tf, layers, x, classes=10):
    """(params, batch, per-example losses) of a Keras model on batch x."""
    model = _keras_model(tf, layers(), x.shape[1:],
                         "int32" if x.dtype.is_integer else "float32")
    rng = np.random.default_rng(20)
    labels = tf.constant(rng.integers(0, classes, x.shape[0]))

    def losses(x, labels):
        logits = model(x)
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
    return model.trainable_variables, (x, labels), losses


def _c_mlp(n_in, width):
    """An MLP n_in-width-width-10 at batch 64."""
    def make(tf):
        import keras  # pylint: disable=import-outside-toplevel
        x = tf.random.stateless_normal([64, n_in], seed=[1, n_in])
        return _compiled_case(tf, lambda: [
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"), keras.layers.Dense(10)], x)
    return make


def _c_text(tf):
    import keras  # pylint: disable=import-outside-toplevel
    x = tf.random.stateless_uniform([32, 16], seed=[1, 3], maxval=1000,
                                    dtype=tf.int32)
    return _compiled_case(tf, lambda: [
        keras.layers.Embedding(1000, 64), keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(10)], x)


def _c_layernorm(tf):
    import keras  # pylint: disable=import-outside-toplevel
    x = tf.random.stateless_normal([64, 16, 32], seed=[1, 4])
    return _compiled_case(tf, lambda: [
        keras.layers.Dense(64, activation="relu"),
        keras.layers.LayerNormalization(), keras.layers.Dense(64),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)], x)


def _c_conv(tf):
    import keras  # pylint: disable=import-outside-toplevel
    x = tf.random.stateless_normal([64, 16, 16, 3], seed=[1, 5])
    return _compiled_case(tf, lambda: [
        keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)], x)


def _c_lstm(tf):
    import keras  # pylint: disable=import-outside-toplevel
    x = tf.random.stateless_normal([32, 12, 16], seed=[1, 6])
    return _compiled_case(tf, lambda: [keras.layers.LSTM(32), keras.layers.Dense(10)], x)


def _c_dilated_bn(tf):
    """Issue 43's convnet: a dilated Conv2D and BatchNormalization in
    inference (their rules, traced)."""
    import keras  # pylint: disable=import-outside-toplevel
    x = tf.random.stateless_normal([64, 16, 16, 3], seed=[1, 7])
    return _compiled_case(tf, lambda: [
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Conv2D(16, 3, dilation_rate=2, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)], x)


def _c_groupnorm(tf):
    import keras  # pylint: disable=import-outside-toplevel
    x = tf.random.stateless_normal([64, 16, 32], seed=[1, 8])
    return _compiled_case(tf, lambda: [
        keras.layers.Dense(64, activation="relu"),
        keras.layers.GroupNormalization(8), keras.layers.Dense(64),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)], x)


def _c_conv_transpose(tf):
    import keras  # pylint: disable=import-outside-toplevel
    x = tf.random.stateless_normal([64, 8, 8, 3], seed=[1, 9])
    return _compiled_case(tf, lambda: [
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Conv2DTranspose(16, 3, strides=2, activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)], x)


def _c_generated(seed):
    """A model drawn from ``seed`` (kinds, widths, depths, batch): the
    bench's held-out cases, not tuned to."""
    def make(tf):
        import keras  # pylint: disable=import-outside-toplevel
        rng = np.random.default_rng(seed)
        kind = ["mlp", "conv", "text", "sequence"][seed % 4]
        batch = int(rng.choice([16, 32, 64, 128]))
        width = int(rng.choice([32, 64, 128, 512]))
        depth = int(rng.integers(1, 4))
        act = str(rng.choice(["relu", "tanh", "gelu"]))
        if kind == "mlp":
            x = tf.random.stateless_normal([batch, int(rng.integers(4, 300))], seed=[seed, 1])
            layers = lambda: [keras.layers.Dense(width, activation=act)
                              for _ in range(depth)] + [keras.layers.Dense(10)]
        elif kind == "conv":
            size = int(rng.choice([8, 12, 24]))
            x = tf.random.stateless_normal([batch, size, size, int(rng.integers(1, 4))],
                                           seed=[seed, 1])
            layers = lambda: [keras.layers.Conv2D(int(rng.choice([8, 16, 32])), 3,
                                                  padding="same", activation=act)
                              for _ in range(depth)] + [
                keras.layers.Flatten(), keras.layers.Dense(10)]
        elif kind == "text":
            vocab, t = int(rng.choice([500, 5000, 20000])), int(rng.choice([8, 32, 64]))
            x = tf.random.stateless_uniform([batch, t], seed=[seed, 1], maxval=vocab,
                                            dtype=tf.int32)
            layers = lambda: [keras.layers.Embedding(vocab, width),
                              keras.layers.GlobalAveragePooling1D()] + [
                keras.layers.Dense(width, activation=act) for _ in range(depth - 1)] + [
                keras.layers.Dense(10)]
        else:
            x = tf.random.stateless_normal([batch, int(rng.choice([4, 16, 32])), 32],
                                           seed=[seed, 1])
            layers = lambda: [keras.layers.Dense(width, activation=act),
                              keras.layers.LayerNormalization()] + [
                keras.layers.Dense(width, activation=act) for _ in range(depth - 1)] + [
                keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)]
        return _compiled_case(tf, layers, x)
    return make


def _compiled_steps(tf, fasttape, params, batch, losses):
    steps = _steps(tf, fasttape, params, batch, losses, plain_tape=tf.GradientTape)
    plain = steps["plain"]

    def noised(noise):
        grads = plain(noise)
        return [tf.convert_to_tensor(g) + tf.random.normal(
            tf.shape(p), stddev=CLIP * noise / int(batch[0].shape[0]))
                for g, p in zip(grads, params)]

    return {"plain fn": tf.function(plain), "+noise fn": tf.function(noised),
            "dp fn": tf.function(steps["dp"]), "vmap fn": steps["vmap fn"]}


def run_dp_compiled_workload(tf, fasttape, workload, repeats, warmup):
    """One row of compiled steps: median ms per arm, spreads, extra peak MB."""
    params, batch, losses = workload.make(tf)
    steps = _compiled_steps(tf, fasttape, params, batch, losses)
    equal = check_equal(tf, steps["vmap fn"](0.0), steps["dp fn"](0.0))
    for _ in range(warmup + 1):
        for step in steps.values():
            step(NOISE)
    times = {name: [] for name in steps}
    arms = tuple(steps)
    for i in range(repeats):
        k = i % len(arms)
        for name in arms[k:] + arms[:k]:
            t0 = time.perf_counter()
            out = steps[name](NOISE)
            # (the values, not only the dispatch: a step's outputs are ready)
            [getattr(g, "values", g).numpy() for g in out if g is not None]  # pylint: disable=expression-not-assigned
            times[name].append(time.perf_counter() - t0)
    return _row(tf, workload, equal, steps, times)


def format_dp_compiled_table(rows):
    arms = ["plain fn", "+noise fn", "dp fn", "vmap fn"]
    lines = [f"{'workload':<16}" + "".join(f"{a:>15}" for a in arms)
             + f"{'dp/plain':>9}{'dp/+noise':>10}{'+noise/plain':>13}{'vmap/plain':>11}"
             f"{'MB plain':>9}{'MB dp':>7}{'MB vmap':>8}"]
    for r in rows:
        cells = "".join(f"{with_spread(r[a], r[a + ' spread']):>15}" for a in arms)
        mb = [r[a + " MB"] for a in ("plain fn", "dp fn", "vmap fn")]
        mb_cells = "".join(f"{m:>{w}.1f}" if m is not None else f"{'-':>{w}}"
                           for m, w in zip(mb, (9, 7, 8)))
        lines.append(f"{r['workload']:<16}{cells}{r['dp fn'] / r['plain fn']:>9.2f}"
                     f"{r['dp fn'] / r['+noise fn']:>10.2f}"
                     f"{r['+noise fn'] / r['plain fn']:>13.2f}"
                     f"{r['vmap fn'] / r['plain fn']:>11.2f}{mb_cells}")
    gen = [r for r in rows if r["workload"].startswith("dpc_gen")]
    # (+noise fn / plain fn: the noise's own cost; above 1.3 on a model, no
    # DP step drawing TF's normal noise is within 1.3x of the plain step)
    for num, den in (("dp fn", "plain fn"), ("dp fn", "+noise fn"),
                     ("+noise fn", "plain fn")):
        ratios = [r[num] / r[den] for r in gen]
        if ratios:
            lines.append(f"generated models, {num} / {den}: median "
                         f"{np.median(ratios):.2f}, worst {max(ratios):.2f}")
    return "\n".join(lines)


DP_COMPILED_WORKLOADS = [
    DPWorkload("dpc_mlp", _c_mlp(8, 256), "compiled DP step: MLP 8-256-256-10, batch 64"),
    DPWorkload("dpc_text", _c_text,
               "compiled DP step: Embedding(1000,64)+Dense, batch 32, T=16"),
    DPWorkload("dpc_layernorm", _c_layernorm,
               "compiled DP step: Dense+LayerNormalization, batch 64, T=16"),
    DPWorkload("dpc_conv", _c_conv, "compiled DP step: 2 Conv2D + Dense, batch 64"),
    DPWorkload("dpc_lstm", _c_lstm, "compiled DP step: LSTM(32) + Dense, batch 32"),
    DPWorkload("dpc_dilated_bn", _c_dilated_bn,
               "compiled DP step: Conv2D, dilated Conv2D, BatchNormalization "
               "(inference), Dense, batch 64"),
    DPWorkload("dpc_groupnorm", _c_groupnorm,
               "compiled DP step: Dense+GroupNormalization, batch 64, T=16"),
    DPWorkload("dpc_conv_transpose", _c_conv_transpose,
               "compiled DP step: Conv2D, Conv2DTranspose, Dense, batch 64"),
    DPWorkload("dpc_wide_mlp", _c_mlp(1024, 1024),
               "compiled DP step: MLP 1024-1024-1024-10, batch 64 (peak memory)"),
] + [DPWorkload(f"dpc_gen{s}", _c_generated(s),
                f"compiled DP step: a model drawn from seed {s}")
     for s in range(8)]
DP_COMPILED_BY_NAME = {w.name: w for w in DP_COMPILED_WORKLOADS}
