# cython: language_level=3
# distutils: language = c++
"""The recording hot path, compiled: the fast-path recorder, the op-callback
entry for what it does not see, and what they record.

Everything here runs once per executed op while a fasttape tape or
accumulator is active, so it avoids Python-level property lookups (dtype
objects, closures) and talks to the core through its C-level methods. The
hooks that route TF into these functions are installed by _recording, the
one module that patches TF.
"""

import gc as _gc
import itertools

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop_util
from tensorflow.python.eager import context
from tensorflow.python.eager import tape as tf_tape
from tensorflow.python.framework import errors_impl
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops
from tensorflow.python.ops import resource_variable_ops

cimport cython
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_DECREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int64_t
from libcpp.vector cimport vector

from fasttape._core cimport GradientTapeCore, ForwardAccumulatorCore
from fasttape.gradients._payloads cimport (EagerOp, GraphOp, PyBackward,
                                          tensor_enum, tensor_shape)

ctypedef void (*_dealloc_fn)(PyObject*) noexcept

cdef extern from "Python.h":
    ctypedef struct _PyType "PyTypeObject":
        _dealloc_fn tp_dealloc
    void PyErr_Fetch(PyObject**, PyObject**, PyObject**)
    void PyErr_Restore(PyObject*, PyObject*, PyObject*)
    void PyErr_WriteUnraisable(object)
    PyObject* PyThreadState_GetDict()
    PyObject* PyDict_GetItem(object, object)   # borrowed, or NULL
    void PyObject_GC_UnTrack(void*)
    int PyObject_IS_GC(object)
    int PyObject_GC_IsTracked(object)
from fasttape.recording._saved import saved_indices

cdef object _py_is_stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped
cdef object _uid = pywrap_tfe.TFE_Py_UID
cdef object _EagerTensor = ops.EagerTensor
cdef object _BaseVariable = resource_variable_ops.BaseResourceVariable

# DataType enums (types.proto) of the differentiable dtypes: half, bfloat16,
# float, double, complex64, complex128, resource; variant is decided by its
# element dtype, as TF's IsTrainable does.
cdef int _RESOURCE = 20
cdef int _VARIANT = 21
NO_LIMIT = 1 << 62
# Tapes and accumulators are numbered in the order they are pushed (see
# _recording._push).
nesting_ids = itertools.count()

EAGER_OP = 0
GRAPH_OP = 1
PY_BACKWARD = 2


# -- a tape as the recording machinery sees it ------------------------------------

cdef class TapeState:
    """One fasttape GradientTape's recording state."""
    cdef readonly GradientTapeCore core
    cdef readonly bint persistent
    cdef readonly bint watch_accessed_variables
    cdef public dict variables          # handle id -> variable
    cdef public long long nesting_id    # set at every push (see _recording)
    cdef public object explain_info     # fasttape.explain's facts (None: none kept)
    cdef public object budget           # a memory budget's store (_budget.Store), or None
    # TF's unique-id counter when the tape was made: tensors with a greater
    # _id were made after it (tape.summary() tells them apart).
    cdef readonly long long first_uid
    # Hears of EagerTensor deaths (see _tensor_died), of ids from first_uid
    # to the last recorded output that can die first.
    cdef bint hearing
    cdef long long last_mortal_uid
    cdef object __weakref__

    def __init__(self, bint persistent, bint watch_accessed_variables):
        self.first_uid = _uid()
        self.core = GradientTapeCore(persistent)
        self.persistent = persistent
        self.watch_accessed_variables = watch_accessed_variables
        self.variables = {}
        self.nesting_id = 0
        self.explain_info = None
        self.budget = None

    def __dealloc__(self):
        if self.hearing:
            _stop_hearing(self)

    def watch_variable(self, variable):
        self._watch_variable(variable)

    cdef int _watch_variable(self, variable) except -1:
        hid = _id_of(variable.handle)
        self.core.watch(hid)
        if hid not in self.variables:
            self.variables[hid] = variable
        return 0

    def watched_variables(self):
        # TF's tape keeps its variables in a set ordered by handle id.
        return tuple([self.variables[k] for k in sorted(self.variables)])


# -- tensor deaths ---------------------------------------------------------------
#
# TF's tape forgets an op once its outputs all die unread: EagerTensor's
# dealloc calls TFE_Py_TapeSetDeleteTrace(id). fasttape's tapes hear of the
# same deaths from the same place: install_death_hook() puts _eager_dealloc
# in EagerTensor's tp_dealloc slot; it calls TF's, then tells each tape that
# recorded outputs able to die first (core.delete_trace, which queues while
# the tape is mid-operation). No weakref per recorded output is then made:
# its allocation, its callback and the garbage collector's passes over it
# cost about a tenth of a microsecond an op, more at scale, which TF's tape
# does not pay.

cdef _dealloc_fn _tf_dealloc = NULL     # EagerTensor's own, while hooked
cdef Py_ssize_t _id_offset = -1         # of EagerTensor's int64 id field
cdef vector[PyObject*] _hearing         # TapeStates (borrowed: each leaves in its dealloc)


cdef void _start_hearing(TapeState ts):
    ts.hearing = True
    _hearing.push_back(<PyObject*>ts)


cdef void _stop_hearing(TapeState ts):
    cdef size_t i
    for i in range(_hearing.size()):
        if _hearing[i] == <PyObject*>ts:
            _hearing.erase(_hearing.begin() + i)
            break
    ts.hearing = False


cdef void _eager_dealloc(PyObject* tensor) noexcept:
    cdef int64_t tid = _id_in_place(tensor)
    _tf_dealloc(tensor)
    if not _hearing.empty():
        _tensor_died(tid)


cdef void _tensor_died(int64_t tid) noexcept:
    """Tell the tapes hearing deaths that tensor ``tid`` died. Runs inside a
    dealloc: on any thread, inside the garbage collector, maybe with an
    exception being raised (kept aside, as CPython keeps it for weakref
    callbacks); what fails is reported as unraisable."""
    cdef PyObject *etype, *evalue, *etb
    cdef PyObject* held[8]
    cdef vector[PyObject*] more
    cdef size_t i, n = 0
    cdef TapeState ts
    # The tapes to tell, held: telling one can free another (its last
    # reference was a saved tensor's), which then leaves _hearing. The
    # first eight on the stack, any more in a vector.
    for i in range(_hearing.size()):
        ts = <TapeState>_hearing[i]
        if ts.first_uid <= tid <= ts.last_mortal_uid:
            Py_INCREF(ts)
            if n < 8:
                held[n] = <PyObject*>ts
            else:
                more.push_back(<PyObject*>ts)
            n += 1
    if n == 0:
        return
    PyErr_Fetch(&etype, &evalue, &etb)
    for i in range(n):
        ts = <TapeState>(held[i] if i < 8 else more[i - 8])
        if ts.core is not None:     # (None: cleared by the collector)
            try:
                ts.core.delete_trace(tid)
            except BaseException:
                PyErr_WriteUnraisable(ts)
            if (ts.hearing and ts.core.live_ops == 0 and not ts.core.busy
                    and ts.core.dead_ids.empty()):
                # It holds no op now (all forgotten, or released by a
                # gradient): deaths need not reach it until it records
                # again, so tapes kept after their step cost a death
                # nothing.
                _stop_hearing(ts)
        Py_DECREF(ts)
    ts = None
    PyErr_Restore(etype, evalue, etb)


