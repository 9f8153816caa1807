"""Interception: what fasttape records, and every monkeypatch of TF.

All of fasttape's changes to TensorFlow live in this module:
  - while any fasttape tape or accumulator records (on any thread), a
    wrapper of ``pywrap_tfe.TFE_Py_FastPathExecute`` that records each eager
    op itself (_callback.fast_path_execute) and reads Variable arguments in
    Python first (a Variable passed straight into a fast-path op is read
    inside C++, where no hook sees it, and its gradient would silently be
    None), and a wrapper of ``execute.execute`` (the fallback path) that
    records what it runs. No op callback is registered: while one is, TF's
    C++ fast path builds Python objects for every op's attrs and inputs and
    calls it, about as costly as a whole record;
  - wrappers of ``record.record_operation*``, ``record.could_possibly_record``,
    ``record.should_record_backprop``, ``gradients_util.
    PossibleTapeGradientTypes``, ``tape.variable(s)_accessed``,
    ``op_def_library._apply_op_helper`` (graph ops built while tracing, where
    TF calls its op callbacks) and pfor's ``_create_op`` (it builds ops no
    callback sees) — each calls TF's original first, so TF's own tapes keep
    working beside fasttape's;
  - a wrapper of the JVP function TF's own ForwardAccumulator calls for
    every op it sees (``TFE_Py_RegisterJVPFunction``), and of
    ``TFE_Py_ForwardAccumulatorSetAdd``/``SetRemove`` to know when each TF
    accumulator was pushed: while one computes a JVP, only fasttape tapes
    and accumulators older than it see the ops it runs, as TF's tapes do
    (see _tf_jvp_dispatch);
  - a wrapper of ConcreteFunction's ``_build_functions_for_outputs`` that
    keeps fasttape's accumulators out of the forward function TF builds
    with JVPs for its own accumulators (a fasttape accumulator takes a
    function call's JVPs from record_operation_backprop_only's record);
  - wrappers of ``op_callbacks.add_op_callback``/``remove_op_callback``,
    which switch ``execute.execute`` for all threads: fasttape's wrapper is
    put back while anything records;
  - a wrapper of ``context.Context._clear_caches`` that also empties
    fasttape's caches (``clear_caches``), as TF's leak checkers expect;
  - a wrapper of ``pywrap_tfe.TFE_ContextClearCaches`` (``tf.random.set_seed``)
    that tells the compiled-backward cache its passes' kernels were dropped;
  - the drop-in swap of TF's classes (``swap_classes``/``restore_classes``).
``install()`` puts the hooks in, ``uninstall()`` takes every one out.

The active tapes are a thread-local stack: MirroredStrategy replica threads
run their own tapes, and the wrappers are shared by all threads.
"""

import contextlib
import functools
import weakref
import threading as _threading
import sys
import warnings

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python import pywrap_tfe
from tensorflow.python.autograph.core import config as autograph_config
from tensorflow.python.autograph.core import config_lib as autograph_config_lib
from tensorflow.python.eager import backprop
from tensorflow.python.eager import context
from tensorflow.python.eager import execute
from tensorflow.python.eager import forwardprop as tf_forwardprop
from tensorflow.python.eager import record
from tensorflow.python.eager import tape as tf_tape
from tensorflow.python.eager.polymorphic_function import concrete_function
from tensorflow.python.framework import op_callbacks
from tensorflow.python.framework import op_def_library
from tensorflow.python.framework import ops
from tensorflow.python.ops import gradients_util
from tensorflow.python.ops.parallel_for import pfor as pfor_lib

from fasttape.recording import _budget
from fasttape.recording import _callback
from fasttape.gradients import _compiled
from fasttape import _core
from fasttape.gradients import _fast_grads
from fasttape.gradients._tf_vspace import TFVSpace


def _anything_recording():
    """Would an op run now be recorded by some tape or accumulator?"""
    st = _current()
    return bool(st.tapes or st.accumulators) or not pywrap_tfe.TFE_Py_TapeSetIsEmpty()


VSPACE = TFVSpace(_anything_recording)

# Tapes and accumulators are numbered in the order they are pushed. While an accumulator
# computes a JVP, only older tapes and accumulators see the ops it runs (TF's
# rule: that is how nested accumulators and tapes give higher orders without
# a younger one recording its elder's bookkeeping).
_nesting_ids = _callback.nesting_ids

