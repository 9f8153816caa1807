"""Per-example gradients of the loop invariants of a traced While (a Keras 3
RNN's kernel, recurrent kernel and bias, captured by its one While op),
from TF's own gradient of the loop (while_v2's _WhileGrad: a backward
While over the body's gradient). Inside the body each op that meets the
weight and the batch (``plan``: a MatMul, a BiasAdd, a broadcast Add of a
bias) hands over what each example's term needs (a_t and g_t; g_t), in
place of their sum over the batch, through the loop variable TF carries
the variable's gradient in: a TensorList, one element per iteration (set
at the backward loop's counter), stacked after the loop, batch-major.
A tensor the meets of several variables read (an LSTM's gate gradient)
goes to one of their lists only; where the body reads a variable more
than once (a Keras GRU's gate slices of a kernel), and under XLA (whose
lists are buffers of a size and element shape fixed while compiling: the
loop's bound), each list's columns are fixed in advance, each read
writing its own meets' (TF's pass adds the reads' lists). A variable
read by MatMuls alone, of the whole of it or of ranges of its rows and
columns, comes back as its factors (Factors: the iterations' inputs and
output gradients), whose norms and clipped sum the caller's rule of a
batched product takes (the ghost norm, one product): no per-example
gradient is built; the others' terms are summed over the iterations.

The weight's own ops between its read and those (a Split, Squeeze or
Unpack of GRU's two biases) then carry the terms back to the variable,
the batch axis in front. The analysis (_per_example._loop_proof) proves the
plan: the body keeps every example's rows its own, and reads the weight
only through these ops.
"""

import collections

from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_util
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import array_ops_stack
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import list_ops
from tensorflow.python.ops import math_ops
from tensorflow.python.ops import special_math_ops
from tensorflow.python.ops import while_v2

from fasttape.recording import _recording

# ops on a weight's values alone (no batch), by how a per-example gradient
# goes back through them: their batch axis in front
WEIGHT_OPS = frozenset({"ReadVariableOp", "Identity", "Squeeze", "Reshape",
                        "ExpandDims", "Split", "SplitV", "Unpack",
                        "StridedSlice"})
_MASKS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
          "shrink_axis_mask")
# ops meeting a weight (at input 1) and the batch (input 0, axis 0)
MEETS = frozenset({"MatMul", "BiasAdd", "Add", "AddV2"})


def _zeros(t, batch):
    return array_ops.zeros([batch] + t.shape.as_list(), t.dtype)


def _back(op, pieces, batch):
    """A weight-side op's input's per-example gradient from its outputs'
    (``pieces``, [B] in front, None where none reached)."""
    kind = op.type
    pieces = [_zeros(o, batch) if p is None else p for p, o in zip(pieces, op.outputs)]
    if kind in ("ReadVariableOp", "Identity"):
        return pieces[0]
    if kind in ("Squeeze", "Reshape", "ExpandDims"):
        return array_ops.reshape(pieces[0], [batch] + op.inputs[0].shape.as_list())
    if kind == "StridedSlice":
        # the slice's gradient, one axis more in front (taken whole)
        begin, end, strides = _slice_spec(op)
        masks = {m: int(op.get_attr(m)) << 1 for m in _MASKS}
        masks["begin_mask"] |= 1
        masks["end_mask"] |= 1
        return array_ops.strided_slice_grad(
            [batch] + op.inputs[0].shape.as_list(), [0] + begin, [0] + end,
            [1] + strides, pieces[0], **masks)
    if kind == "Unpack":
        return array_ops_stack.stack(pieces, axis=int(op.get_attr("axis")) % (
            op.inputs[0].shape.rank) + 1)
    rank = op.inputs[0 if kind == "SplitV" else 1].shape.rank
    axis = int(tensor_util.constant_value(op.inputs[2 if kind == "SplitV" else 0])) % rank
    return array_ops.concat(pieces, axis + 1)


def _slice_spec(op):
    """A StridedSlice's begin, end and strides, as lists; None where one is
    not a constant while tracing."""
    spec = [tensor_util.constant_value(t) for t in op.inputs[1:4]]
    return None if any(v is None for v in spec) else [list(map(int, v)) for v in spec]


