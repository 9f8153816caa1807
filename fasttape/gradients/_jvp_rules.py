"""Forward-mode rules: ``JVP_RULES[op_type](op, tangents) -> output tangents``.

A rule may return NotImplemented to use the fallback for an op instance.
``op`` is a small view with ``inputs``, ``outputs`` and ``attr(name)``, the
same for ops recorded eagerly and ops built in a graph. ``tangents`` has one
entry per input: a tensor (zeros for an input of a differentiable dtype that
has no tangent, as in TF) or None for a non-differentiable input. Ops without
a rule here fall back to the core's transposition of their registered
gradient (tape.h's ForwardpropFromTape), which is correct for every op with a
gradient but runs about twice the work.
"""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.framework import dtypes
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import array_ops_stack
from tensorflow.python.ops import gen_math_ops
from tensorflow.python.ops import gen_nn_ops
from tensorflow.python.ops import math_ops
from tensorflow.python.ops import nn_ops

JVP_RULES = {}


def rule(*op_types):
    def register(fn):
        for op_type in op_types:
            JVP_RULES[op_type] = fn
        return fn
    return register


class OpView:
    """inputs/outputs/attr of an eager record or a graph op, for the rules."""

    __slots__ = ("inputs", "outputs", "_attrs", "_op")

    def __init__(self, inputs, outputs, attrs=None, op=None):
        self.inputs = inputs
        self.outputs = outputs
        self._attrs = attrs
        self._op = op

    def attr(self, name):
        if self._op is not None:
            return self._op.get_attr(name)
        attrs = self._attrs
        for i in range(0, len(attrs), 2):
            if attrs[i] == name:
                return attrs[i + 1]
        raise KeyError(name)


@rule("Identity", "ReadVariableOp", "EnsureShape")
def _identity(op, t):
    return [array_ops.identity(t[0])]


@rule("IdentityN")
def _identity_n(op, t):
    return [None if x is None else array_ops.identity(x) for x in t]


@rule("Add", "AddV2")
def _add(op, t):
    return [t[0] + t[1]]


@rule("Sub")
def _sub(op, t):
    return [t[0] - t[1]]


@rule("Neg")
def _neg(op, t):
    return [-t[0]]


@rule("AddN")
def _add_n(op, t):
    return [math_ops.add_n(list(t))]


@rule("Mul")
def _mul(op, t):
    a, b = op.inputs
    return [t[0] * b + a * t[1]]


@rule("RealDiv", "Div")
def _div(op, t):
    a, b = op.inputs
    return [(t[0] - op.outputs[0] * t[1]) / b]


@rule("Square")
def _square(op, t):
    return [2 * op.inputs[0] * t[0]]


@rule("Sqrt")
def _sqrt(op, t):
    return [t[0] / (2 * op.outputs[0])]


@rule("Exp")
def _exp(op, t):
    return [op.outputs[0] * t[0]]


@rule("Log")
def _log(op, t):
    return [t[0] / op.inputs[0]]


@rule("Sin")
def _sin(op, t):
    return [math_ops.cos(op.inputs[0]) * t[0]]


@rule("Cos")
def _cos(op, t):
    return [-math_ops.sin(op.inputs[0]) * t[0]]


@rule("Tanh")
def _tanh(op, t):
    y = op.outputs[0]
    return [(1 - y * y) * t[0]]


@rule("Sigmoid")
def _sigmoid(op, t):
    y = op.outputs[0]
    return [y * (1 - y) * t[0]]


@rule("Relu")
def _relu(op, t):
    return [gen_nn_ops.relu_grad(t[0], op.outputs[0])]


@rule("MatMul")
def _matmul(op, t):
    a, b = op.inputs
    ta, tb = op.attr("transpose_a"), op.attr("transpose_b")
    mm = lambda x, y: gen_math_ops.mat_mul(x, y, transpose_a=ta, transpose_b=tb)  # noqa: E731
    return [mm(t[0], b) + mm(a, t[1])]


