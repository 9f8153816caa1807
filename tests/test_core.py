"""Reverse mode of fasttape's core (GradientTapeCore), on the NumPy framework
of numpy_vspace: results against analytic NumPy formulas and central
differences, and the bookkeeping of tape.h (pruning, usage counts, payload
release, early aggregation, delete_trace, export_trace)."""

import weakref

import numpy as np
import pytest

import numpy_vspace as nv
from numpy_vspace import (T, GradientMismatch, NumpyVSpace, check_gradients,
                          gradient, tape)


def close(a, b, rtol=1e-12, atol=1e-12):
    np.testing.assert_allclose(nv.value(a), b, rtol=rtol, atol=atol)


def calls_of(vs, op_type):
    return [c for c in vs.backward_log if c.op_type == op_type]


# -- the numerical checker --------------------------------------------------

def _f_chain(x):
    return nv.exp(nv.sin(nv.mul(x, x)))


def _f_fan(x):
    return nv.add(nv.add(nv.mul(x, x), nv.sin(x)), nv.sub(x, nv.cos(x)))


def _f_diamond(x):
    a = nv.exp(x)
    return nv.mul(nv.sin(a), nv.cos(a))


def _f_matmul(a, b):
    return nv.matmul(nv.sin(a), nv.exp(nv.transpose(b)))


def _f_two_outputs(x):
    s, c = nv.sincos(x)
    return nv.sub(nv.mul(s, s), nv.neg(c))


def _f_split(x):
    lo, hi = nv.split2(x)
    return nv.concat(nv.mul(lo, nv.sin(hi)), nv.exp(lo))


def _f_broadcast(x):
    return nv.mul(nv.broadcast_to(nv.reduce_sum(nv.sin(x)), x.shape), x)


@pytest.mark.parametrize("f, shapes", [
    (_f_chain, [(4,)]),
    (_f_fan, [(3,)]),
    (_f_diamond, [(2, 3)]),
    (_f_matmul, [(2, 3), (4, 3)]),
    (_f_two_outputs, [(5,)]),
    (_f_split, [(6,)]),
    (_f_broadcast, [(3,)]),
], ids=["chain", "fan", "diamond", "matmul", "two_outputs", "split", "broadcast"])
def test_gradients_match_central_differences(f, shapes, rng):
    arrays = [rng.normal(size=s) for s in shapes]
    check_gradients(f, arrays)


def test_checker_fails_on_a_wrong_gradient_rule(rng):
    x = [rng.normal(size=4)]
    check_gradients(nv.sin, x, NumpyVSpace())  # the right rule passes
    wrong = NumpyVSpace()
    wrong.overrides["sin"] = lambda p, u, g: [nv.mul(g[0], nv.sin(p.inputs[0]))]
    with pytest.raises(GradientMismatch):
        check_gradients(nv.sin, x, wrong)
    # and off by only 0.1%: still caught
    slightly = NumpyVSpace()
    slightly.overrides["sin"] = lambda p, u, g: [
        nv.mul(g[0], nv.mul(nv.cos(p.inputs[0]), T(1.001)))]
    with pytest.raises(GradientMismatch):
        check_gradients(nv.sin, x, slightly)


# -- shapes of graphs ---------------------------------------------------------

def test_chain(vs):
    x = T([0.1, 0.7, -1.3])
    with tape(watch=[x]) as tp:
        y = nv.exp(nv.sin(nv.mul(x, x)))
    g = gradient(tp, vs, y, x)
    xv = x.value
    close(g, np.exp(np.sin(xv * xv)) * np.cos(xv * xv) * 2 * xv)
    assert [c.op_type for c in vs.backward_log] == ["exp", "sin", "mul"]


def test_fan_out_fan_in_sums_every_path(vs):
    x = T([0.3, -0.8])
    with tape(watch=[x]) as tp:
        y = nv.add(nv.add(nv.mul(x, x), nv.sin(x)), x)
    g = gradient(tp, vs, y, x)
    xv = x.value
    close(g, 2 * xv + np.cos(xv) + 1)
    # x got 4 gradients (mul twice, sin, add), summed once, at the end
    assert vs.aggregate_sizes == [4]


def test_diamond_producer_runs_once_with_the_full_sum(vs):
    x = T([0.4, 1.3])
    with tape(watch=[x]) as tp:
        a = nv.exp(x)
        y = nv.add(nv.sin(a), nv.cos(a))
    g = gradient(tp, vs, y, x)
    av = np.exp(x.value)
    close(g, (np.cos(av) - np.sin(av)) * av)
    (exp_call,) = calls_of(vs, "exp")  # once, after both readers of a
    close(exp_call.out_grads[0], np.cos(av) - np.sin(av))


def test_deep_diamonds(vs):
    x = T(0.7)
    with tape(watch=[x]) as tp:
        h = x
        for _ in range(20):
            h = nv.mul(nv.sin(h), nv.cos(h))  # h' = cos(2h)
    g = gradient(tp, vs, h, x)
    expected, hv = 1.0, 0.7
    for _ in range(20):
        expected *= np.cos(2 * hv)
        hv = np.sin(hv) * np.cos(hv)
    close(g, expected, rtol=1e-10)