def install_death_hook():
    """Put _eager_dealloc in EagerTensor's tp_dealloc slot (idempotent).
    The id's place in the object is found by reading tensors of known ids;
    if it is not found in exactly one place, nothing is installed and the
    tapes keep a weakref on each output instead (False)."""
    global _tf_dealloc, _id_offset
    if _tf_dealloc != NULL:
        return True
    import numpy as np
    with ops.init_scope():      # (eager tensors, even if a trace installs)
        probes = [ops.convert_to_tensor(np.float32(i)) for i in range(4)]
    if any(type(t) is not _EagerTensor for t in probes):
        return False
    cdef Py_ssize_t off, found = -1, size = (<object>_EagerTensor).__basicsize__
    for off in range(16, size - 7, 8):
        if all((<int64_t*>((<char*><PyObject*>t) + off))[0] == t._id
               for t in probes):
            if found != -1:
                return False
            found = off
    if found == -1:
        return False
    _id_offset = found
    _tf_dealloc = (<_PyType*><PyObject*>_EagerTensor).tp_dealloc
    (<_PyType*><PyObject*>_EagerTensor).tp_dealloc = _eager_dealloc
    return True


cdef inline int64_t _id_in_place(PyObject* t) noexcept:
    # An EagerTensor's id, where install_death_hook found the field.
    return (<int64_t*>((<char*>t) + _id_offset))[0]


cdef inline int64_t _id_of(t) except? -1:
    """t._id, read in place for an EagerTensor (where install_death_hook
    found the field: the attribute read goes through Tensor's __getattr__
    hook), by the attribute for any other tensor or if it was not found."""
    if type(t) is _EagerTensor and _id_offset != -1:
        return _id_in_place(<PyObject*>t)
    return t._id


def uninstall_death_hook():
    global _tf_dealloc
    if _tf_dealloc != NULL:
        (<_PyType*><PyObject*>_EagerTensor).tp_dealloc = _tf_dealloc
        _tf_dealloc = NULL


def tapes_hearing():
    """How many tapes hear of EagerTensor deaths now (tests)."""
    return _hearing.size()


def death_hook_installed():
    return _tf_dealloc != NULL and (
        (<_PyType*><PyObject*>_EagerTensor).tp_dealloc == _eager_dealloc)


# -- per-thread state -----------------------------------------------------------

@cython.final
cdef class ThreadState:
    """Per-thread recording state (current() gives this thread's). A C-level
    object kept in the thread's own dict: the recorder reads it a dozen
    times per op, and a threading.local's attributes cost ~50 ns each."""
    cdef public list tapes             # recording TapeStates, innermost last
    cdef public list accumulators      # recording AccumulatorStates
    cdef public bint in_callback       # re-entry guard
    # The fast-path wrapper lets TF's C++ convert an op's Python-value
    # inputs and hands the op to TF's op-callback machinery for that one
    # call (see _capture): set while that call runs, until the op's own
    # callback (of type capture_op) has been seen.
    cdef public bint capturing
    cdef public object capture_op
    # While an accumulator computes a JVP: only tapes older than it
    # (nesting id < nesting_limit), accumulators not younger (<=), and
    # whatever is pushed during the computation (nesting id >
    # nesting_floor, e.g. the GradientTape inside TF's own
    # _FusedBatchNormGradGrad once patch() is on) see the ops it runs.
    cdef public long long nesting_limit
    cdef public long long nesting_floor

    def __cinit__(self):
        self.tapes = []
        self.accumulators = []
        self.in_callback = False
        self.capturing = False
        self.capture_op = None
        self.nesting_limit = NO_LIMIT
        self.nesting_floor = NO_LIMIT


cdef object _STATE_KEY = "fasttape._callback.ThreadState"
cdef ThreadState _shared_state = None   # tests only: see share_state


cdef inline ThreadState _current():
    cdef PyObject* d
    cdef PyObject* p
    if _shared_state is not None:
        return _shared_state
    d = PyThreadState_GetDict()
    if d != NULL:
        p = PyDict_GetItem(<object>d, _STATE_KEY)
        if p != NULL:
            return <ThreadState>p
    return _new_state()


cdef ThreadState _new_state():
    cdef PyObject* d = PyThreadState_GetDict()
    if d == NULL:
        raise RuntimeError("fasttape: no Python thread state")
    st = ThreadState()
    (<dict><object>d)[_STATE_KEY] = st
    return st


def current():
    """This thread's recording state (a ThreadState)."""
    return _current()


def share_state(st):
    """Tests only: make every thread use one ThreadState (st), or each its
    own again (None); shows why the state must be per thread."""
    global _shared_state
    _shared_state = st


cdef inline int _enum(t) except? -1:
    if type(t) is _EagerTensor:
        return tensor_enum(t)
    return t.dtype._type_enum


cdef inline bint _trainable_enum(int enum):
    # half, bfloat16, float, double, complex64, complex128, resource
    return (enum == 1 or enum == 2 or enum == 8 or enum == 14 or enum == 18
            or enum == 19 or enum == 20)


cpdef bint is_trainable(t) except? -1:
    cdef int enum = _enum(t)
    if _trainable_enum(enum):
        return True
    if enum == _VARIANT:
        return backprop_util.IsTrainable(t)
    return False


cpdef object output_meta(t):
    """What ones/zeros for ``t`` need: (shape, dtype enum) for an eager
    tensor; the tensor itself for graph tensors, resources and variants
    (their zeros need handle data)."""
    if type(t) is _EagerTensor:
        enum = tensor_enum(t)
        if enum != _RESOURCE and enum != _VARIANT:
            return (tensor_shape(t), enum)
    return t


cdef tuple _NO_META = (None,)


cdef list _ids(tensors):
    return [_id_of(t) for t in tensors]


cdef dict _saved_masks = {}   # op type -> {arity key: masks} (see _masks); the one
                              # saved-tensor mask cache (both recording paths)


