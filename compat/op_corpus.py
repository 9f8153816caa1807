"""The op corpus: one small gradient case per TF op type, as a table.

Each entry names the TF op type it exercises, a function that calls TF's
public API (``tf.raw_ops`` where there is none; TF's internal Python
wrappers in the two places where raw ops cannot be used: CSR sparse matmul
and composite-tensor variants) and the specs of its inputs. ``expand()``
turns a table into runnable cases (one per dtype); a case's
``body(GradientTape)`` builds the inputs from a seeded RNG, records the op
under the given tape, reduces every selected output to a scalar with fixed
random weights (``sum(y * w)``; real and imaginary parts for complex
outputs) and returns the gradients with respect to every differentiable
input. Other ``*_body`` methods run the same case in other modes (variables,
persistent tape, second order, mixed tapes, output_gradients, outputs as
sources, jacobians, tf.function). ``compat/test_op_corpus.py`` and
``compat/test_op_corpus_modes.py`` run them under tf.GradientTape and
fasttape.GradientTape (``harness.assert_parity``).

Tables: TABLE (eager, ops with a gradient function), GRAPH_TABLE (ops that
only exist in a graph: control flow v2), EXTRAS (ops with no gradient
function: NotDifferentiable, or unknown to the registry).

    python compat/op_corpus.py --write-md     # regenerate compat/OP_CORPUS.md
    python compat/op_corpus.py --check        # TF-only run: errors, op coverage
    python compat/op_corpus.py --check --fasttape   # the same with fasttape
"""

import contextlib
import os
import sys
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import execute  # noqa: E402
from tensorflow.python.framework import op_callbacks  # noqa: E402
from tensorflow.python.framework import ops  # noqa: E402

r = tf.raw_ops
SEED = 20240601

# -- input specs -----------------------------------------------------------------


def _rand(rng, shape, lo, hi, dtype):
    dtype = tf.as_dtype(dtype)
    val = rng.uniform(lo, hi, size=shape)
    if dtype.is_complex:
        val = val + 1j * rng.uniform(lo, hi, size=shape)
    return val


class X:
    """A differentiable input (a gradient source) in the case's dtype.

    shape/lo/hi: uniform values in [lo, hi) (real and imaginary parts);
    make(rng, dtype) -> array: a custom builder (SPD matrices, ...);
    dtype: a fixed dtype instead of the case's; var: a tf.Variable;
    watch=False: a random constant that is not a source.
    """

    def __init__(self, shape=(2, 3), lo=-1.0, hi=1.0, dtype=None, var=False,
                 make=None, watch=True):
        self.shape, self.lo, self.hi = tuple(shape), lo, hi
        self.dtype, self.var, self.make, self.watch = dtype, var, make, watch

    def build(self, rng, dtype):
        dt = tf.as_dtype(self.dtype or dtype)
        if self.make is not None:
            val = self.make(rng, dt)
        else:
            val = _rand(rng, self.shape, self.lo, self.hi, dt)
        val = np.asarray(val).astype(dt.as_numpy_dtype)
        if self.var:
            return tf.Variable(val)
        return tf.constant(val)


def C(*args, **kwargs):
    """A random float constant (not a gradient source)."""
    return X(*args, watch=False, **kwargs)


class K:
    """A fixed constant tensor (indices, shapes, ...); never a source.
    dtype='case' gives it the case's dtype."""

    watch = False

    def __init__(self, value, dtype=None):
        self.value, self.dtype = value, dtype

    def build(self, rng, dtype):
        dt = dtype if self.dtype == "case" else self.dtype
        return tf.constant(self.value, dtype=dt)


class P:
    """A Python value passed through unchanged."""

    watch = False

    def __init__(self, value):
        self.value = value

    def build(self, rng, dtype):
        return self.value


# matrix / domain builders (each returns make(rng, dtype))

def spd(n, batch=()):
    def make(rng, dt):
        a = _rand(rng, batch + (n, n), -1, 1, dt)
        return a @ np.conj(np.swapaxes(a, -1, -2)) + n * np.eye(n)
    return make


def wellcond(m, n=None, batch=()):
    n = m if n is None else n

    def make(rng, dt):
        return _rand(rng, batch + (m, n), -0.5, 0.5, dt) + 2 * np.eye(m, n)
    return make


def symmetric(n):
    def make(rng, dt):
        a = _rand(rng, (n, n), -1, 1, dt)
        return (a + np.conj(a.T)) / 2 + np.diag(np.arange(n) * 1.5)
    return make


def lower_tri(n):
    def make(rng, dt):
        return np.tril(_rand(rng, (n, n), -0.5, 0.5, dt)) + 2 * np.eye(n)
    return make


def simplex(shape):
    def make(rng, dt):
        p = rng.uniform(0.1, 1.0, size=shape)
        return p / p.sum(-1, keepdims=True)
    return make


def banded(k, n):
    def make(rng, dt):
        b = rng.uniform(-0.5, 0.5, size=(k, n))
        b[0] += 2.5  # lower=True: the diagonal is the first row
        return b
    return make


def tridiag(n):
    def make(rng, dt):
        d = rng.uniform(-0.5, 0.5, size=(3, n))
        d[1] += 3.0
        return d
    return make


def distinct(shape, scale=1.0):
    """Well-separated values (no ties: max/top-k/sort gradients are unique)."""
    def make(rng, dt):
        n = int(np.prod(shape))
        return (rng.permutation(n).reshape(shape) - n / 2) * (scale / n)
    return make


def fbn_forward(x, scale, offset, version):
    """Training-mode FusedBatchNorm[V2|V3] forward returning the raw outputs."""
    f = {1: r.FusedBatchNorm, 2: r.FusedBatchNormV2, 3: r.FusedBatchNormV3}[version]
    c = scale.shape[0]
    return f(x=x, scale=scale, offset=offset, mean=tf.zeros([c]),
             variance=tf.ones([c]), epsilon=0.001, is_training=True)


# -- the case table ----------------------------------------------------------------


class Entry:
    """One row of the table.

    op: the TF op type claimed (checked under an op callback);
    fn(*built_args) -> any nest of tensors; args: input specs;
    dtypes: the case dtypes (the first is unmarked in the id);
    outs: indices into tf.nest.flatten(out, expand_composites=True) to reduce
      (None: every float/complex output);
    tag: id suffix for variants; tol: (rtol, atol) override;
    xfail: {dtype, mode or '*': reason} known fasttape bugs (strict xfail in
      that dtype's case / that mode's test / everywhere);
    raises: TF's gradient is expected to raise (the same type is required);
    graph: also run inside @tf.function in the graph-mode tests;
    no_modes: modes where TF itself cannot run the case ('variables',
      'persistent', 'second_order', 'output_gradients', 'intermediate', 'jacobian').
    """

    def __init__(self, op, fn, args, dtypes=("float32",), outs=None, tag="",
                 tol=None, xfail=None, raises=False, graph=False, no_modes=()):
        self.no_modes = tuple(no_modes)
        self.op, self.fn, self.args, self.dtypes = op, fn, list(args), tuple(dtypes)
        self.outs, self.tag, self.tol, self.raises = outs, tag, tol, raises
        self.xfail = xfail or {}
        self.graph = graph


TABLE = []
EXTRAS = []  # ops without a registered gradient function (NotDifferentiable / none)
GRAPH_TABLE = []  # ops that only exist inside a graph (checked while tracing)


def E(op, fn, args, **kw):
    TABLE.append(Entry(op, fn, args, **kw))


def EX(op, fn, args, **kw):
    EXTRAS.append(Entry(op, fn, args, **kw))


def G(op, fn, args, **kw):
    GRAPH_TABLE.append(Entry(op, fn, args, graph=True, **kw))


F32 = ("float32",)
F64 = ("float32", "float64")
FH = ("float32", "float64", "float16")
FC = ("float32", "float64", "complex64", "complex128")
FHC = ("float32", "float64", "float16", "complex64", "complex128")
C64 = ("complex64", "complex128")
FB = ("float32", "float64", "float16", "bfloat16")


def unary(op, fn, lo=-1.0, hi=1.0, shape=(2, 3), dtypes=F64, **kw):
    E(op, fn, [X(shape, lo, hi)], dtypes=dtypes, **kw)


def binary(op, fn, a=(-1.0, 1.0), b=(-1.0, 1.0), shapes=((2, 3), (2, 3)),
           dtypes=F64, **kw):
    E(op, fn, [X(shapes[0], *a), X(shapes[1], *b)], dtypes=dtypes, **kw)


# ---- elementwise unary math
E("Abs", tf.math.abs, [X(make=distinct((2, 3)))], dtypes=FH)
unary("Neg", tf.math.negative, dtypes=FHC)
unary("Sign", tf.math.sign)
# gradient None; multiplied by x so that None meets a real gradient
unary("Floor", tf.math.floor, -3, 3, dtypes=F32, tag="alone")
unary("Floor", lambda x: tf.math.floor(x) * x, -3, 3)
unary("Ceil", lambda x: tf.math.ceil(x) * x, -3, 3)
unary("Round", lambda x: tf.math.round(x) * x, -3, 3)
unary("Rint", lambda x: tf.math.rint(x) * x, -3, 3)
unary("Exp", tf.math.exp, dtypes=FHC, graph=True)
unary("Expm1", tf.math.expm1, dtypes=FC)
unary("Log", tf.math.log, 0.5, 2.0, dtypes=FHC)
unary("Log1p", tf.math.log1p, -0.5, 2.0, dtypes=FC)
unary("Sqrt", tf.math.sqrt, 0.5, 2.0, dtypes=FHC)
unary("Rsqrt", tf.math.rsqrt, 0.5, 2.0, dtypes=FHC)
unary("Square", tf.math.square, dtypes=FHC)
unary("Reciprocal", tf.math.reciprocal, 0.5, 2.0, dtypes=FHC)
unary("Inv", lambda x: r.Inv(x=x), 0.5, 2.0)
unary("Sin", tf.math.sin, -2, 2, dtypes=FHC, graph=True)
unary("Cos", tf.math.cos, -2, 2, dtypes=FHC)
unary("Tan", tf.math.tan, -1, 1, dtypes=FC)
unary("Asin", tf.math.asin, -0.9, 0.9)
unary("Acos", tf.math.acos, -0.9, 0.9)
unary("Atan", tf.math.atan, -2, 2)
unary("Sinh", tf.math.sinh, dtypes=FC)
unary("Cosh", tf.math.cosh, dtypes=FC)
unary("Tanh", tf.math.tanh, -2, 2, dtypes=FHC)
unary("Asinh", tf.math.asinh, -2, 2)
unary("Acosh", tf.math.acosh, 1.2, 3.0)
unary("Atanh", tf.math.atanh, -0.9, 0.9)
unary("Sigmoid", tf.math.sigmoid, -3, 3, dtypes=FHC)
unary("Erf", tf.math.erf, -2, 2, dtypes=FH)
unary("Erfc", tf.math.erfc, -2, 2)
unary("Erfinv", tf.math.erfinv, -0.9, 0.9)
unary("Ndtri", tf.math.ndtri, 0.1, 0.9)
unary("Lgamma", tf.math.lgamma, 0.5, 3.0)
unary("Digamma", tf.math.digamma, 0.5, 3.0)
unary("BesselI0", tf.math.special.bessel_i0, -2, 2)
unary("BesselI0e", tf.math.special.bessel_i0e, -2, 2)
unary("BesselI1", tf.math.special.bessel_i1, -2, 2)
unary("BesselI1e", tf.math.special.bessel_i1e, -2, 2)
unary("BesselJ0", tf.math.special.bessel_j0, -2, 2)
unary("BesselJ1", tf.math.special.bessel_j1, -2, 2)
unary("BesselK0", tf.math.special.bessel_k0, 0.5, 2)
unary("BesselK0e", tf.math.special.bessel_k0e, 0.5, 2)
unary("BesselK1", tf.math.special.bessel_k1, 0.5, 2)
unary("BesselK1e", tf.math.special.bessel_k1e, 0.5, 2)
unary("BesselY0", tf.math.special.bessel_y0, 0.5, 2)
unary("BesselY1", tf.math.special.bessel_y1, 0.5, 2)
unary("Dawsn", tf.math.special.dawsn, -2, 2)
unary("Expint", tf.math.special.expint, 0.5, 2)
unary("FresnelCos", tf.math.special.fresnel_cos, -2, 2)
unary("FresnelSin", tf.math.special.fresnel_sin, -2, 2)
unary("Spence", tf.math.special.spence, 0.5, 2)
unary("Relu", tf.nn.relu, dtypes=FB, graph=True)
unary("Relu6", tf.nn.relu6, -3, 8)
unary("Elu", tf.nn.elu, dtypes=FH)
unary("Selu", tf.nn.selu)
unary("LeakyRelu", lambda x: tf.nn.leaky_relu(x, alpha=0.2), dtypes=FH)
unary("Softplus", tf.math.softplus, -3, 3, dtypes=FH)
unary("Softsign", tf.math.softsign, -3, 3)
unary("Softmax", tf.nn.softmax, -2, 2, dtypes=FH, graph=True)
unary("LogSoftmax", tf.nn.log_softmax, -2, 2)
unary("Identity", tf.identity, dtypes=FHC)
unary("CheckNumerics", lambda x: tf.debugging.check_numerics(x, "corpus"))
unary("CheckNumericsV2", lambda x: r.CheckNumericsV2(tensor=x, message="corpus"))
unary("EnsureShape", lambda x: tf.ensure_shape(x, [2, None]))
unary("PlaceholderWithDefault", lambda x: r.PlaceholderWithDefault(input=x, shape=[2, 3]))
unary("DebugIdentityV2", lambda x: r.DebugIdentityV2(input=x) * 2.0)
unary("Print", lambda x: r.Print(input=x, data=[], message="", first_n=0))
unary("PreventGradient", lambda x: r.PreventGradient(input=x, message="corpus"),
      raises=True)
