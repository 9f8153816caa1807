"""Which ops keep each example's row: the allowlist the per-example analysis
(_per_example) trusts.

An op rule reads row j of its op's output gradient as example j's. That
holds only while every op after it, on the path to ``losses``, keeps what
it reads in row j in row j of what it makes: elementwise work, a reshape
that keeps the batch axis leading, a reduction, slice, concat or
transpose over the other axes, a product whose rows are its first
operand's. ``keeps_axis0`` says whether an op provably does so. An op type
that is not in ROW_OPS, or whose condition fails or cannot be proved (a
shape or a config value unknown), may move rows.

Rows (the gradient of losses[i] over the whole batch's forward pass) are
example i's own gradient only where losses[i] depends on example i
alone, so the same table is also the allowlist for keeping the examples
apart (``keeps_apart``): an op that moves the batch axis in a way the
analysis follows (a time-major transpose, a proved loop: _per_example's
_track_batch_axis) sends the sources read before it to rows; an op not
in ROW_OPS, or whose condition fails where the batch axis is 0, or that
is not elementwise where the analysis followed it elsewhere, is refused
(an op nobody listed costs a loud error, never a wrong gradient).

Only tensors that may hold rows matter (``carrying``): those computed on
the path from one whose leading axis may be the batch's (the input batch,
a batched source, a constant of unknown shape). A parameter, and what is
computed from parameters alone (a batch norm's ``gamma * rsqrt(variance +
eps)``), hold no example's values, and broadcasting them over the rows
moves none. An op none of whose inputs on the path carries rows keeps
them.

ROW_OPS' conditions take the batch axis (``batch_axis``: where it is
after the op, given where the inputs hold it), so the same table serves
a recurrent layer's time-major ops and a traced loop's body
(_per_example._op_axis): ELEMENTWISE keeps a batch axis wherever it
lies, a reduction, scan, concat, pad, squeeze or batched product along
other axes keeps it or moves it by the axes it removes or adds; most
conditions are known with the batch on axis 0 alone.
"""

import operator

from tensorflow.python.framework import dtypes
from tensorflow.python.framework import ops
from tensorflow.python.util import nest

from fasttape.gradients import _norm_rules


def value(t):
    """A small config input's value (axes, a permutation) as a list or a
    number: an eager tensor's, or a traced one's where it is known while
    tracing (a constant, or computed from constants and static shapes:
    shape_values, Keras' RepeatVector's Tile multiples); else None."""
    found = _constant(t)
    if found is not None or type(t) is ops.EagerTensor:
        return found
    rank = getattr(t, "shape", None)
    rank = None if rank is None else rank.rank
    if rank not in (0, 1) or not t.dtype.is_integer:
        return None
    dims = shape_values(t)
    if dims is None or any(not isinstance(d, int) for d in dims):
        return None
    return dims[0] if rank == 0 else dims


def _constant(t):
    if type(t) is ops.EagerTensor:
        return t.numpy().tolist()
    found = _norm_rules.value_of(t)
    return None if found is None else found.tolist()


def meta_shape(meta):
    if isinstance(meta, tuple) and len(meta) == 2 and isinstance(meta[0], tuple):
        return meta[0]
    return None


def leading(shape):
    return shape[0] if shape else None


def off_path_axis(shape, batch, time_major=False):
    """The batch axis of a tensor off the path (neither computed on it
    nor a source) of ``shape``: 0 where its leading axis may be the
    batch's (of its size or a multiple of it, folded with time; unknown
    while tracing); with the inputs time-major (``time_major``, see
    inputs_time_major), its first other axis of the batch's size; else -1:
    it holds no example's values (a constant, a weight)."""
    if not shape:
        return -1
    lead = shape[0]
    if lead is None or (batch and lead % batch == 0):
        return 0
    if time_major and batch in shape[1:]:
        return shape.index(batch, 1)
    return -1


def inputs_time_major(shapes, batch):
    """Whether the examples lie off axis 0 in the inputs of ``shapes``
    (those off the path, and the sources that are tensors): none of two or
    more axes leads with the batch or a multiple of it, and one has an
    axis of its size (a time-major [T, B, ...] input with T not a
    multiple of B). Their batch axis is then that axis (off_path_axis),
    followed as a time-major transpose's is."""
    if not batch or batch < 2:
        return False
    shapes = [s for s in shapes if s is not None and len(s) > 1]
    return (not any(off_path_axis(s, batch) == 0 for s in shapes)
            and any(off_path_axis(s, batch, True) > 0 for s in shapes))


# Elementwise, one input: the output's row j is f(row j).
UNARY = frozenset({
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "CheckNumerics",
    "EnsureShape", "Cast", "captured_value", "ZerosLike", "OnesLike",
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Gelu", "Tanh", "Sigmoid",
    "Softplus", "Softsign", "Neg", "Abs", "Sign", "Square", "Sqrt", "Rsqrt",
    "Reciprocal", "Inv", "Exp", "Expm1", "Log", "Log1p", "Sin", "Cos", "Tan",
    "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Erf",
    "Erfc", "Erfinv", "Ndtri", "Lgamma", "Digamma", "Floor", "Ceil", "Round",
    "Rint", "IsNan", "IsInf", "IsFinite", "LogicalNot", "Real", "Imag", "Conj",
    "ComplexAbs", "Angle", "BesselI0e", "BesselI1e",
    "FakeQuantWithMinMaxArgs"})
