# cython: language_level=3
# distutils: language = c++
"""What a recorded op keeps for its backward pass (EagerOp, GraphOp,
PyBackward), and what a compiled backward pass depends on besides tensor
values (backward_signature, bake_slot).

The recorder (fasttape.recording._callback) builds these payloads; the
vector space and the compiled backward (this layer) read them. They live
here, below the recorder, so that imports run one way.
"""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.framework import dtypes, ops

cimport cython
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy
from libcpp.vector cimport vector

from fasttape._core cimport OpEntry

cdef object _EagerTensor = ops.EagerTensor

# -- an eager tensor's dtype enum and shape, read through TF's C methods ------
#
# EagerTensor's class tree defines __getattr__ (Tensor's), so each
# attribute read on a tensor goes through Python's slow getattr hook: a
# third to three quarters of the cost of x._datatype_enum() and
# x._shape_tuple(). Their C functions, found in their method descriptors
# at import, are called directly instead (each is METH_NOARGS; where one
# is not, the method is called as usual).

cdef extern from *:
    """
    typedef PyObject* (*ft_noargs_fn)(PyObject*, PyObject*);
    static ft_noargs_fn ft_noargs_of(PyObject* desc) {
        if (desc == NULL || Py_TYPE(desc) != &PyMethodDescr_Type)
            return NULL;
        PyMethodDef* m = ((PyMethodDescrObject*)desc)->d_method;
        if ((m->ml_flags & (METH_VARARGS | METH_KEYWORDS | METH_NOARGS | METH_O
                            | METH_FASTCALL | METH_METHOD)) != METH_NOARGS)
            return NULL;
        return (ft_noargs_fn)(void(*)(void))m->ml_meth;
    }
    """
    ctypedef object (*ft_noargs_fn)(object, PyObject*)
    ft_noargs_fn ft_noargs_of(PyObject* desc)

# (The class keeps its descriptors, and they their C functions.)
cdef object _descr = (<type>_EagerTensor).__dict__.get("_datatype_enum")
cdef ft_noargs_fn _DTYPE_ENUM_FN = ft_noargs_of(<PyObject*>_descr)
_descr = (<type>_EagerTensor).__dict__.get("_shape_tuple")
cdef ft_noargs_fn _SHAPE_TUPLE_FN = ft_noargs_of(<PyObject*>_descr)
_descr = None


cdef int tensor_enum(x) except? -1:
    """x._datatype_enum() of an EagerTensor x (type(x) is EagerTensor)."""
    if _DTYPE_ENUM_FN != NULL:
        return _DTYPE_ENUM_FN(x, NULL)
    return x._datatype_enum()


cdef object tensor_shape(x):
    """x._shape_tuple() of an EagerTensor x (type(x) is EagerTensor)."""
    if _SHAPE_TUPLE_FN != NULL:
        return _SHAPE_TUPLE_FN(x, NULL)
    return x._shape_tuple()


def fast_tensor_reads():
    """Which of tensor_enum and tensor_shape call TF's C functions
    directly (for tests)."""
    return _DTYPE_ENUM_FN != NULL, _SHAPE_TUPLE_FN != NULL

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

cdef int _INT32 = 3
cdef int _INT64 = 9
MAX_BAKED_ELEMENTS = 32
# Ops whose gradients call back into Python: kept eager.
cdef frozenset _NEVER_COMPILED = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})

cdef object _DType = dtypes.DType
# id -> type enum of each interned DType (the module keeps them alive, so
# their ids are stable); another DType's enum is read from it.
cdef dict _DTYPE_ENUMS = {id(d): d.as_datatype_enum
                          for d in getattr(dtypes, "_INTERN_TABLE", {}).values()}  # pylint: disable=protected-access

# A signature's words (int64): each item opens with a tag, and what varies
# in length gives its length, so one sequence of words reads back one way
# only (equal words, equal signatures).
cdef enum:
    _T_NONE = -1
    _T_STR = -2
    _T_BYTES = -3
    _T_INT = -4
    _T_BOOL = -5
    _T_FLOAT = -6
    _T_DTYPE = -7
    _T_SEQ = -8
    _T_EXTRA = -9      # a value kept as itself in ``extras`` (its index)
    _T_TENSOR = -10
    _T_BAKED = -11
    _T_HOOK = -12      # slot_hook's description, in ``extras`` (their count after it)


