"""Trace deletion on tensor death in the core: record_operation(...,
outputs=...) holds a weakref on each output and runs delete_trace when one
dies (tape.h's DeleteTrace, which TF calls from EagerTensor's dealloc), at
once when the tape is idle, after the operation under way otherwise (never
inside a backward pass)."""

import gc
import threading
import weakref

import numpy as np
import pytest

import numpy_vspace as nv
from numpy_vspace import T, Payload
from fasttape._core import GradientTapeCore


def rec(tp, op_type, fn, *inputs, give_outputs=True):
    """Run fn (unrecorded: no numpy_vspace tape is active) and record it on
    tp with a payload that saves the inputs only, as TF's Sin/Mul do."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    tp.record_operation(op_type, [x.id for x in inputs], [o.id for o in outs],
                        tuple(o.meta for o in outs),
                        Payload(op_type, inputs, (), None), None,
                        outs if give_outputs else None)
    return out


def grad(tp, vs, y, x):
    return tp.compute_gradient(vs, [y.id], [x.id])[0]


def test_a_dying_chain_frees_its_ops_and_saved_tensors(vs):
    x = T(0.6)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    y = rec(tp, "sin", nv.sin, x)
    z = rec(tp, "mul", nv.mul, y, y)
    y_ref = weakref.ref(y)
    del y                       # still saved by z's op
    assert tp.num_ops == 2 and y_ref() is not None
    del z                       # z's op goes, y with it, then y's op
    assert tp.num_ops == 0 and y_ref() is None
    assert tp.num_watched_outputs == 0
    assert tp.is_watched(x.id)  # watched tensors stay
    w = rec(tp, "sin", nv.sin, x)
    np.testing.assert_allclose(grad(tp, vs, w, x).value, np.cos(0.6))


def test_a_live_target_keeps_its_history(vs):
    x = T(0.3)
    tp = GradientTapeCore(False)
    tp.watch(x.id)
    a = rec(tp, "sin", nv.sin, x)
    b = rec(tp, "mul", nv.mul, a, x)
    del a                        # read by b's op: kept
    for _ in range(10):
        rec(tp, "sin", nv.sin, b)   # results die at once
    assert tp.num_ops == 2
    np.testing.assert_allclose(grad(tp, vs, b, x).value,
                               np.cos(0.3) * 0.3 + np.sin(0.3))


def test_multi_output_op_goes_with_its_last_output(vs):
    x = T(0.6)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    s, c = rec(tp, "sincos", nv.sincos, x)
    del s
    assert tp.num_ops == 1
    y = rec(tp, "mul", nv.mul, c, c)
    np.testing.assert_allclose(grad(tp, vs, y, x).value,
                               -2 * np.cos(0.6) * np.sin(0.6))
    del c, y
    assert tp.num_ops == 0


def test_an_id_recorded_twice_dies_once(vs):
    """custom_gradient re-records the same outputs: one weakref per id, so
    the usage count is decremented once on death."""
    x = T(0.6)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    y = rec(tp, "sin", nv.sin, x)
    tp.record_operation("sin", [x.id], [y.id], (y.meta,),
                        Payload("sin", (x,), (), None), None, (y,))
    z = rec(tp, "mul", nv.mul, y, x)
    assert tp.num_watched_outputs == 2
    del y                       # z's op still reads it: nothing goes
    assert tp.num_ops == 3 and tp.producer(z.id) == 2
    np.testing.assert_allclose(grad(tp, vs, z, x).value,
                               np.cos(0.6) * 0.6 + np.sin(0.6))


def test_without_output_objects_nothing_is_deleted(vs):
    x = T(0.6)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    for _ in range(5):
        rec(tp, "sin", nv.sin, x, give_outputs=False)
    assert tp.num_ops == 5 and tp.num_watched_outputs == 0


def test_objects_without_weakrefs_are_kept():
    tp = GradientTapeCore(True)
    tp.watch(1)
    tp.record_operation("op", [1], [2], (None,), object(), None, (2.5,))
    assert tp.num_ops == 1 and tp.num_watched_outputs == 0


def test_a_death_during_the_backward_pass_waits_for_its_end(vs):
    x = T(0.4)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    held = [rec(tp, "sin", nv.sin, x) for _ in range(5)]
    y = rec(tp, "mul", nv.mul, x, x)
    seen = []

    def on_backward(op_type, payload, unneeded, out_grads):
        held.clear()             # five recorded tensors die mid-pass
        gc.collect()
        seen.append(tp.num_ops)  # inspection defers too while busy

    vs.on_backward = on_backward
    g = grad(tp, vs, y, x)
    np.testing.assert_allclose(g.value, 0.8)
    assert seen == [6]
    assert tp.num_ops == 1       # applied when the pass ended
    vs.on_backward = None
    np.testing.assert_allclose(grad(tp, vs, y, x).value, 0.8)


def test_non_persistent_pass_releases_everything(vs):
    x = T(0.4)
    tp = GradientTapeCore(False)
    tp.watch(x.id)
    keep = [rec(tp, "sin", nv.sin, x) for _ in range(3)]
    y = rec(tp, "mul", nv.mul, x, x)
    np.testing.assert_allclose(grad(tp, vs, y, x).value, 0.8)
    assert tp.num_ops == 0 and tp.num_watched_outputs == 0
    del keep, y                  # the tape has no weakref left: no effect


def test_tensors_outliving_their_tape_do_not_reach_it():
    x = T(0.4)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    ys = [rec(tp, "sin", nv.sin, x) for _ in range(20)]
    del tp
    gc.collect()
    del ys                       # no callback into a freed tape
    gc.collect()


def test_a_tape_in_a_dead_cycle_is_collected_while_its_tensors_die():
    class Box:
        pass

    x = T(0.4)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    box = Box()
    box.tape = tp                # payload -> box -> tape -> payload
    y = nv.sin(x)
    tp.record_operation("sin", [x.id], [y.id], (y.meta,), box, None, (y,))
    box.y = y                    # the cycle also holds the output
    ref = weakref.ref(box)
    del tp, box, y
    gc.collect()
    assert ref() is None


def test_deaths_on_another_thread(vs):
    x = T(0.4)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    batch = [rec(tp, "sin", nv.sin, x) for _ in range(50)]
    th = threading.Thread(target=batch.clear)
    th.start()
    th.join()
    y = rec(tp, "mul", nv.mul, x, x)
    assert tp.num_ops == 1
    np.testing.assert_allclose(grad(tp, vs, y, x).value, 0.8)


def test_plan_and_export_see_a_stable_tape(vs):
    x = T(0.4)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    a = rec(tp, "sin", nv.sin, x)
    y = rec(tp, "mul", nv.mul, a, x)
    dead = rec(tp, "sin", nv.sin, x)
    del dead
    code, entries = tp.plan([y.id], [x.id])
    assert [e.op_type for e in entries] == ["sin", "mul"]
    assert tp.export_trace()["op_types"] == ["sin", "mul"]


def test_watched_ids_and_live_outputs_for_inspection(vs):
    """What tape.summary()/to_dot() read: the watched ids (producer -1),
    ascending, and the recorded outputs still alive, by id."""
    x, w = T(0.5), T(2.0)
    tp = GradientTapeCore(True)
    tp.watch(w.id)
    tp.watch(x.id)
    y = rec(tp, "sin", nv.sin, x)
    z = rec(tp, "mul", nv.mul, y, w)
    assert tp.watched_ids() == sorted([x.id, w.id])
    assert tp.live_outputs() == {y.id: y, z.id: z}
    y_id, z_id = y.id, z.id
    del y                       # saved by z's op (the payload keeps it)
    assert set(tp.live_outputs()) == {y_id, z_id}
    v = rec(tp, "sin", nv.sin, z)
    del v                       # died unread: forgotten at once
    assert set(tp.live_outputs()) == {y_id, z_id}
    del z
    assert tp.live_outputs() == {} and tp.num_ops == 0
    assert tp.watched_ids() == sorted([x.id, w.id])


def test_watched_roots_walks_back_to_the_watched_ids(vs):
    """What explain notes for a stop_gradient: the watched ids a tensor is
    recorded from, None past the walk limit, and earlier walks' results
    reused where the walk meets them."""
    x, w, c = T(0.5), T(2.0), T(3.0)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    tp.watch(w.id)
    y = rec(tp, "sin", nv.sin, x)
    z = rec(tp, "mul", nv.mul, y, c)        # c: not tracked, not a root
    u = rec(tp, "mul", nv.mul, z, w)
    assert tp.watched_roots(z.id, 10, {}) == frozenset([x.id])
    assert tp.watched_roots(u.id, 10, {}) == frozenset([x.id, w.id])
    assert tp.watched_roots(x.id, 10, {}) == frozenset([x.id])
    assert tp.watched_roots(c.id, 10, {}) == frozenset()
    assert tp.watched_roots(u.id, 2, {}) is None
    assert tp.watched_roots(u.id, 10, {z.id: frozenset([99])}) == frozenset([99, w.id])
    assert tp.watched_roots(u.id, 10, {z.id: None}) is None


def _weakrefs_to(cls):
    return sum(1 for o in gc.get_objects()
               if type(o) is weakref.ReferenceType and isinstance(o(), cls)
               or type(o) is weakref.ReferenceType and o() is None)


def test_the_weakrefs_of_dead_outputs_are_freed_as_the_tape_goes_on(vs):
    """A tape whose outputs keep dying holds at most about twice the
    weakrefs of its live outputs (dead ones are freed in batches), not one
    per op ever recorded."""
    x = T(0.6)
    tp = GradientTapeCore(True)
    tp.watch(x.id)
    gc.collect()
    before = _weakrefs_to(T)
    for _ in range(5000):
        rec(tp, "sin", nv.sin, x)       # each result dies at once
    held = _weakrefs_to(T) - before
    assert tp.num_ops == 0 and tp.num_watched_outputs == 0
    assert 0 <= held <= 200, held
    alive = [rec(tp, "sin", nv.sin, x) for _ in range(300)]
    assert tp.num_watched_outputs == 300
    assert set(tp.live_outputs()) == {a.id for a in alive}
    del alive
    assert tp.num_ops == 0 and tp.num_watched_outputs == 0


def test_a_weakref_whose_callback_is_still_to_come_is_kept(vs):
    """CPython clears a dying object's weakrefs, then calls their callbacks
    one by one. Here tape A's callback runs first and frees what tape B
    recorded, so B frees its dead weakrefs in between, while B's callback
    for the first object is still to come: B must keep that weakref, and
    count it once when its callback comes."""
    x = T(0.5)
    tape_a, tape_b = GradientTapeCore(True), GradientTapeCore(True)
    tape_b.watch(x.id)
    bs = [rec(tape_b, "sin", nv.sin, x) for _ in range(100)]
    a = T(float(sum(b.value for b in bs)))
    # B records a first (its weakref on a is called back last), saving
    # nothing; A records it saving the bs, which it alone then holds.
    tape_b.record_operation("add_n", [b.id for b in bs], [a.id], (a.meta,),
                            Payload("add_n", (), (), None), None, (a,))
    for b in bs:
        tape_a.watch(b.id)
    tape_a.record_operation("add_n", [b.id for b in bs], [a.id], (a.meta,),
                            Payload("add_n", tuple(bs), (), None), None, (a,))
    del bs, b
    assert tape_b.num_ops == 101 and tape_b.num_watched_outputs == 101
    del a
    assert tape_a.num_ops == 0 and tape_a.num_watched_outputs == 0
    assert tape_b.num_ops == 0 and tape_b.num_watched_outputs == 0
    assert tape_b.live_outputs() == {}
    y = rec(tape_b, "sin", nv.sin, x)
    assert tape_b.num_watched_outputs == 1 and set(tape_b.live_outputs()) == {y.id}
