"""GradientTape.per_example_gradients, per_example_norms and dp_gradient
(DP-SGD with TF Privacy's semantics), over one recorded forward pass.

``losses`` [B] holds one loss per example, each depending only on its own
example. Then the ordinary backward pass of ``sum(losses)`` hands every op
its output gradient with example i's cotangent at index i of the batch
axis. For a source used by exactly one op that has a rule in
gradients._norm_rules (MatMul, BatchMatMul, Einsum, 2-D, 3-D, depthwise,
dilated and transposed convolutions, a batch norm in inference, a bias or
scale broadcast over the batch, Gather on a table), the rule reads that output
gradient and the op's saved inputs and gives each example's squared norm,
its gradient, or the clipped sum (book-keeping: no second backward pass).
The output gradients come from one ordinary backward pass of ``losses`` to
the ruled ops' outputs (so a training loop's pass is compiled and replayed
like gradient()'s, and no ruled op's own gradient is computed). A source
read by several ruled ops (a recurrent weight, once a time step), or through
a chain of elementwise ops on values of its own shape (a batch norm's gamma
in inference), gets its per-example gradient from those ops' output
gradients, which the same pass goes to (_uses). Every other source
goes through per-example rows: one backward pass per example over the same
trace (the Jacobian's machinery).

Inside tf.function (a tape recorded while tracing) the same walk and the
same rules run on the traced ops: each recorded tf.Operation is read as an
eager op is (its attrs, inputs and outputs: _graph_entries), the backward
pass to the ruled ops' outputs calls the gradient functions with the real
ops, the rules and the post-pass build their ops into the function, and
the sources without a rule take rows by TF's pfor over one backward pass
(a while loop where pfor cannot vectorize an op): exact whatever the
model. Noise there is drawn from TF's stateless uniform bits
(_traced_normal), seeded by ``seed`` or, unseeded, by a seed drawn at each
call (_graph_noise). A batch unknown while tracing
(an input_signature with None) sends every source through rows.
"""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
import collections
import itertools
import os
import threading

import numpy as np
from tensorflow.python.eager import context
from tensorflow.python.framework import constant_op
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import errors
from tensorflow.python.framework import function_def_to_graph
from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import ops
from tensorflow.python.framework import random_seed
from tensorflow.python.framework import tensor_shape
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import array_ops_stack
from tensorflow.python.ops import control_flow_assert
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import gen_random_ops
from tensorflow.python.ops import gen_stateless_random_ops_v2
from tensorflow.python.ops import linalg_ops_impl
from tensorflow.python.ops import math_ops
from tensorflow.python.ops import random_ops_util
from tensorflow.python.ops import stateless_random_ops
from tensorflow.python.ops.parallel_for import control_flow_ops as pfor_ops
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.platform import tf_logging as logging
from tensorflow.python.util import nest

from fasttape.backward import _gradient
from fasttape.backward import _jacobians
from fasttape.backward import _row_ops
from fasttape.backward import _while_grads
from fasttape.diagnostics import _frames
from fasttape.diagnostics import anomaly as _anomaly
from fasttape.gradients import _compiled
from fasttape.gradients import _norm_rules
from fasttape.gradients._fast_grads import _cached, _const, _ex
from fasttape.gradients._payloads import EagerOp
from fasttape.gradients._payloads import GraphOp
from fasttape.gradients._payloads import backward_signature
from fasttape.recording import _recording
from fasttape.recording._callback import output_meta
from fasttape.backward._row_ops import leading as _leading
from fasttape.backward._row_ops import meta_shape as _meta_shape
from fasttape.backward._row_ops import value as _value

_DT_RESOURCE = dtypes.resource.as_datatype_enum
# Ops that pass a source on unchanged (a variable's read; while tracing,
# TF's record of a tensor or handle captured by the function).
_TRANSPARENT = frozenset({"ReadVariableOp", "Identity", "captured_value"})
_RESHAPES = frozenset({"Reshape", "ExpandDims", "Squeeze"})
_BATCH_NORMS = frozenset({"FusedBatchNorm", "FusedBatchNormV2",
                          "FusedBatchNormV3"})
_SAME_SHAPE = _row_ops.SAME_SHAPE
# (ops whose shapes _carry_shape reads across)
_CARRIED_SHAPES = frozenset({"Transpose", "Unpack", "Pack"}) | _row_ops.BROADCASTING


class _Analysis:
    """Which sources have an op rule (ruled: k -> (payload, pos, rule,
    source shape)) and which go through rows (fallback: k -> op types)."""

    def __init__(self):
        self.ruled = {}
        self.fallback = {}
        self.op_types = {}
        self.out_ids = {}       # k -> the id of its ruled op's output
        self.out_shapes = {}    # k -> its shape, where the recording knows it
        self.key = None         # its structural key (_ANALYSES), if it has one
        self.folded = {}        # k -> the payload a _fold_rows copy was made of
        self.entries = None     # the path's entries (core.plan), if kept
        self.uses = {}          # k -> the tree of its uses (_uses)


def _start(tape, losses, sources, what):
    """Checks shared by the three methods; returns (tape state, batch size,
    flat sources, flat handles). The batch size is None for a batch unknown
    while tracing (every source then takes rows)."""
    if tape._tape is None:  # pylint: disable=protected-access
        raise RuntimeError(_gradient.CONSUMED)
    if tape._tape.budget is not None:  # pylint: disable=protected-access
        # The rules read saved tensors straight from the trace, where a
        # budget may have dropped them: a loud error, not a wrong norm.
        raise NotImplementedError(
            f"GradientTape.{what} does not support memory_budget yet: record "
            "these losses on a tape without a budget (and unset "
            "FASTTAPE_MEMORY_BUDGET if it sets one for every tape).")
    if tape._recording and not tape._persistent:  # pylint: disable=protected-access
        tape._pop_tape()  # pylint: disable=protected-access
    if losses is None or not hasattr(losses, "_id"):
        raise TypeError(f"GradientTape.{what}: `losses` must be a tensor of "
                        f"shape [batch], got {losses!r}")
    if losses.shape.rank != 1 or (losses.shape[0] is None
                                  and context.executing_eagerly()):
        raise ValueError(
            f"GradientTape.{what}: `losses` must have shape [batch] (one loss "
            f"per example, not reduced over the batch), got shape "
            f"{losses.shape}.")
    flat_raw = nest.flatten(sources)
    flat = [_gradient.handle_or_self(s) for s in flat_raw]
    _gradient.check_tensors(flat, "sources")
    repeated = _repeated(flat)
    if repeated and what != "per_example_gradients":
        # (the analysis keys each source by its handle: a second listing
        # would get None; and whether it counts once or twice in each
        # example's norm is the caller's to say)
        k = min(repeated)
        raise ValueError(
            f"GradientTape.{what}: source {k} ({_source_name(flat_raw[k])}) is "
            f"source {repeated[k]} listed again; list each source once (its "
            "gradient would count once or twice in each example's norm).")
    batch = losses.shape[0]
    return (tape._tape, None if batch is None else int(batch), flat_raw,  # pylint: disable=protected-access
            flat)


class _GraphEntry:
    """A recorded graph op as the analysis and the rules read a recorded
    eager op: its payload an EagerOp of the tf.Operation's attrs, inputs
    and outputs. (Backprop never sees it: the passes run on the tape's own
    entries, with the real op.)"""

    __slots__ = ("op_type", "input_ids", "output_ids", "output_meta",
                 "payload")

    def __init__(self, entry):
        self.op_type = entry.op_type
        self.input_ids = entry.input_ids
        self.output_ids = entry.output_ids
        payload = entry.payload
        if type(payload) is GraphOp:
            op = payload.op
            attrs = []
            for name in sorted(op.node_def.attr):
                attrs += [name, op.get_attr(name)]
            outputs = tuple(op.outputs)
            self.output_meta = tuple(
                (tuple(t.shape.as_list()), t.dtype) if t.shape.rank is not None
                else None for t in outputs)
            payload = EagerOp(tuple(attrs), tuple(op.inputs) + outputs,
                              len(op.inputs))
        else:
            self.output_meta = entry.output_meta
        self.payload = payload


def _repeated(flat):
    """{k: j}: source k is source j < k listed again (the same variable
    or tensor)."""
    first, repeated = {}, {}
    for k, source in enumerate(flat):
        j = first.setdefault(source._id, k)  # pylint: disable=protected-access
        if j != k:
            repeated[k] = j
    return repeated


def _graph_entries(entries):
    return [_GraphEntry(e) for e in _producers_first(entries)]


def _producers_first(entries):
    """``entries`` (op-id order) with each after the producers of its
    inputs, else in their order. While tracing, op-id order is not always
    that: TF records a "captured_value" op each time a function captures a
    tensor again, and the tape keeps the last record as the placeholder's
    producer, so the first op that read the capture came before it (the
    analysis, walking in order, then missed that read: a variable gathered
    twice took only its last Gather's per-example gradient)."""
    at = {}
    for n, entry in enumerate(entries):
        for o in entry.output_ids:
            at[o] = n
    if all(at.get(i, -1) < n for n, entry in enumerate(entries)
           for i in entry.input_ids):
        return entries
    done, order = set(), []
    for n in range(len(entries)):
        stack = [n]
        while stack:
            m = stack[-1]
            if m in done:
                stack.pop()
                continue
            todo = [at[i] for i in entries[m].input_ids
                    if i in at and at[i] not in done and at[i] != m]
            if todo:
                stack.extend(todo)
                continue
            done.add(m)
            order.append(entries[m])
            stack.pop()
    return order


def _pack(sources, flat_raw, out):
    """nest.pack_sequence_as(sources, out), without nest's walk for a flat
    list or tuple of sources (a model's trainable_variables)."""
    if type(sources) in (list, tuple) and len(sources) == len(flat_raw) and all(
            s is f for s, f in zip(sources, flat_raw)):
        return type(sources)(out)
    return nest.pack_sequence_as(sources, out)


def _end(tape, tape_state):
    """A non-persistent tape is used up, as by gradient()."""
    if not tape._persistent:  # pylint: disable=protected-access
        tape._watched_variables = tape_state.watched_variables()  # pylint: disable=protected-access
        tape_state.core.release()
        tape._tape = None  # pylint: disable=protected-access


def _where(entry):
    """Where ``entry``'s op was recorded, for an error: its line, if the
    forward pass ran under fasttape.detect_anomaly()."""
    record = _anomaly.record_of(entry.payload)
    if record is not None and record.stack:
        return "at " + str(_frames.Where(record.stack[0][:2]))
    return ("(record the forward pass under fasttape.detect_anomaly() to "
            "see its line)")


def _mixing_error(what, entry, batch, verb="reduces over", axis=0):
    where = _where(entry)
    return ValueError(
        f"GradientTape.{what}: `losses` mixes examples: a {entry.op_type} op "
        f"{where} {verb} the batch axis (axis {axis}, of size {batch}) on "
        "the path from the sources to `losses`, so one example's loss "
        "depends on the others and has no per-example gradient. Compute one "
        "loss per example (reduce over the other axes only), and use layers "
        "without batch statistics (LayerNormalization, or BatchNormalization "
        "with training=False).")


# Ops that mix the examples along some axes of their inputs: op type ->
# (what it does there, finder). A finder takes (payload, ranks of the
# inputs) and returns {input index: its mixing axes (None: computed while
# tracing, so maybe the batch's)}. The op mixes the examples where the
# batch axis of such an input is among them.

_UNSAVED = object()


def _given(payload, i):
    """Input i's value (_config's), or _UNSAVED where the recording kept
    no such input."""
    inputs = payload.inputs
    if len(inputs) <= i or inputs[i] is None:
        return _UNSAVED
    return _value(inputs[i])


def _axes_at(i, data=0):
    """Axes given by input i (a reduction's, a cumsum's, a reverse's)."""
    def find(payload, ranks, io=None):
        value = _given(payload, i)
        if value is _UNSAVED:
            return {}
        return {data: None if value is None else list(nest.flatten(value))}
    return find


def _last_axis(payload, ranks, io=None):
    """A softmax's or top_k's: along the last axis."""
    return {0: [ranks[0] - 1] if ranks[0] else None}


def _moved_axes(i, moves):
    """Axes along which input i's values are not all kept in place:
    moves(value) -> the axes (a roll's by shifts, a tile's by
    multiples)."""
    def find(payload, ranks, io=None):
        value = _given(payload, i)
        if value is _UNSAVED:
            return {}
        return {0: None if value is None else moves(payload, value, ranks[0])}
    return find


def _rolled(payload, shifts, rank):
    axes = _given(payload, 2)
    if axes is None or axes is _UNSAVED:
        return None
    shifts, axes = nest.flatten(shifts), nest.flatten(axes)
    if len(shifts) == 1:
        shifts = shifts * len(axes)
    return [a for s, a in zip(shifts, axes) if s != 0]


def _masked(payload, dims, rank):
    """Reverse (TF's first, by a mask of axes)."""
    return [a for a, d in enumerate(nest.flatten(dims)) if d]


def _tiled(payload, ranks, io=None):
    """Tile: the axes of a multiple other than 1; multiples computed while
    tracing (UpSampling's repeat): the axes its output is not as long as
    its input along (each at least one: one multiple there)."""
    multiples = _given(payload, 1)
    if multiples is _UNSAVED:
        return {}
    if multiples is not None:
        return {0: [a for a, m in enumerate(nest.flatten(multiples)) if m != 1]}
    ins, out = io if io else (None, None)
    if not ins or not ins[0] or not out or len(ins[0]) != len(out):
        return {0: None}
    return {0: [a for a, (n, m) in enumerate(zip(ins[0], out))
                if n is None or n < 1 or n != m]}


def _gathered(payload, ranks, io=None):
    """GatherV2: along its axis (input 2), unless the indices pick each
    row in place."""
    axis = _given(payload, 2)
    if axis is _UNSAVED:
        return {}
    if axis is None:
        return {0: None}
    indices = _given(payload, 1)
    params = payload.inputs[0]
    if indices not in (None, _UNSAVED) and ranks[0] and params is not None:
        size = params.shape[int(axis) % ranks[0]] if params.shape.rank else None
        if size is not None and nest.flatten(indices) == list(range(size)):
            return {}
    return {0: [axis]}


def _gathered_nd(payload, ranks, io=None):
    """GatherNd: along the leading axes its indices' last axis indexes."""
    indices = payload.inputs[1] if len(payload.inputs) > 1 else None
    if indices is None:
        return {}
    depth = indices.shape[-1] if indices.shape.rank else None
    return {0: None if depth is None else list(range(depth))}


def _contracted(payload, ranks, io=None):
    """MatMul, BatchMatMul: the axes each operand is summed over."""
    first = (_norm_rules.attr(payload, "transpose_a")
             or _norm_rules.attr(payload, "adj_x"))
    second = (_norm_rules.attr(payload, "transpose_b")
              or _norm_rules.attr(payload, "adj_y"))
    if not ranks[0] or not ranks[1]:
        return {0: None, 1: None}
    return {0: [ranks[0] - 2 if first else ranks[0] - 1],
            1: [ranks[1] - 1 if second else ranks[1] - 2]}


def _einsum_contracted(payload, ranks, io=None):
    """Einsum: the axes whose labels are not in the output."""
    equation = _norm_rules.attr(payload, "equation")
    if isinstance(equation, bytes):
        equation = equation.decode()
    if not equation or "->" not in equation:
        return {i: None for i in range(len(ranks))}
    ins, out = equation.replace(" ", "").split("->")
    found = {}
    for i, (labels, rank) in enumerate(zip(ins.split(","), ranks)):
        if rank is None:
            found[i] = None
            continue
        head, _, tail = labels.partition("...")
        at = list(enumerate(head)) + [
            (rank - len(tail) + j, c) for j, c in enumerate(tail)]
        found[i] = [a for a, c in at if c not in out]
    return found


_REDUCERS = ("Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm")
_PRODUCTS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
_MIXERS = {}
for _op in _REDUCERS:
    _MIXERS[_op] = ("reduces over", _axes_at(1))
for _op in ("Cumsum", "Cumprod", "CumulativeLogsumexp"):
    _MIXERS[_op] = ("accumulates along", _axes_at(1))
for _op in ("Softmax", "LogSoftmax"):
    _MIXERS[_op] = ("normalises along", _last_axis)
for _op in _PRODUCTS:
    _MIXERS[_op] = ("sums products along", _contracted)
_MIXERS.update({
    "TopKV2": ("sorts along", _last_axis),
    "Einsum": ("sums products along", _einsum_contracted),
    "ReverseV2": ("reverses", _axes_at(1)),
    "Reverse": ("reverses", _moved_axes(1, _masked)),
    "Roll": ("rolls along", _moved_axes(1, _rolled)),
    "Tile": ("tiles", _tiled),
    "GatherV2": ("gathers along", _gathered),
    "GatherNd": ("gathers along", _gathered_nd),
})
del _op
# (their output's shape is not their input's: reductions, products, gathers)
_MIXERS_OF_SHAPE = frozenset(
    _REDUCERS + _PRODUCTS + ("Einsum", "Tile", "GatherV2", "GatherNd"))


def _output_shape(entry, shapes):
    """The first output's shape where known: worked out, or recorded."""
    out = shapes.get(entry.output_ids[0]) if entry.output_ids else None
    if out is None and entry.output_meta:
        out = _meta_shape(entry.output_meta[0])
    return out


def _input_shape(entry, i, shapes):
    """Input i's shape where known: saved, recorded, or (the data input
    of a softmax, sort, cumsum ... whose gradient keeps only its output)
    its output's rank and leading size."""
    t = _input_tensor(entry, i)
    if t is not None and t.dtype == dtypes.resource:
        return None
    shape = _saved_shape(entry, i, shapes)
    if shape is None and i == 0 and entry.op_type not in _MIXERS_OF_SHAPE:
        shape = _output_shape(entry, shapes)
    return shape


def _input_tensor(entry, i):
    inputs = getattr(entry.payload, "inputs", None) or ()
    return inputs[i] if i < len(inputs) else None


def _saved_shape(entry, i, shapes):
    """Input i's shape as the analysis knows it or the recording saved it;
    None where unknown or a resource."""
    t = _input_tensor(entry, i)
    if t is not None and t.dtype == dtypes.resource:
        return None
    shape = shapes.get(entry.input_ids[i])
    if shape is None and t is not None and t.shape.rank is not None:
        shape = tuple(t.shape.as_list())
    return shape


def _batch_axes_of(entry, i, shape, batch, axes, weights, carrying):
    """The axes of input i one of which may be its batch's (the op mixes
    the examples where it mixes along all of them): a weight's none; axis
    0 where its leading size may be the batch (unknown while tracing),
    and the axis _track_batch_axis followed the batch to, if another (it
    takes inputs off the path to lead with the batch: a time-major input
    as long as the batch fools it); none where the leading size is a
    multiple of the batch's (folded with another axis: whether an op
    mixes it, its size cannot tell); else, for a tensor that may hold
    examples' rows (``carrying``, None for all: its batch moved where the
    analysis lost it), the followed axis, or each axis of the batch's
    size."""
    tid = entry.input_ids[i]
    if (weights is not None and weights(tid)) or not shape:
        return set()
    tracked = axes.get(tid, -1) if axes else -1
    found = {tracked} if tracked >= 0 else set()
    if shape[0] in (batch, None):
        return found | {0}
    if batch and shape[0] % batch == 0:
        return found - {0}      # (its 0 there a guess from the size too)
    if found:
        return found
    if carrying is None or tid in carrying:
        # (None: a traced body's op, where no tensor's rows are known)
        return {a for a, n in enumerate(shape) if n in (batch, None)}
    return set()


