# cython: language_level=3
# distutils: language = c++
"""fasttape's tape core: reverse-mode tape, backprop loop, forward accumulator.

Scope: the bookkeeping of TensorFlow's ``tensorflow/c/eager/tape.h`` in
Cython, framework-agnostic. This module never imports a framework; every
tensor is an opaque Python object reached through a ``VSpace``, and every
tensor is named by an int64 id the caller supplies.

Terms (as in tape.h):
  tensor  a value named by a unique, never reused int64 id.
  op      one recorded operation: input ids -> output ids, plus an opaque
          backward payload the VSpace knows how to differentiate.
  target  a tensor being differentiated; source: one we differentiate by.
  watched a tensor the tape tracks although no recorded op produced it
          (its producer id is -1).

Only integers live in C++ containers; Python objects (op entries, gradients)
live in Python lists and dicts. Nothing here recurses, so tapes of millions
of ops work. The backward pass runs the ops, and so sums each tensor's
gradient contributions, in exactly the order TF's tape does (so results
agree with TF's bit for bit); nothing depends on Python's hashing, so that
order is the same run to run.
"""

cimport cython
from cython.operator cimport dereference as deref, preincrement as inc
from libc.stdint cimport int32_t, int64_t, intptr_t
from libcpp cimport bool as cbool
from libcpp.vector cimport vector
from libcpp.utility cimport pair
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from libcpp.algorithm cimport sort

import numpy as np

from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF

cdef extern from "Python.h":
    int PyObject_GC_IsTracked(object)
    void PyObject_GC_UnTrack(void*)
    void PyErr_Clear()
    # A new reference, or NULL with an exception set.
    PyObject* _new_weakref "PyWeakref_NewRef"(PyObject* ob, PyObject* callback)
    # The referent, borrowed; Py_None once it died.
    PyObject* _weakref_object "PyWeakref_GET_OBJECT"(PyObject* ref)
    ctypedef struct PyWeakReference:
        Py_hash_t hash
    ctypedef PyObject* (*PyCFunction)(PyObject*, PyObject*)
    ctypedef struct PyMethodDef:
        const char* ml_name
        PyCFunction ml_meth
        int ml_flags
        const char* ml_doc
    int METH_O
    PyObject* PyCFunction_NewEx(PyMethodDef* ml, PyObject* self, PyObject* module) except NULL

# A tape's death weakrefs carry their tensor's id in the weakref's hash
# cache (CPython's PyWeakReference.hash, -1 until hash() is first asked;
# tensor ids are >= 0). No map from weakref to id is then kept: at a
# hundred thousand recorded ops, that map's inserts cost more than the
# weakrefs did. The weakrefs are the tape's own (reached by nobody but
# weakref.getweakrefs), and an EagerTensor's hash() raises, so no hash a
# user could rely on is replaced.
cdef inline void _set_ref_tid(PyObject* ref, int64_t tid):
    (<PyWeakReference*>ref).hash = <Py_hash_t>tid

cdef inline int64_t _ref_tid(PyObject* ref):
    return <int64_t>(<PyWeakReference*>ref).hash

# The id a weakref is given once its death is applied: the tape may free it.
# (Only then: CPython clears an object's weakrefs before it calls their
# callbacks, and other callbacks, which may free the tape's dead weakrefs,
# can run in between; a weakref whose callback is still to come is kept.)
cdef int64_t _SPENT = -2

# Early aggregation thresholds of tape.h: more than this many pending
# gradients for one tensor, holding more than this many bytes, are summed at
# once to free memory.
cdef enum:
    MIN_AGGREGATE_COUNT = 4
    # An aggregate of at most this many gradients adds them left to right
    # (TF's AddN: aggregate_ops.h), so a running sum gives its bits.
    MAX_FOLDED = 9
cdef int64_t MIN_AGGREGATE_BYTES = 128 * 1024 * 1024


cdef class VSpace:
    """What the core needs from a framework. Subclass it in Python.

    Gradients and tangents are opaque objects; ``meta`` is whatever the
    framework stored per output at record time (shape, dtype, device...).
    """

    def __init__(self, none_ok_indices=None):
        self.none_ok_indices = dict(none_ok_indices or {})

    def num_elements(self, grad):
        """Number of elements of a gradient (early aggregation)."""
        raise NotImplementedError

    def element_size(self, grad):
        """Bytes per element of a gradient (early aggregation)."""
        return 4

    def aggregate(self, list grads):
        """Sum of a non-empty list of gradients for one tensor."""
        raise NotImplementedError

    def fold(self, list grads):
        """(Called only where fold_pending is set.) The sum of two or more
        gradients of one tensor that arrived so far, when summing them now
        and the rest later gives the bits of one aggregate of them all;
        None to keep them pending."""
        return None

    def call_backward(self, op_type, payload, list unneeded_indices,
                      list out_grads):
        """Input gradients of one op: a list, one entry (or None) per input.

        ``out_grads`` holds one gradient per output (None only at indices of
        ``none_ok_indices[op_type]``); gradients at ``unneeded_indices`` are
        not used and may be None.
        """
        raise NotImplementedError

    def ones_like(self, meta):
        raise NotImplementedError

    def zeros_like(self, meta):
        raise NotImplementedError

    def tensor_id(self, tensor):
        """The id under which ops that use ``tensor`` are recorded."""
        raise NotImplementedError

    def forward_rule(self, op_type, payload, list in_tangents, bint use_batch):
        """Output tangents of one op, or NotImplemented when no rule exists
        (the core then transposes the backward function). With use_batch,
        inputs without a tangent are None (unbatched zeros would have the
        wrong rank); the rule must treat them as zeros."""
        return NotImplemented

    def forwardprop_aid(self, meta):
        """The stand-in output gradient transposed by the forward fallback;
        its value does not matter, it must only be watchable."""
        return self.ones_like(meta)

    def transposable(self, grad):
        """A gradient the forward fallback transposes, or a tangent it seeds
        the transposition with, as a plain tensor
        whose id the inner tape knows (e.g. sparse gradients made dense).
        Runs while the inner tape records, so its ops are transposed too."""
        return grad

    def unbatch(self, tangent):
        """Split a batched tangent along its first axis (a list)."""
        raise NotImplementedError

    def batch(self, list tangents):
        """Stack per-example tangents along a new first axis."""
        raise NotImplementedError


# Freed entries are kept for reuse: an entry made from this list does not
# count towards the garbage collector's next collection (one made new
# does, even untracked), and a long forward pass under a tape triggered
# collections enough to run a full one, over every object of TF's, once
# every few hundred thousand recorded ops.
@cython.freelist(4096)
@cython.final
cdef class OpEntry:
    """One recorded op. Fields documented in _core.pxd."""

    @property
    def input_ids(self):
        return [i for i in self.input_ids]

    @property
    def output_ids(self):
        return [i for i in self.output_ids]


cdef inline void _fill(vector[int64_t]& dst, ids) except *:
    dst.clear()
    dst.reserve(len(ids))
    for i in ids:
        dst.push_back(i)


cdef inline int64_t _number(unordered_map[int64_t, int64_t]& number,
                            vector[int64_t]& order, int64_t tid) except -1:
    """tid's number in order of first appearance."""
    cdef unordered_map[int64_t, int64_t].iterator it = number.find(tid)
    if it != number.end():
        return deref(it).second
    cdef int64_t n = order.size()
    number[tid] = n
    order.push_back(tid)
    return n


