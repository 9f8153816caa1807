"""Parity harness: one test body, run under tf.GradientTape and fasttape.

A *case* is a function ``case(GradientTape)`` that builds its inputs, records
under the given tape class and returns any nest of tensors / None / Python
values. ``assert_parity(case)`` runs it with both implementations and
compares: structure, None positions, dtypes, shapes, values (per-dtype
tolerances, or bit for bit with ``exact=True``), or — if TF raises — that
fasttape raises the same exception type.

Bit-exact mode: fasttape runs the backward functions and sums gradient
contributions in the order TF's tape does, so an eager gradient equals TF's
bit for bit wherever TF's own eager tape is deterministic. Where the values
differ, the TF case is run again: if TF's two results differ from each
other too (a kernel whose last bits vary run to run), the case falls back
to the tolerances. FASTTAPE_PARITY_EXACT=1 makes exact the default (a
survey of which cases differ in the last bit).
"""

import contextlib
import gc
import os
import unittest

import numpy as np
import tensorflow as tf
from absl import logging as absl_logging
from tensorflow.core.function.polymorphism import function_cache
from tensorflow.python.eager import forwardprop as tf_forwardprop
from tensorflow.python.eager.polymorphic_function import tracing_compilation
from tensorflow.python.framework import test_util
from tensorflow.python.platform import tf_logging

import fasttape

IMPLEMENTATIONS = {"tf": tf.GradientTape, "fasttape": fasttape.GradientTape}

# (rtol, atol) per dtype, for the comparisons that are not bit-exact
# (graph-mode passes, where Grappler may reorder; model loops whose kernels
# TF itself does not run deterministically).
TOLERANCES = {
    tf.float16: (1e-2, 1e-2),
    tf.bfloat16: (2e-2, 2e-2),
    tf.float32: (1e-5, 1e-6),
    tf.float64: (1e-10, 1e-12),
    tf.complex64: (1e-5, 1e-6),
    tf.complex128: (1e-10, 1e-12),
}


EXACT_DEFAULT = os.environ.get("FASTTAPE_PARITY_EXACT", "") not in ("", "0")
# The exact comparisons that fell back to tolerances (TF's results differ
# run to run), by case name: tests may check it stays empty.
TF_NONDETERMINISTIC = []


class Raised:
    """What a case raised, kept for comparison."""

    def __init__(self, exc):
        self.exc = exc

    def __repr__(self):
        return f"Raised({type(self.exc).__name__}: {self.exc})"


def run_case(case, impl):
    try:
        return case(IMPLEMENTATIONS[impl])
    except Exception as exc:  # noqa: BLE001 - compared, never swallowed
        return Raised(exc)


def _to_numpy(x):
    if isinstance(x, tf.IndexedSlices):
        x = tf.convert_to_tensor(x)
    if isinstance(x, (tf.Tensor, tf.Variable)):
        return x.dtype, x.numpy()
    return None, x


def _bits(x):
    return np.ascontiguousarray(x).tobytes()