_is_stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped

_handle_or_self = backprop._handle_or_self  # pylint: disable=protected-access


def could_record():
    """Would a watch() take effect now? As TF's TFE_Py_TapeWatch: only while
    some tape (TF's or fasttape's) records on this thread, not stopped."""
    if _is_stopped():
        return False
    return bool(_current().tapes) or not pywrap_tfe.TFE_Py_TapeSetIsEmpty()


TapeState = _callback.TapeState


class AccumulatorState:
    """One fasttape forward accumulator as the recording machinery sees it."""

    __slots__ = ("core", "nesting_id", "refs", "__weakref__")

    def __init__(self, use_batch):
        self.core = _core.ForwardAccumulatorCore(VSPACE, use_batch)
        self.nesting_id = 0  # set at every push
        self.refs = {}  # tensor id -> weakref whose callback drops the tangent

    def track(self, outputs):
        """Drop each output's tangent when the output itself dies, as TF's
        accumulator does, so a long forward pass does not pile tangents up."""
        core, refs = self.core, self.refs
        for t in outputs:
            tid = t._id  # pylint: disable=protected-access
            if tid not in refs and core.fetch_jvp(tid) is not None:
                refs[tid] = weakref.ref(
                    t, functools.partial(_forget_tangent, weakref.ref(self), tid))


def _forget_tangent(acc_ref, tid, _):
    acc = acc_ref()
    if acc is not None:
        acc.core.delete_gradient(tid)
        acc.refs.pop(tid, None)


_current = _callback.current     # this thread's ThreadState
is_trainable = _callback.is_trainable
_live_lock = _threading.Lock()
_live_tapes = 0                    # recording tapes over all threads


@contextlib.contextmanager
def gradient_functions_of(overrides):
    """TF's gradient functions of single graph ops replaced while the block
    runs ({tf.Operation: fn}, as TF's custom_gradient sets
    ``op._gradient_function`` inside a function), restored after it; TF's
    gradients_util reads them when it differentiates those ops."""
    saved = {op: op._gradient_function for op in overrides}  # pylint: disable=protected-access
    try:
        for op, fn in overrides.items():
            op._gradient_function = fn  # pylint: disable=protected-access
        yield
    finally:
        for op, fn in saved.items():
            op._gradient_function = fn  # pylint: disable=protected-access


def recording_tapes():
    return _current().tapes


# -- the tape stack -------------------------------------------------------------

def _push(stack, item):
    if not _installed:
        install()
    # As TF: a fresh nesting id at every push (entering, or resuming after
    # stop_recording), so "older" means "pushed earlier".
    item.nesting_id = next(_nesting_ids)
    global _live_tapes
    with _live_lock:
        _live_tapes += 1
        if _live_tapes == 1:
            _install_fast_path_wrapper()
            _arm_execute()
    stack.append(item)


def _pop(stack, item, error):
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is item:
            del stack[i]
            break
    else:
        raise ValueError(error)
    global _live_tapes
    with _live_lock:
        _live_tapes -= 1
        if _live_tapes == 0:
            _uninstall_fast_path_wrapper()
            _disarm_execute()


# What the diagnostics layer (above this one) asks to hear about, registered
# by it when it is imported: recording never imports upward.
_tape_observer = None      # f(tape_state, pushed) at every push and pop
_cache_clearers = []       # emptied by clear_caches()
_uninstallers = []         # called by uninstall()


def observe_from_above(tape_observer=None, clear_caches=None, uninstall=None):
    """Register a layer above's interest: ``tape_observer(tape_state, pushed)``
    at every tape push/pop, ``clear_caches()`` with fasttape.clear_caches(),
    ``uninstall()`` with uninstall()."""
    global _tape_observer
    if tape_observer is not None:
        _tape_observer = tape_observer
    if clear_caches is not None and clear_caches not in _cache_clearers:
        _cache_clearers.append(clear_caches)
    if uninstall is not None and uninstall not in _uninstallers:
        _uninstallers.append(uninstall)


def push_tape(tape_state):
    _push(_current().tapes, tape_state)
    if _tape_observer is not None:
        _tape_observer(tape_state, True)


def pop_tape(tape_state):
    _pop(_current().tapes, tape_state, "Tape is not recording.")
    if _tape_observer is not None:
        _tape_observer(tape_state, False)


