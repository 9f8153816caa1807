"""The finite-difference judge itself: it must catch a wrong gradient."""

import numpy as np
import pytest
import tensorflow as tf

import fd


def test_central_difference_of_a_known_function():
    x = np.array([0.3, -1.2])
    (jac,) = fd.central_difference(lambda v: np.sin(v) * v, [x])
    np.testing.assert_allclose(jac, np.diag(np.cos(x) * x + np.sin(x)), rtol=1e-7)


def test_vjp_and_jvp_oracles_agree_on_the_inner_product_identity():
    rng = np.random.default_rng(0)
    x, u, v = rng.normal(size=3), rng.normal(size=2), rng.normal(size=3)
    a = rng.normal(size=(2, 3))
    f = lambda x: np.tanh(a @ x)  # noqa: E731
    (vjp,) = fd.vjp_oracle(f, [x], u)
    jvp = fd.jvp_oracle(f, [x], [v])
    assert np.isclose(u @ jvp, vjp @ v, rtol=1e-6)


def test_judge_catches_a_wrong_gradient_on_either_side():
    x0 = np.array([0.5, 2.0])
    (oracle,) = fd.vjp_oracle(lambda v: np.sum(v ** 3), [x0])

    def case(FA, GT):
        x = tf.constant(x0)
        with GT() as t:
            t.watch(x)
            y = tf.reduce_sum(x ** 3)
        g = t.gradient(y, x)
        # A wrong rule on one side only: the judge must blame that side.
        return g * 2.0 if GT is tf.GradientTape else g

    assert fd.judge(case, [oracle]) == "TF wrong"
    assert fd.matches(fd.run(case, "fasttape"), [oracle], 1e-6, 1e-8)
    with pytest.raises(AssertionError):
        fd.tf_wrong_here(lambda FA, GT: case(FA, tf.GradientTape), [oracle])


# -- judge_results: sorting a pair already computed -------------------------------

_RIGHT = [np.array([3.0, 12.0])]


def _t(values):
    return [tf.constant(values, tf.float64)]


def test_judge_results_agree_needs_no_oracle():
    def oracle():
        raise AssertionError("the oracle is computed only on a disagreement")
    assert fd.judge_results(_t([3.0, 12.0]), _t([3.0, 12.0]), oracle) == "agree"
    both = fd.Raised(ValueError("x")), fd.Raised(ValueError("y"))
    assert fd.judge_results(*both, oracle) == "agree"


@pytest.mark.parametrize("expected, actual, verdict", [
    (_t([3.0, 12.0]), _t([6.0, 24.0]), "fasttape wrong"),
    (_t([6.0, 24.0]), _t([3.0, 12.0]), "TF wrong"),
    (_t([6.0, 24.0]), _t([0.0, 0.0]), "inconclusive"),            # both wrong
    (fd.Raised(ValueError("tf")), _t([3.0, 12.0]), "TF wrong"),
    (_t([3.0, 12.0]), fd.Raised(ValueError("ft")), "fasttape wrong"),
    (fd.Raised(ValueError("tf")), fd.Raised(TypeError("ft")), "inconclusive"),
])
def test_judge_results_blames_the_side_the_oracle_refutes(expected, actual, verdict):
    assert fd.judge_results(expected, actual, _RIGHT) == verdict
    assert fd.judge_results(expected, actual, lambda: _RIGHT) == verdict


def test_judge_results_without_an_oracle_is_inconclusive():
    assert fd.judge_results(_t([3.0, 12.0]), _t([6.0, 24.0]), None) == "inconclusive"
    assert fd.judge_results(_t([1.0]), _t([2.0]), lambda: None) == "inconclusive"


def test_judge_uses_judge_results():
    """judge() is run() twice, then judge_results: same verdicts."""
    def case(FA, GT):
        return _t([6.0, 24.0]) if GT is tf.GradientTape else _t([3.0, 12.0])
    assert fd.judge(case, _RIGHT) == fd.judge_results(
        fd.run(case, "tf"), fd.run(case, "fasttape"), _RIGHT) == "TF wrong"


def test_matches_none_as_zeros():
    zeros = [np.zeros(2)]
    assert not fd.matches([None], zeros, 1e-6, 1e-8)
    assert fd.matches([None], zeros, 1e-6, 1e-8, none_as_zeros=True)
    assert fd.matches(_t([0.0, 0.0]), [None], 1e-6, 1e-8, none_as_zeros=True)
    assert not fd.matches(_t([0.0, 1.0]), [None], 1e-6, 1e-8, none_as_zeros=True)
    assert not fd.matches([None], _RIGHT, 1e-6, 1e-8, none_as_zeros=True)
    # a None for an unconnected source against a zero oracle: only the
    # option says they are the same answer
    assert fd.judge_results([None], _t([0.0, 0.0]), zeros) == "TF wrong"
    assert fd.judge_results([None], _t([0.0, 0.0]), zeros,
                            none_as_zeros=True) == "inconclusive"


def test_matches_densifies_indexed_slices():
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0]], tf.float64),
                              tf.constant([1]), tf.constant([2, 2]))
    assert fd.matches([slices], [np.array([[0.0, 0.0], [1.0, 2.0]])], 1e-6, 1e-8)