def _pairs_examples(entry, shapes, batch, weights, carrying):
    """A MatMul of two tensors that may hold examples' rows (``carrying``)
    whose product is [B, B] (h @ tf.transpose(h)): each row pairs an
    example with every other."""
    if entry.op_type != "MatMul" or batch is None or not carrying:
        return False
    ids = entry.input_ids[:2]
    if len(ids) < 2 or any(weights(i) or i not in carrying for i in ids):
        return False
    return tuple(_output_shape(entry, shapes) or ()) == (batch, batch)


def _check_mixing(what, entry, shapes, batch, separable=(), axes=None,
                  weights=None, carrying=None):
    """Raise where ``entry`` mixes the examples: a training batch norm
    whose statistics may span several, an op of _MIXERS along an input's
    batch axis (``axes``: _track_batch_axis's, where it followed it; else
    axis 0 of an input that may lead with the batch, not a source's value
    that ``weights`` names), a [B, B] product of two computed tensors."""
    op_type = entry.op_type
    payload = entry.payload
    inputs = getattr(payload, "inputs", None)
    if inputs is None or (batch is not None and batch < 2):
        return
    # (while tracing, a leading axis unknown then may be the batch's)
    if op_type in _BATCH_NORMS:
        if _norm_rules.attr(payload, "is_training") and id(entry) not in separable:
            # statistics over every axis but the channels': they mix the
            # examples wherever the input may hold several (a batch
            # folded into another axis too), unless _row_groups proved
            # each channel within one example
            shape = shapes.get(entry.input_ids[0])
            if (shape is None and inputs[0] is not None
                    and inputs[0].shape.rank is not None):
                shape = tuple(inputs[0].shape.as_list())
            # a batch unknown while tracing: any folded batch may mix
            if (shape is None or None in shape or batch is None
                    or shape[0] == batch or int(np.prod(shape)) % batch == 0):
                raise _mixing_error(what, entry, batch)
        return
    if weights is not None and _pairs_examples(entry, shapes, batch, weights,
                                               carrying):
        raise _mixing_error(what, entry, batch, "pairs each example with "
                            "every other along")
    mixer = _MIXERS.get(op_type)
    if mixer is None:
        return
    verb, find = mixer
    held, ranks, in_shapes = {}, [], []
    for i in range(min(len(inputs), len(entry.input_ids))):
        shape = _input_shape(entry, i, shapes)
        in_shapes.append(shape)
        ranks.append(None if shape is None else len(shape))
        found = _batch_axes_of(entry, i, shape, batch, axes, weights, carrying)
        if found:
            held[i] = found
    if not held:
        return
    out = _output_shape(entry, shapes)
    for i, found in find(payload, ranks, (in_shapes, out)).items():
        if i not in held or (i and weights is None):
            # (a traced body's op: no source is known there, and a
            # product's second operand, a kernel as long as the batch,
            # would pass for rows)
            continue
        if found is None:   # computed while tracing: maybe the batch's
            raise _mixing_error(what, entry, batch, verb, min(held[i]))
        rank = ranks[i]
        if held[i] <= {int(a) % rank if rank else int(a) for a in found}:
            raise _mixing_error(what, entry, batch, verb, min(held[i]))


# The functions a traced call, loop or conditional runs (not a loop's
# condition: it hands no gradient on)
_BODIES = ("f", "body", "then_branch", "else_branch", "branches")


def _function_graph(where, graph, fname):
    """The graph of the function ``fname``: traced in ``where`` or
    ``graph``, or (an eager call of a tf.function, recorded under its
    function's name) the eager context's; None if there is none."""
    found = where._get_function(fname) or graph._get_function(fname)  # pylint: disable=protected-access
    body = getattr(found, "graph", None)
    if body is None and isinstance(fname, str):
        ctx = context.context()
        if ctx.has_function(fname):
            body = function_def_to_graph.function_def_to_graph(
                ctx.get_function_def(fname))
    return body


def _may_hold_rows(t, batch):
    """Whether a function's input may hold examples' rows: a TensorList
    (its elements a time step's), or a tensor with an axis that may be
    the batch's (of its size, a multiple of it, or unknown)."""
    if t.dtype == dtypes.variant:
        return True
    if t.dtype == dtypes.resource or not t.shape.rank:
        return t.dtype != dtypes.resource and t.shape.rank is None
    return any(n is None or (batch and n % batch == 0) or batch is None
               for n in t.shape.as_list())


def _check_bodies(what, entry, batch):
    """_check_mixing on the ops of the functions a traced op on the path
    runs (tf.cond's branches, a while loop's body, a nested tf.function),
    and theirs: a reduction over the batch there mixes the examples as on
    the path, where the analysis sees only the call (its rows would be
    the gradients of losses that depend on every example). Ops of
    floating outputs only (a batch's largest sequence length moves no
    gradient). And _row_ops.keeps_apart on each op there that reads a
    tensor that may hold examples' rows (_may_hold_rows for the
    functions' inputs, and what is computed from them), the batch taken
    to lead where no axis is followed."""
    if batch is not None and batch < 2:
        return
    graph = ops.get_default_graph()
    traced = isinstance(entry, _GraphEntry)
    if not traced and not context.context().has_function(entry.op_type):
        return
    # (a nested tf.function's call is recorded under its function's name)
    calls = [(graph, entry.op_type)]
    op = (_loop_op(entry.payload) if traced and type(entry.payload) is EagerOp
          else None)
    todo, seen = ([op] if op is not None else []), set()
    while calls or todo:
        if not calls:
            op = todo.pop()
            for name in _BODIES:
                try:
                    fns = op.get_attr(name)
                except (ValueError, AttributeError):
                    continue
                calls.extend((op.graph, getattr(fn, "name", None))
                             for fn in (fns if isinstance(fns, list) else [fns]))
            continue
        where, fname = calls.pop()
        if fname is None or fname in seen:
            continue
        seen.add(fname)
        body = _function_graph(where, graph, fname)
        if body is not None:
            todo.extend(_check_body(what, body, batch))


def _check_body(what, body, batch):
    """_check_bodies' walk over one function's ops: _check_mixing on
    those of floating outputs; on those that read a tensor that may hold
    examples' rows, _op_axis: the batch axis followed from its inputs
    (taken to lead there: a loop's carry, a branch's input), each op known
    to keep the examples apart where it lies, back on axis 0 at the
    function's outputs. Returns its ops (for the
    functions they run)."""
    carrying, axes = set(), {}
    for inner in body.get_operations():
        if inner.type == "Placeholder":
            if _may_hold_rows(inner.outputs[0], batch):
                carrying.add(inner.outputs[0]._id)  # pylint: disable=protected-access
            continue
        ids = [t._id for t in inner.inputs]  # pylint: disable=protected-access
        held = [axes.get(t, 0) if t in carrying else -1 for t in ids]
        if max(held, default=-1) < 0 and not (
                inner.outputs and inner.outputs[0].dtype.is_floating):
            continue
        body_entry = _BodyEntry(inner)
        if inner.outputs and inner.outputs[0].dtype.is_floating:
            _check_mixing(what, body_entry, {}, batch)
        if max(held, default=-1) < 0:
            continue
        carrying.update(body_entry.output_ids)
        # (a call's functions checked in turn)
        out = 0 if inner.type in _CALLS else _op_axis(body_entry, {}, batch,
                                                       held, axes)
        if out is None:
            raise _apart_error(what, body_entry, batch)
        for o in body_entry.output_ids:
            axes[o] = out
    for t in body.outputs:
        if axes.get(t._id, 0) > 0:  # pylint: disable=protected-access
            raise _apart_error(what, _BodyEntry(t.op), batch)
    return body.get_operations()


def _op_axis(entry, shapes, batch, ins, axes=None, path=False):
    """The batch axis of ``entry``'s outputs, given its inputs' (``ins``:
    -1 where one holds none): where a _TRACKED op moves it (_moved_axis),
    else where _row_ops.batch_axis finds the op keeps the examples apart;
    None where it is lost. On the recorded ``path``, a _TRACKED op of a
    tensor without the batch (a weight's) makes one without it (-1), and
    an op other than those that leaves the batch where it lies (on axis
    0, or elementwise) is taken to: _not_apart asks _row_ops.keeps_apart
    of it there, with the tensors the analysis finds carry rows."""
    op = entry.op_type
    data = ins[1] if op == "Split" and len(ins) > 1 else (ins[0] if ins else -1)
    if op == "Pack" and len(set(ins)) > 1:
        return None
    if op in _TRACKED and data >= 0:
        out = _moved_axis(entry, shapes, data, batch)
        if out is not None:
            return out
    elif op in _TRACKED and path:
        return -1
    batched = {a for a in ins if a >= 0}
    if len(batched) != 1:
        return None
    axis = batched.pop()
    if path and op not in _TRACKED and (axis == 0 or op in _row_ops.ELEMENTWISE):
        return axis
    return _row_ops.batch_axis(entry, shapes, batch, ins, axes)


# Ops that run functions (_BODIES): where the batch axis is not followed
# through one (_loop_proof), its functions' ops are checked instead
_CALLS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case",
                    "StatelessCase", "PartitionedCall",
                    "StatefulPartitionedCall"})


def _runs_functions(entry):
    """Whether ``entry`` runs functions (checked by _check_bodies)."""
    if isinstance(entry, _GraphEntry) and entry.op_type in _CALLS:
        return True
    # (a tf.function's call is recorded under its function's name)
    name = entry.op_type
    return (ops.get_default_graph()._get_function(name) is not None  # pylint: disable=protected-access
            or context.context().has_function(name))


def _apart_error(what, entry, batch):
    return ValueError(
        f"GradientTape.{what}: `losses` may mix examples: a {entry.op_type} "
        f"op {_where(entry)} is not known to keep examples apart along the batch "
        f"axis (of size {batch}) on the path from "
        "the sources to `losses`, so one example's loss may depend on the "
        "others; per-example gradients are given only where every op on "
        "the path is known to keep the examples apart (see "
        "docs/privacy.md). Compute each example's loss from its own row, "
        "with ops along the other axes.")


def _no_rows_error(what, batch):
    return ValueError(
        f"GradientTape.{what}: `losses` holds no example's values: no input "
        f"it is computed from has an axis of its length ({batch}), the "
        "batch's, so its rows are not the examples' (one example may reach "
        "every loss). Compute one loss per example, from inputs that hold "
        "the batch on an axis (a dense tensor: a ragged one's .to_tensor()).")


def _not_apart(entry, shapes, batch, carrying, axes, kept, lost):
    """``entry`` where it reads a tensor that may hold examples' rows
    (``carrying``) and is not known to keep the examples apart: neither
    an op whose move of the batch axis was followed or whose layout was
    proved (``kept``), nor one _row_ops.keeps_apart knows, with the batch
    axes ``axes`` followed, nor one that runs functions (their ops are
    checked: _check_bodies, where the batch leads), else None. ``lost``:
    the entry at which the batch axis was lost (refused)."""
    if id(entry) in kept or (batch is not None and batch < 2):
        return None
    if not any(tid in carrying for tid in entry.input_ids):
        return None
    if entry is not lost and _runs_functions(entry):
        return None     # (where its inputs hold the batch on axis 0)
    if entry is not lost and _row_ops.keeps_apart(entry, shapes, batch,
                                                  carrying, axes):
        return None
    return entry



# Analyses by the structure of the path they walked (see _analyse): a
# training loop records the same program each step, and its analysis then
# costs a lookup. Values hold no tensor: entry positions, rules, shapes.
_ANALYSES = collections.OrderedDict()
_MAX_ANALYSES = 64


class _Layout:
    """An analysis with its ops as positions among the path's entries."""

    __slots__ = ("ruled", "fallback", "logs", "uses")

    def __init__(self, ruled, fallback, logs, uses=None):
        self.uses = uses or {}      # k -> _uses' tree, by positions: _uses_layout
        self.ruled = ruled          # k -> (j, pos, rule, src_shape, fold, op_type, out_shape)
        self.fallback = fallback    # k -> op types
        self.logs = logs            # its DEBUG lines


def _analyse(what, tape_state, losses, flat, flat_raw, batch, use_rules=True,
             keep_entries=False):
    """Walk the ops between the sources and `losses` once: refuse a losses
    that mixes examples, and find each source's rule or its fallback.

    A path equal in structure to one analysed before (the core's code for
    it, and its backward signature: op types, attrs, shapes, dtypes, and
    the values of the small config inputs the checks read, such as axes
    and permutations) takes that analysis, on this path's ops.
    ``keep_entries``: the path's entries are left in result.entries (they
    hold its tensors: the caller drops them when done).

    While tracing: the traced ops (_graph_entries), analysed each time (a
    trace runs once); with the batch unknown, every source takes rows."""
    core = tape_state.core
    source_ids = [t._id for t in flat]  # pylint: disable=protected-access
    code, entries = core.plan([losses._id], source_ids)  # pylint: disable=protected-access
    key = None
    if not context.executing_eagerly():
        logs = []
        if batch is None and use_rules:
            use_rules = False
            logs.append(f"fasttape {what}: the batch size is unknown while "
                        "tracing: every source takes per-example rows")
            logging.debug(logs[-1])
        result = _analyse_path(what, _graph_entries(entries), flat, flat_raw,
                               batch, use_rules, logs, losses)
        return result
    signed = backward_signature(entries, _compiled.CONFIG_INPUTS,
                                _compiled.config_inputs_of)
    if signed is not None:
        key = (what, code, signed[0], batch, use_rules, tuple(
            (tuple(s.shape.as_list()), s.dtype) for s in flat_raw))
        try:
            layout = _ANALYSES.get(key)
        except TypeError:       # an attr value that cannot be a key
            layout, key = None, None
        if layout is not None:
            _ANALYSES.move_to_end(key)
            for line in layout.logs:
                logging.debug(line)
            result = _rebind(layout, entries, key)
            if keep_entries:
                result.entries = entries
            return result
    logs = []
    result = _analyse_path(what, entries, flat, flat_raw, batch, use_rules,
                           logs, losses)
    if keep_entries:
        result.entries = entries
    if key is not None:
        layout = _layout(result, entries, logs)
        if layout is not None:
            _ANALYSES[key] = layout
            if len(_ANALYSES) > _MAX_ANALYSES:
                _ANALYSES.popitem(last=False)
            result.key = key
    return result


def _layout(result, entries, logs):
    """result as a _Layout over ``entries``, or None if a ruled payload
    is not one of theirs (nor a _fold_rows copy of one)."""
    at = {id(e.payload): j for j, e in enumerate(entries)}
    ruled = {}
    for k, (payload, pos, rule, src_shape) in result.ruled.items():
        j, fold = at.get(id(payload)), None
        if j is None:
            j = at.get(id(result.folded.get(k)))
            if j is None:
                return None
            fold = tuple(payload.attrs[len(entries[j].payload.attrs):])
        ruled[k] = (j, pos, rule, src_shape, fold, result.op_types[k],
                    result.out_shapes[k])
    uses = {k: _uses_layout(node, at) for k, node in result.uses.items()}
    uses = {k: node for k, node in uses.items() if node is not None}
    return _Layout(ruled, {k: tuple(v) for k, v in result.fallback.items()},
                   tuple(logs), uses)


def _rebind(layout, entries, key):
    """The analysis ``layout`` notes, on this path's ``entries``."""
    result = _Analysis()
    for k, (j, pos, rule, src_shape, fold, op_type, out_shape) in layout.ruled.items():
        entry = entries[j]
        payload = entry.payload
        if fold is not None:
            payload = EagerOp(tuple(payload.attrs) + fold,
                              tuple(payload.inputs), payload.num_inputs)
        result.ruled[k] = (payload, pos, rule, src_shape)
        result.op_types[k] = op_type
        result.out_ids[k] = entry.output_ids[0]
        result.out_shapes[k] = out_shape
    result.fallback = {k: list(v) for k, v in layout.fallback.items()}
    result.uses = {k: _uses_rebound(node, entries)
                   for k, node in layout.uses.items()}
    result.key = key
    return result