# Elementwise with NumPy broadcasting: row j meets row j while every
# carrying input has the output's rank (a lower rank would broadcast its
# rows along another axis: [B, d] * [B, 1, d] is [B, B, d]).
BROADCASTING = frozenset({
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "Div", "RealDiv", "DivNoNan",
    "FloorDiv", "FloorMod", "Mod", "TruncateDiv", "TruncateMod", "Maximum",
    "Minimum", "SquaredDifference", "Pow", "Atan2", "Xdivy", "Xlogy",
    "Xlog1py", "Igamma", "Igammac", "Zeta", "Polygamma", "Betainc", "Complex",
    "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual",
    "LogicalAnd", "LogicalOr", "ApproximateEqual", "Select", "SelectV2",
    "ClipByValue",
    "AddN", "TanhGrad", "SigmoidGrad", "ReluGrad", "Relu6Grad", "EluGrad",
    "SeluGrad", "SoftplusGrad", "SoftsignGrad", "LeakyReluGrad", "RsqrtGrad",
    "SqrtGrad", "ReciprocalGrad", "InvGrad", "GeluGrad"})
ELEMENTWISE = UNARY | BROADCASTING
SEGMENTS = frozenset({
    "SegmentSum", "SegmentMean", "SegmentMax", "SegmentMin", "SegmentProd",
    "UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin",
    "UnsortedSegmentProd"})
# Ops whose output has the shape of their first input (the analysis carries
# a known shape across them, either way).
SAME_SHAPE = UNARY | frozenset({
    "BiasAdd", "BiasAddV1", "Identity", "Relu", "Relu6", "Elu", "Selu",
    "LeakyRelu", "Gelu", "Tanh", "Sigmoid", "Softplus", "Softsign", "Neg",
    "Sin", "Cos", "Exp", "Log", "Log1p", "Square", "Sqrt", "Rsqrt", "Abs",
    "Erf", "Softmax", "LogSoftmax", "Cast", "StopGradient", "ReverseV2",
    "Reverse", "Roll", "Cumsum", "Cumprod", "CumulativeLogsumexp",
    "ReverseSequence", "MatrixBandPart", "MatrixInverse", "Cholesky",
    "MatrixExponential", "MatrixLogarithm", "MatrixSquareRoot",
    "MatrixSetDiag", "MatrixSetDiagV3", "FFT", "IFFT", "FFT2D", "IFFT2D",
    "FFT3D", "IFFT3D"})


class _Op:
    """One recorded op as the conditions read it: ``ins``, each input's
    batch axis (-1 where it holds no rows), and ``axis``, the batch axis
    of those that hold rows."""

    __slots__ = ("entry", "shapes", "batch", "ins", "axis", "inputs", "axes")

    def __init__(self, entry, shapes, batch, ins, axes=None):
        self.entry = entry
        self.shapes = shapes
        self.batch = batch
        self.ins = ins
        self.axis = max(ins)
        self.inputs = getattr(entry.payload, "inputs", None) or ()
        self.axes = axes or {}      # tensor id -> its batch axis, if followed

    def carries(self, i):
        return i < len(self.ins) and self.ins[i] >= 0

    def carried(self):
        return [i for i, a in enumerate(self.ins) if a >= 0]

    def shape(self, i):
        ins = self.entry.input_ids
        shape = self.shapes.get(ins[i]) if i < len(ins) else None
        t = self.inputs[i] if i < len(self.inputs) else None
        if shape is None and t is not None and t.dtype != dtypes.resource and (
                t.shape.rank is not None):
            shape = tuple(t.shape.as_list())
        return shape

    def rank(self, i):
        shape = self.shape(i)
        return None if shape is None else len(shape)

    def kept_rank(self):
        """Input 0's rank, or (unknown: a softmax's input, its gradient
        reading only the output) its output's, for an op that keeps it."""
        rank = self.rank(0)
        if rank is None:
            out = self.out_shape()
            rank = None if out is None else len(out)
        return rank

    def out_shape(self):
        entry = self.entry
        shape = self.shapes.get(entry.output_ids[0]) if entry.output_ids else None
        if shape is None and entry.output_meta:
            shape = meta_shape(entry.output_meta[0])
        if shape is None:
            outputs = getattr(entry.payload, "outputs", None) or ()
            t = outputs[0] if outputs else None
            if t is not None and t.shape.rank is not None:
                shape = tuple(t.shape.as_list())
        return shape

    def const(self, i):
        t = self.inputs[i] if i < len(self.inputs) else None
        return None if t is None else value(t)

    def attr(self, name, default=None):
        return _norm_rules.attr(self.entry.payload, name, default)

    def after(self, axes, rank, keep=False):
        """The batch axis after an op along ``axes`` (a number or a list,
        negative from the end of ``rank`` axes): None where one of them
        is the batch's or may be (off axis 0, the rank unknown); else the
        batch axis, less the axes before it unless they are ``kept``."""
        if axes is None or (self.axis and rank is None):
            return None
        along = set()
        for a in nest.flatten(axes):
            a = int(a)
            if a < 0:
                if rank is None:
                    return None
                a += rank
            along.add(a)
        if self.axis in along:
            return None
        return self.axis - (0 if keep else len([a for a in along if a < self.axis]))


