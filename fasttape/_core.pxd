# cython: language_level=3
# distutils: language = c++
"""Layout of fasttape's framework-agnostic tape (see _core.pyx for the prose).

Terms, as in TensorFlow's tape.h:
  tensor  an opaque value the framework identifies by a unique int64 id.
  op      one recorded operation: input ids -> output ids, plus the payload
          the VSpace needs to run its backward function.
  target  a tensor we differentiate; source: a tensor we differentiate by.
C++ containers hold integers only; Python objects live in Python containers.
"""

from libc.stdint cimport int64_t, intptr_t
from cpython.object cimport PyObject
from libcpp.vector cimport vector
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set


cdef class VSpace:
    cdef public dict none_ok_indices   # op_type -> frozenset of output indices whose grad may be None
    cdef public bint fold_pending      # sum a tensor's gradients as they arrive (vspace.fold), where that sums as one aggregate would


cdef class OpEntry:
    cdef readonly object op_type        # the framework's op name (str)
    cdef vector[int64_t] input_ids      # ids of the op's inputs, in order
    cdef vector[int64_t] output_ids     # ids of the op's outputs, in order
    cdef readonly tuple output_meta     # per output: what ones_like/zeros_like need (or None)
    cdef public object payload          # opaque backward payload; dropped once used (non-persistent)


cdef class _DeathWatch:
    # The weakref callback of a tape's recorded outputs. Points at its tape
    # without owning it (the tape owns the weakrefs, which own this), and is
    # cut loose when the tape goes.
    cdef PyObject* core


cdef class GradientTapeCore:
    cdef readonly bint persistent       # keep payloads after compute_gradient
    cdef unordered_map[int64_t, int64_t] tensor_tape  # tensor id -> producing op id (-1: watched)
    cdef unordered_map[int64_t, int64_t] tensor_usage # tensor id -> live uses (delete_trace)
    cdef list op_tape                   # op id -> OpEntry, or None once released
    cdef int64_t next_op_id             # dense op ids: the next op's id
    cdef int64_t live_ops               # entries of op_tape that are not None
    cdef readonly bint consumed         # a non-persistent tape that has computed once
    # The pruning plan() last did, reused once by the pass that follows it
    # (cleared whenever the tape changes).
    cdef bint pruned_valid, pruned_all_watched
    cdef vector[int64_t] pruned_targets, pruned_sources, pruned_ops
    cdef unordered_set[int64_t] pruned_needed
    # Trace deletion (tape.h's DeleteTrace on tensor death): the framework
    # calls delete_trace, or, given the output objects, the tape holds a
    # weakref on each whose callback does. A death heard while the core is
    # mid-operation (deaths come on any thread, inside the garbage
    # collector, or in the middle of a core method) is queued, and applied
    # when the core is between operations and no backward pass runs.
    cdef PyObject* death_watch    # owned _DeathWatch, or NULL (raw: kept through tp_clear)
    cdef PyObject* death_callback # owned: the weakrefs' callback, bound to death_watch
    cdef vector[PyObject*] refs         # owned weakrefs, each carrying its tensor id (_ref_tid)
    cdef Py_ssize_t spent_refs          # entries of refs whose tensor died and was drained
    cdef vector[int64_t] dead_ids       # deaths heard while busy (delete_trace, weakrefs), not yet drained
    cdef int busy                                         # >0: in a pass or a drain
    cdef size_t peak_tape, peak_usage   # the most entries tensor_tape and tensor_usage held (the next tape's reservation)

    cpdef watch(self, int64_t tensor_id)
    cpdef bint is_watched(self, int64_t tensor_id)
    cpdef bint should_record(self, input_ids, trainable=*)
    cpdef int64_t record_operation(self, op_type, input_ids, output_ids,
                                   tuple output_meta, payload, trainable=*,
                                   outputs=*) except -2
    cpdef delete_trace(self, int64_t tensor_id)
    cdef int _delete_trace(self, int64_t tensor_id) except -1
    cdef bint tracks_any(self, const vector[int64_t]& ids,
                         const vector[char]* trainable)
    cdef int64_t record_ids(self, op_type, const vector[int64_t]& input_ids,
                            const vector[int64_t]& output_ids,
                            tuple output_meta, payload, outputs) except -2
    cdef int _check_open(self) except -1
    cdef int64_t _append(self, op_type, const vector[int64_t]& input_ids,
                         const vector[int64_t]& output_ids,
                         tuple output_meta, payload, outputs) except -2
    cdef object _death_watched(self, outputs, Py_ssize_t n)
    cdef int _watch_death(self, obj, int64_t tid) except -1
    cdef int _drain_deaths(self) except -1
    cdef bint _deaths_pending(self)
    cdef void _drop_death_refs(self)
    cdef void _compact_refs(self)
    cdef void _prune(self, vector[int64_t]& targets, vector[int64_t]& sources,
                     vector[int64_t]& op_list,
                     unordered_set[int64_t]& needed, bint all_watched) except *
    cdef void _walk_path(self, vector[int64_t]& targets, vector[int64_t]& sources,
                         vector[int64_t]& op_list,
                         unordered_set[int64_t]& needed, bint all_watched) except *
    cdef int _tf_order(self, vector[int64_t]& targets,
                       vector[int64_t]& init) except -1
    cdef list _compute(self, VSpace vspace, vector[int64_t]& targets,
                       vector[int64_t]& sources, dict sources_that_are_targets,
                       output_gradients, bint build_default_zeros, bint keep,
                       target_meta, bint all_watched)


cdef class ForwardAccumulatorCore:
    cdef readonly VSpace vspace         # makes zeros/ones, runs rules and backward functions
    cdef readonly bint use_batch        # tangents carry a leading batch dimension
    cdef dict accumulated               # tensor id -> tangent
    cdef list call_state                # stack of [backward_tape or None, accumulating]

    cpdef bint busy_accumulating(self)
    cpdef bint should_record(self, input_ids, trainable=*)
    cdef list _forward_from_backward(self, op_type, payload, tuple output_meta,
                                     list in_tangents)
    cdef list _transpose(self, op_type, payload, tuple output_meta,
                         list in_tangents)