def test_several_targets_are_summed(vs):
    x = T([0.5, 2.0])
    with tape(watch=[x]) as tp:
        y1 = nv.sin(x)
        y2 = nv.mul(x, x)
    close(gradient(tp, vs, [y1, y2], x), np.cos(x.value) + 2 * x.value)


def test_target_that_also_feeds_another_target(vs):
    x = T(0.9)
    with tape(watch=[x]) as tp:
        y = nv.sin(x)
        z = nv.exp(y)
    close(gradient(tp, vs, [y, z], x), np.cos(0.9) * (1 + np.exp(np.sin(0.9))))


# -- several outputs, zeros and None -----------------------------------------

def test_unused_output_gets_zeros(vs):
    x = T([0.2, 1.1])
    with tape(watch=[x]) as tp:
        s, c = nv.sincos(x)
        y = nv.reduce_sum(s)
    close(gradient(tp, vs, y, x), np.cos(x.value))
    (call,) = calls_of(vs, "sincos")
    assert call.out_grads[1] is not None
    assert call.out_grads[1].shape == (2,) and not call.out_grads[1].any()
    assert vs.calls["zeros_like"] == 1


def test_none_ok_indices_get_none_instead_of_zeros():
    vs = NumpyVSpace(none_ok_indices={"sincos": frozenset({1})})
    x = T([0.2, 1.1])
    with tape(watch=[x]) as tp:
        s, c = nv.sincos(x)
        y = nv.reduce_sum(s)
    close(gradient(tp, vs, y, x), np.cos(x.value))
    (call,) = calls_of(vs, "sincos")
    assert call.out_grads[1] is None
    assert vs.calls["zeros_like"] == 0


def test_none_ok_indices_only_cover_their_indices():
    vs = NumpyVSpace(none_ok_indices={"sincos": frozenset({1})})
    x = T([0.2, 1.1])
    with tape(watch=[x]) as tp:
        s, c = nv.sincos(x)
        y = nv.reduce_sum(c)  # output 0 unused, and 0 is not none-ok
    close(gradient(tp, vs, y, x), -np.sin(x.value))
    (call,) = calls_of(vs, "sincos")
    assert call.out_grads[0] is not None and not call.out_grads[0].any()
    assert vs.calls["zeros_like"] == 1


def test_build_default_zeros_false_passes_none(vs):
    x = T([0.2, 1.1])
    with tape(watch=[x]) as tp:
        lo, hi = nv.split2(nv.sin(x))
        y = nv.reduce_sum(hi)
    g = gradient(tp, vs, y, x, build_default_zeros=False)
    close(g, [0.0, np.cos(1.1)])
    (call,) = calls_of(vs, "split2")
    assert call.out_grads[0] is None
    assert vs.calls["zeros_like"] == 0


def test_op_whose_outputs_get_no_gradient_is_skipped(vs):
    x = T([0.3, 1.6])
    with tape(watch=[x]) as tp:
        r = nv.round_(nv.sin(x))  # no gradient through round
        y = nv.mul(r, x)
    g = gradient(tp, vs, y, x)
    close(g, np.round(np.sin(x.value)))
    assert vs.calls["bw:round"] == 1
    assert vs.calls["bw:sin"] == 0  # nothing reached sin's output


def test_integer_output_cuts_the_tape(vs):
    x = T([0.3, 1.6])
    with tape(watch=[x]) as tp:
        i = nv.to_int(nv.mul(x, T(3.0)))
        assert not tp.should_record([i.id], [False])
        f = nv.add(T(np.zeros(2)), T(i.value.astype(float)))  # not recorded
    assert tp.producer(f.id) is None
    assert gradient(tp, vs, f, x) is None


# -- targets, sources, given gradients ----------------------------------------

def test_source_computed_from_another_source(vs):
    # As tape.h: the walk from the targets goes through sources, so a source
    # upstream of another source gets its gradient too (tf: [108., 18.]).
    x = T(3.0)
    with tape(watch=[x]) as tp:
        y = nv.mul(x, x)
        z = nv.mul(y, y)
    gx, gy = gradient(tp, vs, z, [x, y])
    close(gx, 4 * 27.0)
    close(gy, 2 * 9.0)


def test_source_computed_from_another_source_reversed_order(vs):
    x = T(3.0)
    with tape(persistent=True, watch=[x]) as tp:
        y = nv.sin(x)
        z = nv.exp(y)
    gy, gx = gradient(tp, vs, z, [y, x])
    close(gy, np.exp(np.sin(3.0)))
    close(gx, np.exp(np.sin(3.0)) * np.cos(3.0))
    # a source between target and the other source: same via a longer path
    (gx2,) = gradient(tp, vs, z, [x])
    assert gx2.value.tobytes() == gx.value.tobytes()