@cython.final
cdef class Signature:
    """What a backward pass depends on besides tensor values, as
    backward_signature describes it: words, plus the values that are no
    names, numbers, DTypes, bytes or sequences of them (``extras``,
    compared as Python objects). Hashed once, as it is built; equal when
    the words (one memcmp) and the extras are."""

    cdef readonly bytes words
    cdef readonly tuple extras
    cdef Py_hash_t _hash

    def __hash__(self):
        if self.extras:     # (TypeError: an extra that cannot be a key)
            return hash((self._hash, self.extras))
        return self._hash

    def __eq__(self, other):
        if self is other:
            return True
        if type(other) is not Signature:
            return NotImplemented
        cdef Signature o = <Signature>other
        return (self._hash == o._hash and self.words == o.words
                and self.extras == o.extras)


cdef inline void _put_bytes(vector[int64_t]& w, int64_t tag, const char* p,
                            Py_ssize_t n):
    w.push_back(tag)
    w.push_back(n)
    cdef size_t at = w.size()
    w.resize(at + <size_t>((n + 7) // 8), 0)    # (zero padding)
    if n:
        memcpy(&w[at], p, n)


cdef inline void _put_extra(vector[int64_t]& w, list extras, v):
    w.push_back(_T_EXTRA)
    w.push_back(len(extras))
    extras.append(v)


cdef int _put_value(vector[int64_t]& w, list extras, v) except -1:
    """One value (an attr, an op type): names, numbers, bools, None,
    DTypes, bytes and sequences of them as words; anything else in
    ``extras``."""
    cdef type t = type(v)
    cdef Py_ssize_t n
    cdef const char* p
    cdef double d
    cdef tuple seq
    if t is str:
        try:
            p = PyUnicode_AsUTF8AndSize(v, &n)
        except UnicodeError:        # (a lone surrogate)
            _put_extra(w, extras, v)
            return 0
        _put_bytes(w, _T_STR, p, n)
    elif t is bool:
        w.push_back(_T_BOOL)
        n = 1 if v is True else 0
        w.push_back(n)
    elif t is int:
        try:
            n = v
        except OverflowError:
            _put_extra(w, extras, v)
            return 0
        w.push_back(_T_INT)
        w.push_back(n)
    elif v is None:
        w.push_back(_T_NONE)
    elif t is _DType:
        e = _DTYPE_ENUMS.get(id(v))
        n = e if e is not None else v.as_datatype_enum
        w.push_back(_T_DTYPE)
        w.push_back(n)
    elif t is float:
        d = v
        w.push_back(_T_FLOAT)
        w.push_back((<int64_t*>&d)[0])
    elif t is tuple or t is list:     # (a list attr is written as its tuple)
        seq = <tuple>v if t is tuple else tuple(<list>v)
        w.push_back(_T_SEQ)
        w.push_back(len(seq))
        for x in seq:
            _put_value(w, extras, x)
    elif t is bytes:
        _put_bytes(w, _T_BYTES, <const char*>(<bytes>v), len(<bytes>v))
    else:
        _put_extra(w, extras, v)
    return 0


cdef inline int _put_shape(vector[int64_t]& w, list extras, shape) except -1:
    # An eager tensor's shape: a tuple of ints (anything else, as a value).
    if type(shape) is not tuple:
        return _put_value(w, extras, shape)
    w.push_back(len(<tuple>shape))
    for d in <tuple>shape:
        if type(d) is int:
            w.push_back(<int64_t>d)
        else:
            _put_extra(w, extras, d)
    return 0


cdef Py_hash_t _hash_words(const int64_t* w, size_t n) noexcept:
    cdef uint64_t h = 0x9E3779B97F4A7C15ULL ^ n
    cdef size_t i
    for i in range(n):
        h = (h ^ <uint64_t>w[i]) * 0x100000001B3ULL
        h ^= h >> 29
    cdef Py_hash_t r = <Py_hash_t>(h >> 1)
    return -2 if r == -1 else r


def words_hash(bytes b):
    """A fast hash of ``b``, whose length is a multiple of 8 (a plan's
    code: thousands of words, new at every step, which Python's hash would
    read through SipHash)."""
    return _hash_words(<const int64_t*><const char*>b, len(b) // 8)


# The words' buffer, kept from one signature to the next: a few KiB, new at
# every gradient call, which malloc served slowly (a large chunk: thousands
# of instructions). A call takes it (swap), and gives it back at the end;
# one made meanwhile (a slot_hook's) finds none and allocates its own.
cdef vector[int64_t] _words_kept
cdef size_t _WORDS_KEPT_MAX = 1 << 17


def backward_signature(list entries, dict config_inputs, config_inputs_of,
                       list slots=None, slot_hook=None):
    """For the pruned entries of a backward pass (GradientTapeCore.plan):
    ``(signature, feeds)``, or None where the pass cannot be compiled (a
    payload other than an eagerly run op, an output whose zeros need a
    tensor, a variant tensor, or an op whose gradient calls Python).

    signature (a Signature): per entry its op type, attrs, output metas
    and number of saved slots, then per slot the dtype and shape of the
    saved tensor (None where the gradient reads none): everything but
    tensor values, as words in C++ (no Python object per item: hashing and
    comparing thousands of them at every lookup, and the garbage
    collector's passes over them, cost more than the loop). feeds: the
    saved tensors, in order.

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
    marker of a dropped tensor); it appends what describes x (hashable
    objects) to the list ``sig`` and returns True, or returns False (the
    pass is then not compiled). Such an item is no feed.
    """
    cdef vector[int64_t] w
    cdef list extras = [], feeds = []
    cdef EagerOp p
    cdef Py_ssize_t k, i = -1
    cdef bytes baked
    w.swap(_words_kept)     # (a buffer of kept capacity: see _words_kept)
    w.clear()
    w.reserve(16 * len(entries) + 16)
    for entry in entries:
        i += 1
        if type(entry) is OpEntry:      # (the core's: its fields directly)
            payload = (<OpEntry>entry).payload
            op_type = (<OpEntry>entry).op_type
            metas = (<OpEntry>entry).output_meta
        else:
            payload, op_type = entry.payload, entry.op_type
            metas = entry.output_meta
        if type(payload) is not EagerOp:
            return None
        p = <EagerOp>payload
        if op_type in _NEVER_COMPILED:
            return None
        _put_value(w, extras, op_type)
        _put_value(w, extras, p.attrs)
        w.push_back(len(metas))
        for meta in metas:
            if meta is None:
                w.push_back(_T_NONE)
            elif type(meta) is not tuple:
                return None
            else:
                _put_value(w, extras, meta)
        w.push_back(len(p.saved))
        configs = config_inputs.get(op_type)
        if configs is None:
            configs = config_inputs_of(op_type)
        k = 0
        for x in p.saved:
            if x is None:
                w.push_back(_T_NONE)
                k += 1
                continue
            if type(x) is not _EagerTensor:
                if slot_hook is None or not slot_hook(
                        i, k, op_type, p.num_inputs, x, extras):
                    return None
                w.push_back(_T_HOOK)
                w.push_back(len(extras))
                k += 1
                continue
            enum = tensor_enum(x)
            if enum == _VARIANT:
                return None
            w.push_back(_T_TENSOR)
            w.push_back(<int64_t>enum)
            _put_shape(w, extras, tensor_shape(x))
            if configs and _bake(configs, k, p.num_inputs, x, enum):
                baked = x.numpy().tobytes()
                _put_bytes(w, _T_BAKED, <const char*>baked, len(baked))
            else:
                feeds.append(x)
                if slots is not None:
                    slots.append((i, k))
            k += 1
    cdef Signature sig = Signature.__new__(Signature)
    sig.words = (<char*>w.data())[:w.size() * sizeof(int64_t)]
    sig.extras = tuple(extras)
    sig._hash = _hash_words(w.data(), w.size())
    if w.capacity() <= _WORDS_KEPT_MAX:
        _words_kept.swap(w)
    return sig, feeds


cdef inline bint _bake(configs, Py_ssize_t k, Py_ssize_t n_in, x,
                       int enum) except -1:
    return ((enum == _INT32 or enum == _INT64) and k < n_in
            and (k in configs or (k - n_in) in configs)
            and x._num_elements() <= MAX_BAKED_ELEMENTS)


def bake_slot(configs, Py_ssize_t k, Py_ssize_t n_in, x):
    """Is saved slot k (x) of an op with n_in inputs baked into the
    compiled pass as a constant?"""
    return bool(configs) and _bake(configs, k, n_in, x, x._datatype_enum())
