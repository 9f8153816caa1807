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