def test_watched_target_that_is_a_source_gets_ones(vs):
    x = T([1.0, 2.0])
    with tape(watch=[x]) as tp:
        pass
    close(gradient(tp, vs, x, x), [1.0, 1.0])


def test_target_that_is_a_source_needs_sources_that_are_targets(vs):
    x = T([1.0, 2.0])
    tp = nv.GradientTapeCore(True)
    tp.watch(x.id)
    assert tp.compute_gradient(vs, [x.id], [x.id]) == [None]
    (g,) = tp.compute_gradient(vs, [x.id], [x.id], {x.id: x.meta})
    close(g, [1.0, 1.0])


def test_untracked_target_that_is_a_source_gets_ones(vs):
    x = T(2.0)
    tp = nv.GradientTapeCore(False)
    (g,) = tp.compute_gradient(vs, [x.id], [x.id], {x.id: x.meta})
    close(g, 1.0)


def test_recorded_target_that_is_also_a_source(vs):
    x = T(0.5)
    with tape(watch=[x]) as tp:
        y = nv.sin(x)
    gx, gy = gradient(tp, vs, y, [x, y])
    close(gx, np.cos(0.5))
    close(gy, 1.0)


def test_given_output_gradients(vs, rng):
    x = T(rng.normal(size=3))
    v = rng.normal(size=3)
    with tape(watch=[x]) as tp:
        y = nv.sin(x)
    close(gradient(tp, vs, y, x, output_gradients=[v]), v * np.cos(x.value))
    assert vs.calls["ones_like"] == 0


def test_given_output_gradients_none_means_ones(vs, rng):
    x = T(rng.normal(size=3))
    v = rng.normal(size=3)
    with tape(watch=[x]) as tp:
        y1 = nv.sin(x)
        y2 = nv.exp(x)
    g = gradient(tp, vs, [y1, y2], x, output_gradients=[None, v])
    close(g, np.cos(x.value) + v * np.exp(x.value))


def test_output_gradients_of_wrong_length_raise_before_consuming(vs):
    x = T(1.0)
    with tape(watch=[x]) as tp:
        y = nv.sin(x)
    with pytest.raises(ValueError):
        gradient(tp, vs, y, x, output_gradients=[None, None])
    assert not tp.consumed
    close(gradient(tp, vs, y, x), np.cos(1.0))


def test_unconnected_source_is_none(vs):
    x, w = T(1.0), T(2.0)
    with tape(watch=[x, w]) as tp:
        y = nv.sin(x)
        nv.exp(w)  # recorded, but does not lead to y
    gx, gw = gradient(tp, vs, y, [x, w])
    close(gx, np.cos(1.0))
    assert gw is None
    assert vs.calls["bw:exp"] == 0


def test_source_that_is_not_watched_is_none(vs):
    x, c = T([1.0, 2.0]), T([3.0, -4.0])
    with tape(watch=[x]) as tp:
        y = nv.mul(x, c)
    gx, gc = gradient(tp, vs, y, [x, c])
    close(gx, c.value)
    assert gc is None  # as tape.h: c is not on the tape
    # ... but, as tape.h, a source's gradient is wanted from the ops that
    # read it (unneeded = not tracked and not a source), so what TF's
    # gradient function would raise for it is raised.
    (call,) = calls_of(vs, "mul")
    assert call.unneeded == []


def test_target_not_on_the_tape_gives_none(vs):
    x = T(1.0)
    with tape(watch=[x]) as tp:
        pass
    y = nv.sin(x)  # after the tape
    assert gradient(tp, vs, y, x) is None


# -- persistence and payloads -------------------------------------------------

def test_persistent_tape_computes_twice_identically(vs, rng):
    x = T(rng.normal(size=4))
    with tape(persistent=True, watch=[x]) as tp:
        y = _f_fan(nv.exp(x))
        z = nv.sin(x)
    n_ops = tp.num_ops
    g1 = gradient(tp, vs, y, x)
    g2 = gradient(tp, vs, y, x)
    assert g1 is not g2
    assert g1.value.tobytes() == g2.value.tobytes()
    close(gradient(tp, vs, z, x), np.cos(x.value))
    assert tp.num_ops == n_ops and not tp.consumed
    assert all(tp.op(i).payload is not None for i in range(n_ops))


def test_non_persistent_second_compute_raises(vs):
    x = T(1.0)
    with tape(watch=[x]) as tp:
        y = nv.sin(x)
    gradient(tp, vs, y, x)
    assert tp.consumed
    with pytest.raises(RuntimeError):
        gradient(tp, vs, y, x)
    assert tp.num_ops == 0
    assert not tp.should_record([x.id])
    assert not tp.is_watched(x.id)


def _payload_refs(tp):
    return [weakref.ref(tp.op(i).payload) for i in range(tp.num_ops)]


