"""``python -m fasttape bench``: fasttape against tf.GradientTape, side by side.

Each workload is run in one process, in alternation: the forward pass with no
tape (the floor), tf.GradientTape, fasttape.GradientTape. Gradients of the
two tapes are checked equal before anything is timed. Medians are printed,
with the ratio fasttape/tf (below 1 means fasttape is faster).

TensorFlow is imported quietly (see ``_import_tf``) and TF's own warning that
its pfor jacobian retraces is filtered: both are noise about TF, not about the
measurement. A progress bar goes to stderr (tqdm, on a terminal).
"""

import argparse
import contextlib
import cProfile
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import weakref

import numpy as np


class Workload:
    """name, and ``make(tf)`` -> (forward, record): ``forward()`` runs the
    model with no tape (the floor); ``record(impl)`` runs it under ``impl``'s
    tape or accumulator and returns ``finish``, a function that computes and
    returns the gradients (or JVPs). ``impl`` has ``GradientTape`` and
    ``ForwardAccumulator`` (TF's or fasttape's)."""

    def __init__(self, name, make, description, max_repeats=None,
                 variable=False):
        self.name = name
        self.make = make
        self.description = description
        self.max_repeats = max_repeats
        # Shapes change from step to step: timed from the first step (no
        # warm-up), VARIABLE_STEPS steps at least, judged by the mean (total)
        # time, builds of compiled passes included, and also run with the
        # compiled backward off.
        self.variable = variable


def _grad_case(forward, sources, watch=()):
    def record(impl):
        with impl.GradientTape() as tape:
            for w in watch:
                tape.watch(w)
            loss = forward()
        return lambda: tape.gradient(loss, sources)
    return forward, record


def _chain(tf):
    x = tf.constant([[0.5, 0.6], [0.7, 0.8]])
    y0 = tf.constant([[0.1, 0.2], [0.3, 0.4]])

    def forward():
        y = y0
        for _ in range(200):
            y = tf.sin(y) * x
        return y

    return _grad_case(forward, x, watch=[x])


RECORDING_OPS = 400


def _recording(tf):
    """The recording microbenchmark: a chain of tf.sin on 2x2, where the
    kernels cost least and what a tape adds per op shows most. Its rec tf /
    rec ft columns, divided by RECORDING_OPS, are each tape's recording
    cost per op above the no-tape floor."""
    x = tf.constant([[0.1, 0.2], [0.3, 0.4]])

    def forward():
        y = x
        for _ in range(RECORDING_OPS):
            y = tf.sin(y)
        return y

    return _grad_case(forward, x, watch=[x])


def _dense_stack(tf, sizes, batch, seed):
    rng = np.random.default_rng(seed)
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        w = tf.Variable(rng.normal(0, 1 / np.sqrt(n_in), (n_in, n_out)).astype("float32"))
        b = tf.Variable(np.zeros(n_out, "float32"))
        params += [w, b]
    x = tf.constant(rng.normal(size=(batch, sizes[0])).astype("float32"))
    labels = tf.constant(rng.integers(0, sizes[-1], batch))

    def forward(h=x, labels=labels):
        for i in range(0, len(params), 2):
            h = tf.nn.bias_add(tf.matmul(h, params[i]), params[i + 1])
            if i + 2 < len(params):
                h = tf.nn.relu(h)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, h))

    forward.params = params

    return _grad_case(forward, params)


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

    return _grad_case(forward, [table, w])


def _rnn_cell(tf, seed, max_length):
    """The tanh RNN cell's parameters, and ``run(length)``: the loss after
    ``length`` steps (at most ``max_length``) over a batch of 8."""
    rng = np.random.default_rng(seed)
    wx = tf.Variable(rng.normal(0, 0.3, (16, 32)).astype("float32"))
    wh = tf.Variable(rng.normal(0, 0.3, (32, 32)).astype("float32"))
    b = tf.Variable(np.zeros(32, "float32"))
    xs = tf.constant(rng.normal(size=(max_length, 8, 16)).astype("float32"))

    def run(length):
        h = tf.zeros((8, 32))
        for t in range(length):
            h = tf.tanh(tf.matmul(xs[t], wx) + tf.matmul(h, wh) + b)
        return tf.reduce_sum(h * h)

    return [wx, wh, b], run


