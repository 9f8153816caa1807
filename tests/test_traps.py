"""Reliability tests: each interception wrapper of fasttape._recording matters.

For every trap listed in DESIGN.md ("TensorFlow integration") there is a
test that passes with fasttape's hooks in place and a companion
(``*_needs_*``) that switches off exactly that hook and shows the result
turning wrong (None, a wrong value, or an error). A companion that stopped
failing would mean its positive test no longer proves anything.

Hooks are switched off with a MonkeyPatch that is undone after each test,
and ``_recording.install()`` is called afterwards, so no test leaks a
missing hook into the next.
"""

import contextlib
import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python import pywrap_tfe  # noqa: E402
from tensorflow.python.eager import execute  # noqa: E402
from tensorflow.python.eager import record  # noqa: E402
from tensorflow.python.eager import tape as tf_tape  # noqa: E402
from tensorflow.python.framework import op_callbacks  # noqa: E402
from tensorflow.python.framework import ops  # noqa: E402

import fasttape  # noqa: E402
from fasttape.recording import _recording  # noqa: E402
import fasttape.tape as ft_tape  # noqa: E402

GradientTape = fasttape.GradientTape

HOOK_NAMES = [name for _, name, _ in _recording._HOOKS]  # pylint: disable=protected-access


# -- fixtures --------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _hooks_restored():
    """Every test starts and ends with all hooks in, no tape recording, and
    the fast-path wrapper enabled and not installed."""
    _recording.install()
    assert not _recording.recording_tapes()
    yield
    _recording.fast_path_wrapper_enabled = True
    _recording.install()
    assert set(HOOK_NAMES) <= set(_recording.installed_hooks())
    assert not _recording.recording_tapes(), "a test leaked a recording tape"


@pytest.fixture
def disable():
    """disable(name) puts TF's original back for one hook of _HOOKS."""
    mp = pytest.MonkeyPatch()
    hooks = {name: (module, wrapper)
             for module, name, wrapper in _recording._HOOKS}  # pylint: disable=protected-access

    def off(name):
        module, wrapper = hooks[name]
        assert getattr(module, name) is wrapper, f"{name} was not hooked"
        mp.setattr(module, name, _recording._originals[name])  # pylint: disable=protected-access

    yield off
    mp.undo()
    _recording.install()


@pytest.fixture
def no_fast_path_wrapper(monkeypatch):
    assert not _recording.recording_tapes()
    assert "TFE_Py_FastPathExecute" not in _recording.installed_hooks()
    monkeypatch.setattr(_recording, "fast_path_wrapper_enabled", False)


def close(a, b):
    assert a is not None, "gradient is None"
    np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(), b, rtol=1e-6)


def tf_reference(fn):
    """fn(tf.GradientTape): the same body under TF's own tape."""
    return fn(tf.GradientTape)


# -- 1. a Variable passed straight into a fast-path op ------------------------------

def _fast_path_body(Tape):
    v = tf.Variable([1.0, 2.0])
    w = tf.Variable([0.5, -1.0])
    x = tf.constant([[3.0, 4.0]])
    with Tape() as t:
        y = tf.reduce_sum(x * v)                          # Tensor.__mul__
        z = tf.reduce_sum(tf.nn.bias_add(x, w) * 2.0)     # bias_add(x, Variable)
    return t.gradient([y, z], [v, w]), list(t.watched_variables())


def _fast_path_each(Tape):
    v = tf.Variable([1.0, 2.0])
    x = tf.constant([[3.0, 4.0]])
    with Tape(persistent=True) as t:
        a = x * v
        b = tf.nn.bias_add(x, v)
        c = tf.multiply(x, v)
    return [t.gradient(y, v) for y in (a, b, c)]


def test_variable_in_fast_path_op():
    (gv, gw), watched = _fast_path_body(GradientTape)
    (tv, tw), _ = tf_reference(_fast_path_body)
    close(gv, tv.numpy())
    close(gw, tw.numpy())
    close(gv, [3.0, 4.0])
    close(gw, [2.0, 2.0])
    assert len(watched) == 2
    ga, gb, gc = _fast_path_each(GradientTape)
    close(ga, [3.0, 4.0])
    close(gb, [1.0, 1.0])
    close(gc, [3.0, 4.0])