def test_non_persistent_drops_each_payload_once_used(vs):
    x, w = T(0.5), T(2.0)
    with tape(watch=[x, w]) as tp:
        nv.exp(w)                      # op 0: never reached from the target
        a = nv.sin(x)                  # op 1
        p = nv.mul(nv.sin(w), a)       # ops 2 (reads no source), 3
        y = nv.exp(nv.cos(p))          # ops 4, 5
    refs = _payload_refs(tp)
    alive = []
    vs.on_backward = lambda op, payload, u, g: alive.append(
        (op, [i for i, r in enumerate(refs) if r() is not None]))
    gradient(tp, vs, y, x)
    # unreachable and pruned payloads go at once; each used one right after
    # its call (the one being called is alive: it is the argument)
    assert alive == [("exp", [1, 3, 4, 5]), ("cos", [1, 3, 4]),
                     ("mul", [1, 3]), ("sin", [1])]
    assert all(r() is None for r in refs)


def test_persistent_keeps_payloads(vs):
    x = T(0.5)
    with tape(persistent=True, watch=[x]) as tp:
        y = nv.exp(nv.cos(nv.sin(x)))
    refs = _payload_refs(tp)
    gradient(tp, vs, y, x)
    assert all(r() is not None for r in refs)
    del tp
    assert all(r() is None for r in refs)


def test_payloads_released_when_backward_raises(vs):
    x = T(0.5)
    with tape(watch=[x]) as tp:
        y = nv.exp(nv.sin(x))
    refs = _payload_refs(tp)

    def boom(p, u, g):
        raise KeyError("boom")
    vs.overrides["sin"] = boom
    with pytest.raises(KeyError):
        gradient(tp, vs, y, x)
    assert tp.consumed and tp.num_ops == 0
    assert all(r() is None for r in refs)


def test_retain_keeps_a_non_persistent_trace_until_release(vs):
    x = T([0.2, 0.9])
    v = np.array([2.0, -1.0])
    with tape(watch=[x]) as tp:
        y = nv.exp(nv.sin(x))
    refs = _payload_refs(tp)
    dy = np.exp(np.sin(x.value)) * np.cos(x.value)
    (g1,) = tp.compute_gradient(vs, [y.id], [x.id], retain=True)
    (g2,) = tp.compute_gradient(vs, [y.id], [x.id], None, [T(v)], retain=True)
    close(g1, dy)
    close(g2, v * dy)
    assert not tp.consumed and tp.num_ops == 2
    assert all(r() is not None for r in refs)
    tp.release()
    assert tp.consumed and tp.num_ops == 0
    assert all(r() is None for r in refs)
    with pytest.raises(RuntimeError):
        tp.compute_gradient(vs, [y.id], [x.id])


def test_a_pass_without_retain_ends_a_retained_trace(vs):
    x = T(0.4)
    with tape(watch=[x]) as tp:
        y = nv.sin(x)
    tp.compute_gradient(vs, [y.id], [x.id], retain=True)
    (g,) = tp.compute_gradient(vs, [y.id], [x.id])
    close(g, np.cos(0.4))
    assert tp.consumed and tp.num_ops == 0


def test_release_of_a_persistent_tape_does_nothing(vs):
    x = T(0.4)
    with tape(persistent=True, watch=[x]) as tp:
        y = nv.sin(x)
    tp.release()
    assert not tp.consumed and tp.num_ops == 1
    close(gradient(tp, vs, y, x), np.cos(0.4))


def test_backward_returning_wrong_count_raises(vs):
    x = T(0.5)
    with tape(watch=[x]) as tp:
        y = nv.sin(x)
    vs.overrides["sin"] = lambda p, u, g: [g[0], g[0]]
    with pytest.raises(ValueError):
        gradient(tp, vs, y, x)


# -- recording ----------------------------------------------------------------

def test_should_record_and_record_operation(vs):
    x, c = T(1.0), T(2.0)
    tp = nv.GradientTapeCore(False)
    tp.watch(x.id)
    assert tp.is_watched(x.id) and tp.producer(x.id) == -1
    assert not tp.should_record([c.id])
    assert tp.should_record([c.id, x.id])
    assert not tp.should_record([c.id, x.id], [True, False])
    meta = ((), np.dtype(np.float64))
    assert tp.record_operation("sin", [c.id], [101], (meta,), None) == -1
    assert tp.record_operation("mul", [c.id, x.id], [102], (meta,), None, [True, False]) == -1
    assert tp.num_ops == 0
    with pytest.raises(ValueError):
        tp.record_operation("sincos", [x.id], [103, 104], (meta,), None)
    assert tp.record_operation("sin", [x.id], [105], (meta,), "p") == 0
    assert tp.producer(105) == 0 and tp.producer(999) is None
    entry = tp.op(0)
    assert (entry.op_type, entry.input_ids, entry.output_ids, entry.payload) == \
        ("sin", [x.id], [105], "p")
    assert entry.output_meta == (meta,)
    with pytest.raises(IndexError):
        tp.op(1)