def push_accumulator(acc_state):
    _push(_current().accumulators, acc_state)


def pop_accumulator(acc_state):
    _pop(_current().accumulators, acc_state, "Accumulator is not recording.")


# -- recording ------------------------------------------------------------------

def _record_python_backward(op_type, output_tensors, input_tensors,
                            backward_function, forward_function=None,
                            to_tapes=True, to_accumulators=True):
    st = _current()
    if (not st.tapes and not st.accumulators) or _is_stopped():
        return
    inputs = [_handle_or_self(t) for t in input_tensors]
    _callback.record(op_type, inputs, list(output_tensors),
                     _callback.PY_BACKWARD, backward=backward_function,
                     forward=forward_function, to_tapes=to_tapes,
                     to_accumulators=to_accumulators)


# -- wrappers of TF's record/variable functions ----------------------------------

_originals = {}


def _wrapped_record_operation(op_type, output_tensors, input_tensors,
                              backward_function, forward_function=None):
    _originals["record_operation"](op_type, output_tensors, input_tensors,
                                   backward_function, forward_function)
    _record_python_backward(op_type, output_tensors, input_tensors,
                            backward_function, forward_function)


# A tf.function call that TF's own accumulators watch is recorded twice
# (ConcreteFunction's record, the only caller of the two functions below):
# record_operation_backprop_only(outputs, arguments, backward) for tapes, and
# record_operation_forwardprop_only(outputs + JVP outputs + side outputs,
# arguments + TF's input tangents, the same backward, where TF's JVPs are) for
# TF's accumulators, which read the JVPs its forward function computed for
# them and transpose nothing. The backward takes gradients for the first
# record's outputs and gives them for its inputs; it takes none for the JVP
# outputs and gives none for the tangents unless a tape watches those
# tangents (need_gradients_for_jvps). So a fasttape accumulator, which is in
# no such plan, transposes the backward over the first record, the pair that
# always matches, exactly as it transposes record_operation's when no TF
# accumulator is around; over the second it read the aids of TF's JVP outputs
# as the gradients of side outputs or got too few gradients.

def _wrapped_record_operation_backprop_only(op_type, output_tensors,
                                            input_tensors, backward_function):
    _originals["record_operation_backprop_only"](
        op_type, output_tensors, input_tensors, backward_function)
    _record_python_backward(op_type, output_tensors, input_tensors,
                            backward_function)
    _tf_accumulators.call_record = (backward_function, len(input_tensors))


def _wrapped_record_operation_forwardprop_only(
        op_type, output_tensors, input_tensors, backward_function,
        forwardprop_output_indices):
    # (taken first: held, it would keep the call's outputs alive)
    backward, n_args = getattr(_tf_accumulators, "call_record", (None, 0))
    _tf_accumulators.call_record = None, 0
    _originals["record_operation_forwardprop_only"](
        op_type, output_tensors, input_tensors, backward_function,
        forwardprop_output_indices)
    if forwardprop_output_indices is None:
        # a call inside the forward function TF builds for its accumulators
        _record_python_backward(op_type, output_tensors, input_tensors,
                                backward_function, to_tapes=False)
        return
    if backward is backward_function and _watching(input_tensors[n_args:],
                                                   accumulators=True):
        raise TypeError(
            f"fasttape.ForwardAccumulator cannot take the JVP of {op_type!r} "
            "(a tf.function call) with respect to the tangents a "
            "tf.autodiff.ForwardAccumulator gives its arguments: TF computes "
            "those JVPs inside the function for its own accumulators only. "
            "Use one implementation for both accumulators (both "
            "fasttape.ForwardAccumulator, or both tf.autodiff."
            "ForwardAccumulator).")


def _wrapped_could_possibly_record():
    # As TF's (TFE_Py_TapeSetIsEmpty): nothing records under
    # record.stop_recording(). Saying True there made a ConcreteFunction
    # call mark its graph's variables accessed, and a function traced with
    # a since-deleted Variable then failed (recompute_grad's forward).
    st = _current()
    return (((bool(st.tapes) or bool(st.accumulators)) and not _is_stopped())
            or _originals["could_possibly_record"]())


