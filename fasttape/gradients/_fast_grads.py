"""Fast gradient rules: TF's registered gradients for the ops that dominate
real models, issuing the same kernels straight through TF's C++ fast path.

A rule is ``fn(op, grads, skip) -> list | None`` where ``op`` is the recorded
EagerOp (attrs, inputs, outputs), ``grads`` the output gradients and ``skip``
the input indices whose gradient is not needed. A rule returns None when its
preconditions do not hold (broadcasting, unusual attrs); the caller then runs
TF's registered function. Rules are used only when nothing records: no
fasttape tape or accumulator and no TF tape is active in the thread, the
gradient is dense and real-valued, and execution is eager. Under a recording
tape (higher-order derivatives) TF's own functions run, so the recorded
second-order graph is exactly TF's.

Each rule runs the kernels TF's function runs, in the same order, so results
agree bit for bit; compat/test_fast_grads.py proves each one against TF's.
"""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
import numpy as np
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context
from tensorflow.python.framework import constant_op
from tensorflow.python.framework import dtypes

_FAST_PATH = pywrap_tfe.TFE_Py_FastPathExecute  # the original, unwrapped
_INT32 = dtypes.int32

REAL_FLOAT_ENUMS = frozenset(
    d.as_datatype_enum for d in (dtypes.float16, dtypes.bfloat16,
                                 dtypes.float32, dtypes.float64))

FAST_GRADS = {}


def fast_rule(*op_types):
    def register(fn):
        for op_type in op_types:
            FAST_GRADS[op_type] = fn
        return fn
    return register


def _ex(op_name, *args):
    return _FAST_PATH(context._context, op_name, None, *args)  # pylint: disable=protected-access


_const_cache = {}


def _const(value, dtype):
    """A cached eager constant (shapes, axes, scale factors)."""
    return _cached((value, dtype), lambda: constant_op.constant(value, dtype=dtype))


def _cached(key, make):
    """An eager tensor made once by ``make()`` for a hashable key, in the
    constants' cache (emptied by clear_caches)."""
    c = _const_cache.get(key)
    if c is None:
        if len(_const_cache) > 4096:
            _const_cache.clear()
        c = make()
        _const_cache[key] = c
    return c


def clear_caches():
    """Drop the cached constants (eager tensors) and reduction axes."""
    _const_cache.clear()
    _grad_axes_cache.clear()
    _broadcast_cache.clear()


def _attr(op, name):
    attrs = op.attrs
    for i in range(0, len(attrs), 2):
        if attrs[i] == name:
            return attrs[i + 1]
    raise KeyError(name)


def _shape(t):
    return t._shape_tuple()  # pylint: disable=protected-access


# -- identity-like ---------------------------------------------------------------

@fast_rule("Identity", "ReadVariableOp")
def _identity(op, g, skip):
    return [g[0]]


@fast_rule("AddN")
def _add_n(op, g, skip):
    return [g[0]] * op.num_inputs


# -- elementwise binary, with broadcasting ---------------------------------------

_grad_axes_cache = {}


def _grad_axes(sx, sy):
    """The reduction axes of each input's gradient for a broadcasting binary
    op with input shapes ``sx`` and ``sy``: TF's BroadcastGradientArgs
    kernel, run once per pair of shapes (cached as tuples, no tensor). As
    TF's gradients, they come from the inputs' shapes only, never from the
    incoming gradient's: a gradient that does not fit fails in Sum or
    Reshape as it does in TF."""
    key = (sx, sy)
    axes = _grad_axes_cache.get(key)
    if axes is None:
        rx, ry = _ex("BroadcastGradientArgs", _const(sx, _INT32),
                     _const(sy, _INT32))
        axes = (tuple(int(a) for a in rx._numpy()),  # pylint: disable=protected-access
                tuple(int(a) for a in ry._numpy()))  # pylint: disable=protected-access
        if len(_grad_axes_cache) > 4096:
            _grad_axes_cache.clear()
        _grad_axes_cache[key] = axes
    return axes


_broadcast_cache = {}


def _broadcast_shape(sx, sy):
    """The output shape of a broadcasting binary op (cached, as the axes)."""
    key = (sx, sy)
    shape = _broadcast_cache.get(key)
    if shape is None:
        try:
            shape = tuple(np.broadcast_shapes(sx, sy))
        except (TypeError, ValueError):
            shape = False
        if len(_broadcast_cache) > 4096:
            _broadcast_cache.clear()
        _broadcast_cache[key] = shape
    return shape


def _reduce_to(g, shape, axes):
    """Sum a broadcast gradient back to ``shape`` (TF's _ReduceGradientArg:
    Sum over ``axes`` keeping dims, then Reshape; the ops that would not
    change the tensor are left out)."""
    if axes:
        g = _ex("Sum", g, _const(axes, _INT32), "keep_dims", True)
    if _shape(g) != shape:
        g = _ex("Reshape", g, _const(shape, _INT32))
    return g


