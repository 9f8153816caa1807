"""Op corpus parity: one gradient case per TF op type (see op_corpus.py).

Every case records one op (plus a weighted-sum reduction) under
tf.GradientTape and under fasttape.GradientTape, eagerly, and compares the
gradients with respect to every differentiable input bit for bit
(harness.assert_parity, exact mode: fasttape sums in TF's order).
Ids are op type names, with a variant tag and a dtype suffix where the case
is not the op's primary float case.

The primary-dtype cases also run with every source a tf.Variable, on a
persistent tape, to second order, and to second order with tf.GradientTape
and the tape under test nested either way; a handful (``graph=True``), plus
a graph-only control-flow table, with the tape inside a @tf.function. More
modes (output_gradients, outputs as sources, jacobians) are in
test_op_corpus_modes.py.
"""

import os
import re

import pytest
import tensorflow as tf
from tensorflow.python.eager import execute
from tensorflow.python.framework import op_callbacks
from tensorflow.python.framework import op_def_registry

import op_corpus as oc
from harness import Raised, assert_parity

MIN_COVERED = 200


def _params(cases, mode=None):
    out = []
    for c in cases:
        reason = c.xfail_in(mode)
        marks = (pytest.mark.xfail(strict=True, reason=reason),) if reason else ()
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


CASES = oc.expand()
EXTRA_CASES = oc.expand(oc.EXTRAS)
GRAPH_ONLY_CASES = oc.expand(oc.GRAPH_TABLE)
PRIMARY = [c for c in CASES if c.dtype == c.entry.dtypes[0] and not c.entry.raises]
GRAPH_CASES = [c for c in PRIMARY if c.entry.graph]


def _primary(mode):
    return _params([c for c in PRIMARY if mode not in c.entry.no_modes], mode)


def _check(case, body, tf_raises=None, tf_result=None):
    """Parity of ``body``; TF must succeed unless the case (or ``tf_raises``)
    says TF raises, and then it must raise. Returns TF's result.
    ``tf_result``: TF's result of the same computation in an earlier test
    (see _TF_RESULTS), or None to run it."""
    raises = case.entry.raises if tf_raises is None else tf_raises
    tol = case.entry.tol or (None, None)
    result = assert_parity(body, rtol=tol[0], atol=tol[1], allow_tf_error=raises,
                           exact=True, tf_result=tf_result)
    if raises:
        assert isinstance(result, Raised), f"{case.id}: TF was expected to raise"
    return result


# TF's result of a computation two tests share, kept by the first (when it
# passed) for the second, which takes it out: the eager first-order case is
# also the compiled test's reference (the compiled mode is fasttape's; TF's
# tape runs as always), and TF's second order (a tf.GradientTape over a
# tf.GradientTape) is the reference of both halves of the mixed-tapes test.
# Run alone, the second test runs TF itself.
_TF_RESULTS = {}


# -- eager, first order ---------------------------------------------------------------

@pytest.mark.parametrize("case", _params(CASES))
def test_op_gradient_parity(case):
    """Gradients of sum(y * w) w.r.t. every float input, recorded eagerly."""
    _TF_RESULTS["first", case.id] = _check(case, case.body)


@pytest.fixture
def compiled_verify():
    """fasttape's compiled backward at first use, checked against its eager
    pass (a pass that cannot be traced or disagrees raises) and returned,
    so that the parity check compares the compiled result with TF's."""
    from fasttape.gradients import _compiled
    previous = _compiled.set_mode("verify")
    try:
        yield
    finally:
        _compiled.set_mode(previous)
        _compiled.CACHE.clear()


@pytest.mark.parametrize("case", _params(CASES))
def test_op_gradient_parity_compiled(case, compiled_verify):
    """As test_op_gradient_parity, with the backward pass compiled."""
    _check(case, case.body, tf_result=_TF_RESULTS.pop(("first", case.id), None))


@pytest.mark.parametrize("case", _primary("variables"))
def test_op_gradient_parity_variables(case):
    """Every source a tf.Variable, read by the op (often on TF's fast path)."""
    _check(case, case.variables_body)


