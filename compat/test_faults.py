"""Faults injected into eager tapes and accumulators, TF's classes and
fasttape's side by side (compiled passes: test_faults_compiled.py).

Each case is a body ``body(impl)`` (``impl`` gives the GradientTape and
ForwardAccumulator classes, and the context that runs the body: TF's classes
as they are, or fasttape's under ``fasttape.patched()``) that raises or
returns values. ``check(body)`` runs it under each implementation and asserts:
  - the outcome is TF's: the same exception type, or the same values;
  - the tape stacks are clean afterwards: no fasttape tape or accumulator on
    the thread's stacks nor counted live (the fast-path wrapper is out), no
    re-entry guard or nesting limit left set, TF's tape and accumulator set
    empty and not stopped, fasttape not patched in;
  - no tensor left alive beyond TF's (the count of TF's
    ``test_util.assert_no_new_tensors``, taken around the faulting run);
  - a fresh tape (and accumulator) afterwards gives the exact gradient.
"""

import contextlib
import gc
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context
from tensorflow.python.eager import execute
from tensorflow.python.framework import errors

import fasttape
from fasttape.recording import _callback
from fasttape.recording import _recording

# Held in a dict: patch() swaps module attributes (a module-level
# ``TF_TAPE = tf.GradientTape`` here would be swapped too).
_CLASSES = {
    "tf": (tf.GradientTape, tf.autodiff.ForwardAccumulator,
           contextlib.nullcontext),
    "fasttape": (fasttape.GradientTape, fasttape.ForwardAccumulator,
                 fasttape.patched),
}
IMPLS = tuple(_CLASSES)


class Impl:
    def __init__(self, name):
        self.name = name
        self.Tape, self.Acc, self.context = _CLASSES[name]


class Boom(Exception):
    """The injected exception."""


# -- what is checked after each run --------------------------------------------------

def assert_clean():
    st = _callback.current()
    assert st.tapes == [] and st.accumulators == [], (st.tapes, st.accumulators)
    assert not st.in_callback and not st.capturing
    assert st.nesting_limit == st.nesting_floor == _callback.NO_LIMIT
    assert _recording._live_tapes == 0   # pylint: disable=protected-access
    hooks = _recording.installed_hooks()
    assert "TFE_Py_FastPathExecute" not in hooks and "execute" not in hooks
    assert execute.execute is not _recording._recording_execute   # pylint: disable=protected-access
    assert pywrap_tfe.TFE_Py_TapeSetIsEmpty(), "a TF tape or accumulator left"
    assert not pywrap_tfe.TFE_Py_TapeSetIsStopped()
    assert not fasttape.is_patched()
    assert tf.GradientTape is _CLASSES["tf"][0]


def _tensor_ids():
    gc.collect()
    return {id(o) for o in gc.get_objects() if isinstance(o, tf.Tensor)}


def _new_tensors(before):
    """Tensors made since ``before`` and still alive, counted as TF's
    assert_no_new_tensors does (after context._clear_caches and a collection)."""
    context.context()._clear_caches()   # pylint: disable=protected-access
    gc.collect()
    return [o for o in gc.get_objects()
            if isinstance(o, tf.Tensor) and id(o) not in before]


def assert_fresh_gradients_exact(impl):
    """A fresh tape and accumulator: d(3 x^2 + x)/dx = 6x + 1, exactly."""
    x = tf.constant([0.5, 2.0, -3.0], tf.float64)
    v = tf.Variable([1.5, -0.25], dtype=tf.float64)
    with impl.Tape(persistent=True) as t:
        t.watch(x)
        y = 3.0 * x * x + x
        w = tf.reduce_sum(v * v * 2.0)
    np.testing.assert_array_equal(t.gradient(y, x).numpy(), [4.0, 13.0, -17.0])
    np.testing.assert_array_equal(t.gradient(w, v).numpy(), [6.0, -1.0])
    with impl.Acc(x, tf.ones_like(x)) as acc:
        y = 3.0 * x * x + x
    np.testing.assert_array_equal(acc.jvp(y).numpy(), [4.0, 13.0, -17.0])
    del t


