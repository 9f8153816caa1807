"""Reliability faults found from outside (issue 9: 2, 9, 13-16; issue 14:
3, 5, 7): tapes around pfor jacobians in tf.function, recompute_grad with
stop_recording, and the exception types users match on.

Each case runs under tf.GradientTape and fasttape (``harness``); where TF
is wrong, ``fd.tf_wrong_here`` judges with float64 finite differences and
fails the day TF is fixed.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import fasttape
import fd
import harness
from harness import Raised


def _fresh(n):
    """tf.function, traced anew for each implementation (a function traced
    with one tape class must not be reused with the other)."""
    return tf.function(n)


# -- issue 9 fault 2: ops built by pfor, seen by an outer tape ----------------

@pytest.mark.parametrize("in_function", [True, False], ids=["function", "eager"])
@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "loop"])
@pytest.mark.parametrize("persistent", [True, False],
                         ids=["persistent", "once"])
def test_outer_tape_sees_batch_jacobian(in_function, pfor, persistent):
    """The issue's case: gradient of a sum of a batch_jacobian (TF [[6, 12]]
    for x**3; fasttape gave None in tf.function with pfor)."""
    x0 = tf.constant([[1., 2.], [0.5, -1.5]])
    w = tf.constant([[[1., -2.], [3., 0.5]], [[0.25, 1.], [-1., 2.]]])

    def case(Tape):
        def body(x):
            with Tape(persistent=persistent) as g:
                g.watch(x)
                with Tape(persistent=persistent) as gg:
                    gg.watch(x)
                    y = x ** 3 * tf.sin(x)
                j = gg.batch_jacobian(y, x, experimental_use_pfor=pfor)
                s = tf.reduce_sum(j * w)
            return g.gradient(s, x)
        return (_fresh(body) if in_function else body)(x0)

    out = harness.assert_parity(case)
    if in_function or persistent:
        assert not isinstance(out, Raised) and out is not None


@pytest.mark.parametrize("in_function", [True, False], ids=["function", "eager"])
@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "loop"])
@pytest.mark.parametrize("outer", ["jacobian", "batch_jacobian", "gradient"])
def test_outer_tape_sees_jacobian(in_function, pfor, outer):
    """A nested jacobian, then jacobian / batch_jacobian / gradient of it
    (TF 2*I for x**2; fasttape gave zeros in tf.function with pfor)."""
    x0 = tf.constant([[1.], [2.], [-0.5]])

    def case(Tape):
        def body(x):
            with Tape(persistent=True) as g:
                g.watch(x)
                with Tape(persistent=True) as gg:
                    gg.watch(x)
                    y = x ** 2 + tf.sin(x) * x[0]
                j = gg.jacobian(y, x, experimental_use_pfor=pfor)
                if outer == "gradient":
                    j = tf.reduce_sum(j * tf.reshape(tf.range(9.), [3, 1, 3, 1]))
            if outer == "gradient":
                return g.gradient(j, x)
            return getattr(g, outer)(j, x, experimental_use_pfor=pfor)
        return (_fresh(body) if in_function else body)(x0)

    out = harness.assert_parity(case, allow_tf_error=False)
    assert np.any(out.numpy() != 0)


def test_outer_tape_sees_jacobian_issue_case():
    """The issue's second form, exactly: 2*I from a nested jacobian then
    batch_jacobian in a tf.function."""
    def case(Tape):
        @tf.function
        def f(x):
            with Tape() as g:
                g.watch(x)
                with Tape() as gg:
                    gg.watch(x)
                    y = x ** 2
                j = gg.jacobian(y, x)
            return g.batch_jacobian(j, x)
        return f(tf.constant([[1., 2.]]))

    out = harness.assert_parity(case, allow_tf_error=False)
    assert np.any(out.numpy() != 0)
