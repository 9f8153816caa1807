"""The TensorFlow "vector space": how the core's opaque gradients are made,
summed and propagated with TF's own registered gradient functions.

Payloads recorded per op (built in _recording):
  EagerOp   an op run eagerly: attrs, and only the inputs/outputs its
            gradient function reads (the rest are None, so memory is freed
            as TF's exclusion tables free it).
  GraphOp   an op built while tracing a tf.function: the real tf.Operation
            (a mock op from AttrValue protos gives wrong gradients).
  PyBackward a backward function recorded through record.record_operation
            (custom_gradient, tf.function calls, copies, captures).

Output metadata (what ones/zeros need) is a (shape, dtype enum) tuple for
eager tensors, or the tensor itself for graph tensors, resources and
variants.
"""

import re
import sys
import time

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.eager import backprop
from tensorflow.python.eager import context
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import errors_impl
from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import array_ops_stack
from tensorflow.python.ops import default_gradient

from fasttape.gradients._payloads import EagerOp, GraphOp, PyBackward
from fasttape._core import VSpace
from fasttape.gradients._fast_grads import FAST_GRADS, REAL_FLOAT_ENUMS
from fasttape.gradients._jvp_rules import JVP_RULES, OpView

# Output indices whose gradient may be None rather than zeros (tape.h's
# FunctionsAcceptingNoneForIndicesMap).
NONE_OK_INDICES = {
    "SoftmaxCrossEntropyWithLogits": frozenset({1}),
    "SparseSoftmaxCrossEntropyWithLogits": frozenset({1}),
    "FusedBatchNorm": frozenset({1, 2, 3, 4}),
    "FusedBatchNormV2": frozenset({1, 2, 3, 4}),
    "FusedBatchNormV3": frozenset({1, 2, 3, 4, 5}),
}

_DIFFERENTIABLE = frozenset({dtypes.float16, dtypes.bfloat16, dtypes.float32,
                             dtypes.float64, dtypes.complex64, dtypes.complex128})
_RESOURCE = dtypes.resource
_VARIANT = dtypes.variant
_STRING = dtypes.string


# -- the vspace ---------------------------------------------------------------

_MockOp = backprop._MockOp  # pylint: disable=protected-access
_tf_zeros = backprop._zeros  # pylint: disable=protected-access
_fast_fill = backprop._fast_fill  # pylint: disable=protected-access


_named = {}


def _named_backward(op_type):
    """A function called ``backward_<op_type>`` that runs one op's backward."""
    fn = _named.get(op_type)
    if fn is None:
        def fn(vspace, payload, unneeded_indices, out_grads):
            return vspace._call_backward(op_type, payload, unneeded_indices,  # pylint: disable=protected-access
                                         out_grads)
        name = "backward_" + re.sub(r"\W", "_", op_type)
        fn.__code__ = fn.__code__.replace(co_name=name, co_qualname=name)
        fn.__name__ = fn.__qualname__ = name
        _named[op_type] = fn
    return fn


def _never_recording():
    return False


_UNSIZED = (dtypes.resource, dtypes.variant, dtypes.string)


_size_by_enum = {}   # DataType enum -> bytes per element (0: unsized)


def nbytes(t):
    """Bytes of an eager tensor's buffer: the one byte counter (the tape
    summary's and the bench's). 0 for resources, variants and strings,
    whose buffers hold handles or pointers, not their data."""
    # (By the dtype's enum: comparing DType objects costs about 2 us a
    # tensor, and the memory budget counts every tensor it records.)
    return element_size(t) * t._num_elements()  # pylint: disable=protected-access


def element_size(t):
    """Bytes per element of an eager tensor's buffer (0: see nbytes)."""
    enum = t._datatype_enum()  # pylint: disable=protected-access
    size = _size_by_enum.get(enum)
    if size is None:
        dtype = dtypes.as_dtype(enum)
        size = 0 if dtype in _UNSIZED else dtype.size
        _size_by_enum[enum] = size
    return size


