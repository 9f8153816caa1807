"""tape.summary() and tape.to_dot(): what a fasttape tape holds, checked
against its trace, against the bench's held-memory measurement, and as
parsed DOT."""

import collections
import re
import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

import fasttape
from fasttape import bench

from harness import assert_leaks_nothing, assert_parity


def _nbytes(t):
    return t.dtype.size * int(np.prod(t.shape))


# -- summary --------------------------------------------------------------------

def test_summary_counts_agree_with_the_trace():
    x = tf.constant([1.0, 2.0, 3.0])
    v = tf.Variable(tf.ones((3, 2)))
    with fasttape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        a = x * x                     # Mul saves x (twice: counted once)
        b = tf.sin(x)                 # Sin saves x again: counted under Mul
        c = tf.exp(a + b)             # AddV2 saves its inputs' shapes (a, b); Exp its output
        d = tf.matmul(c[None, :], v)  # StridedSlice; ReadVariableOp; MatMul
        loss = tf.reduce_sum(d)
    s = tape.summary()
    trace = tape._tape.core.export_trace()  # pylint: disable=protected-access
    by_type = collections.Counter(trace["op_types"][i]
                                  for i in trace["op_type_index"].tolist())
    assert {r.op_type: r.ops for r in s.op_types} == dict(by_type)
    assert s.num_ops == tape._tape.core.num_ops == len(trace["op_ids"])  # pylint: disable=protected-access
    rows = {r.op_type: r for r in s.op_types}
    assert rows["Mul"].saved_tensors == 1 and rows["Mul"].saved_bytes == 12
    assert rows["Sin"].saved_tensors == 0          # x: already under Mul
    assert rows["Exp"].saved_tensors == 1 and rows["Exp"].saved_bytes == 12
    saved_ids = [t.tensor_id for t in s.saved]
    assert len(saved_ids) == len(set(saved_ids))   # each once
    assert x._id in saved_ids and c._id in saved_ids  # pylint: disable=protected-access
    # The rows add up to the total.
    assert sum(r.saved_bytes for r in s.op_types) == s.saved_bytes
    assert sum(r.saved_tensors for r in s.op_types) == s.saved_tensors
    # Every saved tensor, found the other way: the payloads' tensors.
    core = tape._tape.core  # pylint: disable=protected-access
    expected = {}
    for op_id in trace["op_ids"].tolist():
        for t in core.op(op_id).payload.saved:
            if t is not None:
                expected[t._id] = _nbytes(t)  # pylint: disable=protected-access
    assert s.saved_bytes == sum(expected.values())
    origin = {t.tensor_id: t.origin for t in s.saved}
    assert origin[x._id] == "from before the tape"  # pylint: disable=protected-access
    assert origin[c._id] == "made under the tape"  # pylint: disable=protected-access
    assert "variable value" in origin.values()     # v's read, saved by MatMul
    assert s.watched_tensors == 1
    assert list(s.watched_variables) == [v]
    del loss


def test_summary_table_and_dict():
    x = tf.constant([[1.0, 2.0]])
    with fasttape.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(tf.tanh(x) * 2.0)
    s = tape.summary()
    text = str(s)
    assert text.startswith("fasttape non-persistent tape: 3 ops")
    for op_type in ("Tanh", "Mul", "Sum"):
        assert re.search(rf"^{op_type}\s+1\s", text, re.M), text
    assert "watched: 1 tensors, 0 variables" in text
    d = s.as_dict()
    assert d["num_ops"] == 3 and d["watched_tensors"] == 1
    tape.gradient(y, x)
    used = tape.summary()
    assert used.consumed and used.num_ops == 0
    assert "used up" in str(used)


def test_summary_counts_python_backward_ops():
    @tf.custom_gradient
    def clip(x):
        return tf.identity(x), lambda dy: tf.clip_by_value(dy, -1.0, 1.0)

    @tf.function
    def f(x):
        return tf.sin(x) * 2.0

    x = tf.constant([1.0, 2.0])
    with fasttape.GradientTape() as tape:
        tape.watch(x)
        y = f(clip(x))
    s = tape.summary()
    assert s.python_backward_ops == 2, str(s)
    assert "Python backward function" in str(s)
    del y


def test_summary_and_to_dot_leave_gradients_as_tf():
    def case(GradientTape):
        w = tf.Variable([[2.0], [3.0]])
        inputs = tf.constant([[0.5, 1.5], [1.0, -1.0]])
        with GradientTape(persistent=True) as tape:
            tape.watch(inputs)
            y = tf.reduce_mean(tf.tanh(tf.matmul(inputs, w)) ** 2)
        x, v = inputs, w
        assert hasattr(tape, "summary") == (GradientTape is fasttape.GradientTape)
        if hasattr(tape, "summary"):
            tape.summary()
            tape.to_dot(y, [x, v])
        first = tape.gradient(y, [x, v])
        if hasattr(tape, "summary"):
            str(tape.summary())
        return first, tape.gradient(y, [x, v])

    assert_parity(case, allow_tf_error=False)