def _binary_shapes(op):
    x, y = op.inputs
    if x is None or y is None:
        raise _NotApplicable
    sx, sy = _shape(x), _shape(y)
    return x, y, sx, sy, _grad_axes(sx, sy)


class _NotApplicable(Exception):
    pass


def _skipped_scalar_y(op, skip):
    """TF's shortcut in _AddGrad, _SubGrad and _MulGrad: when y's gradient is
    not needed and y is a scalar, x's gradient is the incoming one (times y
    for Mul) with no reduction, so a gradient that does not fit x is
    returned as it is, not reduced to x's shape."""
    if 1 not in skip:
        return False
    y = op.inputs[1]
    return y is not None and _shape(y) == ()


@fast_rule("Add", "AddV2")
def _add(op, g, skip):
    if _skipped_scalar_y(op, skip):
        return [g[0], None]
    x, y, sx, sy, (ax, ay) = _binary_shapes(op)
    return [None if 0 in skip else _reduce_to(g[0], sx, ax),
            None if 1 in skip else _reduce_to(g[0], sy, ay)]


@fast_rule("Sub")
def _sub(op, g, skip):
    if _skipped_scalar_y(op, skip):
        return [g[0], None]
    x, y, sx, sy, (ax, ay) = _binary_shapes(op)
    return [None if 0 in skip else _reduce_to(g[0], sx, ax),
            None if 1 in skip else _reduce_to(_ex("Neg", g[0]), sy, ay)]


@fast_rule("Mul")
def _mul(op, g, skip):
    if _skipped_scalar_y(op, skip):
        return [_ex("Mul", g[0], op.inputs[1]), None]
    x, y, sx, sy, (ax, ay) = _binary_shapes(op)
    return [None if 0 in skip else _reduce_to(_ex("Mul", g[0], y), sx, ax),
            None if 1 in skip else _reduce_to(_ex("Mul", x, g[0]), sy, ay)]


@fast_rule("RealDiv")
def _real_div(op, g, skip):
    x, y, sx, sy, (ax, ay) = _binary_shapes(op)
    if 0 in skip or 1 in skip:
        # TF's _RealDivGrad ignores skip_input_indices: it computes (and
        # reduces) both gradients, so a gradient that does not fit the
        # output fails even for an input nobody needs. Such a gradient goes
        # to TF's function; one that fits cannot fail, so skipping is safe.
        if _shape(g[0]) != _broadcast_shape(sx, sy):
            return None
    gx = None if 0 in skip else _reduce_to(_ex("RealDiv", g[0], y), sx, ax)
    gy = None
    if 1 not in skip:
        ratio = _ex("RealDiv", _ex("RealDiv", _ex("Neg", x), y), y)
        gy = _reduce_to(_ex("Mul", g[0], ratio), sy, ay)
    return [gx, gy]


# -- elementwise unary -------------------------------------------------------------

@fast_rule("Neg")
def _neg(op, g, skip):
    return [_ex("Neg", g[0])]


@fast_rule("Sin")
def _sin(op, g, skip):
    return [_ex("Mul", g[0], _ex("Cos", op.inputs[0]))]


@fast_rule("Cos")
def _cos(op, g, skip):
    return [_ex("Mul", _ex("Neg", g[0]), _ex("Sin", op.inputs[0]))]


@fast_rule("Exp")
def _exp(op, g, skip):
    return [_ex("Mul", g[0], op.outputs[0])]


@fast_rule("Log")
def _log(op, g, skip):
    return [_ex("Mul", g[0], _ex("Reciprocal", op.inputs[0]))]


@fast_rule("Square")
def _square(op, g, skip):
    x = op.inputs[0]
    return [_ex("Mul", g[0], _ex("Mul", x, _const(2.0, x.dtype)))]


@fast_rule("Sqrt")
def _sqrt(op, g, skip):
    return [_ex("SqrtGrad", op.outputs[0], g[0])]


@fast_rule("Tanh")
def _tanh(op, g, skip):
    return [_ex("TanhGrad", op.outputs[0], g[0])]


@fast_rule("Sigmoid")
def _sigmoid(op, g, skip):
    return [_ex("SigmoidGrad", op.outputs[0], g[0])]


@fast_rule("Relu")
def _relu(op, g, skip):
    return [_ex("ReluGrad", g[0], op.outputs[0])]


# -- linear algebra and layers -------------------------------------------------------

def _mat_mul(a, b, ta, tb, ga, gb):
    return _ex("MatMul", a, b, "transpose_a", ta, "transpose_b", tb,
               "grad_a", ga, "grad_b", gb)


# How TF's _MatMulGrad forms each input's gradient, per (transpose_a,
# transpose_b): (first operand, second operand, transpose_a, transpose_b),
# with "g" the output gradient and "a", "b" the op's inputs.
_MATMUL_GRAD_A = {(False, False): ("g", "b", False, True),
                  (False, True): ("g", "b", False, False),
                  (True, False): ("b", "g", False, True),
                  (True, True): ("b", "g", True, True)}
_MATMUL_GRAD_B = {(False, False): ("a", "g", True, False),
                  (False, True): ("g", "a", True, False),
                  (True, False): ("a", "g", False, False),
                  (True, True): ("g", "a", True, True)}


