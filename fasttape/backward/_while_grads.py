"""Per-example gradients of the loop invariants of a traced While (a Keras 3
RNN's kernel, recurrent kernel and bias, captured by its one While op),
from TF's own gradient of the loop (while_v2's _WhileGrad: a backward
While over the body's gradient). Inside the body each op that meets the
weight and the batch (``plan``: a MatMul, a BiasAdd, a broadcast Add of a
bias) hands over what each example's term needs (a_t and g_t; g_t), in
place of their sum over the batch, through the loop variable TF carries
the variable's gradient in:

- a TensorList, one element per iteration (set at the backward loop's
  counter), stacked after the loop: a MatMul's terms are then one batched
  product over the iterations, [B, in, T] x [B, T, out]; a tensor the
  meets of several variables read (an LSTM's gate gradient) goes to one
  of their lists only; a variable one MatMul alone reads is handed back
  as its factors (Factors), the caller's rule of a batched product then
  taking its norms by the ghost norm and its clipped sum by one product;
- under XLA (whose lists are dense buffers, so that adding one to another
  costs the whole list), a [B] + shape accumulator, each iteration's terms
  added to it.

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
                        "ExpandDims", "Split", "SplitV", "Unpack"})
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
    if kind == "Unpack":
        return array_ops_stack.stack(pieces, axis=int(op.get_attr("axis")) % (
            op.inputs[0].shape.rank) + 1)
    rank = op.inputs[0 if kind == "SplitV" else 1].shape.rank
    axis = int(tensor_util.constant_value(op.inputs[2 if kind == "SplitV" else 0])) % rank
    return array_ops.concat(pieces, axis + 1)


def _term(op, a, g):
    """A meeting op's per-example term for its weight, [B] + the weight's
    shape, from its input a and output gradient g; [B, T, ...] of each
    (stacked iterations) give the sum over them."""
    if op.type == "MatMul":
        eq = "bi,bo->boi" if op.get_attr("transpose_b") else "bi,bo->bio"
        if g.shape.rank == 3:
            eq = eq.replace("i,", "ti,").replace("o-", "to-")
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
    """{i: [B] + shape per-example gradients, or their Factors} of the
    While's resource inputs i of ``plans`` (i -> (the variable's shape, dtype, {id(op):
    "weight" or "meet"} of the body ops it flows through)), from ``grads``
    of its outputs (the pass of the losses to them)."""
    body = while_op._body_graph  # pylint: disable=protected-access
    by_id = {id(op): op for op in body.get_operations()}
    stacked = not control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())
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
    # (stacked) the loop's one set of what the meets handed over, and where
    # each tensor of it went: the meets of a loop's variables read the same
    # tensors (an LSTM's gate gradient, for its kernel, recurrent kernel and
    # bias), each written to one list only
    handed, layout = {}, {"placed": {}, "width": {}}
    for i, (shape, dtype, kinds) in plans.items():
        meets = [by_id[key] for key, kind in kinds.items() if kind == "meet"]
        meets.sort(key=lambda o: o._id)  # pylint: disable=protected-access
        if stacked:
            slots[i] = [(op, _width(op)) for op in meets]
            grads[i] = list_ops.tensor_list_reserve(
                None, while_op.outputs[0], dtype)
        else:
            grads[i] = array_ops.zeros([batch] + list(shape), dtype)
            handed = {}    # meet op -> its term this iteration
        reads = [by_id[key] for key, kind in kinds.items()
                 if kind == "weight" and by_id[key].type == "ReadVariableOp"]
        for op in meets:
            overrides[op] = _hand_over(op, handed, batch, stacked)
        for op in reads:
            overrides[op] = _collect(
                None if not stacked else (i, slots[i], layout),
                kinds, by_id, handed, batch)
    with _recording.gradient_functions_of(overrides):
        out = while_v2._WhileGrad(while_op, *grads)  # pylint: disable=protected-access
    if not stacked:
        return {i: out[i] for i in plans}
    # the iterations' rows, batch-major: [B, T, width] (T known while
    # tracing where the loop's bound is: the list padded to it with zero
    # rows, which add nothing to any term)
    bound = tensor_util.constant_value(while_op.inputs[1])
    bound = int(bound) if bound is not None and bound >= 0 else None
    rows = {}
    for i, width in layout["width"].items():
        if not width:
            continue
        handle = out[i]
        if bound is not None:
            handle = list_ops.tensor_list_resize(handle, bound)
        rows[i] = array_ops.transpose(list_ops.tensor_list_stack(
            handle, plans[i][1], element_shape=[batch, width],
            num_elements=-1 if bound is None else bound), [1, 0, 2])
    result = {}
    for i, (shape, dtype, kinds) in plans.items():
        terms, factors = {}, None
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
                factors = Factors(a, g, op.get_attr("transpose_b"))
                term = _term(op, a, g)
            else:
                term = _term(op, None, array_ops.reshape(
                    g, [batch, -1] + op.outputs[0].shape.as_list()[1:]))
            terms.setdefault(op.inputs[1]._id, []).append(term)  # pylint: disable=protected-access
        if (len(slots[i]) == 1 and factors is not None
                and [o.type for o in _weight_ops(kinds, by_id)] == ["ReadVariableOp"]):
            # the variable's gradient is this one product's, sum_t a_t g_t^T
            result[i] = factors
            continue
        result[i] = next(iter(_back_to_variable(kinds, terms, by_id, batch).values()))
    return result


class Factors(collections.namedtuple("Factors", "a g transpose_b")):
    """A loop variable's per-example gradient that is one MatMul's terms
    summed over the iterations, sum_t a_t g_t^T (its transpose with
    transpose_b), as its factors: a [B, T, K], g [B, T, N] (T unknown while
    tracing where the loop's bound is). The caller applies the rule of a
    batched product A W to them (norms by the ghost norm, the clipped sum
    by one product), so the per-example gradients need never be built."""


def _columns(rows, at, width):
    """[B, T, width] of the stacked lists ``rows`` at ``at``: (list, first
    column)."""
    i, first = at
    return rows[i][:, :, first:first + width]


def _width(op):
    """The columns a meeting op hands over each iteration: a and g for a
    MatMul, g for a BiasAdd or Add."""
    out = op.outputs[0].shape.num_elements() // int(op.outputs[0].shape[0])
    return out + (int(op.inputs[0].shape[1]) if op.type == "MatMul" else 0)


def _hand_over(op, handed, batch, stacked):
    """A meeting op's gradient: TF's for its batch input; for the weight,
    zeros to TF's pass (it checks each gradient's shape against its
    input's), and what its per-example term needs to ``handed``: [B, width]
    columns (stacked), or the term."""
    original = ops.get_gradient_function(op)

    def grad(_, g):
        first = original(op, g)[0]
        if stacked:
            handed[op] = (op.inputs[0] if op.type == "MatMul" else None, g)
        else:
            handed[op] = _term(op, op.inputs[0], g)
        w = op.inputs[1]
        return [first, array_ops.zeros(w.shape, w.dtype)]
    return grad


def _collect(stacked, kinds, by_id, handed, batch):
    """The variable read's gradient, which TF's loop carries for the
    resource (TF checks no resource gradient's shape): the per-example
    gradient; or (``stacked``: the variable's plan index i, its slots and
    the loop's layout) this iteration's columns in a list with only the
    counter's element set (adding lists takes each element from the one that
    holds it): the tensors its meets handed over that no other variable's
    list holds (where each went in layout, by meet op: (list, column) of a
    and of g; None where no gradient reached the meet), the list left
    unset where there are none."""

    def grad(read, _):
        if stacked is None:
            terms = {}
            for op, term in handed.items():
                terms.setdefault(op.inputs[1]._id, []).append(term)  # pylint: disable=protected-access
            return _back_to_variable(kinds, terms, by_id, batch)[read]
        i, slots, layout = stacked
        placed = layout["placed"]       # id(tensor) -> (tensor, (list, column))
        graph = ops.get_default_graph()
        counter, total = graph.inputs[0], graph.inputs[2]
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