def _always(op):
    del op
    return True


def _elementwise(keeps):
    """Elementwise where ``keeps``: the batch axis where it lies."""
    def check(op):
        return op.axis if keeps(op) else None
    return check


def _on_axis0(keeps):
    """A condition known with the batch on axis 0 alone: kept there."""
    def check(op):
        return 0 if op.axis == 0 and keeps(op) else None
    return check


def _aligned(carried, shapes, out):
    """Whether the inputs ``carried`` (of ``shapes``) meet the output
    ``out`` axis for axis from the first, their rows not broadcast over
    others' (a leading axis of 1 against more)."""
    if out is None:
        return False
    for i in carried:
        shape = shapes[i]
        if shape is None or len(shape) != len(out):
            return False
        if shape and shape[0] == 1 and out[0] != 1:
            return False
    return True


def _broadcast_shape(shapes):
    """The broadcast of ``shapes`` (None if one is unknown), right-aligned;
    a dimension unknown in one stays unknown."""
    if None in shapes:
        return None
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(rank):
        dims = {s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0}
        known = dims - {1}
        out.append(None if None in dims else (known.pop() if len(known) == 1
                                              else 1 if not known else None))
    return tuple(out)


def _broadcast(op):
    shapes = [op.shape(i) for i in range(len(op.entry.input_ids))]
    return _aligned(op.carried(), shapes, op.out_shape() or _broadcast_shape(shapes))


def _select(op):
    # Select's condition may be a vector over the rows
    if op.rank(0) == 1 and op.rank(1) is not None and op.rank(1) > 1:
        shapes = [op.shape(i) for i in range(3)]
        return _aligned([i for i in op.carried() if i > 0], shapes, shapes[1])
    return _broadcast(op)


def _bias_add(op):
    # a bias over the channels, any layout
    return None if op.carries(1) else op.axis


def _per_row(*weights):
    """An op on each row of its data alone (a convolution), with the
    inputs ``weights`` the same for every row."""
    def check(op):
        return not any(op.carries(i) for i in weights)
    return check


def _last_axis(op):
    """An op over the last axis (a softmax): the batch's kept off it."""
    rank = op.kept_rank()
    return op.axis if rank is not None and op.axis < rank - 1 else None


def _top_k(op):
    return _last_axis(op) == 0


def _reshape_keeps(op, lead_out):
    # Row-major: while each example's values are one contiguous block, a
    # leading axis that is a multiple of B keeps every row inside one
    # example's block (Keras folds [B, T, d] into [B*T, d] and back).
    lead_in = leading(op.shape(0) or ())
    batch = op.batch
    if batch is None:       # (unknown while tracing)
        return _unknown_lead_keeps(op, lead_in, lead_out)
    return (lead_in is not None and lead_out is not None and lead_in > 0
            and lead_out > 0 and lead_in % batch == 0 and lead_out % batch == 0)


def _batch_lead(op):
    """Whether a Reshape's target leads with ``tf.shape(t)[0]`` of a
    tensor t whose leading axis is the batch's (unknown while tracing; its
    batch axis not followed elsewhere): [B, -1] whatever B is at run
    time, each example's values one row, where the input's rows are
    whole examples' or an example-major fold's (_unfolded)."""
    return _leads_with_batch(op.inputs[1] if len(op.inputs) > 1 else None,
                             op.axes) and _unfolded(op.inputs[0])


def _leads_with_batch(target, axes=None):
    dims = shape_values(target) if target is not None else None
    first = dims[0] if dims else None
    if not isinstance(first, _Dim) or first.axis != 0:
        return False
    t = first.tensor
    return (t.shape.rank is not None and t.shape.rank >= 1
            and t.shape[0] is None and (axes or {}).get(t._id, 0) == 0)  # pylint: disable=protected-access


def _unfolded(t, depth=0):
    """Whether a traced tensor's rows (its leading axis unknown while
    tracing) are not a fold of unknown layout: the row-wise ops before it
    reach no Reshape, or one that folds example-major (_rows_per_example)
    or unfolds to the batch (a target leading with it). A time-major fold
    ([T*B, d] from a transpose) is one."""
    op = getattr(t, "op", None)
    if op is None or depth > 16:
        return op is None
    if op.type == "Reshape":
        return (_rows_per_example(t) is not None
                or _leads_with_batch(op.inputs[1]))
    if op.type not in _ROW_WISE or not op.inputs:
        return True
    return _unfolded(op.inputs[0], depth + 1)


class _Dim:
    """An axis of a traced tensor unknown while tracing, as a shape vector
    reads it (``tf.shape(tensor)[axis]``)."""

    __slots__ = ("tensor", "axis")

    def __init__(self, tensor, axis):
        self.tensor = tensor
        self.axis = axis


def _known(d):
    return d if isinstance(d, int) else None


_INT_ARITHMETIC = {"Add": operator.add, "AddV2": operator.add,
                   "Sub": operator.sub, "Mul": operator.mul}


