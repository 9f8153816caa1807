"""Faults around compiled backward passes, TF's classes and fasttape's side
by side.

A compiled pass is something fasttape builds by itself, so building or
calling one may never end worse than TF's eager tape: a kernel error inside
a replayed pass, an exception or KeyboardInterrupt raised by a gradient
function while a pass is traced, an allocation that fails while one is
built (a real ``RLIMIT_AS``, in a subprocess, so that a crash fails the test
rather than pytest), and a forked child (where any ``tf.function`` call
hangs). Each case checks the outcome (TF's exception type, or TF's result),
that the tape stacks are empty afterwards, that no more tensors are left
alive than TF leaves, and that fresh tapes afterwards give the gradients
they gave before the fault, exactly.
"""

import gc
import multiprocessing
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context
from tensorflow.python.framework import errors
from tensorflow.python.framework import ops

import fasttape
from harness import compiled_mode
from fasttape.gradients import _compiled
from fasttape.recording import _recording

CLASSES = {"tf": tf.GradientTape, "fasttape": fasttape.GradientTape}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_compiled_mode = compiled_mode   # compat/harness.py


def _assert_stacks_clean():
    state = _recording._current()  # pylint: disable=protected-access
    assert not state.tapes and not state.accumulators
    assert _recording._live_tapes == 0  # pylint: disable=protected-access
    assert pywrap_tfe.TFE_Py_TapeSetIsEmpty()


def _live_tensors():
    """Eager tensors alive, once every cache TF's leak checks clear is clear."""
    fasttape.clear_caches()
    context.context()._clear_caches()  # pylint: disable=protected-access
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, ops.EagerTensor))


def _outcome(fn):
    """("ok", values) or ("raised", exception type): nothing of the
    exception (traceback, frames, tensors) is kept."""
    try:
        return "ok", [g.numpy() for g in fn()]
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - compared
        return "raised", type(e)


def _fresh(Tape):
    """A gradient whose sums have one term each: exact, step after step."""
    x = tf.constant([0.3, -1.2, 2.5])
    w = tf.constant([1.5, 0.5, -2.0])
    with Tape() as t:
        t.watch([x, w])
        y = tf.reduce_sum(tf.atan(x) * w)
    return [g.numpy() for g in t.gradient(y, [x, w])]


def _side_by_side(scenario, mode="always"):
    """Run ``scenario(Tape)`` with TF's class and fasttape's; compare."""
    results = {}
    for impl, Tape in CLASSES.items():
        with _compiled_mode(mode):
            fasttape.clear_caches()
            fresh_before = _fresh(Tape)
            before = _live_tensors()
            outcome = scenario(Tape)
            _assert_stacks_clean()
            left = _live_tensors() - before
            fresh_after = _fresh(Tape)
        for a, b in zip(fresh_before, fresh_after):
            np.testing.assert_array_equal(a, b)
        results[impl] = (outcome, left, fresh_after)
    (tf_out, tf_left, tf_fresh), (ft_out, ft_left, ft_fresh) = (
        results["tf"], results["fasttape"])
    assert tf_out[0] == ft_out[0], (tf_out, ft_out)
    if tf_out[0] == "raised":
        assert tf_out[1] is ft_out[1], (tf_out, ft_out)
    else:
        for a, b in zip(tf_out[1], ft_out[1]):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    # (TF's run may free tensors an earlier test left to the collector, so
    # its count can fall below zero; fasttape must leave none of its own)
    assert ft_left <= max(tf_left, 0), (ft_left, tf_left)
    for a, b in zip(tf_fresh, ft_fresh):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    return tf_out


# -- a kernel error inside a compiled pass -------------------------------------