def _rnn(tf):
    params, run = _rnn_cell(tf, 3, 40)
    return _grad_case(lambda: run(40), params)


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

    return _grad_case(forward, [k1, k2, w])


def _matmul(tf):
    rng = np.random.default_rng(5)
    a = tf.Variable(rng.normal(size=(512, 512)).astype("float32"))
    b = tf.constant(rng.normal(size=(512, 512)).astype("float32") / 20)

    def forward():
        h = a
        for _ in range(4):
            h = tf.matmul(h, b)
        return tf.reduce_sum(h)

    return _grad_case(forward, a)


def _hvp(tf):
    rng = np.random.default_rng(6)
    x = tf.Variable(rng.normal(size=(32,)).astype("float32"))
    m = tf.constant(rng.normal(size=(32, 32)).astype("float32") / 6)
    v = tf.constant(rng.normal(size=(32,)).astype("float32"))

    def f():
        h = tf.tanh(tf.linalg.matvec(m, x))
        return tf.reduce_sum(tf.sin(h) * h)

    def record(impl):
        # forward-over-reverse Hessian-vector product
        with impl.ForwardAccumulator(x, v) as acc:
            with impl.GradientTape() as tape:
                y = f()
            g = tape.gradient(y, x)
        return lambda: acc.jvp(g)

    return f, record


def _jvp(tf):
    forward, _ = _mlp_small(tf)
    params = forward.params
    rng = np.random.default_rng(7)
    tangents = [tf.constant(rng.normal(size=p.shape).astype("float32"))
                for p in params]

    def record(impl):
        with impl.ForwardAccumulator(params, tangents) as acc:
            loss = forward()
        return lambda: acc.jvp(loss)

    return forward, record


def _jacobian(tf):
    rng = np.random.default_rng(8)
    x = tf.constant(rng.normal(size=(1, 16)).astype("float32"))
    w1 = tf.Variable(rng.normal(0, 0.3, (16, 64)).astype("float32"))
    w2 = tf.Variable(rng.normal(0, 0.3, (64, 32)).astype("float32"))

    def forward():
        return tf.tanh(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2))

    def record(impl):
        with impl.GradientTape() as tape:
            tape.watch(x)
            y = forward()
        return lambda: tape.jacobian(y, x)

    return forward, record


# -- shapes that change from step to step ---------------------------------------

# As many steps as the compiled-backward cache expects a steady key to be
# used (_compiled.HORIZON): it builds a pass when the pass pays back over
# that many calls, so a shorter window would count builds and not what
# they save.
VARIABLE_STEPS = 200


class _Sequence:
    """The values a variable workload's steps go through: the n-th call by
    each caller (``impl``, or None for the floor) gets the n-th value, so
    TF's and fasttape's steps see the same shapes in the same order."""

    def __init__(self, values):
        self.values = list(values)
        self.calls = {}

    def next(self, caller):
        n = self.calls.get(id(caller), 0)
        self.calls[id(caller)] = n + 1
        return self.values[n % len(self.values)]


def _lengths(seed, low, high, distinct=20, steps=VARIABLE_STEPS):
    """Sequence lengths as text gives them: ``distinct`` lengths between
    ``low`` and ``high``, drawn with Zipf-like weights (a few common
    lengths, a long tail), ``steps`` draws."""
    rng = np.random.default_rng(seed)
    choices = np.sort(rng.choice(np.arange(low, high + 1), distinct,
                                 replace=False))
    weights = 1.0 / np.arange(1, distinct + 1)
    rng.shuffle(weights)
    return [int(n) for n in rng.choice(choices, steps, p=weights / weights.sum())]