def _analyse_path(what, entries, flat, flat_raw, batch, use_rules, logs,
                  losses):
    """_analyse's walk over the path's entries (DEBUG lines into logs)."""
    losses_id = losses._id  # pylint: disable=protected-access
    source_ids = [t._id for t in flat]  # pylint: disable=protected-access
    alias = {}
    for k, sid in enumerate(source_ids):
        alias.setdefault(sid, k)
    uses = {k: [] for k in range(len(flat))}
    # Shapes of the tensors on the path: the recorder keeps no output
    # metadata, but a consumer that saved the tensor for its gradient knows
    # it (and `losses` its own: a last reshape's output, which none saves).
    shapes = {}
    if losses.shape.rank is not None:
        shapes[losses_id] = tuple(losses.shape.as_list())
    for entry in entries:
        inputs = getattr(entry.payload, "inputs", None)
        # (and the outputs it saved: a Tanh's, a Softmax's)
        outputs = getattr(entry.payload, "outputs", None) if inputs else None
        for tid, t in itertools.chain(
                zip(entry.input_ids if inputs else (), inputs or ()),
                zip(entry.output_ids if outputs else (), outputs or ())):
            if tid in shapes or t is None:
                continue
            if type(t) is ops.EagerTensor:
                if t._datatype_enum() != _DT_RESOURCE:  # pylint: disable=protected-access
                    shapes[tid] = t._shape_tuple()  # pylint: disable=protected-access
            elif t.dtype != dtypes.resource and t.shape.rank is not None:
                shapes[tid] = tuple(t.shape.as_list())
    # ... and across the ops that keep their input's shape (a BiasAdd after
    # a Dense's MatMul and Reshape saves neither)
    for chain in (reversed(entries), entries):
        for entry in chain:
            if (entry.op_type in _SAME_SHAPE and entry.input_ids
                    and len(entry.output_ids) == 1):
                i, o = entry.input_ids[0], entry.output_ids[0]
                if i in shapes and o not in shapes:
                    shapes[o] = shapes[i]
                elif o in shapes and i not in shapes:
                    shapes[i] = shapes[o]
            elif entry.op_type in _CARRIED_SHAPES and entry.output_ids:
                _carry_shape(entry, shapes)
            elif entry.op_type == "SpaceToBatchND":
                _carry_blocks_shape(entry, shapes)
    consumers = {}
    for entry in entries:
        for tid in entry.input_ids:
            consumers.setdefault(tid, []).append(entry)
    groups = _row_groups(entries, shapes, consumers, batch)
    produced = frozenset(o for entry in entries for o in entry.output_ids)
    time_major = _row_ops.inputs_time_major(
        [_saved_shape(entry, i, shapes)
         for entry in entries for i, tid in enumerate(entry.input_ids)
         if tid not in produced]
        + [tuple(s.shape.as_list()) for s, t in zip(flat_raw, flat)
           if t.dtype != dtypes.resource and s.shape.rank], batch)
    # (the axes it followed before it lost the batch, if it did: where
    # _check_mixing looks for it)
    seen, trail = {}, {}
    followed, axes, loops = _track_batch_axis(entries, shapes, batch, alias,
                                              consumers, seen, trail,
                                              time_major)
    kept = trail["followed"] | trail["apart"] | groups.accepted | groups.apart
    refused = None      # (the first op not known to keep examples apart)
    movers = []
    # tensors that may hold examples' rows (_row_ops): a tensor source that
    # leads with the batch (a variable is a parameter, whatever its shape),
    # and what is computed from such tensors
    batched = {k for k, (s, t) in enumerate(zip(flat_raw, flat))
               if t.dtype != dtypes.resource and s.shape.rank
               and s.shape[0] == batch}
    carrying = {sid for sid, k in alias.items() if k in batched}
    weak = set()

    def weights(tid):
        """A source's value that holds no example (a variable's)."""
        return tid in alias and alias[tid] not in batched

    def may_rule(entry, pos):
        rule = _norm_rules.candidate(entry.op_type, entry.payload)
        if rule is None:
            return False
        out = _output_shape(entry, shapes)
        src = shapes.get(entry.input_ids[pos])
        if out is None or src is None:
            return True
        return _norm_rules.applies(rule, entry.payload, pos, out, src, batch)
    for entry in entries:
        ins = entry.input_ids
        if ins and ins[0] in alias and (
                (entry.op_type in _TRANSPARENT and len(ins) == 1)
                or (entry.op_type in _RESHAPES and not any(
                    i in alias for i in ins[1:]))):
            # A read, or a reshape (Keras reshapes LayerNormalization's
            # gamma and MultiHeadAttention's kernels): the rule sees the
            # reshaped value; its results are reshaped back to the source.
            for o in entry.output_ids:
                alias[o] = alias[ins[0]]
                if alias[o] in batched:
                    carrying.add(o)
                if entry.op_type in _TRANSPARENT and o not in shapes:
                    # (a read: the source's shape, for a chain of its uses)
                    shapes[o] = tuple(flat_raw[alias[o]].shape.as_list())
            continue
        for pos, tid in enumerate(ins):
            k = alias.get(tid)
            if k is not None:
                uses[k].append((entry, pos))
        _check_mixing(what, entry, shapes, batch, groups.separable, seen,
                      weights, carrying)
        _check_bodies(what, entry, batch)
        if refused is None:
            refused = _not_apart(entry, shapes, batch, carrying, seen, kept,
                                 trail.get("lost"))
        if (use_rules and id(entry) not in groups.accepted
                and id(entry) not in followed
                and not _row_ops.keeps_axis0(entry, shapes, batch, carrying)):
            movers.append(entry)
            logs.append(f"fasttape {what}: a {entry.op_type} op is not known "
                        "to keep each example's row on the batch axis: the "
                        "sources read before it take per-example rows")
            logging.debug(logs[-1])
        rows, vector = _row_ops.carries_rows(entry, carrying, weak, produced,
                                             alias, shapes, batch, may_rule,
                                             time_major)
        if rows or vector:
            (carrying if rows else weak).update(entry.output_ids)
        for o, meta in zip(entry.output_ids, entry.output_meta):
            shape = _meta_shape(meta)
            if shape is not None:
                shapes[o] = shape
    if refused is not None:
        # (after the walk: an op that mixes the examples says what it does)
        raise _apart_error(what, refused, batch)
    if (batch is not None and batch > 1 and losses_id in produced
            and losses_id not in carrying and losses_id not in weak):
        raise _no_rows_error(what, batch)
    before = _before(movers, entries)
    result = _Analysis()
    for k, used in uses.items():
        if not used:
            continue    # not connected: None, as gradient()
        src_shape = tuple(flat_raw[k].shape.as_list())
        rule = None
        ruled = use_rules and not any(id(e) in before for e, _ in used)
        if ruled and len(used) == 1 and None not in src_shape:
            entry, pos = used[0]
            rule = _norm_rules.candidate(entry.op_type, entry.payload)
            if entry.output_ids[0] not in carrying:
                rule = None     # its rows are no examples' (pos @ W, T == B)
            if rule is not None and (axes is not None and any(
                    axes.get(t, 0) > 0 for t in entry.input_ids + entry.output_ids[:1])
                    or _chains(entry, pos, shapes) is not None):
                rule = None     # its batch not on axis 0 (time-major), or a chain
        if rule is not None and entry.op_type == "MatMul":
            payload = _fold_rows(entry, shapes, consumers, batch)
            if payload is None:
                rule = None
            elif payload is not entry.payload:
                result.folded[k] = entry.payload
        else:
            payload = entry.payload if rule is not None else None
        if rule is not None and id(entry) in groups.blocks:
            payload = EagerOp(tuple(payload.attrs) + (
                _norm_rules.BLOCKS_ATTR, groups.blocks[id(entry)]),
                tuple(payload.inputs), payload.num_inputs)
            result.folded[k] = entry.payload
        if rule is not None:
            result.ruled[k] = (payload, pos, rule, src_shape)
            result.op_types[k] = entry.op_type
            result.out_ids[k] = entry.output_ids[0]
            result.out_shapes[k] = shapes.get(entry.output_ids[0])
        else:
            result.fallback[k] = sorted({e.op_type for e, _ in used})
            if ruled and None not in src_shape:
                uses = _uses(used, axes, batch, shapes, consumers, loops=loops,
                             rows=carrying)
                if uses and (len(used) > 1 or uses[0][0] != "rule"):
                    result.uses[k] = uses
    return result


def _before(movers, entries):
    """Ids of the entries from which one of ``movers`` (ops that may move
    rows across the batch axis) is reached, the movers with them. A rule
    reads row j of its op's output gradient as example j's: that holds
    while every op after it keeps the rows (row j reaches loss j only),
    whatever the ops before it did to its saved inputs (its per-example
    gradient is row j's term, what row j holds). So a mover sends the
    sources read before it to rows, not the ones read after it (a Dense
    head after a traced RNN's loop and its time-major outputs)."""
    if not movers:
        return frozenset()
    producer = {}
    for entry in entries:
        for o in entry.output_ids:
            producer[o] = entry
    seen = {id(e) for e in movers}
    stack = list(movers)
    while stack:
        for tid in stack.pop().input_ids:
            entry = producer.get(tid)
            if entry is not None and id(entry) not in seen:
                seen.add(id(entry))
                stack.append(entry)
    return seen