def test_variable_in_fast_path_op_needs_fast_path_wrapper(no_fast_path_wrapper):
    del no_fast_path_wrapper
    ga, gb, gc = _fast_path_each(GradientTape)
    # Without the wrapper the Variable is read inside C++: nothing records it.
    assert ga is None and gb is None and gc is None
    (gv, gw), watched = _fast_path_body(GradientTape)
    assert gv is None and gw is None and watched == []


def test_fast_path_wrapper_only_installed_while_recording():
    assert "TFE_Py_FastPathExecute" not in _recording.installed_hooks()
    with GradientTape():
        assert "TFE_Py_FastPathExecute" in _recording.installed_hooks()
        with GradientTape():
            pass
        assert "TFE_Py_FastPathExecute" in _recording.installed_hooks()
    assert "TFE_Py_FastPathExecute" not in _recording.installed_hooks()



def test_uninstall_takes_out_every_hook_it_lists():
    """One install()/uninstall(): every TF hook fasttape puts in, including
    explain_none's .numpy() conversion hook and the AutoGraph rule, is
    listed by installed_hooks() and gone after uninstall()."""
    original_numpy = ops._EagerTensorBase._numpy  # pylint: disable=protected-access
    previous = fasttape.explain_none(True)
    try:
        tape = GradientTape()
        with tape:
            listed = set(_recording.installed_hooks())
            assert {"_numpy", "CONVERSION_RULES", "TFE_Py_FastPathExecute",
                    "execute"} | set(HOOK_NAMES) <= listed
            _recording.uninstall()
            assert _recording.installed_hooks() == []
            assert ops._EagerTensorBase._numpy is original_numpy  # pylint: disable=protected-access
            _recording.install()
    finally:
        fasttape.explain_none(previous)
    assert "_numpy" not in _recording.installed_hooks()

# -- 2. trainable variable reads: variable_accessed / variables_accessed --------------

def _read_body(Tape):
    v = tf.Variable([1.0, 2.0])
    with Tape() as t:
        y = tf.reduce_sum(v * 3.0)        # Variable.__mul__ -> value()
    return t.gradient(y, v), list(t.watched_variables())


def test_variable_read_is_watched():
    g, watched = _read_body(GradientTape)
    close(g, [3.0, 3.0])
    assert len(watched) == 1


def test_variable_read_needs_variable_accessed_hook(disable):
    disable("variable_accessed")
    g, watched = _read_body(GradientTape)
    assert g is None and watched == []


def _variables_accessed_body():
    v = tf.Variable(2.0)
    frozen = tf.Variable(3.0, trainable=False)
    with GradientTape() as t:
        tf_tape.variables_accessed([v, frozen])
    return [x is v for x in t.watched_variables()]


def test_variables_accessed_watches_trainable_only():
    # TF 2.21 itself never calls tape.variables_accessed; libraries may.
    assert _variables_accessed_body() == [True]


def test_variables_accessed_needs_hook(disable):
    disable("variables_accessed")
    assert _variables_accessed_body() == []


# -- 3. tf.custom_gradient / recompute_grad / copies: record_operation -----------------

@tf.custom_gradient
def _times_one_grad_ten(x):
    def grad(dy):
        return dy * 10.0
    return x * 1.0, grad


def _custom_body(Tape):
    x = tf.constant([1.0, 2.0])
    with Tape() as t:
        t.watch(x)
        y = _times_one_grad_ten(x)
    return t.gradient(y, x)


def test_custom_gradient():
    close(_custom_body(GradientTape), [10.0, 10.0])
    close(tf_reference(_custom_body), [10.0, 10.0])


def test_custom_gradient_needs_record_operation_hook(disable):
    disable("record_operation")
    g = _custom_body(GradientTape)
    # The custom backward is never recorded: the plain derivative (or None)
    # comes back instead of the custom one.
    assert g is None or not np.allclose(g.numpy(), [10.0, 10.0])