def _outcome(body, impl):
    """("ok", values as NumPy) or ("raised", exception type); the exception
    object itself is dropped (its traceback holds tensors)."""
    try:
        with impl.context():
            values = body(impl)
        return ("ok", tf.nest.map_structure(
            lambda g: None if g is None else np.asarray(g), values))
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included
        return ("raised", type(exc))


def _assert_same(expected, actual):
    assert expected[0] == actual[0], (expected, actual)
    if expected[0] == "raised":
        assert actual[1] is expected[1], (expected, actual)
        return
    e, a = tf.nest.flatten(expected[1]), tf.nest.flatten(actual[1])
    assert len(e) == len(a), (expected, actual)
    for ei, ai in zip(e, a):
        if ei is None or ai is None:
            assert ei is None and ai is None, (expected, actual)
        elif ei.dtype.kind not in "fciub":
            assert ai.dtype == ei.dtype and np.array_equal(ai, ei), (expected, actual)
        else:
            np.testing.assert_allclose(ai, ei, rtol=1e-6, atol=1e-12)


def check(body, warm_up=None, expect=None):
    """Run ``body`` under TF's classes and fasttape's; compare and check.
    ``warm_up(impl)`` runs first (default: the body itself), so that kernels
    and caches made once are not counted as left alive. ``expect``: the
    exception type TF must raise (None: TF must succeed). Returns the
    outcomes."""
    outcomes, left = {}, {}
    for name in IMPLS:
        impl = Impl(name)
        _outcome(warm_up or body, impl)
        assert_clean()
        before = _tensor_ids()
        outcomes[name] = _outcome(body, impl)
        left[name] = _new_tensors(before)
        del before
        assert_clean()
        assert_fresh_gradients_exact(impl)
        assert_clean()
    tf_outcome = outcomes["tf"]
    if expect is None:
        assert tf_outcome[0] == "ok", tf_outcome
    else:
        assert tf_outcome == ("raised", expect), tf_outcome
    _assert_same(tf_outcome, outcomes["fasttape"])
    assert len(left["fasttape"]) <= len(left["tf"]), (
        "fasttape left alive: " + ", ".join(
            f"{t.dtype.name}{list(t.shape)}" for t in left["fasttape"][:10]),
        len(left["tf"]))
    return outcomes


@pytest.fixture(autouse=True)
def _clean_around():
    assert_clean()
    yield
    if fasttape.is_patched():
        fasttape.unpatch()
    assert_clean()


INTERRUPTS = [Boom, KeyboardInterrupt]


# -- faults inside nested tapes --------------------------------------------------------

@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
@pytest.mark.parametrize("fault", INTERRUPTS, ids=lambda e: e.__name__)
def test_fault_in_the_innermost_of_three_tapes(fault, persistent):
    """Raised while the innermost of three tapes records; the tapes (popped
    by their with blocks) then give the gradients of what they recorded."""
    def body(impl):
        x = tf.constant([0.3, -1.2, 2.0])
        v = tf.Variable([[0.5, -0.1], [0.2, 0.7]])
        try:
            with impl.Tape(persistent=persistent) as t1:
                t1.watch(x)
                a = tf.sin(x) * x
                with impl.Tape(persistent=persistent) as t2:
                    t2.watch(x)
                    b = tf.exp(a) + tf.reduce_sum(v @ v)
                    with impl.Tape(persistent=persistent) as t3:
                        t3.watch(x)
                        c = tf.tanh(b) * a
                        raise fault("deep")
        except fault:
            pass
        return [t3.gradient(c, [x, v]), t2.gradient(c, [x, v]),
                t1.gradient(c, [x, v])]

    check(body)


