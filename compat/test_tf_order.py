"""Gradients bit for bit with TF's eager tape, where a tensor has several
consumers: fasttape runs the backward functions, and sums each tensor's
contributions, in the order TF's tape does (tape.h: a queue after the
initial ops, the initial ops in the iteration order of its unordered_map,
early aggregation at its thresholds), eagerly and in compiled passes.

Every comparison here is bit-exact (harness ``exact=True``), eager, on CPU.
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

from fasttape.gradients import _compiled
from harness import IMPLEMENTATIONS, assert_parity, assert_same, run_case


def _exact(case):
    assert_parity(case, allow_tf_error=False, exact=True)


def test_three_consumers_of_a_variable():
    x = tf.Variable(np.random.default_rng(0).standard_normal((30, 30)))

    def case(Tape):
        with Tape() as t:
            y = (tf.reduce_sum(tf.sin(x)) + tf.reduce_sum(tf.exp(x))
                 + tf.reduce_sum(tf.cos(x)))
        return t.gradient(y, x)

    _exact(case)


def test_a_deep_branch_and_shallow_ones():
    x = tf.constant(np.random.default_rng(1).standard_normal(500) * 3)

    def case(Tape):
        with Tape() as t:
            t.watch(x)
            deep = tf.sin(tf.sin(tf.sin(x)))
            y = deep + tf.exp(x) * 1e-3 - x + tf.tanh(x) * 7.0 + tf.square(x)
        return t.gradient(y, x)

    _exact(case)


@pytest.mark.parametrize("k", [0, 10, 11, 26, 27])
def test_several_targets_start_in_the_order_of_tf_s_hash_map(k):
    """k ops before the targets' producers change TF's unordered_map (its
    bucket count, so the order it lists the initial ops in)."""
    x = tf.constant(np.random.default_rng(5).standard_normal(2000) * 3)

    def case(Tape):
        with Tape() as t:
            t.watch(x)
            h = x
            for _ in range(k):
                h = tf.identity(h)
            ys = [tf.sin(h), tf.cos(h), tf.exp(h), tf.negative(h)]
        return t.gradient(ys, x)

    _exact(case)


def _fan(n):
    """x read by n ops whose gradients span many magnitudes (AddN of n)."""
    rng = np.random.default_rng(n)
    x = tf.constant(rng.standard_normal(256))
    ws = [tf.constant(rng.standard_normal(256) * 10.0 ** rng.integers(-6, 7))
          for _ in range(n)]

    def case(Tape):
        with Tape() as t:
            t.watch(x)
            ys = [tf.reduce_sum(tf.sin(x * w)) for w in ws]
            y = tf.add_n(ys)
        return t.gradient(y, x)

    return case


@pytest.mark.parametrize("n", [3, 8, 9, 12, 17, 25])
def test_many_consumers(n):
    _exact(_fan(n))


@contextlib.contextmanager
def _always_compiled(monkeypatch):
    monkeypatch.setattr(_compiled.CACHE, "keep_faster", False)
    _compiled.CACHE.clear()
    previous = _compiled.set_mode("always")
    try:
        yield
    finally:
        _compiled.set_mode(previous)
        _compiled.CACHE.clear()


@pytest.mark.parametrize("n", [3, 4, 9, 12, 17])
def test_compiled_passes_sum_as_the_eager_one(monkeypatch, n):
    """In a graph, an AddN kernel that may reuse an input's buffer moves
    that input to the front, and sums in another order; the compiled pass
    adds in the eager AddN's order instead. Built at the first call,
    replayed after: every result is TF's eager one, bit for bit."""
    case = _fan(n)
    expected = run_case(case, "tf")
    with _always_compiled(monkeypatch):
        for _ in range(3):
            assert_same(expected, run_case(case, "fasttape"), exact=True)
        assert _compiled.CACHE.stats["replayed"] >= 2, _compiled.CACHE.stats


def test_compiled_pass_with_several_targets(monkeypatch):
    x = tf.constant(np.random.default_rng(3).standard_normal(64) * 10)
    rng = np.random.default_rng(4)
    ws = [tf.constant(rng.standard_normal(64) * 10.0 ** rng.integers(-6, 7))
          for _ in range(3)]

    def case(Tape):
        with Tape() as t:
            t.watch(x)
            h = tf.sin(x)
            ys = [h * w + x for w in ws]
        return t.gradient(ys, x)

    expected = run_case(case, "tf")
    with _always_compiled(monkeypatch):
        for _ in range(3):
            assert_same(expected, run_case(case, "fasttape"), exact=True)
        assert _compiled.CACHE.stats["replayed"] >= 2, _compiled.CACHE.stats


