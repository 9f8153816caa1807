"""What a tape holds: ``GradientTape.summary()`` and ``GradientTape.to_dot()``.

Both read the core's trace (``export_trace``, each op's entry and backward
payload) and change nothing on the tape.

Saved tensors are the inputs and outputs each recorded op keeps for its
gradient function (only those the function reads, as TF keeps them). A
tensor saved by several ops is counted once, under the first op (in
recording order) that saves it, so the per-type rows add up to the total.
Each is also sorted by where it came from:

- made under the tape: made after the tape was created (a tensor id above
  TF's id counter then), not a variable read. These are the bytes the tape
  adds to memory: they die with it (unless the program keeps them too);
- variable values: ``ReadVariableOp`` outputs, which share the variable's
  buffer (TF reads a Variable passed to an op inside C++; fasttape reads it
  in Python, as one more op);
- from before the tape: inputs, constants, watched tensors.

Ops whose backward is a Python function (``tf.custom_gradient``,
``tf.function`` calls, ``recompute_grad``) keep what their closures hold,
which is not counted; ops recorded while tracing keep graph tensors, which
hold no memory of their own. Both are counted as ops.
"""

import dataclasses

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.eager import backprop
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import ops
from tensorflow.python.util import nest

from fasttape.diagnostics import anomaly
from fasttape.gradients._payloads import EagerOp, GraphOp
from fasttape.gradients._tf_vspace import nbytes as _nbytes

_handle_or_self = backprop._handle_or_self  # pylint: disable=protected-access

_VARIABLE_READ = "ReadVariableOp"