@cython.final
cdef class _DeathWatch:
    """What the weakrefs a tape holds on its recorded outputs call back
    with (through _death_callback): the tape, by a raw pointer. Holds no
    Python reference, so it can be in no reference cycle."""


cdef object _output_died(object watch, object wr):
    """The weakref callback: the tape hears of its tensor's death as from
    a framework (delete_trace, which queues it while the tape is
    mid-operation). The weakref is spent: the tape may free it."""
    cdef PyObject* raw = (<_DeathWatch>watch).core
    if raw == NULL:
        return None
    cdef GradientTapeCore core = <GradientTapeCore>raw
    cdef PyObject* p = <PyObject*>wr
    cdef int64_t tid = _ref_tid(p)
    _set_ref_tid(p, _SPENT)
    core.spent_refs += 1
    core.delete_trace(tid)
    if (core.busy == 0 and core.spent_refs > 64
            and 2 * core.spent_refs > <Py_ssize_t>core.refs.size()):
        core._compact_refs()
    return None


# The callback is a builtin function of one argument bound to the tape's
# _DeathWatch: CPython calls it with no argument tuple and no argument
# parsing (an object's __call__ gets both), once per recorded output that
# dies: as often as an op is recorded, when outputs die unread.
cdef PyMethodDef _output_died_def
_output_died_def.ml_name = "fasttape_output_died"
_output_died_def.ml_meth = <PyCFunction>_output_died
_output_died_def.ml_flags = METH_O
_output_died_def.ml_doc = NULL


# The most entries the last recording tape's two maps held, capped: the
# next tape reserves as many at its first op. A training loop records about
# as much step after step, and growing two maps by rehashing from nothing
# at every step cost about a tenth of a long forward pass's recording (a
# 400-op chain whose outputs stay alive). Entries, not bucket counts (which
# never shrink, so a small tape after a large one would pass the large
# size on for good). Written without a lock: a race only mis-sizes a
# reservation.
cdef size_t _tape_size_hint = 0, _usage_size_hint = 0
cdef size_t _SIZE_HINT_MAX = 1 << 13     # about 64 KiB of buckets per map


def map_sizes(GradientTapeCore core):
    """(Tests) the bucket counts of ``core``'s two maps, the most entries
    each held, and the sizes the next tape will reserve."""
    return (core.tensor_tape.bucket_count(), core.tensor_usage.bucket_count(),
            core.peak_tape, core.peak_usage, _tape_size_hint, _usage_size_hint)


