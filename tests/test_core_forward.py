"""Forward mode of fasttape's core (ForwardAccumulatorCore) on the NumPy
framework: JVPs through direct forward rules and through the transposition
fallback, checked against reverse mode with <J v, u> = <v, J^T u>; batched
tangents; call-state semantics; nesting with tapes and accumulators."""

import numpy as np
import pytest

import numpy_vspace as nv
from numpy_vspace import T, NumpyVSpace, forward_accumulator, gradient, tape


def close(a, b, rtol=1e-12, atol=1e-12):
    np.testing.assert_allclose(nv.value(a), b, rtol=rtol, atol=atol)


def f_mix(x, w):
    """R^(3x2) x R^(4x3) -> R^(4x2): every op of numpy_vspace with a rule or
    not (matmul, sincos, exp, mul, sub, neg, add, transpose, identity,
    split2/concat, reduce_sum/broadcast_to)."""
    h = nv.matmul(w, x)
    s, c = nv.sincos(h)
    a = nv.sub(nv.mul(s, nv.exp(nv.neg(h))), c)
    b = nv.transpose(nv.identity(nv.transpose(nv.sin(a))))
    m = nv.broadcast_to(nv.reduce_sum(nv.mul(x, x)), b.shape)
    return nv.add(nv.mul(b, a), nv.cos(m))


def f_vec(x):
    """R^6 -> R^6 with a two-output split and concat."""
    lo, hi = nv.split2(nv.mul(x, nv.sin(x)))
    return nv.concat(nv.exp(hi), nv.add(lo, nv.mul(lo, hi)))


def jvp(f, primals, tangents, vs, use_batch=False):
    with forward_accumulator(vs, primals, tangents, use_batch) as acc:
        y = f(*primals)
    return acc.fetch_jvp(y.id), y, acc


def vjp(f, primals, u, vs):
    with tape(watch=primals) as tp:
        y = f(*primals)
    return gradient(tp, vs, y, primals, output_gradients=[u])


def inner(a, b):
    return float(sum(np.vdot(nv.value(p), nv.value(q)) for p, q in zip(a, b)))


# -- JVPs against reverse mode -------------------------------------------------

@pytest.mark.parametrize("rules", [True, False], ids=["rules", "fallback"])
def test_inner_product_identity(rules, rng):
    for _ in range(3):
        x, w = T(rng.normal(size=(3, 2))), T(rng.normal(size=(4, 3)))
        vx, vw = rng.normal(size=(3, 2)), rng.normal(size=(4, 3))
        u = rng.normal(size=(4, 2))
        vs = NumpyVSpace(forward_rules=rules)
        jv, y, _ = jvp(f_mix, [x, w], [vx, vw], vs)
        assert jv.shape == y.shape == (4, 2)
        jtu = vjp(f_mix, [x, w], u, NumpyVSpace())
        lhs = float(np.vdot(jv.value, u))
        rhs = inner([vx, vw], jtu)
        assert lhs == pytest.approx(rhs, rel=1e-10, abs=1e-12)
        if rules:
            assert vs.calls["rule:mul"] > 0 and vs.calls["rule:sin"] > 0
            assert vs.calls["fallback"] > 0      # matmul, sincos, ... have none
        else:
            assert not any(k.startswith("rule:") for k in vs.calls)
            assert vs.calls["fallback"] == vs.calls["forward_rule"] > 0


@pytest.mark.parametrize("rules", [True, False], ids=["rules", "fallback"])
def test_inner_product_identity_two_output_op(rules, rng):
    x = T(rng.normal(size=6))
    v, u = rng.normal(size=6), rng.normal(size=6)
    jv, _, _ = jvp(f_vec, [x], [v], NumpyVSpace(forward_rules=rules))
    (jtu,) = vjp(f_vec, [x], u, NumpyVSpace())
    assert float(np.vdot(jv.value, u)) == pytest.approx(float(np.vdot(v, jtu.value)), rel=1e-10)


