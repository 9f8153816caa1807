# cython: language_level=3
# distutils: language = c++
"""What a recorded op keeps for its backward pass (EagerOp, GraphOp,
PyBackward), and what a compiled backward pass depends on besides tensor
values (backward_signature, bake_slot).

The recorder (fasttape.recording._callback) builds these payloads; the
vector space and the compiled backward (this layer) read them. They live
here, below the recorder, so that imports run one way.
"""
import gc as _gc

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.framework import ops

cimport cython

cdef object _EagerTensor = ops.EagerTensor
cdef int _VARIANT = 21

# -- backward payloads (what a recorded op keeps for its backward pass) --------

@cython.no_gc
cdef class EagerOp:
    """An op run eagerly: its attrs and the inputs/outputs its gradient reads
    (None in place of the others), kept in one tuple: few objects per
    recorded op means fewer garbage-collector passes while recording.
    (Attrs and tensors only: no reference cycle can pass through it, so the
    garbage collector never tracks it, nor, the core then decides, the
    op's entry.)"""

    def __init__(self, attrs, tuple saved, Py_ssize_t num_inputs):
        # (The fast-path recorder makes them with EagerOp.__new__ and sets
        # the fields itself: no argument parsing.)
        self.attrs = tuple(attrs) if attrs is not None else ()
        self.saved = saved
        self.num_inputs = num_inputs

    @property
    def inputs(self):
        return self.saved[:self.num_inputs]

    @property
    def outputs(self):
        return self.saved[self.num_inputs:]


cdef class GraphOp:
    """An op built while tracing: the real tf.Operation."""

    def __cinit__(self, op, Py_ssize_t num_inputs):
        self.op = op
        self.num_inputs = num_inputs


cdef class PyBackward:
    """A backward function recorded through record.record_operation, and
    the forward (tangent) function TF gave with it, if any."""

    def __cinit__(self, fn, Py_ssize_t num_inputs, forward=None):
        self.fn = fn
        self.num_inputs = num_inputs
        self.forward = forward


# -- compiled backward: what a recorded pass depends on besides tensor values --

cdef object _hashable(value):
    """Attr values as dict keys: lists (shapes, strides) become tuples."""
    if isinstance(value, (list, tuple)):
        return tuple([_hashable(v) for v in value])
    return value


cdef int _INT32 = 3
cdef int _INT64 = 9
MAX_BAKED_ELEMENTS = 32
# Ops whose gradients call back into Python: kept eager.
cdef frozenset _NEVER_COMPILED = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})


def backward_signature(list entries, dict config_inputs, config_inputs_of,
                       list slots=None, slot_hook=None):
    """For the pruned entries of a backward pass (GradientTapeCore.plan):
    ``(signature, feeds)``, or None where the pass cannot be compiled (a
    payload other than an eagerly run op, an output whose zeros need a
    tensor, a variant tensor, or an op whose gradient calls Python).

    signature: a flat tuple of, per entry, its op type, attrs, output metas
    and number of saved slots, then per slot the dtype and shape of the
    saved tensor (None where the gradient reads none): everything but
    tensor values. Flat, to allocate few objects (the garbage collector's
    passes cost more than the loop). feeds: the saved tensors, in order.

    Configuration inputs (config_inputs: op type -> input indices, negative
    ones counted from the end; config_inputs_of(op_type) fills it): small integer
    tensors such as an axis, a shape or a permutation. Eager gradient
    functions read their values (tensor_util.constant_value), so they are
    baked into the compiled pass as constants (``bake_slot`` says which),
    and their values are part of the signature instead of a feed.

    ``slots`` (a list): where each feed is, (entry index, slot), is
    appended to it.

    ``slot_hook(i, k, op_type, num_inputs, x, sig)``: called for a saved
    item x that is neither None nor an eager tensor (a memory budget's
    marker of a dropped tensor); it appends what describes x to ``sig`` and
    returns True, or returns False (the pass is then not compiled). Such an
    item is no feed.
    """
    cdef list sig = [], feeds = []
    cdef EagerOp p
    cdef Py_ssize_t k, i = -1
    gc_was_enabled = _gc.isenabled()
    _gc.disable()
    try:
        for entry in entries:
            i += 1
            payload = entry.payload
            if type(payload) is not EagerOp:
                return None
            p = <EagerOp>payload
            metas = entry.output_meta
            for meta in metas:
                if meta is not None and type(meta) is not tuple:
                    return None
            attrs = p.attrs
            try:
                hash(attrs)
            except TypeError:
                attrs = _hashable(attrs)
            op_type = entry.op_type
            if op_type in _NEVER_COMPILED:
                return None
            sig.append(op_type)
            sig.append(attrs)
            sig.append(metas)
            sig.append(len(p.saved))
            configs = config_inputs.get(op_type)
            if configs is None:
                configs = config_inputs_of(op_type)
            k = 0
            for x in p.saved:
                if x is None:
                    sig.append(None)
                    k += 1
                    continue
                if type(x) is not _EagerTensor:
                    if slot_hook is None or not slot_hook(
                            i, k, op_type, p.num_inputs, x, sig):
                        return None
                    k += 1
                    continue
                enum = x._datatype_enum()
                if enum == _VARIANT:
                    return None
                sig.append(enum)
                sig.append(x._shape_tuple())
                if configs and _bake(configs, k, p.num_inputs, x, enum):
                    sig.append(x.numpy().tobytes())
                else:
                    feeds.append(x)
                    if slots is not None:
                        slots.append((i, k))
                k += 1
        return tuple(sig), feeds
    finally:
        if gc_was_enabled:
            _gc.enable()


cdef inline bint _bake(configs, Py_ssize_t k, Py_ssize_t n_in, x,
                       int enum) except -1:
    return ((enum == _INT32 or enum == _INT64) and k < n_in
            and (k in configs or (k - n_in) in configs)
            and x._num_elements() <= MAX_BAKED_ELEMENTS)


def bake_slot(configs, Py_ssize_t k, Py_ssize_t n_in, x):
    """Is saved slot k (x) of an op with n_in inputs baked into the
    compiled pass as a constant?"""
    return bool(configs) and _bake(configs, k, n_in, x, x._datatype_enum())