class TFVSpace(VSpace):
    """Calls TF's registered gradients; makes ones/zeros on the right device.

    ``is_recording()`` says whether any tape or accumulator would record the
    backward pass's own ops; only when none does are the fast rules used.
    """

    def __init__(self, is_recording=_never_recording):
        super().__init__(NONE_OK_INDICES)
        self._ones_cache = context._EagerTensorCache()  # pylint: disable=protected-access
        self._is_recording = is_recording
        self.use_fast_rules = True
        self.profile_stats = None  # op_type -> [count, seconds], see profiler
        # Anomaly mode (fasttape.detect_anomaly): f(op_type, payload,
        # unneeded_indices, grads) -> grads, run on every backward function's
        # result; the compiled backward declines a pass while it is set.
        self.check_gradients = None

    def _fast(self, op_type, payload, unneeded_indices, out_grads):
        """Output of the fast rule, or None where TF's function must run."""
        rule = FAST_GRADS.get(op_type)
        if (rule is None or not self.use_fast_rules
                or not context.executing_eagerly() or self._is_recording()):
            return None
        for g in out_grads:
            if g is not None and (type(g) is not ops.EagerTensor or
                                  g._datatype_enum() not in REAL_FLOAT_ENUMS):  # pylint: disable=protected-access
                return None
        try:
            return rule(payload, out_grads, unneeded_indices)
        except Exception:  # pylint: disable=broad-except
            # Unusual attrs, a dropped input, a fallback-only kernel: TF's
            # function decides (and raises the user-facing error if any).
            return None

    def num_elements(self, grad):
        return backprop._num_elements(grad)  # pylint: disable=protected-access

    def element_size(self, grad):
        # tape.h counts 4 bytes per element whatever the dtype: the same
        # count makes early aggregation sum the same groups as TF's tape,
        # so the summation order (and the last bits) are TF's.
        return 4

    def aggregate(self, grads):
        return backprop._aggregate_grads(grads)  # pylint: disable=protected-access

    def tensor_id(self, tensor):
        return tensor._id  # pylint: disable=protected-access

    def _fill(self, meta, value, cache=True):
        if not isinstance(meta, tuple):
            t = meta
            if t.dtype == _STRING:
                return None
            if t.dtype == _RESOURCE:
                if value == 0:
                    # As TF's PyTapeTensor::ZerosLike: gradient functions of
                    # ops that return resources accept None (a handle
                    # without handle data has no zeros to make).
                    return None
                return default_gradient.ones_like(t)
            return (array_ops.zeros_like(t) if value == 0
                    else array_ops.ones_like(t))
        # As TF's vspace: made on the current device (the scope of the
        # gradient() call), not on the device of the tensor they stand for.
        shape, dtype = meta
        dtype = dtypes.as_dtype(dtype)
        if dtype == _STRING or (dtype == _RESOURCE and value == 0):
            return None
        if value == 0 and cache:
            # TF's own zeros (backprop._zeros): cached in the context's
            # zeros cache (at most 256 entries of up to 10,000 elements),
            # which context._clear_caches() empties.
            return _tf_zeros(shape, dtype)
        if dtype.is_bool:
            value = bool(value)
        if not context.executing_eagerly():
            # Backprop traced inside a graph (jacobian's pfor, tf.function).
            return array_ops.fill(shape, array_ops.constant(value, dtype))
        if not cache:
            return _fast_fill(value, shape, dtype)
        # Ones (the initial gradient of every target): TF makes them afresh
        # each time; fasttape keeps them within the bounds of TF's zeros
        # cache (an _EagerTensorCache: 256 entries, 10,000 elements each),
        # emptied by context._clear_caches() and fasttape.clear_caches().
        key = (shape, dtype, context.context().device_name)
        ones = self._ones_cache
        cached = ones.get(key)
        if cached is None:
            cached = _fast_fill(value, shape, dtype)
            ones.put(key, cached)
        return cached

    def clear_caches(self):
        """Drop every cached tensor (the ones)."""
        self._ones_cache.flush()

    def ones_like(self, meta):
        return self._fill(meta, 1)

    def zeros_like(self, meta):
        return self._fill(meta, 0)

    def call_backward(self, op_type, payload, unneeded_indices, out_grads):
        stats = self.profile_stats
        check = self.check_gradients
        if stats is None and check is None and sys.getprofile() is None:
            return self._call_backward(op_type, payload, unneeded_indices,
                                       out_grads)
        if stats is None and sys.getprofile() is None:
            grads = self._call_backward(op_type, payload, unneeded_indices,
                                        out_grads)
            return grads if grads is None else check(
                op_type, payload, unneeded_indices, list(grads))
        # Profiling: go through a function named after the op type, so that
        # cProfile lists the backward pass per op type, and time it.
        fn = _named_backward(op_type)
        t0 = time.perf_counter()
        grads = fn(self, payload, unneeded_indices, out_grads)
        if stats is not None:
            entry = stats.get(op_type)
            if entry is None:
                stats[op_type] = entry = [0, 0.0]
            entry[0] += 1
            entry[1] += time.perf_counter() - t0
        if check is not None and grads is not None:
            grads = check(op_type, payload, unneeded_indices, list(grads))
        return grads

    def _call_backward(self, op_type, payload, unneeded_indices, out_grads):
        n = payload.num_inputs
        cls = type(payload)
        if cls is EagerOp:
            grads = self._fast(op_type, payload, unneeded_indices, out_grads)
            if grads is not None:
                return grads
            fn = ops._gradient_registry.lookup(op_type)  # pylint: disable=protected-access
            if fn is None:
                return [None] * n
            mock = _MockOp(payload.attrs, payload.inputs, payload.outputs,
                           op_type, tuple(unneeded_indices))
            if context.executing_eagerly():
                grads = fn(mock, *out_grads)
            else:
                with ops.name_scope("gradient_tape/"):
                    grads = fn(mock, *out_grads)
        elif cls is GraphOp:
            op = payload.op
            fn = ops.get_gradient_function(op)
            if fn is None:
                # NotDifferentiable, or registered as None.
                try:
                    ops._gradient_registry.lookup(op.type)  # pylint: disable=protected-access
                except LookupError:
                    if not op._gradient_function:  # pylint: disable=protected-access
                        raise
                return [None] * n
            with ops.name_scope("gradient_tape/"):
                grads = fn(op, *out_grads)
        else:
            grads = payload.fn(*out_grads)
        if grads is None or isinstance(grads, (tensor_lib.Tensor,
                                               indexed_slices.IndexedSlices)):
            grads = [grads]
        grads = list(grads)
        if len(grads) != n:
            # TF tolerates gradient functions that return extra Nones.
            if len(grads) > n and all(g is None for g in grads[n:]):
                grads = grads[:n]
            else:
                # TF's tape (tape.h), its type and words (also when there
                # are too many).
                raise errors_impl.InternalError(
                    None, None,
                    f"Recorded operation {op_type!r} returned too few "
                    f"gradients. Expected {n} but received {len(grads)}")
        return grads

    def forwardprop_aid(self, meta):
        # Never cached: each aid must be a distinct tensor (its id is watched).
        if not isinstance(meta, tuple) and meta.dtype == _VARIANT:
            return self._fill(meta, 0, cache=False)
        return self._fill(meta, 1, cache=False)

    def forward_rule(self, op_type, payload, in_tangents, use_batch):
        cls = type(payload)
        if cls is PyBackward:
            if payload.forward is None:
                return NotImplemented
            fn = lambda t: list(payload.forward(*t))  # noqa: E731
        else:
            jvp = JVP_RULES.get(op_type)
            if jvp is None:
                return NotImplemented
            if cls is EagerOp:
                view = OpView(payload.inputs, payload.outputs, attrs=payload.attrs)
            else:
                view = OpView(payload.op.inputs, payload.op.outputs, op=payload.op)
            fn = lambda t: jvp(view, t)  # noqa: E731
        if not use_batch:
            return fn(in_tangents)
        # Batched tangents: the rule per example, restacked; an input of a
        # differentiable dtype without a tangent gets zeros per example.
        if cls is EagerOp:
            primals = payload.inputs
        elif cls is GraphOp:
            primals = payload.op.inputs
        else:
            primals = [None] * len(in_tangents)
        zeros = [array_ops.zeros_like(p) if t is None and p is not None
                 and p.dtype in _DIFFERENTIABLE else None
                 for t, p in zip(in_tangents, primals)]
        split = [None if t is None else array_ops_stack.unstack(t) for t in in_tangents]
        n = next(len(s) for s in split if s is not None)
        rows = [fn([z if s is None else s[b] for s, z in zip(split, zeros)])
                for b in range(n)]
        if any(r is NotImplemented for r in rows):
            return NotImplemented
        return [None if any(r[k] is None for r in rows)
                else array_ops_stack.stack([r[k] for r in rows])
                for k in range(len(rows[0]))]

    def transposable(self, grad):
        # IndexedSlices (a gather's gradient) carry no id of their own: made
        # dense under the inner tape, as TF's function JVPs do.
        if isinstance(grad, indexed_slices.IndexedSlices):
            return ops.convert_to_tensor(grad)
        return grad

    def unbatch(self, tangent):
        return array_ops_stack.unstack(tangent)

    def batch(self, tangents):
        return array_ops_stack.stack(tangents)