def _custom_with_variables_body(Tape):
    v = tf.Variable(2.0)

    @tf.custom_gradient
    def scaled(x):
        def grad(dy, variables=None):
            return dy * 100.0, [tf.reduce_sum(dy) * 1000.0 for _ in variables]
        return x * v, grad

    x = tf.constant([1.0, 2.0])
    with Tape() as t:
        t.watch(x)
        y = tf.reduce_sum(scaled(x))
    return t.gradient(y, [x, v])


def test_custom_gradient_with_variables():
    gx, gv = _custom_with_variables_body(GradientTape)
    close(gx, [100.0, 100.0])
    close(gv, 2000.0)


def test_custom_gradient_with_variables_needs_record_operation_hook(disable):
    disable("record_operation")
    gx, gv = _custom_with_variables_body(GradientTape)
    assert gv is None or not np.allclose(gv.numpy(), 2000.0)
    assert gx is None or not np.allclose(gx.numpy(), [100.0, 100.0])


def _recompute_body(Tape):
    x = tf.constant([1.0, 3.0])
    block = tf.recompute_grad(lambda a: a * a)
    with Tape() as t:
        t.watch(x)
        y = block(x)
    return t.gradient(y, x)


def test_recompute_grad():
    close(_recompute_body(GradientTape), [2.0, 6.0])


def test_recompute_grad_needs_record_operation_hook(disable):
    disable("record_operation")
    assert _recompute_body(GradientTape) is None


def _copy_body(Tape):
    x = tf.constant([1.0, 3.0])
    with Tape() as t:
        t.watch(x)
        y = x._copy() * 2.0  # pylint: disable=protected-access
    return t.gradient(y, x)


def test_tensor_copy():
    close(_copy_body(GradientTape), [2.0, 2.0])


def test_tensor_copy_needs_record_operation_hook(disable):
    disable("record_operation")
    assert _copy_body(GradientTape) is None


# -- 4. a tf.function call inside the tape ------------------------------------------------

def _function_body(Tape, f=None):
    if f is None:
        @tf.function
        def f(a):
            return tf.sin(a) * a
    x = tf.constant([0.5, 1.5])
    with Tape() as t:
        t.watch(x)
        y = f(x)
    return t.gradient(y, x)


def _expected_function_grad():
    x = np.array([0.5, 1.5])
    return np.cos(x) * x + np.sin(x)


@pytest.mark.parametrize("persistent", [False, True])
def test_function_call(persistent):
    @tf.function
    def f(a):
        return tf.sin(a) * a

    x = tf.constant([0.5, 1.5])
    with GradientTape(persistent=persistent) as t:
        t.watch(x)
        y = f(x)
    close(t.gradient(y, x), _expected_function_grad())


def test_function_call_needs_possible_tape_gradient_types_hook(disable):
    disable("PossibleTapeGradientTypes")
    # TF believes no tape watches the inputs and runs the function unrecorded.
    assert _function_body(GradientTape) is None


def test_function_call_needs_record_operation_hook(disable):
    disable("record_operation")
    assert _function_body(GradientTape) is None


def test_function_second_order_through_persistent_tape():
    @tf.function
    def f(a):
        return a * a * a

    x = tf.constant(2.0)
    with GradientTape(persistent=True) as t:
        t.watch(x)
        y = f(x)
        g = t.gradient(y, x)
    close(g, 12.0)
    close(t.gradient(g, x), 12.0)


def _captured_variable_body(Tape, f, v):
    x = tf.constant([1.0, 2.0])
    with Tape() as t:
        y = f(x)
    return t.gradient(y, v), list(t.watched_variables())


def _traced_function_with_captured_variable():
    v = tf.Variable(3.0)

    @tf.function
    def f(a):
        return tf.reduce_sum(a * v)

    f(tf.constant([0.0, 0.0]))  # traced outside any tape
    return f, v


def test_function_captured_variable():
    f, v = _traced_function_with_captured_variable()
    g, watched = _captured_variable_body(GradientTape, f, v)
    close(g, 3.0)
    assert [w is v for w in watched] == [True]


