"""Memory parity: what a tape keeps alive while a long forward runs.

TF's EagerTensor dealloc calls the tape's DeleteTrace: a recorded op whose
outputs have all died, and that no recorded op reads, is forgotten with the
tensors it saved. fasttape must free the same (issue 9, fault 4), and a
forward accumulator must drop a watched primal's tangent when the primal
dies (fault 7). Each case runs under TF's classes and fasttape's and
compares counts of live tensors, and TF's own leak decorators
(``test_util.assert_no_new_tensors`` / ``assert_no_garbage_created``) run
around steps whose results die while a tape records.
"""

import gc
import threading
import unittest
import weakref

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.framework import test_util

import fasttape
from fasttape.recording import _recording

TAPES = {"tf": tf.GradientTape, "fasttape": fasttape.GradientTape}
ACCUMULATORS = {"tf": tf.autodiff.ForwardAccumulator,
                "fasttape": fasttape.ForwardAccumulator}


def live_eager_tensors():
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is ops.EagerTensor)


def both(fn):
    """fn(impl) under TF and fasttape: {impl: result}."""
    return {impl: fn(impl) for impl in ("tf", "fasttape")}


# -- the loop of the issue: y = x * c, every result dies -----------------------

def _loop_alive(impl, n, op="mul", persistent=False):
    """Constants read by recorded ops, still alive after a loop whose results
    die (and the gradient of the last result)."""
    x = tf.constant(1.5)
    refs = []
    with TAPES[impl](persistent=persistent) as t:
        t.watch(x)
        for i in range(n):
            c = tf.constant(float(i))
            refs.append(weakref.ref(c))
            if op == "mul":
                y = x * c
            else:            # Exp saves its own output: kept, in TF too
                y = tf.exp(x * c * 1e-4)
            del c
    gc.collect()
    alive = sum(r() is not None for r in refs)
    g = t.gradient(y, x)
    return alive, float(g)


@pytest.mark.parametrize("persistent", [False, True])
def test_loop_whose_results_die_keeps_what_tf_keeps(persistent):
    r = both(lambda impl: _loop_alive(impl, 3000, persistent=persistent))
    assert r["tf"][0] <= 2            # TF keeps the last op only
    assert r["fasttape"][0] == r["tf"][0], r
    assert r["fasttape"][1] == r["tf"][1] == 2999.0


def test_an_op_that_saves_its_own_output_is_kept_as_in_tf():
    """Exp's gradient reads its output: the saved output keeps itself alive,
    so neither TF nor fasttape forgets that trace (TF's DeleteTrace runs on
    the tensor's death, which the tape itself prevents)."""
    r = both(lambda impl: _loop_alive(impl, 300, op="exp"))
    assert r["tf"][0] == 300
    assert r["fasttape"][0] == r["tf"][0]
    np.testing.assert_allclose(r["fasttape"][1], r["tf"][1], rtol=1e-6)


def test_the_tape_itself_holds_one_op_after_the_loop():
    x = tf.constant(1.0)
    with fasttape.GradientTape() as t:
        t.watch(x)
        for i in range(20000):
            y = x * float(i)
        held = t._tape.core.num_ops  # pylint: disable=protected-access
    assert held == 1
    assert float(t.gradient(y, x)) == 19999.0


# -- a Keras-like loop: metrics and logging intermediates die ------------------

def _keras_like(impl, steps=60):
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(8, 4)).astype(np.float32))
    b = tf.Variable(np.zeros(4, np.float32))
    xs = tf.constant(rng.normal(size=(steps, 16, 8)).astype(np.float32))
    ys = tf.constant(rng.normal(size=(steps, 16, 4)).astype(np.float32))
    total = tf.constant(0.0)
    log = []
    baseline = live_eager_tensors()
    with TAPES[impl]() as t:
        for s in range(steps):
            pred = tf.nn.relu(xs[s] @ w + b)
            err = pred - ys[s]
            loss = tf.reduce_mean(tf.square(err))
            total = total + loss          # the accumulated loss keeps its chain
            # metrics and logging: computed from recorded tensors, then
            # dropped. (Sums: Mean, Sqrt, Tanh... save their own output,
            # which keeps their trace alive in TF too.)
            mae = tf.reduce_sum(tf.abs(err)) * (1.0 / 64)
            hit = tf.reduce_sum(tf.cast(tf.abs(err) < 0.5, tf.float32))
            norm = tf.reduce_sum(pred * pred)
            log.append((float(mae), float(hit), float(norm)))
            del pred, err, loss, mae, hit, norm
        held = live_eager_tensors() - baseline
    grads = t.gradient(total, [w, b])
    return held, [g.numpy() for g in grads], log


def test_keras_like_loop_with_metrics_holds_what_tf_holds():
    r = both(_keras_like)
    held_tf, held_ft = r["tf"][0], r["fasttape"][0]
    # fasttape saves only what each gradient reads: never more than TF.
    assert held_ft <= held_tf, (held_ft, held_tf)
    for gt, gf in zip(r["tf"][1], r["fasttape"][1]):
        np.testing.assert_allclose(gf, gt, rtol=1e-5, atol=1e-6)
    assert r["tf"][2] == r["fasttape"][2]