unary("L2Loss", tf.nn.l2_loss, dtypes=FH)
unary("Cast", lambda x: (lambda y: y * y)(
    tf.cast(x, tf.float32 if x.dtype == tf.float64 else tf.float64)), dtypes=FH)
E("Cast", lambda x: tf.cast(x, tf.complex64) ** 2, [X()], tag="to-complex64")
E("Cast", lambda x: tf.cast(x, tf.float32), [X()], dtypes=("complex64",),
  tag="from-complex64")

# complex <-> real
E("Complex", tf.complex, [X(), X()], dtypes=F64)
E("Real", tf.math.real, [X()], dtypes=C64)
E("Imag", tf.math.imag, [X()], dtypes=C64)
E("Conj", lambda z: tf.math.conj(z) * z * z, [X()], dtypes=C64)
E("Angle", tf.math.angle, [X(lo=0.2, hi=1.0)], dtypes=C64)
E("ComplexAbs", tf.math.abs, [X(lo=0.2, hi=1.0)], dtypes=C64)

# ---- elementwise binary math
binary("Add", lambda a, b: r.Add(x=a, y=b), dtypes=FHC)
binary("AddV2", tf.math.add, shapes=((2, 3), (3,)), dtypes=FB, graph=True)
binary("Sub", tf.math.subtract, shapes=((2, 1), (1, 3)), dtypes=FHC)
binary("Mul", tf.math.multiply, shapes=((2, 3), (1,)), dtypes=FB + C64, graph=True)
binary("Div", lambda a, b: r.Div(x=a, y=b), b=(0.5, 2))
binary("RealDiv", tf.math.truediv, b=(0.5, 2), shapes=((2, 3), (3,)), dtypes=FHC)
binary("DivNoNan", tf.math.divide_no_nan, b=(0.5, 2))
E("DivNoNan", tf.math.divide_no_nan, [X(), X(make=lambda rng, dt: [[0.5, 0.0, 2.0]])],
  tag="zero-den")
binary("MulNoNan", tf.math.multiply_no_nan)
binary("FloorDiv", lambda a, b: tf.math.floordiv(a, b) * a * b, (1, 4), (0.5, 2))
binary("FloorMod", tf.math.floormod, (1, 4), (0.5, 2))
binary("TruncateDiv", lambda a, b: r.TruncateDiv(x=a, y=b) * a * b, (1, 4), (0.5, 2))
binary("Maximum", tf.math.maximum, shapes=((2, 3), (3,)), dtypes=FH)
binary("Minimum", tf.math.minimum, shapes=((2, 3), (2, 1)), dtypes=FH)
binary("Pow", tf.math.pow, (0.5, 2), (-1, 1), dtypes=FHC)
binary("SquaredDifference", tf.math.squared_difference, shapes=((2, 3), (3,)), dtypes=FC)
binary("Atan2", tf.math.atan2, (0.2, 1), (-1, 1))
binary("Xlogy", tf.math.xlogy, b=(0.5, 2), dtypes=FC)
binary("Xlog1py", tf.math.xlog1py, b=(0.5, 2), dtypes=FC)
binary("Xdivy", tf.math.xdivy, b=(0.5, 2), dtypes=FC)
binary("Igamma", tf.math.igamma, (0.5, 2), (0.5, 2))
binary("Igammac", tf.math.igammac, (0.5, 2), (0.5, 2))
binary("Zeta", tf.math.zeta, (1.5, 3), (0.5, 2))
E("Polygamma", tf.math.polygamma, [K([[0, 1, 2], [1, 2, 3]], dtype="case"), X(lo=0.5, hi=2)],
  dtypes=F64)
E("Betainc", tf.math.betainc, [X(lo=0.5, hi=2), X(lo=0.5, hi=2), X(lo=0.1, hi=0.9)],
  dtypes=F64)
binary("NextAfter", tf.math.nextafter, dtypes=F64)
E("Select", lambda c, a, b: r.Select(condition=c, x=a, y=b),
  [K([[True, False, True], [False, True, False]]), X(), X()], dtypes=F64)
E("SelectV2", tf.where, [K([[True], [False]]), X(), X((3,))], dtypes=FC)
E("ClipByValue", lambda t, lo, hi: r.ClipByValue(t=t, clip_value_min=lo, clip_value_max=hi),
  [X(lo=-2, hi=2), X((), -0.5, -0.4), X((), 0.4, 0.5)])
E("AddN", lambda a, b, c: tf.math.add_n([a, b, c]), [X(), X(), X()], dtypes=FHC)
E("Einsum", lambda a, b: tf.einsum("ij,jk->ik", a, b), [X((2, 3)), X((3, 2))], dtypes=FC,
  graph=True)
E("Einsum", lambda a, b: tf.einsum("bij,bkj->bik", a, b), [X((2, 2, 3)), X((2, 4, 3))],
  tag="batch")
E("Cross", tf.linalg.cross, [X((2, 3)), X((2, 3))], dtypes=F64)

# ---- reductions, scans, segments
E("Sum", lambda x: tf.reduce_sum(x, axis=1), [X((2, 3))], dtypes=FHC)
E("Sum", lambda x: tf.reduce_sum(x, axis=[0, 2], keepdims=True), [X((2, 3, 2))], tag="keepdims")
E("Mean", lambda x: tf.reduce_mean(x, axis=0), [X((2, 3))], dtypes=FHC)
E("Mean", lambda x: tf.nn.moments(x, axes=[0])[1], [X((3, 2))], tag="moments-variance-only")
E("Max", lambda x: tf.reduce_max(x, axis=1), [X(make=distinct((2, 3)))], dtypes=FH)
E("Max", lambda x: tf.reduce_max(x, axis=1), [X(make=lambda rng, dt: [[1., 3., 3.], [2., 2., 0.]])],
  tag="ties")
E("Min", lambda x: tf.reduce_min(x, axis=0), [X(make=distinct((2, 3)))], dtypes=F64)
E("Prod", lambda x: tf.reduce_prod(x, axis=1), [X((2, 3), 0.5, 1.5)], dtypes=FC)
E("Prod", lambda x: tf.reduce_prod(x, axis=1),
  [X(make=lambda rng, dt: [[0.0, 2.0, 3.0], [0.0, 0.0, 1.5]])], tag="zeros")
E("EuclideanNorm", lambda x: tf.math.reduce_euclidean_norm(x, axis=1), [X()], dtypes=F64)
E("ArgMax", lambda x: tf.gather(x, tf.math.argmax(x)), [X((5,))])
E("ArgMin", lambda x: tf.gather(x, tf.math.argmin(x)), [X((5,))])
E("Cumsum", lambda x: tf.math.cumsum(x, axis=1), [X((2, 4))], dtypes=FC)
E("Cumsum", lambda x: tf.math.cumsum(x, axis=0, exclusive=True, reverse=True), [X((3, 2))],
  tag="exclusive-reverse")
E("Cumprod", lambda x: tf.math.cumprod(x, axis=1), [X((2, 4), 0.5, 1.5)], dtypes=F64)
E("Cumprod", lambda x: tf.math.cumprod(x, axis=1, exclusive=True, reverse=True),
  [X((2, 4), 0.5, 1.5)], tag="exclusive-reverse")
E("CumulativeLogsumexp", lambda x: tf.math.cumulative_logsumexp(x, axis=1), [X((2, 4))],
  dtypes=F64)
SEG = K([0, 0, 1, 3])
E("SegmentSum", lambda d, s: tf.math.segment_sum(d, s), [X((4, 2)), SEG], dtypes=F64)
E("SegmentMean", lambda d, s: tf.math.segment_mean(d, s), [X((4, 2)), SEG])
E("SegmentMax", lambda d, s: tf.math.segment_max(d, s), [X(make=distinct((4, 2))), SEG])
E("SegmentMin", lambda d, s: tf.math.segment_min(d, s), [X(make=distinct((4, 2))), SEG])
E("SegmentProd", lambda d, s: tf.math.segment_prod(d, s), [X((4, 2), 0.5, 1.5), SEG])
USEG = K([1, 0, 1, 3])
E("UnsortedSegmentSum", lambda d, s: tf.math.unsorted_segment_sum(d, s, 4),
  [X((4, 2)), USEG], dtypes=FC)
E("UnsortedSegmentMax", lambda d, s: tf.math.unsorted_segment_max(d, s, 4),
  [X(make=distinct((4, 2))), USEG])
E("UnsortedSegmentMin", lambda d, s: tf.math.unsorted_segment_min(d, s, 4),
  [X(make=distinct((4, 2))), USEG])
E("UnsortedSegmentProd", lambda d, s: tf.math.unsorted_segment_prod(d, s, 4),
  [X((4, 2), 0.5, 1.5), USEG])
SIDX, SSEG = K([0, 2, 3, 3]), K([0, 0, 1, 1])
E("SparseSegmentSum", lambda d, i, s: tf.sparse.segment_sum(d, i, s), [X((4, 2)), SIDX, SSEG])
E("SparseSegmentMean", lambda d, i, s: tf.sparse.segment_mean(d, i, s), [X((4, 2)), SIDX, SSEG])
E("SparseSegmentSqrtN", lambda d, i, s: tf.sparse.segment_sqrt_n(d, i, s),
  [X((4, 2)), SIDX, SSEG])
E("SparseSegmentSumWithNumSegments",
  lambda d, i, s: tf.sparse.segment_sum(d, i, s, num_segments=3), [X((4, 2)), SIDX, SSEG])
E("SparseSegmentMeanWithNumSegments",
  lambda d, i, s: tf.sparse.segment_mean(d, i, s, num_segments=3), [X((4, 2)), SIDX, SSEG])
E("SparseSegmentSqrtNWithNumSegments",
  lambda d, i, s: tf.sparse.segment_sqrt_n(d, i, s, num_segments=3), [X((4, 2)), SIDX, SSEG])

# ---- shape / indexing
E("Reshape", lambda x: tf.reshape(x, [3, 2]), [X()], dtypes=FC)
E("ExpandDims", lambda x: tf.expand_dims(x, 1), [X()])
E("Squeeze", lambda x: tf.squeeze(x, axis=1), [X((2, 1, 3))])
E("Transpose", lambda x: tf.transpose(x, [1, 0, 2]), [X((2, 3, 2))], dtypes=FC)
E("ConjugateTranspose", lambda x: tf.transpose(x, conjugate=True), [X()], dtypes=C64)
E("Tile", lambda x: tf.tile(x, [2, 1]), [X()], dtypes=FC)
E("BroadcastTo", lambda x: tf.broadcast_to(x, [2, 2, 3]), [X((1, 3))], dtypes=F64)
E("Fill", lambda v: tf.fill([2, 3], v), [X(())], dtypes=F64)
E("Pack", lambda a, b: tf.stack([a, b], axis=1), [X(), X()], dtypes=FC)
E("Unpack", lambda x: tf.unstack(x, axis=1), [X()], dtypes=F64)
E("Unpack", lambda x: tf.unstack(x, axis=0)[1], [X((3, 2))], tag="one-output")
E("ConcatV2", lambda a, b: tf.concat([a, b], axis=1), [X((2, 3)), X((2, 1))], dtypes=FC,
  graph=True)
E("Concat", lambda a, b: r.Concat(concat_dim=0, values=[a, b]), [X((2, 3)), X((1, 3))])
E("Split", lambda x: tf.split(x, 3, axis=1), [X((2, 6))], dtypes=F64)
E("Split", lambda x: tf.split(x, 3, axis=1)[1], [X((2, 6))], tag="one-output")
E("SplitV", lambda x: tf.split(x, [1, 3, 2], axis=1), [X((2, 6))])
E("SplitV", lambda x: tf.split(x, [1, 3, 2], axis=1)[2], [X((2, 6))], tag="one-output")
E("Slice", lambda x: tf.slice(x, [0, 1], [2, 2]), [X((3, 4))], dtypes=FC)
E("StridedSlice", lambda x: x[1:, ::2, tf.newaxis, -1], [X((3, 4, 2))], dtypes=FC, graph=True)
E("StridedSliceGrad", lambda dy: r.StridedSliceGrad(shape=[3, 4], begin=[1, 0], end=[3, 4],
                                                   strides=[1, 2], dy=dy), [X((2, 2))])
E("TensorStridedSliceUpdate",
  lambda x, v: r.TensorStridedSliceUpdate(input=x, begin=[0, 1], end=[2, 3], strides=[1, 1],
                                          value=v), [X((3, 4)), X((2, 2))])