@pytest.mark.parametrize("case", _primary("persistent"))
def test_op_gradient_parity_persistent(case):
    """A persistent tape: the gradient twice, then per loss term."""
    _check(case, case.persistent_body)


@pytest.mark.parametrize("case", _params(EXTRA_CASES))
def test_op_without_gradient_function_parity(case):
    """Ops TF records with no gradient function (NotDifferentiable) or does not
    know at all (a LookupError only if a gradient actually reaches it)."""
    _check(case, case.body)


# -- second order ----------------------------------------------------------------------

@pytest.mark.parametrize("case", _primary("second_order"))
def test_op_second_order_parity(case):
    """An outer tape of the same kind records the inner tape's backward pass."""
    _TF_RESULTS["second", case.id] = _check(
        case, case.second_order_body, oc.second_order_tf_raises(case.id))


@pytest.mark.parametrize("case", _primary("second_order"))
def test_op_second_order_mixed_tapes_parity(case):
    """tf.GradientTape outside the tape under test, and the reverse."""
    def body(GradientTape):
        return (case.mixed_outer_tf_body(GradientTape),
                case.mixed_inner_tf_body(GradientTape))
    # Under TF's tape both halves are TF's own second order: if it raised,
    # the first half raises it.
    second = _TF_RESULTS.pop(("second", case.id), None)
    _check(case, body, oc.second_order_tf_raises(case.id),
           tf_result=second if second is None or isinstance(second, Raised)
           else (second, second))


# -- graph mode ------------------------------------------------------------------------

@pytest.mark.parametrize("case", _params(GRAPH_CASES + GRAPH_ONLY_CASES))
def test_op_gradient_parity_in_tf_function(case):
    """The case with the tape inside a @tf.function (graph mode)."""
    _check(case, case.graph_body)


# -- the table itself -------------------------------------------------------------------

def test_cases_execute_claimed_op():
    """Each case's forward function really executes the op type it names
    (eagerly; graph-only cases while being traced)."""
    missing = []
    for case, graph in ([(c, False) for c in CASES + EXTRA_CASES]
                        + [(c, True) for c in GRAPH_ONLY_CASES]):
        seen = case.executed_op_types(graph=graph)
        if case.op not in seen:
            missing.append(f"{case.id}: saw {sorted(seen)}")
    assert not missing, "cases not executing their op:\n" + "\n".join(missing)


def test_corpus_size():
    """At least MIN_COVERED op types with a registered gradient function are
    covered eagerly by a case expected to produce gradients (not to raise)."""
    registered = oc.registered_gradient_ops()
    unknown = sorted({e.op for e in oc.TABLE + oc.GRAPH_TABLE if e.op not in registered})
    assert not unknown, f"corpus ops missing from the gradient registry: {unknown}"
    covered = oc.covered_ops(graph=False)
    assert len(covered) >= MIN_COVERED, (len(covered), covered)


def test_second_order_tf_raises_list_is_current():
    ids = {c.id for c in PRIMARY}
    assert oc.SECOND_ORDER_TF_RAISES <= ids, sorted(oc.SECOND_ORDER_TF_RAISES - ids)
    assert set(oc.SECOND_ORDER_RUNS) <= ids, sorted(set(oc.SECOND_ORDER_RUNS) - ids)
    assert not set(oc.SECOND_ORDER_RUNS) & oc.SECOND_ORDER_TF_RAISES
    # each names a real op: a misspelt one would read as "no gradient" on every release
    unknown = [op for op in oc.SECOND_ORDER_RUNS.values() if op_def_registry.get(op) is None]
    assert not unknown, unknown


def test_op_corpus_md_is_current():
    """OP_CORPUS.md lists exactly the covered op types."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "OP_CORPUS.md")
    with open(path) as f:
        text = f.read()
    listed = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    assert listed == set(oc.covered_ops()), (
        "OP_CORPUS.md is stale: run `python compat/op_corpus.py --write-md`")


def test_collect_op_types_leaves_callbacks_as_they_were():
    before = (op_callbacks.should_invoke_op_callbacks(), execute.execute)
    with oc.collect_op_types() as seen:
        tf.sin(tf.constant(1.0))
    assert "Sin" in seen
    assert (op_callbacks.should_invoke_op_callbacks(), execute.execute) == before