def _watching(tensors, accumulators=False):
    """The active fasttape tapes (or accumulators) that would record an op
    on ``tensors``."""
    st = _current()
    items = st.accumulators if accumulators else st.tapes
    if not items or _is_stopped():
        return []
    flat = [_handle_or_self(t) for t in tensors]
    flat = [t for t in flat if hasattr(t, "_id")]
    ids = [t._id for t in flat]  # pylint: disable=protected-access
    trainable = [is_trainable(t) for t in flat]
    limit, floor = st.nesting_limit, st.nesting_floor
    return [x for x in items if (x.nesting_id <= limit or x.nesting_id > floor)
            and x.core.should_record(ids, trainable)]


def _wrapped_should_record_backprop(tensors):
    return (_originals["should_record_backprop"](tensors)
            or bool(_watching(tensors)))


def _wrapped_possible_tape_gradient_types(tensors):
    """As TF's TFE_Py_TapeSetPossibleGradientTypes, over TF's tapes and
    accumulators and fasttape's together: 0 when none watches ``tensors``,
    1 for exactly one (a non-persistent tape or an accumulator), else 2.
    (Answering 2 for a lone accumulator made cond_v2/while_v2 wrap the op in
    a "cflow_gradient_wrapper" function that TF itself never builds there,
    whose gradient cond_v2 then cannot resolve.)"""
    theirs = _originals["PossibleTapeGradientTypes"](tensors)
    if theirs == gradients_util.POSSIBLE_GRADIENT_TYPES_HIGHER_ORDER:
        return theirs
    tapes = _watching(tensors)
    accumulators = _watching(tensors, accumulators=True)
    if not tapes and not accumulators:
        return theirs
    if (theirs or len(tapes) + len(accumulators) > 1
            or any(tp.persistent for tp in tapes)):
        return gradients_util.POSSIBLE_GRADIENT_TYPES_HIGHER_ORDER
    return gradients_util.POSSIBLE_GRADIENT_TYPES_FIRST_ORDER


def _wrapped_pfor_create_op(op_type, inputs, op_dtypes, attrs=None):
    """pfor builds most of its vectorized ops with ``Graph.create_op``, which
    runs no op callback (TF's tapes see them through the
    ``execute.record_gradient`` call that follows): record them here, or a
    tape around a pfor jacobian inside a tf.function misses them and
    silently gives None or zeros."""
    op = _originals["_create_op"](op_type, inputs, op_dtypes, attrs)
    _record_built_op(op, op.outputs, False)
    return op


def _record_built_op(op, outputs, shown_to_callbacks):
    """Record a graph op TF built without an op callback (pfor's create_op,
    _apply_op_helper) on this thread's tapes and accumulators.
    shown_to_callbacks: skip it while TF runs its op callbacks (ops a TF op
    callback builds are not shown to callbacks)."""
    st = _current()
    if (outputs and (st.tapes or st.accumulators)
            and not (shown_to_callbacks
                     and context.context().invoking_op_callbacks)):
        _callback.op_callback(op.type, tuple(op.inputs), None,
                              tuple(outputs), op.name, op.graph)


# tape.variable_accessed / variables_accessed, wrapped (compiled: a trainable
# variable's every read goes through them).
_wrapped_variable_accessed = _callback.variable_accessed
_wrapped_variables_accessed = _callback.variables_accessed


def _wrapped_apply_op_helper(op_type_name, name=None, **keywords):
    """Graph ops built while tracing, where TF calls its op callbacks (the
    other places it does build ops without inputs: Const, Placeholder)."""
    result = _originals["_apply_op_helper"](op_type_name, name=name, **keywords)
    _record_built_op(result[2], result[3], True)
    return result


# -- the fallback path: execute.execute -------------------------------------------

_tf_execute = execute.execute      # what TF's op-callback switch last chose


def _recording_execute(op_name, num_outputs, inputs, attrs, ctx, name=None):
    """execute.execute while anything records: TF's (with its op callbacks,
    if any), then the record."""
    tensors = execute.execute_with_callbacks(op_name, num_outputs, inputs,
                                             attrs, ctx, name)
    _callback.op_callback(op_name, tuple(inputs), attrs, tensors, name)
    return tensors