# The bench's workloads recorded with a plain GradientTape.
TAPE_WORKLOADS = ["chain", "mlp_small", "mlp_large", "rnn", "cnn", "embedding",
                  "matmul", "jacobian"]


@pytest.mark.parametrize("name", TAPE_WORKLOADS)
def test_summary_bytes_agree_with_bench_held_memory(name):
    """The bench's held column (tensors made while recording, alive while
    the step's closure is) is the summary's bytes made under the tape plus
    the result the closure keeps."""
    _, record = bench.BY_NAME[name].make(tf)
    tapes, finishes = [], []

    class Tape(fasttape.GradientTape):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            tapes.append(self)

    class Impl:
        GradientTape = Tape
        ForwardAccumulator = fasttape.ForwardAccumulator

    op_outputs = set()

    def outputs_seen(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        op_outputs.update(o._id for o in outputs)  # pylint: disable=protected-access

    def keep(impl):
        op_callbacks.add_op_callback(outputs_seen)
        try:
            finish = record(impl)
        finally:
            op_callbacks.remove_op_callback(outputs_seen)
        finishes.append(finish)
        return finish

    record(Impl)()    # as the bench: measured after a first step
    held = bench.held_bytes(tf, keep, Impl)
    s = tapes[-1].summary()
    saved = {t.tensor_id for t in s.saved}
    first_uid = tapes[-1]._tape.first_uid  # pylint: disable=protected-access
    results = [c.cell_contents for c in finishes[-1].__closure__
               if isinstance(c.cell_contents, tf.Tensor)]
    result_bytes = sum(_nbytes(t) for t in results
                       if t._id > first_uid and t._id not in saved)  # pylint: disable=protected-access
    assert s.held_bytes > 0
    # The bench sees tensors through an op callback, so not the Python
    # values converted to tensors while recording (an axis, a scalar) that
    # a gradient function saves: a few bytes, which the summary counts.
    made = [t for t in s.saved if t.origin == "made under the tape"]
    converted = [t for t in made if t.tensor_id not in op_outputs]
    assert all(t.dtype in ("int32", "int64") and t.nbytes <= 64
               for t in converted), converted
    assert held == s.held_bytes - sum(t.nbytes for t in converted) + result_bytes, str(s)


# -- DOT ------------------------------------------------------------------------

_NODE = re.compile(r'^  (\w+) \[shape=(\w+), label="((?:[^"\\]|\\.)*)"(, color=[^\]]*)?\];$')
_EDGE = re.compile(r"^  (\w+) -> (\w+)( \[color=[^\]]*\])?;$")


def parse_dot(text):
    """{node: (shape, label, highlighted)}, [(src, dst, highlighted)];
    every line of the body must be a node, an edge or a default."""
    nodes, edges = {}, []
    lines = text.strip().splitlines()
    assert lines[0].startswith("digraph ") and lines[-1] == "}"
    for line in lines[1:-1]:
        m = _NODE.match(line)
        if m:
            nodes[m.group(1)] = (m.group(2), m.group(3).replace("\\n", "\n"),
                                 m.group(4) is not None)
            continue
        m = _EDGE.match(line)
        if m:
            edges.append((m.group(1), m.group(2), m.group(3) is not None))
            continue
        assert re.match(r"^  (rankdir=|node |edge )", line), line
    for src, dst, _ in edges:
        assert src in nodes and dst in nodes, (src, dst)
    return nodes, edges


def _branchy():
    x = tf.constant([1.0, 2.0])
    v = tf.Variable([3.0, 4.0])
    tape = fasttape.GradientTape(persistent=True)
    with tape:
        tape.watch(x)
        a = tf.sin(x)
        b = a * v
        c = tf.cos(x)            # not on the way to the loss
        d = tf.exp(c)
        loss = tf.reduce_sum(b)
    return tape, x, v, loss, (a, b, c, d)


def _by_type(nodes):
    out = collections.defaultdict(list)
    for name, (_, label, hot) in nodes.items():
        out[label.split("\n")[0]].append((name, hot))
    return out


def test_to_dot_nodes_and_edges_match_the_trace():
    tape, x, v, loss, keep = _branchy()
    nodes, edges = parse_dot(tape.to_dot())
    core = tape._tape.core  # pylint: disable=protected-access
    trace = core.export_trace()
    op_ids = trace["op_ids"].tolist()
    assert {n for n in nodes if n.startswith("op")} == {f"op{i}" for i in op_ids}
    # watched: x and v's handle
    assert {n for n in nodes if n.startswith("w")} == {
        f"w{x._id}", f"w{v.handle._id}"}  # pylint: disable=protected-access
    # One edge per input that the tape tracks.
    produced = {}
    for k, op_id in enumerate(op_ids):
        for tid in trace["output_ids"][trace["output_offsets"][k]:
                                      trace["output_offsets"][k + 1]]:
            produced[int(tid)] = op_id
    expected = []
    for k, op_id in enumerate(op_ids):
        for tid in trace["input_ids"][trace["input_offsets"][k]:
                                     trace["input_offsets"][k + 1]].tolist():
            if tid in produced:
                expected.append((f"op{produced[tid]}", f"op{op_id}"))
            elif core.producer(tid) == -1:
                expected.append((f"w{tid}", f"op{op_id}"))
    assert sorted((s, d) for s, d, _ in edges) == sorted(expected)
    # The same graph, written out by hand (not read from the trace): each
    # edge as (its producer's label, its reader's label).
    kind = {name: label.split("\n")[0] for name, (_, label, _) in nodes.items()}
    assert sorted((kind[s], kind[d]) for s, d, _ in edges) == sorted([
        ("watched", "Sin"), ("watched", "Cos"),
        ("Variable:0", "ReadVariableOp"),
        ("Sin", "Mul"), ("ReadVariableOp", "Mul"),
        ("Cos", "Exp"), ("Mul", "Sum")])
    # Op types and shapes in the labels.
    types = _by_type(nodes)
    assert set(types) >= {"Sin", "Mul", "Cos", "Exp", "Sum", "ReadVariableOp"}
    sin_label = nodes[types["Sin"][0][0]][1]
    assert sin_label == "Sin\n(2,) float32"
    assert not any(hot for _, _, hot in nodes.values())
    del keep, loss


@pytest.mark.parametrize("which", ["x", "v", "both"])
def test_to_dot_highlights_the_path_from_sources_to_targets(which):
    tape, x, v, loss, keep = _branchy()
    sources = {"x": [x], "v": [v], "both": [x, v]}[which]
    nodes, edges = parse_dot(tape.to_dot(targets=loss, sources=sources))
    types = _by_type(nodes)
    hot = {t for t, items in types.items() for _, h in items if h}
    expected = {"x": {"Sin", "Mul", "Sum", "watched", "target"},
                "v": {"ReadVariableOp", "Mul", "Sum", "Variable:0", "target"},
                "both": {"Sin", "ReadVariableOp", "Mul", "Sum", "watched",
                         "Variable:0", "target"}}[which]
    assert hot == expected
    # An edge is red exactly when both its ends are on the path.
    for src, dst, h in edges:
        assert h == (nodes[src][2] and nodes[dst][2]), (src, dst)
    assert ("op" + str(tape._tape.core.producer(loss._id)), "target0", True) in edges  # pylint: disable=protected-access
    del keep


def test_to_dot_renders_with_graphviz(tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("graphviz's dot is not installed")
    tape, x, v, loss, keep = _branchy()
    path = tmp_path / "trace.dot"
    path.write_text(tape.to_dot(loss, [x, v]))
    out = subprocess.run(["dot", "-Tplain", str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert out.count("\nnode ") == len(parse_dot(path.read_text())[0])
    del keep


def test_to_dot_in_anomaly_mode_knows_every_shape():
    """Off, the tape keeps no shape for a tensor no gradient reads (here
    MatMul's output, read only by a Transpose); ops recorded in anomaly mode
    carry every shape."""
    x = tf.constant([[1.0, 2.0]])
    w = tf.constant([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])

    def labels(anomaly_mode):
        with fasttape.detect_anomaly(anomaly_mode):
            with fasttape.GradientTape() as tape:
                tape.watch(x)
                y = tf.reduce_mean(tf.transpose(tf.matmul(x, w)))
        nodes, _ = parse_dot(tape.to_dot())
        del y
        return {label.split("\n")[0]: label for name, (_, label, _)
                in nodes.items() if name.startswith("op")}

    assert labels(False)["MatMul"] == "MatMul"
    on = labels(True)
    assert on["MatMul"] == "MatMul\n(1, 3) float32"
    assert on["Transpose"] == "Transpose\n(3, 1) float32"


def _inspected_step():
    tape, x, v, loss, keep = _branchy()
    str(tape.summary())
    tape.to_dot(loss, [x, v])
    tape.gradient(loss, [x, v])
    del keep


def test_summary_and_to_dot_leak_nothing():
    assert_leaks_nothing(_inspected_step)


def test_one_byte_counter_for_summary_and_bench():
    """summary() and the bench count a tensor's bytes with one function:
    a string, resource or variant buffer counts 0 (it holds pointers)."""
    from fasttape.gradients._tf_vspace import nbytes
    from fasttape.diagnostics import _inspect_tape
    assert nbytes(tf.zeros((2, 3))) == 24
    assert nbytes(tf.constant([1, 2], tf.int64)) == 16
    assert nbytes(tf.constant(["abc", "de"])) == 0
    assert nbytes(tf.Variable(1.0).handle) == 0
    assert _inspect_tape._nbytes is nbytes  # pylint: disable=protected-access

    def strings(impl):
        with impl.GradientTape() as tape:
            s = tf.strings.as_string(tf.constant([1.0, 2.0]))
        return lambda: (tape, s)
    assert bench.held_bytes(tf, strings, fasttape) == 0