E("Pad", lambda x: tf.pad(x, [[1, 0], [0, 2]]), [X()], dtypes=FC)
E("PadV2", lambda x: tf.pad(x, [[1, 0], [0, 2]], constant_values=1.5), [X()])
E("MirrorPad", lambda x: tf.pad(x, [[1, 1], [2, 1]], mode="REFLECT"), [X((3, 4))], dtypes=F64)
E("MirrorPad", lambda x: tf.pad(x, [[1, 1], [2, 1]], mode="SYMMETRIC"), [X((3, 4))],
  tag="symmetric")
E("MirrorPadGrad", lambda x: r.MirrorPadGrad(input=x, paddings=[[1, 1], [1, 0]],
                                             mode="REFLECT"), [X((4, 4))])
E("ReverseV2", lambda x: tf.reverse(x, axis=[1]), [X()], dtypes=FC)
E("Reverse", lambda x: r.Reverse(tensor=x, dims=[True, False]), [X()])
E("ReverseSequence", lambda x: tf.reverse_sequence(x, [1, 3], seq_axis=1, batch_axis=0),
  [X((2, 4, 2))])
E("Roll", lambda x: tf.roll(x, shift=[1, -1], axis=[0, 1]), [X((3, 4))], dtypes=F64)
E("Gather", lambda x: r.Gather(params=x, indices=[2, 0, 2]), [X((3, 2))])
E("GatherV2", lambda x: tf.gather(x, [2, 0, 2]), [X((3, 2))], dtypes=FC, graph=True)
E("GatherV2", lambda x: tf.gather(x, [[1, 0], [2, 1]], axis=1, batch_dims=1), [X((2, 3, 2))],
  tag="batch-dims")
E("GatherNd", lambda x: tf.gather_nd(x, [[0, 1], [2, 0], [0, 1]]), [X((3, 2))], dtypes=F64)
E("ResourceGather", lambda v: tf.gather(v, [2, 0, 2]), [X((3, 2), var=True)], dtypes=F64,
  graph=True)
E("ResourceGatherNd", lambda v: tf.gather_nd(v, [[0, 1], [2, 0]]), [X((3, 2), var=True)])
E("ReadVariableOp", lambda v: v.value() * v.read_value(), [X(var=True)], dtypes=FC)
E("ScatterNd", lambda u: tf.scatter_nd([[1], [3], [1]], u, [5, 2]), [X((3, 2))], dtypes=F64)
E("ScatterNdNonAliasingAdd",
  lambda x, u: r.ScatterNdNonAliasingAdd(input=x, indices=[[1], [3]], updates=u),
  [X((5, 2)), X((2, 2))])
E("TensorScatterUpdate", lambda x, u: tf.tensor_scatter_nd_update(x, [[1], [3]], u),
  [X((5, 2)), X((2, 2))], dtypes=F64)
E("TensorScatterAdd", lambda x, u: tf.tensor_scatter_nd_add(x, [[1], [3], [1]], u),
  [X((5, 2)), X((3, 2))])
E("TensorScatterSub", lambda x, u: tf.tensor_scatter_nd_sub(x, [[1], [3]], u),
  [X((5, 2)), X((2, 2))])
E("TensorScatterMax", lambda x, u: tf.tensor_scatter_nd_max(x, [[1], [3]], u),
  [X(make=distinct((5, 2))), X(make=distinct((2, 2), 0.7))])
E("TensorScatterMin", lambda x, u: tf.tensor_scatter_nd_min(x, [[1], [3]], u),
  [X(make=distinct((5, 2))), X(make=distinct((2, 2), 0.7))])
E("DynamicPartition", lambda x: tf.dynamic_partition(x, [0, 1, 1, 0, 2], 3), [X((5, 2))])
E("DynamicPartition", lambda x: tf.dynamic_partition(x, [0, 1, 1, 0, 2], 3)[1], [X((5, 2))],
  tag="one-output")
E("DynamicStitch", lambda a, b: tf.dynamic_stitch([[0, 2], [1, 3, 2]], [a, b]),
  [X((2, 2)), X((3, 2))])
E("ParallelDynamicStitch",
  lambda a, b: r.ParallelDynamicStitch(indices=[[0, 2], [1, 3]], data=[a, b]),
  [X((2, 2)), X((2, 2))])
E("Diag", tf.linalg.tensor_diag, [X((3,))], dtypes=F64)
E("DiagPart", tf.linalg.tensor_diag_part, [X((3, 3))])
E("MatrixDiag", lambda d: r.MatrixDiag(diagonal=d), [X((2, 3))])
E("MatrixDiagV2", lambda d: r.MatrixDiagV2(diagonal=d, k=1, num_rows=-1, num_cols=-1,
                                           padding_value=0.0), [X((2, 3))])
E("MatrixDiagV3", lambda d: tf.linalg.diag(d, k=(-1, 0), num_rows=3, num_cols=4),
  [X((2, 2, 3))], dtypes=F64)
E("MatrixDiagPart", lambda x: r.MatrixDiagPart(input=x), [X((2, 3, 3))])
E("MatrixDiagPartV2", lambda x: r.MatrixDiagPartV2(input=x, k=[0, 1], padding_value=0.0),
  [X((3, 4))])
E("MatrixDiagPartV3", lambda x: tf.linalg.diag_part(x, k=(-1, 1)), [X((3, 4))], dtypes=F64)
E("MatrixSetDiag", lambda x, d: r.MatrixSetDiag(input=x, diagonal=d), [X((3, 3)), X((3,))])
E("MatrixSetDiagV2", lambda x, d: r.MatrixSetDiagV2(input=x, diagonal=d, k=1),
  [X((3, 4)), X((3,))])
E("MatrixSetDiagV3", lambda x, d: tf.linalg.set_diag(x, d, k=(0, 1)), [X((3, 4)), X((2, 3))],
  dtypes=F64)
E("MatrixBandPart", lambda x: tf.linalg.band_part(x, 1, 0), [X((3, 4))], dtypes=F64)
E("SpaceToBatchND", lambda x: tf.space_to_batch(x, [2, 2], [[0, 0], [0, 0]]), [X((1, 4, 4, 2))])
E("BatchToSpaceND", lambda x: tf.batch_to_space(x, [2, 2], [[0, 0], [0, 0]]), [X((4, 2, 2, 1))])
E("SpaceToBatch", lambda x: r.SpaceToBatch(input=x, paddings=[[0, 0], [0, 0]], block_size=2),
  [X((1, 4, 4, 1))])
E("BatchToSpace", lambda x: r.BatchToSpace(input=x, crops=[[0, 0], [0, 0]], block_size=2),
  [X((4, 2, 2, 1))])
E("SpaceToDepth", lambda x: tf.nn.space_to_depth(x, 2), [X((1, 4, 4, 1))])
E("DepthToSpace", lambda x: tf.nn.depth_to_space(x, 2), [X((1, 2, 2, 4))])
E("IdentityN", lambda a, b: tf.identity_n([a, b]), [X(), X((3,))])
E("IdentityN", lambda a, b: tf.identity_n([a, b])[1], [X(), X((3,))], tag="one-output")

# ---- linear algebra
E("MatMul", tf.linalg.matmul, [X((2, 3)), X((3, 4))], dtypes=FB + C64, graph=True)
E("MatMul", lambda a, b: tf.linalg.matmul(a, b, transpose_a=True, transpose_b=True),
  [X((3, 2)), X((4, 3))], tag="transposed")
E("MatMul", lambda a, b: tf.linalg.matmul(a, b, adjoint_a=True), [X((3, 2)), X((3, 2))],
  dtypes=("complex64",), tag="adjoint")
E("BatchMatMul", lambda a, b: r.BatchMatMul(x=a, y=b, adj_y=True), [X((2, 2, 3)), X((2, 4, 3))])
E("BatchMatMulV2", lambda a, b: r.BatchMatMulV2(x=a, y=b), [X((2, 2, 3)), X((1, 3, 2))],
  dtypes=FC)
E("BatchMatMulV3", lambda a, b: r.BatchMatMulV3(x=a, y=b, Tout=a.dtype, adj_x=True),
  [X((2, 3, 2)), X((2, 3, 2))], dtypes=F64)
E("SparseMatMul", lambda a, b: r.SparseMatMul(a=a, b=b, a_is_sparse=True), [X((2, 3)), X((3, 2))])
E("Cholesky", tf.linalg.cholesky, [X(make=spd(3))], dtypes=FC, graph=True)
E("MatrixInverse", tf.linalg.inv, [X(make=wellcond(3))], dtypes=FC)
E("MatrixDeterminant", tf.linalg.det, [X(make=wellcond(3, batch=(2,)))], dtypes=FC)
E("LogMatrixDeterminant", tf.linalg.slogdet, [X(make=wellcond(3))], dtypes=F64)
E("LogMatrixDeterminant", lambda a: tf.linalg.slogdet(a)[1], [X(make=wellcond(3))],
  tag="logdet-only")
E("MatrixSolve", tf.linalg.solve, [X(make=wellcond(3)), X((3, 2))], dtypes=FC)
E("MatrixSolve", lambda a, b: tf.linalg.solve(a, b, adjoint=True), [X(make=wellcond(3)), X((3, 2))],
  tag="adjoint")
E("MatrixTriangularSolve", lambda a, b: tf.linalg.triangular_solve(a, b, lower=True),
  [X(make=lower_tri(3)), X((3, 2))], dtypes=FC)
E("MatrixTriangularSolve",
  lambda a, b: tf.linalg.triangular_solve(a, b, lower=False, adjoint=True),
  [X(make=lambda rng, dt: lower_tri(3)(rng, dt).T), X((3, 2))], tag="upper-adjoint")
E("BandedTriangularSolve", lambda a, b: tf.linalg.banded_triangular_solve(a, b, lower=True),
  [X(make=banded(2, 4)), X((4, 2))], dtypes=F64)
E("TridiagonalSolve",
  lambda d, b: tf.linalg.tridiagonal_solve(d, b, diagonals_format="compact"),
  [X(make=tridiag(4)), X((4, 2))], dtypes=F64)
E("TridiagonalMatMul",
  lambda d, b: tf.linalg.tridiagonal_matmul(d, b, diagonals_format="compact"),
  [X(make=tridiag(4)), X((4, 2))], dtypes=F64)
E("MatrixSolveLs",
  lambda a, b: r.MatrixSolveLs(matrix=a, rhs=b, l2_regularizer=tf.constant(0.0, tf.float64),
                               fast=True),
  [X(make=wellcond(4, 2)), X((4, 2))], dtypes=F64)
E("MatrixSquareRoot", tf.linalg.sqrtm, [X(make=spd(3))], dtypes=F64)
E("Qr", lambda a: tf.linalg.qr(a, full_matrices=False), [X(make=wellcond(3, 2))], dtypes=F64)
E("Qr", lambda a: tf.linalg.qr(a, full_matrices=False)[1], [X(make=wellcond(3, 3))],
  tag="r-only")
E("Svd", lambda a: tf.linalg.svd(a, compute_uv=True), [X(make=wellcond(3, 2))], dtypes=F64)
E("Svd", lambda a: tf.linalg.svd(a, compute_uv=False), [X(make=wellcond(3, 2))],
  tag="values-only")
E("Svd", lambda a: tf.linalg.svd(a, compute_uv=True)[0], [X(make=wellcond(2, 3))],
  tag="s-of-full")
E("SelfAdjointEigV2", tf.linalg.eigh, [X(make=symmetric(3))], dtypes=FC)
E("SelfAdjointEigV2", tf.linalg.eigvalsh, [X(make=symmetric(3))], tag="values-only")
E("SelfAdjointEigV2", lambda a: tf.linalg.eigh(a)[0], [X(make=symmetric(3))],
  tag="e-of-full")
E("Eig", lambda a: tf.linalg.eig(a)[0], [X(make=symmetric(3))], dtypes=C64)
E("Eig", tf.linalg.eigvals, [X(make=wellcond(3))], tag="values-only-real-input")

# ---- neural network
X4 = (1, 4, 4, 2)
E("BiasAdd", tf.nn.bias_add, [X((2, 3, 4)), X((4,))], dtypes=FH, graph=True)
E("BiasAdd", lambda x, b: tf.nn.bias_add(x, b, data_format="NCHW"), [X((1, 3, 2, 2)), X((3,))],
  tag="NCHW")
E("BiasAddV1", lambda x, b: r.BiasAddV1(value=x, bias=b), [X((2, 3)), X((3,))])
E("BiasAddGrad", lambda g: r.BiasAddGrad(out_backprop=g), [X((2, 3, 4))])
E("Conv2D", lambda x, f: tf.nn.conv2d(x, f, 1, "SAME"), [X(X4), X((2, 2, 2, 3))], dtypes=FH,
  graph=True)
E("Conv2D", lambda x, f: tf.nn.conv2d(x, f, 2, "VALID", dilations=1), [X((1, 5, 5, 2)),
                                                                       X((3, 3, 2, 2))],
  tag="strided-valid")
E("Conv2DBackpropInput", lambda x, f: tf.nn.conv2d_transpose(x, f, [1, 4, 4, 2], 2, "SAME"),
  [X((1, 2, 2, 3)), X((2, 2, 2, 3))], dtypes=F64)