def _check_numerics_steps(bad_step, stats):
    """Steps of one tape shape whose backward runs CheckNumerics on the
    incoming gradient (tf.debugging.check_numerics' gradient): finite
    seeds, then at ``bad_step`` a NaN one, which TF's kernel rejects.
    ``stats`` gets the compiled cache's counters of the last run."""
    def scenario(Tape):
        x = tf.constant([0.5, 1.0, 2.0])

        def step(scale):
            with Tape() as t:
                t.watch(x)
                y = tf.debugging.check_numerics(tf.sin(x) * 2.0, "forward")
                loss = tf.reduce_sum(y * scale)
            return [t.gradient(loss, x)]

        outcome = None
        for i in range(3):
            scale = tf.constant([1.0, float("nan") if i == bad_step else 2.0, 3.0])
            outcome = _outcome(lambda: step(scale))
            if outcome[0] == "raised":
                break
        stats.clear()
        stats.update(_compiled.CACHE.stats)
        return outcome
    return scenario


@pytest.mark.parametrize("bad_step", [0, 2], ids=["at_build", "at_replay"])
def test_kernel_error_in_a_compiled_pass_raises_as_tf(bad_step):
    stats = {}
    tf_out = _side_by_side(_check_numerics_steps(bad_step, stats))
    assert tf_out == ("raised", errors.InvalidArgumentError)
    if bad_step == 2:    # the pass was built and replayed before the fault
        assert stats.get("replayed", 0) >= 1
        assert stats.get("replay_failed") == 1


# -- a gradient function that raises while a pass is traced --------------------

class _Injected(RuntimeError):
    pass


@pytest.mark.parametrize("fault", [_Injected, KeyboardInterrupt])
def test_gradient_function_fault_while_a_pass_is_built(fault, monkeypatch):
    """Atan's registered gradient (no fast rule: the eager pass calls it too)
    raises at the step fasttape builds its pass (``always``: the first)."""
    entry = ops._gradient_registry._registry["Atan"]  # pylint: disable=protected-access

    def scenario(Tape):
        x = tf.constant([0.3, 0.7])
        with Tape() as t:
            t.watch(x)
            y = tf.reduce_sum(tf.atan(x) * tf.sin(x))
        original = entry["type"]

        def faulty(op, grad):
            raise fault("injected")

        monkeypatch.setitem(entry, "type", faulty)
        try:
            return _outcome(lambda: [t.gradient(y, x)])
        finally:
            monkeypatch.setitem(entry, "type", original)

    assert _side_by_side(scenario) == ("raised", fault)


def test_gradient_function_fault_on_a_later_build_keeps_later_steps_exact(
        monkeypatch):
    """After a build failed on a fault, the steps of that shape run eagerly
    and exactly as TF's."""
    entry = ops._gradient_registry._registry["Atan"]  # pylint: disable=protected-access
    original = entry["type"]

    def scenario(Tape):
        x = tf.constant([0.3, 0.7])

        def step():
            with Tape() as t:
                t.watch(x)
                y = tf.reduce_sum(tf.atan(x) * tf.sin(x))
            return [t.gradient(y, x)]

        def faulty(op, grad):
            raise _Injected("injected")

        monkeypatch.setitem(entry, "type", faulty)
        first = _outcome(step)
        monkeypatch.setitem(entry, "type", original)
        assert first == ("raised", _Injected)
        return _outcome(lambda: step() + step())

    assert _side_by_side(scenario)[0] == "ok"


# -- an allocation that fails while a pass is built (subprocess) ---------------

_MEMORY_PROGRAMS = {
    # The zeros gradient of split's large unused output is a Fill of a
    # constant shape: TF's instantiation constant-folds it.
    "split_unused_output": """
        n = 1 << 24
        x = tf.fill([n], 1.0)
        def step():
            with Tape() as t:
                t.watch(x)
                a, _ = tf.split(x, [1, n - 1])
                y = a * 2.0
            return t.gradient(y, x)
        result = lambda g: float(g[0])
    """,
}

