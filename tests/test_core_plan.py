"""GradientTapeCore.plan: the shape of a backward pass, which fasttape's
compiled backward keys its cache on. Equal programs must give equal codes
(whatever the ids), and any difference in what the pass computes must give
a different code."""

import numpy as np
import pytest

import numpy_vspace as nv
from numpy_vspace import T, NumpyVSpace, gradient, tape


def _plan(f, n_sources=1, persistent=False, sources_first=False):
    xs = [T(np.arange(3.0) + i) for i in range(n_sources)]
    with tape(persistent=persistent, watch=xs) as tp:
        y = f(*xs)
    return tp, y, xs, tp.plan([y.id], [x.id for x in xs])


def _sin_mul(x):
    return nv.mul(nv.sin(x), x)


def test_same_program_same_code_whatever_the_ids():
    _, _, _, (code1, entries1) = _plan(_sin_mul)
    nv.T(np.zeros(5))          # move the id counter on
    _, _, _, (code2, entries2) = _plan(_sin_mul)
    assert code1 == code2
    assert [e.op_type for e in entries1] == [e.op_type for e in entries2] == ["sin", "mul"]


@pytest.mark.parametrize("other", [
    lambda x: nv.mul(x, nv.sin(x)),           # inputs swapped
    lambda x: nv.mul(nv.sin(x), nv.sin(x)),   # two producers
    lambda x: nv.sin(nv.mul(x, x)),           # order
], ids=["swapped", "two_sins", "order"])
def test_different_structure_different_code(other):
    code1 = _plan(_sin_mul)[3][0]
    code2 = _plan(other)[3][0]
    assert code1 != code2


def test_pruned_ops_are_left_out():
    def f(x):
        c = T(np.ones(3))                       # not watched: its op is pruned
        return nv.add(nv.sin(x), nv.exp(c))
    _, _, _, (_, entries) = _plan(f)
    assert [e.op_type for e in entries] == ["sin", "add"]


def test_sources_and_targets_are_in_the_code():
    def f(x, z):
        return nv.mul(x, z)
    xs = [T(np.ones(2)), T(np.ones(2))]
    with tape(persistent=True, watch=xs) as tp:
        y = f(*xs)
    a = tp.plan([y.id], [xs[0].id, xs[1].id])[0]
    b = tp.plan([y.id], [xs[1].id, xs[0].id])[0]
    c = tp.plan([y.id], [xs[0].id])[0]
    assert len({a, b, c}) == 3


def test_consumed_tape_has_no_plan():
    tp, y, xs, _ = _plan(_sin_mul)
    gradient(tp, NumpyVSpace(), y, xs[0])
    assert tp.plan([y.id], [xs[0].id]) is None


def test_plan_leaves_the_tape_usable():
    tp, y, xs, _ = _plan(_sin_mul)
    g, = gradient(tp, NumpyVSpace(), y, xs)
    x = xs[0].value
    np.testing.assert_allclose(nv.value(g), np.cos(x) * x + np.sin(x))


def test_compute_after_plan_reuses_its_pruning():
    tp, y, xs, _ = _plan(_sin_mul, persistent=True)
    g1, = gradient(tp, NumpyVSpace(), y, xs)
    tp.plan([y.id], [xs[0].id])
    g2, = gradient(tp, NumpyVSpace(), y, xs)
    np.testing.assert_allclose(nv.value(g2), nv.value(g1))


def test_a_change_between_plan_and_compute_is_seen():
    """The pruning plan() leaves for the next pass must not outlive a change
    of the tape: watching a tensor after plan() makes its gradient wanted."""
    x, c = T(np.arange(3.0)), T(np.full(3, 2.0))
    with tape(persistent=True, watch=[x]) as tp:
        y = nv.mul(x, c)
    tp.plan([y.id], [x.id], True)  # c is not tracked: its gradient unneeded
    tp.watch(c.id)                 # now every watched tensor's gradient is
    vs = NumpyVSpace()
    (g,) = tp.compute_gradient(vs, [y.id], [x.id],
                               output_gradients=[T(np.ones(3))],
                               all_watched=True)
    np.testing.assert_allclose(nv.value(g), c.value)
    (call,) = vs.backward_log
    assert call.unneeded == []


def test_path_is_the_walk_backprop_prunes_with():
    """path(): the ops between the sources and the targets (what plan and
    compute_gradient run; to_dot and explain read it too), and it leaves a
    following plan/compute untouched."""
    x, z = T(np.arange(3.0)), T(np.ones(3))
    with tape(persistent=True, watch=[x, z]) as tp:
        a = nv.sin(x)             # on the path from x
        b = nv.exp(z)             # leads to y, but from z
        c = nv.cos(x)             # from x, but not to y
        y = nv.mul(a, b)
    ops, needed = tp.path([y.id], [x.id])
    kinds = [tp.op(i).op_type for i in ops]
    assert kinds == ["sin", "mul"]
    assert ops == sorted(ops)
    assert {x.id, a.id, y.id} <= needed and b.id not in needed and c.id not in needed
    assert [e.op_type for e in tp.plan([y.id], [x.id])[1]] == kinds
    ops_z, _ = tp.path([y.id], [z.id])
    assert [tp.op(i).op_type for i in ops_z] == ["exp", "mul"]
    assert tp.path([y.id], [c.id]) == ([], {c.id})
