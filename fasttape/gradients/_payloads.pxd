# The backward payloads, declared for the recorder's cimport (it fills an
# EagerOp's fields directly; see _payloads.pyx).
cimport cython


@cython.no_gc
cdef class EagerOp:
    cdef readonly tuple attrs
    cdef public tuple saved             # inputs then outputs (a memory budget swaps
                                        # dropped ones for recipes: recording._budget)
    cdef readonly Py_ssize_t num_inputs
    cdef object __weakref__


cdef class GraphOp:
    cdef readonly object op
    cdef readonly Py_ssize_t num_inputs
    cdef object __weakref__


cdef class PyBackward:
    cdef readonly object fn, forward
    cdef readonly Py_ssize_t num_inputs
    cdef object __weakref__


# An EagerTensor's _datatype_enum() and _shape_tuple(), by TF's C functions
# (see _payloads.pyx).
cdef int tensor_enum(x) except? -1
cdef object tensor_shape(x)
