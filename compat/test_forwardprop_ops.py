"""Op-by-op parity of fasttape.ForwardAccumulator with TF's: every op with a
direct JVP rule (fasttape.gradients._jvp_rules.JVP_RULES) and a spread of ops without
one (fasttape transposes their registered gradient), each on realistic small
shapes; plus, per case, the inner-product identity <J v, u> == <v, J^T u>
with fasttape alone (forward accumulator against tape with output_gradients).

A case is (id, fn, args, ops): every floating/complex arg is a primal with a
random tangent, other args (indices, masks, shapes) are plain constants;
``ops`` lists op types fasttape must push tangents through, and whether each
went through a direct rule or the fallback is checked against JVP_RULES.
"""

import contextlib
import zlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.util import nest

import fasttape
from fasttape.recording import _recording
from fasttape.gradients._jvp_rules import JVP_RULES
from harness import Raised, assert_same
from op_corpus import tf_registers_no_gradient
from test_forwardprop import fwd_error, fwd_parity, run_fwd_case


# -- argument specs -----------------------------------------------------------

class Spec:
    """A float argument made from the case's own random stream."""

    def __init__(self, kind, *shape, dtype=np.float32):
        self.kind, self.shape, self.dtype = kind, shape, dtype

    def make(self, rng):
        kind, shape = self.kind, self.shape
        if kind == "n":
            value = rng.standard_normal(shape)
        elif kind == "pos":
            value = rng.uniform(0.5, 2.0, shape)
        elif kind == "unit":
            value = rng.uniform(-0.8, 0.8, shape)
        elif kind == "spd":
            a = rng.standard_normal(shape)
            value = a @ np.swapaxes(a, -1, -2) + shape[-1] * np.eye(shape[-1])
        elif kind == "wc":   # well conditioned
            value = np.eye(shape[-1]) + 0.3 * rng.standard_normal(shape)
        elif kind == "tril":
            value = np.tril(rng.standard_normal(shape)) + 2 * np.eye(shape[-1])
        elif kind == "c":
            value = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
            return value.astype(np.complex64 if self.dtype == np.float32 else self.dtype)
        elif kind == "distinct":   # no ties (max/min/top_k/pooling)
            value = rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1 - 1.0
        else:
            raise ValueError(kind)
        return np.asarray(value, self.dtype)


def N(*s, **k): return Spec("n", *s, **k)          # noqa: E302,E704
def Pos(*s, **k): return Spec("pos", *s, **k)      # noqa: E302,E704
def Unit(*s, **k): return Spec("unit", *s, **k)    # noqa: E302,E704
def Spd(*s, **k): return Spec("spd", *s, **k)      # noqa: E302,E704
def Wc(*s, **k): return Spec("wc", *s, **k)        # noqa: E302,E704
def Tril(*s, **k): return Spec("tril", *s, **k)    # noqa: E302,E704
def Cx(*s, **k): return Spec("c", *s, **k)         # noqa: E302,E704
def Dis(*s, **k): return Spec("distinct", *s, **k)  # noqa: E302,E704


def I32(*values): return np.array(values, np.int32)  # noqa: E302,E704


def _is_diff(dtype):
    dtype = tf.as_dtype(dtype)
    return dtype.is_floating or dtype.is_complex


class Case:
    def __init__(self, id, fn, args, ops, rtol=None, atol=None, xfail=None,
                 tf_raises=None, ip_rtol=1e-4, ip_skip=None):
        self.id, self.fn, self.args, self.ops = id, fn, args, tuple(ops)
        self.rtol, self.atol, self.xfail = rtol, atol, xfail
        self.tf_raises = tf_raises  # TF's forward mode raises this here
        self.ip_rtol = ip_rtol      # inner-product identity tolerance
        self.ip_skip = ip_skip      # why the identity does not hold (TF's JVP)

    def arrays(self):
        """(arrays, tangents): the same numbers on every call."""
        rng = np.random.default_rng(zlib.crc32(self.id.encode()))
        arrays = [a.make(rng) if isinstance(a, Spec) else np.asarray(a)
                  for a in self.args]
        tangents = []
        for a in arrays:
            if _is_diff(a.dtype):
                t = rng.standard_normal(a.shape)
                if np.iscomplexobj(a):
                    t = t + 1j * rng.standard_normal(a.shape)
                tangents.append(t.astype(a.dtype))
        return arrays, tangents

    def with_dtype(self, dtype, suffix, **kwargs):
        """The same case with every real float argument in ``dtype``."""
        args = [Spec(a.kind, *a.shape, dtype=dtype)
                if isinstance(a, Spec) and a.kind != "c" else a for a in self.args]
        return Case(f"{self.id}_{suffix}", self.fn, args, self.ops, **kwargs)

    def param(self):
        marks = ()
        if self.xfail:
            marks = (pytest.mark.xfail(strict=True, reason=self.xfail),)
        return pytest.param(self, id=self.id, marks=marks)


def _split(arrays):
    tensors = [tf.constant(a) for a in arrays]
    return tensors, [t for t in tensors if _is_diff(t.dtype)]


def make_jvp_case(c):
    def case(FA, GT):
        arrays, tangents = c.arrays()
        tensors, primals = _split(arrays)
        with FA(primals, [tf.constant(t) for t in tangents]) as acc:
            out = c.fn(*tensors)
        return out, nest.map_structure(acc.jvp, out)
    return case


@contextlib.contextmanager
def seen_by_fasttape():
    """(op type, went through a direct rule) for every op fasttape's
    accumulators push tangents through while active."""
    seen = []
    vspace = _recording.VSPACE
    original = vspace.forward_rule

    def forward_rule(op_type, payload, in_tangents, use_batch):
        result = original(op_type, payload, in_tangents, use_batch)
        seen.append((op_type, result is not NotImplemented))
        return result

    vspace.forward_rule = forward_rule
    try:
        yield seen
    finally:
        del vspace.forward_rule


