"""``python -m fasttape bench``: fasttape against tf.GradientTape, side by side.

Each workload is run in one process, in alternation: the forward pass with no
tape (the floor), tf.GradientTape, fasttape.GradientTape. Gradients of the
two tapes are checked equal before anything is timed. Medians are printed,
with the ratio fasttape/tf (below 1 means fasttape is faster).
"""

import argparse
import cProfile
import json
import statistics
import sys
import time

import numpy as np


class Workload:
    """name, and ``make()`` -> (forward, step): forward() runs the model with
    no tape; step(GradientTape) records and returns the gradients."""

    def __init__(self, name, make, description, repeats=None):
        self.name = name
        self.make = make
        self.description = description
        self.repeats = repeats


def _chain(tf):
    x = tf.constant([[0.5, 0.6], [0.7, 0.8]])
    y0 = tf.constant([[0.1, 0.2], [0.3, 0.4]])

    def forward():
        y = y0
        for _ in range(200):
            y = tf.sin(y) * x
        return y

    def step(GradientTape):
        with GradientTape() as tape:
            tape.watch(x)
            y = forward()
        return tape.gradient(y, x)

    return forward, step


def _dense_stack(tf, sizes, batch, seed):
    rng = np.random.default_rng(seed)
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        w = tf.Variable(rng.normal(0, 1 / np.sqrt(n_in), (n_in, n_out)).astype("float32"))
        b = tf.Variable(np.zeros(n_out, "float32"))
        params += [w, b]
    x = tf.constant(rng.normal(size=(batch, sizes[0])).astype("float32"))
    labels = tf.constant(rng.integers(0, sizes[-1], batch))

    def forward():
        h = x
        for i in range(0, len(params), 2):
            h = tf.nn.bias_add(tf.matmul(h, params[i]), params[i + 1])
            if i + 2 < len(params):
                h = tf.nn.relu(h)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, h))

    def step(GradientTape):
        with GradientTape() as tape:
            loss = forward()
        return tape.gradient(loss, params)

    return forward, step


def _mlp_small(tf):
    return _dense_stack(tf, [64, 64, 64, 64], 32, 0)


def _mlp_large(tf):
    return _dense_stack(tf, [784, 256, 256, 10], 64, 1)


def _embedding(tf):
    rng = np.random.default_rng(2)
    table = tf.Variable(rng.normal(size=(1000, 32)).astype("float32"))
    w = tf.Variable(rng.normal(size=(32, 1)).astype("float32"))
    ids = tf.constant(rng.integers(0, 1000, (64, 8)))

    def forward():
        e = tf.reduce_mean(tf.gather(table, ids), axis=1)
        return tf.reduce_mean(tf.square(tf.matmul(e, w)))

    def step(GradientTape):
        with GradientTape() as tape:
            loss = forward()
        return tape.gradient(loss, [table, w])

    return forward, step


def _rnn(tf):
    rng = np.random.default_rng(3)
    wx = tf.Variable(rng.normal(0, 0.3, (16, 32)).astype("float32"))
    wh = tf.Variable(rng.normal(0, 0.3, (32, 32)).astype("float32"))
    b = tf.Variable(np.zeros(32, "float32"))
    xs = tf.constant(rng.normal(size=(40, 8, 16)).astype("float32"))

    def forward():
        h = tf.zeros((8, 32))
        for t in range(40):
            h = tf.tanh(tf.matmul(xs[t], wx) + tf.matmul(h, wh) + b)
        return tf.reduce_sum(h * h)

    def step(GradientTape):
        with GradientTape() as tape:
            loss = forward()
        return tape.gradient(loss, [wx, wh, b])

    return forward, step


def _cnn(tf):
    rng = np.random.default_rng(4)
    k1 = tf.Variable(rng.normal(0, 0.2, (3, 3, 3, 8)).astype("float32"))
    k2 = tf.Variable(rng.normal(0, 0.2, (3, 3, 8, 16)).astype("float32"))
    w = tf.Variable(rng.normal(0, 0.1, (16 * 4 * 4, 10)).astype("float32"))
    x = tf.constant(rng.normal(size=(16, 16, 16, 3)).astype("float32"))
    labels = tf.constant(rng.integers(0, 10, 16))

    def forward():
        h = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME"))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h = tf.nn.relu(tf.nn.conv2d(h, k2, 1, "SAME"))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        logits = tf.matmul(tf.reshape(h, (16, -1)), w)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    def step(GradientTape):
        with GradientTape() as tape:
            loss = forward()
        return tape.gradient(loss, [k1, k2, w])

    return forward, step


def _matmul(tf):
    rng = np.random.default_rng(5)
    a = tf.Variable(rng.normal(size=(512, 512)).astype("float32"))
    b = tf.constant(rng.normal(size=(512, 512)).astype("float32") / 20)

    def forward():
        h = a
        for _ in range(4):
            h = tf.matmul(h, b)
        return tf.reduce_sum(h)

    def step(GradientTape):
        with GradientTape() as tape:
            loss = forward()
        return tape.gradient(loss, a)

    return forward, step