def assert_same(expected, actual, path="result", rtol=None, atol=None,
                exact=False):
    """Compare two result nests (expected from TF); with ``exact``, values
    bit for bit."""
    if isinstance(expected, Raised) or isinstance(actual, Raised):
        assert isinstance(expected, Raised) and isinstance(actual, Raised), (
            f"{path}: tf gave {expected!r}, fasttape gave {actual!r}")
        assert type(actual.exc) is type(expected.exc), (
            f"{path}: tf raised {type(expected.exc).__name__}: {expected.exc}; "
            f"fasttape raised {type(actual.exc).__name__}: {actual.exc}")
        return
    if expected is None or actual is None:
        assert expected is None and actual is None, (
            f"{path}: tf gave {expected!r}, fasttape gave {actual!r}")
        return
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(expected) == set(actual), path
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}[{k!r}]", rtol, atol,
                        exact)
        return
    if isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), (
            f"{path}: tf gave {type(expected).__name__}, "
            f"fasttape gave {type(actual).__name__}")
        assert len(actual) == len(expected), f"{path}: length differs"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}[{i}]", rtol, atol, exact)
        return
    assert isinstance(actual, tf.IndexedSlices) == isinstance(
        expected, tf.IndexedSlices), (
            f"{path}: tf gave {type(expected).__name__}, "
            f"fasttape gave {type(actual).__name__}")
    e_dtype, e = _to_numpy(expected)
    a_dtype, a = _to_numpy(actual)
    if e_dtype is None:
        assert e == a, f"{path}: tf gave {e!r}, fasttape gave {a!r}"
        return
    assert a_dtype == e_dtype, f"{path}: dtype {a_dtype} != tf's {e_dtype}"
    assert np.shape(a) == np.shape(e), (
        f"{path}: shape {np.shape(a)} != tf's {np.shape(e)}")
    if exact:
        if _bits(a) != _bits(e):
            differ = int(np.sum(~((a == e) | ((a != a) & (e != e)))))
            raise AssertionError(
                f"{path}: not bit for bit TF's ({differ} of {np.size(e)} "
                f"elements differ in value, dtype {e_dtype.name})")
        return
    r, t = TOLERANCES.get(e_dtype, (0, 0))
    np.testing.assert_allclose(
        np.asarray(a, dtype=np.complex128 if np.iscomplexobj(e) else np.float64)
        if e_dtype in TOLERANCES else a,
        np.asarray(e, dtype=np.complex128 if np.iscomplexobj(e) else np.float64)
        if e_dtype in TOLERANCES else e,
        rtol=r if rtol is None else rtol, atol=t if atol is None else atol,
        err_msg=path)


def assert_parity(case, rtol=None, atol=None, allow_tf_error=True,
                  exact=None, tf_result=None):
    """Run ``case`` under both implementations and compare the results.

    Returns TF's result. If TF raised and ``allow_tf_error`` is False the
    test fails (use it where TF is expected to succeed). ``exact``: values
    bit for bit where TF's own results are (None: EXACT_DEFAULT).
    ``tf_result``: what ``case`` gave under TF's tape in an earlier run of
    the very same computation, used instead of running it again (where the
    values differ, TF still runs again to see whether its own last bits
    vary).
    """
    if exact is None:
        exact = EXACT_DEFAULT
    expected = run_case(case, "tf") if tf_result is None else tf_result
    actual = run_case(case, "fasttape")
    if not exact:
        return compare(expected, actual, rtol, atol, allow_tf_error)
    try:
        return compare(expected, actual, rtol, atol, allow_tf_error, exact=True)
    except AssertionError:
        if tf_deterministic(case, expected):
            raise
    # TF's own results differ run to run: the last bits are not TF's to
    # give, only the tolerances apply.
    TF_NONDETERMINISTIC.append(getattr(case, "__qualname__", repr(case)))
    return compare(expected, actual, rtol, atol, allow_tf_error)


def tf_deterministic(case, expected):
    """Whether running ``case`` under TF's tape again gives ``expected``
    bit for bit."""
    try:
        assert_same(expected, run_case(case, "tf"), exact=True)
    except AssertionError:
        return False
    return True


def compare(expected, actual, rtol=None, atol=None, allow_tf_error=True,
            exact=False):
    """Compare TF's result (or Raised) with fasttape's; return TF's. If TF
    raised and ``allow_tf_error`` is False the test fails. ``exact``:
    values bit for bit."""
    if not allow_tf_error and isinstance(expected, Raised):
        raise AssertionError(f"tf failed: {expected!r}") from expected.exc
    if isinstance(actual, Raised) and not isinstance(expected, Raised):
        raise AssertionError(
            f"fasttape raised where tf succeeded: {actual!r}") from actual.exc
    assert_same(expected, actual, rtol=rtol, atol=atol, exact=exact)
    return expected