def test_function_captured_variable_needs_could_possibly_record_hook(disable):
    f, v = _traced_function_with_captured_variable()
    disable("could_possibly_record")
    # TF only reports the function's captured variables as accessed when
    # could_possibly_record() says some tape is active.
    g, watched = _captured_variable_body(GradientTape, f, v)
    assert g is None and watched == []


def _tape_in_function_body(Tape):
    v = tf.Variable(2.0)

    @tf.function
    def f(x):
        with Tape() as t:
            t.watch(x)
            y = tf.cond(x > 0.0, lambda: x * v, lambda: x)
        return t.gradient(y, [x, v])

    return f(tf.constant(3.0))


def test_tape_inside_function_reads_variable():
    gx, gv = _tape_in_function_body(GradientTape)
    close(gx, 2.0)
    close(gv, 3.0)


@pytest.mark.parametrize("hook", ["record_operation", "variable_accessed"])
def test_tape_inside_function_variable_needs_hook(disable, hook):
    # In a graph the variable read is recorded through record_operation
    # ("ReadVariableOp") and the variable is watched through variable_accessed.
    disable(hook)
    gx, gv = _tape_in_function_body(GradientTape)
    close(gx, 2.0)
    assert gv is None


def _py_function_body(Tape):
    x = tf.constant([1.0, 2.0])
    with Tape() as t:
        t.watch(x)
        y = tf.py_function(lambda a: a * a, [x], tf.float32)
    return t.gradient(y, x)


def test_py_function():
    close(_py_function_body(GradientTape), [2.0, 4.0])


def test_py_function_needs_could_possibly_record_hook(disable):
    disable("could_possibly_record")
    # py_function keeps its inner tape only when could_possibly_record().
    try:
        g = _py_function_body(GradientTape)
    except Exception:  # noqa: BLE001 - TF fails looking up the missing tape
        return
    assert g is None or not np.allclose(g.numpy(), [2.0, 4.0])


def test_should_record_backprop_sees_fasttape():
    x = tf.constant(1.0)
    y = tf.constant(2.0)
    with GradientTape() as t:
        t.watch(x)
        assert record.should_record_backprop([x])
        assert not record.should_record_backprop([y])
    assert not record.should_record_backprop([x])


def test_should_record_backprop_needs_hook(disable):
    # Used by tf.function calls for forward accumulators' tangents.
    disable("should_record_backprop")
    x = tf.constant(1.0)
    with GradientTape() as t:
        t.watch(x)
        assert not record.should_record_backprop([x])


def test_could_possibly_record_sees_fasttape():
    assert not record.could_possibly_record()
    with GradientTape():
        assert record.could_possibly_record()
    assert not record.could_possibly_record()


def test_could_possibly_record_needs_hook(disable):
    disable("could_possibly_record")
    with GradientTape():
        assert not record.could_possibly_record()


def _function_under_a_tf_and_a_fasttape_accumulator():
    f = tf.function(lambda a: tf.sin(a) * a)
    x = tf.constant([0.5, 1.0])
    with fasttape.ForwardAccumulator(x, tf.constant([1.0, 2.0])) as outer:
        with tf.autodiff.ForwardAccumulator(x, tf.constant([3.0, 4.0])) as inner:
            y = f(x)
    return outer.jvp(y), inner.jvp(y)


def test_function_call_under_a_tf_accumulator_builds_without_fasttape():
    jvps = _function_under_a_tf_and_a_fasttape_accumulator()
    x = np.array([0.5, 1.0], np.float32)
    dydx = np.sin(x) + x * np.cos(x)
    close(jvps[0], dydx * [1.0, 2.0])
    close(jvps[1], dydx * [3.0, 4.0])


def test_function_call_under_a_tf_accumulator_needs_build_hook(disable):
    # TF's forward function with JVPs for its own accumulators captured the
    # fasttape accumulator's tangents as extra inputs.
    disable("_build_functions_for_outputs")
    with pytest.raises(TypeError):
        _function_under_a_tf_and_a_fasttape_accumulator()


# -- 5. stop_recording ---------------------------------------------------------------