def weight_op_proven(op):
    """Whether a weight-side op's per-example gradient can be carried back
    (_back): a StridedSlice's spec must be known while tracing."""
    return op.type != "StridedSlice" or _slice_spec(op) is not None


def _ranges(op):
    """A StridedSlice of a 2-D weight that is a range of rows and one of
    columns (stride 1, no axis added or dropped): ((first row, last + 1),
    (first column, last + 1)); else None."""
    spec = _slice_spec(op)
    shape = op.inputs[0].shape
    if (spec is None or shape.rank != 2 or any(op.get_attr(m) for m in _MASKS[2:])
            or len(spec[0]) > 2):
        return None
    out = []
    for d in range(2):
        if d >= len(spec[0]):
            out.append((0, int(shape[d])))
            continue
        first = None if op.get_attr("begin_mask") >> d & 1 else spec[0][d]
        last = None if op.get_attr("end_mask") >> d & 1 else spec[1][d]
        start, stop, step = slice(first, last, spec[2][d]).indices(int(shape[d]))
        if step != 1 or stop <= start:
            return None
        out.append((start, stop))
    return tuple(out)


def _term(op, a, g):
    """A meeting op's per-example term for its weight, [B] + the weight's
    shape, summed over the iterations: from its inputs a and output
    gradients g, [B, T, ...] each."""
    if op.type == "MatMul":
        eq = "bti,bto->boi" if op.get_attr("transpose_b") else "bti,bto->bio"
        return special_math_ops.einsum(eq, a, g)
    axes = list(range(1, g.shape.rank - op.inputs[1].shape.rank))
    return math_ops.reduce_sum(g, axes) if axes else g


def _back_to_variable(kinds, terms, by_id, batch):
    """{read op: the variable's per-example gradient}: the terms of the
    meeting ops (``terms``: weight tensor id -> [B] + its shape) carried
    back through the weight-side ops, last first."""
    out = {}
    for op in sorted(_weight_ops(kinds, by_id), key=lambda o: -o._id):  # pylint: disable=protected-access
        pieces = [_sum(terms.get(o._id)) for o in op.outputs]  # pylint: disable=protected-access
        value = _back(op, pieces, batch)
        if op.type == "ReadVariableOp":
            out[op] = value
        else:
            terms.setdefault(op.inputs[1 if op.type == "Split" else 0]._id, []).append(value)  # pylint: disable=protected-access
    return out


def _weight_ops(kinds, by_id):
    return [by_id[key] for key, kind in kinds.items() if kind == "weight"]


def _sum(terms):
    if not terms:
        return None
    return terms[0] if len(terms) == 1 else math_ops.add_n(terms)