def _variable_case(forward_at, sequence, sources):
    """A gradient workload whose n-th step runs ``forward_at(value)`` for
    the n-th value of ``sequence``."""
    def forward():
        return forward_at(sequence.next(None))

    def record(impl):
        value = sequence.next(impl)
        with impl.GradientTape() as tape:
            loss = forward_at(value)
        return lambda: tape.gradient(loss, sources)

    return forward, record


def _varlen_rnn(tf):
    """The rnn cell over sequences whose length changes every step."""
    params, run = _rnn_cell(tf, 9, 48)
    return _variable_case(run, _Sequence(_lengths(10, 8, 48)), params)


def _varlen_attention(tf):
    """One self-attention layer (4 heads of 16) over a batch of 8 sequences
    whose length changes every step."""
    rng = np.random.default_rng(11)
    d, heads = 64, 4
    wq, wk, wv, wo = (tf.Variable(rng.normal(0, d ** -0.5, (d, d)).astype("float32"))
                      for _ in range(4))
    xs = tf.constant(rng.normal(size=(8, 128, d)).astype("float32"))

    def split(h, n):
        return tf.transpose(tf.reshape(h, (8, n, heads, d // heads)), (0, 2, 1, 3))

    def forward_at(n):
        x = xs[:, :n]
        q, k, v = (split(tf.matmul(x, w), n) for w in (wq, wk, wv))
        att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / 4.0)
        h = tf.reshape(tf.transpose(tf.matmul(att, v), (0, 2, 1, 3)), (8, n, d))
        return tf.reduce_mean(tf.square(tf.matmul(h, wo) + x))

    return _variable_case(forward_at, _Sequence(_lengths(12, 16, 128)),
                          [wq, wk, wv, wo])


def _last_batch(tf):
    """Training epochs over 1,000 examples in batches of 64: 15 full
    batches, then one of 40."""
    forward, _ = _dense_stack(tf, [64, 64, 64, 10], 1, 13)
    params = forward.params
    rng = np.random.default_rng(13)
    data = rng.normal(size=(1000, 64)).astype("float32")
    labels = rng.integers(0, 10, 1000)
    batches = [(tf.constant(data[i:i + 64]), tf.constant(labels[i:i + 64]))
               for i in range(0, 1000, 64)]

    def forward_at(i):
        return forward(*batches[i])   # the MLP's loss on batch i

    return _variable_case(forward_at, _Sequence(range(len(batches))), params)


def _policy_gradient(tf):
    """REINFORCE-like: per episode ``tf.random.set_seed(episode)`` (which
    drops the kernels of every traced function), then a rollout of a
    variable number of steps sampling actions from a small policy, and
    the gradient of sum(log pi(a_t) * return_t)."""
    rng = np.random.default_rng(14)
    w1 = tf.Variable(rng.normal(0, 0.3, (8, 32)).astype("float32"))
    b1 = tf.Variable(np.zeros(32, "float32"))
    w2 = tf.Variable(rng.normal(0, 0.3, (32, 4)).astype("float32"))
    obs = tf.constant(rng.normal(size=(64, 1, 8)).astype("float32"))
    returns = tf.constant(rng.normal(size=(64,)).astype("float32"))
    episodes = _Sequence(list(enumerate(_lengths(15, 10, 40))))

    def forward_at(episode):
        seed, length = episode
        tf.random.set_seed(seed)
        loss = 0.0
        for t in range(length):
            logits = tf.matmul(tf.nn.relu(tf.matmul(obs[t], w1) + b1), w2)
            action = tf.random.categorical(logits, 1)[:, 0]
            logp = tf.reduce_sum(tf.nn.log_softmax(logits) * tf.one_hot(action, 4))
            loss = loss - logp * returns[t]
        return loss

    return _variable_case(forward_at, episodes, [w1, b1, w2])


WORKLOADS = [
    Workload("chain", _chain, "200-step elementwise chain y = sin(y) * x, 2x2"),
    Workload("mlp_small", _mlp_small, "MLP step: 3 dense layers of 64, batch 32"),
    Workload("mlp_large", _mlp_large, "MLP step: 784-256-256-10, batch 64"),
    Workload("rnn", _rnn, "unrolled tanh RNN cell, 40 steps, batch 8"),
    Workload("cnn", _cnn, "small CNN step: 2 conv + pool, batch 16, 16x16"),
    Workload("embedding", _embedding, "embedding step (IndexedSlices)"),
    Workload("hvp", _hvp, "Hessian-vector product (forward over reverse)"),
    Workload("jvp", _jvp, "JVP through the small MLP (forward mode)"),
    Workload("jacobian", _jacobian, "jacobian of a 32-output function",
             max_repeats=10),
    Workload("matmul", _matmul, "compute-bound: 4 chained 512x512 matmuls"),
    Workload("recording", _recording,
             f"recording cost: {RECORDING_OPS} chained tf.sin, 2x2 "
             f"(rec / {RECORDING_OPS} = per op)"),
    Workload("varlen_rnn", _varlen_rnn, "rnn cell over 8-48 steps, 20 lengths "
             "(Zipf-like), a new length each step", variable=True),
    Workload("varlen_attention", _varlen_attention, "self-attention, 4 heads, "
             "batch 8, 20 sequence lengths 16-128", variable=True),
    Workload("last_batch", _last_batch, "MLP epochs of 1,000 examples, batch "
             "64: the 16th batch has 40", variable=True),
    Workload("policy_gradient", _policy_gradient, "REINFORCE rollouts of 10-40 "
             "steps, tf.random.set_seed per episode", variable=True),
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
    result = fn(*args)
    return time.perf_counter() - t0, result


def _step(record, impl):
    return record(impl)()


def held_bytes(tf, record, impl):
    """Bytes of the tensors made during ``record(impl)`` (variable reads
    aside) that are still alive after it returns, while only its ``finish``
    closure is kept: what the tape (or accumulator) holds for the backward
    pass, plus the result."""
    from tensorflow.python.framework import op_callbacks
    from fasttape.gradients._tf_vspace import nbytes
    made = []

    def watch(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        # Variable reads are left out: TF's fast path reads a Variable passed
        # straight into an op inside C++, where no callback sees the value
        # its tape holds, while fasttape reads it in Python (a visible
        # ReadVariableOp). Counting them would charge fasttape alone.
        if op_type in ("ReadVariableOp", b"ReadVariableOp"):
            return
        if graph is None:
            made.extend((weakref.ref(o), nbytes(o)) for o in outputs)

    op_callbacks.add_op_callback(watch)
    try:
        finish = record(impl)
    finally:
        op_callbacks.remove_op_callback(watch)
    gc.collect()
    held = sum(size for ref, size in made if ref() is not None)
    del finish
    return held


class _Impl:
    def __init__(self, GradientTape, ForwardAccumulator):
        self.GradientTape = GradientTape
        self.ForwardAccumulator = ForwardAccumulator


def _counts(workload, repeats, warmup):
    """(repeats, warmup) as run for ``workload``."""
    if workload.max_repeats:
        return min(repeats, workload.max_repeats), min(warmup, 1)
    if workload.variable:
        return max(repeats, VARIABLE_STEPS), 0
    return repeats, warmup


def _step_compiled_off(record, impl):
    from fasttape.gradients import _compiled
    previous = _compiled.set_mode("off")
    try:
        return _step(record, impl)
    finally:
        _compiled.set_mode(previous)


class _Builds:
    """Times fasttape's steps and notes the first that built a compiled
    pass (or tried to: built, slower or failed)."""

    KINDS = ("built", "slower", "failed")

    def __init__(self):
        self.stats = _compiled_stats()
        self.first_ms = None

    def step(self, record, impl):
        before = sum(self.stats[k] for k in self.KINDS)
        seconds, result = _time(_step, record, impl)
        if self.first_ms is None and sum(
                self.stats[k] for k in self.KINDS) > before:
            self.first_ms = seconds * 1e3
        return seconds, result


def run_workload(tf, fasttape, workload, repeats, warmup, profiler=None,
                 tick=lambda: None):
    """One workload's row. ``tick()`` is called once after the checks and
    once per warm-up and timed step (``1 + warmup + repeats`` calls, as
    ``_counts`` gives them): the progress bar."""
    tf_impl = _Impl(tf.GradientTape, tf.autodiff.ForwardAccumulator)
    ft_impl = _Impl(fasttape.GradientTape, fasttape.ForwardAccumulator)
    # Arms of their own (variable workloads give each caller its own run
    # through their sequence): recording only, and the compiled backward off.
    rec_tf_impl = _Impl(tf.GradientTape, tf.autodiff.ForwardAccumulator)
    rec_ft_impl = _Impl(fasttape.GradientTape, fasttape.ForwardAccumulator)
    off_impl = _Impl(fasttape.GradientTape, fasttape.ForwardAccumulator)
    forward, record = workload.make(tf)
    stats = _compiled_stats()
    stats_before = dict(stats)
    build_seconds_before = _compiled_cache().build_seconds
    builds = _Builds()
    # First steps: fasttape's first (so it pays for creating the kernels of
    # the ops both run), then TF's.
    ft_first, ft_result = builds.step(record, ft_impl)
    tf_first, tf_result = _time(_step, record, tf_impl)
    equal = check_equal(tf, tf_result, ft_result)
    off_first = None
    if workload.variable:
        off_first = _time(_step_compiled_off, record, off_impl)[0]
        forward()   # the floor, at the same place in the sequence
    repeats, warmup = _counts(workload, repeats, warmup)
    for _ in range(warmup):
        forward()
        _step(record, tf_impl)
        builds.step(record, ft_impl)
        tick()
    # Checked again in the steady state: after warm-up, fasttape replays
    # compiled backward passes.
    # (Variable workloads: not here, where it would take a step of their
    # sequence from the timed ones.)
    if not workload.variable:
        equal = equal and check_equal(tf, _step(record, tf_impl),
                                      builds.step(record, ft_impl)[1])
    mem_tf = held_bytes(tf, record, rec_tf_impl)
    mem_ft = held_bytes(tf, record, rec_ft_impl)
    tick()
    times = {k: [] for k in ("floor", "rec_tf", "rec_ft", "tf", "ft", "off")}
    replayed_before = stats["replayed"]
    timed_before = dict(stats)
    for _ in range(repeats):
        times["floor"].append(_time(forward)[0])
        times["rec_tf"].append(_time(record, rec_tf_impl)[0])
        times["rec_ft"].append(_time(record, rec_ft_impl)[0])
        times["tf"].append(_time(_step, record, tf_impl)[0])
        if profiler is not None:
            profiler.enable()
        times["ft"].append(builds.step(record, ft_impl)[0])
        if profiler is not None:
            profiler.disable()
        if workload.variable:
            times["off"].append(_time(_step_compiled_off, record, off_impl)[0])
        tick()
    replayed = stats["replayed"] - replayed_before
    timed = {k: stats[k] - timed_before.get(k, 0) for k in stats}
    med = {k: statistics.median(v) * 1e3 for k, v in times.items() if v}
    mean = {k: statistics.fmean(v) * 1e3 for k, v in times.items() if v}
    from fasttape.gradients import _compiled
    gradient_calls = sum(timed.get(k, 0) for k in _compiled.CALL_STATS)
    return {
        "workload": workload.name,
        "description": workload.description,
        "grads_equal": bool(equal),
        "floor_ms": med["floor"],
        "tf_ms": med["tf"],
        "fasttape_ms": med["ft"],
        "ratio": med["ft"] / med["tf"],
        "record_overhead_tf_ms": med["rec_tf"] - med["floor"],
        "record_overhead_fasttape_ms": med["rec_ft"] - med["floor"],
        "held_bytes_tf": mem_tf,
        "held_bytes_fasttape": mem_ft,
        "repeats": repeats,
        # How fasttape's backward passes ran in the timed steps: replayed as
        # one compiled function each, or op by op.
        "backward": ("compiled" if replayed >= repeats
                     else "eager" if replayed == 0 else "mixed"),
        "variable_shapes": workload.variable,
        # Means (totals / steps) of the timed steps: for variable workloads,
        # the builds of compiled passes are among them.
        "tf_mean_ms": mean["tf"],
        "fasttape_mean_ms": mean["ft"],
        "mean_ratio": mean["ft"] / mean["tf"],
        "fasttape_off_mean_ms": mean.get("off"),
        "fasttape_off_ms": med.get("off"),
        "mean_ratio_to_off": (mean["ft"] / mean["off"]) if "off" in mean else None,
        # First steps (item 3): fasttape's very first step, the first step of
        # fasttape's that built a compiled pass (None: none did), TF's first.
        "tf_first_ms": tf_first * 1e3,
        "fasttape_first_ms": ft_first * 1e3,
        "fasttape_off_first_ms": off_first and off_first * 1e3,
        "fasttape_build_step_ms": builds.first_ms,
        "build_seconds": _compiled_cache().build_seconds - build_seconds_before,
        "builds": sum(stats[k] - stats_before.get(k, 0) for k in _Builds.KINDS),
        # The compiled-pass cache over the timed steps: distinct new keys,
        # passes replayed / run eagerly / built, kernel-cache clears.
        "cache": {k: v for k, v in timed.items() if v},
        "hit_rate": (timed.get("replayed", 0) / gradient_calls
                     if gradient_calls else None),
        "steps_ms": ({k: [round(t * 1e3, 3) for t in v]
                      for k, v in times.items() if v}
                     if workload.variable else None),
    }


def _compiled_cache():
    from fasttape.gradients import _compiled
    return _compiled.CACHE


def _compiled_stats():
    return _compiled_cache().stats


def format_table(rows):
    head = (f"{'workload':<11} {'floor':>7} {'tf':>8} {'fasttape':>9} {'ratio':>6}"
            f" {'rec tf':>7} {'rec ft':>7} {'held tf':>8} {'held ft':>8}"
            f"  {'ft backward':<11}  grads")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['workload']:<11} {r['floor_ms']:>7.2f} {r['tf_ms']:>8.2f} "
            f"{r['fasttape_ms']:>9.2f} {r['ratio']:>6.2f} "
            f"{r['record_overhead_tf_ms']:>7.2f} {r['record_overhead_fasttape_ms']:>7.2f} "
            f"{_kib(r['held_bytes_tf']):>8} {_kib(r['held_bytes_fasttape']):>8}  "
            f"{r['backward']:<11}  {'equal' if r['grads_equal'] else 'DIFFER'}")
    return "\n".join(lines)


def format_cache_table(rows):
    """First steps, builds of compiled passes and the cache's churn; for
    variable-shape workloads, mean step times against TF's and against
    fasttape with the compiled backward off."""
    head = (f"{'workload':<16} {'tf 1st':>7} {'ft 1st':>7} {'ft build':>8}"
            f" {'builds':>6} {'build s':>7} {'keys':>5} {'hits':>5}"
            f" {'tf mean':>8} {'ft mean':>8} {'off mean':>8} {'m ratio':>7}"
            f" {'ft/off':>6}")
    lines = [head, "-" * len(head)]

    def opt(value, fmt):
        return "-" if value is None else format(value, fmt)

    for r in rows:
        cache = r["cache"]
        lines.append(
            f"{r['workload']:<16} {r['tf_first_ms']:>7.1f} "
            f"{r['fasttape_first_ms']:>7.1f} "
            f"{opt(r['fasttape_build_step_ms'], '>8.1f')} {r['builds']:>6} "
            f"{r['build_seconds']:>7.2f} {cache.get('new_keys', 0):>5} "
            f"{opt(r['hit_rate'] and 100 * r['hit_rate'], '>4.0f')}% "
            f"{r['tf_mean_ms']:>8.2f} {r['fasttape_mean_ms']:>8.2f} "
            f"{opt(r['fasttape_off_mean_ms'], '>8.2f')} {r['mean_ratio']:>7.2f} "
            f"{opt(r['mean_ratio_to_off'], '>6.2f')}")
    return "\n".join(lines)


def _kib(n):
    return f"{n / 1024:.0f}K"


def _startup_output_hidden():
    """Whether TF's start-up output is hidden: unless the user chose a
    ``TF_CPP_MIN_LOG_LEVEL`` (``0`` shows everything)."""
    return "TF_CPP_MIN_LOG_LEVEL" not in os.environ


@contextlib.contextmanager
def _native_stderr_to_file():
    """File descriptor 2 (C++ and Python alike) goes to a temporary file for
    the block; what was written is shown if the block raises, else dropped."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors="replace"))
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _import_tf():
    """``import tensorflow``, quietly.

    TF's C++ start-up lines (oneDNN, CUDA probing, CPU features) are written
    through absl before TF applies ``TF_CPP_MIN_LOG_LEVEL`` (TF 2.21 writes
    them even at level 3), so setting the variable is not enough: the import
    and the runtime's start (where the device probing logs) run with file
    descriptor 2 sent to a temporary file, shown only if they fail, and the
    level is set to 2 (errors only) for the rest of the run. A user who sets
    ``TF_CPP_MIN_LOG_LEVEL`` gets TF's output as they asked for it."""
    if "tensorflow" in sys.modules or not _startup_output_hidden():
        import tensorflow as tf
        return tf
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    with _native_stderr_to_file():
        import tensorflow as tf
        tf.config.list_logical_devices("CPU")
    return tf


class _DropRetracingWarnings(logging.Filter):
    """TF warns when its pfor jacobian (a new tf.function per call) retraces:
    that is the cost being measured, not news."""

    def filter(self, record):
        return "triggered tf.function retracing" not in record.getMessage()


class _Progress:
    """A tqdm bar on stderr when stderr is a terminal; otherwise one line per
    finished workload."""

    def __init__(self, total):
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=sys.stderr, unit="step",
                            dynamic_ncols=True, leave=False)

    def start(self, name):
        if self.bar is not None:
            self.bar.set_description(name)

    def tick(self):
        if self.bar is not None:
            self.bar.update(1)

    def done(self, name):
        if self.bar is None:
            print(f"  {name}: done", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


PLOT_PARTS = (("floor", "#9e9e9e"), ("recording", "#f2a541"),
              ("backward", "#3b7dd8"))


def step_parts(row):
    """{"tf": {...}, "fasttape": {...}}: each step time split into the floor
    (the forward with no tape), recording (the tape's cost during the
    forward) and backward (the rest: the gradient or JVP computation), in ms.
    Medians are taken separately, so a split can be slightly negative on a
    noisy machine; it is shown as 0."""
    out = {}
    for impl, total, rec in (("tf", "tf_ms", "record_overhead_tf_ms"),
                             ("fasttape", "fasttape_ms",
                              "record_overhead_fasttape_ms")):
        floor = row["floor_ms"]
        recording = row[rec]
        out[impl] = {"floor": floor, "recording": recording,
                     "backward": row[total] - floor - recording,
                     "total": row[total]}
    return out


def _check_plotting():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib, which is not installed: "
            "pip install 'fasttape[plot]' (or pip install matplotlib)") from None


def plot(rows, path):
    """Per workload, TF's and fasttape's step time stacked as floor /
    recording / backward, side by side; one panel (own scale) per workload."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(rows)
    ncols = min(n, 5)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(max(2.6 * ncols, 5.2), 3.0 * nrows + 0.6),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax, row in zip(axes.flat, rows):
        parts = step_parts(row)
        bottom = [0.0, 0.0]
        for part, color in PLOT_PARTS:
            heights = [max(parts[impl][part], 0.0) for impl in ("tf", "fasttape")]
            ax.bar([0, 1], heights, bottom=bottom, color=color, width=0.6,
                   label=part)
            bottom = [b + h for b, h in zip(bottom, heights)]
        for x, impl in enumerate(("tf", "fasttape")):
            ax.annotate(f"{parts[impl]['total']:.3g}", (x, bottom[x]),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks([0, 1], ["tf", "fasttape"])
        ax.set_ylim(0, max(bottom) * 1.15 or 1.0)
        ax.set_title(f"{row['workload']} ({row['ratio']:.2f}x)", fontsize=10)
        ax.set_ylabel("ms per step", fontsize=8)
        ax.tick_params(labelsize=8)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=9)
    fig.suptitle("ms per step, medians (title: ratio fasttape / tf)", fontsize=10)
    fig.savefig(path, dpi=110)


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
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw each workload's step time split into floor / "
                             "recording / backward, TF and fasttape side by side "
                             "(needs matplotlib: pip install 'fasttape[plot]')")
    args = parser.parse_args(argv)
    if args.plot:
        _check_plotting()

    tf = _import_tf()
    import fasttape

    retracing = _DropRetracingWarnings()
    tf_logger = logging.getLogger("tensorflow")
    tf_logger.addFilter(retracing)
    profiler = cProfile.Profile() if args.profile else None
    workloads = [BY_NAME[name] for name in args.workloads]
    progress = _Progress(sum(1 + sum(_counts(w, args.repeats, args.warmup))
                             for w in workloads))
    rows = []
    try:
        for workload in workloads:
            progress.start(workload.name)
            rows.append(run_workload(tf, fasttape, workload, args.repeats,
                                     args.warmup, profiler, tick=progress.tick))
            progress.done(workload.name)
    finally:
        progress.close()
        tf_logger.removeFilter(retracing)
    print(format_table(rows))
    print("\nms per step, medians of alternating runs in one process. ratio ="
          " fasttape / tf (< 1: fasttape faster).\nrec = recording overhead "
          "(forward under the tape minus the floor); held = bytes of forward "
          "tensors the\ntape keeps alive for the backward pass. ft backward: "
          "fasttape's backward passes replayed\nas compiled functions, or "
          "run op by op (eager).")
    for r in rows:
        if r["workload"] == "recording":
            print(f"recording per op above the floor: tf "
                  f"{r['record_overhead_tf_ms'] / RECORDING_OPS * 1e3:.2f} us, "
                  f"fasttape {r['record_overhead_fasttape_ms'] / RECORDING_OPS * 1e3:.2f} us "
                  f"({r['record_overhead_fasttape_ms'] / r['record_overhead_tf_ms']:.2f}x TF's)")
    print()
    print(format_cache_table(rows))
    print("\nms; 1st = each tape's first step (fasttape's runs first); ft "
          "build = fasttape's first step that\nbuilt a compiled backward pass "
          "(- = none did); builds and build s (tracing + first calls): whole\n"
          "run; keys (distinct new pass keys) and hits (replayed passes / "
          "gradient calls): timed steps.\nmean = mean step time over the "
          "timed steps (builds included); off = fasttape with the compiled\n"
          "backward off (variable-shape workloads); m ratio = ft mean / tf "
          "mean; ft/off = ft mean / off mean.")
    if profiler is not None:
        print("(--profile: fasttape's steps ran under cProfile, where backward "
              "passes run op by op so\nthat each op type shows; their times "
              "include the profiler's cost.)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if profiler is not None:
        profiler.dump_stats(args.profile)
        print(f"cProfile stats of the fasttape steps written to {args.profile}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    if not all(r["grads_equal"] for r in rows):
        print("ERROR: gradients differ on: " + ", ".join(
            r["workload"] for r in rows if not r["grads_equal"]), file=sys.stderr)
        return 1
    return 0