def shape_values(t, depth=0):
    """The elements of a traced shape vector (or scalar: one element) as
    far as they are known while tracing (an axis unknown then: a _Dim;
    else None); None where
    its make is not one read here (a constant, a tensor's shape, and the
    Pack, ConcatV2, GatherV2, StridedSlice and Prod that tf.tensordot,
    Keras' Dense on [B, T, d], builds its fold's target from; the Slice
    and integer arithmetic of TF's cross-entropies' fold to [-1, C])."""
    found = _constant(t)
    if found is not None:
        return found if isinstance(found, list) else [found]
    op = getattr(t, "op", None)
    if op is None or depth > 8:
        return None
    if op.type == "Shape":
        t = op.inputs[0]
        return None if t.shape.rank is None else [
            _Dim(t, i) if d is None else d for i, d in enumerate(t.shape.as_list())]
    parts = [shape_values(x, depth + 1) for x in op.inputs]
    if op.type == "Pack":
        if any(p is None or len(p) != 1 for p in parts):
            return None
        return [p[0] for p in parts]
    if op.type == "ConcatV2":
        if parts[-1] != [0] or any(p is None for p in parts[:-1]):
            return None
        return [d for p in parts[:-1] for d in p]
    if op.type in ("Cast", "Identity") or (
            op.type == "Reshape" and parts[0] is not None and len(parts[0]) == 1):
        return parts[0]     # (one value as a scalar or a vector: tf.repeat's)
    if op.type in _INT_ARITHMETIC and len(parts) == 2:
        # (an index computed from a rank: TF's sparse cross-entropy of
        # [B, T, C] logits folds them to [-1, shape[rank - 1]])
        a, b = parts
        if (a is None or b is None or len(a) != len(b)
                or any(_known(d) is None for d in a + b)):
            return None
        return [_INT_ARITHMETIC[op.type](x, y) for x, y in zip(a, b)]
    if op.type in ("GatherV2", "StridedSlice", "Prod", "Slice") and parts[0] is None:
        return None
    if op.type == "Slice":
        # (tf.nn.softmax_cross_entropy_with_logits' fold: [-1] and the
        # shape's slice from rank - 1)
        begin, size = parts[1:3]
        if (begin is None or size is None or len(begin) != 1 or len(size) != 1
                or _known(begin[0]) is None or _known(size[0]) is None):
            return None
        start = begin[0] % len(parts[0]) if parts[0] else 0
        return parts[0][start:None if size[0] < 0 else start + size[0]]
    if op.type == "GatherV2":
        if parts[2] != [0] or parts[1] is None or None in parts[1]:
            return None
        if any(not isinstance(i, int) or not -len(parts[0]) <= i < len(parts[0])
               for i in parts[1]):
            return None
        return [parts[0][i] for i in parts[1]]
    if op.type == "Prod":
        if parts[1] not in ([0], [-1]) or op.get_attr("keep_dims"):
            return None
        size = 1
        for d in parts[0]:
            if _known(d) is None:
                return [None]
            size *= d
        return [size]
    if op.type == "StridedSlice":
        begin, end, strides = parts[1:4]
        masks = [int(op.get_attr(m)) for m in (
            "begin_mask", "end_mask", "shrink_axis_mask", "ellipsis_mask",
            "new_axis_mask")]
        if (None in (begin, end, strides) or len(begin) != 1 or len(end) != 1
                or _known(begin[0]) is None or _known(end[0]) is None
                or strides != [1] or masks[3] or masks[4]):
            return None
        start = None if masks[0] & 1 else int(begin[0])
        if masks[2] & 1:
            if not -len(parts[0]) <= (start or 0) < len(parts[0]):
                return None
            return [parts[0][start or 0]]
        return parts[0][start:None if masks[1] & 1 else int(end[0])]
    return None


def _unknown_lead_keeps(op, lead_in, lead_out):
    """With the batch unknown while tracing: a leading axis unknown on
    both sides, each output row a whole input row or a piece of one (its
    other axes known: their size divides an input row's; a target made
    from shapes, as tf.tensordot's fold, read as far as known)."""
    shape, out = op.shape(0), op.out_shape()
    if out and None in out[1:] and len(op.inputs) > 1:
        dims = shape_values(op.inputs[1])
        if dims is not None and len(dims) == len(out):
            out = tuple(o if o is not None else _known(d)
                        for o, d in zip(out, dims))
    if lead_out == -1:
        lead_out = None     # (a target of [-1, ...]: the rows as many as fit)
    if lead_in is not None or lead_out is not None or not shape or not out:
        return False
    if _batch_lead(op):
        return True
    if None in shape[1:] or None in out[1:]:
        return False
    size_in = size_out = 1
    for d in shape[1:]:
        size_in *= d
    for d in out[1:]:
        size_out *= d
    if size_out > 0 and size_in % size_out == 0:
        return True
    # rows merged (Keras' Dense on [B, T, d] folds to [B*T, d] and back):
    # each example's rows as its fold made them
    rows = _rows_per_example(op.inputs[0] if op.inputs else None)
    return bool(rows) and size_out > 0 and (rows * size_in) % size_out == 0


_ROW_WISE = frozenset({"MatMul", "BiasAdd", "BiasAddV1"}) | UNARY | BROADCASTING