_MEMORY_SCRIPT = """
import resource, sys
import tensorflow as tf
import fasttape
Tape = fasttape.GradientTape if sys.argv[1] == "fasttape" else tf.GradientTape
{program}
for _ in range(3):
    step()
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), hard))
try:
    print("outcome ok", result(step()), flush=True)
except tf.errors.ResourceExhaustedError:
    print("outcome ResourceExhaustedError", flush=True)
"""


def _run_under_memory_limit(program, impl, mode):
    script = _MEMORY_SCRIPT.format(program=textwrap.dedent(_MEMORY_PROGRAMS[program]))
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
               FASTTAPE_COMPILED_BACKWARD=mode)
    proc = subprocess.run([sys.executable, "-c", script, impl], env=env,
                          capture_output=True, text=True, timeout=300,
                          check=False)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("outcome")]
    assert proc.returncode == 0 and lines, (
        f"{impl} ({mode}) exited with {proc.returncode}: "
        f"{proc.stderr[-2000:]}")
    return lines[-1]


# TF's outcome per program: the same child for both modes, run once.
_TF_OUTCOMES = {}


# auto builds at the fourth step (the one under the limit); always builds at
# the first and replays under the limit.
@pytest.mark.parametrize("mode", ["auto", "always"])
@pytest.mark.parametrize("program", sorted(_MEMORY_PROGRAMS))
def test_build_under_memory_pressure_ends_as_tf(program, mode):
    if program not in _TF_OUTCOMES:
        _TF_OUTCOMES[program] = _run_under_memory_limit(program, "tf", "auto")
    expected = _TF_OUTCOMES[program]
    assert _run_under_memory_limit(program, "fasttape", mode) == expected


def test_large_foldable_constants_keep_a_pass_eager():
    """The mechanism behind the crash, without a memory limit: a pass whose
    graph holds more constant-foldable bytes than the bound is not
    compiled, and its gradient is TF's."""
    n = 1 << 20
    x = tf.fill([n], 1.0)

    def grad(Tape):
        with Tape() as t:
            t.watch(x)
            a, _ = tf.split(x, [1, n - 1])
            y = a * 2.0
        return t.gradient(y, x).numpy()

    expected = grad(tf.GradientTape)
    with _compiled_mode("always"):
        fasttape.clear_caches()
        np.testing.assert_array_equal(grad(fasttape.GradientTape), expected)
        assert _compiled.CACHE.stats["failed"] == 1
        assert _compiled.CACHE.stats["built"] == 0
        fasttape.clear_caches()


# -- a forked child ------------------------------------------------------------

def _fork_step(impl):
    v = tf.Variable(tf.ones([4, 4]) * 0.1)

    def step():
        with CLASSES[impl]() as t:
            h = tf.tanh(tf.sin(v) @ v) * 0.5 + tf.cos(v)
            loss = tf.reduce_sum(tf.exp(h) * h)
        return t.gradient(loss, v).numpy()
    return v, step


def _child(impl, queue):
    _, step = _fork_step(impl)
    result = step()
    _assert_stacks_clean()
    fasttape.clear_caches()      # must not call into TF's runtime either
    queue.put(result)


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_forked_child_runs_as_tfs_tape(mode):
    ctx = multiprocessing.get_context("fork")
    results = {}
    for impl in CLASSES:
        with _compiled_mode(mode):
            _, step = _fork_step(impl)
            for _ in range(5):
                parent = step()
            if impl == "fasttape":
                assert any(c is not _compiled._FAILED  # pylint: disable=protected-access
                           for c in _compiled.CACHE.compiled.values())
            queue = ctx.Queue()
            p = ctx.Process(target=_child, args=(impl, queue))
            p.start()
            p.join(60)
            if p.exitcode is None:
                p.kill()
                p.join()
            assert p.exitcode == 0, f"{impl}: the forked child ended with {p.exitcode}"
            child = queue.get(timeout=10)
        np.testing.assert_array_equal(child, parent)
        results[impl] = child
    np.testing.assert_allclose(results["fasttape"], results["tf"], rtol=1e-6)
    _assert_stacks_clean()