def test_watching_a_recorded_tensor_keeps_its_producer(vs):
    x = T(0.3)
    with tape(watch=[x]) as tp:
        y = nv.sin(x)
        tp.watch(y.id)
        z = nv.exp(y)
    assert tp.producer(y.id) == 0
    close(gradient(tp, vs, z, x), np.exp(np.sin(0.3)) * np.cos(0.3))


def test_record_operation_last_writer_wins(vs):
    # custom_gradient: the output is re-recorded with its own gradient
    x = T(0.3)
    with tape(persistent=True, watch=[x]) as tp:
        y = nv.sin(x)
        tp.record_operation("double", [x.id], [y.id], (y.meta,),
                            nv.Payload("double", [x], [y], None))
        z = nv.cos(y)
    vs.overrides["double"] = lambda p, u, g: [nv.mul(g[0], T(2.0))]
    assert tp.producer(y.id) == 1
    close(gradient(tp, vs, y, x), 2.0)
    close(gradient(tp, vs, z, x), -np.sin(np.sin(0.3)) * 2.0)
    assert vs.calls["bw:sin"] == 0


# -- pruning and unneeded inputs ------------------------------------------------

def test_ops_that_read_no_source_are_never_called(vs):
    x, w = T(0.4), T(1.5)
    with tape(watch=[x, w]) as tp:
        a = w
        for _ in range(10):
            a = nv.sin(a)               # a chain that only reads w
        y = nv.mul(a, nv.cos(x))
    g = gradient(tp, vs, y, x)
    av = 1.5
    for _ in range(10):
        av = np.sin(av)
    close(g, -av * np.sin(0.4))
    assert vs.calls["bw:sin"] == 0
    assert vs.calls["call_backward"] == 2  # mul, cos
    (call,) = calls_of(vs, "mul")
    assert call.unneeded == [0]            # a does not lead to x


def test_pruned_ops_not_called_even_if_a_backward_ignores_unneeded(vs):
    # many gradient functions compute every input gradient anyway; pruning
    # alone must keep the ops that read no source from running
    def mul_all(p, unneeded, g):
        a, b = p.inputs
        return [nv.mul(g[0], b), nv.mul(g[0], a)]
    vs.overrides["mul"] = mul_all
    x, w = T(0.4), T(1.5)
    with tape(watch=[x, w]) as tp:
        a = nv.exp(nv.sin(w))
        y = nv.mul(a, nv.cos(x))
    close(gradient(tp, vs, y, x), -np.exp(np.sin(1.5)) * np.sin(0.4))
    assert vs.calls["bw:exp"] == 0 and vs.calls["bw:sin"] == 0
    assert vs.calls["call_backward"] == 2


def test_unneeded_indices_empty_when_every_input_leads_to_a_source(vs):
    x, w = T(0.4), T(1.5)
    with tape(watch=[x, w]) as tp:
        y = nv.mul(nv.sin(w), nv.cos(x))
    gx, gw = gradient(tp, vs, y, [x, w])
    close(gx, -np.sin(1.5) * np.sin(0.4))
    close(gw, np.cos(1.5) * np.cos(0.4))
    (call,) = calls_of(vs, "mul")
    assert call.unneeded == []
    assert vs.calls["bw:sin"] == 1


def test_unneeded_index_for_a_tracked_input_that_is_not_a_source(vs):
    x, w = T([[1.0, 2.0]]), T([[0.5], [0.25]])
    with tape(watch=[x, w]) as tp:
        k = nv.exp(w)                  # tracked, but w is not a source below
        y = nv.matmul(x, k)
    g = gradient(tp, vs, y, x)
    close(g, np.exp(w.value).T)
    (call,) = calls_of(vs, "matmul")
    assert call.unneeded == [1]
    assert vs.calls["bw:exp"] == 0
    assert vs.calls["bw:transpose"] == 0   # k's side of matmul's rule skipped


# -- TF's order -----------------------------------------------------------------
#
# tape.h's loop pops ops from the back of its stack but inserts newly ready
# ops at the front: the ops ready at the start run first, then the others
# first ready, first run. A tensor's gradient contributions are summed in
# the order they arrived, so this order fixes the last bits of every result.


class _LoggingVSpace(NumpyVSpace):
    """Logs the values handed to each aggregate call."""

    def __init__(self):
        super().__init__()
        self.aggregated = []

    def aggregate(self, grads):
        self.aggregated.append([float(g.value) for g in grads])
        return super().aggregate(grads)


def test_ops_run_first_ready_first_run_and_contributions_sum_in_that_order():
    vs = _LoggingVSpace()
    x = T(0.5)
    with tape(watch=[x]) as tp:
        y = nv.add(nv.add(nv.sin(x), nv.exp(x)), nv.cos(x))
    g = gradient(tp, vs, y, x)
    # The outer add readies the inner add (its input 0) and cos (input 1);
    # the inner add then readies sin and exp, which run after cos.
    assert [c.op_type for c in vs.backward_log] == [
        "add", "add", "cos", "sin", "exp"]
    v = 0.5
    assert vs.aggregated == [[-np.sin(v), np.cos(v), np.exp(v)]]
    close(g, np.cos(v) + np.exp(v) - np.sin(v))