def _rows_per_example(t, depth=0, row=None):
    """How many rows of a traced tensor [k*B, ...] (the batch unknown while
    tracing) each example holds, where a Reshape made it from [B, ...]
    (a leading axis unknown, the others known) and only row-wise ops
    (a product whose rows are its first operand's, elementwise ones of
    its shape) lie between; else None."""
    op = getattr(t, "op", None)
    if op is None or depth > 16 or t.shape.rank is None:
        return None
    if op.type == "Reshape":
        src = op.inputs[0].shape
        before = op.inputs[0].op
        if before.type == "Transpose" and (value(before.inputs[1]) or [1])[0] != 0:
            return None     # (the batch moved off the leading axis)
        if row is None and None not in t.shape[1:]:
            row = 1
            for d in t.shape[1:]:
                row *= d
        if (src.rank is None or src.rank < 2 or src[0] is not None
                or None in src[1:] or not row):
            return None
        size = 1
        for d in src[1:]:
            size *= d
        return size // row if size % row == 0 else None
    if op.type not in _ROW_WISE or not op.inputs:
        return None
    first = op.inputs[0]
    if op.type == "MatMul":
        if op.get_attr("transpose_a"):
            return None
        kernel = op.inputs[1].shape
        # (its rows as long as the kernel's contracted axis)
        row = kernel[1 if op.get_attr("transpose_b") else 0] if kernel.rank == 2 else None
        return _rows_per_example(first, depth + 1, row)
    if not first.shape.is_compatible_with(t.shape) or first.shape.rank != t.shape.rank:
        return None
    return _rows_per_example(first, depth + 1, row)


def _reshape(op):
    lead_out = leading(op.out_shape() or ())
    if lead_out is None:
        target, shape = op.const(1), op.shape(0)
        if target:
            lead_out = target[0]
            if lead_out == -1 and shape is not None and None not in shape:
                rest = 1
                for d in target[1:]:
                    rest *= d
                size = 1
                for d in shape:
                    size *= d
                lead_out = size // rest if rest > 0 else None
    return _reshape_keeps(op, lead_out)


def _expand_dims(op):
    """A new axis: the batch's after it (on axis 0, kept there or refused:
    the walk takes an op on axis 0 to keep it there)."""
    rank, at = op.rank(0), op.const(1)
    at = None if at is None else nest.flatten(at)
    if not at or len(at) != 1 or rank is None:
        return 0 if op.axis == 0 and _reshape_keeps(
            op, leading(op.out_shape() or ())) else None
    if int(at[0]) % (rank + 1) > op.axis:
        return op.axis
    return op.axis + 1 if op.axis else None


def _squeeze(op):
    dims = op.attr("squeeze_dims") or ()
    if dims:
        return op.after(list(dims), op.rank(0))
    # (every axis of size 1: the batch's kept where its size is known)
    lead = leading(op.shape(0) or ())
    return 0 if op.axis == 0 and lead is not None and lead != 1 else None


def _transpose(op):
    perm = op.const(1)
    return perm is not None and len(perm) > 0 and perm[0] == 0


def _reduce(op):
    """A reduction along other axes than the batch's: the batch's after it."""
    keep = op.attr("keep_dims") and op.entry.op_type[:3] != "Arg"
    return op.after(op.const(1), op.rank(0), keep)


def _segments(op):
    """Segments of the leading axes (as many as the ids' axes, the ids
    holding no rows): the batch's after them, where it is not among them."""
    ids = op.shape(1)
    if (not op.carries(0) or any(op.carries(i) for i in range(1, len(op.ins)))
            or ids is None or op.axis < len(ids)):
        return None
    return op.axis - len(ids) + 1


def _axis_input(axis_at, data_at=0, extra=0):
    """An op along the axis given by input ``axis_at`` (a split, reverse,
    concat): it keeps the rows when that axis is not the batch's."""
    def check(op):
        rank = op.rank(data_at)
        return op.after(op.const(axis_at),
                        None if rank is None else rank + extra) is not None
    return check


def _along_input(op):
    """A scan or concat along the axis its last input gives: the batch's
    kept off it (off axis 0, a scan's input unknown: its output's rank)."""
    rank = op.kept_rank() if op.axis else op.rank(0)
    return op.after(op.const(len(op.entry.input_ids) - 1), rank, keep=True)


def _attr_axis(extra=0):
    def check(op):
        rank = op.rank(0)
        return op.after(op.attr("axis", 0),
                        None if rank is None else rank + extra) is not None
    return check


def _strided_slice(op):
    begin, end, strides = op.const(1), op.const(2), op.const(3)

    def mask(name):
        return int(op.attr(name, 0) or 0) & 1
    if None in (begin, end) and strides and strides[0] == 1 and not (
            mask("ellipsis_mask") or mask("shrink_axis_mask")
            or mask("new_axis_mask")):
        # (bounds computed while tracing, xs[:, t] in a loop body: the
        # batch axis taken whole by the masks)
        return bool(mask("begin_mask") and mask("end_mask"))
    if None in (begin, end, strides) or not begin:
        return False
    if mask("ellipsis_mask"):
        # a leading ellipsis holds the batch axis unless it stands for no
        # axis (x[..., ::-1, :] of a matrix reverses the batch): the
        # entries after it, new axes aside, as many as the input's axes
        rank = op.rank(0)
        new_axes = bin(int(op.attr("new_axis_mask", 0) or 0)).count("1")
        return rank is not None and len(begin) - 1 - new_axes < rank
    if mask("shrink_axis_mask") or mask("new_axis_mask"):
        return False
    lead = leading(op.shape(0) or ())
    if (strides[0] > 1 and op.batch and lead is not None
            and lead == strides[0] * op.batch):
        # [k*B, ...] (each example's k rows in a block, tf.repeat's) taken
        # one row in k from one in the first block: a row of each example
        return ((mask("begin_mask") or 0 <= begin[0] < strides[0])
                and (mask("end_mask") or end[0] >= lead))
    if strides[0] != 1:
        return False
    return ((mask("begin_mask") or begin[0] == 0)
            and (mask("end_mask") or (op.batch is not None and end[0] >= op.batch)))