E("Conv2DBackpropFilter",
  lambda x, g: r.Conv2DBackpropFilter(input=x, filter_sizes=[2, 2, 2, 3], out_backprop=g,
                                      strides=[1, 1, 1, 1], padding="SAME"),
  [X(X4), X((1, 4, 4, 3))])
E("Conv3D", lambda x, f: tf.nn.conv3d(x, f, [1] * 5, "SAME"), [X((1, 3, 3, 3, 2)),
                                                              X((2, 2, 2, 2, 2))], dtypes=F64)
E("Conv3DBackpropInputV2",
  lambda x, f: tf.nn.conv3d_transpose(x, f, [1, 4, 4, 4, 2], [1, 2, 2, 2, 1], "SAME"),
  [X((1, 2, 2, 2, 3)), X((2, 2, 2, 2, 3))])
E("Conv3DBackpropFilterV2",
  lambda x, g: r.Conv3DBackpropFilterV2(input=x, filter_sizes=[2, 2, 2, 2, 3], out_backprop=g,
                                        strides=[1] * 5, padding="SAME"),
  [X((1, 3, 3, 3, 2)), X((1, 3, 3, 3, 3))])
E("DepthwiseConv2dNative", lambda x, f: tf.nn.depthwise_conv2d(x, f, [1, 1, 1, 1], "SAME"),
  [X(X4), X((2, 2, 2, 2))], dtypes=F64)
E("DepthwiseConv2dNativeBackpropInput",
  lambda f, g: r.DepthwiseConv2dNativeBackpropInput(input_sizes=[1, 4, 4, 2], filter=f,
                                                    out_backprop=g, strides=[1, 1, 1, 1],
                                                    padding="SAME"),
  [X((2, 2, 2, 2)), X((1, 4, 4, 4))])
E("DepthwiseConv2dNativeBackpropFilter",
  lambda x, g: r.DepthwiseConv2dNativeBackpropFilter(input=x, filter_sizes=[2, 2, 2, 2],
                                                     out_backprop=g, strides=[1, 1, 1, 1],
                                                     padding="SAME"),
  [X(X4), X((1, 4, 4, 4))])
E("Dilation2D", lambda x, f: tf.nn.dilation2d(x, f, [1, 1, 1, 1], "SAME", "NHWC", [1, 1, 1, 1]),
  [X(make=distinct(X4)), X(make=distinct((2, 2, 2), 0.3))])
E("AvgPool", lambda x: tf.nn.avg_pool2d(x, 2, 2, "VALID"), [X(X4)], dtypes=FH)
E("AvgPool", lambda x: tf.nn.avg_pool2d(x, 3, 1, "SAME"), [X(X4)], tag="same")
E("MaxPool", lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID"), [X(make=distinct(X4))], dtypes=FH,
  graph=True)
E("MaxPoolV2", lambda x: r.MaxPoolV2(input=x, ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1],
                                     padding="VALID"), [X(make=distinct(X4))])
E("MaxPoolWithArgmax", lambda x: tf.nn.max_pool_with_argmax(x, 2, 2, "VALID").output,
  [X(make=distinct(X4))])
E("AvgPool3D", lambda x: tf.nn.avg_pool3d(x, 2, 2, "VALID"), [X((1, 4, 4, 4, 1))])
E("MaxPool3D", lambda x: tf.nn.max_pool3d(x, 2, 2, "VALID"), [X(make=distinct((1, 4, 4, 4, 1)))])
KS, ST = [1, 2, 2, 1], [1, 2, 2, 1]
E("AvgPoolGrad", lambda g: r.AvgPoolGrad(orig_input_shape=[1, 4, 4, 2], grad=g, ksize=KS,
                                         strides=ST, padding="VALID"), [X((1, 2, 2, 2))])
E("AvgPool3DGrad",
  lambda g: r.AvgPool3DGrad(orig_input_shape=[1, 4, 4, 4, 1], grad=g, ksize=[1, 2, 2, 2, 1],
                            strides=[1, 2, 2, 2, 1], padding="VALID"), [X((1, 2, 2, 2, 1))])


def _maxpool_grad(x, g, v2=False):
    y = tf.nn.max_pool2d(x, 2, 2, "VALID")
    if v2:
        return r.MaxPoolGradV2(orig_input=x, orig_output=y, grad=g, ksize=KS, strides=ST,
                               padding="VALID")
    return r.MaxPoolGrad(orig_input=x, orig_output=y, grad=g, ksize=KS, strides=ST,
                         padding="VALID")


def _maxpool_gradgrad(x, g):
    y = tf.nn.max_pool2d(x, 2, 2, "VALID")
    return r.MaxPoolGradGrad(orig_input=x, orig_output=y, grad=g, ksize=KS, strides=ST,
                             padding="VALID")


def _maxpool3d_grad(x, g, gradgrad=False):
    k = [1, 2, 2, 2, 1]
    y = tf.nn.max_pool3d(x, 2, 2, "VALID")
    f = r.MaxPool3DGradGrad if gradgrad else r.MaxPool3DGrad
    return f(orig_input=x, orig_output=y, grad=g, ksize=k, strides=k, padding="VALID")


E("MaxPoolGrad", _maxpool_grad, [X(make=distinct(X4)), X((1, 2, 2, 2))])
E("MaxPoolGradV2", lambda x, g: _maxpool_grad(x, g, True),
  [X(make=distinct(X4)), X((1, 2, 2, 2))])
E("MaxPoolGradGrad", _maxpool_gradgrad, [X(make=distinct(X4)), X(X4)])
E("MaxPool3DGrad", _maxpool3d_grad, [X(make=distinct((1, 4, 4, 4, 1))), X((1, 2, 2, 2, 1))])
E("MaxPool3DGradGrad", lambda x, g: _maxpool3d_grad(x, g, True),
  [X(make=distinct((1, 4, 4, 4, 1))), X((1, 4, 4, 4, 1))])
E("FractionalMaxPool",
  lambda x: tf.nn.fractional_max_pool(x, [1.0, 1.5, 1.5, 1.0], seed=7)[0],
  [X(make=distinct((1, 5, 5, 1)))])
E("FractionalAvgPool",
  lambda x: tf.nn.fractional_avg_pool(x, [1.0, 1.5, 1.5, 1.0], seed=7)[0], [X((1, 5, 5, 1))])
E("LRN", lambda x: tf.nn.local_response_normalization(x, depth_radius=1, bias=1.0, alpha=0.5,
                                                      beta=0.75), [X((1, 2, 2, 4))])
E("SoftmaxCrossEntropyWithLogits",
  lambda lab, lg: tf.nn.softmax_cross_entropy_with_logits(lab, lg),
  [X(make=simplex((3, 4))), X((3, 4))], dtypes=FH, graph=True)
E("SoftmaxCrossEntropyWithLogits",
  lambda lab, lg: r.SoftmaxCrossEntropyWithLogits(features=lg, labels=lab),
  [X(make=simplex((3, 4))), X((3, 4))], tag="loss-and-backprop")
E("SparseSoftmaxCrossEntropyWithLogits",
  lambda lg: tf.nn.sparse_softmax_cross_entropy_with_logits([0, 3, 1], lg), [X((3, 4))],
  dtypes=F64)
E("SparseSoftmaxCrossEntropyWithLogits",
  lambda lg: r.SparseSoftmaxCrossEntropyWithLogits(features=lg, labels=[0, 3, 1]),
  [X((3, 4))], tag="loss-and-backprop")
E("TopKV2", lambda x: tf.math.top_k(x, k=2), [X(make=distinct((2, 5)))], dtypes=F64, graph=True)
E("TopKV2", lambda x: tf.sort(x, direction="DESCENDING"), [X(make=distinct((2, 5)))],
  tag="sort")
E("ApproxTopK", lambda x: tf.math.approx_max_k(x, 2)[0], [X(make=distinct((2, 5)))])
E("NthElement", lambda x: r.NthElement(input=x, n=1, reverse=True), [X(make=distinct((2, 5)))])
E("IsotonicRegression", lambda x: tf.nn.isotonic_regression(x)[0], [X(make=distinct((2, 5)))])

_FBN_X, _FBN_C = X((2, 2, 2, 3)), X((3,), dtype="float32")
E("FusedBatchNormV3",
  lambda x, s, o: tf.compat.v1.nn.fused_batch_norm(x, s, o, is_training=True),
  [_FBN_X, _FBN_C, _FBN_C], dtypes=("float32", "float16"), graph=True)
E("FusedBatchNormV3",
  lambda x, s, o: tf.compat.v1.nn.fused_batch_norm(x, s, o, is_training=True)[0],
  [_FBN_X, _FBN_C, _FBN_C], tag="y-only")
E("FusedBatchNormV3",
  lambda x, s, o, m, v: tf.compat.v1.nn.fused_batch_norm(x, s, o, m, v, is_training=False)[0],
  [_FBN_X, _FBN_C, _FBN_C, X((3,), dtype="float32"), X((3,), 0.5, 1.5, dtype="float32")],
  tag="inference")
E("FusedBatchNorm", lambda x, s, o: fbn_forward(x, s, o, 1)[:3],
  [_FBN_X, _FBN_C, _FBN_C])
E("FusedBatchNormV2", lambda x, s, o: fbn_forward(x, s, o, 2)[0],
  [_FBN_X, _FBN_C, _FBN_C])
E("FusedBatchNormGrad",
  lambda g, x, s, o: r.FusedBatchNormGrad(
      y_backprop=g, x=x, scale=s, reserve_space_1=fbn_forward(x, s, o, 1)[3],
      reserve_space_2=fbn_forward(x, s, o, 1)[4], epsilon=0.001, is_training=True)[:3],
  [X((2, 2, 2, 3)), _FBN_X, _FBN_C, C((3,))])
E("FusedBatchNormGradV2",
  lambda g, x, s, o: r.FusedBatchNormGradV2(
      y_backprop=g, x=x, scale=s, reserve_space_1=fbn_forward(x, s, o, 2)[3],
      reserve_space_2=fbn_forward(x, s, o, 2)[4], epsilon=0.001, is_training=True)[:3],
  [X((2, 2, 2, 3)), _FBN_X, _FBN_C, C((3,))])


def _fbn_grad_v3(g, x, s, o):
    fw = fbn_forward(x, s, o, 3)
    return r.FusedBatchNormGradV3(
        y_backprop=g, x=x, scale=s, reserve_space_1=fw[3], reserve_space_2=fw[4],
        reserve_space_3=fw[5], epsilon=0.001, is_training=True)[:3]


E("FusedBatchNormGradV3", _fbn_grad_v3, [X((2, 2, 2, 3)), _FBN_X, _FBN_C, C((3,))])


def _block_lstm(x, cs, h, w, b, v2=False):
    cell = cs.shape[-1]
    z = tf.zeros([cell])
    kw = dict(seq_len_max=tf.constant(x.shape[0], tf.int64), x=x, cs_prev=cs, h_prev=h, w=w,
              wci=z, wcf=z, wco=z, b=b, cell_clip=-1.0, use_peephole=False)
    if v2:
        return r.BlockLSTMV2(**kw)
    return r.BlockLSTM(forget_bias=1.0, **kw)


_LSTM_ARGS = [X((3, 2, 2)), X((2, 2)), X((2, 2)), X((4, 8), -0.5, 0.5), X((8,), -0.5, 0.5)]
E("BlockLSTM", lambda *a: _block_lstm(*a)[6], _LSTM_ARGS, tag="h-only")
E("BlockLSTM", lambda *a: [_block_lstm(*a)[1], _block_lstm(*a)[6]], _LSTM_ARGS, tag="cs-and-h")
E("BlockLSTMV2", lambda *a: _block_lstm(*a, v2=True)[6], _LSTM_ARGS)


def _ctc(logits, v2=False):
    kw = dict(inputs=logits, labels_indices=tf.constant([[0, 0], [0, 1], [1, 0]], tf.int64),
              labels_values=[1, 2, 1], sequence_length=[4, 3])
    if v2:
        return r.CTCLossV2(**kw)
    return r.CTCLoss(**kw)


E("CTCLoss", lambda lg: _ctc(lg)[0], [X((4, 2, 4))])

# ---- image
IMG = (1, 3, 3, 2)
E("ResizeBilinear", lambda x: tf.image.resize(x, [5, 4], "bilinear"), [X(IMG)], dtypes=F64)
E("ResizeNearestNeighbor", lambda x: tf.image.resize(x, [5, 4], "nearest"), [X(IMG)])
E("ResizeBicubic", lambda x: tf.image.resize(x, [5, 4], "bicubic"), [X(IMG)])
E("ScaleAndTranslate", lambda x: tf.image.resize(x, [2, 2], "bilinear", antialias=True),
  [X((1, 4, 4, 2))])
E("CropAndResize",
  lambda im, bx: tf.image.crop_and_resize(im, bx, [0, 0], [2, 2]),
  [X((1, 4, 4, 2)), X(make=lambda rng, dt: [[0.1, 0.2, 0.8, 0.7], [0.0, 0.0, 0.6, 0.9]])])