# -- cases the deletion must not break -----------------------------------------

def test_live_target_keeps_its_history_and_gradients_match():
    def case(impl):
        x = tf.constant([0.3, 0.7])
        v = tf.Variable([1.0, 2.0])
        with TAPES[impl](persistent=True) as t:
            t.watch(x)
            keep = tf.sin(x) * v                 # target, alive
            for i in range(50):
                tmp = tf.cos(keep) * float(i)    # dies
            s, c = tf.split(keep * x, 2)         # two outputs; c dies below
            del c
            z = tf.reduce_sum(s * keep)
            del tmp
        out = [t.gradient(keep, [x, v]), t.gradient(z, [x, v]),
               t.gradient(s, x)]
        return [[g.numpy() for g in gs] if isinstance(gs, list) else gs.numpy()
                for gs in out]
    r = both(case)
    for a, b_ in zip(r["tf"], r["fasttape"]):
        for ga, gb in zip(np.atleast_1d(a), np.atleast_1d(b_)):
            np.testing.assert_allclose(gb, ga, rtol=1e-6)


def test_nested_tapes_both_forget_and_second_order_matches():
    def case(impl):
        x = tf.constant(0.8)
        refs = []
        with TAPES[impl]() as outer:
            outer.watch(x)
            with TAPES[impl]() as inner:
                inner.watch(x)
                for i in range(200):
                    c = tf.constant(float(i))
                    refs.append(weakref.ref(c))
                    y = tf.sin(x) * c
                    del c
                y = tf.sin(x) * x
            dy = inner.gradient(y, x)
        d2 = outer.gradient(dy, x)
        gc.collect()
        return sum(r() is not None for r in refs), float(d2)
    r = both(case)
    assert r["fasttape"][0] == r["tf"][0] == 0
    np.testing.assert_allclose(r["fasttape"][1], r["tf"][1], rtol=1e-6)


def test_death_during_a_backward_pass_does_not_corrupt_it():
    """A gradient function drops the last reference to recorded tensors while
    the pass runs: the deletion waits for the pass to end."""
    def case(impl):
        x = tf.constant([0.5, 1.5])
        holder = []

        @tf.custom_gradient
        def f(v):
            def grad(dy):
                holder.clear()            # recorded tensors die mid-pass
                gc.collect()
                return dy * 3.0
            return tf.identity(v), grad

        with TAPES[impl](persistent=True) as t:
            t.watch(x)
            a = tf.sin(x)
            holder.extend([tf.exp(a) * 2.0 for _ in range(20)])
            y = tf.reduce_sum(f(a) * tf.cos(a))
        g1 = t.gradient(y, x).numpy()
        g2 = t.gradient(y, x).numpy()      # after the queued deletions
        return g1, g2
    r = both(case)
    for a, b_ in zip(r["tf"], r["fasttape"]):
        np.testing.assert_allclose(b_, a, rtol=1e-6)


def test_deaths_on_another_thread():
    """Recorded tensors handed to another thread and dropped there: the
    recording thread's tape forgets them, its gradients unchanged."""
    def case(impl):
        x = tf.constant(2.0)
        refs = []
        with TAPES[impl]() as t:
            t.watch(x)
            for round_ in range(5):
                batch = []
                for i in range(40):
                    c = tf.constant(float(i + round_))
                    refs.append(weakref.ref(c))
                    batch.append(x * c)
                    del c
                th = threading.Thread(target=batch.clear)
                th.start()
                th.join()
            y = x * x
        g = float(t.gradient(y, x))
        gc.collect()
        return sum(r() is not None for r in refs), g
    r = both(case)
    assert r["fasttape"] == r["tf"]


# -- TF's leak decorators around steps whose results die ---------------------

@pytest.mark.parametrize("impl", ["tf", "fasttape"])
@pytest.mark.parametrize("persistent", [False, True])
def test_no_new_tensors_after_a_step_whose_results_die(impl, persistent):
    x = tf.constant([1.0, 2.0])
    v = tf.Variable([0.5, -0.5])
    with TAPES[impl](persistent=persistent) as t:
        t.watch(x)

        @test_util.assert_no_garbage_created
        @test_util.assert_no_new_tensors
        def step(_):
            for i in range(30):
                h = tf.sin(x * v + float(i))  # (Sin saves no output)
                s, c = tf.split(tf.concat([h, h], 0), 2)
                _ = tf.reduce_sum(s * c)

        step(unittest.TestCase())  # the decorators' self (assertEqual)
        y = tf.reduce_sum(x * v)
    g = t.gradient(y, [x, v])
    np.testing.assert_allclose(g[0].numpy(), [0.5, -0.5])
    np.testing.assert_allclose(g[1].numpy(), [1.0, 2.0])


# -- forward mode: a watched primal's tangent goes with the primal -------------