@pytest.mark.parametrize("fault", INTERRUPTS, ids=lambda e: e.__name__)
def test_fault_in_a_backward_function_under_two_recording_tapes(fault):
    """A custom gradient raises while the innermost tape's gradient runs,
    with two outer tapes recording (a higher-order step); the outer tapes
    then still differentiate what they recorded."""
    def body(impl):
        @tf.custom_gradient
        def f(u):
            def grad(dy):
                if dy.shape.rank is not None:
                    raise fault("in backward")
                return dy
            return tf.identity(u * u), grad

        x = tf.constant([1.5, -0.5])
        with impl.Tape() as t1:
            t1.watch(x)
            with impl.Tape() as t2:
                t2.watch(x)
                with impl.Tape() as t3:
                    t3.watch(x)
                    y = tf.reduce_sum(f(x) * tf.sin(x))
                try:
                    t3.gradient(y, x)
                except fault:
                    pass
                z = tf.reduce_sum(tf.cos(x) * x)
            dz = t2.gradient(z, x)
        return [dz, t1.gradient(dz, x)]

    check(body)


# -- faults inside nested accumulators -----------------------------------------------

@pytest.mark.parametrize("fault", INTERRUPTS, ids=lambda e: e.__name__)
def test_fault_in_the_innermost_of_three_accumulators(fault):
    def body(impl):
        x = tf.constant([0.4, 1.3])
        try:
            with impl.Acc(x, tf.constant([1.0, 0.0])) as a1:
                with impl.Acc(x, tf.constant([0.0, 1.0])) as a2:
                    with impl.Acc(x, tf.constant([1.0, 1.0])) as a3:
                        y = tf.sin(x) * tf.exp(x)
                        raise fault("deep")
        except fault:
            pass
        return [a1.jvp(y), a2.jvp(y), a3.jvp(y)]

    check(body)


@pytest.mark.parametrize("fault", INTERRUPTS, ids=lambda e: e.__name__)
def test_fault_in_a_jvp_under_a_tape_and_two_accumulators(fault):
    """A custom gradient whose backward raises: the accumulators compute its
    JVP from the backward function, so the fault rises out of the forward
    op, with a tape and two accumulators recording."""
    def body(impl):
        @tf.custom_gradient
        def f(u):
            def grad(dy):
                raise fault("in the JVP")
            return tf.identity(u * 2.0), grad

        x = tf.constant([0.7, -0.2])
        with impl.Tape() as t:
            t.watch(x)
            with impl.Acc(x, tf.ones_like(x)) as a1:
                with impl.Acc(x, tf.constant([2.0, 3.0])) as a2:
                    y = tf.sin(x)
                    try:
                        f(y)
                    except fault:
                        pass
                    z = y * y
        return [a1.jvp(z), a2.jvp(z), t.gradient(z, x)]

    check(body)


# -- transient faults in a backward function -------------------------------------------

@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
def test_transient_fault_in_a_custom_gradient(persistent):
    """The backward function raises on its first call only. A persistent
    tape's retry succeeds (as TF's); a non-persistent tape refuses the retry
    (as TF's: RuntimeError)."""
    calls = []

    def body(impl):
        @tf.custom_gradient
        def f(u):
            def grad(dy):
                calls.append(1)
                if len(calls) % 2 == 1:
                    raise Boom("transient")
                return dy * tf.cos(u)
            return tf.sin(u), grad

        x = tf.Variable([0.1, 0.9, -2.0])
        with impl.Tape(persistent=persistent) as t:
            y = tf.reduce_sum(f(x * x))
        try:
            t.gradient(y, x)
        except Boom:
            pass
        return t.gradient(y, x)

    out = check(body, expect=None if persistent else RuntimeError)
    if persistent:   # and the value is the derivative: 2x cos(x^2)
        x = np.array([0.1, 0.9, -2.0], np.float32)
        np.testing.assert_allclose(out["fasttape"][1], 2 * x * np.cos(x * x),
                                   rtol=1e-6)


# -- kernel errors -----------------------------------------------------------------------

def test_kernel_error_in_the_forward_pass_under_tapes_and_accumulator():
    def body(impl):
        x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        with impl.Tape() as t:
            t.watch(x)
            with impl.Acc(x, tf.ones_like(x)):
                with impl.Tape(persistent=True) as t2:
                    t2.watch(x)
                    y = tf.sin(x)
                    tf.matmul(y, tf.ones([3, 3]))   # InvalidArgumentError
        return t.gradient(y, x)

    check(body, expect=errors.InvalidArgumentError)


