"""The bench's memory-budget workloads (mem_*): one model step under an
unbudgeted fasttape tape and under budgets of 50% and 25% of what that tape
holds, side by side.

  held      the most bytes only the tape holds, at any recorded op or
            backward step (counted afresh at each: a debug run, untimed)
  ratio     step time over the unbudgeted step's (medians of alternating runs)
  peak RSS  the process's peak resident memory during two steps, above its
            resident memory before them (VmHWM reset through
            /proc/self/clear_refs; else ru_maxrss), each budget in a fresh
            subprocess: the first steps, whose passes run eagerly
  steady    the peak over two steps after STEADY steps, when a repeating
            pass is replayed compiled. Resident memory cannot show it (the
            earlier steps' peak stays resident: TF's CPU allocator pools
            its large blocks), so it is the sum of two peaks above their
            levels before the two steps: that pool's own (TF's memory
            statistics, reset before them) and resident memory's, with
            glibc returning the blocks of 64 KiB or more it frees at once.
            Two peaks summed: never below the peak of the two together

The budgeted gradients are checked equal to the unbudgeted ones, bit for bit,
before anything is timed.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np

from fasttape.bench.report import with_spread
from fasttape.bench.timing import iqr_ms

FRACTIONS = (0.5, 0.25)
STEADY = 8      # steps before the steady peak is measured


class MemWorkload:
    """name, description, and ``make(tf)`` -> (params, loss): ``loss()`` runs
    the model's forward pass and returns a scalar."""

    def __init__(self, name, make, description):
        self.name = name
        self.make = make
        self.description = description


def _dense(rng, tf, n_in, n_out):
    return (tf.Variable(rng.normal(0, 1 / np.sqrt(n_in), (n_in, n_out)).astype("float32")),
            tf.Variable(np.zeros(n_out, "float32")))


def _mlp(tf, batch=256):
    rng = np.random.default_rng(20)
    layers = [_dense(rng, tf, 512, 512) for _ in range(12)]
    x = tf.constant(rng.normal(size=(batch, 512)).astype("float32"))

    def loss():
        y = x
        for w, b in layers:
            y = tf.nn.relu(tf.matmul(y, w) + b)
        return tf.reduce_mean(tf.square(y))

    return [v for layer in layers for v in layer], loss


def _convnet(tf):
    rng = np.random.default_rng(21)
    params = []
    for n_in in [3] + [32] * 5:
        params += [tf.Variable(rng.normal(0, 1 / np.sqrt(9 * n_in), (3, 3, n_in, 32)).astype("float32")),
                   tf.Variable(np.zeros(32, "float32"))]
    x = tf.constant(rng.normal(size=(16, 32, 32, 3)).astype("float32"))

    def loss():
        y = x
        for k, b in zip(params[::2], params[1::2]):
            y = tf.nn.relu(tf.nn.conv2d(y, k, 1, "SAME") + b)
        return tf.reduce_mean(tf.square(y))

    return params, loss


def _lstm(tf):
    rng = np.random.default_rng(22)
    hidden, features, steps, batch = 256, 64, 32, 64
    w, b = _dense(rng, tf, features + hidden, 4 * hidden)
    out_w, out_b = _dense(rng, tf, hidden, 1)
    xs = tf.constant(rng.normal(size=(steps, batch, features)).astype("float32"))

    def loss():
        h = tf.zeros((batch, hidden))
        c = tf.zeros((batch, hidden))
        for t in range(steps):
            z = tf.matmul(tf.concat([xs[t], h], 1), w) + b
            i, f, g, o = tf.split(z, 4, axis=1)
            c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
            h = tf.sigmoid(o) * tf.tanh(c)
        return tf.reduce_mean(tf.square(tf.matmul(h, out_w) + out_b))

    return [w, b, out_w, out_b], loss