def per_example(while_op, grads, plans, batch):
    """({i: [B] + shape per-example gradients, or their Factors} of the
    While's resource inputs i of ``plans`` (i -> (the variable's shape, dtype, {id(op):
    "weight" or "meet"} of the body ops it flows through)), the gradients
    of its other inputs: TF's pass' (None at those i)), from ``grads`` of
    its outputs (the pass of the losses to them). One backward loop gives
    both: as the While's gradient inside a pass that goes on below it, it
    spares that pass TF's own backward loop."""
    body = while_op._body_graph  # pylint: disable=protected-access
    by_id = {id(op): op for op in body.get_operations()}
    xla = control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())
    # A loop variable none of the losses reads gets zeros, as TF's pass
    # gives it (with None, _WhileGrad leaves it out of the backward loop,
    # and so the gradient its later steps carry back through it: a
    # recurrent state). (A While differentiated before holds more outputs:
    # none of theirs.)
    grads = [array_ops.zeros_like(o) if g is None and o.dtype.is_floating else g
             for g, o in zip(grads, while_op.outputs)]
    grads += [None] * (len(while_op.outputs) - len(grads))
    slots = {}        # i -> meets, in order: [(op, width of its columns)]
    overrides = {}
    # the loop's one set of what the meets handed over, and where each
    # tensor of it went: the meets of a loop's variables read the same
    # tensors (an LSTM's gate gradient, for its kernel, recurrent kernel and
    # bias), each written to one list only (not under XLA: there each list's
    # columns are fixed in advance, its element shape known at its reserve).
    # The lists hold the forward loop's iterations (under XLA, its bound:
    # XLA sizes a list while compiling; the rows past the last iteration
    # stay zeros). size: the backward loop's input holding their number.
    handed = {}
    layout = {"placed": {}, "width": {}, "size": 1 if xla else 2}
    for i, (shape, dtype, kinds) in plans.items():
        meets = [by_id[key] for key, kind in kinds.items() if kind == "meet"]
        meets.sort(key=lambda o: o._id)  # pylint: disable=protected-access
        reads = [by_id[key] for key, kind in kinds.items()
                 if kind == "weight" and by_id[key].type == "ReadVariableOp"]
        slots[i] = [(op, _width(op)) for op in meets]
        element = None
        if len(reads) > 1 or xla:
            element = [batch, _fix_layout(i, slots[i], layout)]
        grads[i] = list_ops.tensor_list_reserve(
            element, while_op.inputs[1] if xla else while_op.outputs[0], dtype)
        for op in meets:
            overrides[op] = _hand_over(op, handed)
        for op in reads:
            overrides[op] = _collect(
                i, slots[i], layout, handed, batch,
                _downstream(op, kinds) if len(reads) > 1 else (
                    set(meets) if element else None))
    with _recording.gradient_functions_of(overrides):
        out = while_v2._WhileGrad(while_op, *grads)  # pylint: disable=protected-access
    for op in [op for op in layout if isinstance(op, ops.Operation)]:
        if op not in handed:
            layout[op] = None   # (a fixed layout's meet no gradient reached)
    # the iterations' rows, batch-major: [B, T, width] (T known while
    # tracing where the loop's bound is: the list padded to it with zero
    # rows, which add nothing to any term)
    bound = _constant_bound(while_op.inputs[1])
    rows = {"columns": {}}
    for i, width in layout["width"].items():
        if not width:
            continue
        handle = out[i]
        if bound is not None and not xla:     # (under XLA: its size)
            handle = list_ops.tensor_list_resize(handle, bound)
        rows[i] = array_ops.transpose(list_ops.tensor_list_stack(
            handle, plans[i][1], element_shape=[batch, width],
            num_elements=-1 if bound is None else bound), [1, 0, 2])
    result = {}
    for i, (shape, dtype, kinds) in plans.items():
        blocks = _blocks(slots[i], kinds, by_id, shape)
        if blocks is not None:
            result[i] = _factors(blocks, layout, rows, batch, dtype, shape)
            continue
        terms = {}
        for op, w in slots[i]:
            k = int(op.inputs[0].shape[1]) if op.type == "MatMul" else 0
            at = layout.get(op)
            if at is None:      # no gradient reached it
                a = array_ops.zeros([batch, 1, k], dtype)
                g = array_ops.zeros([batch, 1, w - k], dtype)
            else:
                g = _columns(rows, at[1], w - k)
                a = _columns(rows, at[0], k) if k else None
            if op.type == "MatMul":
                term = _term(op, a, g)
            else:
                term = _term(op, None, array_ops.reshape(
                    g, [batch, -1] + op.outputs[0].shape.as_list()[1:]))
            terms.setdefault(op.inputs[1]._id, []).append(term)  # pylint: disable=protected-access
        result[i] = _sum(list(_back_to_variable(kinds, terms, by_id, batch).values()))
    return result, [None if i in plans else g for i, g in enumerate(out)]


def _downstream(read, kinds):
    """The meets of one read of a variable (of several in the body): the
    ops of ``kinds`` its value reaches."""
    out, stack = set(), [read]
    while stack:
        op = stack.pop()
        for t in op.outputs:
            for c in t.consumers():
                kind = kinds.get(id(c))
                if kind == "meet":
                    out.add(c)
                elif kind == "weight" and c not in out:
                    out.add(c)
                    stack.append(c)
    return out


def _fix_layout(i, slots, layout):
    """The columns of variable i's list where the body reads it more than
    once: each meet's a and g at columns fixed in advance, no tensor shared
    with another list (each read writes its own meets' columns, zeros in
    the others', and TF's pass adds the reads' lists: the rows of all)."""
    width = 0
    for op, w in slots:
        k = int(op.inputs[0].shape[1]) if op.type == "MatMul" else 0
        layout[op] = ((i, width) if k else None, (i, width + k))
        width += w
    layout["width"][i] = width
    return width