E("RGBToHSV", tf.image.rgb_to_hsv, [X((2, 2, 3), 0.05, 0.95)])
E("ExtractImagePatches", lambda x: tf.image.extract_patches(x, [1, 2, 2, 1], [1, 1, 1, 1],
                                                            [1, 1, 1, 1], "VALID"), [X(IMG)])
E("ExtractVolumePatches",
  lambda x: tf.extract_volume_patches(x, [1, 2, 2, 2, 1], [1, 1, 1, 1, 1], "VALID"),
  [X((1, 3, 3, 3, 1))])
E("ImageProjectiveTransformV3",
  lambda im: r.ImageProjectiveTransformV3(
      images=im, transforms=[[1.0, 0.2, 0.3, 0.1, 1.0, -0.2, 0.0, 0.0]], output_shape=[4, 4],
      fill_value=0.5, interpolation="BILINEAR", fill_mode="CONSTANT"), [X((1, 4, 4, 2))])
E("ImageProjectiveTransformV2",
  lambda im: r.ImageProjectiveTransformV2(
      images=im, transforms=[[1.0, 0.2, 0.3, 0.1, 1.0, -0.2, 0.0, 0.0]], output_shape=[4, 4],
      interpolation="BILINEAR", fill_mode="REFLECT"), [X((1, 4, 4, 2))])

# ---- FFT
E("FFT", tf.signal.fft, [X((2, 4))], dtypes=C64)
E("IFFT", tf.signal.ifft, [X((2, 4))], dtypes=C64)
E("FFT2D", tf.signal.fft2d, [X((2, 2, 4))], dtypes=C64)
E("IFFT2D", tf.signal.ifft2d, [X((2, 2, 4))], dtypes=C64)
E("FFT3D", tf.signal.fft3d, [X((2, 2, 2))], dtypes=C64)
E("IFFT3D", tf.signal.ifft3d, [X((2, 2, 2))], dtypes=C64)
E("RFFT", tf.signal.rfft, [X((2, 6))], dtypes=F64)
E("RFFT", lambda x: tf.signal.rfft(x, [8]), [X((2, 6))], tag="padded")
E("IRFFT", tf.signal.irfft, [X((2, 4))], dtypes=C64)
E("RFFT2D", tf.signal.rfft2d, [X((2, 4, 4))])
E("IRFFT2D", tf.signal.irfft2d, [X((2, 4, 3))], dtypes=("complex64",))

# ---- random (seeded / stateless), quantization
E("RandomGamma", lambda a: tf.random.gamma([3], a, seed=3, dtype=a.dtype), [X((2,), 0.5, 2.0)],
  dtypes=F64)
E("StatelessRandomGammaV2",
  lambda a: r.StatelessRandomGammaV2(shape=[3, 2], seed=[1, 2], alpha=a), [X((2,), 0.5, 2.0)])
E("StatelessRandomGammaV3", lambda a: tf.random.stateless_gamma([3, 2], [1, 2], a, dtype=a.dtype),
  [X((2,), 0.5, 2.0)], dtypes=F64)
E("StatelessParameterizedTruncatedNormal",
  lambda m, s, lo, hi: tf.random.stateless_parameterized_truncated_normal(
      [4, 2], [1, 2], m, s, lo, hi),
  [X((2,), -0.2, 0.2), X((2,), 0.5, 1.0), X((2,), -1.5, -1.0), X((2,), 1.0, 1.5)])
E("FakeQuantWithMinMaxArgs",
  lambda x: tf.quantization.fake_quant_with_min_max_args(x, -1.0, 1.0), [X(lo=-1.5, hi=1.5)])
E("FakeQuantWithMinMaxVars",
  lambda x, lo, hi: tf.quantization.fake_quant_with_min_max_vars(x, lo, hi),
  [X(lo=-1.5, hi=1.5), X((), -1.1, -0.9), X((), 0.9, 1.1)])
E("FakeQuantWithMinMaxVarsPerChannel",
  lambda x, lo, hi: tf.quantization.fake_quant_with_min_max_vars_per_channel(x, lo, hi),
  [X(lo=-1.5, hi=1.5), X((3,), -1.1, -0.9), X((3,), 0.9, 1.1)])
E("QuantizeAndDequantizeV2",
  lambda x: r.QuantizeAndDequantizeV2(input=x, input_min=-1.0, input_max=1.0, range_given=True),
  [X(lo=-1.5, hi=1.5)])
E("QuantizeAndDequantizeV3",
  lambda x: r.QuantizeAndDequantizeV3(input=x, input_min=-1.0, input_max=1.0, num_bits=8,
                                      range_given=True), [X(lo=-1.5, hi=1.5)])
E("QuantizeAndDequantizeV4",
  lambda x, lo, hi: tf.quantization.quantize_and_dequantize_v2(x, lo, hi, range_given=True),
  [X(lo=-1.5, hi=1.5), X((), -1.1, -0.9), X((), 0.9, 1.1)])
E("QuantizeAndDequantizeV4Grad",
  lambda g, x, lo, hi: r.QuantizeAndDequantizeV4Grad(gradients=g, input=x, input_min=lo,
                                                     input_max=hi)[0],
  [X(), X(lo=-1.5, hi=1.5), X((), -1.1, -0.9), X((), 0.9, 1.1)],
  raises=True)  # TF's _QuantizeAndDequantizeV4GradGrad has the wrong arity

# ---- gradients of gradient ops (second order)
for _name, _args in [("EluGrad", ("gradients", "outputs")),
                     ("SeluGrad", ("gradients", "outputs")),
                     ("SoftplusGrad", ("gradients", "features")),
                     ("ReluGrad", ("gradients", "features")),
                     ("Relu6Grad", ("gradients", "features")),
                     ("SigmoidGrad", ("y", "dy")), ("TanhGrad", ("y", "dy")),
                     ("SqrtGrad", ("y", "dy")), ("RsqrtGrad", ("y", "dy")),
                     ("ReciprocalGrad", ("y", "dy")), ("InvGrad", ("y", "dy"))]:
    E(_name, (lambda f, a0, a1: lambda u, v: f(**{a0: u, a1: v}))(getattr(r, _name), *_args),
      [X(lo=0.3, hi=1.5), X(lo=0.3, hi=1.5)] if _args[0] == "y" else [X(), X(lo=-2, hi=2)],
      dtypes=F64)
E("LeakyReluGrad", lambda g, f: r.LeakyReluGrad(gradients=g, features=f, alpha=0.2),
  [X(), X(lo=-2, hi=2)])

# ---- sparse (SparseTensor values are the sources)
SP_IDX = [[0, 0], [0, 2], [1, 1], [2, 3]]
SP_SHAPE = [3, 4]


def sp(values, idx=SP_IDX, shape=SP_SHAPE):
    return tf.sparse.SparseTensor(tf.constant(idx, tf.int64), values,
                                  tf.constant(shape, tf.int64))


SPV = X((4,))
E("SparseToDense", lambda v: tf.sparse.to_dense(sp(v)), [SPV], dtypes=F64)
E("SparseAdd", lambda a, b: tf.sparse.add(sp(a), sp(b, [[0, 2], [1, 0], [2, 3]])),
  [SPV, X((3,))], dtypes=F64)
E("SparseTensorDenseAdd", lambda v, d: tf.sparse.add(sp(v), d), [SPV, X((3, 4))])
E("SparseTensorDenseMatMul", lambda v, d: tf.sparse.sparse_dense_matmul(sp(v), d),
  [SPV, X((4, 2))], dtypes=F64)
E("SparseTensorDenseMatMul",
  lambda v, d: tf.sparse.sparse_dense_matmul(sp(v), d, adjoint_a=True), [SPV, X((3, 2))],
  tag="adjoint-a")
E("SparseDenseCwiseMul", lambda v, d: (sp(v) * d).values, [SPV, X((3, 4))])
E("SparseDenseCwiseDiv", lambda v, d: (sp(v) / d).values, [SPV, X((3, 4), 0.5, 2)])
E("SparseDenseCwiseAdd",
  lambda v, d: r.SparseDenseCwiseAdd(sp_indices=tf.constant(SP_IDX, tf.int64), sp_values=v,
                                     sp_shape=tf.constant(SP_SHAPE, tf.int64), dense=d),
  [SPV, X((4,))], raises=True)  # TF: "Gradient for SparseDenseCwiseAdd is not implemented"
E("SparseReduceSum", lambda v: tf.sparse.reduce_sum(sp(v), axis=1), [SPV])
E("SparseReorder", lambda v: tf.sparse.reorder(sp(v, [[2, 3], [0, 0], [1, 1], [0, 2]])), [SPV])
E("SparseSlice", lambda v: tf.sparse.slice(sp(v), [0, 1], [3, 3]), [SPV])
E("SparseSoftmax", lambda v: tf.sparse.softmax(sp(v)), [SPV])
# TF's gradient functions take one output gradient for a two-output op: both raise
E("SparseSparseMaximum", lambda a, b: tf.sparse.maximum(sp(a), sp(b)),
  [X(make=distinct((4,))), X(make=distinct((4,), 0.7))], raises=True)
E("SparseSparseMinimum", lambda a, b: tf.sparse.minimum(sp(a), sp(b)),
  [X(make=distinct((4,))), X(make=distinct((4,), 0.7))], raises=True)
E("SparseFillEmptyRows", lambda v, d: tf.sparse.fill_empty_rows(sp(v, [[0, 0], [2, 1]],
                                                                   [4, 2]), d)[0],
  [X((2,)), X(())])


def _csr(dense):
    idx = tf.where(tf.not_equal(dense, 0))
    return r.DenseToCSRSparseMatrix(dense_input=dense, indices=idx)


def _csr_dense(m, dt=tf.float32):
    return r.CSRSparseMatrixToDense(sparse_input=m, type=dt)


def _csr_from_sp(v, idx=SP_IDX, shape=SP_SHAPE):
    return r.SparseTensorToCSRSparseMatrix(indices=tf.constant(idx, tf.int64), values=v,
                                           dense_shape=tf.constant(shape, tf.int64))


E("DenseToCSRSparseMatrix", lambda d: _csr_dense(_csr(d)), [X((3, 4))])
E("CSRSparseMatrixToDense", lambda v: _csr_dense(_csr_from_sp(v)), [SPV])
E("SparseTensorToCSRSparseMatrix",
  lambda v: r.CSRSparseMatrixToSparseTensor(sparse_matrix=_csr_from_sp(v), type=tf.float32)[1],
  [SPV])
E("CSRSparseMatrixToSparseTensor",
  lambda d: r.CSRSparseMatrixToSparseTensor(sparse_matrix=_csr(d), type=tf.float32)[1],
  [X((3, 4))])
E("SparseMatrixTranspose",
  lambda v: _csr_dense(r.SparseMatrixTranspose(input=_csr_from_sp(v), type=tf.float32)),
  [SPV])
E("SparseMatrixMatMul",
  lambda v, b: r.SparseMatrixMatMul(a=_csr_from_sp(v), b=b), [SPV, X((4, 2))])


def _csr_sparse_matmul(a, b):
    # raw_ops leave the CSR variants without handle data, which this op's
    # gradient reads; TF's own (internal) CSRSparseMatrix wrapper sets it.
    from tensorflow.python.ops.linalg.sparse import sparse_csr_matrix_ops as sm
    ma = sm.CSRSparseMatrix(sp(a))
    mb = sm.CSRSparseMatrix(sp(b, [[0, 0], [2, 0], [1, 1], [3, 2]], [4, 3]))
    return sm.matmul(ma, mb).to_dense()


E("SparseMatrixSparseMatMul", _csr_sparse_matmul, [SPV, X((4,))])

# ---- ragged
RSPLITS = K([0, 2, 2, 5], dtype=tf.int64)


def rt(values, splits):
    return tf.RaggedTensor.from_row_splits(values, splits, validate=False)


E("RaggedGather", lambda v, s: tf.gather(rt(v, s), [2, 0, 2]), [X((5,)), RSPLITS])
E("RaggedTensorToTensor", lambda v, s, d: rt(v, s).to_tensor(default_value=d),
  [X((5,)), RSPLITS, X(())], dtypes=F64)
E("RaggedTensorToSparse", lambda v, s: rt(v, s).to_sparse(), [X((5, 2)), RSPLITS])
E("RaggedTensorToVariant",
  lambda v, s: r.RaggedTensorFromVariant(
      encoded_ragged=r.RaggedTensorToVariant(rt_nested_splits=[s], rt_dense_values=v,
                                             batched_input=False),
      input_ragged_rank=1, output_ragged_rank=1, Tvalues=tf.float32, Tsplits=tf.int64),
  [X((5,)), RSPLITS])
E("RaggedTensorFromVariant",
  lambda v, s: r.RaggedTensorFromVariant(
      encoded_ragged=r.RaggedTensorToVariant(rt_nested_splits=[s], rt_dense_values=v,
                                             batched_input=True),
      input_ragged_rank=0, output_ragged_rank=1, Tvalues=tf.float32, Tsplits=tf.int64),
  [X((5,)), RSPLITS])