def _tf_stop_recording_body(Tape, restart_inside=False):
    x = tf.constant(3.0)
    with Tape(persistent=True) as t:
        t.watch(x)
        with record.stop_recording():
            if restart_inside:
                # What fasttape would do if it ignored TF's "stopped" flag.
                pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
            y = x * x
            if restart_inside:
                pywrap_tfe.TFE_Py_TapeSetStopOnThread()
        with tf.init_scope():
            z = x * 4.0
        w = x * 5.0
    return t.gradient(y, x), t.gradient(z, x), t.gradient(w, x)


def test_tf_stop_recording():
    gy, gz, gw = _tf_stop_recording_body(GradientTape)
    assert gy is None and gz is None
    close(gw, 5.0)
    assert tf_reference(_tf_stop_recording_body)[:2] == (None, None)


def test_tf_stop_recording_needs_stopped_check():
    gy, _, gw = _tf_stop_recording_body(GradientTape, restart_inside=True)
    close(gy, 6.0)  # recorded: the stopped flag is the only thing that hid it
    close(gw, 5.0)


def _fasttape_stop_recording_body():
    x = tf.constant(3.0)
    v = tf.Variable(2.0)
    with GradientTape(persistent=True) as t:
        t.watch(x)
        with t.stop_recording():
            y = x * x
            u = v * 2.0
        w = x * 5.0
    return t.gradient(y, x), t.gradient(u, v), t.gradient(w, x)


def test_fasttape_stop_recording():
    gy, gu, gw = _fasttape_stop_recording_body()
    assert gy is None and gu is None
    close(gw, 5.0)


def test_fasttape_stop_recording_needs_pop(monkeypatch):
    monkeypatch.setattr(ft_tape.GradientTape, "stop_recording",
                        lambda self: contextlib.nullcontext())
    gy, gu, _ = _fasttape_stop_recording_body()
    close(gy, 6.0)
    close(gu, 2.0)


def _stop_gradient_body(Tape):
    x = tf.constant([1.0, 2.0])
    with Tape() as t:
        t.watch(x)
        y = tf.reduce_sum(tf.stop_gradient(x * x) * x)
    return t.gradient(y, x)


def test_tf_stop_gradient():
    close(_stop_gradient_body(GradientTape), [1.0, 4.0])
    close(tf_reference(_stop_gradient_body), [1.0, 4.0])


@pytest.fixture
def stop_gradient_differentiable(monkeypatch):
    """Register an identity gradient for StopGradient (for this test only)."""
    registry = ops._gradient_registry._registry  # pylint: disable=protected-access
    entry = dict(registry["StopGradient"])
    entry["type"] = lambda op, grad: grad
    monkeypatch.setitem(registry, "StopGradient", entry)


def test_tf_stop_gradient_relies_on_stop_recording(stop_gradient_differentiable):
    # tf.stop_gradient runs its op inside record.stop_recording(): a tape
    # that honours TF's "stopped" flag never records it, whatever its
    # gradient is. TF's tape and fasttape both give the stopped result.
    del stop_gradient_differentiable
    close(_stop_gradient_body(GradientTape), [1.0, 4.0])
    close(tf_reference(_stop_gradient_body), [1.0, 4.0])


def test_tf_stop_gradient_needs_stopped_check(stop_gradient_differentiable,
                                              monkeypatch):
    # Hide the stop from fasttape (as if it ignored TF's stopped flag): the
    # op is recorded, and with a differentiable StopGradient the result is
    # wrong, so the test above can fail.
    del stop_gradient_differentiable
    monkeypatch.setattr(record, "stop_recording", contextlib.nullcontext)
    g = _stop_gradient_body(GradientTape)
    assert not np.allclose(g.numpy(), [1.0, 4.0])


# -- 6. threads -----------------------------------------------------------------------

N_THREADS = 4
ROUNDS = 3


