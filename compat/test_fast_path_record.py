"""fasttape records eager ops from its wrapper of TF's C++ fast path, with no
op callback registered (see _callback.fast_path_execute). What it records
must be exactly what TF's op callback machinery shows for the same op: the
op type, the input tensors (after TF's conversions), the attrs (non-inferred
as passed, then the inferred ones, as the C++ fast path builds them) and the
outputs. A spy op callback, registered beside fasttape's tape, is the
reference: TF hands it the fast path's own view of every op.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import op_callbacks

import fasttape
from fasttape.recording import _recording


def _ops():
    """(name, body(x, v)) for ops of every OpDef shape the recorder reads."""
    return [
        ("unary", lambda x, v: tf.sin(x)),
        ("binary", lambda x, v: x * x),
        ("broadcast", lambda x, v: x + tf.constant([1.0, 2.0])),
        ("non_inferred_attrs", lambda x, v: tf.matmul(x, x, transpose_b=True)),
        ("variable_input", lambda x, v: x * v),
        ("variable_bias_add", lambda x, v: tf.nn.bias_add(x, v)),
        ("python_scalar_input", lambda x, v: tf.raw_ops.Mul(x=x, y=2.0)),
        ("python_list_input", lambda x, v: tf.reshape(x, [4, 1])),
        ("python_axis", lambda x, v: tf.reduce_sum(x, 1)),
        ("numpy_input", lambda x, v: tf.raw_ops.AddV2(x=x, y=np.ones((2, 2), "float32"))),
        ("number_list", lambda x, v: tf.concat([x, x * 2.0], axis=0)),
        ("number_list_add_n", lambda x, v: tf.add_n([x, x, x])),
        ("pack", lambda x, v: tf.stack([x, x], axis=1)),
        ("type_list", lambda x, v: tf.raw_ops.IdentityN(input=[x, tf.cast(x, tf.float64)])),
        ("list_output", lambda x, v: tf.split(x, 2, axis=1)),
        # The same with every input a tensor: no conversion by TF's C++, so
        # the recorder builds the attrs itself (above, TF's callback
        # machinery handed them over for the Python-number arguments).
        ("number_list_tensor_axis",
         lambda x, v: tf.concat([x, x * 2.0], axis=tf.constant(0))),
        ("list_output_tensor_axis",
         lambda x, v: tf.split(x, 2, axis=tf.constant(1))),
        ("several_outputs_tensor_k",
         lambda x, v: tf.math.top_k(tf.reshape(x, [-1]), tf.constant(2))),
        ("several_outputs", lambda x, v: tf.math.top_k(tf.reshape(x, [-1]), 2)),
        ("unpack", lambda x, v: tf.unstack(x)),
        ("gather", lambda x, v: tf.gather(x, [1, 0])),
        ("strided_slice", lambda x, v: x[1:, :1]),
        ("cast", lambda x, v: tf.cast(x, tf.float64)),
        ("softmax_xent", lambda x, v: tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.constant([0, 1]), x)),
    ]


def _spied(body):
    """Run body under a fasttape tape watching x, with a spy op callback.
    Returns (what the spy saw, what the tape recorded), both as
    {output ids: (op type, input ids, attrs)}."""
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    v = tf.Variable([0.5, -1.0])
    seen = {}

    def spy(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if isinstance(op_type, bytes):
            op_type = op_type.decode()
        seen[tuple(o._id for o in outputs)] = (
            op_type, [t._id for t in inputs], tuple(attrs or ()))

    with fasttape.GradientTape() as tape:
        tape.watch(x)
        op_callbacks.add_op_callback(spy)
        try:
            out = body(x, v)
        finally:
            op_callbacks.remove_op_callback(spy)
    core = tape._tape.core  # pylint: disable=protected-access
    recorded = {}
    for i in range(core.num_ops):
        entry = core.op(i)
        recorded[tuple(entry.output_ids)] = (
            entry.op_type, list(entry.input_ids), tuple(entry.payload.attrs))
    del out
    return seen, recorded


@pytest.mark.parametrize("name,body", _ops(), ids=[n for n, _ in _ops()])
def test_fast_path_record_is_what_tf_callbacks_see(name, body):
    seen, recorded = _spied(body)
    assert recorded, f"{name}: nothing recorded"
    for out_ids, (op_type, input_ids, attrs) in recorded.items():
        assert out_ids in seen, f"{name}: {op_type} recorded, never seen by TF"
        assert (op_type, input_ids, attrs) == seen[out_ids], name
    # Nothing dropped: every op TF ran on the watched tensor's path is
    # recorded (a Shape op reads only a shape: no tape records it).
    missed = {seen[k][0] for k in set(seen) - set(recorded)}
    assert missed <= {"Shape"}, f"{name}: not recorded: {missed}"


def test_no_op_callback_while_recording():
    """The point of recording from the fast path: TF's C++ fast path does
    its per-op callback work only while some op callback is registered."""
    before = list(context.context().op_callbacks)
    x = tf.constant([1.0, 2.0])
    with fasttape.GradientTape() as tape:
        tape.watch(x)
        assert list(context.context().op_callbacks) == before
        y = tf.reduce_sum(tf.sin(x) * 3.0, axis=0)   # a converted input too
        assert list(context.context().op_callbacks) == before
    np.testing.assert_allclose(tape.gradient(y, x).numpy(),
                               3.0 * np.cos([1.0, 2.0]), rtol=1e-6)


def test_fast_path_records_need_the_wrapper(monkeypatch):
    """Without fasttape's fast-path wrapper nothing records a fast-path op
    (no op callback is registered): the gradient is None."""
    monkeypatch.setattr(_recording, "fast_path_wrapper_enabled", False)
    x = tf.constant([1.0, 2.0])
    with fasttape.GradientTape() as tape:
        tape.watch(x)
        y = tf.sin(x)
    assert tape.gradient(y, x) is None


@pytest.mark.parametrize("container", [list, tuple])
def test_variables_in_a_list_argument_of_an_unknown_op_are_read_and_watched(container):
    """Arguments of an op with no OpDef layout (not in TF's registry) go
    through read_variables: a Variable inside a list or a tuple is read in
    Python, where the tape sees the read (else its gradient is None)."""
    from fasttape.recording import _callback
    v, w = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
    with fasttape.GradientTape() as tape:
        args = _callback.read_variables(
            (context.context(), "NotAnOp", None, container([v, w])))
        read = args[3]
        assert [type(x) for x in read] == [type(tf.constant(0.0))] * 2
        y = tf.reduce_sum(read[0]) * tf.reduce_sum(read[1])
    assert tape.watched_variables() == (v, w)
    gv, gw = tape.gradient(y, [v, w])
    np.testing.assert_allclose(gv.numpy(), [3.0, 3.0])
    np.testing.assert_allclose(gw.numpy(), [3.0])


def test_the_wrapper_calls_tfs_fast_path_without_pybind_and_raises_what_tf_raises():
    """On the supported releases the wrapper finds TF's C entry points (the
    fast path and the stop test) and calls them directly; an op's error
    comes out as TF's own, with and without a tape."""
    from fasttape.recording import _callback
    assert _callback.c_entry_points()
    x = tf.constant([[1.0, 2.0]])
    seen = []
    for tape_class in (tf.GradientTape, fasttape.GradientTape):
        with tape_class() as tape:
            tape.watch(x)
            with pytest.raises(tf.errors.InvalidArgumentError) as exc:
                tf.matmul(x, x)
            seen.append(exc.value.message)
            with tape.stop_recording():
                y = tf.sin(x)
            z = tf.sin(x)
        grads = tape.gradient([y, z], [x, x])
        seen.append([g.numpy().tolist() for g in grads])
    assert seen[0] == seen[2] and seen[1] == seen[3]
    np.testing.assert_allclose(seen[1][0], np.cos(x.numpy()), rtol=1e-6)