def check_case(c):
    case = make_jvp_case(c)
    expected = run_fwd_case(case, "tf")
    with seen_by_fasttape() as seen:
        actual = run_fwd_case(case, "fasttape")
    if c.tf_raises is not None:
        assert isinstance(expected, Raised) and isinstance(expected.exc, c.tf_raises), (
            expected)
        assert_same(expected, actual)
        return expected
    if isinstance(expected, Raised):
        raise AssertionError(f"tf failed: {expected!r}") from expected.exc
    if isinstance(actual, Raised):
        raise AssertionError(
            f"fasttape raised where tf succeeded: {actual!r}") from actual.exc
    assert_same(expected, actual, rtol=c.rtol, atol=c.atol)
    # The op types the case is about really went through fasttape, each by
    # the route JVP_RULES says.
    routes = {}
    for op_type, direct in seen:
        routes.setdefault(op_type, set()).add(direct)
    for op_type in c.ops:
        assert op_type in routes, (
            f"{op_type} never reached fasttape's accumulator: saw {sorted(routes)}")
        assert routes[op_type] == {op_type in JVP_RULES}, (op_type, routes[op_type])
    return expected


def _dense(x):
    return tf.convert_to_tensor(x) if isinstance(x, tf.IndexedSlices) else x


def _vdot(a, b):
    """Re <a, b>: the real inner product TF's gradients are adjoint to."""
    a, b = _dense(a), _dense(b)
    a = np.asarray(a, np.complex128 if np.iscomplexobj(a) else np.float64)
    b = np.asarray(b, np.complex128 if np.iscomplexobj(b) else np.float64)
    return float(np.real(np.sum(a * np.conj(b))))


def _absdot(a, b):
    a, b = _dense(a), _dense(b)
    return float(np.sum(np.abs(np.asarray(a)) * np.abs(np.asarray(b))))