E("RaggedFillEmptyRows",
  lambda v, d: r.RaggedFillEmptyRows(value_rowids=tf.constant([0, 0, 2], tf.int64), values=v,
                                     nrows=tf.constant(4, tf.int64), default_value=d)[1],
  [X((3,)), X(())])

# ---- TensorList (variant handles)
ES = K([2], dtype=tf.int32)


def tl(x, es):
    return r.TensorListFromTensor(tensor=x, element_shape=es)


E("TensorListFromTensor",
  lambda x, es: r.TensorListGetItem(input_handle=tl(x, es), index=1, element_shape=es,
                                    element_dtype=tf.float32), [X((3, 2)), ES])
E("TensorListStack",
  lambda x, es: r.TensorListStack(input_handle=tl(x, es), element_shape=es,
                                  element_dtype=tf.float32), [X((3, 2)), ES])
E("TensorListGetItem",
  lambda x, es: [r.TensorListGetItem(input_handle=tl(x, es), index=i, element_shape=es,
                                     element_dtype=tf.float32) for i in (0, 2)],
  [X((3, 2)), ES])
E("TensorListSetItem",
  lambda x, it, es: r.TensorListStack(
      input_handle=r.TensorListSetItem(input_handle=tl(x, es), index=1, item=it),
      element_shape=es, element_dtype=tf.float32), [X((3, 2)), X((2,)), ES])
E("TensorListPushBack",
  lambda x, it, es: r.TensorListStack(
      input_handle=r.TensorListPushBack(input_handle=tl(x, es), tensor=it),
      element_shape=es, element_dtype=tf.float32), [X((3, 2)), X((2,)), ES])
E("TensorListPopBack",
  lambda x, es: r.TensorListPopBack(input_handle=tl(x, es), element_shape=es,
                                    element_dtype=tf.float32)[1], [X((3, 2)), ES],
  tag="tensor-only")
E("TensorListPopBack",
  lambda x, es: (lambda h, t: [t, r.TensorListStack(input_handle=h, element_shape=es,
                                                     element_dtype=tf.float32)])(
      *r.TensorListPopBack(input_handle=tl(x, es), element_shape=es, element_dtype=tf.float32)),
  [X((3, 2)), ES], tag="both")
E("TensorListGather",
  lambda x, es: r.TensorListGather(input_handle=tl(x, es), indices=[2, 0, 2], element_shape=es,
                                   element_dtype=tf.float32), [X((3, 2)), ES])
E("TensorListScatter",
  lambda x, es: r.TensorListStack(
      input_handle=r.TensorListScatter(tensor=x, indices=[2, 0, 1], element_shape=es),
      element_shape=es, element_dtype=tf.float32), [X((3, 2)), ES])
E("TensorListScatterV2",
  lambda x, es: r.TensorListStack(
      input_handle=r.TensorListScatterV2(tensor=x, indices=[3, 0], element_shape=es,
                                         num_elements=4),
      element_shape=es, element_dtype=tf.float32, num_elements=4)[:1], [X((2, 2)), ES])
E("TensorListScatterIntoExistingList",
  lambda x, u, es: r.TensorListStack(
      input_handle=r.TensorListScatterIntoExistingList(input_handle=tl(x, es), tensor=u,
                                                       indices=[2, 0]),
      element_shape=es, element_dtype=tf.float32), [X((3, 2)), X((2, 2)), ES])
E("TensorListConcat",
  lambda x, es: r.TensorListConcat(input_handle=tl(x, es), element_dtype=tf.float32,
                                   element_shape=[None, 2])[0], [X((3, 1, 2)), K([1, 2])])
E("TensorListConcatV2",
  lambda x, es: r.TensorListConcatV2(input_handle=tl(x, es), element_shape=[-1, 2],
                                     leading_dims=tf.constant([], tf.int64),
                                     element_dtype=tf.float32)[0], [X((3, 1, 2)), K([1, 2])])
E("TensorListSplit",
  lambda x: r.TensorListStack(
      input_handle=r.TensorListSplit(tensor=x, element_shape=[-1, 2],
                                     lengths=tf.constant([2, 2], tf.int64)),
      element_shape=[2, 2], element_dtype=tf.float32), [X((4, 2))])
E("TensorListResize",
  lambda x, es: r.TensorListStack(
      input_handle=r.TensorListResize(input_handle=tl(x, es), size=2), element_shape=es,
      element_dtype=tf.float32), [X((3, 2)), ES])

# ---- other variant / misc
# TF: Optional.from_value(variable) fails; a py_function's gradient can be taken once
E("OptionalFromValue", lambda x: tf.experimental.Optional.from_value(x).get_value() * 2.0,
  [X()], no_modes=("variables",))
E("OptionalGetValue",
  lambda a, b: tf.experimental.Optional.from_value((a, b)).get_value()[1], [X(), X((3,))],
  no_modes=("variables",))


def _composite_roundtrip(v, s):
    # No public API: TF's (internal) encoder builds the type-spec metadata.
    from tensorflow.python.ops import composite_tensor_ops as cto
    value = rt(v, s)
    enc = cto.composite_tensor_to_variants(value)
    spec = value._type_spec  # pylint: disable=protected-access
    return cto.composite_tensor_from_variant(enc, spec)


E("CompositeTensorVariantFromComponents", lambda v, s: _composite_roundtrip(v, s).values,
  [X((5,)), RSPLITS])
E("CompositeTensorVariantToComponents", lambda v, s: _composite_roundtrip(v, s).to_tensor(),
  [X((5, 2)), RSPLITS])
E("EagerPyFunc", lambda x: tf.py_function(lambda t: tf.sin(t) * t, [x], tf.float32), [X()],
  no_modes=("persistent", "jacobian"))
E("RandomGamma", lambda a: tf.random.gamma([2], a, beta=2.0, seed=5), [X((3,), 0.5, 2.0)],
  tag="beta")
E("AddV2",
  lambda a, b: a + tf.stop_gradient(b) * a, [X(), X()], tag="with-stop-gradient")
E("Mul", lambda a: tf.zeros_like(a) * a + a * a, [X()],
  tag="with-zeros-like")


# ---- the same tensor in several inputs of one op (one id, several input slots)
E("Mul", lambda x: x * x, [X()], tag="same-input", dtypes=F64)
E("AddV2", lambda x: x + x, [X()], tag="same-input")
E("Sub", lambda x: tf.math.subtract(x, x) + x, [X()], tag="same-input")
E("MatMul", lambda x: tf.linalg.matmul(x, x), [X((3, 3))], tag="same-input", dtypes=F64)
E("MatMul", lambda x: tf.linalg.matmul(x, x, transpose_b=True), [X((2, 3))],
  tag="same-input-transposed")
E("BatchMatMulV2", lambda x: r.BatchMatMulV2(x=x, y=x, adj_x=True), [X((2, 3, 3))],
  tag="same-input")
E("ConcatV2", lambda x: tf.concat([x, x, x], axis=0), [X()], tag="same-input")
E("Pack", lambda x: tf.stack([x, x]), [X()], tag="same-input")
E("AddN", lambda x, y: tf.math.add_n([x, y, x, x]), [X(), X()], tag="same-input")
E("Einsum", lambda x: tf.einsum("ij,kj->ik", x, x), [X()], tag="same-input")
E("Maximum", lambda x: tf.math.maximum(x, x), [X()], tag="same-input")
E("Minimum", lambda x: tf.math.minimum(x, x), [X()], tag="same-input")
E("Pow", lambda x: tf.math.pow(x, x), [X(lo=0.5, hi=2.0)], tag="same-input")
E("Xlogy", lambda x: tf.math.xlogy(x, x), [X(lo=0.5, hi=2.0)], tag="same-input")
E("Atan2", lambda x: tf.math.atan2(x, x), [X(lo=0.5, hi=2.0)], tag="same-input")
E("SquaredDifference", lambda x, y: tf.math.squared_difference(x, x) + x * y, [X(), X()],
  tag="same-input")
E("SelectV2", lambda x: tf.where([[True, False, True], [False, True, True]], x, x), [X()],
  tag="same-input")
E("DynamicStitch", lambda x: tf.dynamic_stitch([[0, 2], [1, 3]], [x, x]), [X((2, 2))],
  tag="same-input")
E("IdentityN", lambda x: tf.identity_n([x, x]), [X()], tag="same-input")
E("Complex", lambda x: tf.complex(x, x), [X()], tag="same-input")
E("Cross", lambda x: tf.linalg.cross(x, x), [X((2, 3))], tag="same-input")
E("MatrixSolve", lambda a: tf.linalg.solve(a, a), [X(make=wellcond(3))], tag="same-input")
E("Conv2D", lambda x: tf.nn.conv2d(x, tf.reshape(x, [2, 2, 1, 1]), 1, "SAME"),
  [X((1, 2, 2, 1))], tag="same-tensor-as-filter")
E("SparseTensorDenseMatMul",
  lambda v: tf.sparse.sparse_dense_matmul(sp(v, [[0, 0], [1, 1]], [2, 2]),
                                          tf.reshape(tf.concat([v, v], 0), [2, 2])),
  [X((2,))], tag="values-in-both")

# ---- gradients that arrive as IndexedSlices, alone or aggregated
E("GatherV2", lambda x: tf.gather(x, [0, 2]) * tf.gather(x, [1, 1]), [X((3, 2))],
  tag="twice")
E("GatherV2", lambda x: tf.gather(x, [0, 2]) + x[:2], [X((3, 2))], tag="plus-dense")
E("ResourceGather", lambda v: [tf.gather(v, [0, 2]), tf.gather(v, [1, 1])],
  [X((3, 2), var=True)], tag="twice")
E("ResourceGather", lambda v: [tf.gather(v, [0, 2]), v * 2.0], [X((3, 2), var=True)],
  tag="plus-dense")
E("Identity", lambda x: tf.gather(tf.identity(x), [2, 0]), [X((3, 2))],
  tag="before-gather")
E("Reshape", lambda x: tf.gather(tf.reshape(x, [3, 2]), [2, 0]), [X((2, 3))],
  tag="before-gather")
E("Cast", lambda x: tf.gather(tf.cast(x, tf.float64), [2, 0]), [X((3, 2))],
  tag="before-gather")
E("ConcatV2", lambda x, y: tf.gather(tf.concat([x, y], 0), [3, 0, 1]), [X((2, 2)), X((2, 2))],
  tag="before-gather")
E("UnsortedSegmentSum",
  lambda x: tf.math.unsorted_segment_sum(tf.gather(x, [0, 2, 2]), [1, 0, 1], 2),
  [X((3, 2))], tag="after-gather")

# ---- an integer output that is consumed (its zero gradient is built, or not)
E("TopKV2", lambda x, y: (lambda v, i: [v, tf.gather(y, i, batch_dims=1)])(
    *tf.math.top_k(x, k=2)), [X(make=distinct((2, 5))), X((2, 5))], tag="indices-used")
E("MaxPoolWithArgmax",
  lambda x, y: (lambda o, a: [o, tf.gather(tf.reshape(y, [-1]), tf.reshape(a, [-1]))])(
      *tf.nn.max_pool_with_argmax(x, 2, 2, "VALID", include_batch_in_index=True)),
  [X(make=distinct(X4)), X(X4)], tag="argmax-used")
E("UnsortedSegmentSum",
  lambda x, y: tf.math.unsorted_segment_sum(y, tf.unique(tf.round(x * 2.0))[1], 6),
  [X((6,)), X((6,))], tag="ids-from-unique")
E("ArgMax", lambda x: [tf.reduce_max(x, axis=1), tf.gather(x, tf.math.argmax(x, axis=1),
                                                              axis=1, batch_dims=1)],
  [X(make=distinct((2, 5)))], tag="with-max")

# ---- extras: no gradient function (NotDifferentiable or unregistered), not counted
EX("Unique", lambda x: tf.math.unsorted_segment_sum(x * 2.0, tf.unique(tf.round(x * 2.0))[1], 6),
   [X((6,))], tag="idx-only")
EX("Unique", lambda x: tf.unique(x)[0], [X((6,))], tag="values", raises=True)
EX("StopGradient", lambda x: tf.stop_gradient(x) * x, [X()])
EX("Shape", lambda x: tf.cast(tf.shape(x), tf.float32)[1] * x, [X()])
EX("ZerosLike", lambda x: tf.zeros_like(x) + x, [X()])
EX("OnesLike", lambda x: tf.ones_like(x) * x, [X()])
EX("Greater", lambda x: tf.where(x > 0.0, x, x * x), [X()])
EX("Equal", lambda x: tf.where(tf.equal(x, x), x, 2.0 * x), [X()])
EX("OneHot", lambda x: tf.one_hot(tf.argmax(x, axis=1), 3) * x, [X()])
EX("RandomStandardNormal", lambda x: tf.random.normal([2, 3], seed=1) * x, [X()])
EX("TruncatedNormal", lambda x: tf.random.truncated_normal([2, 3], seed=1) * x, [X()])
EX("AsString", lambda x: tf.strings.to_number(tf.strings.as_string(x)) * x, [X()])
EX("Bucketize", lambda x: tf.cast(tf.raw_ops.Bucketize(input=x, boundaries=[0.0]), x.dtype) * x,
   [X()])