@rule("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
def _batch_matmul(op, t):
    a, b = op.inputs
    adj_x, adj_y = op.attr("adj_x"), op.attr("adj_y")
    mm = lambda x, y: math_ops.matmul(x, y, adjoint_a=adj_x, adjoint_b=adj_y)  # noqa: E731
    out = mm(t[0], b) + mm(a, t[1])
    return [math_ops.cast(out, op.outputs[0].dtype)]


@rule("Sum")
def _sum(op, t):
    return [math_ops.reduce_sum(t[0], op.inputs[1], keepdims=op.attr("keep_dims"))]


@rule("Mean")
def _mean(op, t):
    return [math_ops.reduce_mean(t[0], op.inputs[1], keepdims=op.attr("keep_dims"))]


@rule("Reshape")
def _reshape(op, t):
    return [array_ops.reshape(t[0], op.inputs[1])]


@rule("Transpose")
def _transpose(op, t):
    return [array_ops.transpose(t[0], op.inputs[1])]


@rule("ExpandDims")
def _expand_dims(op, t):
    return [array_ops.expand_dims(t[0], op.inputs[1])]


@rule("Squeeze")
def _squeeze(op, t):
    return [array_ops.squeeze(t[0], op.attr("squeeze_dims"))]


@rule("ConcatV2")
def _concat(op, t):
    return [array_ops.concat(list(t[:-1]), op.inputs[-1])]


@rule("Pack")
def _pack(op, t):
    return [array_ops_stack.stack(list(t), axis=op.attr("axis"))]


@rule("GatherV2")
def _gather(op, t):
    params, indices, axis = op.inputs
    return [array_ops.gather(t[0], indices, axis=axis,
                             batch_dims=op.attr("batch_dims"))]


@rule("Cast")
def _cast(op, t):
    dst = dtypes.as_dtype(op.attr("DstT"))
    if not (dst.is_floating or dst.is_complex) or t[0] is None:
        return [None]
    return [math_ops.cast(t[0], dst)]


@rule("BiasAdd")
def _bias_add(op, t):
    fmt = op.attr("data_format")
    if isinstance(fmt, bytes):
        fmt = fmt.decode()
    return [nn_ops.bias_add(t[0], t[1], data_format=fmt)]


@rule("Softmax")
def _softmax(op, t):
    y = op.outputs[0]
    return [y * (t[0] - math_ops.reduce_sum(y * t[0], -1, keepdims=True))]


@rule("LogSoftmax")
def _log_softmax(op, t):
    p = math_ops.exp(op.outputs[0])
    return [t[0] - math_ops.reduce_sum(p * t[0], -1, keepdims=True)]


@rule("Conv2D")
def _conv2d(op, t):
    x, w = op.inputs
    kw = {name: op.attr(name) for name in
          ("strides", "padding", "explicit_paddings", "data_format",
           "dilations", "use_cudnn_on_gpu")}
    conv = lambda a, b: gen_nn_ops.conv2d(a, b, **kw)  # noqa: E731
    return [conv(t[0], w) + conv(x, t[1])]


def _pool_attrs(op):
    return {name: op.attr(name) for name in
            ("ksize", "strides", "padding", "data_format")}


@rule("MaxPool")
def _max_pool(op, t):
    # The tangent at each window's maximum: MaxPoolGradGrad pushes a tensor
    # shaped like the input through the max selection.
    kw = _pool_attrs(op)
    if kw["padding"] in ("EXPLICIT", b"EXPLICIT"):
        return NotImplemented  # MaxPoolGradGrad has no explicit padding
    return [gen_nn_ops.max_pool_grad_grad(op.inputs[0], op.outputs[0], t[0], **kw)]


@rule("AvgPool")
def _avg_pool(op, t):
    return [gen_nn_ops.avg_pool(t[0], **_pool_attrs(op))]


def _softmax_jvp(p, dlogits):
    return p * (dlogits - math_ops.reduce_sum(p * dlogits, -1, keepdims=True))


@rule("SparseSoftmaxCrossEntropyWithLogits")
def _sparse_xent(op, t):
    # loss = logsumexp(logits) - logits[label]; backprop = softmax - onehot.
    backprop = op.outputs[1]
    p = nn_ops.softmax(op.inputs[0])
    return [math_ops.reduce_sum(backprop * t[0], -1), _softmax_jvp(p, t[0])]


@rule("SoftmaxCrossEntropyWithLogits")
def _xent(op, t):
    # loss = sum(labels) * logsumexp(logits) - sum(labels * logits);
    # backprop = softmax * sum(labels) - labels.
    logits, labels = op.inputs
    dlogits, dlabels = t
    backprop = op.outputs[1]
    p = nn_ops.softmax(logits)
    log_p = nn_ops.log_softmax(logits)
    loss_t = (math_ops.reduce_sum(backprop * dlogits, -1)
              - math_ops.reduce_sum(log_p * dlabels, -1))
    total = math_ops.reduce_sum(labels, -1, keepdims=True)
    backprop_t = (_softmax_jvp(p, dlogits) * total
                  + p * math_ops.reduce_sum(dlabels, -1, keepdims=True) - dlabels)
    return [loss_t, backprop_t]