def _slice(op):
    begin, size = op.const(1), op.const(2)
    if not begin or begin[0] != 0:
        return False
    if size is not None:
        return size[0] in (-1, op.batch)
    # (eagerly the size is not kept: the leading axis taken whole)
    lead = leading(op.shape(0) or ())
    return lead is not None and lead == leading(op.out_shape() or ())


def _gather(op):
    # rows picked from a table that holds none keep the indices' rows
    if not op.carries(0):
        return True
    if op.entry.op_type != "GatherV2":
        return False
    return op.after(op.const(2), op.rank(0)) is not None


def _params_only(op):
    return not op.carries(0)


def _tile(op):
    multiples = op.const(1)
    return bool(multiples) and multiples[0] == 1


def _roll(op):
    shifts, axes = op.const(1), op.const(2)
    if shifts is not None and axes is not None:
        shifts, axes = nest.flatten(shifts), nest.flatten(axes)
        if len(shifts) == 1:
            shifts = shifts * len(axes)
        # (a shift of 0 moves nothing)
        axes = [a for s, a in zip(shifts, axes) if s != 0] or [-1]
    return op.after(axes, op.rank(0)) is not None


def _pad(op):
    paddings = op.const(1)
    return op.axis if paddings and list(paddings[op.axis]) == [0, 0] else None


def _reverse_sequence(op):
    return int(op.attr("batch_dim", 0) or 0) == 0


def _broadcast_to(op):
    if not op.carries(0):
        return True     # (only its shape from the rows: tf.shape(h))
    target = op.const(1)
    return target is not None and _aligned([0], [op.shape(0)], tuple(target))


def _matmul(op):
    """A product's rows are its first operand's, while that operand is not
    transposed and the second holds no example's values: ``V @ h``, with V
    [B, B] and h computed from the batch, sums other examples' rows into
    each row. Batch dimensions (rank above 2) keep their rows, where every
    carrying operand has the output's rank. Off axis 0: a batch dimension
    of operands of one rank, or a's (b holding none), or a MatMul's column
    of b (each an example's) times a holding none."""
    shapes = [op.shape(0), op.shape(1)]
    if op.axis:
        a, b = (None if s is None else len(s) for s in shapes)
        if op.entry.op_type == "MatMul":
            return 1 if (op.axis == 1 and not op.carries(0) and a == 2
                         and not op.attr("transpose_b")) else None
        if a is None or b is None:
            return None
        if op.carries(0) and not op.carries(1):
            # a's batch dimensions or rows, not adjointed
            return (None if op.attr("adj_x") or op.axis >= a - 1
                    else op.axis + max(a, b) - a)
        return op.axis if a == b and op.axis < a - 2 else None
    if op.entry.op_type != "MatMul" and None not in shapes and max(
            len(s) for s in shapes) > 2:
        batch_dims = [s[:-2] for s in shapes]
        return 0 if _aligned([i for i in op.carried() if i < 2], batch_dims,
                             _broadcast_shape(batch_dims)) else None
    flag = "transpose_a" if op.entry.op_type == "MatMul" else "adj_x"
    # (b's rows contracted, or moved to the columns)
    return None if op.carries(1) or (op.carries(0) and op.attr(flag, False)) else 0


def _einsum(op):
    eq = op.attr("equation")
    if isinstance(eq, bytes):
        eq = eq.decode()
    if not eq or "->" not in eq:
        return False
    lhs, out = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    # operands that hold rows lead with the output's first index, which is
    # not summed over
    return bool(out) and out[:1] != "." and all(
        terms[i][:1] == out[:1] for i in op.carried() if i < len(terms))


def _reverse_mask(op):
    """Reverse (TF's first, by a mask of axes): not along the batch's."""
    dims = op.const(1)
    return dims is not None and not any(nest.flatten(dims)[:1])


def _inner(axes):
    """An op on each input's last ``axes`` axes alone (an FFT, a matrix
    op, an image op): each example's while every carrying input has more
    axes than that, all of one rank (their batch dimensions met, none
    broadcast)."""
    def check(op):
        carried = op.carried()
        ranks = {op.rank(i) for i in carried}
        if None in ranks or len(ranks) != 1 or ranks.pop() <= axes:
            return False
        shapes = [op.shape(i) for i in range(len(op.entry.input_ids))]
        return _aligned(carried, shapes, shapes[carried[0]])
    return check


def _image(*weights):
    """An op on each image of a [B, ...] batch (a resize, a crop of each
    image, patches): its data input 0 of rank 4 or more, the inputs
    ``weights`` (a size, a filter) holding no example."""
    def check(op):
        rank = op.rank(0)
        return (not any(op.carries(i) for i in weights)
                and rank is not None and rank >= 4)
    return check