EX("Multinomial",
   lambda x: tf.gather(x, tf.random.categorical(x, 2, seed=1)[0], axis=1), [X()])


# ---- graph-only: control flow v2 and ops whose gradient needs a graph op. The
# tape is inside a @tf.function; the claimed op is checked while tracing.
PRED = K(1.0)
PRED_FALSE = K(-1.0)


def _var_cond(x, v, p):
    return tf.cond(p > 0, lambda: tf.sin(x) * v, lambda: x * x)


def _while(x, p, v=None):
    def body(i, y):
        y = tf.sin(y) * x
        return i + 1, (y if v is None else y * v)
    return tf.while_loop(lambda i, y: i < 3, body, [tf.constant(0), x])[1]


G("StatelessIf", lambda x, p: tf.cond(p > 0, lambda: tf.sin(x), lambda: x * x), [X(), PRED])
G("StatelessIf", lambda x, p: tf.cond(p > 0, lambda: tf.sin(x), lambda: x * x),
  [X(), PRED_FALSE], tag="false-branch")
G("StatelessIf", lambda x, y, p: tf.cond(p > 0, lambda: (x * y, x), lambda: (x, y * y))[0],
  [X(), X(), PRED], tag="one-output")
G("If", _var_cond, [X(), X((3,), var=True), PRED])
G("StatelessWhile", lambda x, p: _while(x, p), [X((3,), -1, 1), PRED], dtypes=F64)
G("While", lambda x, v, p: _while(x, p, v), [X((3,), -1, 1), X((3,), var=True), PRED])
G("StatelessWhile",
  lambda x, p: tf.while_loop(
      lambda i, y: i < 3,
      lambda i, y: (i + 1, tf.cond(tf.reduce_sum(y) > 0, lambda: y * x, lambda: y - x)),
      [tf.constant(0), x])[1], [X((3,)), PRED], tag="nested-cond",
  no_modes=("jacobian",))  # TF's pfor cannot vectorize this gradient
G("StatelessWhile",
  lambda x, p: tf.while_loop(
      lambda i, ta: i < 3,
      lambda i, ta: (i + 1, ta.write(i, tf.sin(x) * tf.cast(i + 1, x.dtype))),
      [tf.constant(0), tf.TensorArray(x.dtype, size=3)])[1].stack(), [X((2,)), PRED],
  tag="tensor-array")
G("StatelessCase",
  lambda x, p: tf.switch_case(tf.cast(p, tf.int32), [lambda: x * 2.0, lambda: tf.sin(x),
                                                     lambda: x * x]), [X(), PRED])
G("Case",
  lambda x, v, p: tf.switch_case(tf.cast(p, tf.int32), [lambda: x * v, lambda: tf.sin(x) * v,
                                                        lambda: x * x]),
  [X((3,)), X((3,), var=True), PRED])


# Case ids whose second derivative TF itself cannot take (no gradient for the
# gradient's own ops, or TF's gradient function is broken): there fasttape
# must raise the same exception type.
SECOND_ORDER_TF_RAISES = {
    "BlockLSTM-cs-and-h", "BlockLSTM-h-only", "BlockLSTMV2", "CTCLoss", "CropAndResize",
    "Dilation2D", "FractionalMaxPool", "Igamma", "Igammac", "LRN", "MaxPoolGradV2",
    "MaxPoolWithArgmax", "MaxPoolWithArgmax-argmax-used", "QuantizeAndDequantizeV4",
    "RandomGamma", "RandomGamma-beta", "ResizeBicubic", "ScaleAndTranslate", "Softsign",
    "SparseMatrixSparseMatMul", "SparseSoftmax", "StatelessRandomGammaV2",
    "StatelessRandomGammaV3",
}

# Cases whose first-order gradient runs the op type named: TF can take their
# second derivative only where the installed release registers a gradient
# for it (TF 2.16 registers none for these, so TF raises LookupError; later
# releases mark them NotDifferentiable). Read from the installed TF, never
# from a table of releases (test_forwardprop_ops.py asks the same question).
SECOND_ORDER_RUNS = {
    "FakeQuantWithMinMaxArgs": "FakeQuantWithMinMaxArgsGradient",
    "FakeQuantWithMinMaxVars": "FakeQuantWithMinMaxVarsGradient",
    "FakeQuantWithMinMaxVarsPerChannel": "FakeQuantWithMinMaxVarsPerChannelGradient",
    "ResizeBilinear": "ResizeBilinearGrad",
}


def tf_registers_no_gradient(op_type):
    """Whether the installed TF has no gradient registered for ``op_type``
    (neither a function nor NotDifferentiable): a gradient that reaches it
    raises LookupError, under TF's tapes and fasttape's."""
    try:
        ops._gradient_registry.lookup(op_type)  # pylint: disable=protected-access
    except LookupError:
        return True
    return False


def second_order_tf_raises(case_id):
    """Whether TF, the release running, cannot take this case's second
    derivative."""
    return case_id in SECOND_ORDER_TF_RAISES or (
        case_id in SECOND_ORDER_RUNS and tf_registers_no_gradient(SECOND_ORDER_RUNS[case_id]))


# Case ids (besides the graph=True ones) also run as an eager pfor jacobian:
# ops with several outputs, of which some are unused or not float, where the
# backward pass traced by pfor must build zero output gradients.
EAGER_PFOR_IDS = {
    "SparseFillEmptyRows", "RaggedFillEmptyRows", "Split-one-output", "Unpack-one-output",
    "SplitV-one-output", "DynamicPartition-one-output", "IdentityN-one-output",
    "TopKV2-indices-used", "FusedBatchNormV3-y-only", "Svd-values-only", "Svd-s-of-full",
    "Qr-r-only", "SelfAdjointEigV2-e-of-full", "LogMatrixDeterminant-logdet-only",
    "SoftmaxCrossEntropyWithLogits-loss-and-backprop", "SparseSoftmaxCrossEntropyWithLogits",
    "MaxPoolWithArgmax-argmax-used", "IsotonicRegression", "BlockLSTM-h-only", "CTCLoss",
    "TensorListPopBack-tensor-only", "OptionalGetValue", "GatherV2-twice",
    "ResourceGather-twice", "UnsortedSegmentSum-ids-from-unique", "ArgMax-with-max",
}


# -- expansion into runnable cases ---------------------------------------------------


def _weights(rng, y, dtype):
    """Fixed pseudo-random weights shaped like ``y``: from the seeded RNG, or
    (a shape only known at run time, in a graph) a fixed formula."""
    if y.shape.is_fully_defined():
        return tf.constant(rng.standard_normal(y.shape).astype(dtype.as_numpy_dtype))
    n = tf.cast(tf.range(tf.size(y)), dtype)
    return tf.reshape(tf.sin(n * 1.7 + rng.uniform(0.0, 1.0)) * 1.5, tf.shape(y))