cdef tuple _masks(op_type, Py_ssize_t n_in, Py_ssize_t n_out):
    """Per input and output: does the op's gradient read it? And: may the
    op's entry ever be forgotten when its outputs die? Not when its
    gradient reads one of them: the payload then keeps that output (so the
    entry) alive until the tape ends, as TF's backward function does.
    (cached; keyed by op type, then by one integer: a tuple key's
    comparisons showed in the per-op profile)"""
    by_arity = _saved_masks.get(op_type)
    if by_arity is None:
        by_arity = _saved_masks[op_type] = {}
    # Below 16 inputs and outputs, a key below 256: one of Python's cached
    # small ints, no allocation; any other arity, a key of 256 or more.
    key = (n_in * 16 + n_out if n_in < 16 and n_out < 16
           else 256 + ((n_in << 32) | n_out))
    masks = by_arity.get(key)
    if masks is None:
        saved_in, saved_out = saved_indices(op_type)
        out_mask = _mask(saved_out, n_out)
        masks = (_mask(saved_in, n_in), out_mask,
                 out_mask is not None and True not in out_mask)
        by_arity[key] = masks
    return masks


cdef object _mask(indices, Py_ssize_t n):
    if indices is None:
        return None  # all
    wanted = {i % n for i in indices if -n <= i < n}
    return tuple([i in wanted for i in range(n)])


cdef tuple _keep(list inputs, in_mask, list outputs, out_mask):
    """inputs + outputs, with None where a mask says the gradient does not
    read them (one tuple, built in place)."""
    cdef Py_ssize_t n_in = len(inputs), n_out = len(outputs), i
    cdef tuple kept = PyTuple_New(n_in + n_out)
    for i in range(n_in):
        v = inputs[i] if in_mask is None or (<tuple>in_mask)[i] else None
        Py_INCREF(v)
        PyTuple_SET_ITEM(kept, i, v)
    for i in range(n_out):
        v = outputs[i] if out_mask is None or (<tuple>out_mask)[i] else None
        Py_INCREF(v)
        PyTuple_SET_ITEM(kept, n_in + i, v)
    return kept


# Anomaly mode's note-taker (fasttape.anomaly sets it while the mode is on):
# called as hook(payload, op_type, inputs, outputs) for every op recorded on
# a tape; None (the default) costs one pointer test per recorded op.
cdef object _anomaly_hook = None


def set_anomaly_hook(hook):
    """Set (a callable) or clear (None) anomaly mode's per-op hook."""
    global _anomaly_hook
    _anomaly_hook = hook


def record(op_type, inputs, outputs, int kind, attrs=None, backward=None,
           forward=None, bint to_tapes=True, bint to_accumulators=True):
    """Record an op on every active tape that watches one of its inputs, and
    push tangents through it for every active accumulator that tracks one.

    kind: EAGER_OP (attrs given), GRAPH_OP, or PY_BACKWARD (backward and
    optionally forward functions given, as record.record_operation takes).
    An op with no outputs is not recorded: no gradient can reach it (TF's
    forward accumulator records such JVP calls, e.g. of nested accumulators;
    _record reads outputs[0], unchecked).
    """
    if not outputs:
        return
    _record(_current(), op_type, inputs, outputs, kind, attrs, backward, forward,
            to_tapes, to_accumulators)


cdef int _record(ThreadState st, op_type, inputs, outputs, int kind, attrs, backward,
                 forward, bint to_tapes, bint to_accumulators,
                 list ids=None) except -1:
    if type(inputs) is not list:
        inputs = list(inputs)
    if type(outputs) is not list:
        outputs = list(outputs)
    if ids is None:
        ids = _ids(inputs)
    cdef vector[int64_t] id_vec
    for i in ids:
        id_vec.push_back(i)
    cdef list tapes = _tapes_recording(st, id_vec, NULL) if to_tapes else None
    cdef list accs = None
    cdef list acc_list = st.accumulators
    if to_accumulators and acc_list and any(
            [is_trainable(t) for t in outputs]):
        # (TF's accumulators skip ops with no differentiable output.)
        for a in acc_list:
            if _acc_in_scope(st, a) \
                    and (<ForwardAccumulatorCore>a.core).should_record(ids, None) \
                    and (kind == PY_BACKWARD or not _accumulated(a, outputs)):
                if accs is None:
                    accs = [a]
                else:
                    accs.append(a)
    if tapes is None and accs is None:
        return 0
    # The dtypes only now: most ops no tape tracks end above.
    cdef list trainable = [is_trainable(t) for t in inputs]
    cdef vector[char] flags
    cdef char flag
    for t in trainable:
        flag = t
        flags.push_back(flag)
    if tapes is not None:
        tapes = [tp for tp in tapes
                 if (<TapeState>tp).core.tracks_any(id_vec, &flags)]
    if accs is not None:
        accs = [a for a in accs
                if (<ForwardAccumulatorCore>a.core).should_record(ids, trainable)]
    if not tapes and not accs:
        return 0
    cdef list out_ids = _ids(outputs)
    cdef tuple meta = _output_metas(outputs, bool(accs))
    cdef Py_ssize_t n_in = len(inputs)
    payload = None
    if tapes:
        if kind == EAGER_OP:
            in_mask, out_mask, mortal = _masks(op_type, n_in, len(outputs))
            payload = _eager_payload(attrs, inputs, in_mask, outputs, out_mask)
        elif kind == GRAPH_OP:
            payload = GraphOp(outputs[0].op, n_in)
            mortal = True
        else:
            payload = PyBackward(backward, n_in, forward)
            mortal = True
        # Graph tensors live as long as their graph, as in TF.
        _record_on_tapes(tapes, op_type, id_vec, inputs, outputs, meta,
                         payload, mortal and type(outputs[0]) is _EagerTensor)
    if accs:
        if kind == EAGER_OP:
            payload = EagerOp(attrs, tuple(inputs) + tuple(outputs), n_in)
        elif payload is None:
            payload = (GraphOp(outputs[0].op, n_in) if kind == GRAPH_OP
                       else PyBackward(backward, n_in, forward))
        in_meta = tuple([output_meta(t) for t in inputs])
        limit = st.nesting_limit
        guard = st.in_callback
        # While TF builds a graph op it suppresses op callbacks for ops made
        # inside them; the JVP's own ops must still be seen (by the fallback's
        # inner tape and by older tapes/accumulators), so lift that here.
        ctx = context.context()
        tf_guard = ctx.invoking_op_callbacks
        floor = st.nesting_floor
        for acc in accs:
            # The JVP's own ops are seen by older tapes/accumulators, and by
            # those pushed while it runs (the ids drawn after this one).
            st.nesting_limit = acc.nesting_id
            st.nesting_floor = next(nesting_ids)
            st.in_callback = False
            ctx.invoking_op_callbacks = False
            try:
                if acc.core.accumulate(op_type, ids, in_meta, out_ids, meta,
                                       payload, trainable):
                    acc.track(outputs)
            except _InvalidArgumentError as exc:
                _tangent_shape_error(acc, op_type, inputs, exc)
                raise
            finally:
                st.nesting_limit = limit
                st.nesting_floor = floor
                st.in_callback = guard
                ctx.invoking_op_callbacks = tf_guard
    return 0


