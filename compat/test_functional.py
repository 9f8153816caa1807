"""fasttape.hvp and fasttape.hessian against TF computed with its own tapes."""

import numpy as np
import tensorflow as tf

import fasttape
from harness import assert_same

RNG = np.random.default_rng(3)
M = tf.constant(RNG.normal(size=(4, 4)).astype("float32") / 3)


def f(x):
    h = tf.tanh(tf.linalg.matvec(M, x))
    return tf.reduce_sum(tf.sin(h) * h) + tf.reduce_sum(x ** 3)


def tf_hessian(x):
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = f(x)
        g = inner.gradient(y, x)
    return outer.jacobian(g, x)


def test_hessian_matches_tf():
    x = tf.constant(RNG.normal(size=(4,)).astype("float32"))
    assert_same(tf_hessian(x), fasttape.hessian(f, x))


def test_hvp_matches_tf_hessian_times_vector():
    x = tf.constant(RNG.normal(size=(4,)).astype("float32"))
    v = tf.constant(RNG.normal(size=(4,)).astype("float32"))
    expected = tf.linalg.matvec(tf_hessian(x), v)
    np.testing.assert_allclose(fasttape.hvp(f, x, v).numpy(), expected.numpy(),
                               rtol=1e-5, atol=1e-5)


def test_hvp_with_several_primals():
    def g(a, b):
        return tf.reduce_sum(a * a * b) + tf.reduce_sum(tf.sin(b))

    a = tf.constant([1.0, 2.0])
    b = tf.constant([0.5, -1.0])
    va = tf.constant([1.0, 0.0])
    vb = tf.constant([0.0, 1.0])
    ha, hb = fasttape.hvp(g, [a, b], [va, vb])
    # d2/da2 = 2b, d2/dadb = 2a, d2/db2 = -sin(b)
    np.testing.assert_allclose(ha.numpy(), (2 * b * va + 2 * a * vb).numpy(), rtol=1e-6)
    np.testing.assert_allclose(hb.numpy(), (2 * a * va - tf.sin(b) * vb).numpy(),
                               rtol=1e-6)


def test_hessian_of_a_function_independent_of_x_is_zero():
    x = tf.constant([1.0, 2.0])
    h = fasttape.hessian(lambda x: tf.reduce_sum(x) * 0.0 + 1.0, x)
    assert h.shape == (2, 2)
    np.testing.assert_array_equal(h.numpy(), np.zeros((2, 2)))