def _batch_norm(op):
    # per-channel statistics given as inputs (training: _check_mixing)
    return not any(op.carries(i) for i in range(1, 5))


# op type -> the batch axis after the op, given its inputs' (see _Op);
# None where it may mix the examples. Conditions known with the batch on
# axis 0 alone:
ROW_OPS = {op: _on_axis0(keeps) for op, keeps in {
    # per row: the cross-entropies, shapes and integers of a row
    "SparseSoftmaxCrossEntropyWithLogits": _always,
    "SoftmaxCrossEntropyWithLogits": _always,
    "Shape": _always, "ShapeN": _always, "Size": _always, "Rank": _always,
    "Reshape": _reshape,
    "Transpose": _transpose, "ConjugateTranspose": _transpose,
    "Concat": _axis_input(0, 1),
    "Pack": _attr_axis(extra=1), "Unpack": _attr_axis(),
    "Split": _axis_input(0, 1), "SplitV": _axis_input(2),
    "ReverseV2": _axis_input(1),
    "Roll": _roll, "Tile": _tile, "BroadcastTo": _broadcast_to,
    "ReverseSequence": _reverse_sequence,
    "Slice": _slice, "StridedSlice": _strided_slice,
    "GatherV2": _gather, "Gather": _gather, "ResourceGather": _params_only,
    "GatherNd": _params_only,
    "Einsum": _einsum,
    "Conv2D": _per_row(1), "Conv3D": _per_row(1),
    "DepthwiseConv2dNative": _per_row(1),
    "Conv2DBackpropInput": _per_row(1),
    "Conv3DBackpropInputV2": _per_row(1),
    "MaxPool": _always, "AvgPool": _always, "MaxPool3D": _always,
    "AvgPool3D": _always, "MaxPoolV2": _always, "MaxPoolWithArgmax": _always,
    "LRN": _always,
    "FusedBatchNorm": _batch_norm, "FusedBatchNormV2": _batch_norm,
    "FusedBatchNormV3": _batch_norm,
    "Reverse": _reverse_mask, "Fill": _per_row(1),
    # a traced loop's lists of time steps (each leading with the batch;
    # a list over the batch is refused where it is made, on the path)
    "TensorListGetItem": _always, "TensorListSetItem": _always,
    "TensorListReserve": _always, "TensorListLength": _always,
    "TensorListElementShape": _always, "TensorListPushBack": _always,
    "TensorListPopBack": _always,
    "IdentityN": _always, "CheckNumericsV2": _always,
    "TopKV2": _top_k, "InTopKV2": _always, "OneHot": _always,
    "Bucketize": _always, "BroadcastArgs": _always,
    "FakeQuantWithMinMaxVars": _per_row(1, 2),
    "FakeQuantWithMinMaxVarsPerChannel": _per_row(1, 2),
    "Dilation2D": _per_row(1),
    # each image of the batch: resizes, rearrangements, patches, colours
    "ResizeBilinear": _image(1), "ResizeNearestNeighbor": _image(1),
    "ResizeBicubic": _image(1), "ResizeArea": _image(1),
    "ScaleAndTranslate": _image(1, 2, 3),
    "DepthToSpace": _image(), "SpaceToDepth": _image(),
    "ExtractImagePatches": _image(), "ExtractVolumePatches": _image(),
    "AdjustContrastv2": _image(1), "AdjustHue": _image(1),
    "AdjustSaturation": _image(1),
    "RGBToHSV": _always, "HSVToRGB": _always,
    # over the inner axes: FFTs, matrices (a batch of them: rank above 2)
    "FFT": _inner(1), "IFFT": _inner(1), "RFFT": _inner(1),
    "IRFFT": _inner(1), "FFT2D": _inner(2), "IFFT2D": _inner(2),
    "RFFT2D": _inner(2), "IRFFT2D": _inner(2), "FFT3D": _inner(3),
    "IFFT3D": _inner(3), "RFFT3D": _inner(3), "IRFFT3D": _inner(3),
    "Cross": _inner(1),
    "MatrixBandPart": _inner(2), "MatrixInverse": _inner(2),
    "Cholesky": _inner(2), "MatrixDeterminant": _inner(2),
    "LogMatrixDeterminant": _inner(2), "MatrixSolve": _inner(2),
    "MatrixTriangularSolve": _inner(2), "Qr": _inner(2), "Svd": _inner(2),
    "SelfAdjointEigV2": _inner(2), "Eig": _inner(2), "Lu": _inner(2),
    "MatrixExponential": _inner(2), "MatrixLogarithm": _inner(2),
    "MatrixSquareRoot": _inner(2), "MatrixSolveLs": _inner(2),
    "MatrixDiagPartV3": _inner(2), "MatrixDiagPart": _inner(2),
    "MatrixSetDiagV3": _inner(2), "MatrixSetDiag": _inner(2),
    "MatrixDiagV3": _inner(1), "MatrixDiag": _inner(1),
}.items()}
# (random values drawn for a shape read from the rows, a dropout's mask:
# they hold no example's values)
ROW_OPS.update(dict.fromkeys((
    "RandomUniform", "RandomStandardNormal", "TruncatedNormal",
    "RandomUniformInt", "StatelessRandomUniform", "StatelessRandomNormal",
    "StatelessTruncatedNormal", "StatelessRandomUniformV2",
    "StatelessRandomNormalV2", "StatelessTruncatedNormalV2",
    "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2",
    "StatelessRandomBinomial"), _on_axis0(_per_row(*range(1, 6)))))