def _transformer(tf):
    rng = np.random.default_rng(23)
    batch, seq, d, heads, ff = 8, 128, 128, 4, 512
    wq, _ = _dense(rng, tf, d, d)
    wk, _ = _dense(rng, tf, d, d)
    wv, _ = _dense(rng, tf, d, d)
    wo, bo = _dense(rng, tf, d, d)
    w1, b1 = _dense(rng, tf, d, ff)
    w2, b2 = _dense(rng, tf, ff, d)
    g1, g2 = tf.Variable(np.ones(d, "float32")), tf.Variable(np.ones(d, "float32"))
    x = tf.constant(rng.normal(size=(batch, seq, d)).astype("float32"))

    def norm(y, g):
        mean, var = tf.nn.moments(y, axes=[-1], keepdims=True)
        return (y - mean) * tf.math.rsqrt(var + 1e-5) * g

    def split(y):
        return tf.transpose(tf.reshape(y, (batch, seq, heads, d // heads)), (0, 2, 1, 3))

    def loss():
        q, k, v = (split(tf.tensordot(x, m, 1)) for m in (wq, wk, wv))
        att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / np.sqrt(d // heads))
        a = tf.reshape(tf.transpose(tf.matmul(att, v), (0, 2, 1, 3)), (batch, seq, d))
        y = norm(x + tf.tensordot(a, wo, 1) + bo, g1)
        y = norm(y + tf.tensordot(tf.nn.gelu(tf.tensordot(y, w1, 1) + b1), w2, 1) + b2, g2)
        return tf.reduce_mean(tf.square(y))

    return [wq, wk, wv, wo, bo, w1, b1, w2, b2, g1, g2], loss


def _step(fasttape, params, loss, budget):
    with fasttape.GradientTape(memory_budget=budget) as tape:
        value = loss()
    return tape.gradient(value, params)


def _max_held(fasttape, params, loss, budget):
    """The most bytes only the tape holds (debug: counted afresh after every
    recorded op and backward step), the store's counters and the gradient."""
    with fasttape.GradientTape(memory_budget=budget) as tape:
        store = tape._tape.budget  # pylint: disable=protected-access
        store.debug = True
        value = loss()
    grads = tape.gradient(value, params)
    return store.max_held, store, grads


def _budgets(fasttape, params, loss):
    full, _, _ = _max_held(fasttape, params, loss, 10 ** 15)
    return full, [None] + [int(full * f) for f in FRACTIONS]


def peak_rss_child(name, budget, steady=False):
    """(In a fresh process) the peak resident bytes of two steps above the
    resident bytes before them (steady: after STEADY steps, and with the
    peak of TF's pool of large blocks added, see above); printed as
    JSON."""
    import gc  # pylint: disable=import-outside-toplevel
    import resource  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import fasttape  # pylint: disable=import-outside-toplevel
    params, loss = MEM_BY_NAME[name].make(tf)
    loss()          # kernels loaded, no tape
    for _ in range(STEADY if steady else 0):
        _step(fasttape, params, loss, budget)
    gc.collect()
    pool = 0
    if steady:
        stats = tf.config.experimental
        stats.reset_memory_stats("CPU:0")
        pool = -stats.get_memory_info("CPU:0")["current"]
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        how = "VmHWM"
    except OSError:
        how = "ru_maxrss"
    base = _status("VmRSS")
    for _ in range(2):
        _step(fasttape, params, loss, budget)
    peak = (_status("VmHWM") if how == "VmHWM"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if steady:
        pool += stats.get_memory_info("CPU:0")["peak"]
    print(json.dumps({"peak": peak - base + pool, "how": how}))


def _status(key):
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {key} in /proc/self/status")


def _peak_rss(name, budget, steady=False):
    code = ("from fasttape.bench.memory import peak_rss_child; "
            f"peak_rss_child({name!r}, {budget!r}, {steady!r})")
    env = None
    if steady:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
                   MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["peak"]


def _alternate(fasttape, params, loss, budgets, repeats, warmup):
    """Step times per budget ({budget: [seconds]}): the budgets' steps
    alternating, after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for budget in budgets:
            _step(fasttape, params, loss, budget)
    times = {b: [] for b in budgets}
    for _ in range(repeats):
        for budget in budgets:
            t0 = time.perf_counter()
            _step(fasttape, params, loss, budget)
            times[budget].append(time.perf_counter() - t0)
    return times


def run_mem_workload(tf, fasttape, workload, repeats, warmup, rss=True):
    """Rows, one per budget (None, 50%, 25%)."""
    params, loss = workload.make(tf)
    full, budgets = _budgets(fasttape, params, loss)
    reference = _step(fasttape, params, loss, None)
    rows = []
    for budget in budgets:
        held, store, grads = _max_held(fasttape, params, loss,
                                       10 ** 15 if budget is None else budget)
        equal = all(np.array_equal(a.numpy(), b.numpy())
                    for a, b in zip(reference, grads))
        rows.append({"workload": workload.name, "budget": budget,
                     "fraction": None if budget is None else budget / full,
                     "held": held, "grads_equal": bool(equal),
                     "dropped": store.dropped, "recomputed_ops": store.recomputed_ops,
                     "dropped_by_type": dict(store.dropped_by_type)})
    times = _alternate(fasttape, params, loss, budgets, repeats, warmup)
    base = times[None]
    for row in rows:
        seconds = times[row["budget"]]
        row["ms"] = float(np.median(seconds) * 1e3)
        row["spread"] = iqr_ms(seconds)
        row["ratio"] = float(np.median([s / b for s, b in zip(seconds, base)]))
        row["peak_rss"] = _peak_rss(workload.name, row["budget"]) if rss else None
        row["steady_rss"] = (_peak_rss(workload.name, row["budget"], True)
                             if rss else None)
    return rows


def _mb(n):
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def format_mem_table(rows):
    header = (f"{'workload':<16}{'budget':>16}{'held (max)':>14}{'ms/step':>16}"
              f"{'ratio':>8}{'peak RSS':>12}{'steady':>12}{'dropped':>9}{'re-run':>8}")
    lines = [header]
    for r in rows:
        budget = ("none" if r["budget"] is None
                  else f"{r['fraction']:.0%} {_mb(r['budget'])}")
        lines.append(
            f"{r['workload']:<16}{budget:>16}{_mb(r['held']):>14}"
            f"{with_spread(r['ms'], r['spread']):>16}{r['ratio']:>8.2f}"
            f"{_mb(r['peak_rss']):>12}{_mb(r.get('steady_rss')):>12}"
            f"{r['dropped']:>9}{r['recomputed_ops']:>8}")
    return "\n".join(lines)


MEM_WORKLOADS = [
    MemWorkload("mem_mlp", _mlp, "memory budget: MLP of 12 Dense(512), relu, batch 256"),
    # Its weight gradients (12.6 MB, all alive when gradient() returns) are
    # as large as what the tape holds for mem_mlp, so no budget lowers that
    # step's peak; with a batch of 2048 its activations are 8 times them.
    MemWorkload("mem_mlp_wide", lambda tf: _mlp(tf, 2048),
                "memory budget: MLP of 12 Dense(512), relu, batch 2048"),
    MemWorkload("mem_convnet", _convnet, "memory budget: 6 Conv2D(32) 3x3, relu, 16x32x32x3"),
    MemWorkload("mem_lstm", _lstm, "memory budget: LSTM 256 units unrolled 32 steps, batch 64"),
    MemWorkload("mem_transformer", _transformer,
                "memory budget: transformer block, d 128, 4 heads, ff 512, 8x128 tokens"),
]
MEM_BY_NAME = {w.name: w for w in MEM_WORKLOADS}


# -- the generated family (fasttape.bench.family) --------------------------------

MEM_FAMILY = "mem_family"   # the bench's workload name for them
FAMILY_SEED = 4100      # the bench's fixed members
FAMILY_SIZE = 6
FAMILY_SCALE = 16       # their batch, times the test's


def _pool_peak(tf, fasttape, params, loss, budget):
    """The peak of TF's CPU allocator over two steps, above its level before
    them (the steady column's pool part, in this process: the family's
    members are small, and a process each would cost seconds)."""
    stats = tf.config.experimental
    stats.reset_memory_stats("CPU:0")
    before = stats.get_memory_info("CPU:0")["current"]
    for _ in range(2):
        _step(fasttape, params, loss, budget)
    return stats.get_memory_info("CPU:0")["peak"] - before


def run_family_member(tf, fasttape, spec, repeats, warmup, peak=True):
    """One generated member under budgets of 50% and 25% of what the
    unbudgeted tape holds: per budget, the most held bytes and the bound
    (held <= budget + the largest saved tensor), whether the gradients
    equal the unbudgeted ones bit for bit, the step time ratio (medians of
    alternating runs) and the allocator's peak over two steps against the
    unbudgeted one's (after the timed steps: compiled passes in use). The
    steps are timed after STEADY untimed ones at least."""
    from fasttape.bench.family import build, describe  # pylint: disable=import-outside-toplevel
    params, loss = build(tf, spec)
    full, budgets = _budgets(fasttape, params, loss)
    reference = _step(fasttape, params, loss, None)
    rows = []
    for budget in budgets[1:]:
        held, store, grads = _max_held(fasttape, params, loss, budget)
        rows.append({"workload": describe(spec), "budget": budget,
                     "fraction": budget / full, "full": full, "held": held,
                     "largest": store.largest,
                     "bound": held <= budget + store.largest,
                     "warned": store.warned is not None,
                     "grads_equal": all(np.array_equal(a.numpy(), b.numpy())
                                        for a, b in zip(reference, grads)),
                     "dropped": store.dropped,
                     "recomputed_ops": store.recomputed_ops})
    # (Steady steps: a repeating pass, budgeted or not, is compiled after
    # its first few.)
    times = _alternate(fasttape, params, loss, budgets, repeats, max(warmup, STEADY))
    base = times[None]
    peaks = {b: _pool_peak(tf, fasttape, params, loss, b) for b in budgets} if peak else {}
    for row in rows:
        seconds = times[row["budget"]]
        row["ms"] = float(np.median(base) * 1e3)
        row["ratio"] = float(np.median([s / b for s, b in zip(seconds, base)]))
        row["peak"] = peaks.get(row["budget"])
        row["peak_none"] = peaks.get(None)
    return rows


def run_mem_family(tf, fasttape, repeats, warmup, seed=FAMILY_SEED,
                   size=FAMILY_SIZE, scale=FAMILY_SCALE):
    """Rows for the family's fixed members (run_family_member's)."""
    from fasttape.bench.family import family  # pylint: disable=import-outside-toplevel
    return [row for spec in family(seed, size, scale)
            for row in run_family_member(tf, fasttape, spec, repeats, warmup)]


def format_family_table(rows):
    """One line per member and budget, then the family's median and worst."""
    lines = [f"{'member':<44}{'budget':>16}{'held/budget':>13}{'bound':>7}"
             f"{'ms none':>9}{'ratio':>7}{'peak none':>11}{'peak':>10}{'fall':>7}"]
    for r in rows:
        budget = f"{r['fraction']:.0%} {_mb(r['budget'])}"
        fall = (1 - r["peak"] / r["peak_none"]) if r.get("peak_none") else None
        lines.append(
            f"{r['workload'][:43]:<44}{budget:>16}{r['held'] / r['budget']:>13.2f}"
            f"{'ok' if r['bound'] else 'warned' if r.get('warned') else 'OVER':>7}"
            f"{r['ms']:>9.1f}{r['ratio']:>7.2f}"
            f"{_mb(r.get('peak_none')):>11}{_mb(r.get('peak')):>10}"
            f"{'-' if fall is None else f'{fall:.0%}':>7}")
    for fraction in FRACTIONS:
        some = [r for r in rows if abs(r["fraction"] - fraction) < 0.01]
        if not some:
            continue
        ratios = [r["ratio"] for r in some]
        falls = [1 - r["peak"] / r["peak_none"] for r in some if r.get("peak_none")]
        worst = max(some, key=lambda r: r["ratio"])
        lines.append(
            f"family at {fraction:.0%}: {len(some)} members, time ratio median "
            f"{np.median(ratios):.2f}, worst {worst['ratio']:.2f} "
            f"({worst['workload']}); held/budget worst "
            f"{max(r['held'] / r['budget'] for r in some):.2f}, bound kept on "
            f"{sum(r['bound'] for r in some)}/{len(some)} (warned on "
            f"{sum(not r['bound'] and r.get('warned', False) for r in some)} of the "
            f"rest), gradients equal on "
            f"{sum(r['grads_equal'] for r in some)}/{len(some)}"
            + (f"; allocator peak fall median {np.median(falls):.0%}, worst "
               f"{min(falls):.0%}" if falls else ""))
    return "\n".join(lines)