cdef bint _accumulated(a, list outputs) except -1:
    """Has accumulator ``a`` already pushed tangents through the op that made
    ``outputs``? (A TF accumulator's JVP makes fasttape's older ones take the
    op before TF's op callbacks and fasttape's recorder see it: see
    accumulate_before_tf.) Not asked of a record_operation (PY_BACKWARD): TF
    asks no JVP function for it, and it re-records outputs that already have
    tangents (custom_gradient's identities), which TF's accumulator still
    takes: it transposes the backward function, calling it and raising what
    it raises, and the tangents the outputs had win
    (ForwardAccumulatorCore.accumulate)."""
    core = a.core
    for t in outputs:
        if core.fetch_jvp(t._id) is not None:
            return True
    return False


def accumulate_before_tf(op_type, inputs, outputs, attrs, long long older_than):
    """Push tangents through an eagerly run op for this thread's
    accumulators pushed before ``older_than`` (in scope): TF's C++ asks its
    accumulators in the order they were pushed, and a younger one's JVP of
    the op reads the tangents the older ones give its outputs."""
    cdef ThreadState st = _current()
    if not st.accumulators or not outputs:
        return
    limit, floor = st.nesting_limit, st.nesting_floor
    st.nesting_limit = min(limit, older_than - 1)
    st.nesting_floor = NO_LIMIT
    try:
        _record(st, op_type, inputs, outputs, EAGER_OP, attrs, None, None,
                False, True)
    finally:
        st.nesting_limit, st.nesting_floor = limit, floor


cdef object _InvalidArgumentError = errors_impl.InvalidArgumentError


cdef _tangent_shape_error(acc, op_type, inputs, exc):
    """TF computes each eager op's JVP in a traced function, where a tangent
    whose shape does not fit its primal's fails shape inference: ValueError,
    when the op runs. fasttape's rules run eagerly (InvalidArgumentError):
    raise what TF raises."""
    core = acc.core
    if core.use_batch:
        return
    for t in inputs:
        tangent = core.fetch_jvp(t._id)
        if tangent is not None and not t.shape.is_compatible_with(tangent.shape):
            raise ValueError(
                f"Tangent of shape {tangent.shape} does not fit its primal "
                f"of shape {t.shape} in the JVP of {op_type!r}: "
                f"{exc.message}") from exc


# fasttape.explain's lineage hook, set only while fasttape.explain_none(True):
# called after each op this thread runs while it has tapes (recorded or not).
cdef object _lineage_hook = None


cdef object _str(op_type):
    return op_type.decode() if type(op_type) is bytes else op_type


def set_lineage_hook(hook):
    global _lineage_hook
    _lineage_hook = hook


# fasttape.explain's note of a tf.stop_gradient that cuts a tracked tensor
# (tape state, input id, output id), kept whether or not explain_none is on:
# TF runs StopGradient under record.stop_recording(), so the trace never
# holds it. Asked only for a StopGradient op run while this thread has
# tapes: no other op pays for it.
cdef object _stop_gradient_hook = None


def set_stop_gradient_hook(hook):
    global _stop_gradient_hook
    _stop_gradient_hook = hook


cdef _note_stop_gradient(ThreadState st, a, result):
    """A StopGradient run while stopped: note it on each tape tracking its
    input (an eager tensor, or a Variable by its handle: one the tape would
    watch on its first read counts)."""
    if _stop_gradient_hook is None or st.in_callback or not _eager(result):
        return
    cdef bint var = _is_variable(a)
    if var:
        tid = a.handle._id
    elif _eager(a):
        tid = a._id
    else:
        return
    cdef TapeState ts
    for ts in st.tapes:
        if ts.core.is_watched(tid) or (var and ts.watch_accessed_variables
                                       and a.trainable):
            _stop_gradient_hook(ts, tid, result._id)


def op_callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    """Records one op given as TF's op callbacks see it. Called for the ops
    no wrapped fast path records: the fallback path (``execute.execute``),
    graph ops built while tracing (``op_def_library._apply_op_helper``,
    pfor's ``_create_op``) and a fast-path op with Python-value inputs
    (through TF's callback list, for that one call: see _capture)."""
    cdef ThreadState st = _current()
    if not st.tapes and not st.accumulators:
        return None
    if st.in_callback or not outputs or _is_stopped():
        if _lineage_hook is not None and st.tapes and outputs \
                and not st.in_callback:
            # Run under record.stop_recording() (tf.stop_gradient does).
            _lineage_hook(st.tapes, _str(op_type), inputs, outputs, True)
        elif st.tapes and len(inputs) == 1 and len(outputs) == 1 \
                and _str(op_type) == "StopGradient":
            _note_stop_gradient(st, inputs[0], outputs[0])
        return None
    if type(op_type) is bytes:
        op_type = op_type.decode()
    st.in_callback = True
    try:
        _record(st, op_type, inputs, outputs,
                EAGER_OP if graph is None else GRAPH_OP, attrs, None, None,
                True, True)
        if _lineage_hook is not None and st.tapes:
            _lineage_hook(st.tapes, op_type, inputs, outputs)
    finally:
        st.in_callback = False
    return None


cdef dict _is_variable_type = {}


cdef inline bint _is_variable(a):
    cls = type(a)
    r = _is_variable_type.get(cls)
    if r is None:
        r = issubclass(cls, _BaseVariable)
        _is_variable_type[cls] = r
    return r


cdef object _ResourceVariable = resource_variable_ops.ResourceVariable
cdef object _PY_FAST_PATH = pywrap_tfe.TFE_Py_FastPathExecute


# -- TF's C entry points, called without pybind11 ------------------------------
#
# pywrap_tfe.TFE_Py_FastPathExecute and TFE_Py_TapeSetIsStopped are pybind11
# wrappers of C++ functions that take and return Python objects
# (TFE_Py_FastPathExecute_C(args): a new reference, or NULL with the Python
# error set; TFE_Py_TapeSetIsStopped(): a new reference to a bool). pybind11's
# dispatch costs more than a recorded op's whole bookkeeping, and the
# fast-path wrapper pays it on every op it runs, so the two are looked up in
# TF's library (C++ names: the signature is part of the symbol, so another
# signature is simply not found) and called directly; when they are not
# found, the pybind11 wrappers are used.