def _blocks(slots, kinds, by_id, shape):
    """Where a variable is read by MatMuls alone: by one, of the whole
    read ([(meet, None)]), or by several, each of a range of its rows and
    columns (a Keras GRU's gates; transpose_b unset): [(meet, ((first
    row, end), (first column, end)))]; else None."""
    weight_ops = _weight_ops(kinds, by_id)
    if not slots or any(op.type != "MatMul" for op, _ in slots):
        return None
    if len(slots) == 1 and [o.type for o in weight_ops] == ["ReadVariableOp"]:
        return [(slots[0][0], None)]
    out, slices = [], set()
    for op, _ in slots:
        w = op.inputs[1].op
        ranges = _ranges(w) if w.type == "StridedSlice" else None
        if (ranges is None or op.get_attr("transpose_b")
                or w.inputs[0].op.type != "ReadVariableOp"):
            return None
        out.append((op, ranges))
        slices.add(id(w))
    if any(o.type != "ReadVariableOp" and id(o) not in slices for o in weight_ops):
        return None     # (another op on the weight: the general way)
    return out


def _factors(blocks, layout, rows, batch, dtype, shape):
    """The Factors of a variable read by the MatMuls of ``blocks``
    (_blocks): each block's a and g padded to the weight's rows and
    columns (zero rows and columns add nothing); the blocks whose a is one
    tensor and one range of rows summed (their columns are disjoint), the
    others concatenated along the iterations (the sum over all the
    iterations is then the sum of the blocks' products)."""
    if blocks[0][1] is None:
        op = blocks[0][0]
        transpose_b = op.get_attr("transpose_b")
        k, n = int(op.inputs[0].shape[1]), int(op.outputs[0].shape[1])
        at = layout.get(op)
        if at is None:      # no gradient reached it
            return Factors(array_ops.zeros([batch, 1, k], dtype),
                           array_ops.zeros([batch, 1, n], dtype), transpose_b)
        return Factors(_columns(rows, at[0], k), _columns(rows, at[1], n),
                       transpose_b)
    groups = {}
    for op, ((r0, r1), (c0, c1)) in blocks:
        at = layout.get(op)
        if at is None:
            continue        # no gradient reached it
        g = _columns(rows, at[1], c1 - c0)
        if (c0, c1) != (0, shape[1]):
            g = array_ops.pad(g, [[0, 0], [0, 0], [c0, shape[1] - c1]])
        key = (op.inputs[0].ref(), r0, r1)
        if key in groups:
            groups[key][1].append(g)
            continue
        a = _columns(rows, at[0], r1 - r0)
        if (r0, r1) != (0, shape[0]):
            a = array_ops.pad(a, [[0, 0], [0, 0], [r0, shape[0] - r1]])
        groups[key] = (a, [g])
    if not groups:
        return Factors(array_ops.zeros([batch, 1, shape[0]], dtype),
                       array_ops.zeros([batch, 1, shape[1]], dtype), False)
    a = [a for a, _ in groups.values()]
    g = [_sum(gs) for _, gs in groups.values()]
    if len(a) == 1:
        return Factors(a[0], g[0], False)
    return Factors(array_ops.concat(a, 1), array_ops.concat(g, 1), False)


class Factors(collections.namedtuple("Factors", "a g transpose_b")):
    """A loop variable's per-example gradient that is one MatMul's terms
    summed over the iterations, sum_t a_t g_t^T (its transpose with
    transpose_b), as its factors: a [B, T, K], g [B, T, N] (T unknown while
    tracing where the loop's bound is). The caller applies the rule of a
    batched product A W to them (norms by the ghost norm, the clipped sum
    by one product), so the per-example gradients need never be built."""


def _columns(rows, at, width):
    """[B, T, width] of the stacked lists ``rows`` at ``at``: (list, first
    column); one tensor for each (an LSTM's gate gradient, read by its
    kernel's and recurrent kernel's Factors: the rule's memo shares what
    it computes of it)."""
    key = (at, width)
    got = rows["columns"].get(key)
    if got is None:
        i, first = at
        got = rows["columns"][key] = rows[i][:, :, first:first + width]
    return got