@pytest.mark.parametrize("where", ["custom_gradient", "registered"])
def test_kernel_error_in_the_backward_pass(where):
    """A kernel fails in the backward pass: a custom gradient's
    check_numerics sees a NaN, or a registered gradient (Reshape's) meets
    an upstream gradient of the wrong size. A persistent tape then still
    gives the gradient of an unaffected target."""
    def body(impl):
        @tf.custom_gradient
        def guarded(u):
            def grad(dy):
                return tf.debugging.check_numerics(dy * np.nan, "backward")
            return tf.identity(u), grad

        x = tf.constant([0.5, 1.5, 2.5, 3.5])
        with impl.Tape(persistent=True) as t:
            t.watch(x)
            if where == "custom_gradient":
                y = tf.reduce_sum(guarded(tf.exp(x)))
                seed = None
            else:
                y = tf.reshape(tf.exp(x), [2, 2])
                seed = tf.ones([3])
            z = tf.reduce_sum(tf.sin(x))
        try:
            t.gradient(y, x, output_gradients=seed)
            raise AssertionError("no kernel error")
        except errors.InvalidArgumentError:
            pass
        return t.gradient(z, x)

    check(body)


# -- re-entrancy ----------------------------------------------------------------------

@pytest.mark.parametrize("which", ["fresh_tape", "same_tape"])
def test_gradient_called_inside_a_backward_function(which):
    """A backward function that itself calls gradient(): on a tape of its
    own, or (re-entrantly) on the persistent tape whose gradient is running."""
    def body(impl):
        x = tf.constant([0.3, 1.1, -0.8])
        holder = {}

        @tf.custom_gradient
        def f(u):
            def grad(dy):
                if which == "fresh_tape":
                    with impl.Tape() as inner:
                        inner.watch(u)
                        s = tf.reduce_sum(tf.sin(u) * u)
                    return dy * inner.gradient(s, u)
                return dy * holder["tape"].gradient(holder["side"], x)
            return tf.identity(u * 1.0), grad

        with impl.Tape(persistent=True) as t:
            t.watch(x)
            holder["tape"] = t
            holder["side"] = tf.reduce_sum(tf.exp(x))
            y = tf.reduce_sum(f(x) * x)
        out = [t.gradient(y, x), t.gradient(y, x)]
        holder.clear()
        return out

    check(body)


# -- allocation failure --------------------------------------------------------------------

_HUGE = [1 << 40]   # 4 TiB of float32: TF's allocator refuses it (after ~10 s)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_allocation_failure_under_tapes(where):
    """ResourceExhaustedError from a huge allocation in the forward pass
    (a recorded op: its input is watched) or in a backward function, with a
    tape and an accumulator recording; then an ordinary step."""
    def body(impl, shape=_HUGE):
        @tf.custom_gradient
        def f(u):
            def grad(dy):
                return dy + tf.reduce_sum(tf.zeros(shape))
            return tf.identity(u), grad

        x = tf.constant(2.0)
        with impl.Tape() as t:
            t.watch(x)
            with impl.Acc(x, tf.constant(1.0)) as acc:
                y = x * x
                if where == "forward":
                    tf.broadcast_to(y, shape)
            z = f(y) if where == "backward" else y   # (an accumulator would
        if where == "backward":                      # run grad right here)
            try:
                t.gradient(z, x)
            except errors.ResourceExhaustedError:
                return "raised in backward", acc.jvp(y)
        return t.gradient(z, x), acc.jvp(y)

    # The warm-up runs the same steps with a small allocation.
    outcomes = check(body, warm_up=lambda impl: body(impl, [4]),
                     expect=errors.ResourceExhaustedError
                     if where == "forward" else None)
    if where == "backward":
        assert outcomes["tf"][1][0] == "raised in backward"


# -- patch() around faults -------------------------------------------------------------