def _arm_execute():
    """Put fasttape's wrapper in as ``execute.execute`` (around TF's choice,
    kept in _tf_execute) while any tape is live. Called with _live_lock held:
    at the first push, and after TF's add/remove_op_callback, which switch
    ``execute.execute`` for all threads (fallback-path ops would then
    silently go unrecorded on threads that record)."""
    global _tf_execute
    current = execute.execute
    if current is not _recording_execute:
        _tf_execute = current
        if _live_tapes > 0:
            execute.execute = _recording_execute


def _disarm_execute():
    if execute.execute is _recording_execute:
        execute.execute = _tf_execute


def _wrapped_add_op_callback(callback_fn):
    _originals["add_op_callback"](callback_fn)
    with _live_lock:
        _arm_execute()


def _wrapped_remove_op_callback(op_callback):
    _originals["remove_op_callback"](op_callback)
    with _live_lock:
        _arm_execute()


def clear_caches():
    """Empty every fasttape cache that holds tensors or traced functions:
    the ones of the vspace, the fast rules' constants and the
    compiled-backward passes (and what they remember about keys seen).
    ``context.context()._clear_caches()`` calls it too (while fasttape is
    installed), as TF's own zeros cache is emptied there."""
    VSPACE.clear_caches()
    _fast_grads.clear_caches()
    _callback.clear_layouts()
    _compiled.CACHE.clear()
    _budget.clear_caches()
    for clear in _cache_clearers:
        clear()


def _wrapped_clear_caches(self):
    _originals["_clear_caches"](self)
    clear_caches()


def _wrapped_context_clear_caches(context_handle):
    # tf.random.set_seed, keras.utils.set_random_seed, clear_kernel_cache:
    # every traced function's kernels go, so each compiled backward pass is
    # instantiated again by its next call; the cache weighs that cost.
    _originals["TFE_ContextClearCaches"](context_handle)
    _compiled.kernels_cleared()


# -- TF's own ForwardAccumulator -------------------------------------------------
#
# TF's C++ calls the registered JVP function (forwardprop._jvp_dispatch) for
# each op one of its accumulators sees, from inside the op's execution: after
# the kernel ran and BEFORE the op callbacks. The ops that JVP runs are then
# recorded, by TF, only on tapes older than the accumulator computing it
# (TapeSetRecordForwardprop's max_gradient_tape_id) and by accumulators older
# than it. fasttape's tapes and accumulators follow that rule through the
# same nesting limit its own accumulators use, numbered on fasttape's counter
# when TF's accumulator is pushed. And the JVP must not end a fast-path
# capture meant for the op it belongs to (_callback._capture): its ops would
# reach the capture callback first and the op itself would go unrecorded.

_tf_accumulators = _threading.local()  # .pushed: [(TF accumulator, nesting id)]
                                       # .served: (output ids, nesting ids) of this level
                                       # .call_record: (backward, number of arguments)
                                       #   of the last function call recorded


def _tf_pushed():
    pushed = getattr(_tf_accumulators, "pushed", None)
    if pushed is None:
        pushed = _tf_accumulators.pushed = []
    return pushed


def _wrapped_accumulator_set_add(accumulator):
    _originals["TFE_Py_ForwardAccumulatorSetAdd"](accumulator)
    _tf_pushed().append((accumulator, next(_nesting_ids)))


def _wrapped_accumulator_set_remove(accumulator):
    _originals["TFE_Py_ForwardAccumulatorSetRemove"](accumulator)
    pushed = _tf_pushed()
    for i in range(len(pushed) - 1, -1, -1):
        if pushed[i][0] is accumulator:
            del pushed[i]
            break


def _busy_tf_accumulator(inputs, tangents, out_key):
    """The nesting id of the TF accumulator whose JVP is asked for: the one
    that holds these very tangents for these inputs. TF asks its accumulators
    in the order they were pushed, so when several hold the same tangent (one
    tangent given to nested accumulators), the oldest not yet asked for this
    op's outputs. -1 (older than anything fasttape pushed) for an accumulator
    pushed before fasttape's hooks were in."""
    pushed = _tf_pushed()
    found = []
    for nid_acc in pushed:
        acc = nid_acc[0]
        for primal, tangent in zip(inputs, tangents):
            if tangent is not None and pywrap_tfe.TFE_Py_ForwardAccumulatorJVP(
                    acc, primal) is tangent:
                found.append(nid_acc[1])
                break
    if not found:
        return -1
    key, served = getattr(_tf_accumulators, "served", (None, ()))
    if key == out_key:
        found = [nid for nid in found if nid not in served] or found
    return min(found)


