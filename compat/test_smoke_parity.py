"""A few end-to-end parity cases; the suites beside this file go deeper."""

import tensorflow as tf

from harness import assert_parity


def test_chain_with_variable_and_constant():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        v = tf.Variable([3.0, 4.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = tf.reduce_sum(tf.sin(x) * v + x * x)
        return t.gradient(y, {"x": x, "v": v})

    assert_parity(case, allow_tf_error=False)


def test_source_computed_from_source_passes_gradient_on():
    def case(GradientTape):
        x = tf.constant(2.0)
        with GradientTape() as t:
            t.watch(x)
            y = x * x
            z = y * 3.0 + x
        return t.gradient(z, [x, y])

    assert_parity(case, allow_tf_error=False)
