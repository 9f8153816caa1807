"""The bench's measurement: steps run in alternation (floor, recording,
TF's step, fasttape's step, each round in a shuffled order), gradients
checked equal, medians and spreads, bytes held for the backward pass, and a
rough duration up front."""

import contextlib
import gc
import os
import random
import statistics
import sys
import tempfile
import time
import weakref

import numpy as np

from fasttape.bench.workloads import PER_OP_STEPS, VARIABLE_STEPS


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
    if workload.ops_per_step:
        return max(repeats, PER_OP_STEPS), warmup
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
    pass (or tried to, or instantiated one again: _compiled.builds)."""

    def __init__(self):
        self.first_ms = None

    def step(self, record, impl):
        before = _compiled_builds()
        seconds, result = _time(_step, record, impl)
        if self.first_ms is None and _compiled_builds() > before:
            self.first_ms = seconds * 1e3
        return seconds, result


def traced_steps(tf, workload, record, reference):
    """TF's step traced by ``tf.function``, and with ``jit_compile=True``
    (XLA): {"fn": step, "xla": step}, each traced and run once here, and
    None where it does not apply (shapes that change every step: a traced
    step would see only the first shape), fails to trace or compile, or
    gives other gradients than ``reference`` (TF's eager step's)."""
    steps = {"fn": None, "xla": None}
    if workload.variable:
        return steps
    impl = _Impl(tf.GradientTape, tf.autodiff.ForwardAccumulator)
    for name, jit_compile in (("fn", False), ("xla", True)):
        step = tf.function(lambda: _step(record, impl), jit_compile=jit_compile)
        try:
            # (What XLA logs when it cannot compile a step is shown only
            # if something else goes wrong.)
            with _native_stderr_to_file():
                result = step()
        except Exception:   # noqa: BLE001 -- any failure: the column says n/a
            continue
        if check_equal(tf, reference, result):
            steps[name] = step
    return steps


class _PassClock:
    """The time fasttape's steps spend calling their compiled backward
    passes (TF's executor running the pass's kernels, and the call itself):
    what would be left of fasttape's backward with none of its own Python.
    Installed around the timed steps only."""

    def __init__(self):
        self.seconds = 0.0
        self._class = self._call = None

    def __enter__(self):
        from fasttape.gradients import _compiled
        self._class = _compiled._Compiled  # pylint: disable=protected-access
        self._call = call = self._class.__call__
        clock = self

        def timed(compiled, feeds):
            t0 = time.perf_counter()
            try:
                return call(compiled, feeds)
            finally:
                clock.seconds += time.perf_counter() - t0

        self._class.__call__ = timed
        return self

    def __exit__(self, *exc):
        self._class.__call__ = self._call


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
    build_seconds_before = _compiled_cache().build_seconds
    builds_before = _compiled_builds()
    builds = _Builds()
    # First steps: fasttape's first (so it pays for creating the kernels of
    # the ops both run), then TF's.
    ft_first, ft_result = builds.step(record, ft_impl)
    tf_first, tf_result = _time(_step, record, tf_impl)
    equal = check_equal(tf, tf_result, ft_result)
    traced = traced_steps(tf, workload, record, tf_result)
    off_first = None
    if workload.variable:
        off_first = _time(_step_compiled_off, record, off_impl)[0]
        forward()   # the floor, at the same place in the sequence
    repeats, warmup = _counts(workload, repeats, warmup)
    for _ in range(warmup):
        forward()
        _step(record, tf_impl)
        builds.step(record, ft_impl)
        for step in traced.values():
            if step is not None:
                step()
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
    times = {k: [] for k in ("floor", "rec_tf", "rec_ft", "tf", "fn", "xla",
                             "ft", "off")}
    replayed_before = stats["replayed"]
    timed_before = dict(stats)
    passes = []     # per fasttape step: seconds in its compiled passes' calls
    with _PassClock() as clock:

        def fasttape_step():
            if profiler is not None:
                profiler.enable()
            before = clock.seconds
            times["ft"].append(builds.step(record, ft_impl)[0])
            passes.append(clock.seconds - before)
            if profiler is not None:
                profiler.disable()

        arms = [lambda: times["floor"].append(_time(forward)[0]),
                lambda: times["rec_tf"].append(_time(record, rec_tf_impl)[0]),
                lambda: times["rec_ft"].append(_time(record, rec_ft_impl)[0]),
                lambda: times["tf"].append(_time(_step, record, tf_impl)[0]),
                fasttape_step]
        if workload.variable:
            arms.append(lambda: times["off"].append(
                _time(_step_compiled_off, record, off_impl)[0]))
        # Each round in an order of its own (seeded): a step runs faster
        # or slower after some steps than after others (after a fasttape
        # step with a compiled pass, TF's forward ran up to 80 us slower
        # or 50 us faster, depending on the process), so no arm always
        # follows the same one.
        order = random.Random(0)
        for _ in range(repeats):
            order.shuffle(arms)
            for arm in arms:
                arm()
            tick()
    replayed = stats["replayed"] - replayed_before
    timed = {k: stats[k] - timed_before.get(k, 0) for k in stats}
    # The traced steps in an alternation of their own, after that one: run
    # between eager steps, a traced step slowed the eager step after it
    # (fasttape's replayed pass most), which would blur the tf/fasttape ratio.
    if any(step is not None for step in traced.values()):
        for _ in range(repeats):
            for name, step in traced.items():
                if step is not None:
                    times[name].append(_time(step)[0])
    med = {k: statistics.median(v) * 1e3 for k, v in times.items() if v}
    mean = {k: statistics.fmean(v) * 1e3 for k, v in times.items() if v}
    spread = {k: iqr_ms(v) for k, v in times.items() if v}
    # The ratio's spread: that of the paired per-step ratios ft / tf.
    spread["ratio"] = iqr_ms([f / t / 1e3 for f, t in zip(times["ft"], times["tf"])])
    for name in ("fn", "xla"):
        if times[name]:
            spread["ratio_to_" + name] = iqr_ms(
                [f / t / 1e3 for f, t in zip(times["ft"], times[name])])
    if times["off"]:
        spread["ratio_to_off"] = iqr_ms([f / o / 1e3 for f, o
                                         in zip(times["ft"], times["off"])])
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
        # TF's step traced by tf.function, and compiled by XLA
        # (jit_compile=True), timed in the same alternation; None where
        # not applicable (see traced_steps).
        "tf_function_ms": med.get("fn"),
        "xla_ms": med.get("xla"),
        "ratio_to_tf_function": med["ft"] / med["fn"] if "fn" in med else None,
        "ratio_to_xla": med["ft"] / med["xla"] if "xla" in med else None,
        # fasttape's steps' calls of compiled backward passes (TF's
        # executor), median per step (None: no step called one); with the
        # floor, what fasttape's step would take with none of its own work
        # (its recording and the Python around each pass gone).
        "compiled_pass_ms": (statistics.median(passes) * 1e3
                             if any(passes) else None),
        "record_overhead_tf_ms": med["rec_tf"] - med["floor"],
        "record_overhead_fasttape_ms": med["rec_ft"] - med["floor"],
        # Interquartile range (q1, q3) of each arm's timed steps, in ms
        # ("ratio": of the per-step ratios ft / tf, unscaled).
        "spread_ms": spread,
        "ops_per_step": workload.ops_per_step,
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
        "builds": _compiled_builds() - builds_before,
        # The compiled-pass cache over the timed steps: distinct new keys,
        # passes replayed / run eagerly / built, kernel-cache clears.
        "cache": {k: v for k, v in timed.items() if v},
        "hit_rate": (timed.get("replayed", 0) / gradient_calls
                     if gradient_calls else None),
        "steps_ms": ({k: [round(t * 1e3, 3) for t in v]
                      for k, v in times.items() if v}
                     if workload.variable else None),
    }


def iqr_ms(seconds):
    """(q1, q3) of step times given in seconds, in ms (one step: (t, t))."""
    ms = sorted(s * 1e3 for s in seconds)
    if len(ms) < 2:
        return (ms[0], ms[0]) if ms else (0.0, 0.0)
    q = statistics.quantiles(ms, n=4, method="inclusive")
    return (q[0], q[2])


# Rough cost of one timed step, in forward passes: floor 1, each recording
# arm about 1.5, each eager step (forward + backward) about 3, each traced
# one about 1.
_FORWARDS_PER_STEP = 1 + 2 * 1.5 + 2 * 3 + 2 * 1
_FORWARDS_PER_OFF_STEP = 3


def estimate_seconds(tf, workloads, repeats, warmup):
    """A rough duration of the run, from one (warm) forward pass of each
    workload: its steps (checks, warm-up, timed) times the forward passes
    each one costs, plus a fixed start-up per workload (first steps, tracing)."""
    total = 0.0
    for workload in workloads:
        forward, _ = workload.make(tf)
        forward()
        seconds = _time(forward)[0]
        n_repeats, n_warmup = _counts(workload, repeats, warmup)
        per_step = _FORWARDS_PER_STEP + (_FORWARDS_PER_OFF_STEP if workload.variable else 0)
        total += seconds * per_step * (n_repeats + n_warmup + 4) + 1.0
    return total


def _compiled_cache():
    from fasttape.gradients import _compiled
    return _compiled.CACHE


def _compiled_stats():
    return _compiled_cache().stats


def _compiled_builds():
    from fasttape.gradients import _compiled
    return _compiled.builds()