def test_indexed_slices_and_dense_contributions(monkeypatch):
    """Gathers give IndexedSlices, the other reads dense gradients: TF
    aggregates them with backprop_util (dense AddN)."""
    rng = np.random.default_rng(6)
    v = tf.Variable(rng.standard_normal((40, 8)))
    idx = [tf.constant(rng.integers(0, 40, size=12)) for _ in range(3)]

    def case(Tape):
        with Tape() as t:
            y = tf.reduce_sum(tf.sin(v)) + tf.reduce_sum(tf.exp(v) * 1e-3)
            for i in idx:
                y += tf.reduce_sum(tf.gather(v, i) * 3.0)
            y += tf.reduce_sum(tf.cos(v))
        return t.gradient(y, v)

    _exact(case)
    expected = run_case(case, "tf")
    with _always_compiled(monkeypatch):
        for _ in range(3):
            assert_same(expected, run_case(case, "fasttape"), exact=True)


def test_only_indexed_slices_contributions():
    rng = np.random.default_rng(7)
    v = tf.Variable(rng.standard_normal((40, 8)))
    idx = [tf.constant(rng.integers(0, 40, size=12)) for _ in range(4)]

    def case(Tape):
        with Tape() as t:
            y = tf.add_n([tf.reduce_sum(tf.gather(v, i) * float(k + 1))
                          for k, i in enumerate(idx)])
        return t.gradient(y, v)

    _exact(case)


def test_early_aggregation_at_tf_s_thresholds():
    """tape.h sums a tensor's pending gradients once more than 4 are
    pending and count * elements * 4 bytes passes 128 MiB: with float16
    (2 bytes, counted as 4) of 7M elements TF sums every 5 as they come
    (adding left to right throughout); counting 2 bytes, 10 would be summed
    at once, and AddN adds 10 as (g1 + g2) + (g3 + ... + g10)."""
    n = 7 * 2 ** 20
    x = tf.random.stateless_uniform([n], seed=[1, 2], minval=-2.0,
                                    maxval=2.0, dtype=tf.float16)
    ws = [tf.constant(float(k) * 0.37 + 0.11, tf.float16) for k in range(10)]

    def case(Tape):
        with Tape() as t:
            t.watch(x)
            y = tf.add_n([tf.reduce_sum(tf.sin(x * w)) for w in ws])
        return t.gradient(y, x)

    _exact(case)


def test_the_harness_sees_a_last_bit():
    """Bit-exact mode fails on a one-ulp difference that the tolerances
    accept (a check that the mode checks)."""
    a = tf.constant([1.0, 2.0], tf.float64)
    b = tf.constant([1.0, np.nextafter(2.0, 3.0)], tf.float64)
    assert_same(a, b)
    with pytest.raises(AssertionError, match="not bit for bit"):
        assert_same(a, b, exact=True)
    assert IMPLEMENTATIONS   # (the harness's two tapes)


def test_compiled_pass_keyed_by_the_initial_order(monkeypatch):
    """The order of several initial ops depends on their op ids, which the
    compiled cache's key otherwise abstracts away: ops recorded before
    (outside the pass) must not let one order's compiled pass replay for
    the other."""
    x = tf.constant(np.random.default_rng(5).standard_normal(2000) * 3)

    def case_with(k):
        def case(Tape):
            with Tape() as t:
                t.watch(x)
                h = tf.identity(x)      # op 0
                for _ in range(k):
                    tf.identity(x)      # recorded, not in the pass
                # ops k+1..k+4: with k = 12, op 13 shares op 0's bucket
                ys = [tf.sin(h), tf.cos(h), tf.exp(h), tf.negative(h)]
            return t.gradient(ys, x)
        return case

    expected = {k: run_case(case_with(k), "tf") for k in (0, 12)}
    assert not np.array_equal(expected[0].numpy(), expected[12].numpy())
    with _always_compiled(monkeypatch):
        for _ in range(2):
            for k in (0, 12):
                assert_same(expected[k], run_case(case_with(k), "fasttape"),
                            exact=True)
        assert _compiled.CACHE.stats["replayed"] >= 2, _compiled.CACHE.stats