@pytest.mark.parametrize("fault", INTERRUPTS, ids=lambda e: e.__name__)
def test_fault_inside_patched_code(fault):
    """Unmodified TF code (tf.GradientTape, tf.autodiff.ForwardAccumulator)
    run under the patch for fasttape, as it is for TF: a fault inside a tape
    inside the patched block leaves TF as it was found."""
    def body(impl):
        x = tf.constant([0.2, 0.4])
        assert (tf.GradientTape is fasttape.GradientTape) == (impl.name == "fasttape")
        try:
            with tf.GradientTape() as t:
                t.watch(x)
                with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)) as acc:
                    y = tf.sin(x) * x
                    raise fault("inside the patch")
        except fault:
            pass
        assert type(t) is impl.Tape and type(acc) is impl.Acc
        seen[impl.name] = (t.gradient(y, x).numpy(), acc.jvp(y).numpy())
        raise fault("out of the patched block")

    seen = {}
    check(body, expect=fault)
    for a, b in zip(seen["tf"], seen["fasttape"]):
        np.testing.assert_allclose(b, a, rtol=1e-6)


def test_patch_interrupted_midway_leaves_tf_as_found(monkeypatch):
    """A KeyboardInterrupt while patch() swaps (a module that raises it when
    written) stops the patched block before it runs; TF is as found."""
    import types   # pylint: disable=import-outside-toplevel

    class Interrupting(types.ModuleType):
        def __setattr__(self, key, value):
            raise KeyboardInterrupt

    module = Interrupting("fasttape_test_faults_interrupting")
    object.__setattr__(module, "GradientTape", _CLASSES["tf"][0])
    monkeypatch.setitem(sys.modules, module.__name__, module)
    ran = []

    def body(impl):
        ran.append(impl.name)
        x = tf.constant(1.0)
        with tf.GradientTape() as t:
            t.watch(x)
            y = x * x
        return t.gradient(y, x)

    tf_out = _outcome(body, Impl("tf"))
    ft_out = _outcome(body, Impl("fasttape"))
    assert tf_out[0] == "ok" and ft_out == ("raised", KeyboardInterrupt)
    assert ran == ["tf"]
    assert_clean()
    assert_fresh_gradients_exact(Impl("fasttape"))


# -- an interrupt at any line of gradient() ------------------------------------------

_TRACED = {   # the Python files each implementation's gradient() runs through
    "tf": ("/tensorflow/python/eager/", "/tensorflow/python/ops/math_grad.py",
           "/tensorflow/python/ops/array_grad.py"),
    "fasttape": ("/fasttape/", "/tensorflow/python/eager/",
                 "/tensorflow/python/ops/math_grad.py",
                 "/tensorflow/python/ops/array_grad.py"),
}


# TF itself dies (SIGSEGV) when an exception leaves Context._handle while
# the C++ EagerTensor constructor reads it (tf.constant, no tape needed): an
# interrupt there is left out, for both implementations.
_CRASHES_TF = {context.Context._handle.fget.__code__}   # pylint: disable=protected-access


class _InterruptAt:
    """A tracer raising KeyboardInterrupt at the n-th line event in the
    given files (n = None: counts them), as a signal may between any two
    lines."""

    def __init__(self, files, n=None):
        self.files, self.n, self.events = files, n, 0

    def __call__(self, frame, event, arg):
        if frame.f_code not in _CRASHES_TF and any(
                f in frame.f_code.co_filename for f in self.files):
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "line":
            self.events += 1
            if self.events == self.n:
                raise KeyboardInterrupt
        return self._local


def _traced(tracer, fn):
    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("name, compiled", [
    ("tf", None), ("fasttape", "off"), ("fasttape", "auto")],
    ids=["tf", "fasttape-eager", "fasttape-auto"])
def test_an_interrupt_at_any_line_of_gradient(name, compiled):
    """A KeyboardInterrupt at every other line of a persistent tape's
    gradient() (fasttape's Python layers, eager or with the compiled-pass
    cache building and replaying, and TF's gradient functions): the stacks
    are clean after each, and the retry gives the uninterrupted gradient,
    bit for bit."""
    impl = Impl(name)
    if compiled is not None:
        from fasttape.gradients import _compiled   # pylint: disable=import-outside-toplevel
        _compiled.CACHE.clear()
        previous = _compiled.set_mode(compiled)
    try:
        _interrupt_every_line(name, impl)
    finally:
        if compiled is not None:
            _compiled.set_mode(previous)
            _compiled.CACHE.clear()