def _tf_jvp_dispatch(op_name, attr_tuple, inputs, outputs, tangents,
                     use_batch=False):
    """TF's JVP function (forwardprop._jvp_dispatch), run with fasttape's
    tapes and accumulators scoped as TF scopes its own (see above)."""
    st = _current()
    if not st.tapes and not st.accumulators:
        return _originals["jvp_function"](op_name, attr_tuple, inputs, outputs,
                                          tangents, use_batch)
    out_key = tuple([getattr(t, "_id", None) for t in outputs])
    busy = _busy_tf_accumulator(inputs, tangents, out_key)
    key, served = getattr(_tf_accumulators, "served", (None, ()))
    served = (served if key == out_key else ()) + (busy,)
    limit, floor = st.nesting_limit, st.nesting_floor
    guard, capturing = st.in_callback, st.capturing
    st.in_callback = False
    st.capturing = False
    try:
        if st.accumulators and not guard:
            # fasttape's accumulators older than TF's take the op first, as
            # TF's own would: its JVP reads the tangents of the op's outputs.
            _callback.accumulate_before_tf(op_name, list(inputs),
                                           list(outputs), attr_tuple, busy)
        st.nesting_limit = busy
        st.nesting_floor = next(_nesting_ids)
        _tf_accumulators.served = (None, ())
        return _originals["jvp_function"](op_name, attr_tuple, inputs, outputs,
                                          tangents, use_batch)
    finally:
        st.nesting_limit, st.nesting_floor = limit, floor
        st.in_callback, st.capturing = guard, capturing
        _tf_accumulators.served = (out_key, served)


def _wrapped_build_functions_for_outputs(self, outputs, inference_args,
                                         input_tangents):
    """ConcreteFunction's builder of a call's forward and backward functions,
    with this thread's fasttape accumulators out of sight while it builds
    the forward function that computes JVPs for TF's accumulators.

    That function takes exactly the inputs TF planned: the call's arguments
    and the tangents TF's own accumulators give them (pack_tangents), and TF
    raises when its graph ends up with more ("The forward graph had N
    inputs", itself a TypeError from a misbuilt InternalError). A fasttape
    accumulator is in no such plan: it recorded the "captured_value" ops
    there, giving the graph's placeholders its eager tangents, and the JVPs
    it then built captured those as extra inputs. Nothing it could compute
    in that graph is read: it takes the call's JVPs from the call's record
    (record_operation_backprop_only), as with no TF accumulator around.
    Accumulators pushed meanwhile stay seen and pushed."""
    if not input_tangents:
        return _originals["_build_functions_for_outputs"](
            self, outputs, inference_args, input_tangents)
    st = _current()
    hidden = st.accumulators
    st.accumulators = []
    try:
        return _originals["_build_functions_for_outputs"](
            self, outputs, inference_args, input_tangents)
    finally:
        hidden.extend(st.accumulators)
        st.accumulators = hidden


_jvp_function_registered = False


def _register_jvp_function(wrapped):
    global _jvp_function_registered
    _originals["jvp_function"] = tf_forwardprop._jvp_dispatch  # pylint: disable=protected-access
    pywrap_tfe.TFE_Py_RegisterJVPFunction(
        _tf_jvp_dispatch if wrapped else _originals["jvp_function"])
    _jvp_function_registered = wrapped


_HOOKS = (
    (record, "record_operation", _wrapped_record_operation),
    (record, "record_operation_backprop_only",
     _wrapped_record_operation_backprop_only),
    (record, "record_operation_forwardprop_only",
     _wrapped_record_operation_forwardprop_only),
    (record, "could_possibly_record", _wrapped_could_possibly_record),
    (record, "should_record_backprop", _wrapped_should_record_backprop),
    (gradients_util, "PossibleTapeGradientTypes",
     _wrapped_possible_tape_gradient_types),
    (tf_tape, "variable_accessed", _wrapped_variable_accessed),
    (tf_tape, "variables_accessed", _wrapped_variables_accessed),
    (op_callbacks, "add_op_callback", _wrapped_add_op_callback),
    (op_callbacks, "remove_op_callback", _wrapped_remove_op_callback),
    (op_def_library, "_apply_op_helper", _wrapped_apply_op_helper),
    (pfor_lib, "_create_op", _wrapped_pfor_create_op),
    (context.Context, "_clear_caches", _wrapped_clear_caches),
    (pywrap_tfe, "TFE_ContextClearCaches", _wrapped_context_clear_caches),
    (pywrap_tfe, "TFE_Py_ForwardAccumulatorSetAdd",
     _wrapped_accumulator_set_add),
    (pywrap_tfe, "TFE_Py_ForwardAccumulatorSetRemove",
     _wrapped_accumulator_set_remove),
    (concrete_function._TapeGradientFunctions,  # pylint: disable=protected-access
     "_build_functions_for_outputs", _wrapped_build_functions_for_outputs),
)

