"""Errors where TF's message leaves a user stuck: fasttape raises TF's type
with TF's text, then one sentence saying what to do."""

import numpy as np
import pytest
import tensorflow as tf

from harness import Raised, assert_parity, run_case

A = np.array([1.0, 2.0], np.float32)


def _tf_then_hint(case, hint):
    """Same exception type as TF (assert_parity), TF's message first, then
    a sentence containing ``hint``."""
    assert_parity(case)
    expected, actual = run_case(case, "tf"), run_case(case, "fasttape")
    assert isinstance(expected, Raised) and isinstance(actual, Raised)
    tf_text, ft_text = str(expected.exc), str(actual.exc)
    assert ft_text.startswith(tf_text), (tf_text, ft_text)
    added = ft_text[len(tf_text):]
    assert added.startswith(". ") and hint in added, added


def _used_up(GradientTape, second):
    x = tf.constant([[1.0, 2.0]])
    with GradientTape() as tape:
        tape.watch(x)
        y = x * x
    tape.gradient(y, x)
    return getattr(tape, second)(y, x)


@pytest.mark.parametrize("second", ["gradient", "jacobian", "batch_jacobian"])
def test_second_use_of_a_non_persistent_tape_suggests_persistent(second):
    _tf_then_hint(lambda GT: _used_up(GT, second), "GradientTape(persistent=True)")


@pytest.mark.parametrize("wrap", [lambda a: a, lambda a: [a], lambda a: {"w": a}],
                         ids=["array", "list", "dict"])
def test_numpy_array_as_a_source_suggests_tf_constant_and_watch(wrap):
    def case(GradientTape):
        with GradientTape() as tape:
            y = tf.reduce_sum(tf.constant(A) * 2.0)
        return tape.gradient(y, wrap(A))
    _tf_then_hint(case, "x = tf.constant(a) and call tape.watch(x)")