def _interrupt_every_line(name, impl):

    def grads(t, x, v, y):
        return [g.numpy() for g in t.gradient(y, [x, v])]

    def run():
        x = tf.constant([0.5, 1.0])
        v = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
        with impl.Tape(persistent=True) as t:
            t.watch(x)
            y = tf.reduce_sum(tf.tanh(x[None, :] @ v) * tf.exp(x)) + tf.reduce_sum(v * v)
        expected = grads(t, x, v, y)
        counter = _InterruptAt(_TRACED[name])
        _traced(counter, lambda: grads(t, x, v, y))
        interrupted = 0
        for n in range(1, counter.events + 1, 2):
            try:
                _traced(_InterruptAt(_TRACED[name], n), lambda: grads(t, x, v, y))
            except KeyboardInterrupt:
                interrupted += 1
            assert_clean()
            for g, e in zip(grads(t, x, v, y), expected):
                np.testing.assert_array_equal(g, e)
        return counter.events, interrupted

    run()   # warm-up (kernels, caches)
    before = _tensor_ids()
    events, interrupted = run()
    left = _new_tensors(before)
    assert interrupted > 50, (events, interrupted)
    if name == "fasttape":   # (TF's leaves about two per interrupted call)
        assert not left, [f"{t.dtype.name}{list(t.shape)}" for t in left[:10]]
    assert_fresh_gradients_exact(impl)


def _assert_only_recording(impl, tape):
    """``tape`` is the one tape recording on this thread, nothing paused."""
    assert not pywrap_tfe.TFE_Py_TapeSetIsStopped()
    st = _callback.current()
    assert not st.in_callback and not st.capturing and not st.accumulators
    assert st.nesting_limit == st.nesting_floor == _callback.NO_LIMIT
    if impl.name == "fasttape":
        assert st.tapes == [tape._tape]   # pylint: disable=protected-access
        assert pywrap_tfe.TFE_Py_TapeSetIsEmpty()
    else:
        assert st.tapes == [] and not pywrap_tfe.TFE_Py_TapeSetIsEmpty()


@pytest.mark.parametrize("name", IMPLS)
def test_an_interrupt_at_any_line_of_a_recorded_gradient(name):
    """gradient() of a persistent tape inside an outer tape (a second-order
    step), interrupted at every other line: the outer tape stays the one
    recording, and the step then gives the uninterrupted gradients, bit for
    bit."""
    impl = Impl(name)

    def step(points, counter=None):
        x = tf.constant([0.5, 1.0])
        interrupted = 0
        with impl.Tape() as outer:
            outer.watch(x)
            with impl.Tape(persistent=True) as t:
                t.watch(x)
                y = tf.reduce_sum(tf.tanh(x * x) * tf.exp(x))
            if counter is not None:
                _traced(counter, lambda: t.gradient(y, x))
            for n in points:
                try:
                    _traced(_InterruptAt(_TRACED[name], n), lambda: t.gradient(y, x))
                except KeyboardInterrupt:
                    interrupted += 1
                _assert_only_recording(impl, outer)
            g = t.gradient(y, x)
        return g.numpy(), outer.gradient(g, x).numpy(), interrupted

    first, second, _ = step([])
    counter = _InterruptAt(_TRACED[name])
    step([], counter)
    before = _tensor_ids()
    g, gg, interrupted = step(range(1, counter.events + 1, 2))
    left = _new_tensors(before)
    assert interrupted > 50, (counter.events, interrupted)
    np.testing.assert_array_equal(g, first)
    np.testing.assert_array_equal(gg, second)
    assert_clean()
    if name == "fasttape":
        assert not left, [f"{t.dtype.name}{list(t.shape)}" for t in left[:10]]
    assert_fresh_gradients_exact(impl)