@pytest.mark.parametrize("impl", ["tf", "fasttape"])
def test_watched_primal_tangent_dies_with_the_primal(impl):
    x = tf.constant([1.0, 2.0])
    tangent = tf.constant([3.0, 4.0])
    t_ref = weakref.ref(tangent)
    acc = ACCUMULATORS[impl](x, tangent)
    with acc:
        y = x * x
        np.testing.assert_allclose(acc.jvp(y).numpy(), [6.0, 16.0])
        del tangent, x
        gc.collect()
        assert t_ref() is None, "the tangent outlived its primal"
        np.testing.assert_allclose(acc.jvp(y).numpy(), [6.0, 16.0])


@pytest.mark.parametrize("impl", ["tf", "fasttape"])
def test_op_output_tangents_die_with_their_outputs(impl):
    x = tf.constant([1.0, 2.0])
    refs = []
    with ACCUMULATORS[impl](x, tf.ones([2])) as acc:
        for i in range(50):
            y = tf.sin(x) * float(i)
            refs.append(weakref.ref(acc.jvp(y)))
        del y
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


# -- how a tape hears of deaths --------------------------------------------------

def test_a_tape_hears_deaths_from_eager_tensors_dealloc_as_tf_does():
    """fasttape's tapes hear of an EagerTensor's death where TF's tape does,
    in its dealloc (no weakref per recorded output)."""
    _recording.install()
    assert "EagerTensor.tp_dealloc" in _recording.installed_hooks()
    x = tf.constant(1.0)
    with fasttape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = tf.sin(x)
        z = tf.sin(y)
    core = t._tape.core  # pylint: disable=protected-access
    assert core.num_ops == 2 and core.num_watched_outputs == 0
    del z
    assert core.num_ops == 1
    del y
    assert core.num_ops == 0


def test_without_the_dealloc_hook_a_weakref_per_output_does_the_same():
    from fasttape.recording import _callback  # pylint: disable=import-outside-toplevel
    _recording.install()
    _callback.uninstall_death_hook()
    try:
        assert "EagerTensor.tp_dealloc" not in _recording.installed_hooks()
        x = tf.constant(1.0)
        with fasttape.GradientTape() as t:
            t.watch(x)
            for i in range(2000):
                y = x * float(i)
            assert t._tape.core.num_ops == 1  # pylint: disable=protected-access
            assert t._tape.core.num_watched_outputs == 1  # pylint: disable=protected-access
        assert float(t.gradient(y, x)) == 1999.0
    finally:
        assert _callback.install_death_hook()


def test_a_death_while_an_exception_is_raised_keeps_the_exception():
    """A recorded tensor that dies while an exception is being raised (a
    temporary the interpreter frees on its error path, here a list that
    cannot be a dict key): the tape hears of it, and the exception reaches
    the caller unchanged."""
    x = tf.constant(1.0)
    with fasttape.GradientTape(persistent=True) as t:
        t.watch(x)
        with pytest.raises(TypeError, match="unhashable") as info:
            {[tf.sin(tf.sin(x))]: 1}   # pylint: disable=expression-not-assigned
    assert type(info.value) is TypeError and info.value.__context__ is None
    assert t._tape.core.num_ops == 0  # pylint: disable=protected-access


def test_many_tapes_hear_one_death():
    """Twelve nested tapes record the same ops (more than the dealloc hook
    holds without allocating): each forgets them when their outputs die."""
    x = tf.constant(1.0)
    tapes = [fasttape.GradientTape(persistent=True) for _ in range(12)]
    for t in tapes:
        t.__enter__()
        t.watch(x)
    y = tf.sin(x)
    z = tf.sin(y)
    for t in reversed(tapes):
        t.__exit__(None, None, None)
    cores = [t._tape.core for t in tapes]  # pylint: disable=protected-access
    assert [c.num_ops for c in cores] == [2] * 12
    g = tapes[5].gradient(z, x)
    np.testing.assert_allclose(float(g), np.cos(np.sin(1.0)) * np.cos(1.0), rtol=1e-6)
    del y, z, g
    assert [c.num_ops for c in cores] == [0] * 12


def test_tapes_that_hold_no_op_stop_hearing_deaths():
    """Tapes kept after their gradient (released) or whose ops all died
    leave the list of tapes told of each death, so keeping many costs a
    death nothing; a tape that records again hears again."""
    from fasttape.recording import _callback  # pylint: disable=import-outside-toplevel
    x = tf.constant(1.0)
    before = _callback.tapes_hearing()
    kept = []
    for _ in range(40):
        with fasttape.GradientTape() as t:
            t.watch(x)
            y = tf.sin(x)
        t.gradient(y, x)
        del y
        kept.append(t)
    with fasttape.GradientTape(persistent=True) as p:
        p.watch(x)
        y = tf.sin(tf.sin(x))
        del y           # both ops forgotten
        assert _callback.tapes_hearing() == before
        z = tf.sin(x)   # records again: hears again
        assert _callback.tapes_hearing() == before + 1
        w = tf.sin(z)
        del w
    assert p._tape.core.num_ops == 1  # pylint: disable=protected-access
    del z
    assert p._tape.core.num_ops == 0  # pylint: disable=protected-access
    assert _callback.tapes_hearing() == before