def test_direct_rules_and_fallback_agree(rng):
    x, w = T(rng.normal(size=(3, 2))), T(rng.normal(size=(4, 3)))
    vx, vw = rng.normal(size=(3, 2)), rng.normal(size=(4, 3))
    a, _, _ = jvp(f_mix, [x, w], [vx, vw], NumpyVSpace(forward_rules=True))
    b, _, _ = jvp(f_mix, [x, w], [vx, vw], NumpyVSpace(forward_rules=False))
    close(a, b.value, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("rules", [True, False], ids=["rules", "fallback"])
def test_jvp_analytic(rules):
    x = T([0.3, -1.1])
    v = np.array([2.0, 0.5])
    vs = NumpyVSpace(forward_rules=rules)
    jv, _, acc = jvp(lambda x: nv.mul(nv.sin(x), x), [x], [v], vs)
    xv = x.value
    close(jv, (np.cos(xv) * xv + np.sin(xv)) * v)
    if rules:
        assert vs.calls["rule:sin"] == 1 and vs.calls["rule:mul"] == 1
        assert vs.calls["call_backward"] == 0
    else:
        assert vs.calls["fallback"] == 2
        assert vs.calls["bw:sin"] >= 1 and vs.calls["bw:mul"] >= 1
    # the ops the rules ran are not accumulated: only x, sin(x) and y
    assert len(acc) == 3


@pytest.mark.parametrize("rules", [True, False], ids=["rules", "fallback"])
def test_jvp_matches_central_differences(rules, rng):
    x0, v = rng.normal(size=6), rng.normal(size=6)
    jv, _, _ = jvp(f_vec, [T(x0)], [v], NumpyVSpace(forward_rules=rules))
    eps = 1e-6
    with nv.stop_recording():
        numeric = (f_vec(T(x0 + eps * v)).value - f_vec(T(x0 - eps * v)).value) / (2 * eps)
    close(jv, numeric, rtol=1e-6, atol=1e-8)


def test_fallback_with_an_identity_like_backward(rng):
    # add's backward hands the output gradient itself to both inputs: the
    # transposition's targets are then the stand-in itself, twice.
    x, y = T(rng.normal(size=3)), T(rng.normal(size=3))
    vx, vy = rng.normal(size=3), rng.normal(size=3)
    vs = NumpyVSpace(forward_rules=False)
    jv, _, _ = jvp(lambda a, b: nv.add(nv.identity(a), b), [x, y], [vx, vy], vs)
    close(jv, vx + vy, rtol=0, atol=0)


def test_unwatched_float_input_gets_zero_tangent(vs):
    x, c = T([1.0, 2.0]), T([3.0, 4.0])
    seen = []
    vs.on_forward = lambda op, p, tangents, b: seen.append([nv.value(t) for t in tangents])
    with forward_accumulator(vs, [x], [[1.0, 1.0]]) as acc:
        y = nv.mul(x, c)
    close(acc.fetch_jvp(y.id), c.value)
    assert len(seen) == 1
    close(seen[0][1], [0.0, 0.0])
    assert vs.calls["zeros_like"] == 1


def test_non_trainable_inputs_have_no_tangent(vs):
    x = T([1.5, 2.5])
    with forward_accumulator(vs, [x], [[1.0, 1.0]]) as acc:
        i = nv.to_int(x)
        assert acc.fetch_jvp(i.id) is None
        assert not acc.should_record([i.id], [False])
        acc.watch(i.id, T([1.0, 1.0]))  # even watched, an int input is not trainable
        assert not acc.should_record([i.id], [False])
        assert acc.should_record([i.id, x.id], [False, True])


# -- batched tangents ----------------------------------------------------------

@pytest.mark.parametrize("rules", [True, False], ids=["rules", "fallback"])
def test_batched_tangents_equal_per_vector_jvps(rules, rng):
    batch = 4
    x, w = T(rng.normal(size=(3, 2))), T(rng.normal(size=(4, 3)))
    vx, vw = rng.normal(size=(batch, 3, 2)), rng.normal(size=(batch, 4, 3))
    vs = NumpyVSpace(forward_rules=rules)
    jb, _, _ = jvp(f_mix, [x, w], [vx, vw], vs, use_batch=True)
    assert jb.shape == (batch, 4, 2)
    for b in range(batch):
        jv, _, _ = jvp(f_mix, [x, w], [vx[b], vw[b]], NumpyVSpace(forward_rules=rules))
        close(jb.value[b], jv.value, rtol=1e-12, atol=1e-14)
    assert vs.calls["unbatch"] > 0 and vs.calls["batch"] > 0


@pytest.mark.parametrize("rules", [True, False], ids=["rules", "fallback"])
def test_batched_tangents_with_unwatched_inputs(rules, rng):
    # c and w have no tangent: the core makes unbatched zeros for them, which
    # the batched fallback must not unbatch (w, read last, has 2 rows for a
    # batch of 3; c has as many rows as the batch)
    batch = 3
    c, w = T(rng.normal(size=(3, 2))), T(rng.normal(size=(2, 5)))

    def f(x):
        return nv.mul(nv.sin(nv.matmul(nv.sub(x, c), w)), nv.matmul(x, w))
    x = T(rng.normal(size=(3, 2)))
    v = rng.normal(size=(batch, 3, 2))
    jb, _, _ = jvp(f, [x], [v], NumpyVSpace(forward_rules=rules), use_batch=True)
    assert jb.shape == (batch, 3, 5)
    for b in range(batch):
        jv, _, _ = jvp(f, [x], [v[b]], NumpyVSpace(forward_rules=rules))
        close(jb.value[b], jv.value, rtol=1e-12, atol=1e-14)


def test_batched_rules_get_none_for_inputs_without_tangent():
    # unbatched zeros would have the wrong rank: batched rules get None
    vs = NumpyVSpace()
    seen = []
    vs.on_forward = lambda op, p, tangents, b: seen.append(
        (op, [None if t is None else t.shape for t in tangents], b))
    x, c = T(np.ones(2)), T([5.0, 6.0])
    v = np.arange(6.0).reshape(3, 2)
    with forward_accumulator(vs, [x], [v], use_batch=True) as acc:
        y = nv.mul(x, c)
    assert seen == [("mul", [(3, 2), None], True)]
    close(acc.fetch_jvp(y.id), v * c.value)


def test_batched_two_output_op(rng):
    batch = 3
    x = T(rng.normal(size=6))
    v = rng.normal(size=(batch, 6))
    jb, _, _ = jvp(f_vec, [x], [v], NumpyVSpace(forward_rules=False), use_batch=True)
    for b in range(batch):
        jv, _, _ = jvp(f_vec, [x], [v[b]], NumpyVSpace(forward_rules=False))
        close(jb.value[b], jv.value)


# -- call state ------------------------------------------------------------------

def test_busy_accumulating_and_push_pop_state(vs):
    x = T(0.4)
    seen = {}
    with forward_accumulator(vs, [x], [1.0]) as acc:
        assert not acc.busy_accumulating()
        with pytest.raises(RuntimeError):
            acc.pop_state()

        def hook(op_type, payload, tangents, use_batch):
            if op_type != "sin":
                return
            seen["busy"] = acc.busy_accumulating()
            seen["records_x"] = acc.should_record([x.id])
            acc.push_state()
            try:
                seen["busy_pushed"] = acc.busy_accumulating()
                seen["records_x_pushed"] = acc.should_record([x.id])
                z = nv.exp(x)  # accumulated again: the state was pushed
                seen["z"] = acc.fetch_jvp(z.id)
            finally:
                acc.pop_state()
            seen["busy_popped"] = acc.busy_accumulating()
        vs.on_forward = hook
        y = nv.sin(x)
        vs.on_forward = None
        assert not acc.busy_accumulating()
    assert seen["busy"] and not seen["records_x"]
    assert not seen["busy_pushed"] and seen["records_x_pushed"]
    close(seen["z"], np.exp(0.4))
    assert seen["busy_popped"]
    close(acc.fetch_jvp(y.id), np.cos(0.4))
    # x, z, y: the sin rule's own ops were not accumulated
    assert len(acc) == 3


def test_busy_state_restored_when_the_rule_raises(vs):
    x = T(0.4)

    def hook(op_type, payload, tangents, use_batch):
        raise KeyError("rule failed")
    with forward_accumulator(vs, [x], [1.0]) as acc:
        vs.on_forward = hook
        with pytest.raises(KeyError):
            nv.sin(x)
        vs.on_forward = None
        assert not acc.busy_accumulating()
        y = nv.sin(x)
    close(acc.fetch_jvp(y.id), np.cos(0.4))


def test_should_record_inside_the_fallback_asks_the_inner_tape():
    vs = NumpyVSpace(forward_rules=False)
    x, other = T(0.4), T(1.0)
    seen = {}
    with forward_accumulator(vs, [x], [1.0]) as acc:
        def hook(op_type, payload, unneeded, out_grads):
            if op_type == "sin" and not seen:  # sin's rule being transposed
                seen["busy"] = acc.busy_accumulating()
                seen["aid"] = acc.should_record([out_grads[0].id])
                seen["unrelated"] = acc.should_record([other.id])
                seen["x"] = acc.should_record([x.id])
        vs.on_backward = hook
        y = nv.sin(x)
    assert seen == {"busy": True, "aid": True, "unrelated": False, "x": False}
    close(acc.fetch_jvp(y.id), np.cos(0.4))


def test_forward_rule_returning_wrong_count_raises():
    class Bad(NumpyVSpace):
        def forward_rule(self, op_type, payload, in_tangents, use_batch):
            return [None, None]
    x = T(0.4)
    with forward_accumulator(Bad(), [x], [1.0]) as acc:
        with pytest.raises(ValueError):
            nv.sin(x)
        assert not acc.busy_accumulating()


# -- watch, fetch, delete ----------------------------------------------------------

def test_watch_twice_adds_tangents(vs):
    x = T([0.2, 0.9])
    v1, v2 = np.array([1.0, 2.0]), np.array([0.5, -3.0])
    acc = nv.ForwardAccumulatorCore(vs)
    acc.watch(x.id, T(v1))
    acc.watch(x.id, T(v2))
    close(acc.fetch_jvp(x.id), v1 + v2)
    assert vs.aggregate_sizes == [2]
    assert len(acc) == 1
    nv.ACCUMULATORS.append(acc)
    y = nv.sin(x)
    close(acc.fetch_jvp(y.id), np.cos(x.value) * (v1 + v2))


def test_fetch_jvp_and_delete_gradient(vs):
    x, c = T(0.2), T(5.0)
    with forward_accumulator(vs, [x], [1.0]) as acc:
        assert acc.fetch_jvp(c.id) is None
        y = nv.sin(x)
        assert len(acc) == 2
        acc.delete_gradient(y.id)
        acc.delete_gradient(987654321)   # unknown: nothing
        assert acc.fetch_jvp(y.id) is None and len(acc) == 1
        assert not acc.should_record([y.id])
        z = nv.exp(y)                     # y has no tangent any more
        assert acc.fetch_jvp(z.id) is None
        w = nv.mul(y, x)                  # x still has one
        close(acc.fetch_jvp(w.id), np.sin(0.2))


def test_first_tangent_wins_when_an_output_is_accumulated_again(vs):
    x, c = T(0.2), T(3.0)
    with forward_accumulator(vs, [x], [1.0]) as acc:
        y = nv.sin(x)
        first = acc.fetch_jvp(y.id)
        # recompute_grad: another op claims to produce y
        payload = nv.Payload("mul", [x, c], [y], None)
        assert acc.accumulate("mul", [x.id, c.id], (x.meta, c.meta), [y.id],
                              (y.meta,), payload)
        assert acc.fetch_jvp(y.id) is first


def test_accumulate_ignores_ops_reading_nothing_tracked(vs):
    x, c = T(0.2), T(3.0)
    acc = nv.ForwardAccumulatorCore(vs)
    acc.watch(x.id, T(1.0))
    y = T(9.0)
    payload = nv.Payload("sin", [c], [y], None)
    assert not acc.accumulate("sin", [c.id], (c.meta,), [y.id], (y.meta,), payload)
    assert acc.fetch_jvp(y.id) is None and vs.calls["forward_rule"] == 0


# -- nesting ------------------------------------------------------------------------

@pytest.mark.parametrize("rules", [True, False], ids=["rules", "fallback"])
def test_nested_accumulators_second_derivative(rules):
    vs = NumpyVSpace(forward_rules=rules)
    x = T([0.3, 1.7])
    with forward_accumulator(vs, [x], [np.ones(2)]) as outer:
        with forward_accumulator(vs, [x], [np.ones(2)]) as inner_acc:
            y = nv.sin(x)
        dy = inner_acc.fetch_jvp(y.id)
    close(dy, np.cos(x.value))
    close(outer.fetch_jvp(dy.id), -np.sin(x.value))


def _f_hvp(x):
    return nv.reduce_sum(nv.mul(nv.sin(x), x))


def _hvp_expected(x, v):
    return (2 * np.cos(x) - x * np.sin(x)) * v


@pytest.mark.parametrize("rules", [True, False], ids=["rules", "fallback"])
def test_tape_over_accumulator_hvp(rules, rng):
    vs = NumpyVSpace(forward_rules=rules)
    x, v = T(rng.normal(size=3)), rng.normal(size=3)
    with tape(watch=[x]) as tp:
        with forward_accumulator(vs, [x], [v]) as acc:
            y = _f_hvp(x)
        j = acc.fetch_jvp(y.id)
    close(j, np.vdot(np.cos(x.value) * x.value + np.sin(x.value), v))
    close(gradient(tp, vs, j, x), _hvp_expected(x.value, v))


@pytest.mark.parametrize("rules", [True, False], ids=["rules", "fallback"])
def test_accumulator_over_tape_hvp(rules, rng):
    vs = NumpyVSpace(forward_rules=rules)
    x, v = T(rng.normal(size=3)), rng.normal(size=3)
    with forward_accumulator(vs, [x], [v]) as acc:
        with tape(watch=[x]) as tp:
            y = _f_hvp(x)
        g = gradient(tp, vs, y, x)
    close(g, np.cos(x.value) * x.value + np.sin(x.value))
    close(acc.fetch_jvp(g.id), _hvp_expected(x.value, v))


def test_fallback_records_the_backward_on_outer_tapes(rng):
    # the transposition runs real ops: an outer tape sees them, and the
    # gradient of a JVP built by the fallback is right (checked above); here:
    # the inner tape of the fallback never leaks into the framework's list.
    vs = NumpyVSpace(forward_rules=False)
    x = T(rng.normal(size=3))
    with tape(watch=[x]) as tp:
        with forward_accumulator(vs, [x], [np.ones(3)]):
            nv.exp(nv.sin(x))
        assert nv.TAPES == [tp]
    assert tp.num_ops > 2