def test_a_deep_branch_waits_for_the_shallow_ones():
    # x feeds a chain of three ops and two single ops: the single ops'
    # contributions arrive first although the chain was recorded last.
    vs = _LoggingVSpace()
    x = T(0.25)
    with tape(watch=[x]) as tp:
        deep = nv.sin(nv.sin(nv.sin(x)))
        y = nv.add(nv.add(deep, nv.exp(x)), nv.neg(x))
    gradient(tp, vs, y, x)
    assert [c.op_type for c in vs.backward_log] == [
        "add", "add", "neg", "sin", "exp", "sin", "sin"]
    assert vs.aggregated[0][:2] == [-1.0, float(np.exp(0.25))]


@pytest.mark.parametrize("k, expected", [
    (0, ["neg", "exp", "cos", "sin"]),
    # 14 reachable ops: TF's unordered_map has rehashed to 29 buckets.
    (10, ["cos", "exp", "neg", "sin"]),
    (11, ["exp", "neg", "cos", "sin"]),
])
def test_several_initial_ops_run_in_the_order_of_tf_s_hash_map(k, expected):
    """Ops whose outputs are only targets start the pass in the iteration
    order of tape.h's unordered_map of the reachable ops (filled depth
    first from the last target; a std::unordered_map<int64>, replayed),
    popped from the back: not simply by op id."""
    vs = NumpyVSpace()
    x = T(0.5)
    with tape(watch=[x]) as tp:
        h = x
        for _ in range(k):
            h = nv.identity(h)
        ys = [nv.sin(h), nv.cos(h), nv.exp(h), nv.neg(h)]
    gradient(tp, vs, ys, x)
    assert [c.op_type for c in vs.backward_log[:4]] == expected


# -- early aggregation ----------------------------------------------------------

@pytest.mark.parametrize("dtype, fake, expected", [
    # 5 pending x 2**22 elements x 8 bytes = 160 MiB > 128 MiB: summed at 5
    (np.float64, 2 ** 22, [5, 5, 2]),
    # 4-byte elements: 8 pending are exactly 128 MiB, not over: summed at 9
    (np.float32, 2 ** 22, [9, 2]),
    # real (tiny) sizes: summed once, at the end
    (np.float64, None, [10]),
], ids=["f64", "f32", "small"])
def test_early_aggregation(dtype, fake, expected):
    vs = NumpyVSpace()
    vs.fake_num_elements = fake
    x = T(np.array([0.5, -1.0], dtype=dtype))
    with tape(watch=[x]) as tp:
        ys = [nv.mul(x, T(np.full(2, k + 1.0, dtype=dtype))) for k in range(10)]
        total = ys[0]
        for y in ys[1:]:
            total = nv.add(total, y)
    g = gradient(tp, vs, total, x)
    assert g.dtype == dtype
    close(g, [55.0, 55.0])
    assert vs.aggregate_sizes == expected
    if fake is not None:
        assert vs.calls["num_elements"] == 1  # size computed once per tensor
        assert vs.calls["element_size"] == 1


def test_early_aggregation_of_an_intermediate_tensor():
    vs = NumpyVSpace()
    vs.fake_num_elements = 2 ** 22
    x = T([0.5, -1.0])
    with tape(watch=[x]) as tp:
        h = nv.sin(x)
        total = nv.mul(h, T(1.0))
        for k in range(1, 12):
            total = nv.add(total, nv.mul(h, T(k + 1.0)))
    g = gradient(tp, vs, total, x)
    close(g, 78.0 * np.cos(x.value))
    assert vs.aggregate_sizes == [5, 5, 4]  # 12 = 5, then 1 + 4, then 1 + 3
    (sin_call,) = calls_of(vs, "sin")
    close(sin_call.out_grads[0], [78.0, 78.0])


# -- delete_trace -------------------------------------------------------------

def test_delete_trace_releases_ops_no_live_tensor_needs(vs):
    x = T(0.6)
    with tape(watch=[x]) as tp:
        y = nv.sin(x)           # op 0
        z = nv.exp(y)           # op 1
        refs = _payload_refs(tp)
        assert tp.num_ops == 2
        tp.delete_trace(y.id)   # y is still read by op 1: nothing released
        assert tp.num_ops == 2 and tp.producer(y.id) == 0
        tp.delete_trace(z.id)   # z dead: op 1 goes, then y's last use: op 0
        assert tp.num_ops == 0
        assert tp.op(0) is None and tp.op(1) is None
        assert tp.producer(z.id) is None and tp.producer(y.id) is None
        assert all(r() is None for r in refs)
        assert tp.is_watched(x.id) and tp.producer(x.id) == -1
        tp.delete_trace(x.id)   # watched tensors stay watched
        assert tp.is_watched(x.id)
        tp.delete_trace(123456789)  # unknown: nothing
        w = nv.cos(x)           # the tape goes on recording from x
    assert tp.num_ops == 1
    close(gradient(tp, vs, w, x), -np.sin(0.6))