cdef extern from *:
    """
    #ifdef _WIN32
    static void* fasttape_symbol(const char* path, const char* name) { return NULL; }
    #else
    #include <dlfcn.h>
    static void* fasttape_symbol(const char* path, const char* name) {
        /* Only a library this process has loaded already (RTLD_NOLOAD). */
        void* lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
        void* f;
        if (lib == NULL) return NULL;
        f = dlsym(lib, name);
        dlclose(lib);   /* drops the reference RTLD_NOLOAD took; TF keeps its own */
        return f;
    }
    #endif
    """
    void* fasttape_symbol(const char* path, const char* name)

ctypedef object (*_args_fn)(object)
ctypedef object (*_noargs_fn)()
cdef _args_fn _c_fast_path = NULL
cdef _noargs_fn _c_is_stopped = NULL


cdef _find_c_entry_points():
    global _c_fast_path, _c_is_stopped
    import os
    from tensorflow import python as tf_python
    directory = os.path.dirname(tf_python.__file__)
    for lib in ("lib_pywrap_tensorflow_common.so", "_pywrap_tensorflow_internal.so"):
        path = os.path.join(directory, lib)
        if not os.path.exists(path):
            continue
        encoded = path.encode()
        fast_path = fasttape_symbol(encoded, b"_Z24TFE_Py_FastPathExecute_CP7_object")
        is_stopped = fasttape_symbol(encoded, b"_Z23TFE_Py_TapeSetIsStoppedv")
        if fast_path != NULL and is_stopped != NULL:
            _c_fast_path = <_args_fn>fast_path
            _c_is_stopped = <_noargs_fn>is_stopped
            return


_find_c_entry_points()


def c_entry_points():
    """Whether TF's fast path and stop test are called without pybind11."""
    return _c_fast_path != NULL


cdef inline object _is_stopped():
    if _c_is_stopped != NULL:
        return _c_is_stopped()
    return _py_is_stopped()


cdef object _RAW_FAST_PATH(args):
    """pywrap_tfe.TFE_Py_FastPathExecute(*args)."""
    if _c_fast_path != NULL:
        return _c_fast_path(args if type(args) is tuple else tuple(args))
    return _PY_FAST_PATH(*args)
cdef object _tape_variable_accessed = pywrap_tfe.TFE_Py_TapeVariableAccessed
cdef object _watcher_variable_accessed = pywrap_tfe.TFE_Py_VariableWatcherVariableAccessed
cdef object _default_get_variables = tf_tape.default_get_variables
cdef object _get_default_graph = ops.get_default_graph


# -- variables read: tape.variable_accessed ---------------------------------------

cdef inline object _components(variable):
    """What TF's tapes are told of a read of ``variable``: itself, or its
    components (tape._variables_override: a MirroredVariable's)."""
    override = tf_tape._variables_override
    return (variable,) if override is _default_get_variables else override(variable)


cdef int _accessed(ThreadState st, components, bint tell_tf) except -1:
    """``components``, of a trainable variable just read: TF's tapes and
    variable watchers are told of each (``tell_tf``: what TF's
    tape.variable_accessed does for each), and this thread's fasttape tapes
    that watch accessed variables watch each."""
    for var in components:
        if tell_tf:
            _tape_variable_accessed(var)
            _watcher_variable_accessed(var)
        for tp in st.tapes:
            if (<TapeState>tp).watch_accessed_variables:
                (<TapeState>tp)._watch_variable(var)
    return 0


# TF's tape.variable_accessed and tape.variables_accessed as install() found
# them (set there). Where they are TF's own, the wrappers below do their
# work themselves, so that tape._variables_override, which asks the
# distribution strategy (0.8 us a read in TF 2.21), is asked once a read.
cdef object _tf_variable_accessed = tf_tape.variable_accessed
cdef object _tf_variables_accessed = tf_tape.variables_accessed
cdef object _TF_VARIABLE_ACCESSED = tf_tape.variable_accessed
cdef object _TF_VARIABLES_ACCESSED = tf_tape.variables_accessed


def set_variables_accessed(variable_accessed_, variables_accessed_):
    """What install() found as tape.variable_accessed and
    tape.variables_accessed (wrapped by the two below)."""
    global _tf_variable_accessed, _tf_variables_accessed
    _tf_variable_accessed = variable_accessed_
    _tf_variables_accessed = variables_accessed_


def variable_accessed(variable):
    """tape.variable_accessed (given a trainable variable), wrapped: then
    this thread's fasttape tapes watch it too (not while recording is
    stopped)."""
    cdef ThreadState st = _current()
    if not st.tapes or _is_stopped():
        _tf_variable_accessed(variable)
    elif _tf_variable_accessed is _TF_VARIABLE_ACCESSED:
        _accessed(st, _components(variable), True)
    else:
        _tf_variable_accessed(variable)
        _accessed(st, _components(variable), False)


def variables_accessed(variables):
    """tape.variables_accessed (its trainable variables), wrapped."""
    cdef ThreadState st = _current()
    if not st.tapes or _is_stopped():
        _tf_variables_accessed(variables)
        return
    variables = list(variables)
    cdef bint own = _tf_variables_accessed is _TF_VARIABLES_ACCESSED
    if not own:
        _tf_variables_accessed(variables)
    for v in variables:
        if v.trainable:
            _accessed(st, _components(v), own)


cdef object _read(v):
    """A plain ResourceVariable given to a fast-path op, read as TF's C++
    fast path reads it (MaybeNotifyVariableAccessed, then ReadVariableOp):
    if trainable, the tapes (TF's and fasttape's) are told of the variable
    itself (not of what tape._variables_override gives, which C++ does not
    ask: in TF 2.21 that asks the distribution strategy, 0.8 us a read);
    ReadVariableOp runs through the raw fast path and is recorded as TF's
    op callback would have seen it. Any other variable: v.value()."""
    if type(v) is not _ResourceVariable or v._caching_device is not None \
            or v._cached_value is not None:
        return v.value()
    graph = _get_default_graph()
    if hasattr(graph, "watch_variable"):
        graph.watch_variable(v)
    if v._trainable:
        _accessed(_current(), (v,), True)
    handle = v.handle
    dtype = v._dtype
    value = _RAW_FAST_PATH((context._context, "ReadVariableOp", None, handle,
                            "dtype", dtype))
    op_callback("ReadVariableOp", (handle,), ("dtype", dtype), [value])
    return value


