"""Per-example gradient rules at the op level (ghost norms, book-keeping).

For an op whose output has the batch on its leading axis and one of whose
inputs is a source (a parameter shared by every example), the gradient of
that source is a sum over examples of terms each built from example i's
saved input and example i's output gradient. A rule computes, from the
op's saved payload and its output gradient ``g`` (the per-example
cotangents stacked on the batch axis, as the backward pass of
``sum(losses)`` hands them over when examples are independent):

  sq_norms(payload, pos, g)        [B] squared norms of each example's
                                   gradient of input ``pos`` (without
                                   building it where an identity allows:
                                   |a_i|^2 |g_i|^2 for z = a W);
  weighted(payload, pos, g, w)     sum_i w_i grad_i, the source's gradient of
                                   the reweighted loss (one op, no second
                                   backward pass);
  per_example(payload, pos, g)     [B] + source shape, every example's
                                   gradient.

``applies(payload, pos, out_shape, src_shape, batch)`` decides before the
pass (shapes, attributes, what the payload saved). Each rule is an entry of
NORM_RULES, keyed by op type; an op type without one sends its sources to
the per-example rows (one backward pass per example).
"""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
import numpy as np
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import indexed_slices
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import array_ops_stack
from tensorflow.python.ops import cond
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import gen_nn_ops
from tensorflow.python.ops import linalg_ops_impl
from tensorflow.python.ops import math_ops
from tensorflow.python.ops import special_math_ops

from tensorflow.python.eager import context
from tensorflow.python.framework import constant_op
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_util

from fasttape.gradients import _fast_grads
from fasttape.gradients._graph_ops import graph_op
from fasttape.gradients._payloads import EagerOp


# The rules run eagerly, op by op, or inside dp_gradient's traced
# post-pass (gradients._compiled.post_pass): these three build an op, a
# constant and a cached tensor either way.

def _ex(op_type, *args):
    """An op by type, inputs then flat (name, value) attrs, as TF's fast
    path takes them; in a graph, through TF's op builder."""
    if context.executing_eagerly():
        return _fast_grads._ex(op_type, *args)  # pylint: disable=protected-access
    n = len(op_def_registry.get(op_type).input_arg)
    return graph_op(op_type, args[:n], args[n:])[0]


def _const(value, dtype):
    if context.executing_eagerly():
        return _fast_grads._const(value, dtype)  # pylint: disable=protected-access
    return constant_op.constant(value, dtype=dtype)


def _cached(key, make):
    if context.executing_eagerly():
        return _fast_grads._cached(key, make)  # pylint: disable=protected-access
    return make()


def attr(payload, name, default=None):
    """An attribute of an eager op's flat (name, value, ...) attrs."""
    attrs = payload.attrs
    for i in range(0, len(attrs) - 1, 2):
        if attrs[i] == name:
            return attrs[i + 1]
    return default


def value_of(t):
    """A config input's value (an axis, a size) as numpy: an eager
    tensor's, or a traced tensor's where it is a constant while tracing
    (else None). Rules read config inputs through it: while tracing, their
    payload's inputs are the traced op's (symbolic) tensors."""
    return tensor_util.constant_value(t)


def sq_rows(t, memo=None):
    """[B] sums of squares over all but the leading axis. ``memo`` (a dict
    that lives for one call) shares the result between the rules that read
    the same tensor (a Dense layer's MatMul and BiasAdd share their output
    gradient)."""
    if memo is not None:
        hit = memo.get(("sq", id(t)))
        if hit is not None and hit[0] is t:
            return hit[1]
    rank = len(t.shape)
    if rank == 1:
        out = _ex("Square", t)
    else:
        axes = _const(tuple(range(1, rank)), dtypes.int32)
        out = _ex("Sum", _ex("Square", t), axes, "keep_dims", False)
    if memo is not None:
        memo[("sq", id(t))] = (t, out)
    return out


def _scaled(g, w, memo=None):
    """g [B, ...] times the per-example weights w [B], shared through
    ``memo`` between the rules reading the same g (w is one per call), as
    is w broadcast to a rank."""
    if memo is None:
        return _ex("Mul", g, _bcast(w, len(g.shape)))
    hit = memo.get(("w", id(g)))
    if hit is not None and hit[0] is g:
        return hit[1]
    rank = len(g.shape)
    hit = memo.get(("bcast", id(w), rank))
    if hit is not None and hit[0] is w:
        wide = hit[1]
    else:
        wide = _bcast(w, rank)
        memo[("bcast", id(w), rank)] = (w, wide)
    out = _ex("Mul", g, wide)
    memo[("w", id(g))] = (g, out)
    return out


def _shape(t):
    return tuple(t.shape.as_list())


class NormRule:
    """One op type's rule (see the module docstring)."""

    def __init__(self, applies, sq_norms, weighted, per_example):
        self.applies = applies
        self.sq_norms = sq_norms
        self.weighted = weighted
        self.per_example = per_example


NORM_RULES = {}


def norm_rule(*op_types):
    def register(cls):
        rule = cls()
        for op_type in op_types:
            NORM_RULES[op_type] = rule
        return cls
    return register


def _bcast(w, rank):
    """Per-example weights [B] shaped to multiply a rank-``rank`` tensor."""
    if rank == 2:
        return _ex("ExpandDims", w, _const(1, dtypes.int32))
    return array_ops.reshape(w, [-1] + [1] * (rank - 1))


# -- z = a @ W (MatMul), z = A @ W with A [B, ..., T, K] (BatchMatMul) -------

# An attribute the analysis adds to a MatMul's payload (a copy) whose rows
# fold T positions of each example ([B*T, K] @ W, as Keras runs Dense on a
# sequence): T.
ROWS_ATTR = "fasttape_rows_per_example"


@norm_rule("MatMul")
class _MatMul:
    """z = a W, a [B, K]: example i's gradient of W is the outer product
    a_i g_i^T, whose squared norm is |a_i|^2 |g_i|^2 (Goodfellow's trick).
    With a [B*T, K] (ROWS_ATTR T: rows i*T ... i*T+T-1 are example i's),
    the BatchMatMul rule on a and g reshaped to [B, T, K] and [B, T, N]."""

    def applies(self, payload, pos, out_shape, src_shape, batch):
        rows = attr(payload, ROWS_ATTR) or 1
        return (pos == 1 and not attr(payload, "transpose_a")
                and payload.inputs[0] is not None and len(out_shape) == 2
                and out_shape[0] == batch * rows)

    def _folded(self, payload, g, memo):
        """The BatchMatMul rule's (payload, g) for folded rows, or None."""
        rows = attr(payload, ROWS_ATTR)
        if not rows:
            return None
        hit = None if memo is None else memo.get(("folded", id(payload)))
        if hit is not None and hit[0] is payload:
            folded = hit[1]
        else:
            a = payload.inputs[0]
            folded = EagerOp(
                ("adj_x", False, "adj_y", bool(attr(payload, "transpose_b"))),
                (_ex("Reshape", a, _const((-1, rows, a.shape[1]), dtypes.int32)),
                 payload.inputs[1]), 2)
            if memo is not None:
                memo[("folded", id(payload))] = (payload, folded)
        return folded, _ex("Reshape", g, _const((-1, rows, g.shape[1]), dtypes.int32))

    def sq_norms(self, payload, pos, g, src_shape=None, memo=None):
        folded = self._folded(payload, g, memo)
        if folded is not None:
            return NORM_RULES["BatchMatMulV2"].sq_norms(
                folded[0], pos, folded[1], src_shape=src_shape, memo=memo)
        return _ex("Mul", sq_rows(payload.inputs[0], memo), sq_rows(g, memo))

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        folded = self._folded(payload, g, memo)
        if folded is not None:
            return NORM_RULES["BatchMatMulV2"].weighted(
                folded[0], pos, folded[1], w, src_shape=src_shape, memo=memo)
        a = payload.inputs[0]
        gw = _scaled(g, w, memo)
        if attr(payload, "transpose_b"):
            return _ex("MatMul", gw, a, "transpose_a", True, "transpose_b", False)
        return _ex("MatMul", a, gw, "transpose_a", True, "transpose_b", False)

    def per_example(self, payload, pos, g, src_shape=None):
        folded = self._folded(payload, g, None)
        if folded is not None:
            return NORM_RULES["BatchMatMulV2"].per_example(
                folded[0], pos, folded[1], src_shape=src_shape)
        a = payload.inputs[0]
        if attr(payload, "transpose_b"):
            return special_math_ops.einsum("bk,bn->bnk", a, g)
        return special_math_ops.einsum("bk,bn->bkn", a, g)