@dataclasses.dataclass(frozen=True)
class OpTypeSummary:
    """One row of a TapeSummary."""
    op_type: str
    ops: int              # recorded ops of this type the tape holds
    saved_tensors: int    # distinct tensors first saved by ops of this type
    saved_bytes: int      # their bytes


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One tensor the tape keeps for its backward pass."""
    tensor_id: int
    op_type: str          # the first op type (in recording order) that saves it
    shape: tuple
    dtype: str
    nbytes: int
    origin: str           # "made under the tape", "variable value", "from before the tape"


MADE, VARIABLE, BEFORE = ("made under the tape", "variable value",
                          "from before the tape")


@dataclasses.dataclass(frozen=True)
class TapeSummary:
    """What a fasttape tape holds for its backward pass (see
    ``GradientTape.summary``). ``str()`` is a table."""
    op_types: tuple               # OpTypeSummary rows, most bytes first
    saved: tuple                  # SavedTensor per distinct saved tensor
    watched_tensors: int          # watched tensors (not variables)
    watched_variables: tuple      # the watched variables
    python_backward_ops: int      # ops whose backward is a Python function
    graph_ops: int                # ops recorded while tracing
    persistent: bool
    consumed: bool                # a non-persistent tape that has computed
    # A tape with a memory_budget: its budget, the bytes it holds, and the
    # tensors and bytes dropped and recomputed so far (None: no budget).
    memory: dict = None
    # After per_example_gradients / per_example_norms / dp_gradient: the
    # method, and the sources its last call took per-example rows for (one
    # backward pass per example: no op rule covers them), each as (name,
    # op types using it); None: no such call on this tape.
    per_example_rows: tuple = None
    # ... and how it covered each source: the method, then (name, the op
    # type of its rule, or the op types reading it and how many ruled ops
    # were summed, or "per-example rows"); None: no such call.
    per_example_rules: tuple = None

    @property
    def num_ops(self):
        return sum(r.ops for r in self.op_types)

    @property
    def saved_tensors(self):
        return len(self.saved)

    @property
    def saved_bytes(self):
        return sum(s.nbytes for s in self.saved)

    def bytes_by_origin(self):
        out = {MADE: 0, VARIABLE: 0, BEFORE: 0}
        for s in self.saved:
            out[s.origin] += s.nbytes
        return out

    @property
    def held_bytes(self):
        """Bytes of saved tensors made under the tape (variable reads aside):
        what the tape adds to memory, and what ``python -m fasttape bench``
        counts as held, less the result the step returns."""
        return self.bytes_by_origin()[MADE]

    def as_dict(self):
        return {
            "op_types": [dataclasses.asdict(r) for r in self.op_types],
            "num_ops": self.num_ops,
            "saved_tensors": self.saved_tensors,
            "saved_bytes": self.saved_bytes,
            "bytes_by_origin": self.bytes_by_origin(),
            "watched_tensors": self.watched_tensors,
            "watched_variables": [v.name for v in self.watched_variables],
            "python_backward_ops": self.python_backward_ops,
            "graph_ops": self.graph_ops,
            "persistent": self.persistent,
            "consumed": self.consumed,
            "memory": self.memory,
            "per_example_rows": self.per_example_rows,
            "per_example_rules": self.per_example_rules,
        }

    def _per_example_line(self):
        method, rows = self.per_example_rows
        if not rows:
            return f"{method}: an op rule for every source (no per-example rows)"
        return (f"{method}: per-example rows (no op rule) for {len(rows)} "
                "source(s): " + "; ".join(
                    f"{name} (used by {', '.join(types)})" for name, types in rows))

    def __str__(self):
        kind = "persistent" if self.persistent else "non-persistent"
        if self.consumed:
            text = (f"fasttape {kind} tape: used up by gradient(); it holds "
                    "nothing.")
            if self.per_example_rows is not None:
                text += "\n" + self._per_example_line()
            return text
        width = max([len("op type")] + [len(r.op_type) for r in self.op_types])
        lines = [f"fasttape {kind} tape: {self.num_ops} ops, "
                 f"{self.saved_tensors} saved tensors, "
                 f"{_human(self.saved_bytes)}",
                 f"{'op type':<{width}}  {'ops':>7}  {'saved':>7}  {'bytes':>10}"]
        for r in self.op_types:
            lines.append(f"{r.op_type:<{width}}  {r.ops:>7}  "
                         f"{r.saved_tensors:>7}  {_human(r.saved_bytes):>10}")
        lines.append(f"{'total':<{width}}  {self.num_ops:>7}  "
                     f"{self.saved_tensors:>7}  {_human(self.saved_bytes):>10}")
        by_origin = self.bytes_by_origin()
        lines.append("saved bytes by origin: " + ", ".join(
            f"{k} {_human(v)}" for k, v in by_origin.items()))
        names = ", ".join(f"{v.name} {tuple(v.shape.as_list())}"
                          for v in self.watched_variables)
        lines.append(f"watched: {self.watched_tensors} tensors, "
                     f"{len(self.watched_variables)} variables"
                     + (f" ({names})" if names else ""))
        m = self.memory
        if m is not None:
            lines.append(
                f"memory budget {_human(m['budget'])}: holds "
                f"{_human(m['held_bytes'])} alone; dropped "
                f"{m['dropped_tensors']} tensors ({_human(m['dropped_bytes'])}), "
                f"recomputed {m['recomputed_tensors']} "
                f"({_human(m['recomputed_bytes'])}, {m['recomputed_ops']} ops)")
        if self.python_backward_ops:
            lines.append(f"{self.python_backward_ops} ops have a Python "
                         "backward function (custom_gradient, tf.function): "
                         "what their closures hold is not counted")
        if self.graph_ops:
            lines.append(f"{self.graph_ops} ops were recorded while tracing "
                         "(graph tensors, no bytes of their own)")
        if self.per_example_rows is not None:
            lines.append(self._per_example_line())
        return "\n".join(lines)


def _human(n):
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1024 * 1024):.1f} MiB"


def _ops(core):
    """(op id, OpEntry) of the live recorded ops, in recording order."""
    trace = core.export_trace()
    out = []
    for op_id in trace["op_ids"].tolist():
        entry = core.op(op_id)
        if entry is not None:
            out.append((op_id, entry))
    return out


def summary(tape_state):
    """The TapeSummary of a TapeState (None: a used-up tape)."""
    if tape_state is None or tape_state.core.consumed:
        return TapeSummary((), (), 0, (), 0, 0,
                           bool(tape_state is not None and tape_state.persistent),
                           True, _memory(tape_state))
    core = tape_state.core
    first_uid = tape_state.first_uid
    rows = {}             # op type -> [ops, tensors, bytes]
    saved = {}            # tensor id -> SavedTensor
    python_ops = graph_ops = 0
    for _, entry in _ops(core):
        op_type = entry.op_type
        row = rows.get(op_type)
        if row is None:
            row = rows[op_type] = [0, 0, 0]
        row[0] += 1
        payload = entry.payload
        if type(payload) is GraphOp:
            graph_ops += 1
            continue
        if type(payload) is not EagerOp:
            python_ops += 1
            continue
        for t in payload.saved:
            if t is None or type(t) is not ops.EagerTensor:
                continue
            tid = t._id  # pylint: disable=protected-access
            if tid in saved:
                continue
            nbytes = _nbytes(t)
            if tid < first_uid:
                origin = BEFORE
            elif core.producer(tid) is not None and _is_variable_read(core, tid):
                origin = VARIABLE
            else:
                origin = MADE
            saved[tid] = SavedTensor(tid, op_type, t._shape_tuple(),  # pylint: disable=protected-access
                                     t.dtype.name, nbytes, origin)
            row[1] += 1
            row[2] += nbytes
    op_rows = sorted((OpTypeSummary(k, *v) for k, v in rows.items()),
                     key=lambda r: (-r.saved_bytes, -r.ops, r.op_type))
    variables = tape_state.watched_variables()
    handle_ids = set(tape_state.variables)
    watched = [i for i in core.watched_ids() if i not in handle_ids]
    return TapeSummary(tuple(op_rows), tuple(saved.values()), len(watched),
                       variables, python_ops, graph_ops,
                       tape_state.persistent, False, _memory(tape_state))


def _memory(tape_state):
    store = tape_state.budget if tape_state is not None else None
    return None if store is None else store.summary()


def _is_variable_read(core, tid):
    op_id = core.producer(tid)
    if op_id is None or op_id < 0:
        return False
    entry = core.op(op_id)
    return entry is not None and entry.op_type == _VARIABLE_READ


# -- Graphviz ----------------------------------------------------------------------

def _fmt_shape(desc):
    if desc is None:
        return ""
    shape, dtype = desc
    return f"{'<unknown>' if shape is None else tuple(shape)} {dtype}"


def _tensor_shapes(core, entries):
    """tensor id -> (shape, dtype name), from whatever the tape knows:
    anomaly mode's records, output metadata, saved tensors, graph ops, and
    recorded outputs still alive."""
    shapes = {}
    for tid, t in core.live_outputs().items():
        d = anomaly.describe(t)
        if d is not None:
            shapes[tid] = d
    for _, entry in entries:
        in_ids, out_ids = entry.input_ids, entry.output_ids
        payload = entry.payload
        record = anomaly.record_of(payload) if payload is not None else None
        if record is not None:
            shapes.update(zip(in_ids, record.inputs))
            shapes.update(zip(out_ids, record.outputs))
        for tid, meta in zip(out_ids, entry.output_meta or ()):
            if type(meta) is tuple and len(meta) == 2:
                shapes.setdefault(tid, (meta[0], dtypes.as_dtype(meta[1]).name))
            elif meta is not None:
                d = anomaly.describe(meta)
                if d is not None:
                    shapes.setdefault(tid, d)
        if type(payload) is EagerOp:
            for tid, t in zip(list(in_ids) + list(out_ids), payload.saved):
                if t is not None:
                    d = anomaly.describe(t)
                    if d is not None:
                        shapes.setdefault(tid, d)
        elif type(payload) is GraphOp:
            op = payload.op
            for tid, t in zip(in_ids, op.inputs):
                shapes.setdefault(tid, anomaly.describe(t))
            for tid, t in zip(out_ids, op.outputs):
                shapes.setdefault(tid, anomaly.describe(t))
    return shapes


# Ops whose output 0 has the shape and dtype of their input 0: to_dot
# passes a known shape across them (either way) where the tape saved neither.
_SAME_SHAPE = frozenset({
    "BiasAdd", "Identity", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu",
    "Softplus", "Softsign", "Sigmoid", "Tanh", "Sin", "Cos", "Tan", "Exp",
    "Log", "Log1p", "Expm1", "Neg", "Abs", "Square", "Sqrt", "Rsqrt",
    "Reciprocal", "Erf", "Softmax", "LogSoftmax", "StopGradient",
})


def _propagate_shapes(entries, shapes, variables):
    """Fill in shapes the tape did not keep: a variable read has its
    variable's, and the ops of _SAME_SHAPE pass one between their first
    input and their output."""
    for _, entry in entries:
        if entry.op_type == "ReadVariableOp" and entry.input_ids:
            var = variables.get(entry.input_ids[0])
            if var is not None and var.shape.rank is not None:
                shapes.setdefault(entry.output_ids[0],
                                  (tuple(var.shape.as_list()), var.dtype.name))
    for _ in range(len(entries)):
        changed = False
        for _, entry in entries:
            if entry.op_type not in _SAME_SHAPE or not entry.input_ids:
                continue
            i, o = entry.input_ids[0], entry.output_ids[0]
            if i in shapes and o not in shapes:
                shapes[o] = shapes[i]
                changed = True
            elif o in shapes and i not in shapes:
                shapes[i] = shapes[o]
                changed = True
        if not changed:
            break


def _ids(structure):
    if structure is None:
        return []
    return [_handle_or_self(t)._id for t in nest.flatten(structure)]  # pylint: disable=protected-access


def _quote(text):
    return '"' + (text.replace("\\", "\\\\").replace('"', '\\"')
                  .replace("\n", "\\n")) + '"'


_ON_PATH = 'color="#d62728", penwidth=2'


def to_dot(tape_state, targets=None, sources=None, name="fasttape_trace"):
    """The trace of a TapeState as Graphviz DOT text (see
    GradientTape.to_dot). Nodes: ``op<id>`` per recorded op (box: op type
    and output shapes), ``w<id>`` per watched tensor or variable (ellipse),
    ``target<k>`` per target (with targets given). Edges follow the data,
    from producer to reader. Inputs the tape does not track (constants) are
    left out."""
    lines = [f"digraph {name} {{",
             "  rankdir=TB;",
             '  node [fontname="Helvetica", fontsize=10];',
             '  edge [color="#555555"];']
    if tape_state is None or tape_state.core.consumed:
        lines.append('  consumed [shape=plaintext, label="(tape used up by gradient())"];')
        lines.append("}")
        return "\n".join(lines) + "\n"
    core = tape_state.core
    entries = _ops(core)
    shapes = _tensor_shapes(core, entries)
    _propagate_shapes(entries, shapes, tape_state.variables)
    target_ids, source_ids = _ids(targets), _ids(sources)
    on_path = (set(core.path(target_ids, source_ids)[0])
               if target_ids and source_ids else set())
    source_set = set(source_ids)
    producer = {}
    for op_id, entry in entries:
        for tid in entry.output_ids:
            producer[tid] = op_id
    variables = tape_state.variables
    # Watched tensors and variables that some recorded op reads (or that
    # are targets or sources).
    read = set()
    for _, entry in entries:
        read.update(entry.input_ids)
    watched = [i for i in core.watched_ids()
               if i in read or i in source_set or i in target_ids]
    for tid in watched:
        var = variables.get(tid)
        if var is not None:
            label = f"{var.name}\n{_fmt_shape((tuple(var.shape.as_list()), var.dtype.name))}"
        else:
            label = f"watched\n{_fmt_shape(shapes.get(tid))}".strip()
        style = f", {_ON_PATH}" if tid in source_set and on_path else ""
        lines.append(f"  w{tid} [shape=ellipse, label={_quote(label)}{style}];")
    for op_id, entry in entries:
        # Output shapes where the tape still knows them.
        outs = "\n".join(filter(None, (_fmt_shape(shapes.get(t))
                                       for t in entry.output_ids)))
        label = f"{entry.op_type}\n{outs}" if outs else entry.op_type
        style = f", {_ON_PATH}" if op_id in on_path else ""
        lines.append(f"  op{op_id} [shape=box, label={_quote(label)}{style}];")
    watched_set = set(watched)
    for op_id, entry in entries:
        for tid in entry.input_ids:
            p = producer.get(tid)
            if p is not None and p != op_id:
                src = f"op{p}"
                hot = p in on_path and op_id in on_path
            elif tid in watched_set:
                src = f"w{tid}"
                hot = tid in source_set and op_id in on_path
            else:
                continue
            lines.append(f"  {src} -> op{op_id}" + (f" [{_ON_PATH}]" if hot else "")
                         + ";")
    for k, tid in enumerate(target_ids):
        label = f"target\n{_fmt_shape(shapes.get(tid))}".strip()
        hot = bool(on_path) and producer.get(tid) in on_path
        lines.append(f"  target{k} [shape=doubleoctagon, label={_quote(label)}"
                     + (f", {_ON_PATH}" if hot else "") + "];")
        p = producer.get(tid)
        src = f"op{p}" if p is not None else (f"w{tid}" if tid in watched_set else None)
        if src is not None:
            lines.append(f"  {src} -> target{k}" + (f" [{_ON_PATH}]" if hot else "")
                         + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"