def read_variables(tuple args):
    """Fast-path arguments with every Variable (also inside a list) replaced
    by its value read in Python, so the read is seen and recorded."""
    cdef list out = None
    cdef Py_ssize_t i
    for i in range(len(args)):
        a = args[i]
        if _is_variable(a):
            value = _read(a)
        elif (type(a) is list or type(a) is tuple) \
                and any([_is_variable(x) for x in a]):
            # (A tuple too, as the fast-path recorder reads them.)
            value = [_read(x) if _is_variable(x) else x for x in a]
        else:
            continue
        if out is None:
            out = list(args)
        out[i] = value
    return args if out is None else out


# -- recording from the fast path -------------------------------------------------
#
# TFE_Py_FastPathExecute(ctx, op_name, name, *inputs, *attr_name_value_pairs).
# While any op callback is registered, TF's C++ fast path builds, per op,
# Python objects for every inferred attr and a tuple of the converted inputs,
# and calls each callback (about +0.7 us per small op before the callback
# does anything). fasttape registers none: its wrapper of the fast path
# records the op itself, from the arguments and an OpDef layout cached per op
# type, building the attrs TF's callback would have been given:
# the non-inferred attrs as passed, then per input argument, in order, the
# attrs inferred from it (N and T of a homogeneous list, the type list of a
# heterogeneous one, T of a single input), dtypes as DataType enums.

cdef enum:
    _SINGLE = 0
    _NUMBER_LIST = 1
    _TYPE_LIST = 2
cdef Py_ssize_t _INPUT_START = 3


@cython.final
cdef class _Layout:
    """An op type's OpDef, as the fast-path recorder reads its arguments."""
    cdef Py_ssize_t n_in            # input arguments
    cdef tuple kinds                # per input argument: _SINGLE, _NUMBER_LIST, _TYPE_LIST
    cdef tuple type_attrs           # per input argument: its type attr, or None (fixed type)
    cdef tuple list_attrs           # per input argument: its number or type-list attr, or None
    cdef bint all_single            # no list inputs
    cdef Py_ssize_t n_typed         # input arguments with a type attr
    cdef tuple out_lists            # per output argument: a list?
    # Attrs of calls that pass none (all inferred from the inputs' dtypes:
    # Sin, AddV2, Tanh...), by those dtypes folded into one integer: one
    # tuple shared by all such ops of a dtype, not one per recorded op.
    cdef dict inferred_only

    def __init__(self, op_def):
        kinds, type_attrs, list_attrs = [], [], []
        for arg in op_def.input_arg:
            if arg.number_attr:
                kinds.append(_NUMBER_LIST)
                list_attrs.append(arg.number_attr)
            elif arg.type_list_attr:
                kinds.append(_TYPE_LIST)
                list_attrs.append(arg.type_list_attr)
            else:
                kinds.append(_SINGLE)
                list_attrs.append(None)
            type_attrs.append(arg.type_attr or None)
        self.n_in = len(kinds)
        self.kinds = tuple(kinds)
        self.type_attrs = tuple(type_attrs)
        self.list_attrs = tuple(list_attrs)
        self.all_single = all(k == _SINGLE for k in kinds)
        self.n_typed = sum(1 for t in type_attrs if t is not None)
        self.out_lists = tuple([bool(a.number_attr or a.type_list_attr)
                                for a in op_def.output_arg])
        self.inferred_only = {}


cdef dict _layouts = {}     # op type -> _Layout, or False (not in TF's registry)


cdef object _layout(op_name):
    layout = _layouts.get(op_name)
    if layout is None:
        op_def = op_def_registry.get(op_name) if type(op_name) is str else None
        layout = _Layout(op_def) if op_def is not None else False
        _layouts[op_name] = layout
    return layout


def clear_layouts():
    """Forget the cached OpDef layouts and saved-tensor masks
    (fasttape.clear_caches)."""
    _layouts.clear()
    _saved_masks.clear()


cdef inline bint _eager(t):
    return type(t) is _EagerTensor


def fast_path_execute(*args):
    """TFE_Py_FastPathExecute while a fasttape tape records somewhere. On a
    recording thread: Variables among the inputs are read here, where the
    read is seen (TF reads them inside C++, where nothing else would), and
    the op is recorded from its arguments once it has run."""
    cdef ThreadState st = _current()
    if not st.tapes and not st.accumulators:
        return _RAW_FAST_PATH(args)
    if _is_stopped():
        if st.tapes and args[1] == "StopGradient" \
                and len(args) > _INPUT_START:
            result = (_capture(st, args)
                      if _lineage_hook is not None and not st.in_callback
                      else _RAW_FAST_PATH(args))
            _note_stop_gradient(st, args[_INPUT_START], result)
            return result
        if _lineage_hook is not None and st.tapes and not st.in_callback:
            # explain_none: op_callback notes it as run while stopped.
            return _capture(st, args)
        return _RAW_FAST_PATH(args)
    op_name = args[1]
    layout = _layout(op_name)
    if layout is False:
        return _capture(st, read_variables(args))
    cdef _Layout lay = <_Layout>layout
    cdef Py_ssize_t n_in = lay.n_in, i
    if len(args) < _INPUT_START + n_in:
        return _RAW_FAST_PATH(args)    # TF raises its own error
    cdef list inputs = []
    cdef vector[int64_t] ids
    cdef bint converted = False         # some input TF's C++ will convert
    cdef list new_args = None
    cdef int kind
    ids.reserve(n_in)       # (one allocation for the usual op, not one per doubling)
    for i in range(n_in):
        a = args[_INPUT_START + i]
        kind = lay.kinds[i]
        if kind == _SINGLE:
            if not _eager(a):
                if _is_variable(a):
                    a = _read(a)
                    if new_args is None:
                        new_args = list(args)
                    new_args[_INPUT_START + i] = a
                else:
                    converted = True
                    continue
            inputs.append(a)
            ids.push_back(_id_of(a))
        elif type(a) is list or type(a) is tuple:
            if any([_is_variable(x) for x in a]):
                a = [_read(x) if _is_variable(x) else x for x in a]
                if new_args is None:
                    new_args = list(args)
                new_args[_INPUT_START + i] = a
            for x in a:
                if _eager(x):
                    inputs.append(x)
                    ids.push_back(_id_of(x))
                else:
                    converted = True
        else:
            converted = True            # TF converts it (or raises)
    if new_args is not None:
        args = tuple(new_args)
    if st.in_callback:
        return _RAW_FAST_PATH(args)
    # The tapes that track an input (asked once: _record_eager narrows
    # them to trainable inputs only where some input is not trainable).
    cdef list tapes = None
    cdef bint may
    if st.accumulators:
        may = _may_record(st, ids)
    else:
        tapes = _tapes_recording(st, ids, NULL)
        may = tapes is not None
    if not may:
        # (An input TF converts is a new tensor no tape watches.)
        if _lineage_hook is not None and st.tapes:
            # explain_none: the lineage notes every op this thread runs
            # while a tape records, recorded or not (op_callback does,
            # given the inputs TF converted).
            return _capture(st, args)
        return _RAW_FAST_PATH(args)
    if converted:
        return _capture(st, args)
    result = _RAW_FAST_PATH(args)
    cdef list outputs
    cdef tuple out_lists = lay.out_lists
    if len(out_lists) == 1:
        outputs = list(result) if out_lists[0] else [result]
    elif not out_lists:
        return result
    else:
        outputs = []
        for i in range(len(out_lists)):
            if out_lists[i]:
                outputs.extend(result[i])
            else:
                outputs.append(result[i])
    if not outputs:
        return result
    # One DataType enum per input: the inferred attrs and the trainable
    # test both read it.
    cdef vector[int] enums
    enums.reserve(len(inputs))
    for t in inputs:
        enums.push_back(tensor_enum(<object>t))
    st.in_callback = True
    try:
        if st.accumulators:
            _record(st, op_name, inputs, outputs, EAGER_OP,
                    _attrs(lay, args, enums), None, None, True, True,
                    [i for i in ids])
        else:
            _record_eager(st, lay, op_name, args, inputs, ids, enums, outputs,
                          tapes)
        if _lineage_hook is not None and st.tapes:
            _lineage_hook(st.tapes, op_name, inputs, outputs)
    finally:
        st.in_callback = False
    return result