def _collector_allocations_per_op(Tape, n):
    """Objects counted towards the garbage collector's next collection that
    a chain of n recorded tf.sin keeps, per op (after a chain as long, so
    that the interpreter's free lists hold what the first one freed)."""
    import gc
    x = tf.constant([[0.1, 0.2], [0.3, 0.4]])
    counts = []
    for _ in range(2):
        with Tape() as tape:
            tape.watch(x)
            y = x
            gc.disable()    # (gc.collect() would empty the free lists)
            try:
                before = gc.get_count()[0]
                for _ in range(n):
                    y = tf.sin(y)
                counts.append((gc.get_count()[0] - before) / n)
            finally:
                gc.enable()
        del tape, y
    return counts[-1]


def test_recording_keeps_as_many_collector_allocations_an_op_as_tf():
    """What a tape keeps per recorded op counts towards the garbage
    collector's collections, and their rate decides how often a full one
    runs over all of TF's objects (about 170 ms): a chain of 1,500 ops
    kept five counted objects an op (the outputs' tensors, an entry, the
    saved tensors' tuple, the attrs' tuple and a death weakref), against
    TF's tape's one (the tensors: its tuples come from the interpreter's
    free lists), and ran 2.5 times TF's collections. Entries now come from
    a free list, ops of inferred attrs share one attrs tuple, and the tape
    hears of deaths from EagerTensor's dealloc, as TF's does, with no
    weakref: the tensors alone are left, as for TF's."""
    ours = _collector_allocations_per_op(fasttape.GradientTape, 1500)
    theirs = _collector_allocations_per_op(tf.GradientTape, 1500)
    assert ours - theirs <= 0.05, (ours, theirs)


@pytest.mark.parametrize("n", [3, 14, 15, 16, 20])
def test_saved_masks_by_arity_small_and_large(n):
    # The saved-tensor masks are cached per op type and arity, under a small
    # key below 16 inputs and outputs, a large one above: an op of each
    # arity saves what its gradient reads, and gives TF's gradients.
    xs = [tf.constant([float(i + 1), 2.0]) for i in range(n)]

    def grads(Tape):
        with Tape() as t:
            for x in xs:
                t.watch(x)
            y = tf.reduce_sum(tf.math.accumulate_n(xs) * tf.concat(xs, 0)[:2])
            y = y + tf.reduce_sum(tf.stack(xs) ** 2)
        return t.gradient(y, xs)

    for g, h in zip(grads(tf.GradientTape), grads(fasttape.GradientTape)):
        np.testing.assert_allclose(g.numpy(), h.numpy(), rtol=1e-6)