def _constant_bound(bound):
    """The loop's bound on its iterations where known while tracing (a
    constant, or the Max of one: a Keras RNN's), else None."""
    value = tensor_util.constant_value(bound)
    if value is None and bound.op.type == "Max":
        value = tensor_util.constant_value(bound.op.inputs[0])
        value = None if value is None or value.size == 0 else value.max()
    return int(value) if value is not None and value >= 0 else None


def _width(op):
    """The columns a meeting op hands over each iteration: a and g for a
    MatMul, g for a BiasAdd or Add."""
    out = op.outputs[0].shape.num_elements() // int(op.outputs[0].shape[0])
    return out + (int(op.inputs[0].shape[1]) if op.type == "MatMul" else 0)


def _fixed_row(read, slots, layout, handed, mine, batch):
    """_collect's list at fixed columns (_fix_layout): the meets ``mine``
    of this read hand over their a and g, zeros in the others' columns."""
    graph = ops.get_default_graph()
    counter, total = graph.inputs[0], graph.inputs[layout["size"]]
    dtype = read.outputs[0].dtype
    pieces = []
    for op, w in slots:
        if op in mine and op in handed:
            a, g = handed[op]
            if a is not None:
                pieces.append(array_ops.reshape(a, [batch, -1]))
            pieces.append(array_ops.reshape(g, [batch, -1]))
        else:
            pieces.append(array_ops.zeros([batch, w], dtype))
    row = pieces[0] if len(pieces) == 1 else array_ops.concat(pieces, 1)
    return list_ops.tensor_list_set_item(
        list_ops.tensor_list_reserve(row.shape, total, dtype), counter, row)


def _hand_over(op, handed):
    """A meeting op's gradient: TF's for its batch input; for the weight,
    zeros to TF's pass (it checks each gradient's shape against its
    input's), and what its per-example term needs to ``handed``: its a
    (a MatMul's) and g."""
    original = ops.get_gradient_function(op)

    def grad(_, g):
        first = original(op, g)[0]
        handed[op] = (op.inputs[0] if op.type == "MatMul" else None, g)
        w = op.inputs[1]
        return [first, array_ops.zeros(w.shape, w.dtype)]
    return grad


def _collect(i, slots, layout, handed, batch, mine=None):
    """The gradient of variable i's read, which TF's loop carries for the
    resource (TF checks no resource gradient's shape): this iteration's
    columns in a list with only the counter's element set (adding lists
    takes each element from the one that holds it): the tensors its meets
    handed over that no other variable's list holds (where each went in
    layout, by meet op: (list, column) of a and of g; None where no
    gradient reached the meet), the list left unset where there are none.
    ``mine``: the meets of this read, at the list's columns fixed in
    advance (_fix_layout: the body reads the variable more than once, each
    read's share added by TF's pass, or under XLA)."""

    def grad(read, _):
        if mine is not None:
            return _fixed_row(read, slots, layout, handed, mine, batch)
        placed = layout["placed"]       # id(tensor) -> (tensor, (list, column))
        graph = ops.get_default_graph()
        counter, total = graph.inputs[0], graph.inputs[layout["size"]]
        dtype = read.outputs[0].dtype
        pieces, width = [], 0

        def place(t, w):
            nonlocal width
            hit = placed.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            at = (i, width)
            placed[id(t)] = (t, at)
            pieces.append(array_ops.reshape(t, [batch, w]))
            width += w
            return at

        for op, w in slots:
            if op not in handed:
                layout[op] = None
                continue
            a, g = handed[op]
            k = int(a.shape[1]) if a is not None else 0
            layout[op] = (None if a is None else place(a, k), place(g, w - k))
        layout["width"][i] = width
        empty = list_ops.tensor_list_reserve(None, total, dtype)
        if not pieces:
            return empty
        row = pieces[0] if len(pieces) == 1 else array_ops.concat(pieces, 1)
        return list_ops.tensor_list_set_item(empty, counter, row)
    return grad