cdef int _record_eager(ThreadState st, _Layout lay, op_name, tuple args,
                       list inputs, vector[int64_t]& ids, vector[int]& enums,
                       list outputs, list tapes) except -1:
    """_record for the fast path's common case, with no accumulator active:
    an eagerly run op, its ids held in C++, its dtypes read once (the
    trainable test and the attrs). ``tapes``: those that track one of its
    inputs, of any dtype (_tapes_recording(st, ids, NULL)), asked again
    only if some input's dtype is not trainable."""
    cdef vector[char] trainable
    cdef char flag
    cdef bint all_trainable = True
    cdef Py_ssize_t i, n_in = len(inputs), n_out = len(outputs)
    trainable.reserve(n_in)
    for i in range(n_in):
        if enums[i] == _VARIANT:
            flag = is_trainable(inputs[i])
        else:
            flag = _trainable_enum(enums[i])
        trainable.push_back(flag)   # (through a variable: see _core.should_record)
        if not flag:
            all_trainable = False
    if not all_trainable:
        tapes = _tapes_recording(st, ids, &trainable)
        if tapes is None:
            return 0
    in_mask, out_mask, mortal = _masks(op_name, n_in, n_out)
    payload = _eager_payload(_attrs(lay, args, enums), inputs, in_mask,
                             outputs, out_mask)
    _record_on_tapes(tapes, op_name, ids, inputs, outputs,
                     _output_metas(outputs, False), payload, mortal)
    return 0


cdef inline bint _tape_in_scope(ThreadState st, TapeState ts):
    # While an accumulator computes a JVP, only older tapes and those pushed
    # during the computation see its ops (see ThreadState).
    return ts.nesting_id < st.nesting_limit or ts.nesting_id > st.nesting_floor


cdef inline bint _acc_in_scope(ThreadState st, a):
    return a.nesting_id <= st.nesting_limit or a.nesting_id > st.nesting_floor


cdef list _tapes_recording(ThreadState st, vector[int64_t]& ids,
                           const vector[char]* trainable):
    """The active tapes in scope that track one of ``ids`` (of a trainable
    dtype, per ``trainable``; NULL: any), or None."""
    cdef list tapes = None
    cdef TapeState ts
    for tp in st.tapes:
        ts = <TapeState>tp
        if _tape_in_scope(st, ts) and ts.core.tracks_any(ids, trainable):
            if tapes is None:
                tapes = [ts]
            else:
                tapes.append(ts)
    return tapes


cdef tuple _output_metas(list outputs, bint accumulating):
    # A single-output op never needs zeros for a missing output gradient (it
    # runs only when its one output has a gradient), and a target's ones are
    # made from the target itself: skip the metadata then.
    if len(outputs) == 1 and not accumulating:
        return _NO_META
    return tuple([output_meta(t) for t in outputs])


cdef EagerOp _eager_payload(attrs, list inputs, in_mask, list outputs,
                            out_mask):
    cdef EagerOp payload = EagerOp.__new__(EagerOp)
    payload.attrs = (attrs if type(attrs) is tuple
                     else tuple(attrs) if attrs is not None else ())
    payload.saved = _keep(inputs, in_mask, outputs, out_mask)
    payload.num_inputs = len(inputs)
    # Attrs and tensors only: no reference cycle can pass through these, so
    # the garbage collector need not track them (nor, the core then decides,
    # the op's entry): two to three fewer tracked objects per recorded op.
    PyObject_GC_UnTrack(<PyObject*>payload.saved)
    return payload


cdef int _record_on_tapes(list tapes, op_type, vector[int64_t]& ids,
                          list inputs, list outputs, tuple meta, payload,
                          bint mortal) except -1:
    """Record the op on each tape, then tell anomaly mode. mortal: each tape
    forgets the op once its outputs all die unread (TF's EagerTensor dealloc
    calls DeleteTrace); else (the gradient reads an output, or graph
    tensors) it keeps it until the tape ends."""
    cdef vector[int64_t] out_ids
    out_ids.reserve(len(outputs))
    for t in outputs:
        out_ids.push_back(_id_of(t))
    objs = None
    cdef int64_t op_id, last
    cdef size_t k
    cdef list copies = None
    if mortal:
        if _tf_dealloc == NULL:
            objs = outputs      # (no death hook: a weakref on each)
        else:
            last = 0
            for k in range(out_ids.size()):
                if out_ids[k] > last:
                    last = out_ids[k]
            for tp in tapes:
                if not (<TapeState>tp).hearing:
                    _start_hearing(<TapeState>tp)
                if last > (<TapeState>tp).last_mortal_uid:
                    (<TapeState>tp).last_mortal_uid = last
    for tp in tapes:
        if (<TapeState>tp).core.consumed:
            # Its gradient was computed, on another thread, while this op
            # ran (the tapes were chosen before: a thread sharing its
            # recording state, see tests/test_traps.py): it records
            # nothing more, as TF's tape, gone from the tape set by then.
            continue
        if (<TapeState>tp).budget is None:
            op_id = (<TapeState>tp).core.record_ids(op_type, ids, out_ids, meta,
                                                    payload, objs)
        else:
            # A memory budget (recording._budget): one pointer test per tape
            # and op when there is none. It swaps the tensors it drops out
            # of its payloads: with other tapes recording the op, its own
            # copy, so theirs keep the tensors.
            own = payload
            if len(tapes) > 1 and type(payload) is EagerOp:
                own = EagerOp((<EagerOp>payload).attrs, (<EagerOp>payload).saved,
                              (<EagerOp>payload).num_inputs)
                if copies is None:
                    copies = []
                copies.append(own)
            op_id = (<TapeState>tp).core.record_ids(op_type, ids, out_ids, meta,
                                                    own, objs)
            (<TapeState>tp).budget.recorded(op_id, op_type, inputs, outputs,
                                            own)
    if _anomaly_hook is not None:
        # Anomaly mode (fasttape.anomaly): where in the user's code this op
        # ran. One C-level test per recorded op when off.
        _anomaly_hook(payload, op_type, inputs, outputs)
        if copies is not None:
            for own in copies:
                _anomaly_hook(own, op_type, inputs, outputs)
    return 0