# AutoGraph must not try to convert fasttape's own (partly compiled) code
# when a tape is used inside a user's tf.function, as it leaves TF's alone.
_AUTOGRAPH_RULE = autograph_config_lib.DoNotConvert("fasttape")

_installed = False


def install():
    """Put fasttape's hooks into TF (idempotent)."""
    global _installed
    if _installed:
        return
    for module, name, wrapper in _HOOKS:
        _originals[name] = getattr(module, name)
        setattr(module, name, wrapper)
    _callback.set_variables_accessed(_originals["variable_accessed"],
                                     _originals["variables_accessed"])
    autograph_config.CONVERSION_RULES = (
        (_AUTOGRAPH_RULE,) + tuple(autograph_config.CONVERSION_RULES))
    _register_jvp_function(True)
    _callback.install_death_hook()
    _installed = True


def uninstall():
    """Take every hook out again (tests use this to prove each one matters)."""
    global _installed
    if not _installed:
        return
    for module, name, wrapper in _HOOKS:
        if getattr(module, name) is wrapper:
            setattr(module, name, _originals[name])
    autograph_config.CONVERSION_RULES = tuple(
        r for r in autograph_config.CONVERSION_RULES if r is not _AUTOGRAPH_RULE)
    _installed = False
    _register_jvp_function(False)
    _callback.uninstall_death_hook()
    _tf_pushed().clear()
    _uninstall_fast_path_wrapper()
    _disarm_execute()
    set_conversion_hook(None)
    for take_out in _uninstallers:
        take_out()


def installed_hooks():
    """Names of every fasttape hook now in TF: those of _HOOKS and the
    AutoGraph rule (from install() to uninstall()), the fast-path wrapper
    and ``execute`` (while a tape is live), ``_numpy`` (explain_none's
    conversion hook, while it is on). The fast path's entry in a thread's
    op-callback list (_callback._capture) is taken out in the call that put
    it there, so it is never in place between two calls."""
    names = [name for module, name, wrapper in _HOOKS
             if getattr(module, name) is wrapper]
    if _AUTOGRAPH_RULE in autograph_config.CONVERSION_RULES:
        names.append("CONVERSION_RULES")
    if _jvp_function_registered:
        names.append("JVPFunction")
    if _callback.death_hook_installed():
        names.append("EagerTensor.tp_dealloc")
    if pywrap_tfe.TFE_Py_FastPathExecute is _fast_path_execute:
        names.append("TFE_Py_FastPathExecute")
    if execute.execute is _recording_execute:
        names.append("execute")
    if ops._EagerTensorBase._numpy is _numpy_with_hook:  # pylint: disable=protected-access
        names.append("_numpy")
    return names


# -- the fast path: records, and reads Variable arguments ---------------------------

_original_fast_path = pywrap_tfe.TFE_Py_FastPathExecute
fast_path_wrapper_enabled = True   # tests switch it off to show the trap
_fast_path_execute = _callback.fast_path_execute


def _install_fast_path_wrapper():
    if fast_path_wrapper_enabled:
        pywrap_tfe.TFE_Py_FastPathExecute = _fast_path_execute


def _uninstall_fast_path_wrapper():
    if pywrap_tfe.TFE_Py_FastPathExecute is _fast_path_execute:
        pywrap_tfe.TFE_Py_FastPathExecute = _original_fast_path


# -- fasttape.explain: NumPy conversions while explain_none(True) ------------------

_original_numpy = ops._EagerTensorBase._numpy  # pylint: disable=protected-access


_conversion_hook = None