def check_inner_product_identity(c):
    """<J v, u> == <v, J^T u>, J v from fasttape.ForwardAccumulator and J^T u
    from fasttape.GradientTape with output_gradients=u."""
    arrays, tangents = c.arrays()
    tensors, primals = _split(arrays)
    with fasttape.ForwardAccumulator(
            primals, [tf.constant(t) for t in tangents]) as acc:
        out = c.fn(*tensors)
    outs = [o for o in nest.flatten(out) if _is_diff(o.dtype)]
    jvps = [acc.jvp(o) for o in outs]
    rng = np.random.default_rng(zlib.crc32(c.id.encode()) + 1)
    us = []
    for o in outs:
        u = rng.standard_normal(o.shape)
        if o.dtype.is_complex:
            u = u + 1j * rng.standard_normal(o.shape)
        us.append(tf.constant(u.astype(o.dtype.as_numpy_dtype)))
    with fasttape.GradientTape() as tape:
        tape.watch(primals)
        out2 = c.fn(*tensors)
    outs2 = [o for o in nest.flatten(out2) if _is_diff(o.dtype)]
    grads = tape.gradient(outs2, primals, output_gradients=us,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    lhs = sum(_vdot(j, u) for j, u in zip(jvps, us) if j is not None)
    rhs = sum(_vdot(v, g) for v, g in zip(tangents, grads))
    scale = (sum(_absdot(j, u) for j, u in zip(jvps, us) if j is not None)
             + sum(_absdot(v, g) for v, g in zip(tangents, grads)))
    assert abs(lhs - rhs) <= c.ip_rtol * scale + 1e-5, (lhs, rhs, scale)
    assert any(j is not None for j in jvps) or not outs or c.id in _ZERO_JVP_OK, (
        "no output got a tangent")


# Ops whose JVP is None/zeros everywhere by definition.
_ZERO_JVP_OK = {"Floor", "Round", "Sign"}


# -- ops with a direct rule ---------------------------------------------------------

_bmm_v3 = lambda a, b: tf.raw_ops.BatchMatMulV3(  # noqa: E731
    x=a, y=b, Tout=tf.float32, adj_x=False, adj_y=True)

DIRECT = [
    Case("Identity", tf.identity, [N(3, 4)], ["Identity"]),
    Case("EnsureShape", lambda x: tf.ensure_shape(x * 2., [3, None]), [N(3, 4)],
         ["EnsureShape"]),
    Case("IdentityN", lambda a, b: tf.identity_n([a, b]), [N(2, 3), N(4)], ["IdentityN"]),
    Case("Add_broadcast", lambda a, b: tf.raw_ops.Add(x=a, y=b), [N(2, 3), N(3)], ["Add"]),
    Case("AddV2_broadcast", lambda a, b: a + b, [N(2, 1, 3), N(4, 1)], ["AddV2"]),
    Case("AddV2_scalar_const", lambda a: a + 2., [N(2, 3)], ["AddV2"]),
    Case("Sub_broadcast", lambda a, b: a - b, [N(2, 3), N(2, 1)], ["Sub"]),
    Case("Neg", lambda a: -a, [N(3)], ["Neg"]),
    Case("AddN", lambda a, b, c: tf.add_n([a, b, c]), [N(2, 2), N(2, 2), N(2, 2)], ["AddN"]),
    Case("Mul_broadcast", lambda a, b: a * b, [N(4, 1, 3), N(2, 3)], ["Mul"]),
    Case("Mul_scalar", lambda a, b: a * b, [N(2, 3), N()], ["Mul"]),
    Case("Mul_complex", lambda a, b: a * b, [Cx(2, 3), Cx(3)], ["Mul"]),
    Case("RealDiv_broadcast", lambda a, b: a / b, [N(2, 3), Pos(3)], ["RealDiv"]),
    Case("RealDiv_scalar_denominator", lambda a, b: a / b, [N(2, 3), Pos()], ["RealDiv"]),
    Case("RealDiv_numerator_broadcast", lambda a, b: a / b, [N(3), Pos(2, 3)], ["RealDiv"]),
    Case("Div", lambda a, b: tf.raw_ops.Div(x=a, y=b), [N(2, 3), Pos(2, 3)], ["Div"]),
    Case("Square", tf.square, [N(5)], ["Square"]),
    Case("Square_complex", tf.square, [Cx(4)], ["Square"]),
    Case("Sqrt", tf.sqrt, [Pos(5)], ["Sqrt"]),
    Case("Exp", tf.exp, [N(2, 3)], ["Exp"]),
    Case("Exp_complex", tf.exp, [Cx(3)], ["Exp"]),
    Case("Log", tf.math.log, [Pos(2, 3)], ["Log"]),
    Case("Sin", tf.sin, [N(4)], ["Sin"]),
    Case("Cos", tf.cos, [N(4)], ["Cos"]),
    Case("Tanh", tf.tanh, [N(4)], ["Tanh"]),
    Case("Sigmoid", tf.sigmoid, [N(4)], ["Sigmoid"]),
    Case("Relu", tf.nn.relu, [Dis(3, 4)], ["Relu"]),
    Case("MatMul", tf.matmul, [N(3, 4), N(4, 2)], ["MatMul"]),
    Case("MatMul_transpose_a", lambda a, b: tf.matmul(a, b, transpose_a=True),
         [N(4, 3), N(4, 2)], ["MatMul"]),
    Case("MatMul_transpose_b", lambda a, b: tf.matmul(a, b, transpose_b=True),
         [N(3, 4), N(2, 4)], ["MatMul"]),
    Case("MatMul_transpose_both", lambda a, b: tf.matmul(a, b, transpose_a=True,
                                                         transpose_b=True),
         [N(4, 3), N(2, 4)], ["MatMul"]),
    Case("MatMul_adjoint_real", lambda a, b: tf.matmul(a, b, adjoint_b=True),
         [N(3, 4), N(2, 4)], ["MatMul"]),
    Case("MatMul_complex_adjoint", lambda a, b: tf.matmul(a, b, adjoint_a=True),
         [Cx(3, 2), Cx(3, 4)], ["MatMul"]),
    Case("MatMul_one_side_constant", lambda a: tf.matmul(a, tf.ones([4, 2])),
         [N(3, 4)], ["MatMul"]),
    Case("BatchMatMulV2", tf.matmul, [N(2, 3, 4), N(2, 4, 5)], ["BatchMatMulV2"]),
    Case("BatchMatMulV2_broadcast_batch", tf.matmul, [N(2, 1, 3, 4), N(3, 4, 2)],
         ["BatchMatMulV2"]),
    Case("BatchMatMulV2_adjoint_a", lambda a, b: tf.matmul(a, b, adjoint_a=True),
         [N(2, 4, 3), N(2, 4, 5)], ["BatchMatMulV2"]),
    Case("BatchMatMulV2_transpose_b", lambda a, b: tf.matmul(a, b, transpose_b=True),
         [N(2, 3, 4), N(1, 5, 4)], ["BatchMatMulV2"]),
    Case("BatchMatMulV2_complex_adjoint_both",
         lambda a, b: tf.matmul(a, b, adjoint_a=True, adjoint_b=True),
         [Cx(2, 3, 3), Cx(2, 3, 3)], ["BatchMatMulV2"]),
    Case("BatchMatMul", lambda a, b: tf.raw_ops.BatchMatMul(x=a, y=b, adj_y=True),
         [N(2, 3, 4), N(2, 5, 4)], ["BatchMatMul"]),
    Case("BatchMatMulV3", _bmm_v3, [N(2, 3, 4), N(2, 5, 4)], ["BatchMatMulV3"]),
    Case("Sum_all", tf.reduce_sum, [N(2, 3, 4)], ["Sum"]),
    Case("Sum_axis_keepdims", lambda x: tf.reduce_sum(x, axis=1, keepdims=True),
         [N(2, 3, 4)], ["Sum"]),
    Case("Sum_axes_negative", lambda x: tf.reduce_sum(x, axis=[0, -1]),
         [N(2, 3, 4)], ["Sum"]),
    Case("Mean_all", tf.reduce_mean, [N(2, 3)], ["Mean"]),
    Case("Mean_axis_keepdims", lambda x: tf.reduce_mean(x, axis=-1, keepdims=True),
         [N(2, 3, 4)], ["Mean"]),
    Case("Mean_axes", lambda x: tf.reduce_mean(x, axis=[0, 2]), [N(2, 3, 4)], ["Mean"]),
    Case("Reshape", lambda x: tf.reshape(x, [3, -1]), [N(2, 6)], ["Reshape"]),
    Case("Transpose", lambda x: tf.transpose(x, [2, 0, 1]), [N(2, 3, 4)], ["Transpose"]),
    Case("ExpandDims", lambda x: tf.expand_dims(x, -1), [N(2, 3)], ["ExpandDims"]),
    Case("Squeeze_axis", lambda x: tf.squeeze(x, axis=2), [N(1, 3, 1)], ["Squeeze"]),
    Case("Squeeze_all", tf.squeeze, [N(1, 3, 1, 2)], ["Squeeze"]),
    Case("ConcatV2", lambda a, b, c: tf.concat([a, b, c], axis=1),
         [N(2, 1), N(2, 3), N(2, 2)], ["ConcatV2"]),
    Case("ConcatV2_negative_axis_with_constant",
         lambda a: tf.concat([a, tf.ones([2, 2])], axis=-1), [N(2, 3)], ["ConcatV2"]),
    Case("Pack", lambda a, b: tf.stack([a, b], axis=1), [N(2, 3), N(2, 3)], ["Pack"]),
    Case("GatherV2_axis0", lambda p, i: tf.gather(p, i), [N(5, 3), I32(4, 0, 2, 2)],
         ["GatherV2"]),
    Case("GatherV2_axis1", lambda p, i: tf.gather(p, i, axis=1), [N(2, 5, 3), I32(4, 1)],
         ["GatherV2"]),
    Case("GatherV2_batch_dims", lambda p, i: tf.gather(p, i, axis=1, batch_dims=1),
         [N(2, 5, 3), np.array([[0, 1], [4, 2]], np.int32)], ["GatherV2"]),
    Case("GatherV2_negative_axis_batch_dims", lambda p, i: tf.gather(
        p, i, axis=-1, batch_dims=-1), [N(2, 3, 4), np.array([[0, 3], [2, 2]], np.int32)],
        ["GatherV2"]),
    Case("Cast_float64", lambda x: tf.cast(x, tf.float64), [N(3)], ["Cast"]),
    Case("Cast_float16", lambda x: tf.cast(x, tf.float16), [N(3)], ["Cast"],
         rtol=1e-3, atol=1e-3, ip_rtol=1e-2),
    # No differentiable output: fasttape may skip the op altogether.
    Case("Cast_int32", lambda x: tf.cast(x * 3., tf.int32), [N(3)], []),
    Case("Cast_bool", lambda x: tf.cast(x, tf.bool), [N(3)], []),
    Case("Cast_float64_to_float32", lambda x: tf.cast(x, tf.float32),
         [N(3, dtype=np.float64)], ["Cast"]),
    Case("Cast_complex_to_float", lambda x: tf.cast(x, tf.float32), [Cx(3)], ["Cast"]),
    Case("BiasAdd_NHWC", tf.nn.bias_add, [N(2, 3, 3, 4), N(4)], ["BiasAdd"]),
    Case("BiasAdd_rank2", tf.nn.bias_add, [N(5, 4), N(4)], ["BiasAdd"]),
    Case("BiasAdd_NCHW", lambda x, b: tf.nn.bias_add(x, b, data_format="NCHW"),
         [N(2, 4, 3, 3), N(4)], ["BiasAdd"]),
    Case("Softmax", tf.nn.softmax, [N(3, 5)], ["Softmax"]),
    Case("Softmax_axis0", lambda x: tf.nn.softmax(x, axis=0), [N(3, 5)],
         ["Softmax", "Transpose"]),
    Case("LogSoftmax", tf.nn.log_softmax, [N(2, 3, 5)], ["LogSoftmax"]),
    Case("Conv2D_SAME_stride1", lambda x, w: tf.nn.conv2d(x, w, 1, "SAME"),
         [N(1, 5, 5, 2), N(3, 3, 2, 3)], ["Conv2D"], rtol=1e-4, atol=1e-5),
    Case("Conv2D_VALID_stride2", lambda x, w: tf.nn.conv2d(x, w, 2, "VALID"),
         [N(2, 7, 6, 3), N(3, 2, 3, 4)], ["Conv2D"], rtol=1e-4, atol=1e-5),
    Case("Conv2D_SAME_stride2_dilation", lambda x, w: tf.nn.conv2d(
        x, w, 1, "SAME", dilations=2), [N(1, 6, 6, 2), N(2, 2, 2, 2)], ["Conv2D"],
        rtol=1e-4, atol=1e-5),
    Case("Conv2D_explicit_padding", lambda x, w: tf.nn.conv2d(
        x, w, [1, 2, 1, 1], [[0, 0], [1, 0], [2, 1], [0, 0]]),
        [N(1, 5, 4, 2), N(3, 3, 2, 2)], ["Conv2D"], rtol=1e-4, atol=1e-5),
    Case("Conv2D_filter_only", lambda w: tf.nn.conv2d(tf.ones([1, 4, 4, 2]), w, 1, "SAME"),
         [N(2, 2, 2, 3)], ["Conv2D"], rtol=1e-4, atol=1e-5),
    Case("Mixed_dense_layer", lambda x, w, b: tf.nn.log_softmax(
        tf.tanh(tf.nn.bias_add(tf.matmul(x, w), b))),
         [N(4, 3), N(3, 5), N(5)], ["MatMul", "BiasAdd", "Tanh", "LogSoftmax"]),
    # Moved from the fallback list when direct rules were added:
    Case("MaxPool", lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID"), [Dis(1, 4, 4, 2)],
         ["MaxPool"]),
    Case("MaxPool_SAME_stride1", lambda x: tf.nn.max_pool2d(x, 3, 1, "SAME"),
         [Dis(1, 3, 3, 1)], ["MaxPool"]),
    Case("AvgPool", lambda x: tf.nn.avg_pool2d(x, 2, 1, "SAME"), [N(1, 4, 4, 2)], ["AvgPool"]),
    Case("SoftmaxCrossEntropyWithLogits", lambda lab, log: tf.nn.softmax_cross_entropy_with_logits(
        labels=tf.nn.softmax(lab), logits=log), [N(3, 4), N(3, 4)],
        ["SoftmaxCrossEntropyWithLogits"]),
    Case("SparseSoftmaxCrossEntropyWithLogits",
         lambda lab, log: tf.nn.sparse_softmax_cross_entropy_with_logits(labels=lab, logits=log),
         [I32(0, 3, 1), N(3, 4)], ["SparseSoftmaxCrossEntropyWithLogits"]),
]


# -- ops without a direct rule (fallback: transposed registered gradient) ------------

# What TF's forward mode does below depends on the TF release: the
# expectations ask the installed TF, never a table written for one release.

def _raises_without_gradient(op_type):
    """LookupError if the installed TF registers no gradient for ``op_type``:
    TF's forward mode of an op whose gradient runs ``op_type`` (transposed
    under a tape) then raises it, and so does fasttape's. None if TF has one
    or marks it NotDifferentiable (TF 2.21's ResizeBilinearGrad; TF 2.16
    registers nothing for it). The same question as the op corpus's second
    order (op_corpus.SECOND_ORDER_RUNS)."""
    return LookupError if tf_registers_no_gradient(op_type) else None


def _ops_tf_builds(fn, shape, among):
    """The op types of ``among`` the installed TF builds ``fn`` of a float32
    ``shape`` from (TF 2.16's exact gelu uses Erf, later releases Erfc)."""
    with tf.Graph().as_default() as graph:
        fn(tf.compat.v1.placeholder(tf.float32, shape))
    built = {op.type for op in graph.get_operations()}
    found = [op_type for op_type in among if op_type in built]
    assert found, f"none of {among} in {sorted(built)}"
    return found


_img = N(1, 4, 4, 2)

FALLBACK = [
    # TF registers no gradient for Snapshot: its forward mode raises LookupError.
    Case("Snapshot", lambda x: tf.raw_ops.Snapshot(input=x), [N(3, 4)], ["Snapshot"],
         tf_raises=_raises_without_gradient("Snapshot")),
    Case("Softplus", tf.nn.softplus, [N(2, 3)], ["Softplus"]),
    # TF transposes Softsign's gradient, SoftsignGrad, which has no gradient.
    Case("Softsign", tf.nn.softsign, [N(2, 3)], ["Softsign"],
         tf_raises=_raises_without_gradient("SoftsignGrad")),
    Case("Elu", tf.nn.elu, [N(2, 3)], ["Elu"]),
    Case("Selu", tf.nn.selu, [N(2, 3)], ["Selu"]),
    Case("LeakyRelu", lambda x: tf.nn.leaky_relu(x, 0.2), [Dis(2, 3)], ["LeakyRelu"]),
    Case("Relu6", tf.nn.relu6, [N(2, 5)], ["Relu6"]),
    Case("Atan", tf.math.atan, [N(4)], ["Atan"]),
    Case("Asin", tf.math.asin, [Unit(4)], ["Asin"]),
    Case("Acos", tf.math.acos, [Unit(4)], ["Acos"]),
    Case("Tan", tf.math.tan, [Unit(4)], ["Tan"]),
    Case("Sinh", tf.math.sinh, [N(4)], ["Sinh"]),
    Case("Cosh", tf.math.cosh, [N(4)], ["Cosh"]),
    Case("Atanh", tf.math.atanh, [Unit(4)], ["Atanh"]),
    Case("Erf", tf.math.erf, [N(4)], ["Erf"]),
    Case("Erfc", tf.math.erfc, [N(4)], ["Erfc"]),
    Case("Lgamma", tf.math.lgamma, [Pos(4)], ["Lgamma"]),
    Case("Digamma", tf.math.digamma, [Pos(4)], ["Digamma"]),
    Case("Abs", tf.abs, [Dis(5)], ["Abs"]),
    Case("ComplexAbs", tf.abs, [Cx(4)], ["ComplexAbs"]),
    Case("Real_Imag_Conj", lambda z: (tf.math.real(z), tf.math.imag(z), tf.math.conj(z)),
         [Cx(3)], ["Real", "Imag", "Conj"]),
    Case("Complex", tf.complex, [N(3), N(3)], ["Complex"]),
    Case("Rsqrt", tf.math.rsqrt, [Pos(4)], ["Rsqrt"]),
    Case("Reciprocal", tf.math.reciprocal, [Pos(4)], ["Reciprocal"]),
    Case("Log1p", tf.math.log1p, [Pos(4)], ["Log1p"]),
    Case("Expm1", tf.math.expm1, [N(4)], ["Expm1"]),
    Case("Sign", tf.sign, [Dis(4)], ["Sign"]),
    Case("Floor", tf.floor, [N(4)], ["Floor"]),
    Case("Round", tf.round, [N(4)], ["Round"]),
    Case("Pow", tf.pow, [Pos(2, 3), N(3)], ["Pow"]),
    Case("Pow_const_exponent", lambda x: x ** 3.5, [Pos(3)], ["Pow"]),
    Case("Atan2", tf.math.atan2, [N(3), Pos(3)], ["Atan2"]),
    Case("SquaredDifference", tf.math.squared_difference, [N(2, 3), N(3)],
         ["SquaredDifference"]),
    Case("Xlogy", tf.math.xlogy, [N(3), Pos(3)], ["Xlogy"]),
    Case("DivNoNan", tf.math.divide_no_nan, [N(3), Pos(3)], ["DivNoNan"]),
    Case("FloorMod", tf.math.floormod, [Pos(4), Pos(4)], ["FloorMod"]),
    Case("Maximum_broadcast", tf.maximum, [Dis(2, 3), Spec("n", 3)], ["Maximum"]),
    Case("Minimum", tf.minimum, [Dis(2, 3), N(2, 3)], ["Minimum"]),
    Case("ClipByValue", lambda x: tf.raw_ops.ClipByValue(
        t=x, clip_value_min=-0.5, clip_value_max=0.5), [Dis(6)], ["ClipByValue"]),
    Case("clip_by_value_composite", lambda x: tf.clip_by_value(x, -0.5, 0.5), [Dis(6)],
         ["Maximum", "Minimum"]),
    Case("SelectV2_broadcast", lambda c, a, b: tf.where(c, a, b),
         [np.array([True, False, True]), N(2, 3), N(3)], ["SelectV2"]),
    Case("Select", lambda c, a, b: tf.raw_ops.Select(condition=c, x=a, y=b),
         [np.array([[True, False], [False, True]]), N(2, 2), N(2, 2)], ["Select"]),
    Case("Where_leaky", lambda x: tf.where(x > 0, x, 0.1 * x), [Dis(2, 3)], ["SelectV2"]),
    Case("Where_GatherNd", lambda x: tf.gather_nd(x, tf.where(x > 0)), [Dis(3, 3)],
         ["GatherNd"]),
    Case("BooleanMask", lambda x: tf.boolean_mask(x, [True, False, True]), [N(3, 2)],
         ["GatherV2"]),
    Case("Prod", lambda x: tf.reduce_prod(x, axis=1), [N(2, 3)], ["Prod"]),
    Case("Max_keepdims", lambda x: tf.reduce_max(x, axis=0, keepdims=True), [Dis(3, 4)],
         ["Max"]),
    Case("Min", lambda x: tf.reduce_min(x, axis=[0, 1]), [Dis(2, 3, 2)], ["Min"]),
    Case("EuclideanNorm", lambda x: tf.raw_ops.EuclideanNorm(input=x, axis=1),
         [N(3, 4)], ["EuclideanNorm"]),
    # IsFinite (no gradient registered, bool output) inside: TF skips ops
    # without a differentiable output.
    Case("LogSumExp_composite", lambda x: tf.reduce_logsumexp(x, axis=-1), [N(2, 4)],
         ["Exp", "Log"]),
    Case("IsFinite_IsNan", lambda x: (tf.math.is_finite(x), tf.math.is_nan(x), x * 2.),
         [N(3)], ["Mul"]),
    Case("Cumsum", lambda x: tf.math.cumsum(x, axis=1), [N(2, 4)], ["Cumsum"]),
    Case("Cumsum_exclusive_reverse", lambda x: tf.math.cumsum(
        x, axis=0, exclusive=True, reverse=True), [N(3, 2)], ["Cumsum"]),
    Case("Cumprod", lambda x: tf.math.cumprod(x, axis=1), [Pos(2, 4)], ["Cumprod"]),
    Case("CumulativeLogsumexp", lambda x: tf.math.cumulative_logsumexp(x, axis=0),
         [N(4)], ["CumulativeLogsumexp"]),
    Case("Tile", lambda x: tf.tile(x, [2, 3]), [N(2, 2)], ["Tile"]),
    Case("BroadcastTo", lambda x: tf.broadcast_to(x, [3, 2, 4]), [N(2, 1)],
         ["BroadcastTo"]),
    Case("Pad", lambda x: tf.pad(x, [[1, 0], [0, 2]]), [N(2, 3)], ["Pad"]),
    Case("PadV2", lambda x: tf.pad(x, [[1, 1], [2, 0]], constant_values=3.), [N(2, 3)],
         ["PadV2"]),
    Case("MirrorPad", lambda x: tf.pad(x, [[1, 1], [2, 1]], mode="REFLECT"), [N(3, 4)],
         ["MirrorPad"]),
    Case("Slice", lambda x: tf.slice(x, [1, 0], [1, 2]), [N(3, 3)], ["Slice"]),
    Case("StridedSlice", lambda x: x[1:, ::2], [N(3, 5)], ["StridedSlice"]),
    Case("StridedSlice_newaxis_shrink", lambda x: x[..., None, 0], [N(2, 3, 4)],
         ["StridedSlice"]),
    Case("ReverseV2", lambda x: tf.reverse(x, [1]), [N(2, 3)], ["ReverseV2"]),
    Case("Roll", lambda x: tf.roll(x, 1, axis=0), [N(3, 2)], ["Roll"]),
    Case("Split", lambda x: tf.split(x, 2, axis=1), [N(3, 4)], ["Split"]),
    Case("SplitV", lambda x: tf.split(x, [1, 3], axis=1), [N(2, 4)], ["SplitV"]),
    Case("Unpack", lambda x: tf.unstack(x, axis=1), [N(2, 3)], ["Unpack"]),
    Case("TopKV2", lambda x: tf.math.top_k(x, k=2), [Dis(3, 5)], ["TopKV2"]),
    Case("Sort", lambda x: tf.sort(x, direction="DESCENDING"), [Dis(6)], ["TopKV2"]),
    Case("GatherNd", lambda x, i: tf.gather_nd(x, i),
         [N(3, 4), np.array([[0, 1], [2, 3], [0, 1]], np.int32)], ["GatherNd"]),
    Case("ScatterNd", lambda u: tf.scatter_nd([[1], [3]], u, [5, 2]), [N(2, 2)],
         ["ScatterNd"]),
    Case("TensorScatterUpdate", lambda x, u: tf.tensor_scatter_nd_update(
        x, [[0], [2]], u), [N(4, 2), N(2, 2)], ["TensorScatterUpdate"]),
    Case("UnsortedSegmentSum", lambda x, i: tf.math.unsorted_segment_sum(x, i, 3),
         [N(4, 2), I32(2, 0, 2, 1)], ["UnsortedSegmentSum"]),
    Case("SegmentMax", lambda x, i: tf.math.segment_max(x, i),
         [Dis(4, 2), I32(0, 0, 1, 1)], ["SegmentMax"]),
    Case("MaxPool3D", lambda x: tf.nn.max_pool3d(x, 2, 2, "VALID"), [Dis(1, 2, 4, 4, 1)],
         ["MaxPool3D"]),
    Case("Conv2DBackpropInput", lambda x, w: tf.nn.conv2d_transpose(
        x, w, [1, 6, 6, 2], strides=2, padding="SAME"),
        [N(1, 3, 3, 3), N(3, 3, 2, 3)], ["Conv2DBackpropInput"], rtol=1e-4, atol=1e-5),
    Case("Conv2DBackpropFilter", lambda x, dy: tf.raw_ops.Conv2DBackpropFilter(
        input=x, filter_sizes=[2, 2, 2, 3], out_backprop=dy, strides=[1, 1, 1, 1],
        padding="VALID"), [N(1, 4, 4, 2), N(1, 3, 3, 3)], ["Conv2DBackpropFilter"],
        rtol=1e-4, atol=1e-5),
    Case("DepthwiseConv2dNative", lambda x, w: tf.nn.depthwise_conv2d(
        x, w, [1, 1, 1, 1], "SAME"), [N(1, 4, 4, 2), N(2, 2, 2, 2)],
        ["DepthwiseConv2dNative"], rtol=1e-4, atol=1e-5),
    Case("Conv3D", lambda x, w: tf.nn.conv3d(x, w, [1, 1, 1, 1, 1], "VALID"),
         [N(1, 3, 3, 3, 1), N(2, 2, 2, 1, 2)], ["Conv3D"], rtol=1e-4, atol=1e-5),
    Case("L2Loss", tf.nn.l2_loss, [N(3, 2)], ["L2Loss"]),
    Case("Einsum_matmul", lambda a, b: tf.einsum("bij,bjk->bik", a, b),
         [N(2, 3, 4), N(2, 4, 2)], ["Einsum"]),
    Case("Einsum_contract", lambda a, b: tf.einsum("ij,ij->i", a, b), [N(3, 4), N(3, 4)],
         ["Einsum"]),
    Case("MatrixInverse", tf.linalg.inv, [Wc(3, 3)], ["MatrixInverse"]),
    Case("Cholesky", tf.linalg.cholesky, [Spd(3, 3)], ["Cholesky"]),
    Case("MatrixDeterminant", tf.linalg.det, [Wc(2, 3, 3)], ["MatrixDeterminant"]),
    Case("LogMatrixDeterminant", lambda a: tf.linalg.slogdet(a), [Wc(3, 3)],
         ["LogMatrixDeterminant"]),
    Case("MatrixSolve", tf.linalg.solve, [Wc(3, 3), N(3, 2)], ["MatrixSolve"]),
    Case("MatrixTriangularSolve", lambda a, b: tf.linalg.triangular_solve(a, b, lower=True),
         [Tril(3, 3), N(3, 2)], ["MatrixTriangularSolve"]),
    Case("LinearOperatorLowerTriangular",
         lambda l, b: (tf.linalg.LinearOperatorLowerTriangular(l).solve(b),
                       tf.linalg.LinearOperatorLowerTriangular(l).log_abs_determinant()),
         [Tril(3, 3), N(3, 2)], ["MatrixTriangularSolve", "MatrixDiagPartV3"]),
    Case("LinearOperatorFullMatrix_inverse",
         lambda a, x: tf.linalg.LinearOperatorFullMatrix(a).solvevec(x),
         [Wc(3, 3), N(3)], ["MatrixSolve"]),
    Case("SelfAdjointEigV2", lambda a: tf.linalg.eigh((a + tf.transpose(a)) / 2.),
         [Spd(3, 3)], ["SelfAdjointEigV2"], rtol=1e-4, atol=1e-5),
    Case("Qr", lambda a: tf.linalg.qr(a), [Wc(3, 3)], ["Qr"], rtol=1e-4, atol=1e-5),
    Case("MatrixBandPart", lambda x: tf.linalg.band_part(x, 1, 0), [N(3, 3)],
         ["MatrixBandPart"]),
    Case("MatrixDiagV3", tf.linalg.diag, [N(2, 3)], ["MatrixDiagV3"]),
    Case("MatrixSetDiagV3", tf.linalg.set_diag, [N(3, 3), N(3)], ["MatrixSetDiagV3"]),
    Case("Cross", tf.linalg.cross, [N(2, 3), N(2, 3)], ["Cross"]),
    Case("ResizeBilinear", lambda x: tf.image.resize(x, [6, 6], "bilinear"), [_img],
         ["ResizeBilinear"], tf_raises=_raises_without_gradient("ResizeBilinearGrad"),
         ip_skip="TF's gradient of ResizeBilinearGrad is None, so "
         "TF's JVP is None (fasttape mirrors it): the identity fails for TF too"),
    Case("ResizeNearestNeighbor", lambda x: tf.image.resize(x, [8, 8], "nearest"), [_img],
         ["ResizeNearestNeighbor"],
         tf_raises=_raises_without_gradient("ResizeNearestNeighborGrad")),
    Case("SpaceToDepth", lambda x: tf.nn.space_to_depth(x, 2), [_img], ["SpaceToDepth"]),
    Case("DepthToSpace", lambda x: tf.nn.depth_to_space(x, 2), [N(1, 2, 2, 4)],
         ["DepthToSpace"]),
    Case("ExtractImagePatches", lambda x: tf.image.extract_patches(
        x, [1, 2, 2, 1], [1, 1, 1, 1], [1, 1, 1, 1], "VALID"), [_img],
        ["ExtractImagePatches"]),
    Case("LRN", lambda x: tf.nn.local_response_normalization(x, depth_radius=1),
         [N(1, 2, 2, 4)], ["LRN"], tf_raises=_raises_without_gradient("LRNGrad")),
    Case("FusedBatchNormV3_training", lambda x, s, o: tf.compat.v1.nn.fused_batch_norm(
        x, s, o, is_training=True), [N(2, 3, 3, 4), Pos(4), N(4)], ["FusedBatchNormV3"],
        rtol=1e-4, atol=1e-5),
    Case("FusedBatchNormV3_inference", lambda x, s, o, m, v: tf.compat.v1.nn.fused_batch_norm(
        x, s, o, mean=m, variance=v, is_training=False)[0],
        [N(2, 2, 2, 3), Pos(3), N(3), N(3), Pos(3)], ["FusedBatchNormV3"],
        rtol=1e-4, atol=1e-5),
    Case("TanhGrad", lambda y, dy: tf.raw_ops.TanhGrad(y=y, dy=dy), [Unit(4), N(4)],
         ["TanhGrad"]),
    Case("SigmoidGrad", lambda y, dy: tf.raw_ops.SigmoidGrad(y=y, dy=dy), [Unit(4), N(4)],
         ["SigmoidGrad"]),
    Case("ReluGrad", lambda g, f: tf.raw_ops.ReluGrad(gradients=g, features=f),
         [N(4), Dis(4)], ["ReluGrad"]),
    Case("SoftplusGrad", lambda g, f: tf.raw_ops.SoftplusGrad(gradients=g, features=f),
         [N(4), N(4)], ["SoftplusGrad"]),
    Case("Gelu_composite", lambda x: tf.nn.gelu(x), [N(5)],
         _ops_tf_builds(tf.nn.gelu, [5], among=("Erf", "Erfc"))),
    # complex
    Case("Reciprocal_complex", tf.math.reciprocal, [Cx(3)], ["Reciprocal"]),
    Case("Cumsum_complex", lambda z: tf.math.cumsum(z, axis=1), [Cx(2, 3)], ["Cumsum"]),
    Case("MatrixInverse_complex", lambda z: tf.linalg.inv(z + 3. * tf.eye(3, dtype=z.dtype)),
         [Cx(3, 3)], ["MatrixInverse"], rtol=1e-4, atol=1e-5),
    Case("Einsum_complex", lambda a, b: tf.einsum("ij,jk->ik", a, b), [Cx(2, 3), Cx(3, 2)],
         ["Einsum"]),
]


def _ids(cases):
    return [c.param() for c in cases]


# Direct rules on float64 (the harness's tight tolerances: the rule's formula
# against TF's transposed gradient, to rounding) and on float16.
_F64 = ["AddV2_broadcast", "Sub_broadcast", "AddN", "Mul_broadcast", "RealDiv_broadcast",
        "Div", "Square", "Sqrt", "Exp", "Log", "Sin", "Cos", "Tanh", "Sigmoid", "Relu",
        "MatMul_transpose_both", "BatchMatMulV2_broadcast_batch",
        "BatchMatMulV2_adjoint_a", "Sum_axis_keepdims", "Mean_axes", "Reshape",
        "Transpose", "ExpandDims", "Squeeze_all", "ConcatV2", "Pack",
        "GatherV2_batch_dims", "BiasAdd_NHWC", "Softmax", "LogSoftmax",
        "Conv2D_VALID_stride2", "Conv2D_explicit_padding", "Mixed_dense_layer"]
_F16 = ["Mul_broadcast", "Tanh", "Sigmoid", "Exp", "MatMul", "Softmax", "Sum_all",
        "BiasAdd_rank2"]
_BY_ID = {c.id: c for c in DIRECT}
DIRECT_F64 = [_BY_ID[i].with_dtype(np.float64, "f64") for i in _F64]
DIRECT_F16 = [_BY_ID[i].with_dtype(np.float16, "f16", rtol=2e-2, atol=2e-2, ip_rtol=2e-2)
              for i in _F16]


@pytest.mark.parametrize("c", _ids(DIRECT + DIRECT_F64 + DIRECT_F16))
def test_direct_rule_parity(c):
    check_case(c)


@pytest.mark.parametrize("c", _ids(FALLBACK))
def test_fallback_parity(c):
    check_case(c)


@pytest.mark.parametrize("c", [c.param() for c in DIRECT + DIRECT_F64 + FALLBACK
                               if c.tf_raises is None and c.ip_skip is None])
def test_inner_product_identity(c):
    check_inner_product_identity(c)


# -- coverage of the rule table -----------------------------------------------------

_COVERED_ELSEWHERE = {
    "ReadVariableOp": "test_variable_primals_direct_rule (here) and test_forwardprop.py",
}


def test_every_direct_rule_has_a_case():
    covered = {op for c in DIRECT for op in c.ops} | set(_COVERED_ELSEWHERE)
    assert set(JVP_RULES) <= covered, sorted(set(JVP_RULES) - covered)


def test_fallback_cases_cover_at_least_40_op_types():
    fallback_ops = {op for c in FALLBACK for op in c.ops if op not in JVP_RULES}
    assert len(fallback_ops) >= 40, sorted(fallback_ops)


# -- special cases -----------------------------------------------------------------

def test_variable_primals_direct_rule():
    """ReadVariableOp: variables as primals, read explicitly and passed
    straight into ops (the fast path reads them in C++)."""
    def case(FA, GT):
        v = tf.Variable([[1., 2.], [3., 4.]])
        w = tf.Variable([0.5, -1.])
        x = tf.constant([[1., -1.], [2., 0.5]])
        with FA((v, w), (tf.constant([[1., 0.], [2., 1.]]), tf.constant([3., 1.]))) as acc:
            a = x * v
            b = tf.matmul(v, x) + w
            c = tf.nn.softplus(v.read_value())
            d = tf.nn.bias_add(v, w)
            e = tf.reduce_sum(tf.gather(v, [1, 0, 1]) * w)
        return [a, b, c, d, e], acc.jvp([a, b, c, d, e, v, w])

    with seen_by_fasttape() as seen:
        fwd_parity(case)
    assert ("ReadVariableOp", True) in seen, seen


def test_prevent_gradient():
    # TF's forward mode raises LookupError ('Gradient explicitly disabled').
    def case(FA, GT):
        x = tf.constant([1., 2.])
        with FA(x, tf.ones(2)) as acc:
            y = tf.raw_ops.PreventGradient(input=x, message="no grads")
        return acc.jvp(y)
    fwd_error(case, LookupError)


@pytest.mark.parametrize("op", ["Mod", "MatrixLogarithm"])
def test_op_without_any_gradient_raises_lookuperror(op):
    def case(FA, GT):
        if op == "Mod":
            x = tf.constant([2.5, 3.5])
            with FA(x, tf.ones(2)) as acc:
                y = tf.raw_ops.Mod(x=x, y=tf.constant([2., 2.]))
        else:
            x = tf.constant([[2., 0.], [0., 3.]], tf.complex64)
            with FA(x, tf.ones([2, 2], tf.complex64)) as acc:
                y = tf.linalg.logm(x)
        return acc.jvp(y)
    fwd_error(case, LookupError)


def test_keras_batch_normalization_training():
    import tf_keras

    def case(FA, GT):
        tf_keras.utils.set_random_seed(0)
        layer = tf_keras.layers.BatchNormalization()
        x = tf.constant(np.random.default_rng(0).standard_normal((2, 3, 3, 4)),
                        tf.float32)
        layer.build(x.shape)
        tangents = (tf.ones(4) * 0.5, tf.range(4, dtype=tf.float32),
                    tf.constant(np.random.default_rng(1).standard_normal((2, 3, 3, 4)),
                                tf.float32))
        with FA((layer.gamma, layer.beta, x), tangents) as acc:
            y = layer(x, training=True)
            loss = tf.reduce_mean(tf.square(y))
        return y, acc.jvp([y, loss])
    fwd_parity(case, rtol=1e-4, atol=1e-5)


def test_unary_fallback_ops_on_float64():
    """A few fallback ops on float64, with the harness's tight tolerances."""
    def case(FA, GT):
        x = tf.constant([0.3, -0.7, 1.2], tf.float64)
        with FA(x, tf.constant([1., 2., -1.], tf.float64)) as acc:
            outs = [tf.nn.softplus(x), tf.math.atan(x), tf.nn.elu(x), tf.math.erf(x),
                    tf.math.cumprod(x), tf.reduce_prod(x), x ** 3]
        return acc.jvp(outs)
    fwd_parity(case)