class Case:
    """One runnable (entry, dtype) pair."""

    def __init__(self, entry, dtype, primary):
        self.entry, self.dtype = entry, dtype
        self.op = entry.op
        parts = [entry.op]
        if entry.tag:
            parts.append(entry.tag)
        if not primary:
            parts.append(dtype)
        self.id = "-".join(parts)
        self.seed = (SEED + zlib.crc32(self.id.encode())) % (2 ** 31)
        self.xfail = entry.xfail.get(dtype) or entry.xfail.get("*")

    def xfail_in(self, mode):
        """The known-bug reason for this case in test ``mode``, if any."""
        return self.entry.xfail.get(mode) or self.xfail

    def __repr__(self):
        return f"Case({self.id})"

    def build(self, as_variables=False):
        """The inputs (fresh tensors, same values every call) and the sources.
        as_variables: every source becomes a tf.Variable (read by the op)."""
        tf.random.set_seed(self.seed)
        rng = np.random.default_rng(self.seed)
        args = [spec.build(rng, self.dtype) for spec in self.entry.args]
        if as_variables:
            args = [tf.Variable(a) if spec.watch and not isinstance(a, tf.Variable) else a
                    for a, spec in zip(args, self.entry.args)]
        sources = [a for a, spec in zip(args, self.entry.args) if spec.watch]
        return args, sources

    def reduce(self, out):
        """Scalar loss terms: sum(y * w) per selected float/complex output."""
        flat = tf.nest.flatten(out, expand_composites=True)
        if self.entry.outs is not None:
            flat = [flat[i] for i in self.entry.outs]
        rng = np.random.default_rng(self.seed + 1)
        terms = []
        for y in flat:
            if not (y.dtype.is_floating or y.dtype.is_complex):
                continue
            real = y.dtype.real_dtype
            w, w2 = _weights(rng, y, real), _weights(rng, y, real)
            if y.dtype.is_complex:
                terms.append(tf.reduce_sum(tf.math.real(y) * w)
                             + tf.reduce_sum(tf.math.imag(y) * w2))
            else:
                terms.append(tf.reduce_sum(y * w))
        if not terms:
            raise AssertionError(f"{self.id}: no float output to differentiate")
        return terms

    def _record(self, GradientTape, args, sources, persistent=False):
        with GradientTape(persistent=persistent) as tape:
            for s in sources:
                if not isinstance(s, tf.Variable):
                    tape.watch(s)
            terms = self.reduce(self.entry.fn(*args))
        if persistent:
            # twice, then the loss terms one at a time (the payloads must survive)
            return (tape.gradient(terms, sources), tape.gradient(terms, sources),
                    [tape.gradient(t, sources) for t in terms])
        return tape.gradient(terms, sources)

    def body(self, GradientTape):
        """The parity case: eager recording under ``GradientTape``."""
        args, sources = self.build()
        return self._record(GradientTape, args, sources)

    def variables_body(self, GradientTape):
        """The case with every source a tf.Variable (watched on access)."""
        args, sources = self.build(as_variables=True)
        return self._record(GradientTape, args, sources)

    def second_order_body(self, GradientTape):
        """Gradient of a weighted sum of the case's gradients (an outer tape
        records the inner tape's backward pass: TF's gradient functions, no
        fast rules)."""
        args, sources = self.build()
        with GradientTape() as outer:
            for s in sources:
                if not isinstance(s, tf.Variable):
                    outer.watch(s)
            grads = self._record(GradientTape, args, sources)
            dense = [tf.convert_to_tensor(g) for g in grads
                     if g is not None and (g.dtype.is_floating or g.dtype.is_complex)]
            terms = self.reduce(dense) if dense else []
        if not terms:
            return grads
        return grads, outer.gradient(terms, sources)

    def intermediate_body(self, GradientTape):
        """Gradients w.r.t. the inputs and the op's own (float) outputs, with
        unconnected_gradients='zero'."""
        args, sources = self.build()
        with GradientTape() as tape:
            for s in sources:
                if not isinstance(s, tf.Variable):
                    tape.watch(s)
            out = self.entry.fn(*args)
            terms = self.reduce(out)
        return tape.gradient(terms, sources + self._float_outputs(out),
                             unconnected_gradients="zero")

    def _float_outputs(self, out):
        flat = tf.nest.flatten(out, expand_composites=True)
        if self.entry.outs is not None:
            flat = [flat[i] for i in self.entry.outs]
        return [y for y in flat if y.dtype.is_floating or y.dtype.is_complex]

    def seeded_body(self, GradientTape):
        """The op's outputs themselves as targets, with the fixed weights as
        output_gradients (no reduction ops)."""
        args, sources = self.build()
        with GradientTape() as tape:
            for s in sources:
                if not isinstance(s, tf.Variable):
                    tape.watch(s)
            targets = self._float_outputs(self.entry.fn(*args))
        rng = np.random.default_rng(self.seed + 1)
        seeds = []
        for y in targets:
            w = _weights(rng, y, y.dtype.real_dtype)
            if y.dtype.is_complex:
                w = tf.complex(w, _weights(rng, y, y.dtype.real_dtype))
            seeds.append(w)
        return tape.gradient(targets, sources, output_gradients=seeds)

    def _jacobian(self, GradientTape, args, sources, use_pfor, min_rows=0):
        rng = np.random.default_rng(self.seed + 1)
        with GradientTape(persistent=True) as tape:
            for s in sources:
                if not isinstance(s, tf.Variable):
                    tape.watch(s)
            parts = []
            for y in self._float_outputs(self.entry.fn(*args)):
                real = y.dtype.real_dtype
                parts.append(tf.reshape(tf.math.real(y) * _weights(rng, y, real), [-1]))
                if y.dtype.is_complex:
                    parts.append(tf.reshape(tf.math.imag(y) * _weights(rng, y, real), [-1]))
            vec = tf.concat([tf.cast(p, parts[0].dtype) for p in parts], 0)
            if min_rows:
                # more rows than fasttape's per-row loop takes: pfor, eagerly
                vec = tf.tile(vec, [-(-min_rows // vec.shape[0])])
            elif vec.shape.is_fully_defined() and vec.shape[0] > 3:
                # 3 fixed random projections: a 3-row jacobian that still
                # depends on every output element
                proj = rng.standard_normal((3, vec.shape[0]))
                vec = tf.linalg.matvec(tf.constant(proj.astype(vec.dtype.as_numpy_dtype)), vec)
            # one target per source dtype (TF's non-pfor loop needs them equal)
            vecs = {s.dtype: vec if s.dtype == vec.dtype else tf.cast(vec, s.dtype)
                    for s in sources}
        return [tape.jacobian(vecs[s.dtype], s, experimental_use_pfor=use_pfor)
                for s in sources]

    def jacobian_body(self, GradientTape):
        """Eager tape.jacobian (no pfor: one backward pass per row, in both
        tapes) of 3 random projections of the weighted outputs w.r.t. every
        source."""
        args, sources = self.build()
        return self._jacobian(GradientTape, args, sources, use_pfor=False)

    def jacobian_pfor_body(self, GradientTape):
        """Eager tape.jacobian with pfor, of a target tiled to over 1024 rows
        (fasttape computes smaller eager jacobians row by row)."""
        args, sources = self.build()
        return self._jacobian(GradientTape, args, sources, use_pfor=True, min_rows=1025)

    def jacobian_graph_body(self, GradientTape):
        """tape.jacobian with pfor inside a @tf.function: the backward pass
        is traced and vectorized."""
        return self.graph_body(GradientTape, lambda T, a, s: self._jacobian(T, a, s, True))

    def _second_order(self, Outer, Inner):
        args, sources = self.build()
        with Outer() as outer:
            for s in sources:
                if not isinstance(s, tf.Variable):
                    outer.watch(s)
            grads = self._record(Inner, args, sources)
            dense = [tf.convert_to_tensor(g) for g in grads
                     if g is not None and (g.dtype.is_floating or g.dtype.is_complex)]
            terms = self.reduce(dense) if dense else []
        if not terms:
            return grads
        return grads, outer.gradient(terms, sources)

    def mixed_outer_tf_body(self, GradientTape):
        """Second order with tf.GradientTape outside, ``GradientTape`` inside."""
        return self._second_order(tf.GradientTape, GradientTape)

    def mixed_inner_tf_body(self, GradientTape):
        """Second order with ``GradientTape`` outside, tf.GradientTape inside."""
        return self._second_order(GradientTape, tf.GradientTape)

    def persistent_body(self, GradientTape):
        """The case on a persistent tape, gradients taken three ways."""
        args, sources = self.build()
        return self._record(GradientTape, args, sources, persistent=True)

    def graph_body(self, GradientTape, record=None):
        """The same case with the tape inside a @tf.function."""
        record = record or self._record
        args, sources = self.build()
        tensor_pos = [i for i, a in enumerate(args) if isinstance(a, tf.Tensor)]

        @tf.function(autograph=False)
        def run(*tensors):
            full = list(args)
            for i, t in zip(tensor_pos, tensors):
                full[i] = t
            srcs = [a for a, spec in zip(full, self.entry.args) if spec.watch]
            return record(GradientTape, full, srcs)

        return run(*[args[i] for i in tensor_pos])

    def executed_op_types(self, graph=False):
        """Op types executed by the case's forward function (eagerly), or
        created while tracing it into a @tf.function (graph=True)."""
        args, _ = self.build()
        fn = self.entry.fn
        if graph:
            fn = tf.function(fn, autograph=False)
        with collect_op_types() as seen:
            fn(*args)
        return seen


def expand(table=None):
    cases = []
    for entry in (TABLE if table is None else table):
        for i, dtype in enumerate(entry.dtypes):
            cases.append(Case(entry, dtype, primary=i == 0))
    ids = [c.id for c in cases]
    dup = {i for i in ids if ids.count(i) > 1}
    assert not dup, f"duplicate case ids: {sorted(dup)}"
    return cases


@contextlib.contextmanager
def collect_op_types():
    """Collect the op types executed while active (an op callback, removed after)."""
    seen = set()

    def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        seen.add(op_type.decode() if isinstance(op_type, bytes) else op_type)

    # Removing the thread's last callback resets execute.execute for every
    # thread (fasttape's callbacks in other threads would stop seeing
    # fallback-path ops): put back whatever was there before.
    previous = execute.execute
    op_callbacks.add_op_callback(callback)
    try:
        yield seen
    finally:
        op_callbacks.remove_op_callback(callback)
        execute.execute = previous


def registered_gradient_ops():
    """{op type: True if it has a gradient function, False if NotDifferentiable}."""
    reg = ops._gradient_registry  # pylint: disable=protected-access
    return {name: reg.lookup(name) is not None for name in reg.list()}


def covered_ops(graph=True, raising=False):
    """Registered op types with a gradient function that have a case expected
    to produce gradients (eager table, plus the graph-only table if ``graph``;
    cases where TF's gradient raises only if ``raising``)."""
    reg = registered_gradient_ops()
    entries = TABLE + (GRAPH_TABLE if graph else [])
    return sorted({e.op for e in entries if reg.get(e.op) and (raising or not e.raises)})


# -- why the rest is not covered ---------------------------------------------------

_GPU = "needs a GPU (kernel registered for GPU only)"
_RESOURCE = ("resource-internal / TF1-graph-only (TensorArray v1-v3 — TF2 uses TensorList —, "
             "stacks, queues, readers, tables, ref variables)")
REASONS = {
    "graph-only (TF1 control flow, ref types, session handles, graph rewrites)": [
        "Enter", "Exit", "Merge", "Switch", "LoopCond", "NextIteration", "RefEnter",
        "RefExit", "RefMerge", "RefNextIteration", "RefSwitch", "RefIdentity",
        "DebugGradientRefIdentity", "GetSessionHandle", "GetSessionHandleV2",
        "GetSessionTensor", "DeleteSessionTensor", "AccumulateNV2"],
    "tf.gradients only (its gradient reads op.name; tapes pass a _MockOp without it)": [
        "DebugGradientIdentity"],
    "collective / multi-device": [
        "AllToAll", "CollectivePermute", "CrossReplicaSum", "NcclAllReduce", "NcclBroadcast",
        "NcclReduce"],
    "TPU / XLA / DTensor": [
        "TPUEmbeddingActivations", "XlaClusterOutput", "XlaEinsum", "XlaSharding",
        "XlaSpmdFullToShardShape", "XlaSpmdShardToFullShape", "CopyToMesh", "CopyToMeshGrad",
        "Relayout", "RelayoutLike"],
    _GPU: ["CudnnRNN", "CudnnRNNV2", "CudnnRNNV3", "CTCLossV2", "SparseMatrixAdd",
           "SparseMatrixMul", "SparseMatrixSoftmax"],
    "deprecated op with no usable kernel in TF 2.21 (removed from GraphDef, or the CPU kernel "
    "needs an attr the op no longer has)": [
        "BatchNormWithGlobalNormalization", "QuantizeAndDequantize", "TopK"],
    "needs special setup (internal ops with no Python entry point)": ["_EagerConst"],
}
_RESOURCE_PREFIXES = ("TensorArray", "Stack", "Queue", "Reader", "LookupTable", "HashTable",
                      "MutableHashTable", "MutableDenseHashTable", "InitializeTable",
                      "Assign", "Scatter", "VarIsInitialized", "VariableShape")
_STRING = ("String", "Regex", "Decode", "Encode", "AsString", "Summary", "ParseTensor",
           "SerializeTensor", "ReduceJoin", "AudioMicrofrontend", "EditDistance")
_NOT_DIFF = "registered NotDifferentiable (gradient function is None)"


def uncovered_reasons():
    """{reason: [op types]} for registered op types with no case expected to
    produce gradients."""
    reg = registered_gradient_ops()
    covered = set(covered_ops())
    raising = {e.op for e in TABLE + GRAPH_TABLE if e.raises}
    explicit = {op: reason for reason, op_list in REASONS.items() for op in op_list}
    out = {}
    for op in sorted(reg):
        if op in covered:
            continue
        if not reg[op]:
            reason = _NOT_DIFF
        elif op in raising:
            reason = "covered only as error parity (TF's own gradient function raises)"
        elif op in explicit:
            reason = explicit[op]
        elif op.startswith(_RESOURCE_PREFIXES) or op.endswith("Reader"):
            reason = _RESOURCE
        elif any(t in op for t in _STRING):
            reason = "string / summary / proto / IO"
        else:
            reason = "not reached yet"
        out.setdefault(reason, []).append(op)
    return out


def write_md(path):
    reg = registered_gradient_ops()
    cases, graph_cases, extras = expand(), expand(GRAPH_TABLE), expand(EXTRAS)
    by_op = {}
    for c in cases + graph_cases:
        by_op.setdefault(c.op, []).append(f"`{c.id}`" + (" (graph)" if c.entry in GRAPH_TABLE
                                                          else ""))
    covered = covered_ops()
    n_eager = len(covered_ops(graph=False))
    n_diff = sum(reg.values())
    graph_marked = sorted(c.id for c in cases if c.entry.graph and c.dtype == c.entry.dtypes[0])
    lines = [
        "# Op corpus coverage",
        "",
        "Generated by `python compat/op_corpus.py --write-md`; do not edit by hand.",
        "",
        f"TensorFlow {tf.__version__}: {len(reg)} op types in the gradient registry, "
        f"{n_diff} with a gradient function, {len(reg) - n_diff} registered NotDifferentiable.",
        "",
        f"`compat/test_op_corpus.py` covers **{len(covered)}** op types that have a gradient "
        f"function ({n_eager} eagerly, {len(covered) - n_eager} more in graph mode only), "
        f"in {len(cases)} eager cases and {len(graph_cases)} graph-only cases, plus "
        f"{len(extras)} cases on ops with no gradient function. Each case runs under "
        "tf.GradientTape and fasttape.GradientTape and compares the gradients of "
        "`sum(y * w)` (fixed random `w`, every selected output) with respect to every "
        "float input; its forward function is checked, under an op callback, to execute "
        "the op type it names. A dtype suffix marks the non-primary dtypes of an op.",
        "",
        "The primary-dtype case of every op also runs with every source a `tf.Variable`, "
        "on a persistent tape (gradient twice, then per loss term) and to second order "
        f"(`test_op_corpus.py`; second derivatives TF cannot take — {len(SECOND_ORDER_TF_RAISES)} "
        "cases, listed in `op_corpus.SECOND_ORDER_TF_RAISES` — must raise the same exception "
        "type) and to second order with `tf.GradientTape` and the tape under test nested "
        "either way; and with the op's outputs as targets (`output_gradients`) and as extra "
        "sources, and as an eager `jacobian` (`test_op_corpus_modes.py`; also an eager "
        "pfor `jacobian` of over 1024 rows for the ids in `op_corpus.EAGER_PFOR_IDS`).",
        "",
        "Rerun with the tape inside `@tf.function` (graph mode; also a pfor `jacobian`): "
        + ", ".join(f"`{i}`" for i in graph_marked) + ", and the graph-only cases marked "
        "(graph) below.",
        "",
        "## Covered op types",
        "",
        "| op type | cases |",
        "|---|---|",
    ]
    for op in covered:
        lines.append(f"| `{op}` | {', '.join(by_op[op])} |")
    lines += ["", "## Cases on ops with no gradient function (not counted)", "",
              ", ".join(f"`{c.id}`" for c in extras), "",
              "## Registered op types not covered, by reason", ""]
    for reason, op_list in sorted(uncovered_reasons().items(),
                                  key=lambda kv: (kv[0] == _NOT_DIFF, kv[0])):
        names = ", ".join(f"`{o}`" for o in op_list)
        if reason.startswith("covered only as error parity"):
            names = ", ".join(f"`{o}` ({', '.join(by_op[o])})" for o in op_list)
        lines += [f"### {reason} ({len(op_list)})", "", names, ""]
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")


def _check(impl="tf"):
    """Run every case with one tape only: errors and claimed-op coverage."""
    import time
    if impl == "tf":
        tape = tf.GradientTape
    else:
        import fasttape
        tape = fasttape.GradientTape
    reg = registered_gradient_ops()
    bad = 0
    groups = [(c, False) for c in expand() + expand(EXTRAS)] + \
        [(c, True) for c in expand(GRAPH_TABLE)]
    for c, graph in groups:
        t0 = time.perf_counter()
        try:
            res = (c.graph_body if graph else c.body)(tape)
            err = None
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {str(e)[:300]}"
            res = None
        dt = time.perf_counter() - t0
        try:
            seen = c.executed_op_types(graph=graph)
        except Exception as e:  # noqa: BLE001
            seen = set()
            err = (err or "") + f" | coverage: {type(e).__name__}: {str(e)[:150]}"
        msgs = []
        if err and not c.entry.raises:
            msgs.append("ERROR " + err)
        if c.op not in seen:
            msgs.append(f"op not executed; saw {sorted(seen)}")
        if c.entry not in EXTRAS and c.op not in reg:
            msgs.append("not in gradient registry")
        if res is not None and all(g is None for g in res):
            msgs.append("all gradients None")
        if msgs:
            bad += 1
            print(f"{c.id:45s} {dt * 1000:7.1f}ms  " + " ; ".join(msgs))
    print("problems:", bad, "covered:", len(covered_ops()), "eager cases:", len(expand()))


if __name__ == "__main__":
    if "--write-md" in sys.argv:
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "OP_CORPUS.md")
        write_md(out)
        print("wrote", out, "covered:", len(covered_ops()))
    if "--check" in sys.argv:
        _check("fasttape" if "--fasttape" in sys.argv else "tf")