def _thread_step(i, barrier, results):
    """Thread i: its own tape, variable and constant; the barriers make all
    tapes record at the same time."""
    try:
        v = tf.Variable(float(i + 1))
        x = tf.constant([float(i), 1.0])

        @tf.function
        def f(a):
            return a * a

        grads = []
        for _ in range(ROUNDS):
            with GradientTape() as t:
                t.watch(x)
                barrier.wait()
                y = tf.reduce_sum(x * v + tf.sin(x) * x) + f(v)
                barrier.wait()
            gx, gv = t.gradient(y, [x, v])
            grads.append((None if gx is None else gx.numpy(),
                          None if gv is None else gv.numpy(),
                          [w is v for w in t.watched_variables()]))
        results[i] = grads
    except Exception as exc:  # noqa: BLE001
        barrier.abort()
        results[i] = exc


def _expected_thread_grads(i):
    x = np.array([float(i), 1.0], np.float32)
    v = float(i + 1)
    return v + np.sin(x) + x * np.cos(x), x.sum() + 2.0 * v


def _run_threads():
    barrier = threading.Barrier(N_THREADS, timeout=60)
    results = [None] * N_THREADS
    threads = [threading.Thread(target=_thread_step, args=(i, barrier, results))
               for i in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    return results


def _thread_result_ok(i, result):
    if isinstance(result, Exception) or result is None:
        return False
    ex, ev = _expected_thread_grads(i)
    for gx, gv, watched in result:
        if gx is None or gv is None or watched != [True]:
            return False
        if not (np.allclose(gx, ex, rtol=1e-5) and np.allclose(gv, ev, rtol=1e-5)):
            return False
    return True


def test_threads_each_with_own_tape():
    results = _run_threads()
    for i, r in enumerate(results):
        assert not isinstance(r, Exception), r
        assert _thread_result_ok(i, r), (i, r)


def test_threads_need_thread_local_state(shared_state):
    # One recording state shared by all threads (as if it weren't
    # thread-local): every tape watches every thread's variables.
    results = _run_threads()
    assert not all(_thread_result_ok(i, r) for i, r in enumerate(results))
    # ... and for that reason, not because a thread raised: each tape saw
    # every thread's variable.
    assert all(isinstance(r, list) for r in results), results
    assert any(len(watched) == N_THREADS
               for r in results for *_, watched in r), results


def _cross_thread_body(Tape):
    """An op another thread runs on a tensor this thread's tape watches is
    not recorded on this thread's tape (TF's tape set is per thread)."""
    x = tf.constant([1.0, 2.0])
    out = {}
    with Tape() as t:
        t.watch(x)

        def other():
            with GradientTape():   # makes sure the thread has fasttape's callback
                pass
            out["y"] = x * x

        th = threading.Thread(target=other)
        th.start()
        th.join()
        z = x * 3.0
    return t.gradient([out["y"], z], x)


def test_ops_in_other_thread_not_recorded():
    close(_cross_thread_body(GradientTape), [3.0, 3.0])
    close(tf_reference(_cross_thread_body), [3.0, 3.0])


@pytest.fixture
def shared_state():
    """fasttape's per-thread recording state replaced by one ThreadState
    shared by all threads, for the test's duration."""
    from fasttape.recording import _callback
    shared = _callback.ThreadState()
    _callback.share_state(shared)
    try:
        yield shared
    finally:
        _callback.share_state(None)


def test_ops_in_other_thread_need_thread_local_state(shared_state):
    # The other thread's op leaks onto this thread's tape.
    close(_cross_thread_body(GradientTape), [3.0 + 2.0, 3.0 + 4.0])


# -- 7. the op callback switch (execute.execute) ---------------------------------------

class _Box:
    """Converted through a registered conversion function: ops taking it go
    through the fallback (non fast) path, i.e. through execute.execute."""

    def __init__(self, t):
        self.t = t


tf.register_tensor_conversion_function(
    _Box, lambda b, dtype=None, name=None, as_ref=False: b.t)


def _other_thread_adds_and_removes_op_callback():
    def cb(*args, **kwargs):
        return None

    def body():
        op_callbacks.add_op_callback(cb)
        op_callbacks.remove_op_callback(cb)

    th = threading.Thread(target=body)
    th.start()
    th.join()


def _fallback_body(Tape, interfere):
    x = tf.constant(3.0)
    with Tape(persistent=True) as t:
        t.watch(x)
        if interfere:
            _other_thread_adds_and_removes_op_callback()
        y = tf.multiply(_Box(x), 2.0)   # fallback path
        z = tf.multiply(x, 5.0)         # fast path
    return t.gradient(y, x), t.gradient(z, x)


@pytest.fixture
def execute_restored(monkeypatch):
    # Undo any switch of execute.execute a test provokes.
    monkeypatch.setattr(execute, "execute", execute.execute)


def test_fallback_path_op_recorded(execute_restored):
    del execute_restored
    gy, gz = _fallback_body(GradientTape, interfere=False)
    close(gy, 2.0)
    close(gz, 5.0)


def test_fallback_path_needs_execute_with_callbacks(execute_restored,
                                                   monkeypatch):
    del execute_restored
    # Without fasttape's re-arming wrapper of remove_op_callback ...
    monkeypatch.setattr(op_callbacks, "remove_op_callback",
                        fasttape.recording._recording._originals["remove_op_callback"])
    with GradientTape():
        pass  # make sure this thread's op callback is registered
    gy, gz = _fallback_body(GradientTape, interfere=True)
    assert execute.execute is execute.quick_execute
    assert gy is None  # fasttape no longer sees fallback-path ops
    close(gz, 5.0)
    # TF's own tape records below the callback machinery: unaffected.
    ty, tz = _fallback_body(tf.GradientTape, interfere=True)
    close(ty, 2.0)


def test_fallback_path_survives_other_thread_removing_callback(execute_restored):
    del execute_restored
    with GradientTape():
        pass
    gy, gz = _fallback_body(GradientTape, interfere=True)
    close(gy, 2.0)
    close(gz, 5.0)


# -- memory: untracked payloads must not leak ------------------------------------------

def test_dropped_tape_frees_saved_tensors_by_refcount():
    """Eager payloads are untracked by the garbage collector: a dropped
    tape must free what it saved by reference counting alone."""
    import gc
    import weakref
    x = tf.constant([1.0, 2.0])
    gc.disable()
    try:
        with GradientTape() as t:
            t.watch(x)
            y = tf.sin(x * 3.0)      # Sin saves its input x * 3.0
        inner = weakref.ref(t._tape)
        core = t._tape.core
        saved = [weakref.ref(p) for i in range(core.num_ops)
                 for p in core.op(i).payload.saved
                 if p is not None and p is not x]
        del t, y, core
        assert inner() is None
        assert saved and all(r() is None for r in saved)
    finally:
        gc.enable()


def test_tape_in_a_reference_cycle_is_collected():
    """A custom_gradient closure that refers back to the tape makes a
    cycle; its entry stays tracked, so the collector frees it."""
    import gc
    import weakref
    x = tf.constant([1.0, 2.0])
    t = GradientTape()

    def make_f(tape):
        @tf.custom_gradient
        def f(v):
            def grad(dy):
                assert tape is not None   # the closure holds the tape
                return dy
            return tf.identity(v), grad
        return f

    with t:
        t.watch(x)
        y = make_f(t)(x) * x
    state = weakref.ref(t._tape)
    # y stays alive: were it to die, the tape would forget its ops (trace
    # deletion), the custom_gradient entry with them, and the cycle would
    # be gone before the collector had to find it.
    del t
    assert state() is not None     # a cycle: reference counting cannot free it
    gc.collect()
    assert state() is None
    del y


def test_threads_sharing_a_callback_list_keep_recording():
    """MirroredStrategy's replica threads share their parent's op-callback
    list and run in lock step: a thread that finishes its tape must not take
    the callback away from another thread still recording."""
    from tensorflow.python.eager import context
    x = tf.constant([1.0, 2.0])
    with GradientTape() as t:
        t.watch(x)
        shared = context.context().op_callbacks
        y = x * x

        def replica():
            context.context()._thread_local_data.op_callbacks = shared
            with GradientTape() as t2:
                t2.watch(x)
                z = x * 3.0
            close(t2.gradient(z, x), [3.0, 3.0])

        th = threading.Thread(target=replica)
        th.start()
        th.join()
        y = y * x          # recorded only if the callback is still there
    close(t.gradient(y, x), [3.0, 12.0])