@norm_rule("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
class _BatchMatMul:
    """Z = A W with A [B, ..., T, K] and a 2-D W shared by all: example i's
    gradient is A_i^T G_i; its squared norm is <A_i A_i^T, G_i G_i^T> (the
    ghost norm, T x T per example) when T^2 < K N, else built and summed."""

    def applies(self, payload, pos, out_shape, src_shape, batch):
        return (pos == 1 and len(src_shape) == 2 and len(out_shape) >= 3
                and out_shape[0] == batch and payload.inputs[0] is not None
                and not attr(payload, "adj_x"))

    def _flat(self, payload, g, src_shape, pos=1):
        a = payload.inputs[0]
        b = array_ops.shape(a)[0]
        k, n = a.shape[-1], g.shape[-1]
        if src_shape is not None and len(src_shape) == 2 and None not in src_shape:
            # (W's known shape: while tracing, a's or g's last axis may be
            # unknown)
            k, n = src_shape[::-1] if attr(payload, "adj_y") else src_shape
        return (array_ops.reshape(a, [b, -1, k]),
                array_ops.reshape(g, [b, -1, n]))

    def sq_norms(self, payload, pos, g, src_shape=None, memo=None):
        given = (payload.inputs[0], g)
        a, g = self._flat(payload, g, src_shape, pos)
        t, k, n = a.shape[1], a.shape[2], g.shape[2]

        def gram(x, x_given, share):
            # (shared by the products reading one tensor: a loop's gate
            # gradient, for its kernel and recurrent kernel)
            key = ("gram", id(x_given), tuple(x.shape.as_list()))
            hit = memo.get(key) if share else None
            if hit is not None and hit[0] is x_given:
                return hit[1]
            out = math_ops.matmul(x, x, transpose_b=True)
            if share:
                memo[key] = (x_given, out)
            return out

        def ghost(share=False):
            # (not a convolution's: its a, the patches, is its own)
            share = share and memo is not None and type(self) is _BatchMatMul
            return math_ops.reduce_sum(
                gram(a, given[0], share) * gram(g, given[1], share), axis=[1, 2])
        if t is not None and t * t < k * n and self._ghost(a.shape[0], t, k, n, a.dtype,
                                                           payload):
            return ghost(share=True)
        if t is None and None not in (k, n) and type(self)._ghost is _BatchMatMul._ghost:
            # T unknown while tracing (a loop's iterations): the choice at
            # run time (weighted() is then one product either way)
            return cond.cond(
                math_ops.square(array_ops.shape(a)[1]) < k * n, ghost,
                lambda: sq_rows(math_ops.matmul(a, g, transpose_a=True)))
        grads = math_ops.matmul(a, g, transpose_a=True)
        if memo is not None:
            # weighted() sums these (B x K x N, no larger than the saved
            # activations here): no second product of the activations
            memo[("per_example", id(payload), pos)] = (payload, grads)
        return sq_rows(grads)

    def _ghost(self, b, t, k, n, dtype, payload=None):
        """Whether the ghost norm (where T^2 < K N) serves over the
        per-example gradients: for a product, always (its clipped sum is one
        K x B T x N product either way)."""
        return True

    def _memoized(self, payload, pos, memo):
        """Whether sq_norms left this op's per-example gradients in memo."""
        hit = None if memo is None else memo.get(("per_example", id(payload), pos))
        return hit is not None and hit[0] is payload

    def _from_memo(self, payload, pos, w, memo):
        """sum_i w_i grad_i from the per-example gradients sq_norms built
        (a [1, B] x [B, K N] product), or None."""
        hit = None if memo is None else memo.get(("per_example", id(payload), pos))
        if hit is None or hit[0] is not payload:
            return None
        grads = hit[1]
        b = grads.shape[0]
        flat = _ex("Reshape", grads, _const((b, -1), dtypes.int32))
        summed = _ex("MatMul", _ex("Reshape", w, _const((1, b), dtypes.int32)),
                     flat, "transpose_a", False, "transpose_b", False)
        return _ex("Reshape", summed, _const(tuple(grads.shape[1:]), dtypes.int32))

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        summed = self._from_memo(payload, pos, w, memo)
        if summed is not None:
            if attr(payload, "adj_y"):
                return _ex("Transpose", summed, _const((1, 0), dtypes.int32))
            return summed
        a, g = self._flat(payload, g, src_shape)
        a = array_ops.reshape(a, [-1, a.shape[-1]])
        gw = array_ops.reshape(g * _bcast(w, 3), [-1, g.shape[-1]])
        if attr(payload, "adj_y"):
            return math_ops.matmul(gw, a, transpose_a=True)
        return math_ops.matmul(a, gw, transpose_a=True)

    def per_example(self, payload, pos, g, src_shape=None):
        a, g = self._flat(payload, g, src_shape)
        if attr(payload, "adj_y"):
            return math_ops.matmul(g, a, transpose_a=True)
        return math_ops.matmul(a, g, transpose_a=True)


# The identity kernel that extracts a convolution's patches is used up to
# this size (kh kw cin)^2 in bytes and below _SLICED_MIN_CHANNELS input
# channels; else the patches are gathered from the input (_slices).
_MAX_PATCH_KERNEL_BYTES = 1 << 18
# From this many input channels, the patches are copied (_slices: then kh
# kw strided slices, now one gather, faster still): an
# identity-kernel convolution does K = kh kw cin products per value copied,
# and took 1.3-6x the slices' time from 8 channels (3x3 kernels, 7x7 to
# 28x28 images, batches 16-128), as long below.
_SLICED_MIN_CHANNELS = 8
# Below that, an identity-kernel convolution makes the patches only in
# float32 where TF runs oneDNN's kernels (_groups_run) and for fewer than
# this many values K = kh kw cin a patch; else they are gathered too
# (_gathered). Eagerly, B 16-128, 8x8 to 32x32 images (12^3 volumes), 1-4
# channels, strides 1-2: in float32 the identity kernel took 0.1-0.7x the
# gather's time up to K 54, 1.6-4x it from K 100; in float64 (Eigen's
# convolution) 1.1-4.4x at every K (2D K 9-100, 3D K 8-108).
_MIN_GATHERED_K = 64


def _identity_patches(x, k, cin):
    """Whether a convolution's patches (K = k values each) are made by an
    identity-kernel convolution rather than gathered (_gathered)."""
    return (cin is not None and cin < _SLICED_MIN_CHANNELS and k < _MIN_GATHERED_K
            and k * k * x.dtype.size <= _MAX_PATCH_KERNEL_BYTES
            and x.dtype in _GROUPED_DTYPES and _groups_run())


def _slices(x, kh, kw, out_hw, strides, dilations, padding):
    """[N, ho, wo, kh kw, cin]: each output position's patch of x [N, H,
    W, cin] (NHWC, H and W known) under a kh x kw convolution (strides
    and dilations NHWC's four), in the kernel's (kh, kw, cin) order:
    _gathered. (One GatherV2 by cached indices, not kh kw strided slices
    and their stack: float64, B 16-64, 8x8 to 32x32, 16-64 channels, 3x3
    to 5x5, it took 0.15-0.5x their time, eagerly and traced; 0.15x at
    stride 2, whose slices TF copies value by value.)"""
    return _gathered(x, (kh, kw), out_hw, strides[1:3], dilations[1:3], padding)


def _padded_same(x, ksize, out_sizes, strides, dilations, padding):
    """(x, its spatial sizes) with x [N, *sizes, cin] (sizes known) padded
    as TF pads SAME for a convolution of kernel ``ksize`` with per-axis
    ``strides`` and ``dilations`` to ``out_sizes``; VALID's as it is."""
    sizes = list(x.shape[1:-1])
    if padding == "SAME":
        pads = [[0, 0]]
        for size, out, k, s, d in zip(sizes, out_sizes, ksize, strides, dilations):
            total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
            pads.append([total // 2, total - total // 2])
        if any(p != [0, 0] for p in pads):
            x = _ex("Pad", x, _const(tuple(tuple(p) for p in pads) + ((0, 0),),
                                     dtypes.int32))
            sizes = [size + sum(p) for size, p in zip(sizes, pads[1:])]
    return x, sizes


def _per_offset(x, g, ksize, strides, dilations, padding):
    """[N, prod(ksize), cin, cout]: each row's kernel gradient of a
    convolution (any number of spatial axes, their sizes known; stride 1
    along the last) without its patches: for each offset j of the kernel's
    leading axes, the slice of x padded as TF pads (_padded_same) that those
    taps read, whole along the last axis ([N, T', cin], T' = T pl / ol for
    the last axis' padded and output sizes), against g's kl shifts along
    its last axis side by side ([N, T', kl cout], zero outside: built
    once), one batched product each (the patches' products times pl / ol;
    one slice of N T' cin values held at a time, not N T K)."""
    x, _ = _padded_same(x, ksize, g.shape[1:-1], strides, dilations, padding)
    out_sizes = list(g.shape[1:-1])
    rank = len(out_sizes)
    cin, cout = x.shape[-1], g.shape[-1]
    kl, dl, ol, pl = ksize[-1], dilations[-1], out_sizes[-1], x.shape[-2]
    t = int(np.prod(out_sizes[:-1])) * pl
    shifts = [_ex("Pad", g, _const(((0, 0),) * rank + ((c * dl, pl - ol - c * dl), (0, 0)),
                                   dtypes.int32)) for c in range(kl)]
    # (g^T [kl cout, T'] by the rows [T', cin], then the small result
    # transposed: float32, B 128, 12^3, 16 channels to 8, 27 such products
    # took 0.4x the time of rows^T g's)
    gt = _ex("Transpose", _ex("Reshape", array_ops.concat(shifts, -1),
                              _const((-1, t, kl * cout), dtypes.int32)),
             _const((0, 2, 1), dtypes.int32))
    grads = []
    for taps in np.ndindex(*ksize[:-1]):
        window = tuple(slice(j * d, j * d + (o - 1) * s + 1, s)
                       for j, d, o, s in zip(taps, dilations, out_sizes, strides))
        rows = _ex("Reshape", x[(slice(None),) + window],
                   _const((-1, t, cin), dtypes.int32))
        grads.append(math_ops.matmul(gt, rows))
    grads = _ex("Reshape", array_ops_stack.stack(grads, axis=1),
                _const((-1, int(np.prod(ksize)), cout, cin), dtypes.int32))
    return _ex("Transpose", grads, _const((0, 1, 3, 2), dtypes.int32))


def _gathered(x, ksize, out_sizes, strides, dilations, padding):
    """[N, *out_sizes, prod(ksize), cin]: each output position's patch of
    x [N, *sizes, cin] (the spatial sizes known) under a convolution of
    kernel ``ksize`` with per-axis ``strides`` and ``dilations`` (any
    number of spatial axes: Conv2D's two, Conv3D's three), in the kernel's
    (..., cin) order: one gather of x's positions (padded as TF pads SAME,
    flattened) by cached indices, copies, no products."""
    cin = x.shape[-1]
    x, sizes = _padded_same(x, ksize, out_sizes, strides, dilations, padding)
    spatial = len(sizes)

    def indices():
        # position p (per axis), tap j (per axis) reads p s + j d on each
        # axis; the flat index in row-major order over the padded sizes,
        # laid out [*positions, *taps]
        flat = np.zeros((1,) * (2 * spatial), np.int64)
        stride = 1
        for axis in reversed(range(spatial)):
            read = (np.arange(out_sizes[axis])[:, None] * strides[axis]
                    + np.arange(ksize[axis])[None, :] * dilations[axis])
            shape = [1] * (2 * spatial)
            shape[axis], shape[spatial + axis] = out_sizes[axis], ksize[axis]
            flat = flat + read.reshape(shape) * stride
            stride *= sizes[axis]
        return constant_op.constant(flat.reshape(-1).astype(np.int32))
    idx = _cached(("slices", tuple(out_sizes), tuple(ksize), tuple(strides),
                   tuple(dilations), tuple(sizes)), indices)
    taps = int(np.prod(ksize))
    total = int(np.prod(sizes))
    if cin is None:     # (a traced input's channels unknown: read at run time)
        cin = array_ops.shape(x)[-1]
        return array_ops.reshape(array_ops.gather(
            array_ops.reshape(x, [-1, total, cin]), idx, axis=1),
                                 [-1] + list(out_sizes) + [taps, cin])
    flat = _ex("Reshape", x, _const((-1, total, cin), dtypes.int32))
    patches = _ex("GatherV2", flat, idx, _const(1, dtypes.int32), "batch_dims", 0)
    return _ex("Reshape", patches, _const((-1,) + tuple(out_sizes) + (taps, cin),
                                          dtypes.int32))


# Per-example kernel gradients (K N values an example, built from the
# patches) where the ghost norm also serves (T^2 < K N) only up to this
# many times the values the op's input and output gradient hold an
# example: beyond, and where they hold more than the ghost norm's two
# T x T products (both routes hold the patches), they would raise the DP
# step's peak memory over the plain step's, whose largest tensors are such
# activations (dpc_conv's second convolution, 144 x 32 values an example
# against 784 + 800 and 2 x 25 x 25: the step's extra peak over the plain
# step's 5.2-6.2 MB with them, 3.6-4.4 with the ghost norm).
_PER_EXAMPLE_HELD = 1


def _over_held(payload, t, k, n):
    """Whether an example's gradient (k n values) outgrows both the op's
    input and output gradient (t n values) times _PER_EXAMPLE_HELD and
    the ghost norm's two t x t products (t: the positions over every
    space-to-batch block)."""
    x = None if payload is None else payload.inputs[0]
    if x is None or x.shape.rank is None or None in x.shape[1:]:
        return False
    held = _blocks(payload) * x.shape[1:].num_elements() + t * n
    return k * n > _PER_EXAMPLE_HELD * held and k * n > 2 * t * t


@norm_rule("Conv2D")
class _Conv2D(_BatchMatMul):
    """z = conv2d(x, K), NHWC, SAME or VALID: example i's gradient of K is
    P_i^T G_i, P_i its image patches [T, kh kw cin] (extract_patches, the
    kernel's layout), G_i its output gradient [T, cout]: the BatchMatMul
    rule on patches (Opacus' unfold, Bu et al.'s mixed ghost clipping)."""

    def applies(self, payload, pos, out_shape, src_shape, batch):
        fmt = attr(payload, "data_format") or "NHWC"
        fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
        padding = attr(payload, "padding")
        padding = padding.decode() if isinstance(padding, bytes) else padding
        return (pos == 1 and fmt == "NHWC" and padding in ("SAME", "VALID")
                and len(src_shape) == 4 and None not in src_shape
                and len(out_shape) == 4 and out_shape[0] == batch
                and payload.inputs[0] is not None)

    def _flat(self, payload, g, src_shape, pos=1):
        x = payload.inputs[0]
        kh, kw = src_shape[:2]
        padding = attr(payload, "padding")
        padding = padding.decode() if isinstance(padding, bytes) else padding
        cin = x.shape[-1]
        strides = list(attr(payload, "strides"))
        dilations = list(attr(payload, "dilations") or [1, 1, 1, 1])
        k = kh * kw * cin
        if (None not in x.shape[1:3] and None not in g.shape[1:3]
                and not _identity_patches(x, k, cin)):
            patches = _ex("Reshape", _slices(x, kh, kw, g.shape[1:3], strides, dilations, padding),
                          _const((-1, g.shape[1], g.shape[2], k), dtypes.int32))
        elif k * k * x.dtype.size > _MAX_PATCH_KERNEL_BYTES:
            # TF's extract_patches (the same (kh, kw, cin) order): no
            # identity kernel, which would be large here (and which TF's
            # instantiation of the compiled post-pass would fold)
            patches = array_ops.extract_image_patches_v2(
                x, sizes=[1, kh, kw, 1], strides=strides, rates=dilations,
                padding=padding)
        else:
            # a convolution with the identity as its kernel (exact: each
            # output sums one input times 1 and zeros), in the kernel's
            # (kh, kw, cin) order: several times faster than
            # extract_patches, and than the slices with few channels
            eye = _cached(("patches", kh, kw, cin, x.dtype), lambda: array_ops.reshape(
                linalg_ops_impl.eye(k, dtype=x.dtype), [kh, kw, cin, k]))
            patches = gen_nn_ops.conv2d(
                x, eye, strides=strides, padding=padding, dilations=dilations,
                data_format="NHWC")
        b = array_ops.shape(x)[0]
        return (array_ops.reshape(patches, [b, -1, patches.shape[-1]]),
                array_ops.reshape(g, [b, -1, g.shape[-1]]))

    def _ghost(self, b, t, k, n, dtype, payload=None):
        """The ghost norm where its B T^2 (K + N) products are few (at most
        4 B K N), where the per-example gradients would take more than
        _MAX_SLICED_BYTES (or B is unknown), or more than the op's input
        and output gradient hold and than the ghost norm's products
        (_over_held: they would raise the step's peak over the plain
        one's); else the per-example gradients,
        built by one batched product of the patches (B T K N, as the plain
        step's kernel gradient), whose weighted sum is the clipped sum (a
        1 x B x K N product) where the ghost norm is followed by TF's kernel
        gradient of w * g (B T K N again). (A Conv2D of 7x7x16 to 32
        channels, batch 64: its norms and clipped sum with sliced patches
        took 0.65x the time of the ghost norm's on identity-kernel ones.)"""
        if t * t * (k + n) <= 4 * k * n or _over_held(payload, t, k, n):
            return True
        return b is None or b * k * n * dtype.size > _MAX_SLICED_BYTES

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        summed = self._from_memo(payload, pos, w, memo)
        if summed is not None:      # [kh kw cin, cout], the kernel's layout
            return _ex("Reshape", summed, _const(tuple(src_shape), dtypes.int32))
        # the kernel's gradient of the reweighted loss: TF's own filter
        # gradient of the reweighted output gradient (no patches)
        padding = attr(payload, "padding")
        return gen_nn_ops.conv2d_backprop_filter(
            payload.inputs[0], _const(tuple(src_shape), dtypes.int32),
            _scaled(g, w, memo), strides=list(attr(payload, "strides")),
            padding=padding.decode() if isinstance(padding, bytes) else padding,
            dilations=list(attr(payload, "dilations") or [1, 1, 1, 1]),
            data_format="NHWC")

    def per_example(self, payload, pos, g, src_shape=None):
        return array_ops.reshape(super().per_example(payload, pos, g, src_shape),
                                 [-1] + list(src_shape))


def _decoded(payload, name, default=None):
    value = attr(payload, name, default)
    return value.decode() if isinstance(value, bytes) else value


@norm_rule("DepthwiseConv2dNative")
class _DepthwiseConv2D(_BatchMatMul):
    """z = depthwise_conv2d(x, K), K [kh, kw, cin, mult], NHWC, SAME or
    VALID: example i's gradient of K[:, :, c, m] is P_ic^T G_icm, P_ic the
    image patches of channel c [T, kh kw], G_icm the output gradient of
    channel c m [T]; built per example (a depthwise kernel is small), the
    clipped sum by TF's own filter gradient of the reweighted output
    gradient."""

    def applies(self, payload, pos, out_shape, src_shape, batch):
        return (pos == 1 and (_decoded(payload, "data_format") or "NHWC") == "NHWC"
                and _decoded(payload, "padding") in ("SAME", "VALID")
                and len(src_shape) == 4 and None not in src_shape
                and len(out_shape) == 4 and out_shape[0] == batch
                and payload.inputs[0] is not None
                and payload.inputs[0].shape[-1] == src_shape[2])

    def per_example(self, payload, pos, g, src_shape=None):
        x = payload.inputs[0]
        kh, kw, cin, mult = src_shape
        patches = array_ops.extract_image_patches_v2(
            x, sizes=[1, kh, kw, 1], strides=list(attr(payload, "strides")),
            rates=list(attr(payload, "dilations") or [1, 1, 1, 1]),
            padding=_decoded(payload, "padding"))
        b = array_ops.shape(x)[0]
        # patches in the kernel's (kh, kw, cin) order
        patches = array_ops.reshape(patches, [b, -1, kh * kw, cin])
        g = array_ops.reshape(g, [b, -1, cin, mult])
        grads = special_math_ops.einsum("btkc,btcm->bkcm", patches, g)
        return array_ops.reshape(grads, [-1] + list(src_shape))

    def sq_norms(self, payload, pos, g, src_shape=None, memo=None):
        grads = self.per_example(payload, pos, g, src_shape)
        if memo is not None:
            memo[("per_example", id(payload), pos)] = (payload, grads)
        return sq_rows(grads)

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        summed = self._from_memo(payload, pos, w, memo)
        if summed is not None:
            return summed
        return gen_nn_ops.depthwise_conv2d_native_backprop_filter(
            payload.inputs[0], _const(tuple(src_shape), dtypes.int32),
            _scaled(g, w, memo), strides=list(attr(payload, "strides")),
            padding=_decoded(payload, "padding"),
            dilations=list(attr(payload, "dilations") or [1, 1, 1, 1]),
            data_format="NHWC")


def _einsum_parts(payload, pos):
    """For an Einsum with the source as operand ``pos`` and the batch on the
    other operand's (and the output's) leading index: (x term, source term,
    output term, rows, contracted, out letters), where rows are the letters
    of x and the output only (a sequence's positions), contracted those of
    x and the source only, out those of the source and the output only; or
    None for an equation outside these (a letter in all three terms, one
    summed in one operand only, an ellipsis, a repeated letter)."""
    eq = _decoded(payload, "equation")
    if (not eq or "->" not in eq or "." in eq or len(payload.inputs) != 2
            or pos not in (0, 1)):
        return None
    lhs, out = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None
    xt, wt = terms[1 - pos], terms[pos]
    if (not xt or not out or xt[0] != out[0] or xt[0] in wt
            or any(len(set(t)) != len(t) for t in (xt, wt, out))):
        return None
    rows = [c for c in xt[1:] if c in out and c not in wt]
    contracted = [c for c in xt[1:] if c in wt and c not in out]
    outs = [c for c in wt if c in out and c not in xt]
    if (len(rows) + len(contracted) != len(xt) - 1
            or len(contracted) + len(outs) != len(wt)
            or len(rows) + len(outs) != len(out) - 1):
        return None
    return xt, wt, out, rows, contracted, outs


@norm_rule("Einsum")
class _Einsum(_BatchMatMul):
    """z = einsum(eq, x, W), x's leading index the batch (EinsumDense,
    tf_keras' MultiHeadAttention: "abc,cd->abd", "abc,cde->abde",
    "abcd,cde->abe"): the BatchMatMul rule on x transposed and reshaped to
    [B, T, K] (its rows, then the letters summed with W) and the output
    gradient to [B, T, N] (the rows, then W's output letters); example i's
    gradient of W is their product, put back in W's letter order."""

    def applies(self, payload, pos, out_shape, src_shape, batch):
        parts = _einsum_parts(payload, pos)
        x = payload.inputs[1 - pos]
        return (parts is not None and x is not None
                and len(x.shape) == len(parts[0])
                and len(out_shape) == len(parts[2]) and out_shape[0] == batch
                and len(src_shape) == len(parts[1]) and None not in src_shape)

    def _flat(self, payload, g, src_shape, pos=1):
        xt, wt, out, rows, contracted, outs = _einsum_parts(payload, pos)
        x = payload.inputs[1 - pos]
        b = array_ops.shape(x)[0]
        a = array_ops.transpose(x, [0] + [xt.index(c) for c in rows + contracted])
        g = array_ops.transpose(g, [0] + [out.index(c) for c in rows + outs])
        # (the sizes from the source's known shape: while tracing, x's or
        # g's may be unknown, after an op such as SegmentSum)
        k = int(np.prod([src_shape[wt.index(c)] for c in contracted]))
        n = int(np.prod([src_shape[wt.index(c)] for c in outs]))
        return (array_ops.reshape(a, [b, -1, k]), array_ops.reshape(g, [b, -1, n]))

    def _to_source(self, payload, pos, grads, src_shape, lead):
        """[lead..., K, N] in the (contracted, out) letters -> W's layout."""
        _, wt, _, _, contracted, outs = _einsum_parts(payload, pos)
        order = contracted + outs
        dims = [src_shape[wt.index(c)] for c in order]
        grads = array_ops.reshape(grads, lead + dims)
        perm = [order.index(c) for c in wt]
        return array_ops.transpose(
            grads, list(range(len(lead))) + [len(lead) + p for p in perm])

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        summed = self._from_memo(payload, pos, w, memo)
        if summed is None:
            a, g = self._flat(payload, g, src_shape, pos)
            a = array_ops.reshape(a, [-1, a.shape[-1]])
            gw = array_ops.reshape(g * _bcast(w, 3), [-1, g.shape[-1]])
            summed = math_ops.matmul(a, gw, transpose_a=True)
        return self._to_source(payload, pos, summed, src_shape, [])

    def per_example(self, payload, pos, g, src_shape=None):
        a, g = self._flat(payload, g, src_shape, pos)
        return self._to_source(payload, pos, math_ops.matmul(a, g, transpose_a=True),
                               src_shape, [-1])


# -- a bias or scale broadcast over the batch --------------------------------

def _to_source(h, src_shape):
    """Reduce h [B, ...] (an op's output shape) to [B] + src_shape, summing
    the axes along which the source was broadcast."""
    rank = len(h.shape)
    if rank == 2 and tuple(src_shape) == (h.shape[1],):
        return h
    src = list(src_shape)
    if len(src) == rank:        # a leading 1 for the batch axis
        src = src[1:]
    aligned = [1] * (rank - 1 - len(src)) + src
    axes = [k + 1 for k, d in enumerate(aligned)
            if d == 1 and h.shape[k + 1] != 1]
    if axes:
        h = math_ops.reduce_sum(h, axis=axes, keepdims=True)
    return array_ops.reshape(h, [-1] + list(src_shape))


def _broadcast_over_batch(out_shape, src_shape, batch):
    """A source of shape src_shape broadcast against an output [B, ...]."""
    if not out_shape or out_shape[0] != batch or None in out_shape:
        return False
    if len(src_shape) > len(out_shape):
        return False
    if len(src_shape) == len(out_shape) and src_shape[0] != 1:
        return False
    return True


class _Elementwise:
    """z = x op s with s broadcast over the batch: example i's gradient is
    example i's h_i = g_i (Add) or g_i * x_i (Mul), summed over the axes s
    was broadcast along."""

    sign = 1.0

    def _h(self, payload, pos, g):
        return g

    def applies(self, payload, pos, out_shape, src_shape, batch):
        return _broadcast_over_batch(out_shape, src_shape, batch)

    def per_example(self, payload, pos, g, src_shape=None):
        h = self._h(payload, pos, g)
        return _to_source(h, src_shape)

    def sq_norms(self, payload, pos, g, src_shape=None, memo=None):
        grads = self.per_example(payload, pos, g, src_shape)
        if memo is not None and len(g.shape) > 2 and grads.shape[0] is not None:
            # (weighted() sums these: a [1, B] product, not the output-sized
            # reweighted g reduced again)
            memo[("per_example", id(payload), pos)] = (payload, grads)
        return sq_rows(grads, memo)

    _from_memo = _BatchMatMul._from_memo

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        h = self._h(payload, pos, g)
        if len(h.shape) == 2 and tuple(src_shape) == (h.shape[1],):
            # sum_i w_i h_i (the weighted rows shared with a MatMul's rule)
            return _ex("Sum", _scaled(h, w, memo), _const(0, dtypes.int32),
                       "keep_dims", False)
        summed = self._from_memo(payload, pos, w, memo)
        if summed is not None:
            return summed
        h = _scaled(h, w, memo)
        return array_ops.reshape(math_ops.reduce_sum(
            _to_source(h, src_shape), axis=0), src_shape)


@norm_rule("Add", "AddV2")
class _Add(_Elementwise):
    pass


@norm_rule("Sub")
class _Sub(_Elementwise):
    def _h(self, payload, pos, g):
        return g if pos == 0 else -g


@norm_rule("Mul")
class _Mul(_Elementwise):
    def applies(self, payload, pos, out_shape, src_shape, batch):
        return (payload.inputs[1 - pos] is not None
                and _broadcast_over_batch(out_shape, src_shape, batch))

    def _h(self, payload, pos, g):
        return g * payload.inputs[1 - pos]


@norm_rule("BiasAdd", "BiasAddV1")
class _BiasAdd(_Elementwise):
    def applies(self, payload, pos, out_shape, src_shape, batch):
        fmt = attr(payload, "data_format") or "NHWC"
        fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
        return (pos == 1 and fmt == "NHWC"
                and _broadcast_over_batch(out_shape, src_shape, batch))


# -- embeddings: Gather on a table --------------------------------------------

# The Gather rule's two ways to example i's squared norm, and what each
# costs per example with T ids of d values (CPU time of traced steps on
# embedding models, vocabularies 50..50000, T 4..128, d 16..256): the ghost
# norm, sum over t, t' of example i's positions with equal ids of
# <g_it, g_it'> ([B, T, T]: a batched product, T^2 d, and an equality mask,
# T^2, plus the product's fixed cost), or the segments: the rows summed per
# (example, id) (a hash of each id, then a scatter of its d values) and
# squared. The ghost norm wins where T is small and d large; the segments
# where T is large, d small, or the batch small (the product's fixed cost).
_GHOST_FIXED_NS = 80_000
_GHOST_PAIR_NS, _GHOST_MAC_NS = 2.0, 0.006
_SEGMENT_ID_NS, _SEGMENT_VALUE_NS = 23.0, 2.0


# Under jit_compile XLA fuses the ghost norm's ops and runs Unique as a
# sort: the ghost norm up to this many ids an example (the bench's text step
# under jit_compile, without noise: 1.10x the plain step by the ghost norm,
# 1.45x by the segments).
_GHOST_XLA_MAX = 128


def _ghost_cheaper(b, t, d):
    if not context.executing_eagerly() and \
            control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        return t <= _GHOST_XLA_MAX
    ghost = _GHOST_FIXED_NS + b * t * t * (_GHOST_PAIR_NS + _GHOST_MAC_NS * d)
    return ghost < b * t * (_SEGMENT_ID_NS + _SEGMENT_VALUE_NS * d)


@norm_rule("GatherV2", "ResourceGather")
class _Gather:
    """z = table[ids], ids [B, ...]: example i's gradient is its output
    gradients scattered to its ids (summed over an id repeated within the
    example), so its norm sums over example i's distinct ids."""

    def applies(self, payload, pos, out_shape, src_shape, batch):
        if pos != 0 or len(payload.inputs) < 2 or payload.inputs[1] is None:
            return False
        if attr(payload, "batch_dims", 0) != 0:
            return False
        if len(payload.inputs) > 2:     # GatherV2's axis
            axis = payload.inputs[2]
            if axis is None or value_of(axis) != 0:
                return False
        ids = payload.inputs[1]
        return (len(ids.shape) >= 1 and ids.shape[0] == batch
                and len(src_shape) >= 1 and None not in src_shape)

    def _segments(self, payload, g, src_shape):
        ids = math_ops.cast(payload.inputs[1], dtypes.int64)
        b = array_ops.shape(ids, out_type=dtypes.int64)[0]
        ids = array_ops.reshape(ids, [b, -1])
        rows = src_shape[0]
        example = array_ops.broadcast_to(
            math_ops.range(b, dtype=dtypes.int64)[:, None], array_ops.shape(ids))
        values = array_ops.reshape(g, [-1] + list(src_shape[1:]))
        return array_ops.reshape(example * rows + ids, [-1]), values, b, rows

    def sq_norms(self, payload, pos, g, src_shape=None, memo=None):
        ids = payload.inputs[1]
        b, n = ids.shape[0], ids.shape.num_elements()
        if not b or not n or None in g.shape:
            # (a batch or length unknown while tracing: keys built at run time)
            keys, values, b, rows = self._segments(payload, g, src_shape)
            unique, segment = array_ops.unique(keys)
            summed = math_ops.unsorted_segment_sum(
                values, segment, array_ops.shape(unique)[0])
            return math_ops.unsorted_segment_sum(
                sq_rows(summed), unique // rows, b)
        t = n // b
        d = g.shape.num_elements() // n
        if t == 1:      # (one id an example: nothing to sum)
            return sq_rows(g, memo)
        if _ghost_cheaper(b, t, d):
            ids = _ex("Reshape", ids, _const((b, t), dtypes.int32))
            g = _ex("Reshape", g, _const((b, t, d), dtypes.int32))
            same = _ex("Cast", _ex("Equal",
                                   _ex("ExpandDims", ids, _const(2, dtypes.int32)),
                                   _ex("ExpandDims", ids, _const(1, dtypes.int32)),
                                   "incompatible_shape_error", True),
                       "DstT", g.dtype.as_datatype_enum, "Truncate", False)
            gg = _ex("BatchMatMulV2", g, g, "adj_x", False, "adj_y", True)
            return _ex("Sum", _ex("Mul", gg, same), _const((1, 2), dtypes.int32),
                       "keep_dims", False)
        # The segments: keys b * V + id (int32 where they fit), each
        # example's rows summed per key, squared, summed per example (a
        # key's example is key // V).
        rows = int(src_shape[0])
        kind = dtypes.int32 if b * rows < 2 ** 31 else dtypes.int64
        keys = _ex("Reshape", ids, _const((n,), dtypes.int32))
        if keys.dtype != kind:
            keys = _ex("Cast", keys, "DstT", kind.as_datatype_enum, "Truncate", False)
        keys = _ex("AddV2", keys, _cached(
            ("gather_keys", b, t, rows, kind),
            lambda: constant_op.constant(
                np.repeat(np.arange(b, dtype=np.int64) * rows, t), dtype=kind)))
        unique, segment = array_ops.unique(keys, out_idx=dtypes.int32)
        summed = math_ops.unsorted_segment_sum(
            _ex("Reshape", g, _const((n, d), dtypes.int32)), segment,
            array_ops.shape(unique)[0])
        return math_ops.unsorted_segment_sum(
            sq_rows(summed), _ex("FloorDiv", unique, _const(rows, kind)), b)

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        ids = array_ops.reshape(payload.inputs[1], [-1])
        gw = _scaled(g, w, memo)
        return indexed_slices.IndexedSlices(
            array_ops.reshape(gw, [-1] + list(src_shape[1:])), ids,
            src_shape)

    def per_example(self, payload, pos, g, src_shape=None):
        keys, values, b, rows = self._segments(payload, g, src_shape)
        out = math_ops.unsorted_segment_sum(values, keys, b * rows)
        return array_ops.reshape(out, [-1] + list(src_shape))


def candidate(op_type, payload):
    """The rule of an op type, for an op run eagerly; or None."""
    rule = NORM_RULES.get(op_type)
    if rule is None or type(payload) is not EagerOp:
        return None
    return rule


def applies(rule, payload, pos, out_shape, src_shape, batch):
    """Whether ``rule`` covers input ``pos`` of a recorded op, now that its
    output gradient's shape is known."""
    try:
        return bool(rule.applies(payload, pos, out_shape, src_shape, batch))
    except (TypeError, ValueError, IndexError, AttributeError):
        return False


# -- dilated convolutions run by space-to-batch -------------------------------

# Up to this batch size, a convolution with many input channels to few
# outputs builds its per-example kernel gradients one example at a time
# (where no grouped convolution does: _Conv2DBlocks._grouped).
_MAX_LOOPED = 128
# The dtypes whose grouped kernel gradient TF runs (oneDNN on CPU, cuDNN):
# its Eigen kernel, float64's, has no groups.
_GROUPED_DTYPES = frozenset({dtypes.float32})


def _groups_run():
    """Whether TF runs a convolution's kernel gradient with groups here:
    its oneDNN CPU kernels do; with oneDNN off (TF_ENABLE_ONEDNN_OPTS=0, a
    build without it) its Eigen kernels raise InvalidArgumentError."""
    if not _GROUPS_RUN:
        try:
            from tensorflow.python.util import _pywrap_util_port  # pylint: disable=import-outside-toplevel
            _GROUPS_RUN.append(bool(_pywrap_util_port.IsMklEnabled()))
        except (ImportError, AttributeError):
            _GROUPS_RUN.append(False)
    return _GROUPS_RUN[0]


_GROUPS_RUN = []
# From this many taps (kh kw) of a depthwise kernel, each example's kernel
# gradient by a correlation (_DepthwiseBlocks._correlated). In a
# tf.function (as dp_gradient's post-pass runs), float32, B 8-128, 16-256
# channels, 12x12 to 32x32: with 4x4 and 5x5 kernels it took 0.02-0.62x
# (median 0.2x) the time of the side-by-side kernel gradient, 0.4-1.6x that
# of the plain step's; with 3x3 kernels 0.7-2.9x the side-by-side's (TF's
# depthwise convolution of an output of 3x3 per channel), with 1x1 kernels
# or a depth multiplier more.
_MIN_CORRELATED_TAPS = 16
# Up to this size in bytes of every example's depthwise kernel (B kh kw
# cin m), its kernel gradients by one grouped kernel gradient
# (_DepthwiseBlocks._grouped); above, TF's CPU kernel gradient of one image
# of B cin channels copies a patch of kh kw B cin values per position and
# falls out of the cache (float64, B 128, 32x32, 32 channels, 5x5: 8.6x the
# plain step's kernel gradient in CPU time), and chunks of a few examples
# (_chunked) do: up to _DW_CHUNK_BYTES of kernel (kh kw e cin m) each. In
# CPU time on 19 shapes (B 16-128, 8x8 to 32x32, 8-256 channels, 1x1 to
# 5x5, depth multipliers 1-2, strides 1-2): in float32 (oneDNN) with fewer
# than 16 taps grouped took 0.6-1.1x chunked's up to 590 KiB; with 16 taps
# or more (a depth multiplier: no correlation) 2.6-3.4x from 410 KiB; in
# float64 0.8-1.1x up to 147 KiB, 1.1-2.5x from 295 KiB (and 1.6x at 74).
_MAX_GROUPED_DW_BYTES = 640 << 10
_MAX_GROUPED_DW_BYTES_SLOW = 64 << 10
_DW_CHUNK_BYTES = 32 << 10
# In float32 where oneDNN runs, a kernel with a depth multiplier takes
# chunks of at most this many channels (e cin m) an image wherever all of
# them would be more: on 4 shapes (B 32-128, 16x16 to 32x32, 4-32
# channels, 2x2 to 4x4, multiplier 2, strides 1-2) one group of 1024-4096
# channels took 1.2-2.1x the time of chunks of 512 (B 128, 32x32x16, 2x2:
# 74 ms against 36 ms, the plain step's kernel gradient 12 ms); without a
# multiplier 0.65-1.1x (timed in turn), so one group stays.
_DW_CHUNK_CHANNELS = 512
# Up to this size in bytes of its patches (B T K values), such a
# convolution at stride 1 (eagerly at any) gathers them (_Conv2DBlocks._sliced).
_MAX_SLICED_BYTES = 1 << 26
# Patches of a convolution's examples (_Conv2DBlocks._sliced) up to this
# many bytes at a time: a chunk of examples' patches and their batched
# product, then the next chunk's. All of them at once (50-63 MiB) fall
# out of the cache between the gather and the product: traced, float64,
# B 32-128, 16x16 to 24x24, 8-16 channels to 8-32, 5x5 dilated 2-3, their
# wall time was 1.5-3.2x the plain step's kernel gradient's (and 1.5-2.4x
# their own CPU time: the threads wait on memory); in chunks of 4 MiB
# 0.95-1.7x, at about the same CPU time (2 and 8 MiB chunks: about as
# fast, 1 and 16 MiB slower). Where all of them take at most
# _CHUNKED_FROM_BYTES, at once: with 5-18 MiB of them (B 64-128, 16x16 to
# 32x32, 3-8 channels to 16-32, 3x3 and 5x5, float32 and float64) chunks
# took 0.85-1.3x their time.
_PATCH_CHUNK_BYTES = 4 << 20
_CHUNKED_FROM_BYTES = 24 << 20
# A Conv3D's per-example kernel gradients in float32 where oneDNN runs,
# one example at a time (_Conv3D._by_example), from this many output
# positions and products (T K N) an example. Traced, 3x3x3, B 32-128,
# 4-16 channels to 8-32: with 12^3 positions (3-24 million products) it
# took 0.44-0.57x the time of the gathered patches (0.64-0.71x that of the
# offsets' slices, _per_offset); with 8^3 (1.8-3.5 million) 0.9-1.25x, at
# 6^3 (stride 2) 1.3x: each example's kernel gradient costs oneDNN about
# a fixed 0.1-0.2 ms. (In float64, Eigen's kernel gradient of one example
# at a time took 5-9x the patches'.) The positions of one image: a dilated
# convolution's blocks are smaller (B16 12^3 16 -> 32, 2x2x2 dilated 2, 8
# blocks of 5^3: the DP step took 1.35x the plain one's time with them,
# 1.28x with the patches).
_LOOPED_3D_MIN_POSITIONS = 1000
_LOOPED_3D_MIN_MACS = 2_000_000
# Copying one value of a convolution's patches (a strided slice, then the
# stack) took about the time of this many products of their batched product
# (float64, B 128, 64 positions: 2.1 ns against 0.24 ns): _Conv2DBlocks.
# _shifted weighs its copies of the output gradient against the input's.
_COPY_MACS = 9

# An attribute the analysis adds to a convolution's payload (a copy) whose
# batch axis holds nb blocks of the B examples, block-major (TF runs a
# dilated convolution as SpaceToBatchND, the convolution, BatchToSpaceND:
# row r is example r % B): nb.
BLOCKS_ATTR = "fasttape_interleaved_blocks"


def _blocks(payload):
    return attr(payload, BLOCKS_ATTR) or 1


def _unblocked(t, nb):
    """[nb*B, T, K] rows, block-major, -> [B, nb*T, K]: each example's rows
    of every block together. (T is read at run time where a function was
    traced with the positions unknown.)"""
    def dim(t, i):
        return t.shape[i] if t.shape[i] is not None else array_ops.shape(t)[i]
    # (B kept static where it is: the rules' products read it)
    b = -1 if t.shape[0] is None else t.shape[0] // nb
    t = array_ops.reshape(t, [nb, b, dim(t, 1), dim(t, 2)])
    t = array_ops.transpose(t, [1, 0, 2, 3])
    return array_ops.reshape(t, [b, nb * dim(t, 2), dim(t, 3)])


def _in_chunks(grads_of, x, g, nb, per_example_bytes):
    """grads_of(x, g) (each example's [B, ...] from x [nb B, ...] and g
    [nb B, ...], nb blocks of the B examples, block-major), by chunks of
    examples taking at most _PATCH_CHUNK_BYTES each (at least one example;
    per_example_bytes: what grads_of holds an example), concatenated; all
    at once where they take at most _CHUNKED_FROM_BYTES, or where B is
    unknown."""
    if x.shape[0] is None or g.shape[0] is None or None in x.shape[1:] or None in g.shape[1:]:
        return grads_of(x, g)
    b = x.shape[0] // nb
    if b * per_example_bytes <= _CHUNKED_FROM_BYTES:
        return grads_of(x, g)
    e = max(1, _PATCH_CHUNK_BYTES // per_example_bytes)
    if e >= b:
        return grads_of(x, g)
    sizes = [e] * (b // e) + ([b % e] if b % e else [])
    xs = array_ops.split(_ex("Reshape", x, _const((nb, b) + tuple(x.shape[1:]), dtypes.int32)),
                         sizes, axis=1)
    gs = array_ops.split(_ex("Reshape", g, _const((nb, b) + tuple(g.shape[1:]), dtypes.int32)),
                         sizes, axis=1)
    return array_ops.concat([
        grads_of(array_ops.reshape(xc, [nb * n] + x.shape.as_list()[1:]),
                 array_ops.reshape(gc, [nb * n] + g.shape.as_list()[1:]))
        for xc, gc, n in zip(xs, gs, sizes)], 0)


def _tiled(w, nb):
    """Per-example weights [B] for nb blocks of rows, block-major."""
    return _ex("Tile", w, _const((nb,), dtypes.int32))


def _side_by_side(t, nb, b):
    """[nb B, H, W, C] (nb blocks of the B examples, block-major) ->
    [nb, H, W, B C]: example i's channels at i C ... i C + C - 1, for a
    kernel gradient with the examples as groups of channels."""
    h, w, c = t.shape[1], t.shape[2], t.shape[3]
    return _ex("Reshape", _ex("Transpose", _ex(
        "Reshape", t, _const((nb, b, h, w, c), dtypes.int32)),
        _const((0, 2, 3, 1, 4), dtypes.int32)), _const((nb, h, w, b * c), dtypes.int32))


class _Blocked:
    """The clipped sum of a rule on space-to-batch blocks: the per-example
    weights tiled over the blocks (rows block-major)."""

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        nb = _blocks(payload)
        if nb == 1 or self._memoized(payload, pos, memo):
            return super().weighted(payload, pos, g, w, src_shape, memo)
        return super().weighted(payload, pos, g, _tiled(w, nb), src_shape, None)


@norm_rule("Conv2D")
class _Conv2DBlocks(_Blocked, _Conv2D):
    """The Conv2D rule, also on a dilated convolution's space-to-batch
    blocks (BLOCKS_ATTR): example i's gradient sums its rows in every
    block, the BatchMatMul rule on the patches of all of them."""

    def applies(self, payload, pos, out_shape, src_shape, batch):
        nb = _blocks(payload)
        return super().applies(payload, pos, out_shape, src_shape, batch * nb) and (
            nb == 1 or (out_shape[0] == batch * nb
                        and payload.inputs[0].shape[0] == batch * nb))

    def _flat(self, payload, g, src_shape, pos=1):
        a, g = super()._flat(payload, g, src_shape, pos)
        nb = _blocks(payload)
        if nb == 1:
            return a, g
        return _unblocked(a, nb), _unblocked(g, nb)

    def sq_norms(self, payload, pos, g, src_shape=None, memo=None):
        grouped = self._grouped(payload, g, src_shape)
        if grouped is not None:
            if memo is not None:
                memo[("grouped", id(payload), pos)] = (payload, grouped)
            # (the channels' sums, then the taps': one reduction over
            # axes (0, 2) took 2-4x as long, [K, B, cout] float32)
            return _ex("Sum", _ex("Sum", _ex("Square", grouped), _const(2, dtypes.int32),
                                  "keep_dims", False),
                       _const(0, dtypes.int32), "keep_dims", False)
        shifted = self._shifted(payload, g, src_shape)
        if shifted is not None:
            if memo is not None:
                memo[("shifted", id(payload), pos)] = (payload, shifted, tuple(src_shape))
            return _ex("Sum", _ex("Square", shifted), _const((1, 2), dtypes.int32),
                       "keep_dims", False)
        looped = self._looped(payload, g, src_shape)
        if looped is None:
            looped = self._patches_in_chunks(payload, g, src_shape)
        if looped is None:
            return super().sq_norms(payload, pos, g, src_shape, memo)
        if memo is not None:
            memo[("per_example", id(payload), pos)] = (payload, looped)
        return sq_rows(looped)

    def _patches_in_chunks(self, payload, g, src_shape):
        """[B, K, N], each example's kernel gradient from its patches, a
        chunk of examples at a time (_in_chunks: a batched product each,
        at most _PATCH_CHUNK_BYTES of patches), where the per-example
        gradients serve (no ghost norm) and the whole batch's patches (B T
        K values, T over every block) would take more than
        _CHUNKED_FROM_BYTES. Sizes known; else None."""
        x = payload.inputs[0]
        nb = _blocks(payload)
        if x.shape.rank is None or None in x.shape or None in g.shape:
            return None
        b, k, n = x.shape[0] // nb, int(np.prod(src_shape[:-1])), src_shape[-1]
        t = g.shape[1:-1].num_elements() * nb
        if b * t * k * x.dtype.size <= _CHUNKED_FROM_BYTES or (
                t * t < k * n and self._ghost(b, t, k, n, x.dtype, payload)):
            return None

        def grads_of(xc, gc):
            a, gf = self._flat(EagerOp(payload.attrs, (xc, None), 2), gc, src_shape)
            return math_ops.matmul(a, gf, transpose_a=True)
        return _in_chunks(grads_of, x, g, nb, t * k * x.dtype.size)

    def per_example(self, payload, pos, g, src_shape=None):
        grouped = self._grouped(payload, g, src_shape)
        if grouped is not None:     # [K, B, cout] -> [B] + src_shape
            return array_ops.reshape(array_ops.transpose(grouped, [1, 0, 2]),
                                     [-1] + list(src_shape))
        shifted = self._shifted(payload, g, src_shape)
        if shifted is not None:     # [B, cin, kh kw cout] -> [B] + src_shape
            kh, kw, cin, cout = src_shape
            return array_ops.transpose(
                array_ops.reshape(shifted, [-1, cin, kh, kw, cout]), [0, 2, 3, 1, 4])
        looped = self._looped(payload, g, src_shape)
        if looped is None:
            looped = self._patches_in_chunks(payload, g, src_shape)
        if looped is not None:
            return array_ops.reshape(looped, [-1] + list(src_shape))
        return super().per_example(payload, pos, g, src_shape)

    def _memoized(self, payload, pos, memo):
        return memo is not None and any(
            memo.get((kind, id(payload), pos), (None,))[0] is payload
            for kind in ("grouped", "shifted", "per_example"))

    def _from_memo(self, payload, pos, w, memo):
        hit = None if memo is None else memo.get(("shifted", id(payload), pos))
        if hit is not None and hit[0] is payload:
            grads = hit[1]      # [B, cin, kh kw cout]: one [1, B] product
            b = grads.shape[0]
            kh, kw, cin, cout = hit[2]
            summed = _ex("MatMul", _ex("Reshape", w, _const((1, b), dtypes.int32)),
                         _ex("Reshape", grads, _const((b, -1), dtypes.int32)),
                         "transpose_a", False, "transpose_b", False)
            return _ex("Transpose", _ex("Reshape", summed, _const((cin, kh, kw, cout), dtypes.int32)),
                       _const((1, 2, 0, 3), dtypes.int32))
        hit = None if memo is None else memo.get(("grouped", id(payload), pos))
        if hit is None or hit[0] is not payload:
            return super()._from_memo(payload, pos, w, memo)
        grads = hit[1]      # [K, B, cout]: sum_i w_i grads[:, i] by K [1, B] products
        b = grads.shape[1]
        summed = _ex("BatchMatMulV2", _ex("Reshape", w, _const((1, 1, b), dtypes.int32)),
                     grads, "adj_x", False, "adj_y", False)
        return _ex("Reshape", summed, _const((grads.shape[0], grads.shape[2]), dtypes.int32))

    def _many_inputs(self, payload, g, src_shape):
        """(B, T, K) for a convolution of many input channels to few
        outputs (K > 2 N: an identity-kernel convolution's patches would
        cost more than the kernel gradient, K^2 products per position
        against K N), its positions T over all blocks known; else None."""
        x = payload.inputs[0]
        rank = len(src_shape)
        if rank not in (4, 5) or x.shape.rank != rank:
            return None
        k, cout = int(np.prod(src_shape[:-1])), src_shape[-1]
        if x.shape[0] is None or None in g.shape[1:-1] or k <= 2 * cout:
            return None
        nb = _blocks(payload)
        return x.shape[0] // nb, int(np.prod(g.shape[1:-1])) * nb, k

    def _grouped(self, payload, g, src_shape):
        """[K, B, cout], each example's kernel gradient (K = kh kw cin in
        the kernel's order), by one grouped convolution: TF's kernel
        gradient of x's blocks [nb, H, W, B cin] against g's [nb, Ho, Wo,
        B cout], example i the group of channels i (its blocks summed as
        the batch is), with the op's strides, padding and dilations. Where
        K > 2 cout (_many_inputs), in a dtype TF groups
        (_GROUPED_DTYPES, _groups_run), but where the ghost norm costs fewer
        products (T^2 (K + N) against T K N); else None. Its products
        are the kernel gradient's, and it holds no patches; on 14
        generated shapes of that kind it took 0.2-1.3x (median 0.7x) the
        time of the slices', the per-example loop's or the ghost norm."""
        x = payload.inputs[0]
        shape = self._many_inputs(payload, g, src_shape)
        if (shape is None or len(src_shape) != 4 or x.dtype not in _GROUPED_DTYPES or None in x.shape[1:]
                or None in g.shape[1:] or not _groups_run()):
            return None
        b, t, k = shape
        kh, kw, cin, cout = src_shape
        if t * t < k * cout and t * (k + cout) <= k * cout:
            return None         # (the ghost norm)
        nb = _blocks(payload)
        grads = gen_nn_ops.conv2d_backprop_filter(
            _side_by_side(x, nb, b), _const((kh, kw, cin, b * cout), dtypes.int32),
            _side_by_side(g, nb, b),
            strides=list(attr(payload, "strides")),
            padding=_decoded(payload, "padding"),
            dilations=list(attr(payload, "dilations") or [1, 1, 1, 1]),
            data_format="NHWC")
        return _ex("Reshape", grads, _const((k, b, cout), dtypes.int32))

    def _shifted(self, payload, g, src_shape):
        """[B, cin, kh kw cout], each example's kernel gradient with the
        input channels first, at stride 1 and no dilation, where the
        per-example gradients serve (no ghost norm, _Conv2D._ghost) and
        copying the output gradient's shifts costs less than copying the
        input's patches (fewer output channels than input ones, roughly);
        else None. Example i's gradient of tap (r, c) is sum_p X_i[p]^T
        G_i[p - (r, c)], X_i its input padded as the op pads ((ho + kh - 1)
        x (wo + kw - 1) positions), G_i its output gradient zero outside:
        one batched product of X_i^T by the kh kw shifts of G_i side by
        side (kh kw slices of G_i padded by kh - 1, kw - 1 on each side),
        no patches of the input. Its products are the patches' times
        (ho + kh - 1)(wo + kw - 1) / (ho wo). On a dilated convolution's
        blocks (BLOCKS_ATTR), each block's, summed over an example's."""
        x = payload.inputs[0]
        if (len(src_shape) != 4 or x.shape.rank != 4
                or None in x.shape or None in g.shape
                or list(attr(payload, "strides")) != [1] * 4
                or list(attr(payload, "dilations") or [1] * 4) != [1] * 4):
            return None
        kh, kw, cin, cout = src_shape
        nb = _blocks(payload)
        b, ho, wo = x.shape[0], g.shape[1], g.shape[2]
        t, k, hp, wp = ho * wo, kh * kw * cin, ho + kh - 1, wo + kw - 1
        if (nb * t) ** 2 < k * cout and self._ghost(b // nb, nb * t, k, cout, x.dtype,
                                                    payload):
            return None
        # a copied value costs about as many as _COPY_MACS products
        if (hp * wp * kh * kw * cout * (_COPY_MACS + cin)
                >= t * k * (_COPY_MACS + cout)
                or b * hp * wp * kh * kw * cout * x.dtype.size > _MAX_SLICED_BYTES):
            return None
        if _decoded(payload, "padding") == "SAME":
            top, left = hp - x.shape[1], wp - x.shape[2]
            if top < 0 or left < 0:
                return None
            if top or left:
                x = _ex("Pad", x, _const(((0, 0), (top // 2, top - top // 2),
                                          (left // 2, left - left // 2), (0, 0)),
                                         dtypes.int32))
        if x.shape[1] != hp or x.shape[2] != wp:
            return None
        if kh > 1 or kw > 1:
            g = _ex("Pad", g, _const(((0, 0), (kh - 1, kh - 1), (kw - 1, kw - 1), (0, 0)),
                                     dtypes.int32))
        shifts = array_ops_stack.stack(
            [g[:, kh - 1 - r:kh - 1 - r + hp, kw - 1 - c:kw - 1 - c + wp, :]
             for r in range(kh) for c in range(kw)], axis=3)
        grads = math_ops.matmul(
            _ex("Reshape", x, _const((b, hp * wp, cin), dtypes.int32)),
            _ex("Reshape", shifts, _const((b, hp * wp, kh * kw * cout), dtypes.int32)),
            adjoint_a=True)
        if nb == 1:
            return grads
        return _ex("Sum", _ex("Reshape", grads, _const((nb, b // nb, cin, kh * kw * cout),
                                                       dtypes.int32)),
                   _const(0, dtypes.int32), "keep_dims", False)

    def _looped(self, payload, g, src_shape):
        """Each example's kernel gradient where many input channels go to
        few outputs (_many_inputs), over many positions (no ghost norm),
        with no dilation, in a dtype TF groups no convolution of. At
        stride 1, or eagerly at any stride, from patches built by
        one gather of x's positions (copies, no products: _sliced) where they take
        at most _MAX_SLICED_BYTES; else by TF's own
        kernel gradient of each example's rows (of every block), for a
        batch of at most _MAX_LOOPED examples; else None."""
        x = payload.inputs[0]
        nb = _blocks(payload)
        shape = self._sliceable(payload, g, src_shape)
        if shape is None or list(attr(payload, "dilations") or [1] * 4) != [1] * 4:
            return None
        b, t, k = shape
        strides = list(attr(payload, "strides"))
        padding = _decoded(payload, "padding")
        # (eagerly at any stride: the loop's B kernel gradients dispatched
        # one by one took 1.8-12x the gather and product's time, float64,
        # B 16-128, 8x8 to 16x16, 32-64 channels to 8-16, stride 2; traced
        # they took 0.6-0.9x)
        if ((strides == [1, 1, 1, 1] or context.executing_eagerly())
                and None not in x.shape[1:3]
                and b * t * k * x.dtype.size <= _MAX_SLICED_BYTES):
            return self._sliced(x, g, src_shape, nb, padding, strides)
        if b > _MAX_LOOPED:
            return None
        xs = array_ops.reshape(x, [nb, b] + x.shape.as_list()[1:])
        gs = array_ops.reshape(g, [nb, b] + g.shape.as_list()[1:])
        sizes = _const(tuple(src_shape), dtypes.int32)
        grads = [gen_nn_ops.conv2d_backprop_filter(
            xi, sizes, gi, strides=strides, padding=padding, data_format="NHWC")
                 for xi, gi in zip(array_ops_stack.unstack(xs, axis=1),
                                   array_ops_stack.unstack(gs, axis=1))]
        return array_ops_stack.stack(grads)

    def _sliceable(self, payload, g, src_shape):
        """_many_inputs' (B, T, K) where the ghost norm does not serve
        (T^2 at least K N), else None: where _looped may take the slices."""
        shape = self._many_inputs(payload, g, src_shape)
        if shape is None or shape[1] * shape[1] < shape[2] * src_shape[-1]:
            return None
        return shape

    def _sliced(self, x, g, src_shape, nb, padding, strides=(1, 1, 1, 1)):
        """[B] + src_shape: each example's kernel gradient with no
        dilation (at ``strides``), sum over its blocks of P^T G, P its patches
        [T, kh kw cin] gathered from x (_slices, padded as TF pads
        SAME), by batched products; a chunk of
        examples at a time where all their patches would take more than
        _CHUNKED_FROM_BYTES (_in_chunks)."""
        kh, kw, cin, cout = src_shape
        ho, wo = g.shape[1], g.shape[2]

        k, t = kh * kw * cin, ho * wo
        # A dilated convolution's nb blocks: one product a block, summed
        # after (holding nb times the per-example gradients, nb k cout an
        # example), or, where that is more than the patches and g copied
        # (nb t (k + cout) an example: few rows a block, as at a large
        # dilation of a small image), each example's rows of every block
        # side by side, one product an example.
        side_by_side = nb > 1 and (nb - 1) * k * cout > nb * t * (k + cout)

        def by_example(u, n):
            # [nb b, ...] rows of u, block-major -> [b, nb t, n]
            u = _ex("Transpose", array_ops.reshape(u, [nb, -1, t, n]),
                    _const((1, 0, 2, 3), dtypes.int32))
            return array_ops.reshape(u, [-1, nb * t, n])

        def grads_of(x, g):
            patches = _slices(x, kh, kw, (ho, wo), list(strides), [1] * 4, padding)
            if side_by_side:
                return math_ops.matmul(by_example(patches, k), by_example(g, cout),
                                       adjoint_a=True)
            grads = math_ops.matmul(array_ops.reshape(patches, [nb, -1, t, k]),
                                    array_ops.reshape(g, [nb, -1, t, cout]),
                                    adjoint_a=True)
            return math_ops.reduce_sum(grads, axis=0) if nb > 1 else grads[0]
        grads = _in_chunks(grads_of, x, g, nb, nb * ho * wo * kh * kw * cin * x.dtype.size)
        return array_ops.reshape(grads, [-1] + list(src_shape))


@norm_rule("DepthwiseConv2dNative")
class _DepthwiseBlocks(_Blocked, _DepthwiseConv2D):
    """The depthwise rule, also on a dilated convolution's space-to-batch
    blocks (BLOCKS_ATTR): each row's gradient, summed over the blocks."""

    def applies(self, payload, pos, out_shape, src_shape, batch):
        nb = _blocks(payload)
        return super().applies(payload, pos, out_shape, src_shape, batch * nb) and (
            nb == 1 or payload.inputs[0].shape[0] == batch * nb)

    def per_example(self, payload, pos, g, src_shape=None):
        grouped = self._correlated(payload, g, src_shape)
        if grouped is None:
            grouped = self._chunked(payload, g, src_shape)
        if grouped is None:
            grouped = self._grouped(payload, g, src_shape)
        if grouped is not None:
            return grouped
        grads = super().per_example(payload, pos, g, src_shape)
        nb = _blocks(payload)
        if nb == 1:
            return grads
        return math_ops.reduce_sum(
            array_ops.reshape(grads, [nb, -1] + list(src_shape)), axis=0)

    def _correlated(self, payload, g, src_shape):
        """[B] + src_shape, each example's kernel gradient as what it is, the
        correlation of its input with its output gradient: one depthwise
        convolution (forward) of x's channels side by side, [1, H, W,
        nb B cin] (padded as the op pads, cropped to the rows and columns
        the kernel reads), by g as its kernel [Ho, Wo, nb B cin, 1],
        dilated by the op's strides, summed over the blocks; its output
        [1, kh, kw, nb B cin]. Where the kernel has at least
        _MIN_CORRELATED_TAPS taps and no depth multiplier, in float32
        (_GROUPED_DTYPES: TF's oneDNN kernels; float64's Eigen kernel of a
        32x32 kernel over 4096 channels took 9x the CPU time of _chunked's),
        not under XLA; else None. The same products as the
        kernel gradient; TF's CPU kernel gradient of one image of B cin
        channels holds a [kh kw, B cin] buffer per position, which a 5x5
        kernel over 1024 channels takes out of the cache."""
        x = payload.inputs[0]
        kh, kw, cin, mult = src_shape
        strides = list(attr(payload, "strides"))
        if (mult != 1 or kh * kw < _MIN_CORRELATED_TAPS or x.shape.rank != 4
                or x.dtype not in _GROUPED_DTYPES
                or None in x.shape or None in g.shape
                or list(attr(payload, "dilations") or [1] * 4) != [1] * 4
                or (strides != [1, 1, 1, 1] and (
                    x.dtype not in _GROUPED_DTYPES or not _groups_run()))
                or (not context.executing_eagerly()
                    and control_flow_util.GraphOrParentsInXlaContext(
                        ops.get_default_graph()))):
            return None
        n, h, w = x.shape[0], x.shape[1], x.shape[2]
        ho, wo = g.shape[1], g.shape[2]
        rows, cols = (ho - 1) * strides[1] + kh, (wo - 1) * strides[2] + kw
        if _decoded(payload, "padding") == "SAME":
            top, left = max(rows - h, 0), max(cols - w, 0)
            x = _ex("Pad", x, _const(((0, 0), (top // 2, top - top // 2),
                                      (left // 2, left - left // 2), (0, 0)),
                                     dtypes.int32))
        if x.shape[1] != rows or x.shape[2] != cols:
            x = _ex("Slice", x, _const((0, 0, 0, 0), dtypes.int32),
                    _const((n, rows, cols, cin), dtypes.int32))
        kernel = _ex("Reshape", _ex("Transpose", g, _const((1, 2, 0, 3), dtypes.int32)),
                     _const((ho, wo, n * cin, 1), dtypes.int32))
        out = gen_nn_ops.depthwise_conv2d_native(
            _side_by_side(x, 1, n), kernel, strides=[1, 1, 1, 1], padding="VALID",
            dilations=strides, data_format="NHWC")
        nb = _blocks(payload)
        out = _ex("Reshape", out, _const((kh, kw, nb, n // nb, cin, 1), dtypes.int32))
        if nb > 1:
            out = _ex("Sum", out, _const(2, dtypes.int32), "keep_dims", False)
        else:
            out = _ex("Reshape", out, _const((kh, kw, n, cin, 1), dtypes.int32))
        return _ex("Transpose", out, _const((2, 0, 1, 3, 4), dtypes.int32))

    def _chunked(self, payload, g, src_shape):
        """[B] + src_shape by TF's depthwise kernel gradient of chunks of e
        examples side by side in the channels (x's blocks [nb, H, W, e
        cin] against g's [nb, Ho, Wo, e cin m], e the largest divisor of B
        whose kernels take at most _DW_CHUNK_BYTES), with the op's strides
        and padding: B / e ops of the plain step's products, each one
        image's patches in the cache. Where every example's kernels take
        more than _MAX_GROUPED_DW_BYTES (float32, fewer than 16 taps), else
        _MAX_GROUPED_DW_BYTES_SLOW (one group of all of them would not stay
        in the cache: _grouped), the sizes are known and the op does not
        dilate; else None."""
        x = payload.inputs[0]
        kh, kw, cin, mult = src_shape
        if (x.shape.rank != 4 or None in x.shape or None in g.shape
                or list(attr(payload, "dilations") or [1] * 4) != [1] * 4):
            return None
        nb = _blocks(payload)
        b = x.shape[0] // nb
        per = kh * kw * cin * mult * x.dtype.size
        fast = x.dtype in _GROUPED_DTYPES and kh * kw < _MIN_CORRELATED_TAPS
        wide = (mult > 1 and x.dtype in _GROUPED_DTYPES and _groups_run()
                and b * cin * mult > _DW_CHUNK_CHANNELS)
        if not wide and b * per <= (_MAX_GROUPED_DW_BYTES if fast
                                    else _MAX_GROUPED_DW_BYTES_SLOW):
            return None
        e = max(1, min(b, _DW_CHUNK_BYTES // per))
        if wide:
            e = max(1, min(e, _DW_CHUNK_CHANNELS // (cin * mult)))
        while b % e:
            e -= 1
        q = b // e

        def chunks(t):      # [nb B, h, w, c] -> q of [nb, h, w, e c]
            h, w, c = t.shape[1], t.shape[2], t.shape[3]
            if e > 1 or nb > 1:
                t = _ex("Transpose", _ex("Reshape", t, _const((nb, q, e, h, w, c), dtypes.int32)),
                        _const((1, 0, 3, 4, 2, 5), dtypes.int32))
            return array_ops_stack.unstack(
                _ex("Reshape", t, _const((q, nb, h, w, e * c), dtypes.int32)), num=q)

        sizes = _const((kh, kw, e * cin, mult), dtypes.int32)
        strides = list(attr(payload, "strides"))
        padding = _decoded(payload, "padding")
        out = array_ops_stack.stack([
            gen_nn_ops.depthwise_conv2d_native_backprop_filter(
                xi, sizes, gi, strides=strides, padding=padding, data_format="NHWC")
            for xi, gi in zip(chunks(x), chunks(g))])
        if e == 1:
            return _ex("Reshape", out, _const((b, kh, kw, cin, mult), dtypes.int32))
        return _ex("Reshape", _ex("Transpose", _ex(
            "Reshape", out, _const((q, kh, kw, e, cin, mult), dtypes.int32)),
            _const((0, 3, 1, 2, 4, 5), dtypes.int32)), _const((b, kh, kw, cin, mult), dtypes.int32))

    def _grouped(self, payload, g, src_shape):
        """[B] + src_shape by one depthwise kernel gradient with the
        examples' channels side by side: x's blocks [nb, H, W, B cin]
        against g's [nb, Ho, Wo, B cin m] (example i's channel c is
        channel i cin + c, its blocks summed as the batch is), or None
        where a size is unknown or the op dilates (TF's CPU kernel does
        not). The products are the plain step's kernel gradient's (it took
        1.2-3.3x that gradient's time on 8 shapes, one image of B cin
        channels running on fewer threads); the patches and their einsum
        (B T kh kw cin values) took 3-17x as long as this."""
        x = payload.inputs[0]
        kh, kw, cin, mult = src_shape
        if (x.shape.rank != 4 or None in x.shape or None in g.shape[1:]
                or list(attr(payload, "dilations") or [1] * 4) != [1] * 4):
            return None
        nb = _blocks(payload)
        b = x.shape[0] // nb
        grads = gen_nn_ops.depthwise_conv2d_native_backprop_filter(
            _side_by_side(x, nb, b), _const((kh, kw, b * cin, mult), dtypes.int32),
            _side_by_side(g, nb, b),
            strides=list(attr(payload, "strides")),
            padding=_decoded(payload, "padding"), data_format="NHWC")
        return _ex("Transpose", _ex("Reshape", grads, _const(
            (kh, kw, b, cin, mult), dtypes.int32)), _const((2, 0, 1, 3, 4), dtypes.int32))


# -- 3-D and transposed convolutions, batch norm in inference -----------------

@norm_rule("Conv3D")
class _Conv3D(_Conv2DBlocks):
    """z = conv3d(x, K), NDHWC, SAME or VALID: the Conv2D rule on volume
    patches [T, kd kh kw cin] (the kernel's layout); with many input
    channels to few outputs at stride 1, no patches (_sliced)."""

    def applies(self, payload, pos, out_shape, src_shape, batch):
        nb = _blocks(payload)
        return (pos == 1 and (_decoded(payload, "data_format") or "NDHWC") == "NDHWC"
                and _decoded(payload, "padding") in ("SAME", "VALID")
                and len(src_shape) == 5 and None not in src_shape
                and len(out_shape) == 5 and out_shape[0] == batch * nb
                and payload.inputs[0] is not None
                and payload.inputs[0].shape[0] == batch * nb)

    def _flat(self, payload, g, src_shape, pos=1):
        x = payload.inputs[0]
        kd, kh, kw, cin = src_shape[:4]
        k = kd * kh * kw * cin
        strides = list(attr(payload, "strides"))
        dilations = list(attr(payload, "dilations") or [1] * 5)
        padding = _decoded(payload, "padding")
        if (None not in x.shape[1:4] and None not in g.shape[1:4]
                and not _identity_patches(x, k, cin)):
            # gathered, no products, at any stride and dilation (a Conv3D
            # of 4 channels to 8, 3x3x3, B 16, 12^3, float64: DP/plain
            # 1.65x with the identity kernel's patches)
            patches = _ex("Reshape", _gathered(x, (kd, kh, kw), g.shape[1:4], strides[1:4],
                                               dilations[1:4], padding),
                          _const((-1,) + tuple(g.shape[1:4]) + (k,), dtypes.int32))
        elif k * k * x.dtype.size > _MAX_PATCH_KERNEL_BYTES and dilations == [1] * 5:
            patches = array_ops.extract_volume_patches(
                x, [1, kd, kh, kw, 1], strides, padding)
        else:
            eye = _cached(("patches3d", kd, kh, kw, cin, x.dtype), lambda: array_ops.reshape(
                linalg_ops_impl.eye(k, dtype=x.dtype), [kd, kh, kw, cin, k]))
            patches = gen_nn_ops.conv3d(x, eye, strides=strides, padding=padding,
                                        dilations=dilations, data_format="NDHWC")
        b = array_ops.shape(x)[0]
        a = array_ops.reshape(patches, [b, -1, k])
        g = array_ops.reshape(g, [b, -1, g.shape[-1]])
        nb = _blocks(payload)
        if nb == 1:
            return a, g
        return _unblocked(a, nb), _unblocked(g, nb)

    def _looped(self, payload, g, src_shape):
        """Each example's kernel gradient where many input channels go to
        few outputs (_sliceable) at stride 1, any dilation, without the
        volume patches (_sliced), while one slice of x (B T' cin values)
        and g's kw shifts (B T' kw cout; T' the positions padded along the
        last axis) take at most _MAX_SLICED_BYTES; else None. (Strided,
        the gathered patches: kd kh kw strided slices of x, each against
        g, took 5-20x their time, traced, B 16-64, 8^3-12^3, 8-16 channels
        to 2-8, 2x2x2 and 3x3x3 at stride 2, float32 and float64: TF
        copies a strided slice value by value.) Only with more input
        channels than outputs: each offset's product is [kw cout, T'] by
        [T', cin], which with few input channels does the patches'
        products at a fraction of their speed (traced, 3x3x3 at stride 1,
        B 16-128, 8^3-12^3: 4 channels to 32 took 3-5x the gathered
        patches' time, 8 to 16 1.6x, 16 to 16 1.1-1.5x; 16 to 8 0.35-1x,
        8 to 4 0.4-0.6x). Where the offsets' slices do not serve,
        one example at a time (_by_example) may: in float32, 16 channels to
        8 at 12^3, B 128, the slices' DP step took 1.30-1.34x the plain
        one's, one example at a time 1.45-1.47x, quiet."""
        x = payload.inputs[0]
        shape = self._sliceable(payload, g, src_shape)
        strides = list(attr(payload, "strides"))
        if (shape is None or strides != [1] * 5 or None in x.shape[1:]
                or src_shape[3] <= src_shape[4]):
            return self._by_example(payload, g, src_shape)
        b, t, _ = shape
        dilations = list(attr(payload, "dilations") or [1] * 5)
        ow, kw = g.shape[-2], src_shape[2]
        padded = t * (ow + (kw - 1) * dilations[3]) // ow
        if b * padded * max(src_shape[3], kw * src_shape[-1]) * x.dtype.size > _MAX_SLICED_BYTES:
            return self._by_example(payload, g, src_shape)
        return self._sliced(x, g, src_shape, _blocks(payload),
                            _decoded(payload, "padding"), strides, dilations)

    def _by_example(self, payload, g, src_shape):
        """[B] + src_shape: each example's kernel gradient by TF's own
        kernel gradient of its rows (of every block), one example at a
        time, where oneDNN runs it (float32, _groups_run), the ghost norm
        does not serve, at most _MAX_LOOPED examples each have at least
        _LOOPED_3D_MIN_POSITIONS output positions (in each block of a
        dilated one's: oneDNN's kernel runs on a block's) and
        _LOOPED_3D_MIN_MACS products; else None. No patches; the plain step's products, each
        example's kernel at oneDNN's speed."""
        x = payload.inputs[0]
        if (x.dtype not in _GROUPED_DTYPES or x.shape.rank != 5 or None in x.shape
                or None in g.shape or len(src_shape) != 5
                or list(attr(payload, "dilations") or [1] * 5) != [1] * 5
                or not _groups_run()):
            return None
        nb = _blocks(payload)
        b = x.shape[0] // nb
        positions = g.shape[1:-1].num_elements()    # (an image's: a block's)
        t = positions * nb
        k, n = int(np.prod(src_shape[:-1])), src_shape[-1]
        if (b > _MAX_LOOPED or positions < _LOOPED_3D_MIN_POSITIONS
                or t * k * n < _LOOPED_3D_MIN_MACS
                or (t * t < k * n and self._ghost(b, t, k, n, x.dtype, payload))):
            return None
        xs = _ex("Reshape", x, _const((nb, b) + tuple(x.shape[1:]), dtypes.int32))
        gs = _ex("Reshape", g, _const((nb, b) + tuple(g.shape[1:]), dtypes.int32))
        sizes = _const(tuple(src_shape), dtypes.int32)
        return array_ops_stack.stack([gen_nn_ops.conv3d_backprop_filter_v2(
            xi, sizes, gi, strides=list(attr(payload, "strides")),
            padding=_decoded(payload, "padding"), data_format="NDHWC")
            for xi, gi in zip(array_ops_stack.unstack(xs, axis=1),
                              array_ops_stack.unstack(gs, axis=1))])

    def _sliced(self, x, g, src_shape, nb, padding, strides=(1,) * 5, dilations=None):
        """[B] + src_shape: each example's kernel gradient, many input
        channels to few outputs at stride 1 (_looped), without its volume
        patches: for each of the kd kh offsets (dilated), the padded
        input's slice against g's kw shifts, one batched product each
        (_per_offset); a dilated convolution's blocks summed per example."""
        grads = _per_offset(x, g, src_shape[:3], list(strides)[1:4],
                            list(dilations or [1] * 5)[1:4], padding)
        if nb > 1:
            grads = math_ops.reduce_sum(array_ops.reshape(
                grads, [nb, x.shape[0] // nb, -1]), axis=0)
        return array_ops.reshape(grads, [-1] + list(src_shape))

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        summed = self._from_memo(payload, pos, w, memo)
        if summed is not None:
            return _ex("Reshape", summed, _const(tuple(src_shape), dtypes.int32))
        nb = _blocks(payload)
        gw = (_scaled(g, w, memo) if nb == 1
              else _ex("Mul", g, _bcast(_tiled(w, nb), 5)))
        return gen_nn_ops.conv3d_backprop_filter_v2(
            payload.inputs[0], _const(tuple(src_shape), dtypes.int32), gw,
            strides=list(attr(payload, "strides")),
            padding=_decoded(payload, "padding"),
            dilations=list(attr(payload, "dilations") or [1] * 5),
            data_format="NDHWC")


class _Transposed:
    """A transposed convolution's kernel (ConvBackpropInput as a forward
    op), NHWC or NDHWC, SAME or VALID, with the rule of the convolution it
    transposes: example i's gradient of K [..., cy, cx] is P(g_i)^T X_i,
    P(g_i) the patches [T, ... cy] of its output gradient under that
    convolution, X_i its input [T, cx]: the BatchMatMul rule on those; the
    clipped sum by TF's kernel gradient of w * g."""

    rank, data_format, filter_gradient = None, None, None

    def applies(self, payload, pos, out_shape, src_shape, batch):
        x = payload.inputs[2] if len(payload.inputs) > 2 else None
        return (pos == 1
                and (_decoded(payload, "data_format") or self.data_format) == self.data_format
                and _decoded(payload, "padding") in ("SAME", "VALID")
                and _blocks(payload) == 1
                and len(src_shape) == self.rank and None not in src_shape
                and len(out_shape) == self.rank and out_shape[0] == batch
                and x is not None and x.shape[0] == batch
                and out_shape[-1] == src_shape[-2])

    def _forward(self, payload, g, memo):
        """The forward convolution's payload, its input g (the patches of
        g, against x as its output gradient), shared through ``memo``
        between sq_norms and weighted (the per-example gradients sq_norms
        leaves there are keyed by it)."""
        hit = None if memo is None else memo.get(("forward", id(payload)))
        if hit is not None and hit[0] is payload and hit[1].inputs[0] is g:
            return hit[1]
        forward = EagerOp(payload.attrs, (g, None), 2)
        if memo is not None:
            memo[("forward", id(payload))] = (payload, forward)
        return forward

    def sq_norms(self, payload, pos, g, src_shape=None, memo=None):
        return super().sq_norms(self._forward(payload, g, memo), pos,
                                payload.inputs[2], src_shape, memo)

    def per_example(self, payload, pos, g, src_shape=None):
        return super().per_example(self._forward(payload, g, None), pos,
                                   payload.inputs[2], src_shape)

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        summed = self._from_memo(self._forward(payload, g, memo), pos, w, memo)
        if summed is not None:
            return _ex("Reshape", summed, _const(tuple(src_shape), dtypes.int32))
        return self.filter_gradient(
            _scaled(g, w, memo), _const(tuple(src_shape), dtypes.int32),
            payload.inputs[2], strides=list(attr(payload, "strides")),
            padding=_decoded(payload, "padding"),
            dilations=list(attr(payload, "dilations") or [1] * self.rank),
            data_format=self.data_format)


@norm_rule("Conv2DBackpropInput")
class _Conv2DTranspose(_Transposed, _Conv2DBlocks):
    """y = conv2d_transpose(x, K) (Keras' Conv2DTranspose, and
    Conv1DTranspose through ExpandDims): K [kh, kw, cy, cx], the patches
    [T, kh kw cy]; with many channels cy to few cx, each example's kernel
    gradient as the convolution's (one grouped kernel gradient, slices or
    a loop: _Conv2DBlocks)."""

    rank, data_format = 4, "NHWC"
    filter_gradient = staticmethod(gen_nn_ops.conv2d_backprop_filter)


@norm_rule("Conv3DBackpropInputV2")
class _Conv3DTranspose(_Transposed, _Conv3D):
    """y = conv3d_transpose(x, K) (Keras' Conv3DTranspose): K [kd, kh, kw,
    cy, cx], the volume patches [T, kd kh kw cy]."""

    rank, data_format = 5, "NDHWC"
    filter_gradient = staticmethod(gen_nn_ops.conv3d_backprop_filter_v2)


@norm_rule("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
class _FusedBatchNorm:
    """y = scale * (x - mean) / sqrt(variance + eps) + offset in inference
    (is_training false: mean and variance fixed; tf_keras'
    BatchNormalization with training=False): example i's gradient of the
    scale is its output gradient times the normalized x, of the offset its
    output gradient, each summed over all but the channel axis ([B, C],
    built: a per-channel parameter is small)."""

    def applies(self, payload, pos, out_shape, src_shape, batch):
        inputs = payload.inputs
        return (pos in (1, 2) and not attr(payload, "is_training")
                and (_decoded(payload, "data_format") or "NHWC") in (
                    "NHWC", "NCHW", "NDHWC", "NCDHW")
                and len(src_shape) == 1 and len(out_shape) >= 2
                and out_shape[0] == batch
                and (pos == 2 or all(t is not None for t in (
                    inputs[0], inputs[3], inputs[4]))))

    def per_example(self, payload, pos, g, src_shape=None):
        rank = len(g.shape)
        channel = 1 if _decoded(payload, "data_format") in ("NCHW", "NCDHW") else rank - 1
        axes = [a for a in range(1, rank) if a != channel]
        dtype = payload.inputs[3].dtype if payload.inputs[3] is not None else g.dtype
        g = math_ops.cast(g, dtype)
        if pos == 1:
            x = math_ops.cast(payload.inputs[0], dtype)
            shape = [1] * rank
            shape[channel] = -1
            mean = array_ops.reshape(payload.inputs[3], shape)
            inv = math_ops.rsqrt(array_ops.reshape(payload.inputs[4], shape)
                                 + attr(payload, "epsilon", 1e-4))
            g = g * ((x - mean) * inv)
        return math_ops.reduce_sum(g, axis=axes) if axes else g

    # built per example (as a depthwise kernel's), the clipped sum their
    # weighted sum
    sq_norms = _DepthwiseConv2D.sq_norms
    _from_memo = _BatchMatMul._from_memo

    def weighted(self, payload, pos, g, w, src_shape=None, memo=None):
        summed = self._from_memo(payload, pos, w, memo)
        if summed is not None:
            return summed
        grads = self.per_example(payload, pos, g, src_shape)
        return _ex("Sum", _ex("Mul", grads, _bcast(math_ops.cast(w, grads.dtype), 2)),
                   _const(0, dtypes.int32), "keep_dims", False)