def test_delete_trace_in_the_other_order(vs):
    x = T(0.6)
    with tape(watch=[x]) as tp:
        y = nv.sin(x)
        z = nv.exp(y)
        tp.delete_trace(z.id)   # op 1 released; y still alive
        assert tp.num_ops == 1 and tp.op(1) is None and tp.op(0) is not None
        tp.delete_trace(y.id)
        assert tp.num_ops == 0


def test_delete_trace_keeps_an_op_while_one_output_lives(vs):
    x = T(0.6)
    with tape(watch=[x]) as tp:
        s, c = nv.sincos(x)
        tp.delete_trace(s.id)
        assert tp.num_ops == 1
        y = nv.mul(c, c)
    close(gradient(tp, vs, y, x), -2 * np.cos(0.6) * np.sin(0.6))


def test_delete_trace_releases_a_multi_output_op_with_its_last_output(vs):
    x = T(0.6)
    with tape(watch=[x]) as tp:
        s, c = nv.sincos(x)
        tp.delete_trace(c.id)
        tp.delete_trace(s.id)
    assert tp.num_ops == 0


def test_delete_trace_leaves_unrelated_branches(vs):
    x = T(0.6)
    with tape(watch=[x]) as tp:
        a = nv.sin(x)
        b = nv.cos(x)
        tp.delete_trace(a.id)
        y = nv.exp(b)
    assert tp.num_ops == 2
    close(gradient(tp, vs, y, x), -np.exp(np.cos(0.6)) * np.sin(0.6))


# -- export_trace ---------------------------------------------------------------

def test_export_trace_csr(vs):
    x, w = T([0.1, 0.2]), T([1.0, 2.0])
    with tape(watch=[x, w]) as tp:
        s, c = nv.sincos(x)      # op 0: [x] -> [s, c]
        y = nv.mul(s, w)         # op 1: [s, w] -> [y]
        z = nv.add(y, c)         # op 2: [y, c] -> [z]
        v = nv.mul(z, z)         # op 3: [z, z] -> [v]
    tr = tp.export_trace()
    for key in ("op_ids", "op_type_index", "input_offsets", "input_ids",
                "output_offsets", "output_ids"):
        assert tr[key].dtype == np.int64, key
    assert tr["op_ids"].tolist() == [0, 1, 2, 3]
    assert tr["op_types"] == ["sincos", "mul", "add"]
    assert tr["op_type_index"].tolist() == [0, 1, 2, 1]
    assert tr["input_offsets"].tolist() == [0, 1, 3, 5, 7]
    assert tr["input_ids"].tolist() == [x.id, s.id, w.id, y.id, c.id, z.id, z.id]
    assert tr["output_offsets"].tolist() == [0, 2, 3, 4, 5]
    assert tr["output_ids"].tolist() == [s.id, c.id, y.id, z.id, v.id]
    for k, op_id in enumerate(tr["op_ids"]):
        entry = tp.op(int(op_id))
        io, oo = tr["input_offsets"], tr["output_offsets"]
        assert tr["input_ids"][io[k]:io[k + 1]].tolist() == entry.input_ids
        assert tr["output_ids"][oo[k]:oo[k + 1]].tolist() == entry.output_ids
        assert tr["op_types"][tr["op_type_index"][k]] == entry.op_type

    tp.delete_trace(v.id)        # op 3 released
    tr = tp.export_trace()
    assert tr["op_ids"].tolist() == [0, 1, 2]
    assert tr["input_offsets"].tolist() == [0, 1, 3, 5]
    assert tr["output_offsets"].tolist() == [0, 2, 3, 4]
    assert tr["op_types"] == ["sincos", "mul", "add"]


def test_export_trace_skips_released_ops_in_the_middle(vs):
    x = T(0.1)
    with tape(watch=[x]) as tp:
        a = nv.sin(x)            # op 0, released below
        b = nv.cos(x)            # op 1
        c = nv.exp(b)            # op 2
        tp.delete_trace(a.id)
    tr = tp.export_trace()
    assert tr["op_ids"].tolist() == [1, 2]
    assert tr["op_types"] == ["cos", "exp"]
    assert tr["op_type_index"].tolist() == [0, 1]
    assert tr["input_offsets"].tolist() == [0, 1, 2]
    assert tr["input_ids"].tolist() == [x.id, b.id]
    assert tr["output_ids"].tolist() == [b.id, c.id]


def test_export_trace_of_an_empty_tape():
    tr = nv.GradientTapeCore(False).export_trace()
    assert tr["op_ids"].size == 0 and tr["input_ids"].size == 0
    assert tr["input_offsets"].tolist() == [0] and tr["output_offsets"].tolist() == [0]
    assert tr["op_types"] == []


# -- higher order ---------------------------------------------------------------