def _fold_rows(entry, shapes, consumers, batch):
    """A MatMul's payload for its rule: itself where a's rows are the
    examples; where they are B*T rows (Keras' Dense on [B, T, d] reshapes
    to [B*T, d] and back), a copy noting T (_norm_rules.ROWS_ATTR), if the
    output's one consumer on the path is a Reshape to [B, ...] (row-major:
    rows i*T ... i*T+T-1 become example i); else None (rows)."""
    payload = entry.payload
    a = payload.inputs[0] if payload.inputs else None
    if a is None or a.shape.rank != 2 or a.shape[0] is None:
        return payload
    lead = int(a.shape[0])
    if lead == batch or lead % batch or _norm_rules.attr(payload, "transpose_a"):
        return payload
    users = consumers.get(entry.output_ids[0], ())
    if len(users) != 1 or users[0].op_type != "Reshape":
        return None
    out = shapes.get(users[0].output_ids[0])
    if not out or out[0] != batch:
        return None
    return EagerOp(tuple(payload.attrs) + (_norm_rules.ROWS_ATTR, lead // batch),
                   tuple(payload.inputs), payload.num_inputs)


def _source_name(source):
    """A variable's name and shape (unnamed Keras-less variables share
    their names), or a tensor's shape."""
    shape = tuple(source.shape.as_list())
    name = getattr(source, "name", None)
    if isinstance(name, str) and hasattr(source, "handle"):
        return f"{name} {shape}"
    return f"a tensor of shape {shape}"


def _note_fallback(what, tape, flat_raw, analysis):
    """Which sources went through per-example rows, and the op types that
    use them (no rule, or a rule that declined): a DEBUG log line, and the
    tape's summary() (its last per-example call)."""
    rows = tuple((_source_name(flat_raw[k]), tuple(analysis.fallback[k]))
                 for k in sorted(analysis.fallback) if k not in analysis.uses)
    tape._per_example_rows = (what, rows)  # pylint: disable=protected-access
    tape._per_example_rules = (what, _rules_of(flat_raw, analysis))  # pylint: disable=protected-access
    if logging.get_verbosity() <= logging.DEBUG:
        ruled = [f"{name} ({how})" for name, how in tape._per_example_rules[1]  # pylint: disable=protected-access
                 if how != "per-example rows"]
        if ruled:
            logging.debug("fasttape %s: op rules for %d source(s): %s", what,
                          len(ruled), "; ".join(ruled))
    if rows:
        logging.debug(
            "fasttape %s: per-example rows (one backward pass per example) for "
            "%d source(s) used by ops without a per-example rule: %s", what,
            len(rows), "; ".join(f"{name} (used by {', '.join(types)})"
                                 for name, types in rows))


def _pass_to(tape_state, losses, out_ids, post=None, remember=None):
    """The backward pass of sum(losses) to the tensors ``out_ids``, through
    the compiled-pass cache like any gradient() (with ``post`` and
    ``remember``, see gradients._compiled.gradient)."""
    target_meta = [output_meta(losses)]
    target_ids = [losses._id]  # pylint: disable=protected-access
    # an op whose output is `losses` itself: its gradient is the seed
    that_are_targets = {i: target_meta[0] for i in out_ids if i == target_ids[0]}
    core, vspace = tape_state.core, _recording.VSPACE

    def eager_pass():
        return core.compute_gradient(vspace, target_ids, out_ids,
                                     that_are_targets, None, True, True,
                                     target_meta)

    return _compiled.gradient(core, vspace, target_ids, out_ids,
                              that_are_targets, None, True, target_meta,
                              eager_pass, post=post, remember=remember)


def _ruled_pass(what, tape_state, losses, flat, analysis, use_grads=None):
    """The output gradients of the ruled ops: one backward pass of
    sum(losses) to those ops' outputs, through the compiled-pass cache like
    any gradient() (it runs no ruled op's gradient, and of the ops between
    them only what the outputs need). Returns {k: (payload, pos, rule,
    src_shape, g)}. A source whose rule declines (the output's shape, an
    attribute) moves to analysis.fallback. ``use_grads`` (a dict): the same
    pass also goes to the outputs of analysis.uses' ops, whose gradients
    it receives by id (for _rows: no second backward pass)."""
    if not analysis.ruled:
        return {}
    batch = int(losses.shape[0])
    out_ids = list(dict.fromkeys(analysis.out_ids[k] for k in analysis.ruled))
    overrides = {}
    if use_grads is not None:
        loops = _loops_of(analysis.uses)
        out_ids = list(dict.fromkeys(out_ids + [
            o for node in analysis.uses.values() for o in _leaves(node)] + [
                o for item in loops.values() for o in item[4]]))
        overrides = _loop_gradients(loops, batch, use_grads)
    with _recording.gradient_functions_of(overrides):
        grads = dict(zip(out_ids, _pass_to(tape_state, losses, out_ids)))
    if use_grads is not None:
        use_grads.update(grads)
    captured = {}
    for k, (payload, pos, rule, src_shape) in list(analysis.ruled.items()):
        g = grads.get(analysis.out_ids[k])
        if g is None:
            continue
        if type(g) is not ops.EagerTensor:
            g = ops.convert_to_tensor(g)
        saved = payload.inputs[pos]
        if saved is not None and saved.dtype != dtypes.resource:
            # the source as the op saw it (reshaped?)
            src_shape = tuple(saved.shape.as_list())
        if _norm_rules.applies(rule, payload, pos, tuple(g.shape.as_list()),
                               src_shape, batch):
            captured[k] = (payload, pos, rule, src_shape, g)
    for k in list(analysis.ruled):
        if k not in captured:
            del analysis.ruled[k]
            analysis.fallback[k] = [analysis.op_types[k]]
    return captured


def _rows(tape, losses, flat_raw, keys, basis=None, uses=None, grads=None,
          ruled=None):
    """{k: per-example (or per-basis-row) gradients of source k, or None}.
    ``uses``: the analysis' sources read by several ruled ops (_uses), whose
    per-example gradients come from one pass to those ops' outputs (or from
    ``grads``, their gradients by output id, where _ruled_pass's had them).
    A loop's variable read by one MatMul alone comes as its factors
    (_while_grads.Factors): added to ``ruled`` (k -> _ruled_pass's item,
    under the rule of a batched product, LOOP_RULE) and left out of the
    rows; without ``ruled``, its per-example gradients by that rule."""
    if uses and basis is None:
        got = _per_example_of_uses(tape._tape, losses, {  # pylint: disable=protected-access
            k: uses[k] for k in keys if k in uses},
            {k: tuple(flat_raw[k].shape.as_list()) for k in keys}, grads)
        for k in [k for k in uses if k not in got]:
            del uses[k]     # a rule declined: rows (and so in the summary)
        for k, v in list(got.items()):
            if isinstance(v, _while_grads.Factors):
                item = _factored(v, tuple(flat_raw[k].shape.as_list()))
                if ruled is None:
                    got[k] = item[2].per_example(*item[:2], item[4], src_shape=item[3])
                else:
                    ruled[k] = item
                    del got[k]
                    keys = [j for j in keys if j != k]
        rest = _rows(tape, losses, flat_raw, [k for k in keys if k not in got])
        return {k: got[k] if k in got else rest.get(k) for k in keys}
    if not keys:
        return {}
    if not context.executing_eagerly():
        return _graph_rows(tape, losses, flat_raw, keys, basis)
    rows = _jacobians.gradient_rows(tape, losses, [flat_raw[k] for k in keys],
                                    UnconnectedGradients.NONE, batch=False,
                                    basis=basis, release=False)
    return dict(zip(keys, rows))


# The rule a loop variable's factors take: Z = A W over [B, T, K] inputs.
LOOP_RULE = "BatchMatMulV2"


def _factored(factors, shape):
    """_ruled_pass's item (payload, pos, rule, src_shape, g) of a loop
    variable's factors (_while_grads.Factors): the variable as the W of A
    W, A the iterations' inputs, g their output gradients."""
    payload = EagerOp(("adj_x", False, "adj_y", bool(factors.transpose_b)),
                      (factors.a, None), 2)
    return payload, 1, _norm_rules.NORM_RULES[LOOP_RULE], shape, factors.g


def _op_types(analysis, ruled):
    """The op type of each ruled source's rule: the analysis', LOOP_RULE
    for a loop variable's factors (_rows)."""
    return {k: analysis.op_types[k] if k in analysis.ruled else LOOP_RULE
            for k in ruled}


def _graph_rows(tape, losses, flat_raw, keys, basis=None):
    """_rows while tracing: TF's pfor over one backward pass of the losses
    seeded with row i of ``basis`` (default: the unit vectors, so row i is
    example i's gradient), over the recorded trace; pfor runs the ops it
    cannot vectorize in a while loop. Exact, at a batch unknown while
    tracing too. A source no example reaches is None (as eagerly)."""
    raw = [flat_raw[k] for k in keys]
    flat = [_gradient.handle_or_self(s) for s in raw]
    tape_state = tape._tape  # pylint: disable=protected-access
    cut = None
    if basis is not None and losses.shape[0] is None:
        # (microbatches over no examples, a replica's empty shard: under
        # XLA, TF's pfor over two or more of their empty rows fails to
        # compile ("Incompatible shapes: [2,0,4] vs. [2,0,2]" for a [4, 2]
        # MatMul weight's): one iteration, its seed empty, its row zeros,
        # as the microbatches' would be)
        n = math_ops.maximum(math_ops.minimum(
            array_ops.shape(losses)[0], 1) * int(basis.shape[0]), 1)
    elif basis is not None:
        n = int(basis.shape[0])
    elif losses.shape[0] is not None:
        n = int(losses.shape[0])
    else:
        # (over no examples, a replica's empty shard, TF's pfor builds rows
        # of the wrong shape, [0, 1, 3] for a [5, 3] MatMul weight's, or
        # fails, in a Conv2D's filter gradient: one iteration, its seed
        # empty, cut off after)
        cut = array_ops.shape(losses)[0]
        n = math_ops.maximum(cut, 1)
    connected = []

    def loop_fn(i):
        if basis is None:
            seed = array_ops.one_hot(i, array_ops.shape(losses)[0],
                                     dtype=losses.dtype)
        else:
            seed = array_ops.gather(basis, i)
        grads = _gradient.compute(tape_state, [losses], flat, [seed], raw,
                                  UnconnectedGradients.NONE, retain=True)
        connected[:] = [g is not None for g in grads]
        return [array_ops.zeros_like(s) if g is None
                else ops.convert_to_tensor(g) for g, s in zip(grads, raw)]

    if _loops_in_xla(tape_state, losses, flat) or _jacobians.pfor_wrong_on_path(
            tape_state, losses, flat):
        rows = pfor_ops.for_loop(loop_fn, [dtypes.as_dtype(s.dtype).base_dtype
                                           for s in raw], n)
    else:
        rows = pfor_ops.pfor(loop_fn, n)
    if cut is not None:
        rows = [r[:cut] for r in rows]
    return {k: r if c else None for k, r, c in zip(keys, rows, connected)}


# Functional control flow: pfor vectorizes a While's gradient into
# TensorLists of TensorLists, which XLA does not compile (TensorListReserve
# of variants; TF's own vectorized_map of a Keras 3 RNN fails alike).
_CONTROL_FLOW = frozenset({"While", "StatelessWhile", "If", "StatelessIf",
                           "Case", "StatelessCase"})


def _loops_in_xla(tape_state, losses, flat):
    """Whether the rows are built under jit_compile on a path holding
    functional control flow (a Keras 3 RNN's While): then they run as a
    while loop of backward passes, one example each (XLA compiles it), not
    by pfor."""
    if not control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        return False
    plan = tape_state.core.plan([losses._id], [t._id for t in flat])  # pylint: disable=protected-access
    return plan is not None and any(e.op_type in _CONTROL_FLOW for e in plan[1])


def per_example_gradients(tape, losses, sources):
    tape_state, batch, flat_raw, flat = _start(tape, losses, sources,
                                               "per_example_gradients")
    try:
        analysis = _analyse("per_example_gradients", tape_state, losses, flat,
                            flat_raw, batch)
        out = [None] * len(flat)
        use_grads = {}
        ruled = _ruled_pass("per_example_gradients", tape_state, losses, flat,
                            analysis, use_grads)
        _note_fallback("per_example_gradients", tape, flat_raw, analysis)
        for k, rows in _rows(tape, losses, flat_raw, list(analysis.fallback),
                             uses=analysis.uses, grads=use_grads,
                             ruled=ruled).items():
            out[k] = rows
        for k, (payload, pos, rule, src_shape, g) in ruled.items():
            out[k] = array_ops.reshape(
                rule.per_example(payload, pos, g, src_shape=src_shape),
                [batch] + flat_raw[k].shape.as_list())
        for k, j in _repeated(flat).items():    # (as gradient() gives them)
            out[j] = out[k] = out[j] if out[j] is not None else out[k]
    finally:
        _end(tape, tape_state)
    return _pack(sources, flat_raw, out)


def _sq_norms(what, tape, tape_state, losses, flat, flat_raw, analysis):
    """[B] squared norms summed over sources, and what dp_gradient needs to
    finish without another pass (ruled contexts, fallback rows)."""
    use_grads = {}
    ruled = _ruled_pass(what, tape_state, losses, flat, analysis, use_grads)
    _note_fallback(what, tape, flat_raw, analysis)
    rows = _rows(tape, losses, flat_raw, list(analysis.fallback),
                 uses=analysis.uses, grads=use_grads, ruled=ruled)
    total = None
    memo = {}
    for payload, pos, rule, src_shape, g in ruled.values():
        sq = rule.sq_norms(payload, pos, g, src_shape=src_shape, memo=memo)
        total = sq if total is None else total + math_ops.cast(sq, total.dtype)
    for r in rows.values():
        if r is not None:
            sq = _norm_rules.sq_rows(r)
            total = sq if total is None else total + math_ops.cast(sq, total.dtype)
    if total is None:
        total = array_ops.zeros_like(losses)
    return total, ruled, rows, memo


def per_example_norms(tape, losses, sources):
    tape_state, batch, flat_raw, flat = _start(tape, losses, sources,
                                               "per_example_norms")
    try:
        analysis = _analyse("per_example_norms", tape_state, losses, flat,
                            flat_raw, batch)
        total, _, _, _ = _sq_norms("per_example_norms", tape, tape_state,
                                losses, flat, flat_raw, analysis)
    finally:
        _end(tape, tape_state)
    return math_ops.sqrt(total)


def _noise_seed(seed, k):
    """The stateless seed of source k's noise: a seed (an int, or a pair
    of ints as TF's stateless ops take) moved along by the source's index."""
    first, second = (0, seed) if isinstance(seed, int) else seed
    return ops.convert_to_tensor([int(first) + k, int(second)], dtypes.int64)


_NUMPY_NOISE = frozenset({dtypes.float32, dtypes.float64})
_unseeded = []      # the numpy Generator of unseeded noise, made on first use
_U64 = (1 << 64) - 1
# Noise is drawn and added this many values at a time: a DP step holds no
# full-size noise (nor a second copy of the gradient) for a large source.
_NOISE_CHUNK = 1 << 16


def _unseeded_rng():
    if not _unseeded:
        # SFC64: the fastest of numpy's bit generators here (a draw of
        # normals about 10% faster than PCG64's); seeded from the OS
        _unseeded.append(np.random.Generator(np.random.SFC64()))
    return _unseeded[0]


def _after_fork_in_child():
    # A child drawing on from the parent's generator state would add the
    # parent's noise again: each process draws from a generator of its own.
    _unseeded.clear()
    _pool.reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _noise_rng(seed):
    """The numpy Generator of one dp_gradient call's float32/float64 noise:
    keyed by ``seed``, else by TF's op seeds (tf.random.set_seed), else
    unseeded. Every source draws from it in turn.

    numpy (one thread, a few ns a value; see _standard_normal) is several
    times faster than TF's RandomStandardNormal (Box-Muller over Philox,
    split across the intra-op threads), which cost more than the rest of a
    small model's DP work."""
    if seed is None:
        seed1, seed2 = random_seed.get_seed(None)
        if seed1 is None:
            return _unseeded_rng()
    else:
        seed1, seed2 = (0, seed) if isinstance(seed, int) else seed
    return np.random.Generator(np.random.Philox(
        key=((int(seed1) & _U64) << 64) | (int(seed2) & _U64)))


# TF wraps a numpy array aligned to this many bytes without a copy (its
# EIGEN_MAX_ALIGN_BYTES on AVX-512 builds; a multiple of the others).
_ALIGN = 64


def _aligned_empty(n, np_dtype):
    """np.empty(n, np_dtype), starting at a multiple of _ALIGN bytes: an
    EagerTensor made of it (or of a row starting there) shares its memory
    instead of copying it."""
    size = np.dtype(np_dtype).itemsize
    buf = np.empty(n + _ALIGN // size, np_dtype)
    start = (-buf.ctypes.data % _ALIGN) // size
    return buf[start:start + n]


def _standard_normal(rng, n, np_dtype, scale=1.0):
    """n normal values of standard deviation ``scale`` and dtype np_dtype,
    from the numpy Generator rng.

    float32 by Box-Muller (two normals from two uniforms: the radius from a
    float64 uniform, so the tails reach 8.5 standard deviations, the angle
    in float32, whose cos and sin numpy vectorizes; the scale goes into
    the radius): about twice as fast as numpy's ziggurat in float32, which
    cost a small model's DP step more than its clipping. float64 by the
    ziggurat (numpy has no vectorized float64 cos and sin: Box-Muller is
    slower there)."""
    if np_dtype != np.float32:
        out = rng.standard_normal(n, dtype=np_dtype,
                                  out=_aligned_empty(n, np_dtype))
        if scale != 1.0:
            out *= scale
        return out
    half = (n + 1) >> 1
    radius = rng.random(half)      # u in [0, 1): 1 - u in (0, 1], exact
    np.subtract(1.0, radius, out=radius)
    np.log(radius, out=radius)
    radius *= -2.0 * scale * scale
    np.sqrt(radius, out=radius)
    radius = radius.astype(np.float32)
    angle = rng.random(half, dtype=np.float32)
    angle *= np.float32(2 * np.pi)
    out = _aligned_empty(2 * half, np.float32)
    np.multiply(radius, np.cos(angle), out=out[:half])
    np.multiply(radius, np.sin(angle, out=angle), out=out[half:])
    return out[:n]


def _wrap_device(ctx):
    """The device argument of an EagerTensor made of a numpy array where
    TF's convert_to_tensor would pass ctx.device_name: None, the host CPU
    (no _EagerConst op run to place it: 1 us a tensor, not 5), where that
    is where TF would put it too (no device scope and no device but CPUs).
    """
    device = ctx.device_name
    if device or any(d.device_type != "CPU" for d in ctx.list_logical_devices()):
        return device
    return None


class _Pool:
    """Unseeded noise vectors drawn ahead, as eager tensors, by (size, numpy
    dtype, scale, device): each is handed out once (``take``). A DP step
    drawing and wrapping its own vector paid for it cold, after its forward
    pass: 0.17 ms against 0.05 for the same draw and wrap in a loop of
    draws, on the bench's MLP (a tenth of its step). Drawn several at a
    time, the step's mean time fell 4% (its median 10%: the fills fall on
    a few steps). A key's first fill draws one
    vector, each later fill twice as many as the one before, up to
    POOL_VALUES values: a size used once costs no more than before. The
    vectors are independent draws from the unseeded generator, whichever
    call takes them. Emptied by clear_caches() and in a forked child."""

    POOL_VALUES = 1 << 16   # values drawn ahead for one key, at most
    MAX_KEYS = 4

    def __init__(self):
        self._by_key = collections.OrderedDict()   # key -> [rows of its last fill, tensors]
        self._lock = threading.Lock()              # (fills: the takes need none)

    def take(self, size, np_dtype, scale):
        ctx = context.context()
        ctx.ensure_initialized()
        key = (size, np_dtype, scale, ctx.device_name)
        entry = self._by_key.get(key)
        if entry is not None:
            try:
                return entry[1].pop()    # (atomic: no vector goes out twice)
            except IndexError:
                pass
        rows = min(2 * entry[0] if entry is not None else 1,
                   max(1, self.POOL_VALUES // size))
        # Rows _ALIGN bytes apart: each tensor shares its row's memory (TF
        # copies a row that starts elsewhere); the values between them
        # are drawn and never used.
        per = _ALIGN // np.dtype(np_dtype).itemsize
        stride = -(-size // per) * per
        with self._lock:
            values = _standard_normal(_unseeded_rng(), rows * stride, np_dtype,
                                      scale).reshape(rows, stride)
            # (no copy, as constant() makes: the arrays are the pool's alone)
            device = _wrap_device(ctx)
            tensors = [ops.EagerTensor(row[:size], device) for row in values]
            taken = tensors.pop()
            self._by_key.pop(key, None)
            self._by_key[key] = [rows, tensors]
            while len(self._by_key) > self.MAX_KEYS:
                self._by_key.popitem(last=False)
        return taken

    def rows(self):
        """{key: (rows of its last fill, vectors left)} (for tests)."""
        return {k: (e[0], len(e[1])) for k, e in self._by_key.items()}

    def clear(self):
        with self._lock:
            self._by_key.clear()

    def reset(self):
        """Empty, with a new lock, in a forked child (another thread of the
        parent may have held the old one). The parent's tensors are kept,
        not released: as gradients._compiled keeps its passes there, no call
        into TF's runtime is made from a forked child that may not return."""
        _kept_in_child.append(self._by_key)
        self.__init__()


_kept_in_child = []


_pool = _Pool()


class _Noise:
    """The noise vector of one dp_gradient call: ``at[k]`` = (offset, size)
    of source k's noise in it, for every source of the vector's dtype (the
    first float32/float64 source's) up to one noise block. Drawn from
    ``rng`` before anything else (the larger sources' blocks after it);
    unseeded, taken from _pool.
    Its offsets depend on the sources alone, so a seed draws the same for
    each source whichever of them the losses reach."""

    def __init__(self, flat_raw, stddev, rng):
        self.at, self.dtype, self.size = {}, None, 0
        for k, s in enumerate(flat_raw):
            if self.dtype is None and s.dtype in _NUMPY_NOISE:
                self.dtype = s.dtype
            n = s.shape.num_elements()
            if s.dtype == self.dtype and n is not None and n <= _NOISE_CHUNK:
                self.at[k] = (self.size, n)
                self.size += n
        self._stddev, self._rng = stddev, rng
        self._values = self._tensor = None

    def _draw(self):
        if self._values is None and self.size:
            if _unseeded and self._rng is _unseeded[0]:
                self._tensor = self._values = _pool.take(
                    self.size, self.dtype.as_numpy_dtype, self._stddev)
                return
            self._values = _standard_normal(
                self._rng, self.size, self.dtype.as_numpy_dtype, self._stddev)

    def tensor(self):
        self._draw()
        if self._tensor is None:
            # (no copy, as constant() makes: the array is this call's alone)
            ctx = context.context()
            ctx.ensure_initialized()
            self._tensor = ops.EagerTensor(self._values, _wrap_device(ctx))
        return self._tensor

    def wait(self):
        """Drawn (before ``rng`` draws anything else)."""
        self._draw()


def _noise(dtype, shape, seed, k, stddev, rng):
    """Normal noise of standard deviation ``stddev`` for source k: from
    ``rng`` (_noise_rng) for float32 and float64, else from TF's kernels
    (seeded by TF's op seeds, or by ``seed`` and k)."""
    if dtype not in _NUMPY_NOISE:
        if seed is None:
            seed1, seed2 = random_seed.get_seed(None)
            # random_normal's kernel and seeds, without its Python layers
            return _ex("Mul", _ex(
                "RandomStandardNormal", _const(tuple(shape.as_list()), dtypes.int32),
                "seed", seed1, "seed2", seed2, "dtype", dtype), _const(stddev, dtype))
        return stateless_random_ops.stateless_random_normal(
            shape, seed=_noise_seed(seed, k), stddev=stddev, dtype=dtype)
    noise = _standard_normal(rng, shape.num_elements(), dtype.as_numpy_dtype,
                             stddev).reshape(shape.as_list())
    return constant_op.constant(noise)


def _add_noise_in_place(g, stddev, rng):
    """g plus normal noise, added a block of rows at a time into g's own
    buffer (InplaceAdd aliases its input). g must be a gradient this call
    made and holds alone: a rule's weighted sum or the rows' product. The
    blocks are drawn from ``rng`` (numpy, one thread): TF's
    RandomStandardNormal, split across the intra-op threads, waits for the
    slowest of them, and on a machine other processes share it cost 5-15x
    numpy's time (155k values: 12 ms against 0.7)."""
    n = g.shape.num_elements()
    cols = int(g.shape[-1]) if g.shape.rank and g.shape[-1] else 1
    rows = n // cols
    flat = _ex("Reshape", g, _const((rows, cols), dtypes.int32))
    step = max(1, _NOISE_CHUNK // cols)
    for first in range(0, rows, step):
        last = min(rows, first + step)
        chunk = constant_op.constant(_standard_normal(
            rng, (last - first) * cols, g.dtype.as_numpy_dtype,
            stddev).reshape(last - first, cols))
        flat = _ex("InplaceAdd", flat, _cached_range(first, last), chunk)
    return _ex("Reshape", flat, _const(tuple(g.shape.as_list()), dtypes.int32))


def _cached_range(first, last):
    return _cached(("range", first, last),
                   lambda: math_ops.range(first, last, dtype=dtypes.int32))


def _hashable(value):
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def _post_plan(ruled, rows, flat_raw, noise_at, op_types, reserved=0,
               batch=None):
    """What dp_gradient's post-pass computes, as (spec, feeds, feed_at): noise is
    added from the noise vector to the sources in ``noise_at`` (see _Noise);
    ``spec`` is hashable (it keys the traced function, with the feeds'
    shapes and dtypes) and ``feeds`` the tensors it reads: the rules' saved
    inputs and output gradients (each once), the fallback rows. With
    ``reserved`` = n, the first n feeds are the backward pass's outputs (a
    rule's ``g`` is then its index there) and are not in ``feeds``, and
    the post-pass checks that each rule applies to the batch size
    ``batch`` (_NotFusable). ``feed_at`` says where each feed came from:
    (k, i) for input i of source k's ruled op, None for others."""
    feeds, index, feed_at = [None] * reserved, {}, []

    def feed(t, at=None):
        if type(t) is int:
            return t
        i = index.get(id(t))
        if i is None:
            i = index[id(t)] = len(feeds)
            feeds.append(t)
            feed_at.append(at)
        return i
    ruled_spec = []
    for k, (payload, pos, rule, src_shape, g) in ruled.items():
        del rule
        inputs = tuple(
            -1 if t is None or t.dtype == dtypes.resource else feed(t, (k, i))
            for i, t in enumerate(payload.inputs))
        attrs = payload.attrs
        try:
            hash(attrs)
        except TypeError:
            attrs = tuple(_hashable(a) for a in attrs)
        ruled_spec.append((k, op_types[k], pos, tuple(src_shape),
                           attrs, payload.num_inputs, inputs, feed(g)))
    rows_spec = tuple((k, feed(r)) for k, r in rows.items() if r is not None)
    # The noise added inside the post-pass, from one vector (larger
    # sources get theirs a block at a time after it, as do other dtypes).
    noised = tuple((k, *noise_at[k]) for k in sorted(
        [k for k, *_ in ruled_spec] + [k for k, _ in rows_spec]) if k in noise_at)
    shapes = tuple((k, tuple(flat_raw[k].shape.as_list()))
                   for k in sorted([k for k, *_ in ruled_spec]
                                   + [k for k, _ in rows_spec]))
    return ((tuple(ruled_spec), rows_spec, noised, shapes, batch),
            feeds[reserved:], feed_at)


class _NotFusable(Exception):
    """A rule declines an output gradient's shape, in a post-pass fused to
    the backward pass: dp_gradient takes the two steps instead."""


def _fusable(analysis, batch):
    """For a dp_gradient whose every source has a rule that applies with
    its output's recorded shape: {k: (payload, pos, rule, src_shape, index
    of its output among out_ids)} and out_ids; else None."""
    if analysis.fallback or not analysis.ruled:
        return None
    out_ids = list(dict.fromkeys(analysis.out_ids[k] for k in analysis.ruled))
    where = {o: i for i, o in enumerate(out_ids)}
    items = {}
    for k, (payload, pos, rule, src_shape) in analysis.ruled.items():
        saved = payload.inputs[pos]
        if saved is not None and saved.dtype != dtypes.resource:
            src_shape = tuple(saved.shape.as_list())
        # (the recording knows few outputs' shapes: the post-pass checks
        # again on the output gradients, see _NotFusable)
        out_shape = analysis.out_shapes.get(k)
        if out_shape is not None and not _norm_rules.applies(
                rule, payload, pos, out_shape, src_shape, batch):
            return None
        items[k] = (payload, pos, rule, src_shape, where[analysis.out_ids[k]])
    return items, out_ids


def _post_pass(spec, *tensors, payloads=None, sparse=False):
    """dp_gradient after the backward pass: each example's squared norm
    (the rules', the rows'), its clip factor min(1, C / norm) / m, the
    reweighted gradient of each source (a rule's weighted sum, the rows'
    weighted sum), noise, as dense tensors in the order of ``spec``'s
    shapes. The trailing tensors are C, C / m and (with noise) the noise.
    Runs eagerly, or traced once per spec (gradients._compiled.traced_call).
    ``payloads`` (fused to the backward pass: spec's batch set) are the
    recorded ops, on which each rule is checked against its output
    gradient's shape (_NotFusable). ``sparse``: a rule's IndexedSlices
    that no noise is added to here stay IndexedSlices (the traced step
    scatters them into their noise: _graph_noise)."""
    ruled_spec, rows_spec, noised, shapes, batch = spec
    n_fixed = 3 if noised else 2
    clip, clip_m = tensors[-n_fixed], tensors[-n_fixed + 1]
    noise = tensors[-1] if noised else None
    memo, total, items = {}, None, []
    for k, op_type, pos, src_shape, attrs, n_in, inputs, g_i in ruled_spec:
        payload = EagerOp(attrs, tuple(None if i < 0 else tensors[i]
                                       for i in inputs), n_in)
        g = tensors[g_i]
        if g is None or isinstance(g, indexed_slices.IndexedSlices):
            g = ops.convert_to_tensor(g)
        rule = _norm_rules.NORM_RULES[op_type]
        if batch is not None and not _norm_rules.applies(
                rule, payloads[k], pos, tuple(g.shape.as_list()), src_shape,
                batch):
            raise _NotFusable(op_type)
        sq = rule.sq_norms(payload, pos, g, src_shape=src_shape, memo=memo)
        total = sq if total is None else _norm_rules._ex(
            "AddV2", total, math_ops.cast(sq, total.dtype))
        items.append((k, payload, pos, rule, src_shape, g))
    for _, r_i in rows_spec:
        sq = _norm_rules.sq_rows(tensors[r_i])
        total = sq if total is None else _norm_rules._ex(
            "AddV2", total, math_ops.cast(sq, total.dtype))
    clip = math_ops.cast(clip, total.dtype)
    clip_m = math_ops.cast(clip_m, total.dtype)
    # min(1, C / norm), and the division by the number of microbatches.
    weights = _norm_rules._ex("RealDiv", clip_m, _norm_rules._ex("Maximum", _norm_rules._ex("Sqrt", total), clip))
    out = {}
    for k, payload, pos, rule, src_shape, g in items:
        w = weights if g.dtype == weights.dtype else math_ops.cast(weights, g.dtype)
        out[k] = rule.weighted(payload, pos, g, w, src_shape=src_shape,
                               memo=memo)
    for k, r_i in rows_spec:
        r = tensors[r_i]
        out[k] = math_ops.tensordot(math_ops.cast(weights, r.dtype), r, 1)
    noise_of = {k: (offset, n) for k, offset, n in noised}
    result = []
    for k, shape in shapes:
        g = out[k]
        at = noise_of.get(k)
        if isinstance(g, indexed_slices.IndexedSlices):
            if at is None and sparse:
                result.append(indexed_slices.IndexedSlices(
                    g.values, g.indices, _norm_rules._const(tuple(shape), dtypes.int32)))
                continue
            if at is None:
                g = math_ops.unsorted_segment_sum(g.values, g.indices, shape[0])
            else:
                # the noise, with the rows scattered into it (one op)
                g = _norm_rules._ex("TensorScatterAdd", array_ops.reshape(
                    array_ops.slice(noise, [at[0]], [at[1]]), shape), _norm_rules._ex(
                        "ExpandDims", g.indices, _norm_rules._const(-1, dtypes.int32)),
                        g.values)
            result.append(array_ops.reshape(g, shape))
            continue
        g = _shaped(g, shape)
        if at is not None:
            g = _norm_rules._ex("AddV2", g, _shaped(
                array_ops.slice(noise, [at[0]], [at[1]]), shape))
        result.append(g)
    return result


def _shaped(t, shape):
    """t reshaped to ``shape``, or t itself where its static shape is that
    already (a kernel less in each traced post-pass, per source)."""
    if t.shape.as_list() == list(shape):
        return t
    return array_ops.reshape(t, shape)


_DECLINED = set()    # fused post-pass specs a rule declined (_NotFusable)
# The fused post-pass's plan by its analysis' key (_ANALYSES) and whether
# it adds noise: (spec, the ks whose ops' outputs the pass goes to, where
# each feed is among the ruled ops' inputs). No tensor in them.
_FUSED_PLANS = collections.OrderedDict()


def _remember_fused(analysis, noise, spec, feed_at, ruled, out_ids):
    where = {o: i for i, o in enumerate(out_ids)}
    out_ks = [None] * len(out_ids)
    for k in ruled:
        out_ks[where[analysis.out_ids[k]]] = k
    if None in out_ks:
        return
    _FUSED_PLANS[(analysis.key, noise is None)] = [
        spec, tuple(out_ks), tuple(feed_at), None]
    if len(_FUSED_PLANS) > _MAX_ANALYSES:
        _FUSED_PLANS.popitem(last=False)


def _clear_plans():
    _ANALYSES.clear()
    _FUSED_PLANS.clear()
    _pool.clear()


_recording.observe_from_above(clear_caches=_clear_plans)


def _fused_plan(analysis, noise):
    """A remembered fused plan for this analysis, on its ops: (ruled, out_ids,
    (spec, feeds, record)), or None. record: its _FUSED_PLANS value, whose
    last item is the compiled pass replayed for it (a
    gradients._compiled.Remembered rebased on the analysis' entries), or
    None before one was."""
    if analysis.key is None:
        return None
    found = _FUSED_PLANS.get((analysis.key, noise is None))
    if found is None:
        return None
    spec, out_ks, feed_at, _ = found
    ruled = analysis.ruled
    feeds = [ruled[k][0].inputs[i] for k, i in feed_at]
    return ruled, [analysis.out_ids[k] for k in out_ks], (spec, feeds, found)


def _dp_finish(tape_state, losses, flat_raw, analysis, ruled, rows, clip, m,
               noise, out, out_ids=None, planned=None):
    """The post-pass of dp_gradient: fills ``out`` with each source's
    clipped, summed, divided gradient, with noise for the sources the spec
    notes (see _post_plan; ``noise``: a _Noise, or None); returns the spec.
    With ``out_ids``, ``ruled`` holds indices into them and the backward
    pass to them runs fused with the post-pass (may raise _NotFusable).
    ``planned``: _post_plan's (spec, feeds) and their _FUSED_PLANS record
    (see _fused_plan): a pass replayed for it before is replayed on this
    path's tensors without a plan of its own (the analysis' plan has the
    same structure: the pass' key is the same)."""
    fused = out_ids is not None
    record = None
    if planned is not None:
        spec, feeds, record = planned
    else:
        spec, feeds, feed_at = _post_plan(
            ruled, rows, flat_raw, {} if noise is None else noise.at,
            analysis.op_types,
            reserved=len(out_ids) if fused else 0,
            batch=int(losses.shape[0]) if fused else None)
        if fused and analysis.key is not None and None not in feed_at:
            _remember_fused(analysis, noise, spec, feed_at, ruled, out_ids)
    if fused and (record is None or record[3] is None) and spec in _DECLINED:
        raise _NotFusable()
    if not spec[3]:
        return spec
    dtype = noise.dtype if spec[2] else flat_raw[spec[3][0][0]].dtype
    feeds += [_const(clip, dtype), _const(clip / m, dtype)]
    if spec[2]:
        feeds.append(noise.tensor())
    grads = None
    if not fused:
        grads = _compiled.traced_call(
            ("dp_gradient", spec), lambda *t: _post_pass(spec, *t), feeds)
    elif record is not None and record[3] is not None:
        remembered = record[3]
        entries = analysis.entries
        grads = _compiled.replay(
            remembered,
            [entries[j].payload.saved[i] for j, i in remembered.slots] + feeds,
            _recording.VSPACE, [output_meta(losses)])
    if grads is None and fused:
        payloads = {k: item[0] for k, item in ruled.items()}
        remember = [] if record is not None else None
        try:
            grads = _pass_to(tape_state, losses, out_ids, post=(
                ("dp_gradient", spec),
                lambda g, *t: _post_pass(spec, *g, *t, payloads=payloads),
                feeds), remember=remember)
            if remember and remember[0].rebase(analysis.entries):
                record[3] = remember[0]
        except _NotFusable:
            if len(_DECLINED) > 256:
                _DECLINED.clear()
            _DECLINED.add(spec)
            raise
    for (k, _), g in zip(spec[3], grads):
        out[k] = g
    return spec


class IndivisibleBatchError(errors.InvalidArgumentError, ValueError):
    """dp_gradient's num_microbatches does not divide the batch size, or
    the batch holds no example: TF's InvalidArgumentError, which a function
    whose batch is known only at run time raises for it, and a ValueError
    (an argument's). Made as TF's: (node_def, op, message), which
    autograph needs to raise it again from a function being traced."""


EMPTY_BATCH = ("dp_gradient: a batch of no examples has no microbatch to divide "
          "the clipped sum by.")


def _indivisible(m):
    return (f"dp_gradient: num_microbatches ({m}) must divide the batch "
            "size, as in TF Privacy (give every batch a multiple of it: a "
            "dataset batched with drop_remainder=True, or a number of "
            "examples that is a multiple of the batch size)")


def _examples_one(losses, dtype):
    """While tracing, the batch unknown: a 1 of ``dtype`` (a factor of the
    divisor) that fails on a batch of no examples (as eagerly: no
    microbatch to divide by): an assertion, and under XLA a reshape named
    for it. (XLA compiles an Assert to nothing, and no op it compiles
    fails with a message of ours: there the error is the reshape's
    InvalidArgumentError, "Input to reshape is a tensor with 1 values, but
    the requested shape has 0", naming this node. The rows over the
    microbatches of no example must not fail first: _graph_rows.)"""
    n = array_ops.shape(losses)[0]
    check = control_flow_assert.Assert(math_ops.greater(n, 0), [EMPTY_BATCH])
    with ops.control_dependencies([check]):
        one = array_ops.reshape(
            array_ops.ones([1], dtype),
            array_ops.reshape(math_ops.minimum(n, 1), [1]),
            name="dp_gradient_needs_a_batch_of_examples")
    return array_ops.reshape(one, [])


def _microbatch_basis(losses, m, batch):
    """[m, B]: row j averages microbatch j's losses, examples j B/m to
    (j+1) B/m - 1 (TF Privacy's reshape of the losses to [m, B/m], each
    row's mean). ``batch`` None: B read at run time, where a B that m does
    not divide fails with IndivisibleBatchError's message (an assertion's
    InvalidArgumentError; under XLA, which drops assertions, the reshape to
    [m, B] fails, an InvalidArgumentError too). A B of 0 (a replica's empty
    shard) gives an empty basis: every microbatch's gradient is 0."""
    eye = linalg_ops_impl.eye(m, dtype=losses.dtype)
    if batch is not None:
        size = batch // m
        return array_ops.repeat(eye, size, axis=1) / size
    n = array_ops.shape(losses)[0]
    size = n // m
    check = control_flow_assert.Assert(
        math_ops.equal(n - size * m, 0),
        [f"{_indivisible(m)}; the batch size:", n])
    with ops.control_dependencies([check]):
        basis = array_ops.reshape(
            array_ops.repeat(eye, size, axis=1), array_ops_stack.stack([m, n]),
            name="num_microbatches_must_divide_the_batch_size")
    return basis / math_ops.cast(size, losses.dtype)


def _zeros(source):
    return array_ops.zeros(
        source.shape if source.shape.is_fully_defined()
        else array_ops.shape(source), dtypes.as_dtype(source.dtype).base_dtype)


def _noised(out, flat_raw, stddev, seed):
    """While tracing: each clipped sum of ``out`` (None: none) plus noise of
    standard deviation ``stddev`` (_graph_noise), none at 0."""
    if not stddev > 0:
        return out
    add_noise = _graph_noise(seed, flat_raw,
                             [k for k, g in enumerate(out) if g is not None],
                             stddev, 1)
    return [g if g is None else add_noise(k, g) for k, g in enumerate(out)]


def _empty_sums(tape_state, losses, flat, flat_raw):
    """dp_gradient's clipped sums over a batch of no examples (a replica's
    empty shard): zeros, None for a source the losses do not reach (where
    the plain gradient has None)."""
    reached = _gradient.compute(tape_state, [losses], flat,
                                [array_ops.ones_like(losses)], flat_raw,
                                UnconnectedGradients.NONE, retain=True)
    return [None if g is None else _zeros(s) for g, s in zip(reached, flat_raw)]


def _vector_noise(out, noise, flat_raw):
    """Eagerly, an empty shard's zeros (_empty_sums): those of the sources
    in the noise vector (``noise``: a _Noise, or None) replaced by their
    noise from it, as _post_pass adds it (so a seed draws what it draws
    for a shard with examples); returns them as _post_plan's spec notes
    them, (k, offset, size)."""
    if noise is None:
        return ()
    noised = tuple((k, *noise.at[k]) for k, g in enumerate(out)
                   if g is not None and k in noise.at)
    for k, offset, size in noised:
        out[k] = array_ops.reshape(
            array_ops.slice(noise.tensor(), [offset], [size]), flat_raw[k].shape)
    return noised


def _dp_traced(tape, tape_state, losses, flat, flat_raw, batch, clip, m,
               noise_multiplier, seed, divide=True):
    """dp_gradient while tracing: the ruled pass, the rows, and the eager
    path's post-pass (_post_pass, the same rules) built into the function;
    noise by _graph_noise. ``m`` None: the batch is unknown while tracing
    (every example its own microbatch, m read at run time); ``batch`` None
    with ``m`` given: the microbatches' size read at run time
    (_microbatch_basis). ``divide`` as dp_gradient's."""
    if batch == 0:
        return _noised(_empty_sums(tape_state, losses, flat, flat_raw),
                       flat_raw, clip * noise_multiplier, seed)
    if m == batch:
        analysis = _analyse("dp_gradient", tape_state, losses, flat, flat_raw,
                            batch)
        use_grads = {}
        ruled = _ruled_pass("dp_gradient", tape_state, losses, flat, analysis,
                            use_grads)
        # (a source read by several ruled ops or through a chain: their
        # rules summed, as eagerly; the summary says so)
        rows = _rows(tape, losses, flat_raw, list(analysis.fallback),
                     uses=analysis.uses, grads=use_grads, ruled=ruled)
    else:
        # (as eagerly: a microbatch's gradient goes through rows)
        analysis = _analyse("dp_gradient", tape_state, losses, flat, flat_raw,
                            batch, use_rules=False)
        ruled, rows = {}, _rows(tape, losses, flat_raw,
                                list(analysis.fallback),
                                _microbatch_basis(losses, m, batch))
    _note_fallback("dp_gradient", tape, flat_raw, analysis)
    spec, feeds, _ = _post_plan(ruled, rows, flat_raw, {},
                                _op_types(analysis, ruled))
    out = [None] * len(flat)
    if not spec[3]:
        return out
    dtype = flat_raw[spec[3][0][0]].dtype
    if not divide:
        count = _norm_rules._const(1, dtype)
    elif m is None:
        count = math_ops.cast(array_ops.shape(losses)[0], dtype)
    else:
        count = _norm_rules._const(m, dtype)
    if divide and batch is None:
        count = count * _examples_one(losses, dtype)
    clip_t = _norm_rules._const(clip, dtype)
    noised = noise_multiplier > 0
    # (a table's clipped rows stay IndexedSlices: scattered into its noise
    # by _graph_noise, or, with no noise, returned as the plain step's
    # gradient of a Gather is)
    grads = _post_pass(spec, *feeds, clip_t, _norm_rules._ex("RealDiv", clip_t, count),
                       sparse=True)
    if noised:
        add_noise = _graph_noise(seed, flat_raw, [k for k, _ in spec[3]],
                                 clip * noise_multiplier, count)
        grads = [add_noise(k, g) for (k, _), g in zip(spec[3], grads)]
    for (k, _), g in zip(spec[3], grads):
        out[k] = g
    return out


# The traced noise's bits: TF's stateless uniform, Philox named (on CPU
# "auto_select" is Philox too, but under XLA it compiled to a generator
# 5-10x slower). Its normals are drawn by whichever exact transform of
# those uniforms costs least in the mode (_traced_normal).
_NOISE_ALG = "philox"
# Drawn in float32 and cast: a float16 or bfloat16 uniform has 10 or 7
# random bits (its Box-Muller radius would stop at 3.7 standard deviations,
# its inverse CDF at 3.3); TF's own normal of those dtypes is float32's,
# cast.
_DRAWN_AS = {dtypes.float16: dtypes.float32, dtypes.bfloat16: dtypes.float32}
# Half the step of the uniform's grid (k 2^-23 in float32, k 2^-52 in
# float64): the inverse CDF reads the grid's midpoints, symmetric about 1/2,
# never 0 or 1.
_HALF_STEP = {dtypes.float32: 2.0 ** -24, dtypes.float64: 2.0 ** -53}
# Box-Muller's ops for fewer values cost more than TF's normal kernel (g +
# noise in a tf.function, 2 loaded cores: 1,000 values 1.03x the kernel's
# step, 4,000 0.78x, 16,000 0.75x).
_BOX_MULLER_MIN = 2048


def _traced_normal(shape, seed, stddev, dtype, in_xla):
    """While tracing: normal values of shape ``shape`` (static) and
    standard deviation ``stddev`` (a scalar tensor of the drawing dtype:
    _DRAWN_AS, else ``dtype``), of dtype ``dtype``, keyed by ``seed`` (an
    int64 pair tensor: the same seed, the same values).

    Both transforms read TF's stateless uniform bits (the V2 kernel, Philox;
    float32 values k 2^-23, float64 k 2^-52, in [0, 1)):
    - in a graph without XLA, Box-Muller as TF's own normal kernel does it
      (random_distributions.h: radius sqrt(-2 log u) of one uniform, angle
      2 pi v of another, both of the pair kept), but as whole-tensor Eigen
      ops, which vectorize, where TF's kernel runs the transform a pair of
      values at a time: 1 - u in place of TF's u clamped to 1e-7, so the
      radius reaches 5.65 standard deviations (TF's 5.68). float64 takes
      TF's normal kernel there: Eigen's float64 cos and sin made the
      vectorized transform slower than the kernel's scalar one; so does a
      draw of fewer than _BOX_MULLER_MIN values, whose dozen ops cost more
      than their work;
    - under XLA, the inverse normal CDF (Ndtri) of the grid's midpoints,
      which XLA fuses into the draw: its Box-Muller (and TF's normal,
      compiled) cost about twice the uniform draw, this about the draw
      alone; it reaches 5.3 standard deviations in float32 (quantiles
      of a 2^23-point grid), 8.2 in float64."""
    drawn = _DRAWN_AS.get(dtype, dtype)
    n = shape.num_elements()
    key, counter, alg = random_ops_util.get_key_counter_alg(seed, _NOISE_ALG)
    if in_xla:
        u = gen_stateless_random_ops_v2.stateless_random_uniform_v2(
            _norm_rules._const([n], dtypes.int32), key, counter, alg,
            dtype=drawn)
        z = _norm_rules._ex("Mul", _norm_rules._ex("Ndtri", _norm_rules._ex(
            "AddV2", u, _norm_rules._const(_HALF_STEP[drawn], drawn))), stddev)
    elif drawn == dtypes.float64 or n < _BOX_MULLER_MIN:
        z = _norm_rules._ex("Mul", gen_stateless_random_ops_v2.stateless_random_normal_v2(
            _norm_rules._const([n], dtypes.int32), key, counter, alg,
            dtype=drawn), stddev)
    else:
        half = (n + 1) >> 1
        u = gen_stateless_random_ops_v2.stateless_random_uniform_v2(
            _norm_rules._const([2, half], dtypes.int32), key, counter, alg,
            dtype=drawn)
        radius_u, angle_u = array_ops.split(u, 2)
        # sqrt(-2 sigma^2 log(1 - u)): 1 - u is exact, in (0, 1]
        radius = _norm_rules._ex("Sqrt", _norm_rules._ex(
            "Mul", _norm_rules._ex("Log", _norm_rules._ex(
                "Sub", _norm_rules._const(1.0, drawn), radius_u)),
            _norm_rules._ex("Mul", _norm_rules._ex("Square", stddev),
                            _norm_rules._const(-2.0, drawn))))
        angle = _norm_rules._ex("Mul", angle_u,
                                _norm_rules._const(2 * np.pi, drawn))
        z = array_ops.concat(
            [_norm_rules._ex("Mul", radius, _norm_rules._ex("Cos", angle)),
             _norm_rules._ex("Mul", radius, _norm_rules._ex("Sin", angle))], 1)
        z = _norm_rules._ex("Reshape", z, _norm_rules._const([-1], dtypes.int32))
        if 2 * half != n:
            z = z[:n]
    if drawn != dtype:
        z = math_ops.cast(z, dtype)
    return _norm_rules._ex("Reshape", z, _norm_rules._const(
        tuple(shape.as_list()), dtypes.int32))


# A traced source's noise is drawn this many values at a time, at most (4
# MiB of float32, with the draw's temporaries about three times that),
# each block added before the next is drawn: a larger source holds no
# full-size noise. Blocks of _NOISE_CHUNK (the eager path's) cost a
# 512x512 weight's step 1.6x the noise of one draw (each block a dozen
# ops, run one after another; 2 loaded cores).
_TRACED_NOISE_BLOCK = 1 << 20


def _graph_noise(seed, flat_raw, ks, scale, count):
    """While tracing: add_noise(k, g), g plus source k's normal noise of
    standard deviation scale / count, for the sources ``ks``, drawn by
    _traced_normal. The sources of up to _NOISE_CHUNK values take theirs
    from one vector per dtype (one kernel), cut at offsets that depend on
    the sources alone (a seed draws the same for a source whichever of
    them the losses reach); a larger one's in one draw up to
    _TRACED_NOISE_BLOCK values, else drawn and added into g's own buffer a
    block of rows at a time, each block drawn after the last one is added
    (no full-size noise is held). Keyed by
    ``seed`` (an int, a pair of ints, an int tensor of either shape, or a
    pair of an int and an int tensor or variable, e.g. a step counter beside
    a seed): the same noise at each call with that seed. Unseeded, by a key drawn at each call of the function (a stateful
    op, which tf.random.set_seed makes reproducible): no noise is a
    constant of the trace."""
    if seed is None:
        seed1, seed2 = random_seed.get_seed(None)
        base = gen_random_ops.random_uniform_int(
            _norm_rules._const([2], dtypes.int32),
            _norm_rules._const(-(1 << 63), dtypes.int64),
            _norm_rules._const((1 << 63) - 1, dtypes.int64),
            seed=seed1 or 0, seed2=seed2 or 0)
    elif isinstance(seed, (int, np.integer)):
        base = _norm_rules._const([0, int(seed)], dtypes.int64)
    elif isinstance(seed, (tuple, list)) and all(
            isinstance(x, (int, np.integer)) for x in seed):
        base = _norm_rules._const([int(x) for x in seed], dtypes.int64)
    elif isinstance(seed, (tuple, list)):    # e.g. (seed, a step variable)
        base = array_ops_stack.stack([math_ops.cast(ops.convert_to_tensor(x),
                                              dtypes.int64) for x in seed])
    else:
        base = math_ops.cast(ops.convert_to_tensor(seed), dtypes.int64)
        if base.shape.rank == 0:
            base = _seed_pair(base)
    if base.shape.rank != 1 or base.shape[0] not in (2, None):
        raise ValueError(f"dp_gradient: `seed` must be an int or a pair of "
                         f"ints (or such a tensor), got {seed!r}")

    def key(first, second):
        # the small sources' vector of dtype j: (0, j); block b of source
        # k: (1 + k, b)
        if not first and not second:
            return base
        return _norm_rules._ex("AddV2", base, _norm_rules._const(
            [first, second], dtypes.int64))

    stddevs = {}
    in_xla = control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())

    def normal(shape, seed, dtype):
        drawn = _DRAWN_AS.get(dtype, dtype)
        if drawn not in stddevs:
            stddevs[drawn] = _norm_rules._ex(
                "RealDiv", _norm_rules._const(scale, drawn),
                math_ops.cast(count, drawn))
        return _traced_normal(tensor_shape.TensorShape(shape), seed,
                              stddevs[drawn], dtype, in_xla)

    wanted = set(ks)
    shapes = {k: tensor_shape.TensorShape(s.shape) for k, s in enumerate(flat_raw)}
    by_dtype = {}
    for k, s in enumerate(flat_raw):
        n = shapes[k].num_elements()
        if n is not None and n <= _NOISE_CHUNK:
            by_dtype.setdefault(dtypes.as_dtype(s.dtype).base_dtype, []).append(k)
    small = {}
    for j, (dtype, members) in enumerate(sorted(by_dtype.items(),
                                               key=lambda kv: kv[1][0])):
        if not wanted.intersection(members):
            continue
        sizes = [shapes[k].num_elements() for k in members]
        vector = normal([sum(sizes)], key(0, j), dtype)
        parts = array_ops.split(vector, sizes) if len(sizes) > 1 else [vector]
        for k, part in zip(members, parts):
            if k in wanted:
                small[k] = array_ops.reshape(part, shapes[k])

    def add_noise(k, g):
        shape = shapes[k]
        if isinstance(g, indexed_slices.IndexedSlices):
            # A table's clipped rows (a Gather rule's), scattered into its
            # noise: one pass over the table, where densifying them (a
            # zero fill and a scatter) and then adding the noise took three.
            # A table larger than _NOISE_CHUNK values gets its noise in one
            # draw (the result is a table-sized buffer whichever way).
            # Unseeded, the rows (summed per id) are added into the noise's
            # own buffer (InplaceAdd aliases its input): its key comes from
            # a stateful op, so the noise is this call's alone. With a seed
            # the key may be a constant, and TF's constant folding then
            # makes the noise a constant of the function, which an in-place
            # add would change for every later call: TensorScatterAdd
            # (which writes in place only into a buffer nothing else holds,
            # else copies) for a small table; a large one's rows are
            # densified and noised a block at a time, as a dense gradient
            # (no second table-sized buffer). XLA places its buffers itself.
            fresh = seed is None and not in_xla
            if k in small or fresh or in_xla:
                if k in small:
                    noise = small[k]
                else:
                    noise = normal(shape, key(1 + k, 0), g.dtype)
                if not fresh:
                    return _norm_rules._ex(
                        "TensorScatterAdd", noise, _norm_rules._ex(
                            "ExpandDims", g.indices,
                            _norm_rules._const(-1, dtypes.int32)), g.values)
                rows, at = array_ops.unique(g.indices)
                summed = math_ops.unsorted_segment_sum(
                    g.values, at, array_ops.shape(rows)[0])
                return _norm_rules._ex("InplaceAdd", noise, math_ops.cast(
                    rows, dtypes.int32), summed)
            g = math_ops.unsorted_segment_sum(g.values, g.indices, shape[0])
        if k in small:
            return _norm_rules._ex("AddV2", g, small[k])
        cols = int(shape[-1]) if shape.rank and shape[-1] else 1
        rows = shape.num_elements() // cols
        step = max(1, _TRACED_NOISE_BLOCK // cols)
        if rows <= step:        # one draw (AddV2 reuses g's buffer)
            return _norm_rules._ex("AddV2", g, normal(shape, key(1 + k, 0), g.dtype))
        flat = _norm_rules._ex("Reshape", g, _norm_rules._const(
            (rows, cols), dtypes.int32))
        for b, first in enumerate(range(0, rows, step)):
            last = min(rows, first + step)
            with ops.control_dependencies([flat] if b else []):
                block = normal([last - first, cols], key(1 + k, b), g.dtype)
            if in_xla:      # (XLA places its buffers itself)
                flat = _norm_rules._ex("TensorScatterAdd", flat, _norm_rules._const(
                    [[i] for i in range(first, last)], dtypes.int32), block)
            else:
                # into g's own buffer (InplaceAdd aliases its input: g is
                # the post-pass's own result, which nothing else reads)
                flat = _norm_rules._ex("InplaceAdd", flat, _norm_rules._const(
                    list(range(first, last)), dtypes.int32), block)
        return _norm_rules._ex("Reshape", flat, _norm_rules._const(
            tuple(shape.as_list()), dtypes.int32))
    return add_noise


def _seed_pair(x):
    """[0, x] for a scalar int64 tensor x (an eager seed's layout)."""
    return array_ops.concat([array_ops.zeros([1], dtypes.int64),
                             array_ops.reshape(x, [1])], 0)


def dp_gradient(tape, losses, sources, l2_norm_clip, noise_multiplier=0.0,
                num_microbatches=None, seed=None, divide=True):
    """``divide`` False (a replica's share, _dp_replicas): the clipped sum
    plus noise, not divided by the number of microbatches; a batch of no
    examples (an empty shard) then sums to zeros."""
    tape_state, batch, flat_raw, flat = _start(tape, losses, sources,
                                               "dp_gradient")
    if not l2_norm_clip > 0:
        raise ValueError(f"l2_norm_clip must be positive, got {l2_norm_clip!r}")
    if noise_multiplier < 0:
        raise ValueError(
            f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    if num_microbatches is not None and int(num_microbatches) < 1:
        raise ValueError(
            f"num_microbatches must be at least 1, got {num_microbatches!r}")
    m = batch if num_microbatches is None else int(num_microbatches)
    if batch == 0 and divide:
        raise IndivisibleBatchError(None, None, EMPTY_BATCH)
    if batch and batch % m:
        raise IndivisibleBatchError(
            None, None, f"{_indivisible(m)}; the batch size: {batch}")
    clip = float(l2_norm_clip)
    if not context.executing_eagerly():
        try:
            out = _dp_traced(tape, tape_state, losses, flat, flat_raw, batch,
                             clip, m, float(noise_multiplier), seed, divide)
        finally:
            _end(tape, tape_state)
        return _pack(sources, flat_raw, out)
    count = m if divide else 1
    stddev = clip * float(noise_multiplier) / count
    out = [None] * len(flat)
    rng = _noise_rng(seed) if stddev > 0 else None
    noise = _Noise(flat_raw, stddev, rng) if stddev > 0 else None
    try:
        if batch == 0:
            out, analysis = _empty_sums(tape_state, losses, flat,
                                        flat_raw), None
            spec = (None, None, _vector_noise(out, noise, flat_raw))
        elif m == batch:
            analysis = _analyse("dp_gradient", tape_state, losses, flat,
                                flat_raw, batch, keep_entries=True)
            planned = _fused_plan(analysis, noise)
            if planned is not None:
                fused = planned[:2]
            else:
                fused = _fusable(analysis, batch)
            spec = None
            if fused is not None:
                # the backward pass and the post-pass: one function
                try:
                    spec = _dp_finish(tape_state, losses, flat_raw, analysis,
                                      fused[0], {}, clip, count, noise, out,
                                      fused[1], planned and planned[2])
                except _NotFusable:
                    pass
            analysis.entries = None     # (their tensors: not held longer)
            if spec is None:
                use_grads = {}
                ruled = _ruled_pass("dp_gradient", tape_state, losses, flat,
                                    analysis, use_grads)
                rows = _rows(tape, losses, flat_raw, list(analysis.fallback),
                             uses=analysis.uses, grads=use_grads)
                spec = _dp_finish(tape_state, losses, flat_raw, analysis,
                                  ruled, rows, clip, count, noise, out)
        else:
            # TF Privacy: losses reshaped to [m, B/m] and averaged per
            # microbatch; a microbatch's gradient goes through rows.
            analysis = _analyse("dp_gradient", tape_state, losses, flat,
                                flat_raw, batch, use_rules=False)
            rows = _rows(tape, losses, flat_raw, list(analysis.fallback),
                         _microbatch_basis(losses, m, batch))
            spec = _dp_finish(tape_state, losses, flat_raw, analysis, {}, rows,
                              clip, count, noise, out)
        if analysis is not None:
            _note_fallback("dp_gradient", tape, flat_raw, analysis)
    finally:
        _end(tape, tape_state)
    noised = {k for k, _, _ in spec[2]} if stddev > 0 else ()
    if noise is not None:
        noise.wait()    # (the vector comes first from rng)
    for k, g in enumerate(out):
        if g is None or k in noised or not stddev > 0:
            continue
        shape = flat_raw[k].shape
        if g.dtype in _NUMPY_NOISE and g.shape.num_elements() > _NOISE_CHUNK:
            g = _add_noise_in_place(g, stddev, rng)
        else:
            g = _ex("AddV2", g, _noise(g.dtype, shape, seed, k, stddev, rng))
        out[k] = g
    return _pack(sources, flat_raw, out)


class _Groups:
    """Ops whose rows are not the examples one to one, but whose layout
    the analysis proves (see _row_groups): ``accepted`` (ids of entries
    _row_ops.keeps_axis0 would refuse), ``blocks`` (id of a convolution's entry ->
    its number of space-to-batch blocks), ``separable`` (ids of training
    batch norms whose statistics never mix two examples), ``apart`` (ids
    of the reshapes around such a batch norm while the batch is unknown:
    they keep the examples apart, the rules unproved)."""

    def __init__(self):
        self.accepted = set()
        self.blocks = {}
        self.separable = set()
        self.apart = set()      # (ids of reshapes that keep the examples apart)


_CONVS = frozenset({"Conv2D", "DepthwiseConv2dNative", "Conv3D"})
_ROW_WISE_RESHAPES = frozenset({"ExpandDims", "Squeeze"})


def _config(payload, i):
    inputs = getattr(payload, "inputs", None) or ()
    t = inputs[i] if i < len(inputs) else None
    # while tracing, a constant's value, else None (the analysis declines)
    return None if t is None else _value(t)


def _row_groups(entries, shapes, consumers, batch):
    """The layouts the analysis accepts beyond _row_ops.keeps_axis0's:

    - a dilated convolution as TF runs it: SpaceToBatchND (or an input off
      the path), ExpandDims/Squeeze, Conv2D or DepthwiseConv2dNative,
      ExpandDims/Squeeze, BatchToSpaceND, each tensor with one consumer:
      row r of the convolution is example r % B (_norm_rules.BLOCKS_ATTR);
    - a training batch norm (NCHW) over [1, C, ...] reshaped from [B, ...]
      and reshaped back, as tf_keras' LayerNormalization runs (the batch
      folded into the channels): each channel's statistics lie within one
      example when an example's size is a multiple of a channel's."""
    groups = _Groups()
    if batch is not None and batch < 2:
        return groups
    producer = {}
    for entry in entries:
        for o in entry.output_ids:
            producer[o] = entry

    def only_use(tid):
        users = consumers.get(tid, ())
        return users[0] if len(users) == 1 else None

    def back(tid):
        """The producer of tid through row-wise reshapes (each tensor used
        once), or None if tid is off the path."""
        entry = producer.get(tid)
        while entry is not None and entry.op_type in _ROW_WISE_RESHAPES:
            if only_use(entry.output_ids[0]) is None:
                return False
            # (a new leading axis of size 1 before the convolution, or
            # after it before BatchToSpaceND, fails the checks on the
            # convolution's leading axis, nb B, or TF's own)
            if entry.op_type == "ExpandDims" and _config(entry.payload, 1) == 0:
                return False
            entry = producer.get(entry.input_ids[0])
        return entry

    for entry in entries:
        if entry.op_type == "BatchToSpaceND":
            # (a batch unknown while tracing: rows, the blocks keep the
            # examples apart; the rules go unproved)
            block = _config(entry.payload, 1)
            if not block or only_use(entry.input_ids[0]) is None:
                continue
            nb = int(np.prod(block))
            conv = back(entry.input_ids[0])
            if (not conv or conv.op_type not in _CONVS
                    or only_use(conv.output_ids[0]) is None):
                continue
            x = conv.payload.inputs[0]
            if x is None or (batch is not None and x.shape[0] != nb * batch):
                continue
            s2b = back(conv.input_ids[0])
            if s2b is False or (s2b is not None and not (
                    s2b.op_type == "SpaceToBatchND"
                    and _config(s2b.payload, 1) == block
                    and only_use(s2b.output_ids[0]) is not None)):
                continue
            if batch is None:
                groups.apart.add(id(entry))
                if s2b is not None:
                    groups.apart.add(id(s2b))
                continue
            groups.accepted.add(id(entry))
            if s2b is not None:
                groups.accepted.add(id(s2b))
            groups.blocks[id(conv)] = nb
        elif (entry.op_type in _BATCH_NORMS
              and _norm_rules.attr(entry.payload, "is_training")
              and _norm_rules._decoded(entry.payload, "data_format") == "NCHW"):  # pylint: disable=protected-access
            into = producer.get(entry.input_ids[0])
            x = entry.payload.inputs[0]
            if (into is None or into.op_type != "Reshape" or x is None
                    or only_use(entry.input_ids[0]) is None):
                continue
            shape = tuple(x.shape.as_list())
            source = shapes.get(into.input_ids[0])
            if source is None and into.payload.inputs[0] is not None:
                source = tuple(into.payload.inputs[0].shape.as_list())
            if (not source or source[0] != batch or len(shape) < 2
                    or shape[0] != 1 or None in shape[2:]):
                continue
            # An example's values are one contiguous block, a channel's
            # too: each channel within one example when a channel's size
            # divides an example's; so when it divides the product of the
            # example's known axes (while tracing, a sequence length or a
            # batch unknown only multiplies it).
            channel = int(np.prod(shape[2:]))       # one channel's
            known = int(np.prod([d for d in source[1:] if d is not None]))
            if known % channel or (None not in shape and None not in source and
                                   known * batch != int(np.prod(shape))):
                continue
            # its statistics mix no examples, whatever reads them
            groups.separable.add(id(entry))
            users = [consumers.get(o, ()) for o in entry.output_ids]
            out = users[0][0] if len(users[0]) == 1 else None
            if any(users[1:]) or out is None or out.op_type != "Reshape":
                continue
            back_to = _output_shape(out, shapes)
            if batch is None and back_to and tuple(back_to[1:]) == tuple(
                    source[1:]) and None not in source[1:]:
                # (an example's values back in one row each, the batch
                # unknown while tracing: rows, the examples kept apart)
                groups.apart.update((id(into), id(out)))
            if (batch is None
                    or _leading(shapes.get(out.output_ids[0]) or ()) != batch):
                continue    # (the reshapes unproved: rows, by _row_ops)
            groups.accepted.update((id(into), id(out)))
    return groups


_TRACKED = frozenset({"Transpose", "Unpack", "Pack", "StridedSlice", "Split",
                      "SplitV", "Tile", "ReverseV2"})


def _track_batch_axis(entries, shapes, batch, alias, consumers, seen=None,
                      trail=None, time_major=False):
    """Where a recurrent layer runs time-major (Keras' RNNs: Transpose to
    [T, B, ...], Unpack over time, a step's Split of its gates along the
    features, Pack of the outputs and a StridedSlice of the last), the
    batch axis is followed through these ops (_op_axis): (ids of the
    entries whose move is followed (theirs, kept on axis 0 too), {tensor
    id: its batch axis}), or (empty, None) where it is lost (a reduction,
    unpack or slice along it, an op not known to keep the examples apart
    on a tensor whose batch is not on axis 0, a result whose batch is not
    on axis 0). Inputs off the path hold the batch where
    _row_ops.off_path_axis puts it (``time_major`` as there). ``seen``: a
    dict to fill with the axes (those followed before the batch is lost
    too). ``trail``: a dict to fill with "followed" (the entries followed,
    before the batch is lost too), "apart" (other entries whose batch
    axis is not 0 that keep the examples apart: _row_ops.batch_axis) and
    "lost" (the entry at which it is lost, or None). With the batch
    unknown while tracing, the walk fills ``seen``
    and ``trail`` only (a leading axis unknown is taken for the batch's):
    every source takes rows then."""
    axes = {} if seen is None else seen
    followed = set() if trail is None else trail.setdefault("followed", set())
    # (ops on a batch off axis 0 that keep the examples apart, not followed:
    # _row_ops.keeps_axis0 still decides whether they are movers)
    apart = set() if trail is None else trail.setdefault("apart", set())
    loops = {}      # id of a While's entry -> its plans (_loop_proof)
    none = (set(), None, {})
    if batch is None and trail is None:
        return none     # (unknown while tracing: every source takes rows)

    unproved = []       # loops whose layout _loop_proof could not prove

    def lose(entry):
        if trail is not None:
            trail["lost"] = entry
        return none

    def axis_of(tid, t=None):
        if tid in axes:
            return axes[tid]
        if tid in alias:
            return -1                   # a source: no batch
        shape = shapes.get(tid)
        if shape is None and t is not None and t.dtype != dtypes.resource:
            shape = tuple(t.shape.as_list())
        # (a leading axis unknown while tracing, or B*T: the batch's, as
        # _row_ops takes it; -1 would let a Transpose of it pass as a
        # weight's)
        return _row_ops.off_path_axis(shape, batch, time_major)

    produced = {o for entry in entries for o in entry.output_ids}
    lists = set()       # TensorLists: their axis is the batch's once stacked
    for entry in entries:
        payload = entry.payload
        inputs = getattr(payload, "inputs", None) or ()
        ins = [axis_of(tid, inputs[i] if i < len(inputs) else None)
               for i, tid in enumerate(entry.input_ids)]
        op = entry.op_type
        if op in _LOOPS:
            proof = _loop_proof(entry, [
                None if tid not in produced and tid not in alias and a <= 0
                else a for tid, a in zip(entry.input_ids, ins)], batch)
            if proof is None:
                if trail is None:
                    return none
                # (its body checked op by op, the batch leading there:
                # _check_bodies; each output laid out as its input, a list
                # of time steps, each leading with the batch)
                if any(a > 0 and (t is None or t.dtype != dtypes.variant)
                       for a, t in zip(ins, entry.payload.inputs)):
                    return lose(entry)      # (a carry off axis 0)
                unproved.append(entry)
                for o, a, t in zip(entry.output_ids, ins, entry.payload.inputs):
                    variant = t is not None and t.dtype == dtypes.variant
                    axes[o] = 1 if variant else a
                    if variant:
                        lists.add(o)
                continue
            followed.add(id(entry))
            loops[id(entry)] = proof[2]
            for o, a, is_list in zip(entry.output_ids, *proof[:2]):
                axes[o] = a
                if is_list:
                    lists.add(o)
            continue
        if op in _LIST_OPS:
            # (an index or element shape off the path holds no batch,
            # whatever its length)
            out = _list_axis(op, [
                -1 if i and tid not in produced and i < len(inputs)
                and inputs[i] is not None and inputs[i].dtype.is_integer else a
                for i, (tid, a) in enumerate(zip(entry.input_ids, ins))],
                batch, entry)
            if out is None:
                return lose(entry)
            followed.add(id(entry))
            for o in entry.output_ids:
                axes[o] = out
                if op != "TensorListStack" and op != "TensorListGetItem":
                    lists.add(o)
            continue
        if op in _row_ops.SEGMENTS:
            # (segment ids off the path: no rows, whatever their length)
            ins = ins[:1] + [
                -1 if tid not in produced and i + 1 < len(inputs)
                and inputs[i + 1] is not None and inputs[i + 1].dtype.is_integer
                else a for i, (tid, a) in enumerate(zip(entry.input_ids[1:], ins[1:]))]
        if op not in _TRACKED and max(ins, default=-1) < 0:
            # (no input with the batch: a Reshape of rows folded with time
            # to [B, ...], taken to lead with it as inputs off the path)
            # (a scalar holds no batch, known or not)
            shape = shapes.get(entry.output_ids[0]) if entry.output_ids else ()
            out = 0 if shape != () and _leading(shape or ()) == batch else -1
        else:
            out = _op_axis(entry, shapes, batch, ins, path=True)
            if out is None:
                return lose(entry)
            if op in _TRACKED:
                followed.add(id(entry))
            elif max(ins) > 0 and op not in _row_ops.ELEMENTWISE:
                apart.add(id(entry))
        for o in entry.output_ids:
            axes[o] = out
    for entry in entries:
        for o in entry.output_ids:
            if o not in consumers and o not in lists and axes.get(o, 0) > 0:
                return lose(entry)
    if batch is None or unproved:
        return none
    return followed, axes, loops


_LOOPS = frozenset({"While", "StatelessWhile"})
_LIST_OPS = frozenset({"TensorListFromTensor", "TensorListStack",
                       "TensorListGetItem", "TensorListSetItem"})
# a TensorList off the path: its elements taken to lead with the batch
_OFF = object()


def _list_axis(op, ins, batch, entry):
    """The batch axis after a TensorList op (a list's: its axis once
    stacked), given its inputs' (a list's alike; _OFF: a list off the
    path); None where it may move rows (a tensor unstacked along its batch,
    a list of another layout written)."""
    if any(a is not _OFF and a is not None and a >= 0 for a in ins[1:2]) and (
            op != "TensorListFromTensor"):
        return None     # an index or element shape that holds the batch
    first = ins[0] if ins else -1
    if op == "TensorListFromTensor":
        return None if first == 0 else first
    if op == "TensorListStack":
        return -1 if first is _OFF else first
    if op == "TensorListGetItem":
        if first is _OFF:
            out = _meta_shape(entry.output_meta[0]) if entry.output_meta else None
            return 0 if out and out[0] == batch else -1
        return first - 1 if first > 0 else -1
    # TensorListSetItem: the list takes its elements' layout
    item = ins[2] if len(ins) > 2 else -1
    if item is _OFF or item is None:
        return None
    if item < 0:
        return -1 if first in (-1, _OFF) else None
    return item + 1 if first in (-1, _OFF, item + 1) else None


class _BodyEntry:
    """A body op of a traced loop, as the analysis reads a recorded one."""

    __slots__ = ("op_type", "input_ids", "output_ids", "output_meta",
                 "payload", "op")

    def __init__(self, op):
        self.op = op
        self.op_type = op.type
        self.input_ids = [t._id for t in op.inputs]  # pylint: disable=protected-access
        self.output_ids = [t._id for t in op.outputs]  # pylint: disable=protected-access
        self.output_meta = tuple(
            (tuple(t.shape.as_list()), t.dtype) if t.shape.rank is not None
            else None for t in op.outputs)
        attrs = []
        for name in sorted(op.node_def.attr):
            attrs += [name, op.get_attr(name)]
        self.payload = EagerOp(tuple(attrs), tuple(op.inputs) + tuple(op.outputs),
                               len(op.inputs))


def _loop_op(payload):
    """The tf.Operation of a recorded loop (_GraphEntry's payload)."""
    outputs = getattr(payload, "outputs", None) or ()
    return outputs[0].op if outputs and outputs[0] is not None else None


def _loop_proof(entry, ins, batch):
    """A traced While's layout, from its body: (the batch axis of each
    output, whether it is a TensorList, {input i: (shape, dtype, {id(op):
    "weight" or "meet"})} for each resource it reads: the body ops that
    give its per-example gradient, see _while_grads); None where the body
    may move rows across the batch axis, or reads a variable otherwise.
    ``ins``: its inputs' axes (None: off the path, taken to lead with the
    batch; a TensorList's elements too)."""
    op = _loop_op(entry.payload)
    body = getattr(op, "_body_graph", None)
    if body is None or len(body.inputs) < len(ins):
        return None     # (a batch unknown while tracing: the layout only)
    n = len(entry.output_ids)
    outs = body.outputs[:n]
    # the ops the loop's outputs read (not the accumulators of a gradient
    # built before)
    need, stack = set(), [t.op for t in outs]
    while stack:
        o = stack.pop()
        if id(o) not in need:
            need.add(id(o))
            stack.extend(t.op for t in o.inputs)
            stack.extend(o.control_inputs)
    entries = [_BodyEntry(o) for o in body.get_operations() if id(o) in need]
    start = []
    for a, t in zip(ins, body.inputs):
        if a is None:
            a = _OFF if t.dtype == dtypes.variant else (
                0 if t.shape.rank and t.shape[0] == batch else -1)
        start.append(a)
    for _ in range(3):
        got = _body_axes(entries, body, start, batch)
        if got is None:
            return None
        axes, plans = got
        out = [_known(axes.get(t._id, -1)) for t in outs]  # pylint: disable=protected-access
        if out == [_known(b) for b in start]:
            break
        # a list the loop fills (from a TensorListReserve): its layout
        for i, (a, b) in enumerate(zip(out, start)):
            if a != _known(b):
                if outs[i].dtype != dtypes.variant or _known(b) != -1 or a < 1:
                    return None
                start[i] = a
    else:
        return None
    for i, t in enumerate(outs):
        if t._id in plans.get("values", ()) and not (  # pylint: disable=protected-access
                t is body.inputs[i]):
            return None     # a variable's value out of the loop
    plans.pop("values", None)
    return out, [t.dtype == dtypes.variant for t in outs], plans


def _known(axis):
    return -1 if axis is _OFF else axis


def _body_axes(entries, body, start, batch):
    """({tensor id: batch axis}, plans) over a loop body's ops from its
    inputs' axes ``start``; None where an op may move rows (see
    _loop_proof)."""
    axes, weight = {}, {}     # weight: tensor id -> the resource input's index
    plans = {}
    for i, (a, t) in enumerate(zip(start, body.inputs)):
        axes[t._id] = a  # pylint: disable=protected-access
        if t.dtype == dtypes.resource:
            weight[t._id] = i  # pylint: disable=protected-access
    values = set()
    for entry in entries:
        op, kind = entry.op, entry.op_type
        if kind == "Placeholder":
            continue        # an input: its axis is start's
        ins = [axes.get(tid, -1) for tid in entry.input_ids]
        owners = {weight[tid] for tid in entry.input_ids if tid in weight}
        if owners:
            if len(owners) > 1:
                return None
            i = owners.pop()
            at = [p for p, tid in enumerate(entry.input_ids) if tid in weight]
            others = [a for p, a in enumerate(ins) if p not in at]
            if (kind in _while_grads.WEIGHT_OPS and at == [1 if kind == "Split" else 0]
                    and not any(a is _OFF or a >= 0 for a in others)
                    and _while_grads.weight_op_proven(op)):
                if kind == "ReadVariableOp":
                    shape = tuple(op.outputs[0].shape.as_list()) if (
                        op.outputs[0].shape.rank is not None) else None
                    if shape is None or None in shape or (
                            i in plans and plans[i][0] != shape):
                        return None
                    plans.setdefault(i, (shape, op.outputs[0].dtype, {}))
                elif i not in plans:
                    return None
                plans[i][2][id(op)] = "weight"
                for tid in entry.output_ids:
                    weight[tid] = i
                    values.add(tid)
                    axes[tid] = -1
                continue
            if not (kind in _while_grads.MEETS and at == [1] and ins[0] == 0
                    and i in plans and _meets(op, batch is not None)):
                return None
            plans[i][2][id(op)] = "meet"
            axes[entry.output_ids[0]] = 0
            continue
        if any(a is _OFF for a in ins) and kind not in _LIST_OPS:
            return None
        batched = {a for a in ins if a is not _OFF and a >= 0}
        if kind in _LIST_OPS:
            out = _list_axis(kind, ins, batch, entry)
        elif not batched:
            out = -1
        elif kind == "MatMul":
            out = 0 if (ins == [0, -1] and not op.get_attr("transpose_a")) else None
        elif kind == "BiasAdd":
            out = 0 if ins == [0, -1] and _nhwc(op) else None
        elif kind in _row_ops.ELEMENTWISE:
            rank = op.outputs[0].shape.rank
            out = batched.pop() if len(batched) == 1 and all(
                t.shape.rank == rank for t, a in zip(op.inputs, ins) if a >= 0) else None
        elif kind in _TRACKED:
            data = ins[1] if kind == "Split" else ins[0]
            if kind == "Pack" and len(set(ins)) > 1:
                return None
            out = _moved_axis(entry, {}, data, batch) if data >= 0 else None
        else:
            out = None
        if out is None:
            return None
        for tid in entry.output_ids:
            axes[tid] = out
    for i in [i for i in plans if not plans[i][2]]:
        del plans[i]
    plans["values"] = values
    return axes, plans


def _nhwc(op):
    fmt = op.get_attr("data_format") if "data_format" in op.node_def.attr else b"NHWC"
    return fmt in (b"NHWC", "NHWC")


def _meets(op, exact=True):
    """Whether a MatMul, BiasAdd or Add of the batch (input 0, axis 0) and
    a weight (input 1) is one _while_grads gives per-example terms of
    (``exact``: its shapes known; else, with the batch unknown while
    tracing, whether it keeps the examples apart)."""
    x, w = op.inputs[0], op.inputs[1]
    if not exact:
        x_shape, out = x.shape[1:], op.outputs[0].shape[1:]
    else:
        x_shape, out = x.shape, op.outputs[0].shape
    if not (x_shape.is_fully_defined() and out.is_fully_defined()):
        return False
    if op.type == "MatMul":
        return x.shape.rank == 2 and w.shape.rank == 2 and not op.get_attr("transpose_a")
    if op.type == "BiasAdd":
        return _nhwc(op)
    out = op.outputs[0].shape
    if (w.shape.rank is None or out.rank is None or x.shape.rank != out.rank
            or w.shape.rank >= out.rank or not w.shape.is_fully_defined()):
        return False
    return (x.shape.as_list() == out.as_list()
            and out.as_list()[out.rank - w.shape.rank:] == w.shape.as_list())


def _config_axis(entry, shapes):
    """The axis of a Pack, Unpack, Split or SplitV, made non-negative where
    the rank is known; None where it is not known."""
    op = entry.op_type
    payload = entry.payload
    if op in ("Pack", "Unpack"):
        axis = _norm_rules.attr(payload, "axis", 0)
    else:
        axis = _config(payload, 0 if op == "Split" else 2)
    if not isinstance(axis, int):
        return None
    if axis >= 0:
        return axis
    data = entry.input_ids[1 if op == "Split" else 0] if entry.input_ids else None
    inputs = getattr(payload, "inputs", None) or ()
    t = inputs[1 if op == "Split" else 0] if len(inputs) > (1 if op == "Split" else 0) else None
    shape = shapes.get(data)
    if shape is None and t is not None:
        shape = tuple(t.shape.as_list())
    if shape is None and op in ("Split", "SplitV"):
        # a split keeps the rank: any piece's
        shape = next((shapes[o] for o in entry.output_ids if o in shapes), None)
    if shape is None:
        return None
    return axis + len(shape) + (1 if op == "Pack" else 0)


def _moved_axis(entry, shapes, axis, batch):
    """The batch axis after a _TRACKED op, given it at ``axis`` of the
    data input; None where the op may move rows across it."""
    op = entry.op_type
    payload = entry.payload
    if op == "Transpose":
        perm = _config(payload, 1)
        return perm.index(axis) if perm and axis in perm else None
    if op in ("Tile", "ReverseV2"):
        # (a mask tiled over the features; a sequence reversed in time)
        config = _config(payload, 1)
        t = payload.inputs[0] if payload.inputs else None
        rank = t.shape.rank if t is not None else None
        if rank is None and entry.input_ids and shapes.get(entry.input_ids[0]) is not None:
            # (ReverseV2's gradient reads no input: the analysis' shape)
            rank = len(shapes[entry.input_ids[0]])
        if op == "Tile" and config is None:
            # (multiples computed while tracing: UpSampling's repeat) its
            # output as long as its input along the batch axis, each
            # at least one, means one multiple there: rows kept apart
            ins = shapes.get(entry.input_ids[0]) if entry.input_ids else None
            if ins is None and t is not None and t.shape.rank is not None:
                ins = tuple(t.shape.as_list())
            out = shapes.get(entry.output_ids[0]) if entry.output_ids else None
            if (ins is None or out is None or len(ins) != len(out) or axis >= len(ins)
                    or ins[axis] is None or ins[axis] < 1 or out[axis] != ins[axis]):
                return None
            return axis
        if config is None or rank is None:
            return None
        if op == "Tile":
            return axis if len(config) == rank and config[axis] == 1 else None
        return None if axis in {int(a) % rank for a in nest.flatten(config)} else axis
    if op in ("Unpack", "Split", "SplitV", "Pack"):
        a = _config_axis(entry, shapes)
        if a is None or (a == axis and op != "Pack"):
            return None
        if op == "Unpack":
            return axis - (a < axis)
        if op == "Pack":
            return axis + (a <= axis)
        return axis
    # StridedSlice: the batch axis whole, other axes sliced or shrunk
    spec = _slice_spec(payload)
    if spec is None:
        return None
    begin, end, strides, mask = spec
    if mask["ellipsis"]:
        return None
    shrink = mask["shrink_axis"]
    # each entry of the spec: a new axis, or the next input axis (shrunk,
    # or kept in the output)
    at_in = at_out = 0
    for j in range(len(begin)):
        if (mask["new_axis"] >> j) & 1:
            at_out += 1
            continue
        if at_in == axis:
            if (shrink >> j) & 1 or strides[j] != 1:
                return None
            if not ((mask["begin"] >> j) & 1 or begin[j] == 0):
                return None
            if not ((mask["end"] >> j) & 1 or (
                    batch is not None and end[j] >= batch)):
                return None
            return at_out
        at_out += 0 if (shrink >> j) & 1 else 1
        at_in += 1
    return at_out + axis - at_in


def _slice_spec(payload):
    """A StridedSlice's begin, end and strides (lists) and its masks
    ({"begin", "end", "ellipsis", "new_axis", "shrink_axis"}: ints); None
    where a bound is not a constant (fed at run time)."""
    bounds = [_config(payload, i) for i in (1, 2, 3)]
    if any(b is None for b in bounds):
        return None
    begin, end, strides = (np.asarray(b).reshape(-1).tolist() for b in bounds)
    mask = {name: int(_norm_rules.attr(payload, name + "_mask", 0) or 0)
            for name in ("begin", "end", "ellipsis", "new_axis", "shrink_axis")}
    return begin, end, strides, mask


_CHAIN = frozenset({"Mul", "Add", "AddV2", "Sub", "Neg", "Identity"})
_CHAIN_RESHAPES = frozenset({"Squeeze", "Reshape", "ExpandDims", "Identity"})
_MAX_USES = 1 << 14


def _uses(used, axes, batch, shapes, consumers, depth=0, budget=None,
          loops=None, rows=None):
    """For a source read by several ops that each have a rule (a recurrent
    layer's kernel, recurrent kernel and bias, read once a time step), or
    through a chain of elementwise ops on tensors of its own shape that
    hold no batch (Keras' BatchNormalization in inference: gamma times
    rsqrt(variance + eps), read by x * inv and mean * inv): the tree of
    its uses, each ("rule", payload, pos, rule, output id) or ("chain",
    payload, pos, op type, in shape, its output's uses), or, for a
    variable a traced loop reads (a Keras 3 RNN's While: ``loops``, see
    _loop_proof), ("while", payload, pos, its plan, the loop's output
    ids); None where a use is none of these, or its batch is not on axis
    0, or its rows fold time, or are no examples' (not in ``rows``: see
    _row_ops.carries_rows)."""
    budget = budget if budget is not None else [_MAX_USES]
    out = []
    for entry, pos in used:
        budget[0] -= 1
        if budget[0] < 0 or depth > 8:
            return None
        o = entry.output_ids[0] if entry.output_ids else None
        if entry.op_type in _LOOPS:
            plan = (loops or {}).get(id(entry), {}).get(pos)
            if plan is None or len(used) > 1:
                return None
            out.append(("while", entry.payload, pos, plan, tuple(entry.output_ids)))
            continue
        if axes is not None and any(
                axes.get(t, 0) > 0 for t in entry.input_ids + entry.output_ids[:1]):
            return None
        link = _chains(entry, pos, shapes)
        if link is not None:
            # an elementwise op whose output has the shape of the source's
            # values: each example's gradient of its input is the op's
            # VJP of its output's (the sum of the rules of its uses),
            # whatever the other operand (the op is linear in this one)
            chain = _chain_item(entry, pos, link, axes, batch, shapes, consumers,
                                depth, budget, rows)
            if chain is None:
                return None
            out.append(chain)
            continue
        rule = _norm_rules.candidate(entry.op_type, entry.payload)
        if rule is None or (rows is not None and o not in rows):
            return None
        if entry.op_type == "MatMul":
            a = entry.payload.inputs[0]
            if a is None or a.shape.rank != 2 or a.shape[0] != batch:
                return None
        out.append(("rule", entry.payload, pos, rule, o))
    return out


def _in_shape(entry, pos, shapes):
    inputs = getattr(entry.payload, "inputs", None) or ()
    shape = shapes.get(entry.input_ids[pos])
    if shape is None and pos < len(inputs) and inputs[pos] is not None:
        shape = tuple(inputs[pos].shape.as_list())
    return shape


def _out_shapes(entry, pos, shapes, in_shape):
    """The output shapes of a link of a chain (_uses) whose input ``pos``
    has shape in_shape, and the link's op as its spec keeps it (a
    StridedSlice's with its pads: (op type, _slice_pads)); None where it
    is not one: an elementwise op of _CHAIN whose output has that input's
    shape (the other operand broadcast into it); a reshape; a Split into
    equal pieces; a plain range of a StridedSlice."""
    op = entry.op_type
    if type(entry.payload) is not EagerOp:
        return None
    if op == "Split":
        axis, n = _config(entry.payload, 0), len(entry.output_ids)
        if pos != 1 or not isinstance(axis, int) or not n:
            return None
        axis %= len(in_shape)
        if in_shape[axis] % n:
            return None
        return [tuple(d // n if a == axis else d for a, d in enumerate(in_shape))] * n, op
    if len(entry.output_ids) != 1:
        return None
    out = _output_shape(entry, shapes)
    if op == "StridedSlice":
        pads = _slice_pads(entry, in_shape) if pos == 0 else None
        if pads is None:
            return None
        sliced = tuple(d - p0 - p1 for d, (p0, p1) in zip(in_shape, pads))
        return ([sliced], (op, pads)) if out is None or tuple(out) == sliced else None
    if op == "Squeeze" and out is None:
        dims = _norm_rules.attr(entry.payload, "squeeze_dims") or []
        dims = {d % len(in_shape) for d in dims}
        out = tuple(d for a, d in enumerate(in_shape)
                    if not (d == 1 and (not dims or a in dims)))
    if out is None or None in out:
        return None
    out = tuple(out)
    if op in _CHAIN_RESHAPES:
        return ([out], op) if pos == 0 and np.prod(out) == np.prod(in_shape) else None
    if op not in _CHAIN or out != tuple(in_shape):
        return None
    if len(entry.input_ids) == 2:
        if entry.input_ids[0] == entry.input_ids[1]:
            return None
        other = _in_shape(entry, 1 - pos, shapes)
        if other is None or len(other) > len(in_shape) or any(
                d not in (1, e) for d, e in zip(reversed(other), reversed(in_shape))):
            return None
    return [out], op


def _slice_pads(entry, in_shape):
    """A StridedSlice's [(before, after)] per axis of its input (of shape
    in_shape): the zeros its input's gradient pads its output's with;
    None unless it is a plain range (constant bounds, strides 1, no
    ellipsis, new or shrunk axis): GRU(reset_after=False)'s slices of its
    recurrent kernel."""
    spec = _slice_spec(entry.payload)
    if spec is None:
        return None
    begin, end, strides, mask = spec
    if (mask["ellipsis"] or mask["new_axis"] or mask["shrink_axis"]
            or not len(begin) == len(end) == len(strides) <= len(in_shape)
            or any(st != 1 for st in strides)):
        return None
    pads = []
    for a, dim in enumerate(in_shape):
        if a >= len(begin):
            pads.append((0, 0))
            continue
        lo = 0 if (mask["begin"] >> a) & 1 else begin[a] + (dim if begin[a] < 0 else 0)
        hi = dim if (mask["end"] >> a) & 1 else end[a] + (dim if end[a] < 0 else 0)
        lo, hi = min(max(lo, 0), dim), min(max(hi, 0), dim)
        if hi <= lo:
            return None
        pads.append((lo, dim - hi))
    return tuple(pads)


def _chains(entry, pos, shapes):
    """Where input ``pos`` of ``entry`` goes through it as a link of a
    chain (_uses): (its input's shape, _out_shapes' outputs and op);
    else None."""
    in_shape = _in_shape(entry, pos, shapes)
    if not in_shape or None in in_shape:
        return None
    link = _out_shapes(entry, pos, shapes, tuple(in_shape))
    return None if link is None else (tuple(in_shape),) + tuple(link)


def _chain_item(entry, pos, link, axes, batch, shapes, consumers, depth,
                budget, rows=None):
    payload = entry.payload
    inputs = getattr(payload, "inputs", None) or ()
    if entry.op_type == "Mul" and (
            len(inputs) != 2 or inputs[1 - pos] is None
            or inputs[1 - pos].dtype == dtypes.resource):
        return None
    in_shape, out_shapes, op = link
    outs = []
    for o, shape in zip(entry.output_ids, out_shapes):
        used = [(u, p) for u in consumers.get(o, ())
                for p, i in enumerate(u.input_ids) if i == o]
        children = _uses(used, axes, batch, shapes, consumers, depth + 1,
                         budget, rows=rows) if used else ()
        if children is None:
            return None
        outs.append((shape, tuple(children)))
    if not any(children for _, children in outs):
        return None
    # (a StridedSlice's pads in the spec: its bounds are fed)
    return ("chain", payload, pos, op, in_shape, tuple(outs))


def _uses_layout(node, at):
    """A _uses tree with each payload as its position among the entries,
    or None if one is not theirs."""
    out = []
    for item in node:
        j = at.get(id(item[1]))
        if j is None or item[0] == "while":     # (a loop: traced, not kept)
            return None
        if item[0] == "rule":
            out.append(("rule", j, item[2], item[3]))
            continue
        outs = []
        for shape, children in item[5]:
            children = _uses_layout(children, at)
            if children is None:
                return None
            outs.append((shape, children))
        out.append(("chain", j) + tuple(item[2:5]) + (tuple(outs),))
    return tuple(out)


def _uses_rebound(node, entries):
    out = []
    for item in node:
        entry = entries[item[1]]
        if item[0] == "rule":
            out.append(("rule", entry.payload, item[2], item[3], entry.output_ids[0]))
        else:
            out.append(("chain", entry.payload) + tuple(item[2:5]) + (tuple(
                (shape, _uses_rebound(children, entries))
                for shape, children in item[5]),))
    return out


def _stacked_matmuls(terms):
    """sum_t a_t^T g_t per example, from MatMul uses [(payload, g)] sharing
    their attrs: one product of the time steps stacked, [B, T, K] and
    [B, T, N]."""
    a = array_ops_stack.stack([p.inputs[0] for p, _ in terms], axis=1)
    g = array_ops_stack.stack([g for _, g in terms], axis=1)
    if _norm_rules.attr(terms[0][0], "transpose_b"):
        return math_ops.matmul(g, a, transpose_a=True)
    return math_ops.matmul(a, g, transpose_a=True)


class _Declined(Exception):
    """A rule of a use declines its output gradient: the source takes rows."""


def _leaves(node):
    """The output ids whose gradients a use's rules read (a loop's are
    taken by its own pass: none)."""
    for item in node:
        if item[0] == "rule":
            yield item[4]
        elif item[0] != "while":
            for _, children in item[5]:
                yield from _leaves(children)


def _chain_vjp(payload, pos, op, in_shape, out_shapes, values, batch):
    """Each example's gradient of a link's input ([B] + its shape), from
    its outputs' (``values``, None for an output no rule reached)."""
    if op == "Split":
        axis = _config(payload, 0) % len(in_shape)
        dtype = next(x for x in values if x is not None).dtype
        pieces = [v if v is not None else array_ops.zeros([batch] + list(shape), dtype)
                  for v, shape in zip(values, out_shapes)]
        return array_ops.concat(pieces, axis + 1)
    g = values[0]
    if isinstance(op, tuple):   # ("StridedSlice", its pads)
        return array_ops.pad(g, ((0, 0),) + op[1])
    if op in _CHAIN_RESHAPES:
        return array_ops.reshape(g, [batch] + list(in_shape))
    if op == "Mul":
        g = g * math_ops.cast(payload.inputs[1 - pos], g.dtype)
    elif op == "Neg" or (op == "Sub" and pos == 1):
        g = -g
    return _norm_rules._to_source(g, in_shape)  # pylint: disable=protected-access


def _spec(node, shape, grads, batch, feed):
    """A _uses tree as a hashable spec over feeds (``feed(tensor)`` -> its
    index): each rule's payload and output gradient, each link's payload,
    checked against the output gradients' shapes (_Declined); leaves no
    gradient reached are left out; None where none is."""
    out = []
    for item in node:
        payload, pos = item[1], item[2]
        ins = tuple(-1 if t is None or t.dtype == dtypes.resource else feed(t)
                    for t in payload.inputs)
        attrs = tuple(_hashable(a) for a in payload.attrs)
        if item[0] == "chain":
            outs = tuple((o_shape, _spec(children, o_shape, grads, batch, feed))
                         for o_shape, children in item[5])
            if any(c is not None for _, c in outs):
                out.append(("chain", attrs, payload.num_inputs, ins, pos,
                            item[3], item[4], outs))
            continue
        rule, o = item[3], item[4]
        g = grads.get(o)
        if g is None:
            continue
        if type(g) is not ops.EagerTensor:
            g = ops.convert_to_tensor(g)
        saved = payload.inputs[pos]
        seen = (tuple(saved.shape.as_list())
                if saved is not None and saved.dtype != dtypes.resource else shape)
        if not _norm_rules.applies(rule, payload, pos, tuple(g.shape.as_list()),
                                   seen, batch):
            raise _Declined()
        out.append(("rule", attrs, payload.num_inputs, ins, pos, rule, feed(g), seen))
    return tuple(out) or None


def _uses_value(spec, shape, tensors, batch):
    """[B] + shape from a _spec over ``tensors``: the sum of its uses'
    per-example gradients (MatMuls by one product of their stacked steps);
    eager, or traced (gradients._compiled.traced_call)."""
    matmuls, terms = {}, []
    for item in spec:
        payload = EagerOp(item[1], tuple(None if i < 0 else tensors[i]
                                         for i in item[3]), item[2])
        pos = item[4]
        if item[0] == "chain":
            op, in_shape, outs = item[5], item[6], item[7]
            values = [None if c is None else _uses_value(c, o_shape, tensors, batch)
                      for o_shape, c in outs]
            terms.append(_chain_vjp(payload, pos, op, in_shape,
                                    [o_shape for o_shape, _ in outs], values, batch))
            continue
        rule, g, seen = item[5], tensors[item[6]], item[7]
        if type(rule) is type(_norm_rules.NORM_RULES["MatMul"]) and pos == 1:
            key = bool(_norm_rules.attr(payload, "transpose_b"))
            matmuls.setdefault(key, []).append((payload, g))
        else:
            terms.append(rule.per_example(payload, pos, g, src_shape=seen))
    terms += [_stacked_matmuls(t) for t in matmuls.values()]
    terms = [array_ops.reshape(t, [batch] + list(shape)) for t in terms]
    return terms[0] if len(terms) == 1 else math_ops.add_n(terms)


def _per_example_of_uses(tape_state, losses, uses, shapes, grads=None):
    """{k: [B] + source shape} for the sources of ``uses`` (k -> _uses):
    one backward pass to every use's output (none where ``grads``, by
    output id, has them all), each use's rule, summed (MatMuls by one
    product over their stacked steps; a chain back through its ops), in one
    traced function in a training loop; a source one of whose rules
    declines is left out (rows)."""
    batch = int(losses.shape[0])
    loops = _loops_of(uses)
    got = _per_example_of_loops(tape_state, losses, loops, batch, grads) if loops else {}
    uses = {k: node for k, node in uses.items() if k not in loops}
    if not uses:
        return got
    out_ids = list(dict.fromkeys(o for node in uses.values() for o in _leaves(node)))
    if not out_ids:
        return got
    if grads is None or any(o not in grads for o in out_ids):
        grads = dict(zip(out_ids, _pass_to(tape_state, losses, out_ids)))
    feeds, index = [], {}

    def feed(t):
        i = index.get(id(t))
        if i is None:
            i = index[id(t)] = len(feeds)
            feeds.append(t)
        return i
    specs = []
    for k, node in uses.items():
        try:
            spec = _spec(node, shapes[k], grads, batch, feed)
        except _Declined:
            continue
        if spec is not None:
            specs.append((k, shapes[k], spec))
    if not specs:
        return got
    specs = tuple(specs)
    try:
        hash(specs)
    except TypeError:       # an attr value that cannot be a key
        values = [_uses_value(spec, shape, feeds, batch) for _, shape, spec in specs]
    else:
        values = _compiled.traced_call(
            ("dp_uses", specs, batch),
            lambda *t: [_uses_value(spec, shape, t, batch) for _, shape, spec in specs],
            feeds)
    got.update({k: v for (k, _, _), v in zip(specs, values)})
    return got


def _loops_of(uses):
    """The sources of _uses trees that are a traced loop's variables: k ->
    its ("while", payload, pos, plan, output ids)."""
    return {k: node[0] for k, node in uses.items() if node[0][0] == "while"}


def _by_loop(loops):
    """The loops of _loops_of: [(the While op, its ("while", ...) items'
    first, {k: item} of its variables)]."""
    by_loop = {}
    for k, item in loops.items():
        by_loop.setdefault(id(item[1]), (item, {}))[1][k] = item
    return [(_loop_op(item[1]), item, members) for item, members in by_loop.values()]


def _loop_gradients(loops, batch, done):
    """{While op: its gradient function} for a backward pass that goes
    through those loops (to the ops below one, whose rules read their
    output gradients: a PReLU before a recurrent layer): each loop's
    per-example backward loop (_while_grads.per_example), whose per-example
    gradients go to ``done`` (by ("loop", id of its payload)), and its
    inputs' gradients to the pass, in place of TF's backward loop (one
    backward loop, not two). Graph mode only (eagerly a loop is no op)."""
    if not loops or context.executing_eagerly():
        return {}
    out = {}
    for op, item, members in _by_loop(loops):
        plans = {m[2]: m[3] for m in members.values()}

        def grad(_, *grads, op=op, key=("loop", id(item[1])), plans=plans):
            values, inputs = _while_grads.per_example(op, list(grads), plans, batch)
            done[key] = values
            return inputs
        out[op] = grad
    return out


def _per_example_of_loops(tape_state, losses, loops, batch, grads=None):
    """{k: [B] + source shape} for the variables traced loops read
    (``loops``: k -> its ("while", payload, pos, plan, output ids)): one
    backward pass of the losses to the loops' outputs, then each loop's
    gradient with per-example accumulators (_while_grads), one per loop
    for all its variables. ``grads`` (_ruled_pass'): the loops' outputs'
    gradients by id, and the per-example gradients of the loops its pass
    went through (_loop_gradients): no pass then."""
    grads = grads or {}
    out_ids = list(dict.fromkeys(o for item in loops.values() for o in item[4]))
    if any(o not in grads for o in out_ids):
        grads = dict(zip(out_ids, _pass_to(tape_state, losses, out_ids)))
    got = {}
    for op, item, members in _by_loop(loops):
        values = grads.get(("loop", id(item[1])))
        if values is None:
            plans = {m[2]: m[3] for m in members.values()}
            values, _ = _while_grads.per_example(
                op, [grads.get(o) for o in item[4]], plans, batch)
        for k, m in members.items():
            got[k] = values[m[2]]
    return got


def _rules_of(flat_raw, analysis):
    """(name, how) for each connected source, in order: the op type of its
    rule; the op types reading it and the number of ruled ops summed
    (_uses); or "per-example rows"."""
    out = []
    for k in range(len(flat_raw)):
        if k in analysis.ruled:
            how = analysis.op_types[k]
        elif k in analysis.uses and analysis.uses[k][0][0] == "while":
            meets = sorted({kind for kind in _while_kinds(analysis.uses[k][0])})
            how = (f"While: the rules of its body's {', '.join(meets)}, "
                   "summed over its iterations")
        elif k in analysis.uses:
            how = (f"{', '.join(analysis.fallback[k])}: the rules of "
                   f"{len(list(_leaves(analysis.uses[k])))} ops, summed")
        elif k in analysis.fallback:
            how = "per-example rows"
        else:
            continue
        out.append((_source_name(flat_raw[k]), how))
    return tuple(out)


def _while_kinds(item):
    """The op types of a loop's body meeting the variable (_uses' "while")."""
    op = _loop_op(item[1])
    by_id = {id(o): o.type for o in op._body_graph.get_operations()}  # pylint: disable=protected-access
    return [by_id[key] for key, kind in item[3][2].items()
            if kind == "meet" and key in by_id]


def _carry_blocks_shape(entry, shapes):
    """The analysis' shape of a SpaceToBatchND's input from its output's,
    block shape and paddings (a dilated convolution's input, which no op
    saved: a Reshape before it, GroupNormalization's, is then known to keep
    the batch leading)."""
    i, o = entry.input_ids[0], entry.output_ids[0] if entry.output_ids else None
    out = shapes.get(o)
    if i in shapes or out is None or None in out:
        return
    block, pads = _config(entry.payload, 1), _config(entry.payload, 2)
    if not isinstance(block, list) or not isinstance(pads, list):
        return
    m = len(block)
    if len(out) < m + 1 or len(pads) != m or any(len(p) != 2 for p in pads):
        return
    n = int(np.prod(block))
    if n <= 0 or out[0] % n:
        return
    spatial = [out[1 + k] * block[k] - pads[k][0] - pads[k][1] for k in range(m)]
    shapes[i] = tuple([out[0] // n] + spatial + list(out[1 + m:]))


def _carry_shape(entry, shapes):
    """The analysis' shapes across a Transpose, Unpack or Pack, either
    way (a recurrent layer's time-major input, whose shapes no op saved),
    and to a broadcasting op's output from its inputs'."""
    if entry.op_type in _row_ops.BROADCASTING:
        ins = [shapes.get(t) for t in entry.input_ids]
        if entry.output_ids[0] not in shapes and ins and None not in ins and all(
                None not in s for s in ins):
            try:
                shapes[entry.output_ids[0]] = tuple(np.broadcast_shapes(*ins))
            except ValueError:
                pass
        return
    i, outs = entry.input_ids[0], entry.output_ids
    if entry.op_type == "Pack":
        i, outs = outs[0], entry.input_ids      # (an Unpack the other way)
    if entry.op_type == "Transpose":
        perm = _config(entry.payload, 1)
        if not perm:
            return
        if i in shapes and outs[0] not in shapes and len(shapes[i]) == len(perm):
            shapes[outs[0]] = tuple(shapes[i][p] for p in perm)
        elif outs[0] in shapes and i not in shapes and len(shapes[outs[0]]) == len(perm):
            shape = [None] * len(perm)
            for k, p in enumerate(perm):
                shape[p] = shapes[outs[0]][k]
            shapes[i] = tuple(shape)
        return
    axis = _norm_rules.attr(entry.payload, "axis", 0)
    if not isinstance(axis, int):
        return
    if i in shapes:
        shape = list(shapes[i])
        a = axis % len(shape) if shape else 0
        for o in outs:
            shapes.setdefault(o, tuple(shape[:a] + shape[a + 1:]))
        return
    known = next((shapes[o] for o in outs if o in shapes), None)
    if known is not None:
        a = axis % (len(known) + 1)
        shapes[i] = tuple(list(known[:a]) + [len(outs)] + list(known[a:]))