def _numpy_with_hook(self):
    hook = _conversion_hook
    if hook is not None:
        hook(self)
    return _original_numpy(self)


def set_conversion_hook(hook):
    """hook(tensor) before every conversion of an eager tensor to NumPy or
    Python (``.numpy()``, ``np.asarray``, ``float()``...: all go through
    ``_EagerTensorBase._numpy``); None takes the wrapper out (uninstall()
    does too)."""
    global _conversion_hook
    _conversion_hook = hook
    ops._EagerTensorBase._numpy = (  # pylint: disable=protected-access
        _original_numpy if hook is None else _numpy_with_hook)


# -- the drop-in class swap -----------------------------------------------------

_swapped = []  # (module, attribute name, original, replacement), in swap order
_swap_lock = _threading.RLock()


class PatchSkippedWarning(UserWarning):
    """patch() left a module that refused the swap with TF's class."""


def _set(module, name, value):
    """setattr, then proof that it took: a module may refuse by raising or
    ignore the write. Returns the refusal (an exception or a message)."""
    try:
        setattr(module, name, value)
    except Exception as exc:  # noqa: BLE001 - any refusal: reported
        return exc
    try:
        took = vars(module).get(name) is value
    except Exception as exc:  # noqa: BLE001
        return exc
    return None if took else "the attribute did not change"


def swap_classes(replacements):
    """Replace, in every loaded module, each attribute that *is* one of the
    keys of ``replacements`` by its value. Returns how many were swapped.

    All or nothing: a module that refuses the swap (its ``__setattr__``
    raises, or the write does not take) is skipped and named in a
    PatchSkippedWarning, and any other failure midway (an exception while
    scanning, a KeyboardInterrupt) puts back everything this call swapped
    before it propagates. Each swap is noted before it is made, so a rollback
    or restore_classes() never misses one."""
    by_id = {id(k): v for k, v in replacements.items()}
    skipped = []
    with _swap_lock:
        mark = len(_swapped)
        try:
            for module in list(sys.modules.values()):
                try:
                    namespace = vars(module)
                except TypeError:
                    continue
                for name, value in list(namespace.items()):
                    replacement = by_id.get(id(value))
                    if replacement is None or replacement is value:
                        continue
                    _swapped.append((module, name, value, replacement))
                    refused = _set(module, name, replacement)
                    if refused is not None:
                        _swapped.pop()
                        _set(module, name, value)   # if it half took
                        skipped.append(
                            f"{getattr(module, '__name__', module)!s}.{name} "
                            f"({refused})")
        except BaseException:
            _restore_to(mark)
            raise
        count = len(_swapped) - mark
    if skipped:
        warnings.warn(
            "fasttape.patch() left TF's class in place where the module "
            "refused the swap: " + "; ".join(skipped) + ". Code that reaches "
            "the class through these names still uses TF's.",
            PatchSkippedWarning, stacklevel=3)
    return count


def _restore_to(mark):
    """Undo the swaps made after the first ``mark``, newest first. An entry
    leaves the list only once its module holds the original again (or holds
    something else now: a later assignment of the user's is kept), so an
    interrupt midway leaves the rest to the next call. Returns what could not
    be put back (the entries stay listed)."""
    failed = []
    with _swap_lock:
        i = len(_swapped)
        while i > mark:
            i -= 1
            module, name, original, replacement = _swapped[i]
            try:
                current = vars(module).get(name)
            except TypeError:
                current = None
            if current is replacement and _set(module, name, original) is not None:
                failed.append(_swapped[i])
                continue
            del _swapped[i]
    return failed


def restore_classes(mark=0):
    """Undo every swap_classes (those after the first ``mark`` swaps),
    exactly. A module that refuses to take TF's class back is named in a
    PatchSkippedWarning and stays listed (swapped_locations())."""
    failed = _restore_to(mark)
    if failed:
        warnings.warn(
            "fasttape.unpatch() could not put TF's class back in: " +
            ", ".join(f"{getattr(m, '__name__', m)!s}.{n}"
                      for m, n, _, _ in failed),
            PatchSkippedWarning, stacklevel=3)


def swap_mark():
    """How many swaps are in place (patched() restores back to it)."""
    return len(_swapped)


def swapped_locations():
    return [(m.__name__, name) for m, name, _, _ in _swapped]