# (TF refuses pooling windows over the batch, and a convolution's batch is
# its data's: each keeps the rows whatever its attrs.)
# ... and wherever the batch lies: elementwise ops, and ops along others
ROW_OPS.update(dict.fromkeys(UNARY, _elementwise(_always)))
ROW_OPS.update(dict.fromkeys(BROADCASTING, _elementwise(_broadcast)))
ROW_OPS.update(dict.fromkeys(SEGMENTS, _segments))
ROW_OPS.update({
    "Select": _elementwise(_select),
    "BiasAdd": _bias_add, "BiasAddV1": _bias_add,
    "Softmax": _last_axis, "LogSoftmax": _last_axis,
    "ExpandDims": _expand_dims, "Squeeze": _squeeze,
    "Sum": _reduce, "Mean": _reduce, "Max": _reduce, "Min": _reduce,
    "Prod": _reduce, "EuclideanNorm": _reduce, "All": _reduce, "Any": _reduce,
    "ArgMax": _reduce, "ArgMin": _reduce,
    "ConcatV2": _along_input, "Cumsum": _along_input,
    "Cumprod": _along_input, "CumulativeLogsumexp": _along_input,
    "Pad": _pad, "PadV2": _pad, "MirrorPad": _pad,
    "MatMul": _matmul, "BatchMatMul": _matmul, "BatchMatMulV2": _matmul,
    "BatchMatMulV3": _matmul,
})


def batch_axis(entry, shapes, batch, ins, axes=None):
    """The batch axis of ``entry``'s outputs, given its inputs' (``ins``:
    -1 where one holds no rows; the others hold it on one axis), where
    ROW_OPS knows the op keeps the examples apart; else None. ``axes``:
    the batch axes the analysis followed, by tensor id."""
    check = ROW_OPS.get(entry.op_type)
    return None if check is None else check(_Op(entry, shapes, batch, ins, axes))


def keeps_apart(entry, shapes, batch, carrying, axes=None):
    """True where ``entry`` provably keeps each example's values apart
    from the others' with the batch where it lies (batch_axis: the
    carrying inputs' batch axis at 0; an elementwise op's wherever
    ``axes``, the batch axes the analysis followed, put it), or reads no
    tensor that carries rows; False for any other op: the analysis
    refuses it, as it may mix the examples (its rows would be no single
    example's gradients)."""
    axes = axes or {}
    # (-1: an input the analysis followed as holding no batch, a weight's
    # value computed off the rows, however it is carried)
    ins = [axes.get(tid, 0) if tid in carrying else -1 for tid in entry.input_ids]
    if max(ins, default=-1) < 0:
        return True
    if entry.op_type not in ELEMENTWISE and max(ins) > 0:
        return False
    return batch_axis(entry, shapes, batch, ins, axes) is not None


def keeps_axis0(entry, shapes, batch, carrying):
    """True where ``entry`` provably keeps every example's row on axis 0
    (keeps_apart, every carrying input's batch there), or reads no tensor
    that carries rows; False where it may move them."""
    return keeps_apart(entry, shapes, batch, carrying)


def carries_rows(entry, carrying, weak, produced, alias, shapes, batch,
                 may_rule, time_major=False):
    """(whether ``entry``'s outputs may hold examples' rows, whether they
    hold only ``weak`` ones). They may where it reads a carrying tensor,
    or a tensor off the path (neither computed on it nor a source) that
    holds the batch (off_path_axis, ``time_major`` as there) and has more
    axes, or an unknown shape. A vector
    off the path as long as the batch (labels, ids, or a batch norm's
    moving variance with as many channels as examples) is weak: what is
    computed from it and parameters carries rows only from an op a rule
    may read (``may_rule(entry, pos)`` for a source at input pos: an
    embedding of the labels, a scale of a feature), as no rule's rows
    reach it before."""
    if batch is None:
        return True, False      # (unknown while tracing: no rule anyway)
    inputs = getattr(entry.payload, "inputs", None) or ()
    vector = False
    for i, tid in enumerate(entry.input_ids):
        if tid in carrying:
            return True, False
        if tid in weak:
            vector = True
        if tid in produced or tid in alias:
            continue
        shape = shapes.get(tid)
        t = inputs[i] if i < len(inputs) else None
        if shape is None and t is not None:
            if t.dtype == dtypes.resource:
                continue
            if t.shape.rank is not None:
                shape = tuple(t.shape.as_list())
        if shape is None:
            return True, False
        # (a leading axis of B*T: the batch folded with time, Keras' Dense
        # on [B, T, d]; nb*B: a dilated convolution's blocks; the batch on
        # another axis of time-major inputs)
        if shape and shape[0] != 0 and off_path_axis(shape, batch, time_major) >= 0:
            if len(shape) > 1:
                return True, False
            vector = True
    if not vector:
        return False, False
    if any(tid in alias and may_rule(entry, i)
           for i, tid in enumerate(entry.input_ids)):
        return True, False
    return False, True