cdef tuple _attrs(_Layout lay, tuple args, vector[int]& enums):
    """The attrs TF's C++ fast path gives its op callbacks (see
    RunCallbacks in pywrap_tfe_src.cc): the non-inferred ones as passed,
    then those inferred from each input argument. A recorded op keeps them
    until the tape ends: when they hold nothing the garbage collector
    tracks (names, numbers), neither is the tuple tracked (its passes over
    what a long forward pass records cost more than recording it)."""
    cdef tuple attrs = _inferred_attrs(lay, args, enums)
    for a in attrs:
        if PyObject_IS_GC(a) and PyObject_GC_IsTracked(a):
            return attrs
    PyObject_GC_UnTrack(<PyObject*>attrs)
    return attrs


cdef tuple _inferred_attrs_built(_Layout lay, tuple args, vector[int]& enums,
                                 Py_ssize_t given):
    """_inferred_attrs of an op with no list inputs: the ``given`` attrs
    passed, then each typed input's type attr and dtype."""
    cdef Py_ssize_t n_in = lay.n_in, i, k
    cdef Py_ssize_t start = _INPUT_START + n_in
    cdef tuple out = PyTuple_New(given + 2 * lay.n_typed)
    for i in range(given):
        v = args[start + i]
        Py_INCREF(v)
        PyTuple_SET_ITEM(out, i, v)
    k = given
    for i in range(n_in):
        name = lay.type_attrs[i]
        if name is not None:
            Py_INCREF(name)
            PyTuple_SET_ITEM(out, k, name)
            v = enums[i]
            Py_INCREF(v)
            PyTuple_SET_ITEM(out, k + 1, v)
            k += 2
    return out


cdef tuple _inferred_attrs(_Layout lay, tuple args, vector[int]& enums):
    cdef Py_ssize_t n_in = lay.n_in, i, n, k = 0
    cdef Py_ssize_t start = _INPUT_START + n_in, given
    cdef tuple out
    cdef int64_t folded
    if lay.all_single:
        given = len(args) - start
        if given == 0 and lay.n_typed <= 7:
            # Shared (see _Layout.inferred_only): a tuple kept per recorded
            # op counts towards the garbage collector's next collection
            # even untracked, and collections, each scanning the tensors
            # the tape keeps alive, were most of recording's cost.
            folded = lay.n_typed
            for i in range(n_in):
                if lay.type_attrs[i] is not None:
                    folded = (folded << 8) | (enums[i] & 0xff)
            out = lay.inferred_only.get(folded)
            if out is not None:
                return out
            out = _inferred_attrs_built(lay, args, enums, 0)
            if len(lay.inferred_only) < 64:
                lay.inferred_only[folded] = out
            return out
        return _inferred_attrs_built(lay, args, enums, given)
    attrs = list(args[_INPUT_START + n_in:])
    for i in range(n_in):
        kind = lay.kinds[i]
        name = lay.type_attrs[i]
        if kind == _SINGLE:
            if name is not None:
                attrs.append(name)
                attrs.append(enums[k])
            k += 1
            continue
        n = len(args[_INPUT_START + i])
        if kind == _NUMBER_LIST:
            attrs.append(lay.list_attrs[i])
            attrs.append(n)
            if n > 0 and name is not None:
                attrs.append(name)
                attrs.append(enums[k])
        else:
            attrs.append(lay.list_attrs[i])
            attrs.append(tuple([enums[j] for j in range(k, k + n)]))
        k += n
    return tuple(attrs)


cdef bint _may_record(ThreadState st, vector[int64_t]& ids) except -1:
    """Does some active tape or accumulator watch one of these inputs?
    (dtypes aside: _record checks them.)"""
    cdef TapeState ts
    for tp in st.tapes:
        ts = <TapeState>tp
        if _tape_in_scope(st, ts) and ts.core.tracks_any(ids, NULL):
            return True
    if not st.accumulators:
        return False
    id_list = [i for i in ids]
    for a in st.accumulators:
        if _acc_in_scope(st, a) \
                and (<ForwardAccumulatorCore>a.core).should_record(id_list, None):
            return True
    return False


cdef object _capture(ThreadState st, args):
    """Run a fast-path op whose inputs TF's C++ converts (Python numbers,
    NumPy arrays, sequences): the converted tensors are seen only by TF's
    op callbacks, so fasttape's is put in this thread's callback list for
    this one call. (MirroredStrategy's replica threads share the list: the
    callback acts only on the thread that put it there.)

    TF's C++ runs the callbacks last: the ops a forward accumulator of TF's
    runs for this op (zeros for inputs without a tangent, the JVP) come
    first. The callback takes only an eager op of this op's type (the JVP
    itself runs with capturing off: _recording._tf_jvp_dispatch), and a
    capture nested in those ops gives the outer one back when it ends."""
    callbacks = args[0].op_callbacks
    outer, outer_op = st.capturing, st.capture_op
    st.capturing = True
    st.capture_op = args[1]
    callbacks.append(_capture_callback)
    try:
        return _RAW_FAST_PATH(args)
    finally:
        st.capturing, st.capture_op = outer, outer_op
        for i in range(len(callbacks) - 1, -1, -1):
            if callbacks[i] is _capture_callback:
                del callbacks[i]
                break


def _capture_callback(op_type, inputs, attrs, outputs, op_name=None,
                      graph=None):
    cdef ThreadState st = _current()
    if not st.capturing or graph is not None \
            or _str(op_type) != st.capture_op:
        return None
    st.capturing = False
    return op_callback(op_type, inputs, attrs, outputs, op_name, graph)