_WARN_LEVELS = {absl_logging.WARN, tf_logging.WARN}


@contextlib.contextmanager
def captured_log_first_n(*logging_modules):
    """Capture ``log_first_n`` calls made through each given logging module
    (e.g. TF's backprop.logging and fasttape.tape.logging) as
    ("WARN" or level, message) records.

    Patching the function (not a handler) sidesteps log_first_n's per call
    site counter, which would make a warning vanish after 5 (or 1) calls.
    """
    records = []

    def fake(level, msg, n, *args):
        del n
        records.append(("WARN" if level in _WARN_LEVELS else level,
                        msg % args if args else msg))

    modules = {id(m): m for m in logging_modules}
    saved = [(m, m.log_first_n) for m in modules.values()]
    for m in modules.values():
        m.log_first_n = fake
    try:
        yield records
    finally:
        for m, fn in saved:
            m.log_first_n = fn


class SaturatedTraceCount(dict):
    """TF's per-op JVP trace counter, past its limit for every op."""

    def get(self, key, default=None):
        return tf_forwardprop._TRACE_COUNT_LIMIT


def fresh_tf_jvp_trace_state(monkeypatch, trace_count, cache=None):
    """TF's JVP traces start anew: an empty function cache (shared, as in TF,
    by the exact- and relaxed-shape configs; ``cache``: this one, for a state
    kept across tests) and ``trace_count``."""
    if cache is None:
        cache = function_cache.FunctionCache()
    for config in ("_jvp_exact_config", "_jvp_relaxed_config"):
        old = getattr(tf_forwardprop, config)
        monkeypatch.setattr(tf_forwardprop, config, tracing_compilation.TracingOptions(
            tf_forwardprop._jvp_helper_wrapper, name=old.name,
            reduce_retracing=old.reduce_retracing, function_cache=cache))
    monkeypatch.setattr(tf_forwardprop, "_TRACE_COUNT", trace_count)


class _LeakChecks(unittest.TestCase):
    """The ``self`` TF's leak decorators expect (they call self.assertEqual)."""

    def runTest(self):  # pragma: no cover - never run as a test
        pass


def assert_leaks_nothing(step):
    """Run ``step()`` once to warm up, then under TF's
    ``assert_no_new_tensors`` and ``assert_no_garbage_created``, then once
    more with the garbage collector saving every object it would free.

    TF's garbage check sets only ``DEBUG_UNCOLLECTABLE``, so it sees objects
    the collector cannot free (rare since Python 3.4), not ordinary
    reference cycles; the last run fails on any object that only the cycle
    collector frees (a step that leaves work for it: memory held until the
    next collection)."""
    step()

    def body(self):
        del self
        step()

    test_util.assert_no_new_tensors(body)(_LeakChecks())
    test_util.assert_no_garbage_created(body)(_LeakChecks())
    cycles = _cyclic_garbage(step)
    assert not cycles, (
        f"the step left {len(cycles)} objects in reference cycles, e.g. "
        + ", ".join(sorted({type(o).__name__ for o in cycles})[:12]))


def _cyclic_garbage(step):
    """Objects that only the cycle collector freed after ``step()``."""
    gc.collect()
    enabled, flags = gc.isenabled(), gc.get_debug()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    before = len(gc.garbage)
    try:
        step()
        gc.collect()
        found = [o for o in gc.garbage[before:]
                 if getattr(o, "__module__", "") != "ast"]
    finally:
        del gc.garbage[before:]
        gc.set_debug(flags)
        if enabled:
            gc.enable()
    return found


@contextlib.contextmanager
def compiled_mode(mode):
    """fasttape's compiled-backward cache in ``mode`` (auto, always, verify,
    off) for the block."""
    from fasttape.gradients import _compiled  # pylint: disable=import-outside-toplevel
    previous = _compiled.set_mode(mode)
    try:
        yield
    finally:
        _compiled.set_mode(previous)