def test_second_derivative_of_sin_is_minus_sin(vs):
    x = T([0.3, 1.0, 2.5])
    with tape(watch=[x]) as outer:
        with tape(watch=[x]) as inner:
            y = nv.sin(x)
        dy = gradient(inner, vs, y, x)
    d2 = gradient(outer, vs, dy, x)
    close(dy, np.cos(x.value))
    close(d2, -np.sin(x.value))


def test_third_derivative_of_sin(vs):
    x = T([0.3, 1.0])
    with tape(watch=[x]) as t3:
        with tape(watch=[x]) as t2:
            with tape(watch=[x]) as t1:
                y = nv.sin(x)
            d1 = gradient(t1, vs, y, x)
        d2 = gradient(t2, vs, d1, x)
    d3 = gradient(t3, vs, d2, x)
    close(d3, -np.cos(x.value))


def test_mixed_second_derivative(vs):
    x, y = T(0.7), T(-1.2)
    with tape(watch=[x, y]) as outer:
        with tape(watch=[x, y]) as inner:
            f = nv.mul(nv.mul(x, y), nv.sin(x))   # x y sin x
        dfdx = gradient(inner, vs, f, x)
    d2 = gradient(outer, vs, dfdx, [x, y])
    close(dfdx, -1.2 * (np.sin(0.7) + 0.7 * np.cos(0.7)))
    close(d2[1], np.sin(0.7) + 0.7 * np.cos(0.7))
    close(d2[0], -1.2 * (2 * np.cos(0.7) - 0.7 * np.sin(0.7)))


def test_hessian_vector_product_against_differences_of_gradients(vs, rng):
    x0 = rng.normal(size=3)
    v = rng.normal(size=3)

    def f(x):
        return nv.reduce_sum(nv.mul(nv.exp(nv.sin(x)), nv.cos(nv.mul(x, x))))

    def grad_at(a):
        x = T(a)
        with tape(watch=[x]) as tp:
            y = f(x)
        return gradient(tp, vs, y, x).value

    x = T(x0)
    with tape(watch=[x]) as outer:
        with tape(watch=[x]) as inner:
            y = f(x)
        g = gradient(inner, vs, y, x)
        gv = nv.reduce_sum(nv.mul(g, T(v)))
    hv = gradient(outer, vs, gv, x)
    eps = 1e-6
    numeric = (grad_at(x0 + eps * v) - grad_at(x0 - eps * v)) / (2 * eps)
    close(hv, numeric, rtol=1e-6, atol=1e-7)


def test_op_recorded_after_a_reader_of_its_output(vs):
    # record_operation may record an op after an op that read its output:
    # op ids are then no order of the computation, and pruning must still
    # find the reader (tape.h walks the readers; fasttape's sweep in op-id
    # order falls back to that walk).
    x, s = T(3.0), T(5.0)
    t = T(5.0)      # stands for s's copy, recorded only later
    with tape(persistent=True, watch=[x, s]) as tp:
        b = nv.mul(x, t)
        nv._record("identity", [s], [t])
    (gs,) = gradient(tp, vs, b, [s])
    close(gs, 3.0)
    ops, needed = tp.path([b.id], [s.id])
    assert len(ops) == 2 and t.id in needed


def test_a_tape_reserves_the_map_sizes_the_last_recording_tape_reached(vs):
    # A loop records about as much every step: the next tape sizes its maps
    # at its first op for as many entries as the last recording tape's
    # held at most (no rehash on the way), up to a cap; a tape that records
    # nothing leaves the hint alone, and a small tape after a large one
    # passes its own small size on (bucket counts never shrink: they would
    # have kept the large size for good).
    from fasttape import _core
    meta = ((), np.dtype(np.float64))

    def record_chain(n, first_id):
        tp = nv.GradientTapeCore(False)
        tp.watch(first_id)
        for k in range(n):
            tp.record_operation("sin", [first_id + k], [first_id + k + 1],
                                (meta,), None)
        return tp

    tp = record_chain(3000, 10_000)
    peaks = _core.map_sizes(tp)[2:4]
    assert peaks == (3001, 3001)      # the watched tensor and 3000 outputs
    assert min(_core.map_sizes(tp)[:2]) >= 3000
    del tp
    assert _core.map_sizes(nv.GradientTapeCore(False))[4:] == peaks
    empty = nv.GradientTapeCore(False)     # a tape that records nothing
    empty.watch(1)
    del empty
    assert _core.map_sizes(nv.GradientTapeCore(False))[4:] == peaks
    tp = record_chain(1, 20_000)
    assert min(_core.map_sizes(tp)[:2]) >= 3001     # reserved, not grown
    del tp
    assert _core.map_sizes(nv.GradientTapeCore(False))[4:] == (2, 2)
    tp = record_chain(20_000, 40_000)
    del tp
    hint = _core.map_sizes(nv.GradientTapeCore(False))[4:]
    assert hint == (1 << 13, 1 << 13)   # capped