def _hvp(tf):
    rng = np.random.default_rng(6)
    x = tf.Variable(rng.normal(size=(32,)).astype("float32"))
    m = tf.constant(rng.normal(size=(32, 32)).astype("float32") / 6)
    v = tf.constant(rng.normal(size=(32,)).astype("float32"))

    def f():
        h = tf.tanh(tf.linalg.matvec(m, x))
        return tf.reduce_sum(tf.sin(h) * h)

    def step(GradientTape):
        # reverse-over-reverse Hessian-vector product
        with GradientTape() as outer:
            with GradientTape() as inner:
                y = f()
            g = inner.gradient(y, x)
            gv = tf.reduce_sum(g * v)
        return outer.gradient(gv, x)

    return f, step


WORKLOADS = [
    Workload("chain", _chain, "200-step elementwise chain y = sin(y) * x, 2x2"),
    Workload("mlp_small", _mlp_small, "MLP step: 3 dense layers of 64, batch 32"),
    Workload("mlp_large", _mlp_large, "MLP step: 784-256-256-10, batch 64"),
    Workload("rnn", _rnn, "unrolled tanh RNN cell, 40 steps, batch 8"),
    Workload("cnn", _cnn, "small CNN step: 2 conv + pool, batch 16, 16x16"),
    Workload("embedding", _embedding, "embedding step (IndexedSlices)"),
    Workload("hvp", _hvp, "Hessian-vector product (reverse over reverse)"),
    Workload("matmul", _matmul, "compute-bound: 4 chained 512x512 matmuls"),
]
BY_NAME = {w.name: w for w in WORKLOADS}


def _flat(tf, grads):
    if not isinstance(grads, (list, tuple)):
        grads = [grads]
    out = []
    for g in grads:
        if g is None:
            out.append(None)
        else:
            out.append(tf.convert_to_tensor(g).numpy())
    return out


def check_equal(tf, a, b, rtol=1e-4, atol=1e-5):
    fa, fb = _flat(tf, a), _flat(tf, b)
    if len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if (x is None) != (y is None):
            return False
        if x is not None and not np.allclose(x, y, rtol=rtol, atol=atol):
            return False
    return True


def _time(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def run_workload(tf, fasttape, workload, repeats, warmup, profiler=None):
    forward, step = workload.make(tf)
    ref = step(tf.GradientTape)
    got = step(fasttape.GradientTape)
    equal = check_equal(tf, ref, got)
    for _ in range(warmup):
        forward()
        step(tf.GradientTape)
        step(fasttape.GradientTape)
    floor, t_tf, t_ft = [], [], []
    for _ in range(repeats):
        floor.append(_time(forward))
        t_tf.append(_time(step, tf.GradientTape))
        if profiler is not None:
            profiler.enable()
        t_ft.append(_time(step, fasttape.GradientTape))
        if profiler is not None:
            profiler.disable()
    med = statistics.median
    return {
        "workload": workload.name,
        "description": workload.description,
        "grads_equal": bool(equal),
        "floor_ms": med(floor) * 1e3,
        "tf_ms": med(t_tf) * 1e3,
        "fasttape_ms": med(t_ft) * 1e3,
        "ratio": med(t_ft) / med(t_tf),
        "repeats": repeats,
    }


def format_table(rows):
    head = f"{'workload':<12} {'floor ms':>9} {'tf ms':>9} {'fasttape ms':>12} {'ratio':>7}  grads"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['workload']:<12} {r['floor_ms']:>9.3f} {r['tf_ms']:>9.3f} "
            f"{r['fasttape_ms']:>12.3f} {r['ratio']:>7.2f}  "
            f"{'equal' if r['grads_equal'] else 'DIFFER'}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m fasttape bench",
        description="fasttape.GradientTape against tf.GradientTape, side by side.")
    parser.add_argument("--workloads", nargs="+", choices=sorted(BY_NAME),
                        default=[w.name for w in WORKLOADS])
    parser.add_argument("--repeats", type=int, default=30,
                        help="timed steps per workload and tape (default 30)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="also write results as JSON")
    parser.add_argument("--profile", metavar="FILE",
                        help="write cProfile stats of the fasttape steps (pstats/snakeviz)")
    args = parser.parse_args(argv)

    import tensorflow as tf
    import fasttape

    profiler = cProfile.Profile() if args.profile else None
    rows = []
    for name in args.workloads:
        rows.append(run_workload(tf, fasttape, BY_NAME[name], args.repeats,
                                 args.warmup, profiler))
        print(f"  {name}: done", file=sys.stderr, flush=True)
    print(format_table(rows))
    print("\nratio = fasttape / tf.GradientTape, medians of "
          f"{args.repeats} alternating steps (< 1: fasttape faster).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if profiler is not None:
        profiler.dump_stats(args.profile)
        print(f"cProfile stats of the fasttape steps written to {args.profile}")
    if not all(r["grads_equal"] for r in rows):
        print("ERROR: gradients differ on: " + ", ".join(
            r["workload"] for r in rows if not r["grads_equal"]), file=sys.stderr)
        return 1
    return 0