@fast_rule("MatMul")
def _matmul(op, g, skip):
    a, b = op.inputs
    values = {"g": g[0], "a": a, "b": b}
    key = (bool(_attr(op, "transpose_a")), bool(_attr(op, "transpose_b")))
    grads = []
    for index, table, flags in ((0, _MATMUL_GRAD_A, (True, False)),
                                (1, _MATMUL_GRAD_B, (False, True))):
        if index in skip:
            grads.append(None)
            continue
        x, y, tx, ty = table[key]
        grads.append(_mat_mul(values[x], values[y], tx, ty, *flags))
    return grads


@fast_rule("BiasAdd")
def _bias_add(op, g, skip):
    return [g[0], None if 1 in skip else
            _ex("BiasAddGrad", g[0], "data_format", _attr(op, "data_format"))]


@fast_rule("SparseSoftmaxCrossEntropyWithLogits")
def _sparse_xent(op, g, skip):
    if g[1] is not None:
        return None  # second-order term: TF's function handles it
    vec = _ex("ExpandDims", g[0], _const(-1, _INT32))
    return [_ex("Mul", vec, op.outputs[1]), None]


@fast_rule("Conv2D")
def _conv2d(op, g, skip):
    x, w = op.inputs
    attrs = ("strides", _attr(op, "strides"),
             "use_cudnn_on_gpu", _attr(op, "use_cudnn_on_gpu"),
             "padding", _attr(op, "padding"),
             "explicit_paddings", _attr(op, "explicit_paddings"),
             "data_format", _attr(op, "data_format"),
             "dilations", _attr(op, "dilations"))
    return [
        None if 0 in skip else _ex("Conv2DBackpropInput",
                                   _const(_shape(x), _INT32), w, g[0], *attrs),
        None if 1 in skip else _ex("Conv2DBackpropFilter",
                                   x, _const(_shape(w), _INT32), g[0], *attrs),
    ]


@fast_rule("MaxPool")
def _max_pool(op, g, skip):
    return [_ex("MaxPoolGrad", op.inputs[0], op.outputs[0], g[0],
                "ksize", _attr(op, "ksize"), "strides", _attr(op, "strides"),
                "padding", _attr(op, "padding"),
                "explicit_paddings", _attr(op, "explicit_paddings"),
                "data_format", _attr(op, "data_format"))]


# -- shapes and reductions ------------------------------------------------------------

def _reshape_to(g, like):
    return _ex("Reshape", g, _const(_shape(like), _INT32))


@fast_rule("Reshape", "ExpandDims")
def _reshape(op, g, skip):
    return [_reshape_to(g[0], op.inputs[0]), None]


@fast_rule("Squeeze")
def _squeeze(op, g, skip):
    return [_reshape_to(g[0], op.inputs[0])]


@fast_rule("Transpose")
def _transpose(op, g, skip):
    perm = op.inputs[1]
    if perm is None:
        return None
    p = [int(i) for i in perm._numpy()]  # pylint: disable=protected-access
    inverse = [0] * len(p)
    for i, j in enumerate(p):
        inverse[j] = i
    return [_ex("Transpose", g[0], _const(tuple(inverse), perm.dtype)), None]


def _axes(op, rank):
    axes = op.inputs[1]._numpy().reshape(-1)  # pylint: disable=protected-access
    return sorted({int(a) % rank for a in axes}) if rank else []


def _sum_grad(op, grad):
    x = op.inputs[0]
    shape = _shape(x)
    rank = len(shape)
    axes = _axes(op, rank)
    if axes == list(range(rank)):
        grad = _ex("Reshape", grad, _const((1,) * rank, _INT32))
        return _ex("Tile", grad, _const(shape, _INT32))
    kept = tuple(1 if i in axes else d for i, d in enumerate(shape))
    if not _attr(op, "keep_dims"):
        grad = _ex("Reshape", grad, _const(kept, _INT32))
    return _ex("BroadcastTo", grad, _const(shape, _INT32))


@fast_rule("Sum")
def _sum(op, g, skip):
    if op.inputs[0] is None or op.inputs[1] is None:
        return None
    return [_sum_grad(op, g[0]), None]


@fast_rule("Mean")
def _mean(op, g, skip):
    x, y = op.inputs[0], op.outputs[0]
    if x is None or y is None or op.inputs[1] is None:
        return None
    sum_grad = _sum_grad(op, g[0])
    in_size = 1
    for d in _shape(x):
        in_size *= d
    out_size = 1
    for d in _shape(y):
        out_size *= d
    factor = in_size // max(out_size, 1)
    return [_ex("RealDiv", sum_grad, _const(factor, sum_grad.dtype)), None]


@fast_rule("Cast")
def _cast(op, g, skip):
    src = op.inputs[0]
    if src is None or src.dtype.as_datatype_enum not in REAL_FLOAT_ENUMS:
        return None
    return [_ex("Cast", g[0], "DstT", src.dtype, "Truncate", False)]
