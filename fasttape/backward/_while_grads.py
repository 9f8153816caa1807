"""Per-example gradients of the loop invariants of a traced While (a Keras 3
RNN's kernel, recurrent kernel and bias, captured by its one While op):
TF's own gradient of the loop (while_v2's _WhileGrad: a backward While
over the body's gradient), built with the invariants' gradients carried as
[B] + shape accumulators, not their shape. Inside the body each op that
meets the weight and the batch (``plan``: a MatMul, a BiasAdd, a broadcast
Add of a bias) gives each example's term (a_t[b]^T g_t[b], g_t[b], ...)
in place of their sum over the batch, and the weight's own ops between its
read and those (a Split, Squeeze or Unpack of GRU's two biases) carry the
batch axis in front; the loop sums the terms over iterations, as it sums
the gradient. The analysis (_per_example) proves the plan: the body keeps
every example's rows its own, and reads the weight only through these.
"""

from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_util
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import array_ops_stack
from tensorflow.python.ops import math_ops
from tensorflow.python.ops import special_math_ops
from tensorflow.python.ops import while_v2

# ops on a weight's values alone (no batch), by how a per-example gradient
# goes back through them: their batch axis in front
WEIGHT_OPS = frozenset({"ReadVariableOp", "Identity", "Squeeze", "Reshape",
                        "ExpandDims", "Split", "SplitV", "Unpack"})
# ops meeting a weight (at input 1) and the batch (input 0, axis 0)
MEETS = frozenset({"MatMul", "BiasAdd", "Add", "AddV2"})


def _zeros(t, batch):
    return array_ops.zeros([batch] + t.shape.as_list(), t.dtype)


def _term(stash, t, batch):
    """The per-example gradient of a weight's value t: the sum of the
    terms its readers stashed (zeros where none did)."""
    terms = stash.get(t._id)  # pylint: disable=protected-access
    if not terms:
        return _zeros(t, batch)
    return terms[0] if len(terms) == 1 else math_ops.add_n(terms)


def _weight_op_grad(op, batch, stash):
    """The gradient of a weight-side op: the per-example terms of its
    outputs taken back to its input ([B] in front), stashed for the op
    before it; to TF's pass, zeros of the input's shape (TF checks each
    gradient's shape against its input's). The variable's read gives the
    terms to the resource, whose gradient TF does not check: the loop
    accumulates it."""
    kind = op.type

    def grad(_, *unused):
        pieces = [_term(stash, o, batch) for o in op.outputs]
        if kind in ("ReadVariableOp", "Identity"):
            term = pieces[0]
        elif kind in ("Squeeze", "Reshape", "ExpandDims"):
            term = array_ops.reshape(pieces[0], [batch] + op.inputs[0].shape.as_list())
        elif kind == "Unpack":
            term = array_ops_stack.stack(pieces, axis=int(op.get_attr("axis")) % (
                op.inputs[0].shape.rank) + 1)
        else:       # Split, SplitV
            rank = op.inputs[0 if kind == "SplitV" else 1].shape.rank
            axis = int(tensor_util.constant_value(
                op.inputs[2 if kind == "SplitV" else 0])) % rank
            term = array_ops.concat(pieces, axis + 1)
        if kind == "ReadVariableOp":
            return term
        value = op.inputs[1 if kind == "Split" else 0]
        stash.setdefault(value._id, []).append(term)  # pylint: disable=protected-access
        out = [None] * len(op.inputs)
        out[1 if kind == "Split" else 0] = array_ops.zeros_like(value)
        return out
    return grad


def _meet_grad(op, batch, original, stash):
    """The gradient of a MatMul, BiasAdd or Add meeting the batch (input 0)
    and a weight (input 1): TF's for input 0; each example's term for the
    weight, stashed (zeros to TF's pass)."""
    kind = op.type

    def grad(_, g):
        first = original(op, g)[0]
        if kind == "MatMul":
            eq = "bi,bo->boi" if op.get_attr("transpose_b") else "bi,bo->bio"
            term = special_math_ops.einsum(eq, op.inputs[0], g)
        else:
            axes = list(range(1, g.shape.rank - op.inputs[1].shape.rank))
            term = math_ops.reduce_sum(g, axes) if axes else g
        w = op.inputs[1]
        stash.setdefault(w._id, []).append(term)  # pylint: disable=protected-access
        return [first, array_ops.zeros_like(w)]
    return grad


def per_example(while_op, grads, plans, batch):
    """{i: [B] + shape} per-example gradients of the While's resource
    inputs i of ``plans`` (i -> (the variable's shape, dtype, {id(op):
    "weight" or "meet"} of the body ops to override)), from ``grads`` of
    its outputs (the pass of the losses to them)."""
    body = while_op._body_graph  # pylint: disable=protected-access
    by_id = {id(op): op for op in body.get_operations()}
    overrides, stash = {}, {}
    for _, _, kinds in plans.values():
        for key, kind in kinds.items():
            op = by_id[key]
            if kind == "weight":
                overrides[op] = _weight_op_grad(op, batch, stash)
            else:
                overrides[op] = _meet_grad(op, batch, ops.get_gradient_function(op),
                                           stash)
    # A loop variable none of the losses reads gets zeros, as TF's pass
    # gives it (with None, _WhileGrad leaves it out of the backward loop,
    # and so the gradient its later steps carry back through it: a
    # recurrent state). (A While differentiated before holds more outputs:
    # none of theirs.)
    grads = [array_ops.zeros_like(o) if g is None and o.dtype.is_floating else g
             for g, o in zip(grads, while_op.outputs)]
    grads += [None] * (len(while_op.outputs) - len(grads))
    for i, (shape, dtype, _) in plans.items():
        grads[i] = array_ops.zeros([batch] + list(shape), dtype)
    saved = {op: op._gradient_function for op in overrides}  # pylint: disable=protected-access
    try:
        for op, fn in overrides.items():
            op._gradient_function = fn  # pylint: disable=protected-access
        out = while_v2._WhileGrad(while_op, *grads)  # pylint: disable=protected-access
    finally:
        for op, fn in saved.items():
            op._gradient_function = fn  # pylint: disable=protected-access
    return {i: out[i] for i in plans}
