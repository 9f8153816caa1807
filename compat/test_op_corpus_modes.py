"""Op corpus parity, more modes: the primary-dtype cases of op_corpus.py with
the op's outputs as targets (output_gradients) and as extra sources, eager
jacobians, and (a handful) pfor jacobians, eagerly and inside @tf.function.

Kept apart from test_op_corpus.py so that each file runs in a few minutes on
two cores. Where TF's own jacobian fails (a py_function's gradient can be
taken once; pfor cannot vectorize a nested cond) the case opts out with
``no_modes=("jacobian",)``.
"""

import pytest

import op_corpus as oc
from test_op_corpus import GRAPH_CASES, GRAPH_ONLY_CASES, PRIMARY, _check, _params, _primary


@pytest.mark.parametrize("case", _primary("output_gradients"))
def test_op_output_gradients_parity(case):
    """The op's outputs as targets, the fixed weights as output_gradients."""
    _check(case, case.seeded_body)


@pytest.mark.parametrize("case", _primary("intermediate"))
def test_op_outputs_as_sources_parity(case):
    """The op's outputs as extra sources, unconnected_gradients='zero'."""
    _check(case, case.intermediate_body)


@pytest.mark.parametrize("case", _primary("jacobian"))
def test_op_jacobian_parity(case):
    """Eager tape.jacobian (experimental_use_pfor=False), per source dtype."""
    _check(case, case.jacobian_body)


@pytest.mark.parametrize("case", _params(
    [c for c in GRAPH_CASES + GRAPH_ONLY_CASES if "jacobian" not in c.entry.no_modes]))
def test_op_jacobian_pfor_parity_in_tf_function(case):
    """tape.jacobian with pfor inside a @tf.function."""
    _check(case, case.jacobian_graph_body)


@pytest.mark.parametrize("case", _params(
    [c for c in PRIMARY if (c.entry.graph or c.id in oc.EAGER_PFOR_IDS)
     and "jacobian" not in c.entry.no_modes], "jacobian_pfor"))
def test_op_jacobian_pfor_parity(case):
    """Eager tape.jacobian with pfor: a target tiled to over 1024 rows (below
    that fasttape takes one backward pass per row), so the recorded backward
    pass is traced into a graph and vectorized."""
    _check(case, case.jacobian_pfor_body)


def test_eager_pfor_ids_are_current():
    ids = {c.id for c in PRIMARY}
    assert oc.EAGER_PFOR_IDS <= ids, sorted(oc.EAGER_PFOR_IDS - ids)