cdef class GradientTapeCore:
    """A reverse-mode tape: what was computed from what, and how to go back.

    ``watch`` marks a tensor as tracked; ``record_operation`` appends an op if
    any of its (trainable) inputs is tracked, and tracks its outputs;
    ``compute_gradient`` runs the backward pass.
    """

    def __cinit__(self, bint persistent=False):
        self.persistent = persistent
        self.op_tape = []
        self.next_op_id = 0
        self.live_ops = 0
        self.consumed = False
        self.death_watch = NULL
        self.death_callback = NULL
        self.busy = 0

    def __dealloc__(self):
        global _tape_size_hint, _usage_size_hint
        if self.next_op_id:     # (a tape that recorded: its size is the hint)
            _tape_size_hint = min(self.peak_tape, _SIZE_HINT_MAX)
            _usage_size_hint = min(self.peak_usage, _SIZE_HINT_MAX)
        # Cut the callback loose first: the weakrefs dropped below (and the
        # tensors freed after) must not reach a tape that is going.
        if self.death_watch != NULL:
            (<_DeathWatch>self.death_watch).core = NULL
        self._drop_death_refs()
        Py_XDECREF(self.death_callback)
        self.death_callback = NULL
        Py_XDECREF(self.death_watch)
        self.death_watch = NULL

    # -- recording ---------------------------------------------------------

    cpdef watch(self, int64_t tensor_id):
        # emplace: watching a recorded tensor keeps its producer.
        self.pruned_valid = False
        self.tensor_tape.insert((tensor_id, -1))

    cpdef bint is_watched(self, int64_t tensor_id):
        """True when the tape tracks the tensor (watched or recorded)."""
        return self.tensor_tape.find(tensor_id) != self.tensor_tape.end()

    cpdef bint should_record(self, input_ids, trainable=None):
        """True when some input is tracked and (per ``trainable``, one bool
        per input, all True when None) of a differentiable dtype."""
        cdef vector[int64_t] ids
        cdef vector[char] flags
        cdef char flag
        _fill(ids, input_ids)
        if trainable is None:
            return self.tracks_any(ids, NULL)
        for t in trainable:
            flag = 1 if t else 0    # (a literal in push_back: Cython 3 gets it wrong)
            flags.push_back(flag)
        return self.tracks_any(ids, &flags)

    cdef bint tracks_any(self, const vector[int64_t]& ids,
                         const vector[char]* trainable):
        """should_record for a recorder that holds its ids in C++ (trainable:
        one flag per id, or NULL for all)."""
        cdef size_t i
        for i in range(ids.size()):
            if self.tensor_tape.find(ids[i]) != self.tensor_tape.end() and (
                    trainable == NULL or deref(trainable)[i]):
                return True
        return False

    cpdef int64_t record_operation(self, op_type, input_ids, output_ids,
                                   tuple output_meta, payload,
                                   trainable=None, outputs=None) except -2:
        """Record one op; returns its op id, or -1 if nothing it reads is
        tracked. A later op that outputs the same id replaces the producer
        (last writer wins, as custom_gradient needs).

        outputs: None, or the output objects (one per output id). When
        given, the tape holds a weakref on each and, once one dies, calls
        delete_trace with its id (tape.h's DeleteTrace, which TF calls when
        an EagerTensor is deallocated): an op whose outputs all died and
        that no recorded op reads is forgotten, with what it saved.
        Objects that take no weakref, and None entries (the framework knows
        the output cannot die first: its op's payload holds it), are kept
        track of until the tape ends."""
        self._check_open()
        if not self.should_record(input_ids, trainable):
            return -1
        if len(output_meta) != len(output_ids):
            raise ValueError(
                f"record_operation({op_type!r}): {len(output_ids)} output ids "
                f"but {len(output_meta)} output metadata entries")
        cdef vector[int64_t] in_ids, out_ids
        _fill(in_ids, input_ids)
        _fill(out_ids, output_ids)
        return self.record_ids(op_type, in_ids, out_ids, output_meta, payload,
                               outputs)

    cdef int64_t record_ids(self, op_type, const vector[int64_t]& input_ids,
                            const vector[int64_t]& output_ids,
                            tuple output_meta, payload, outputs) except -2:
        """record_operation for a recorder that holds its ids in C++ and has
        checked should_record (tracks_any) itself."""
        cdef int64_t op_id
        self._check_open()
        # Busy: a tensor death (a weakref callback, run by the garbage
        # collector on an allocation below) is queued, not applied mid-way.
        self.busy += 1
        try:
            op_id = self._append(op_type, input_ids, output_ids, output_meta,
                                 payload, outputs)
        finally:
            self.busy -= 1
        if self.busy == 0 and self._deaths_pending():
            self._drain_deaths()
        return op_id

    cdef int _check_open(self) except -1:
        if self.consumed:
            raise RuntimeError(
                "This non-persistent tape has already computed its gradients; "
                "it records nothing more.")
        return 0

    cdef int64_t _append(self, op_type, const vector[int64_t]& input_ids,
                         const vector[int64_t]& output_ids,
                         tuple output_meta, payload, outputs) except -2:
        self.pruned_valid = False
        cdef OpEntry entry = OpEntry.__new__(OpEntry)
        entry.op_type = op_type
        entry.input_ids = input_ids
        entry.output_ids = output_ids
        entry.output_meta = output_meta
        entry.payload = payload
        if not PyObject_GC_IsTracked(payload):
            # A payload the garbage collector does not track declares it
            # can be in no reference cycle: neither can its entry, so the
            # collector need not see it (its passes over millions of
            # recorded objects cost more than recording them).
            PyObject_GC_UnTrack(<PyObject*>entry)
        cdef int64_t op_id = self.next_op_id
        if op_id == 0:      # (the first op: the maps sized as the last tape's)
            self.tensor_tape.reserve(_tape_size_hint)
            self.tensor_usage.reserve(_usage_size_hint)
        self.next_op_id += 1
        cdef int64_t tid
        cdef Py_ssize_t k, n = entry.output_ids.size()
        cdef pair[unordered_map[int64_t, int64_t].iterator, cbool] placed
        cdef bint produced
        if outputs is not None:
            outputs = self._death_watched(outputs, n)
        for tid in entry.input_ids:
            inc(self.tensor_usage[tid])
        for k in range(n):
            tid = entry.output_ids[k]
            placed = self.tensor_tape.insert((tid, op_id))
            produced = False
            if not placed.second:
                # Recorded again (as custom_gradient does): the last
                # producer wins, and an output that already has its
                # weakref gets no second (it must not die twice).
                produced = deref(placed.first).second != -1
                deref(placed.first).second = op_id
            if outputs is not None and not produced:
                self._watch_death(outputs[k], tid)
            self.tensor_usage[tid] = 1
        if self.tensor_tape.size() > self.peak_tape:
            self.peak_tape = self.tensor_tape.size()
        if self.tensor_usage.size() > self.peak_usage:
            self.peak_usage = self.tensor_usage.size()
        self.op_tape.append(entry)
        self.live_ops += 1
        return op_id

    # -- trace deletion on tensor death --------------------------------------

    cdef object _death_watched(self, outputs, Py_ssize_t n):
        """The output objects to hold a death weakref on, as a sequence of
        ``n`` (None if the framework gave another count: no weakrefs)."""
        cdef _DeathWatch dw
        if self.death_watch == NULL:
            dw = _DeathWatch.__new__(_DeathWatch)
            dw.core = <PyObject*>self
            self.death_callback = PyCFunction_NewEx(
                &_output_died_def, <PyObject*>dw, NULL)
            Py_INCREF(dw)
            self.death_watch = <PyObject*>dw
        if type(outputs) is not tuple and type(outputs) is not list:
            outputs = tuple(outputs)
        return outputs if len(outputs) == n else None

    cdef int _watch_death(self, obj, int64_t tid) except -1:
        """A weakref (callback: the tape's _DeathWatch) on a recorded
        output, unless it is None or takes none (then tracked until the
        tape ends)."""
        if obj is None:
            return 0
        cdef PyObject* p = _new_weakref(<PyObject*>obj, self.death_callback)
        if p == NULL:
            PyErr_Clear()
            return 0
        # (The weakref stays tracked by the garbage collector although it
        # can be in no cycle: the collector moves the weakrefs of a dying
        # cycle's objects through its own lists.)
        _set_ref_tid(p, tid)
        self.refs.push_back(p)
        return 0

    cdef int _drain_deaths(self) except -1:
        """Apply the deaths heard while the core was busy (delete_trace and
        the weakref callbacks queue them: they come on any thread, inside
        the garbage collector, or while this core is mid-operation); never
        during a backward pass. Freeing an op can free saved tensors and
        queue more deaths: drained until empty."""
        cdef vector[int64_t] ids
        cdef int64_t tid
        if self.op_tape is None:
            # Cleared by the garbage collector (the tape is in a dead
            # cycle): nothing left to forget.
            self._drop_death_refs()
            return 0
        self.busy += 1
        try:
            while not self.dead_ids.empty():
                ids.clear()
                ids.swap(self.dead_ids)
                for tid in ids:
                    self._delete_trace(tid)
        finally:
            self.busy -= 1
        return 0

    cdef void _compact_refs(self):
        """Free the weakrefs whose death was applied (once they are half of
        refs, so a tape whose outputs keep dying holds no more than about
        twice the weakrefs of its live outputs, and each is visited a
        bounded number of times). Only between drains."""
        cdef vector[PyObject*] dead
        cdef size_t i, n = 0
        cdef PyObject* p
        for i in range(self.refs.size()):
            p = self.refs[i]
            if _ref_tid(p) == _SPENT:
                dead.push_back(p)
            else:
                self.refs[n] = p
                n += 1
        self.refs.resize(n)
        self.spent_refs = 0
        for p in dead:
            Py_XDECREF(p)   # dead referents, callbacks run: none runs again

    cdef void _drop_death_refs(self):
        """Forget every weakref (their tensors' deaths no longer matter)."""
        cdef vector[PyObject*] refs
        refs.swap(self.refs)
        self.spent_refs = 0
        self.dead_ids.clear()
        for p in refs:
            Py_XDECREF(p)

    def collect_deaths(self):
        """Apply the pending tensor deaths now (they are otherwise applied
        at the next record, gradient or inspection); a no-op during a
        backward pass."""
        if self.busy == 0 and self._deaths_pending():
            self._drain_deaths()

    @property
    def num_watched_outputs(self):
        """Recorded outputs the tape holds a death weakref on."""
        return <Py_ssize_t>self.refs.size() - self.spent_refs

    def watched_ids(self):
        """Ids the tape tracks without a recorded producer (watched
        tensors and variable handles), ascending."""
        self.collect_deaths()
        cdef list out = []
        for kv in self.tensor_tape:
            if kv.second == -1:
                out.append(kv.first)
        out.sort()
        return out

    def watched_roots(self, int64_t tensor_id, int64_t limit, dict known):
        """The watched ids (producer -1) a tracked tensor is recorded from,
        as a frozenset; None when more than ``limit`` ops lie behind it.
        ``known``: tensor id -> its roots (or None), found by earlier walks,
        not walked again. (fasttape.explain notes this for a
        tf.stop_gradient: the ops behind its input may be forgotten by the
        time it explains.)"""
        self.collect_deaths()
        cdef unordered_set[int64_t] seen
        cdef vector[int64_t] stack
        cdef int64_t tid, op_id, walked = 0
        cdef unordered_map[int64_t, int64_t].iterator it
        cdef OpEntry entry
        roots = set()
        stack.push_back(tensor_id)
        seen.insert(tensor_id)
        while not stack.empty():
            tid = stack.back()
            stack.pop_back()
            if tid != tensor_id and tid in known:
                found = known[tid]
                if found is None:
                    return None
                roots |= found
                continue
            it = self.tensor_tape.find(tid)
            if it == self.tensor_tape.end():
                continue
            op_id = deref(it).second
            if op_id == -1:
                roots.add(tid)
                continue
            walked += 1
            if walked > limit:
                return None
            entry = self.op_tape[op_id]
            if entry is None:
                continue
            for tid in entry.input_ids:
                if seen.insert(tid).second:
                    stack.push_back(tid)
        return frozenset(roots)

    def live_outputs(self):
        """{tensor id: tensor} for the recorded outputs that are still
        alive and that the tape holds a death weakref on (for inspection:
        their shapes and dtypes)."""
        self.collect_deaths()
        cdef dict out = {}
        cdef PyObject* obj
        cdef size_t i
        # Busy: a death (the garbage collector, run by an allocation below)
        # is queued, so refs does not change under the loop.
        self.busy += 1
        try:
            for i in range(self.refs.size()):
                obj = _weakref_object(self.refs[i])
                if obj != <PyObject*>None:
                    out[_ref_tid(self.refs[i])] = <object>obj
        finally:
            self.busy -= 1
        self.collect_deaths()
        return out

    cpdef delete_trace(self, int64_t tensor_id):
        """The framework's tensor died (its last reference dropped): forget
        the ops that no live tensor depends on any more (tape.h's
        DeleteTrace, without recursion). For a framework that hears of
        deaths itself (TF's EagerTensor dealloc) instead of giving the
        outputs to record_operation. Called while the core is mid-operation
        (a death inside a backward pass, or inside another death), it is
        queued, and applied when the operation ends, as a weakref's is."""
        if self.busy:
            self.dead_ids.push_back(tensor_id)
            return
        self.busy += 1
        try:
            self._delete_trace(tensor_id)
        finally:
            self.busy -= 1
        if self._deaths_pending():
            self._drain_deaths()

    cdef bint _deaths_pending(self):
        return not self.dead_ids.empty()

    cdef int _delete_trace(self, int64_t tensor_id) except -1:
        if self.op_tape is None:
            return 0  # cleared by the garbage collector
        cdef vector[int64_t] stack
        cdef int64_t tid, op_id, out_id
        cdef unordered_map[int64_t, int64_t].iterator it
        cdef OpEntry entry
        cdef bint output_alive
        cdef int64_t dec
        stack.push_back(tensor_id)
        while not stack.empty():
            tid = stack.back()
            stack.pop_back()
            it = self.tensor_usage.find(tid)
            if it == self.tensor_usage.end():
                continue
            dec = deref(it).second - 1
            deref(it).second = dec
            if dec != 0:
                continue
            self.tensor_usage.erase(it)
            it = self.tensor_tape.find(tid)
            if it == self.tensor_tape.end():
                continue
            op_id = deref(it).second
            if op_id == -1:
                continue  # watched tensors stay watched
            self.pruned_valid = False
            self.tensor_tape.erase(it)
            entry = self.op_tape[op_id]
            if entry is None:
                continue
            output_alive = False
            for out_id in entry.output_ids:
                if self.tensor_usage.find(out_id) != self.tensor_usage.end():
                    output_alive = True
                    break
            if output_alive:
                continue
            for out_id in entry.input_ids:
                stack.push_back(out_id)
            self.live_ops -= 1
            # May free saved tensors: their deaths are queued (busy).
            self.op_tape[op_id] = None
        return 0

    # -- inspection --------------------------------------------------------

    @property
    def num_ops(self):
        """Ops currently held (recorded and not released)."""
        self.collect_deaths()
        return self.live_ops

    def op(self, int64_t op_id):
        """The OpEntry of an op id, or None once released."""
        if op_id < 0 or op_id >= self.next_op_id:
            raise IndexError(op_id)
        self.collect_deaths()
        return self.op_tape[op_id]

    def producer(self, int64_t tensor_id):
        """Op id that produced a tensor, -1 if only watched, None if unknown."""
        self.collect_deaths()
        it = self.tensor_tape.find(tensor_id)
        if it == self.tensor_tape.end():
            return None
        return deref(it).second

    def export_trace(self):
        """The live ops as NumPy int64 arrays (CSR edges), no per-element
        Python work beyond one pass:

        op_ids[k], op_type_index[k] (into op_types), input_offsets[k]..
        input_offsets[k+1] slice input_ids, likewise for outputs.
        """
        self.collect_deaths()
        self.busy += 1  # no op may go between the count and the copy
        try:
            return self._export_trace()
        finally:
            self.busy -= 1
            self.collect_deaths()

    def _export_trace(self):
        cdef Py_ssize_t n = self.live_ops, k = 0, n_in = 0, n_out = 0
        cdef OpEntry entry
        for entry in self.op_tape:
            if entry is not None:
                n_in += entry.input_ids.size()
                n_out += entry.output_ids.size()
        op_ids_a = np.empty(n, dtype=np.int64)
        type_a = np.empty(n, dtype=np.int64)
        in_off_a = np.empty(n + 1, dtype=np.int64)
        out_off_a = np.empty(n + 1, dtype=np.int64)
        in_a = np.empty(n_in, dtype=np.int64)
        out_a = np.empty(n_out, dtype=np.int64)
        cdef int64_t[::1] op_ids = op_ids_a, types = type_a
        cdef int64_t[::1] in_off = in_off_a, out_off = out_off_a
        cdef int64_t[::1] ins = in_a, outs = out_a
        cdef dict type_index = {}
        cdef list op_types = []
        cdef Py_ssize_t op_id = 0, pi = 0, po = 0
        cdef int64_t tid
        in_off[0] = 0
        out_off[0] = 0
        for op_id in range(self.next_op_id):
            entry = self.op_tape[op_id]
            if entry is None:
                continue
            t = type_index.get(entry.op_type)
            if t is None:
                t = len(op_types)
                type_index[entry.op_type] = t
                op_types.append(entry.op_type)
            op_ids[k] = op_id
            types[k] = t
            for tid in entry.input_ids:
                ins[pi] = tid
                pi += 1
            for tid in entry.output_ids:
                outs[po] = tid
                po += 1
            k += 1
            in_off[k] = pi
            out_off[k] = po
        return {"op_ids": op_ids_a, "op_type_index": type_a,
                "op_types": op_types, "input_offsets": in_off_a,
                "input_ids": in_a, "output_offsets": out_off_a,
                "output_ids": out_a}

    def _release_all(self):
        self.pruned_valid = False
        # The weakrefs first: the tensors freed below need no delete_trace.
        self._drop_death_refs()
        # The maps before the entries: the saved tensors freed with the
        # entries then find nothing to forget when their deaths are heard
        # (a framework's dealloc hook calling delete_trace), and a hook
        # that stops telling a core holding no op can stop at the first.
        self.tensor_tape.clear()
        self.tensor_usage.clear()
        self.live_ops = 0
        entries = self.op_tape
        self.op_tape = [None] * self.next_op_id
        entries = None

    # -- backprop ----------------------------------------------------------
    #
    # compute_gradient, as tape.h's ComputeGradient:
    # 1. Prepare. Walk back from the targets through the producers of their
    #    inputs (through sources too, as TF 2.21 does: a source computed
    #    from another source passes its gradient on) to find the reachable
    #    ops. Prune them to
    #    the ops that read, transitively, a tracked source: the others cannot
    #    change any result, nor the order in which the kept ones run (every
    #    reader of a kept op's output is kept, so when a kept op is ready
    #    does not depend on the others). Count, per tensor, how many pruned ops read it
    #    (tensor_usage_counts) and, per op, how many of its outputs are still
    #    awaiting gradients (op_missing_tensor).
    # 2. Initial stack: ops awaiting nothing (their outputs are only targets),
    #    in TF's order (see _tf_order).
    # 3. Initial gradients: the given output gradients, else ones for targets
    #    that a recorded op produced (or that are also sources).
    # 4. Loop: take the next op; sum each output's pending gradients, in the
    #    order they arrived, with the vspace's aggregate (zeros where an
    #    output got none, unless the op's gradient accepts None there; an op
    #    with no gradient at all is skipped); call its backward function,
    #    telling it which inputs need no gradient; push each input gradient;
    #    when a tensor's last reader is done, its producer loses one missing
    #    output, and an op missing none is queued. The order is TF's: its
    #    loop pops from the back of its stack but inserts newly ready ops at
    #    the front, so the initial ops run first and then the others, first
    #    ready first run (a queue). Pending lists for one tensor are summed
    #    early when they hold many large gradients (tape.h's thresholds);
    #    with a vspace that sets fold_pending (a memory budget's), also as
    #    they arrive where at most MAX_FOLDED can arrive in all (a running
    #    sum then has the bits of one aggregate at the end).
    # 5. Results: the summed gradient of each source, or None.
    # A non-persistent tape drops every backward payload as soon as it is
    # used (and the unreachable ones at once), so memory falls during the
    # pass.

    def compute_gradient(self, VSpace vspace, target_ids, source_ids,
                         sources_that_are_targets=None, output_gradients=None,
                         bint build_default_zeros=True, bint retain=False,
                         target_meta=None, bint all_watched=False):
        """Gradients of the targets w.r.t. each source: a list, None where a
        source is not connected.

        sources_that_are_targets: {tensor id: meta} for ids that are both, so
        an untracked target that is a source still gets ones.
        output_gradients: None, or one entry per target (None = ones).
        retain: keep the trace even on a non-persistent tape (several passes
        over one trace, as a Jacobian needs); ``release()`` ends it.
        target_meta: None, or per target the meta for its ones, used where
        the recorded output_meta entry is None (the framework may skip
        recording metadata that only a target would need).
        all_watched: run every op between the targets and any watched
        tensor, as TF's tape does, not only those that lead to a source
        (so that what TF's gradient functions would raise, on a bad
        output gradient say, is raised; the results are the same).
        """
        if self.consumed:
            raise RuntimeError(
                "A non-persistent GradientTape can only be used to compute one "
                "set of gradients (or jacobians)")
        cdef vector[int64_t] targets, sources
        _fill(targets, target_ids)
        _fill(sources, source_ids)
        if output_gradients is not None and len(output_gradients) != targets.size():
            raise ValueError(
                f"{len(output_gradients)} output gradients for "
                f"{targets.size()} targets")
        cdef bint keep = self.persistent or retain
        # Deaths so far are applied before the pass; those during it (payloads
        # released, tensors freed by the backward functions) wait for the
        # next drain: the pass must see the tape it started with.
        self.collect_deaths()
        if not keep:
            self.consumed = True
        self.busy += 1
        try:
            return self._compute(vspace, targets, sources,
                                 sources_that_are_targets or {},
                                 output_gradients, build_default_zeros, keep,
                                 target_meta, all_watched)
        finally:
            self.busy -= 1
            if not keep:
                self._release_all()
            elif self.busy == 0 and self._deaths_pending():
                self._drain_deaths()

    def release(self):
        """End a non-persistent tape kept alive by ``retain=True`` passes."""
        if not self.persistent:
            self.consumed = True
            self._release_all()

    def plan(self, target_ids, source_ids, bint all_watched=False):
        """What compute_gradient(targets, sources) would run, for callers that
        cache a compiled backward pass: ``(code, entries)``, or None on a
        consumed tape.

        entries: the pruned OpEntry objects, in op-id order.
        code: bytes of int64 values fixing everything else the pass depends
        on: per entry its input and output ids renumbered by first
        appearance (so repeated runs of one program give equal codes), then
        per renumbered tensor its producer (entry position, -1 watched,
        -2 untracked, -3 an op outside the pass), then the targets' and the
        sources' numbers, then, when several ops start the pass, their
        positions in the order TF's tape runs them (that order depends on
        their op ids, see _tf_order). Equal codes, with equal payloads up to their
        tensors' values, mean the same computation.
        """
        if self.consumed:
            return None
        self.collect_deaths()
        self.busy += 1  # no op may go while the pruned entries are read
        try:
            return self._plan(target_ids, source_ids, all_watched)
        finally:
            self.busy -= 1
            self.collect_deaths()

    def path(self, target_ids, source_ids, bint all_watched=False):
        """The ops between the sources and the targets, as compute_gradient
        would run them: ``(op ids in op-id order, set of tensor ids whose
        gradient matters)`` (the sources and the outputs of those ops)."""
        cdef vector[int64_t] targets, sources, op_list
        cdef unordered_set[int64_t] needed
        _fill(targets, target_ids)
        _fill(sources, source_ids)
        self.collect_deaths()
        self.busy += 1
        try:
            self._walk_path(targets, sources, op_list, needed, all_watched)
        finally:
            self.busy -= 1
            self.collect_deaths()
        return [op_id for op_id in op_list], {tid for tid in needed}

    def _plan(self, target_ids, source_ids, bint all_watched):
        cdef vector[int64_t] targets, sources, op_list, code, order
        cdef unordered_set[int64_t] needed
        _fill(targets, target_ids)
        _fill(sources, source_ids)
        self._prune(targets, sources, op_list, needed, all_watched)
        self.pruned_all_watched = all_watched
        self.pruned_targets = targets
        self.pruned_sources = sources
        self.pruned_ops = op_list
        self.pruned_needed.swap(needed)     # (not read below: no copy)
        self.pruned_valid = True
        cdef unordered_map[int64_t, int64_t] number
        # op id -> its place among the pruned ops, -1 outside (op ids are dense)
        cdef vector[int32_t] position = vector[int32_t](self.next_op_id, -1)
        number.reserve(4 * op_list.size() + 8)
        cdef unordered_map[int64_t, int64_t].iterator it
        cdef int64_t tid, op_id
        cdef size_t i
        cdef OpEntry entry
        cdef list entries = []
        for i in range(op_list.size()):
            position[op_list[i]] = i
        for op_id in op_list:
            entry = self.op_tape[op_id]
            entries.append(entry)
            code.push_back(entry.input_ids.size())
            code.push_back(entry.output_ids.size())
            for tid in entry.input_ids:
                code.push_back(_number(number, order, tid))
            for tid in entry.output_ids:
                code.push_back(_number(number, order, tid))
        code.push_back(-9)
        for tid in targets:
            code.push_back(_number(number, order, tid))
        code.push_back(-9)
        for tid in sources:
            code.push_back(_number(number, order, tid))
        code.push_back(-9)
        for tid in order:
            it = self.tensor_tape.find(tid)
            if it == self.tensor_tape.end():
                code.push_back(-2)
            elif deref(it).second == -1:
                code.push_back(-1)
            else:
                code.push_back(-3 if position[deref(it).second] < 0
                               else position[deref(it).second])
        # The order of the initial ops, when more than one: it depends on
        # their op ids (see _tf_order), which the numbering above hides.
        cdef vector[char] is_read = vector[char](order.size(), 0)
        cdef vector[int64_t] init
        cdef size_t pos = 0, k, n_in, n_out
        cdef bint ready
        for i in range(op_list.size()):
            n_in = code[pos]
            n_out = code[pos + 1]
            for k in range(n_in):
                is_read[code[pos + 2 + k]] = 1
            pos += 2 + n_in + n_out
        pos = 0
        for i in range(op_list.size()):
            n_in = code[pos]
            n_out = code[pos + 1]
            ready = True
            for k in range(n_out):
                if is_read[code[pos + 2 + n_in + k]]:
                    ready = False
                    break
            if ready:
                init.push_back(op_list[i])
            pos += 2 + n_in + n_out
        if init.size() > 1:
            self._tf_order(targets, init)
            code.push_back(-9)
            for op_id in init:
                code.push_back(position[op_id])
        cdef bytes out = (<char*>code.data())[:code.size() * sizeof(int64_t)]
        return out, entries

    cdef void _prune(self, vector[int64_t]& targets, vector[int64_t]& sources,
                     vector[int64_t]& op_list,
                     unordered_set[int64_t]& needed, bint all_watched) except *:
        """Step 1a-1b: the pruned ops in op-id order (op_list) and the tensors
        whose gradient matters (needed)."""
        if self.pruned_valid:
            # plan() just pruned for this pass: take its result, once.
            self.pruned_valid = False
            if (targets == self.pruned_targets and sources == self.pruned_sources
                    and all_watched == self.pruned_all_watched):
                op_list.swap(self.pruned_ops)
                needed.swap(self.pruned_needed)
                return
        self._walk_path(targets, sources, op_list, needed, all_watched)

    cdef void _walk_path(self, vector[int64_t]& targets, vector[int64_t]& sources,
                         vector[int64_t]& op_list, unordered_set[int64_t]& needed,
                         bint all_watched) except *:
        """The one walk over the ops between the sources and the targets
        (backprop's prune, path(), and so the diagnostics): op_list gets the
        recorded ops that lead to a target and read a source, transitively,
        in op-id order; needed the sources and those ops' outputs."""
        cdef int64_t tid, op_id, n_ops = self.next_op_id
        # 1a. Reachable ops (from targets), each producer found once per
        # edge (no set of tensors seen: an op reached again is skipped).
        cdef vector[char] reachable = vector[char](n_ops, 0)
        cdef vector[int64_t] reach_list
        cdef vector[int64_t] op_stack, tensor_stack
        cdef unordered_map[int64_t, int64_t].iterator it
        cdef OpEntry entry
        # An op's inputs come from ops recorded before it (smaller ids), but
        # for ops recorded out of order (record_operation called after a
        # reader of its outputs was recorded): then 1b walks the readers.
        cdef bint in_order = True
        for tid in targets:
            it = self.tensor_tape.find(tid)
            if it != self.tensor_tape.end() and deref(it).second != -1:
                op_stack.push_back(deref(it).second)
        while not op_stack.empty():
            op_id = op_stack.back()
            op_stack.pop_back()
            if reachable[op_id]:
                continue
            entry = self.op_tape[op_id]
            if entry is None:
                continue
            reachable[op_id] = 1
            reach_list.push_back(op_id)
            for tid in entry.input_ids:
                it = self.tensor_tape.find(tid)
                if it != self.tensor_tape.end() and deref(it).second != -1:
                    if deref(it).second >= op_id:
                        in_order = False
                    if not reachable[deref(it).second]:
                        op_stack.push_back(deref(it).second)
        sort(reach_list.begin(), reach_list.end())

        # 1b. Prune to ops that read a tracked source, transitively: a forward
        # walk over the reachable ops from the tracked sources.
        needed.reserve(2 * reach_list.size() + sources.size() + 8)
        # Every source, tracked or not: as in tape.h, the gradient of an op's
        # input is wanted if the input is tracked or is a source, so a source
        # that was never watched but is read by a recorded op still has its
        # gradient computed (and a bad output gradient raises as in TF); it
        # is dropped at the end (step 5 returns None for it).
        for tid in sources:
            if needed.count(tid) == 0:
                needed.insert(tid)
                tensor_stack.push_back(tid)
        if all_watched:
            it = self.tensor_tape.begin()
            while it != self.tensor_tape.end():
                if deref(it).second == -1 and needed.count(deref(it).first) == 0:
                    needed.insert(deref(it).first)
                    tensor_stack.push_back(deref(it).first)
                inc(it)
        if in_order:
            # Every reachable op after the producers of its inputs: one
            # sweep in op-id order finds the same ops as the walk below.
            for op_id in reach_list:
                entry = self.op_tape[op_id]
                for tid in entry.input_ids:
                    if needed.count(tid):
                        op_list.push_back(op_id)
                        for tid in entry.output_ids:
                            needed.insert(tid)
                        break
            return
        cdef vector[char] useful = vector[char](n_ops, 0)
        cdef unordered_map[int64_t, vector[int64_t]] readers
        for op_id in reach_list:
            entry = self.op_tape[op_id]
            for tid in entry.input_ids:
                readers[tid].push_back(op_id)
        cdef unordered_map[int64_t, vector[int64_t]].iterator rit
        while not tensor_stack.empty():
            tid = tensor_stack.back()
            tensor_stack.pop_back()
            rit = readers.find(tid)
            if rit == readers.end():
                continue
            for op_id in deref(rit).second:
                if useful[op_id]:
                    continue
                useful[op_id] = 1
                entry = self.op_tape[op_id]
                for tid in entry.output_ids:
                    if needed.count(tid) == 0:
                        needed.insert(tid)
                        tensor_stack.push_back(tid)

        for op_id in reach_list:
            if useful[op_id]:
                op_list.push_back(op_id)


    cdef int _tf_order(self, vector[int64_t]& targets,
                       vector[int64_t]& init) except -1:
        """Put the initial ops (more than one) in the order TF's tape runs
        them. tape.h's PrepareBackprop inserts every op reachable from the
        targets into a std::unordered_map, depth first from the last
        target; InitialStack lists the ready ones in that map's iteration
        order, and the loop pops from the back. The map is replayed here
        (same keys, same insertion order, the same C++ container), so the
        order is TF's and still independent of Python's hashing. Needs the
        entries, so it runs before a non-persistent pass releases them."""
        cdef unordered_map[int64_t, char] tf_ops   # TF's state.op_tape keys
        cdef unordered_set[int64_t] counted        # TF's tensor_usage_counts keys
        cdef unordered_set[int64_t] ready
        cdef vector[int64_t] stack = targets
        cdef unordered_map[int64_t, int64_t].iterator it
        cdef int64_t tid, op_id
        cdef OpEntry entry
        cdef size_t i
        while not stack.empty():
            tid = stack.back()
            stack.pop_back()
            it = self.tensor_tape.find(tid)
            if it == self.tensor_tape.end():
                continue
            op_id = deref(it).second
            if op_id == -1 or tf_ops.count(op_id):
                continue
            entry = self.op_tape[op_id]
            if entry is None:
                continue
            tf_ops[op_id] = 0
            for tid in entry.input_ids:
                if counted.insert(tid).second and self.tensor_tape.count(tid):
                    stack.push_back(tid)
        for op_id in init:
            ready.insert(op_id)
        init.clear()
        for kv in tf_ops:
            if ready.count(kv.first):
                init.push_back(kv.first)
        # Popped from the back: reverse, so the first to run comes first.
        for i in range(init.size() // 2):
            op_id = init[i]
            init[i] = init[init.size() - 1 - i]
            init[init.size() - 1 - i] = op_id
        return 0

    cdef list _compute(self, VSpace vspace, vector[int64_t]& targets,
                       vector[int64_t]& sources, dict sources_that_are_targets,
                       output_gradients, bint build_default_zeros, bint keep,
                       target_meta, bint all_watched):
        cdef unordered_set[int64_t] sources_set
        cdef int64_t tid, op_id, producer, n_ops = self.next_op_id
        cdef size_t i
        cdef unordered_map[int64_t, int64_t].iterator it
        cdef OpEntry entry
        for tid in sources:
            sources_set.insert(tid)
        cdef vector[int64_t] op_list
        cdef unordered_set[int64_t] needed  # tensors whose gradient matters
        self._prune(targets, sources, op_list, needed, all_watched)
        cdef dict ops = {}          # op id -> OpEntry, the pruned ops
        for op_id in op_list:
            ops[op_id] = self.op_tape[op_id]

        # 1c. Usage counts and missing outputs over the pruned ops.
        cdef unordered_map[int64_t, int64_t] usage_counts
        cdef unordered_map[int64_t, int64_t] op_missing_tensor
        for op_id in op_list:
            entry = ops[op_id]
            for tid in entry.input_ids:
                if inc(usage_counts[tid]) == 1:
                    it = self.tensor_tape.find(tid)
                    if it != self.tensor_tape.end() and deref(it).second != -1:
                        inc(op_missing_tensor[deref(it).second])

        # 2. Initial stack: in the order TF's tape pops it (see _tf_order).
        cdef vector[int64_t] op_stack
        for op_id in op_list:
            if op_missing_tensor.count(op_id) == 0:
                op_stack.push_back(op_id)
        if op_stack.size() > 1:
            self._tf_order(targets, op_stack)
        cdef size_t head = 0

        # 3. Initial gradients (before releasing: targets' producers may have
        # been pruned yet still give their meta for ones).
        cdef dict gradients = {}    # tensor id -> list of pending gradients
        cdef OpEntry producer_entry
        cdef size_t j
        for i in range(targets.size()):
            tid = targets[i]
            given = None if output_gradients is None else output_gradients[i]
            if given is not None:
                gradients.setdefault(tid, []).append(given)
                continue
            it = self.tensor_tape.find(tid)
            if it != self.tensor_tape.end() and deref(it).second != -1:
                producer_entry = self.op_tape[deref(it).second]
                if producer_entry is None:
                    raise RuntimeError(
                        "Internal state of the gradient tape is invalid: "
                        "failed to find operation producing a tensor")
                for j in range(producer_entry.output_ids.size()):
                    if producer_entry.output_ids[j] == tid:
                        meta = producer_entry.output_meta[j]
                        if meta is None and target_meta is not None:
                            meta = target_meta[i]
                        if meta is None:
                            raise ValueError(
                                "No metadata to build the initial gradient of "
                                f"target {tid}: record output_meta or pass "
                                "target_meta")
                        gradients.setdefault(tid, []).append(
                            vspace.ones_like(meta))
                        break
            elif tid in sources_that_are_targets:
                gradients.setdefault(tid, []).append(
                    vspace.ones_like(sources_that_are_targets[tid]))

        if not keep:
            # Only the pruned ops' payloads are needed from here on.
            self.op_tape = [None] * n_ops
            self.live_ops = 0


        # 4. The loop.
        cdef dict none_ok = vspace.none_ok_indices
        cdef unordered_map[int64_t, int64_t] gradients_size
        cdef unordered_map[int64_t, int64_t].iterator uit
        cdef bint fold = vspace.fold_pending
        cdef unordered_map[int64_t, int64_t] arrived  # (fold) gradients summed into pending
        cdef list out_grads, unneeded, in_grads, pending
        cdef bint any_nonzero
        cdef Py_ssize_t n_out, n_in, k
        cdef int64_t size
        while head < op_stack.size():
            op_id = op_stack[head]
            head += 1
            entry = ops.pop(op_id, None)
            if entry is None:
                continue
            n_out = entry.output_ids.size()
            n_in = entry.input_ids.size()
            out_grads = [None] * n_out
            any_nonzero = False
            zero_indices = None
            for k in range(n_out):
                tid = entry.output_ids[k]
                pending = gradients.get(tid)
                if pending is None:
                    if build_default_zeros:
                        accepts = none_ok.get(entry.op_type)
                        if accepts is None or k not in accepts:
                            if zero_indices is None:
                                zero_indices = []
                            zero_indices.append(k)
                    continue
                any_nonzero = True
                if len(pending) == 1:
                    grad = pending[0]
                else:
                    grad = vspace.aggregate(pending)
                if sources_set.count(tid):
                    pending[:] = [grad]
                else:
                    del gradients[tid]
                out_grads[k] = grad
            if any_nonzero:
                if zero_indices is not None:
                    for k in zero_indices:
                        out_grads[k] = vspace.zeros_like(entry.output_meta[k])
                unneeded = []
                for k in range(n_in):
                    if needed.count(entry.input_ids[k]) == 0:
                        unneeded.append(k)
                payload = entry.payload
                if not keep:
                    entry.payload = None
                in_grads = vspace.call_backward(entry.op_type, payload,
                                                unneeded, out_grads)
                del payload
                if in_grads is None or len(in_grads) != n_in:
                    raise ValueError(
                        f"The backward function of {entry.op_type!r} returned "
                        f"{'None' if in_grads is None else len(in_grads)} "
                        f"gradients for {n_in} inputs")
            else:
                if not keep:
                    entry.payload = None
                in_grads = None
            del out_grads
            for k in range(n_in):
                tid = entry.input_ids[k]
                if in_grads is not None and in_grads[k] is not None:
                    pending = gradients.get(tid)
                    if pending is None:
                        gradients[tid] = [in_grads[k]]
                        if fold:
                            arrived[tid] = 1
                    else:
                        pending.append(in_grads[k])
                        if fold and arrived.count(tid):
                            # A running sum where it gives the aggregate's
                            # bits: at most MAX_FOLDED gradients in all
                            # (those arrived and one per usage to come).
                            inc(arrived[tid])
                            uit = usage_counts.find(tid)
                            if uit != usage_counts.end() and \
                                    arrived[tid] + deref(uit).second - 1 <= MAX_FOLDED:
                                folded = vspace.fold(pending)
                                if folded is not None:
                                    pending[:] = [folded]
                        if len(pending) > MIN_AGGREGATE_COUNT:
                            uit = gradients_size.find(tid)
                            if uit == gradients_size.end():
                                size = (vspace.num_elements(pending[0]) *
                                        vspace.element_size(pending[0]))
                                gradients_size[tid] = size
                            else:
                                size = deref(uit).second
                            if len(pending) * size > MIN_AGGREGATE_BYTES:
                                pending[:] = [vspace.aggregate(pending)]
                uit = usage_counts.find(tid)
                if uit == usage_counts.end():
                    continue
                deref(uit).second = deref(uit).second - 1
                if deref(uit).second > 0:
                    continue
                it = self.tensor_tape.find(tid)
                if it == self.tensor_tape.end():
                    # Read by the tape but never tracked: nothing to return.
                    gradients.pop(tid, None)
                    continue
                producer = deref(it).second
                if producer == -1:
                    continue
                uit = op_missing_tensor.find(producer)
                if uit != op_missing_tensor.end():
                    deref(uit).second = deref(uit).second - 1
                    if deref(uit).second == 0:
                        # TF inserts it at the bottom of its stack: first
                        # ready, first run, after the whole initial stack.
                        op_stack.push_back(producer)
            in_grads = None

        # 5. Results.
        cdef list result = []
        for tid in sources:
            pending = gradients.get(tid)
            if pending is None:
                result.append(None)
            else:
                if len(pending) > 1:
                    pending[:] = [vspace.aggregate(pending)]
                result.append(pending[0])
        return result


cdef class ForwardAccumulatorCore:
    """Forward mode (tape.h's ForwardAccumulator): a tangent per tracked id.

    For each op that reads a tensor with a tangent, ``accumulate`` computes
    the outputs' tangents with the VSpace's forward rule or, lacking one, by
    transposing the op's backward function: run it on stand-in output
    gradients under an inner tape, then take the gradient of its result
    w.r.t. those stand-ins with the input tangents as output gradients
    (the "double backward" trick, tape.h's ForwardpropFromTape).

    ``call_state`` is a stack of [inner backward tape or None, accumulating]:
    while accumulating, the ops a rule runs are not accumulated again by this
    accumulator (outer accumulators see them: that is how nesting gives
    higher orders); while an inner tape is set, ops go to that tape.
    """

    def __cinit__(self, VSpace vspace, bint use_batch=False):
        self.vspace = vspace
        self.use_batch = use_batch
        self.accumulated = {}
        self.call_state = [[None, False]]

    def watch(self, int64_t tensor_id, tangent):
        """Start tracking a tensor with a tangent; a second tangent for the
        same id is added to the first."""
        existing = self.accumulated.get(tensor_id)
        if existing is None:
            self.accumulated[tensor_id] = tangent
        else:
            self.accumulated[tensor_id] = self.vspace.aggregate([tangent, existing])

    def fetch_jvp(self, int64_t tensor_id):
        """The tangent of a tensor, or None if it has none."""
        return self.accumulated.get(tensor_id)

    def delete_gradient(self, int64_t tensor_id):
        self.accumulated.pop(tensor_id, None)

    def __len__(self):
        return len(self.accumulated)

    # call_state is indexed from the front: release builds compile with
    # wraparound off, where [-1] on a typed list reads out of bounds.
    cpdef bint busy_accumulating(self):
        return self.call_state[len(self.call_state) - 1][1]

    def push_state(self):
        """Enter a fresh state: not busy, no inner tape, so ops run from
        inside a rule are accumulated again until pop_state (TF's
        ForwardAccumulator.PushState, used while building functions)."""
        self.call_state.append([None, False])

    def pop_state(self):
        if len(self.call_state) == 1:
            raise RuntimeError("pop_state without a matching push_state")
        self.call_state.pop()

    cpdef bint should_record(self, input_ids, trainable=None):
        cdef list top = self.call_state[len(self.call_state) - 1]
        if top[0] is not None:
            # As tape.h: accumulate() hands the op to that inner tape, so
            # that tape decides.
            return (<GradientTapeCore>top[0]).should_record(input_ids, trainable)
        if top[1]:
            return False
        cdef dict acc = self.accumulated
        cdef Py_ssize_t i = 0
        for tid in input_ids:
            if tid in acc and (trainable is None or trainable[i]):
                return True
            i += 1
        return False

    def accumulate(self, op_type, input_ids, tuple input_meta, output_ids,
                   tuple output_meta, payload, trainable=None):
        """An op ran: compute the tangents of its outputs.

        input_meta: per input, what zeros_like needs (an input without a
        tangent but of a trainable dtype gets zeros, as in TF).
        Returns True when something was recorded or accumulated.
        """
        cdef list top = self.call_state[len(self.call_state) - 1]
        cdef GradientTapeCore inner = top[0]
        if inner is not None:
            # A fallback transposition is running this op: it belongs to the
            # inner tape, not to the tangents.
            return inner.record_operation(op_type, input_ids, output_ids,
                                          output_meta, payload, trainable) >= 0
        if not self.should_record(input_ids, trainable):
            return False
        cdef list in_tangents = []
        cdef list own_tangents = []  # None where in_tangents has made-up zeros
        cdef Py_ssize_t i = 0
        cdef dict acc = self.accumulated
        for tid in input_ids:
            t = acc.get(tid)
            own_tangents.append(t)
            if t is None and (trainable is None or trainable[i]):
                t = self.vspace.zeros_like(input_meta[i])
            in_tangents.append(t)
            i += 1
        self.call_state.append([None, True])
        try:
            # Batched, made-up zeros would lack the batch dimension: rules
            # get None there too and fill per example (see VSpace).
            out_tangents = self.vspace.forward_rule(
                op_type, payload, own_tangents if self.use_batch else in_tangents,
                self.use_batch)
            if out_tangents is NotImplemented:
                # Batched, the made-up zeros have no batch dimension: unbatching
                # them would split the wrong axis. A zero tangent adds nothing
                # to the transposed map, so the fallback skips them instead.
                out_tangents = self._forward_from_backward(
                    op_type, payload, output_meta,
                    own_tangents if self.use_batch else in_tangents)
        finally:
            self.call_state.pop()
        if len(out_tangents) != len(output_ids):
            raise ValueError(
                f"The forward rule of {op_type!r} returned {len(out_tangents)} "
                f"tangents for {len(output_ids)} outputs")
        i = 0
        for tid in output_ids:
            t = out_tangents[i]
            # First tangent wins: recompute_grad re-records the same outputs.
            if t is not None and tid not in acc:
                acc[tid] = t
            i += 1
        return True

    cdef list _forward_from_backward(self, op_type, payload, tuple output_meta,
                                     list in_tangents):
        if not self.use_batch:
            return self._transpose(op_type, payload, output_meta, in_tangents)
        # One transposition per example of the batch, then restacked.
        cdef Py_ssize_t n_out = len(output_meta), b, n_batch = -1
        split = []
        for t in in_tangents:
            if t is None:
                split.append(None)
            else:
                parts = self.vspace.unbatch(t)
                n_batch = len(parts)
                split.append(parts)
        if n_batch < 0:
            return [None] * n_out
        per_example = []
        for b in range(n_batch):
            per_example.append(self._transpose(
                op_type, payload, output_meta,
                [None if s is None else s[b] for s in split]))
        cdef list result = []
        for k in range(n_out):
            col = [row[k] for row in per_example]
            if any(c is None for c in col):
                result.append(None)
            else:
                result.append(self.vspace.batch(col))
        return result

    cdef list _transpose(self, op_type, payload, tuple output_meta,
                         list in_tangents):
        cdef VSpace vspace = self.vspace
        cdef GradientTapeCore tape = GradientTapeCore(False)
        cdef list aids = [vspace.forwardprop_aid(m) for m in output_meta]
        cdef list aid_ids = [vspace.tensor_id(a) for a in aids]
        for a in aid_ids:
            tape.watch(a)
        cdef list top = self.call_state[len(self.call_state) - 1]
        top[0] = tape
        try:
            grads = vspace.call_backward(op_type, payload, [], list(aids))
            grads = [None if g is None else vspace.transposable(g)
                     for g in grads]
        finally:
            top[0] = None
        cdef list targets = [], used = []
        for k in range(len(grads)):
            if grads[k] is None or in_tangents[k] is None:
                continue
            targets.append(vspace.tensor_id(grads[k]))
            # made dense too: a gradient function under the inner tape may
            # not take an IndexedSlices gradient (TanhGrad's, say)
            used.append(vspace.transposable(in_tangents[k]))
        if not targets:
            return [None] * len(output_meta)
        # Zeros for missing output gradients, as TF's Python JVP helper gets
        # from tape.gradient (backward functions of tf.function calls need
        # them).
        return tape.compute_gradient(vspace, targets, aid_ids, None, used, True)
