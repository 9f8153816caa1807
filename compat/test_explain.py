"""tape.explain() and fasttape.explain_none(): why a gradient is None.

Each cause is built the way a user hits it (Keras models, custom training
loops, a .numpy() in the middle...). Every test checks the cause code and
the op or the line named, and (parity) that TF's tape gives None there too,
so the explanation is about a real None. The explanation itself is a
fasttape extension: TF has nothing to compare it with.
"""

import logging
import os
import subprocess
import sys
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tensorflow.python.eager import backprop as tf_backprop

import fasttape
from fasttape.diagnostics import _frames
from fasttape.diagnostics import explain as ex
from fasttape import tape as ft_tape

from harness import (assert_leaks_nothing, assert_parity, captured_log_first_n,
                     compare, run_case)

GT = fasttape.GradientTape

_SRC = open(__file__, encoding="utf-8").read().splitlines()


def line(marker):
    """The line number of the line of this file that ends with ``marker``."""
    hits = [i + 1 for i, text in enumerate(_SRC)
            if text.rstrip().endswith("# " + marker)]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def at(e, marker):
    """The explanation names this file's line ``marker``."""
    assert e.line is not None and e.line.endswith(
        f"test_explain.py:{line(marker)}"), (e.line, marker, str(e))
    return True


@pytest.fixture(params=[False, True], ids=["plain", "lineage"])
def lineage(request):
    """explain() without and with explain_none's lineage."""
    previous = fasttape.explain_none(request.param)
    yield request.param
    fasttape.explain_none(previous)


@pytest.fixture
def explaining():
    previous = fasttape.explain_none(True)
    yield
    fasttape.explain_none(previous)


def tf_gives_none(case):
    """TF's tape gives None for the case's gradient (and fasttape agrees)."""
    grads = assert_parity(case, allow_tf_error=False)
    flat = tf.nest.flatten(grads, expand_composites=False) \
        if not isinstance(grads, list) else grads
    assert any(g is None for g in flat), grads


def model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                             keras.layers.BatchNormalization(),
                             keras.layers.Dense(3)])


X = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)


# -- the source is never watched -----------------------------------------------

def test_non_trainable_variable_of_a_keras_model(lineage):
    """model.variables instead of model.trainable_variables: BatchNorm's
    moving statistics are trainable=False."""
    m = model()
    with GT() as tape:
        loss = tf.reduce_mean(m(X, training=True) ** 2)
    exps = tape.explain(loss, m.variables)
    moving = [e for v, e in zip(m.variables, exps) if "moving" in v.path]
    assert len(moving) == 2
    for e in moving:
        assert e.cause == ex.VARIABLE_NOT_TRAINABLE
        assert "moving_" in e.op_name and "batch_normalization" in e.op_name
    assert all(e.cause == ex.CONNECTED for v, e in zip(m.variables, exps)
               if "moving" not in v.path)
    grads = tape.gradient(loss, m.variables)   # still usable after explain
    assert [g is None for g in grads] == ["moving" in v.path for v in m.variables]

    def case(GradientTape):
        mm = model()
        with GradientTape() as t:
            loss = tf.reduce_mean(mm(X, training=True) ** 2)
        return t.gradient(loss, mm.variables)
    tf_gives_none(case)


def test_variable_made_with_trainable_false(lineage):
    scale = tf.Variable(2.0, trainable=False, name="temperature")
    w = tf.Variable([1.0, 2.0])
    with GT(persistent=True) as tape:  # enter-nontrainable
        loss = tf.reduce_sum(w * scale)
    e = tape.explain(loss, scale)
    assert e.cause == ex.VARIABLE_NOT_TRAINABLE
    assert e.op_name == "temperature:0" and at(e, "enter-nontrainable")
    assert "tape.watch" in e.message

    def case(GradientTape):
        t_scale = tf.Variable(2.0, trainable=False)
        t_w = tf.Variable([1.0, 2.0])
        with GradientTape() as t:
            t_loss = tf.reduce_sum(t_w * t_scale)
        return t.gradient(t_loss, [t_scale, t_w])
    tf_gives_none(case)


def test_watch_accessed_variables_false(lineage):
    m = keras.layers.Dense(2)
    m.build((None, 4))
    with GT(watch_accessed_variables=False) as tape:  # enter-noaccess
        loss = tf.reduce_sum(m(X))
    e = tape.explain(loss, [m.kernel])[0]
    assert e.cause == ex.WATCH_ACCESSED_OFF and at(e, "enter-noaccess")
    assert e.op_name == m.kernel.path

    def case(GradientTape):
        d = keras.layers.Dense(2)
        d.build((None, 4))
        with GradientTape(watch_accessed_variables=False) as t:
            loss = tf.reduce_sum(d(X))
        return t.gradient(loss, [d.kernel])
    tf_gives_none(case)


def test_constant_never_watched(lineage):
    x = tf.constant([1.0, 2.0])
    with GT() as tape:  # enter-constant
        y = tf.reduce_sum(x * x)  # use-constant
    e = tape.explain(y, x)
    assert e.cause == ex.SOURCE_NOT_WATCHED and "tape.watch(x)" in e.message
    if lineage:   # the op that read it, and where
        assert e.op_type == "Mul" and at(e, "use-constant")
    else:
        assert at(e, "enter-constant")

    def case(GradientTape):
        with GradientTape() as t:
            t_y = tf.reduce_sum(x * x)
        return t.gradient(t_y, x)
    tf_gives_none(case)


def test_watched_after_use(lineage):
    x = tf.constant(3.0)
    with GT() as tape:
        y = x * x  # use-late
        tape.watch(x)  # watch-late
    e = tape.explain(y, x)
    assert e.cause == ex.WATCHED_AFTER_USE
    if lineage:
        assert e.op_type == "Mul" and at(e, "use-late")
    else:
        assert at(e, "watch-late")
    assert f"test_explain.py:{line('watch-late')}" in e.message

    def case(GradientTape):
        xx = tf.constant(3.0)
        with GradientTape() as t:
            yy = xx * xx
            t.watch(xx)
        return t.gradient(yy, xx)
    tf_gives_none(case)


# -- the path passes through an integer dtype ----------------------------------

def test_cast_to_int_in_a_training_loop(explaining):
    """Quantizing the logits with tf.cast in the loss."""
    m = model()
    with GT() as tape:
        logits = m(X)
        q = tf.cast(logits * 4.0, tf.int32)  # cast-int
        loss = tf.reduce_mean(tf.cast(q, tf.float32) ** 2)  # cast-back
    exps = tape.explain(loss, m.trainable_variables)
    for e in exps:
        assert e.cause == ex.NON_DIFFERENTIABLE_DTYPE, str(e)
        assert e.op_type == "Cast" and at(e, "cast-int")
        assert str(line("cast-back")) in e.message
    assert tape.gradient(loss, m.trainable_variables) == [None] * len(exps)

    def case(GradientTape):
        mm = model()
        with GradientTape() as t:
            qq = tf.cast(mm(X) * 4.0, tf.int32)
            t_loss = tf.reduce_mean(tf.cast(qq, tf.float32) ** 2)
        return t.gradient(t_loss, mm.trainable_variables)
    tf_gives_none(case)


def test_argmax_accuracy_as_a_loss(explaining):
    m = model()
    labels = tf.constant([0, 2], tf.int64)
    with GT() as tape:
        pred = tf.argmax(m(X), axis=1)  # argmax
        loss = 1.0 - tf.reduce_mean(tf.cast(pred == labels, tf.float32))
    e = tape.explain(loss, m.trainable_variables)[0]
    assert e.cause == ex.NON_DIFFERENTIABLE_DTYPE
    assert e.op_type == "ArgMax" and at(e, "argmax")

    def case(GradientTape):
        mm = model()
        with GradientTape() as t:
            p = tf.argmax(mm(X), axis=1)
            l2 = 1.0 - tf.reduce_mean(tf.cast(p == labels, tf.float32))
        return t.gradient(l2, mm.trainable_variables)
    tf_gives_none(case)


def test_integer_path_without_lineage_says_it_cannot_tell():
    previous = fasttape.explain_none(False)
    try:
        w = tf.Variable([1.5, 2.5])
        with GT() as tape:
            loss = tf.reduce_sum(tf.cast(tf.cast(w, tf.int32), tf.float32))
        e = tape.explain(loss, w)
    finally:
        fasttape.explain_none(previous)
    assert e.cause == ex.TARGET_NOT_RECORDED and not e.certain
    assert "explain_none(True)" in e.message and "integer" in e.message
    assert "while the tape recorded, but not from anything the tape tracks" \
        in e.message


def test_watched_integer_source_is_named_as_the_source(lineage):
    """Watching an int32 tensor: the source itself is the non-differentiable
    dtype (no producer op to name), with or without lineage."""
    x = tf.constant([1, 2], tf.int32)
    with GT(persistent=True) as tape:
        tape.watch(x)  # watch-int
        y = tf.cast(x, tf.float32) * 2.0
    e = tape.explain(y, x)
    assert e.cause == ex.NON_DIFFERENTIABLE_DTYPE, str(e)
    assert "the source itself has dtype int32" in e.message
    assert "(at None)" not in e.message
    assert "tf.cast(x, tf.float32)" in e.message
    assert at(e, "watch-int")

    def case(GradientTape):
        with GradientTape() as t:
            t.watch(x)
            z = tf.cast(x, tf.float32) * 2.0
        return [t.gradient(z, x)]
    tf_gives_none(case)


# -- the path is cut -------------------------------------------------------------

def elementwise(GradientTape, op, explain=False):
    """loss = sum(op(2 v) ** 2): the gradient by v (or its explanation)."""
    v = tf.Variable([0.3, 1.7])
    with GradientTape() as t:
        loss = tf.reduce_sum(op(v * 2.0) ** 2)
    return t.explain(loss, v) if explain else t.gradient(loss, v)


def test_round_in_the_forward_pass(lineage):
    e = elementwise(GT, lambda x: tf.round(x), explain=True)  # round
    assert e.cause == ex.NOT_DIFFERENTIABLE_OP and e.op_type == "Round"
    if lineage:
        assert at(e, "round")
    tf_gives_none(lambda GradientTape: elementwise(GradientTape, tf.round))


def test_stop_gradient_on_a_dqn_target(lineage):
    """Differentiating a DQN loss by the target network's weights."""
    online, target_net = model(1), model(2)
    with GT() as tape:
        q = online(X)
        q_next = tf.stop_gradient(target_net(X))  # stop-gradient
        loss = tf.reduce_mean((q - (1.0 + 0.9 * q_next)) ** 2)
    e = tape.explain(loss, target_net.trainable_variables)[0]
    # TF runs StopGradient unrecorded; the recorder notes it all the same.
    assert e.cause == ex.STOP_GRADIENT and e.op_type == "StopGradient"
    assert e.certain and at(e, "stop-gradient")
    assert tape.explain(loss, online.trainable_variables)[0].cause == ex.CONNECTED

    def case(GradientTape):
        on, tn = model(1), model(2)
        with GradientTape() as t:
            t_loss = tf.reduce_mean(
                (on(X) - (1.0 + 0.9 * tf.stop_gradient(tn(X)))) ** 2)
        return t.gradient(t_loss, tn.trainable_variables)
    tf_gives_none(case)


def stopped_then_scaled(GradientTape, explain=False):
    """y = tf.stop_gradient(f(x)) * 2: the target itself is not recorded."""
    x = tf.constant([0.4, 1.1])
    with GradientTape() as t:
        t.watch(x)
        h = tf.tanh(x) * x
        y = tf.stop_gradient(h) * 2.0  # stop-then-scale
    return t.explain(y, x) if explain else t.gradient(y, x)


def test_stop_gradient_of_an_unrecorded_target(lineage):
    e = stopped_then_scaled(GT, explain=True)
    assert e.cause == ex.STOP_GRADIENT and e.op_type == "StopGradient"
    assert e.certain and at(e, "stop-then-scale")
    tf_gives_none(stopped_then_scaled)


def test_stop_gradient_of_a_variable_never_read_otherwise(lineage):
    def case(GradientTape, explain=False):
        v = tf.Variable([0.5, 1.5])
        with GradientTape() as t:
            y = tf.reduce_sum(tf.stop_gradient(v) * 3.0)  # stop-variable
        return t.explain(y, v) if explain else t.gradient(y, v)
    e = case(GT, explain=True)
    assert e.cause == ex.STOP_GRADIENT and e.certain and at(e, "stop-variable")
    tf_gives_none(case)


@pytest.mark.xfail(strict=True, reason=(
    "without lineage only the order of tensor ids ties a target nothing "
    "recorded to a stop_gradient: a stray stop_gradient of a tracked tensor "
    "made before an integer cast is named (certain) as the cut"))
def test_a_stray_stop_gradient_before_an_integer_cut_without_lineage():
    previous = fasttape.explain_none(False)
    try:
        x = tf.constant([1.5, 2.5])
        with GT() as tape:
            tape.watch(x)
            shown = tf.stop_gradient(x * 2.0)   # for a log line, say
            y = tf.cast(tf.cast(x, tf.int32), tf.float32)
        e = tape.explain(y, x)
    finally:
        fasttape.explain_none(previous)
    del shown
    assert e.cause == ex.TARGET_NOT_RECORDED or not e.certain, e


def test_stop_gradient_notes_cost_nothing_elsewhere():
    """Only a StopGradient of a tensor a tape tracks reaches explain; none
    is noted with no tape, nor for a tensor no tape tracks."""
    from fasttape.recording import _callback
    calls = []
    _callback.set_stop_gradient_hook(lambda *a: calls.append(a[1:]))
    try:
        x, c = tf.constant([1.0, 2.0]), tf.constant([3.0])
        tf.stop_gradient(x)                       # no tape
        with GT() as t:
            t.watch(x)
            y = tf.sin(x) * tf.exp(x)             # other ops: never asked
            tf.stop_gradient(c)                   # not tracked
            with t.stop_recording():
                tf.stop_gradient(y)               # the tape is paused
            s = tf.stop_gradient(y)
        assert calls == [(y._id, s._id)]
    finally:
        _callback.set_stop_gradient_hook(ex.note_stop_gradient)


def test_op_registered_as_not_differentiable(lineage):
    e = elementwise(GT, lambda x: tf.random.shuffle(x), explain=True)  # shuffle
    assert e.cause == ex.NOT_DIFFERENTIABLE_OP and e.op_type == "RandomShuffle"
    assert "not differentiable" in e.message
    if lineage:
        assert at(e, "shuffle")
    tf_gives_none(lambda GradientTape: elementwise(GradientTape,
                                                   tf.random.shuffle))


def test_op_with_no_registered_gradient_raises_as_in_tf(lineage):
    """No None to explain: TF (and fasttape) raise LookupError; explain()
    names the op."""
    def snapshot(x):
        return tf.raw_ops.Snapshot(input=x)  # snapshot

    def case(GradientTape):
        return elementwise(GradientTape, snapshot)
    tf_result = run_case(case, "tf")
    assert isinstance(tf_result.exc, LookupError), tf_result
    assert_parity(case)
    e = elementwise(GT, snapshot, explain=True)
    assert e.cause == ex.NO_GRADIENT and e.op_type == "Snapshot"
    if lineage:
        assert at(e, "snapshot")


def test_cut_inside_a_tf_function_names_the_call(lineage):
    @tf.function
    def quantize(a):
        return tf.round(a) * 3.0

    e = elementwise(GT, quantize, explain=True)
    assert e.cause == ex.NOT_DIFFERENTIABLE_OP
    assert e.op_type.startswith("__forward_quantize") or \
        e.op_type.startswith("__inference_quantize"), e.op_type
    assert "own backward function" in e.message and "registered" not in e.message
    tf_gives_none(lambda GradientTape: elementwise(GradientTape, quantize))


def test_stop_recording_block(lineage):
    m = model()
    with GT() as tape:
        with tape.stop_recording():  # stop-recording
            loss = tf.reduce_mean(m(X) ** 2)
    e = tape.explain(loss, m.trainable_variables)[0]
    assert e.cause == ex.STOP_RECORDING and at(e, "stop-recording")

    def case(GradientTape):
        mm = model()
        with GradientTape() as t:
            with t.stop_recording():
                t_loss = tf.reduce_mean(mm(X) ** 2)
        return t.gradient(t_loss, mm.trainable_variables)
    tf_gives_none(case)


def test_numpy_round_trip(explaining):
    m = model()
    with GT() as tape:
        h = m(X)
        h2 = tf.constant(np.clip(h.numpy(), -1, 1))  # numpy
        loss = tf.reduce_mean(h2 * 2.0)  # after-numpy
    e = tape.explain(loss, m.trainable_variables)[0]
    assert e.cause == ex.CONVERTED_TO_NUMPY and at(e, "numpy")
    assert e.op_type == "Mul" and str(line("after-numpy")) in e.message

    def case(GradientTape):
        mm = model()
        with GradientTape() as t:
            hh = tf.constant(np.clip(mm(X).numpy(), -1, 1))
            t_loss = tf.reduce_mean(hh * 2.0)
        return t.gradient(t_loss, mm.trainable_variables)
    tf_gives_none(case)


# -- the target is computed where the tape does not record -----------------------

def test_loss_computed_after_the_with_block(lineage):
    m = model()
    with GT() as tape:  # with-after
        pred = m(X)
    loss = tf.reduce_mean(pred ** 2)
    e = tape.explain(loss, m.trainable_variables)[0]
    assert e.cause == ex.TARGET_AFTER_TAPE
    assert at(e, "with-after")   # Python runs __exit__ on the with line

    def case(GradientTape):
        mm = model()
        with GradientTape() as t:
            p = mm(X)
        return t.gradient(tf.reduce_mean(p ** 2), mm.trainable_variables)
    tf_gives_none(case)


def test_target_computed_on_another_thread(explaining):
    w = tf.Variable([1.0, 2.0])
    out = {}
    with GT() as tape:
        h = w * 2.0
        th = threading.Thread(target=lambda: out.setdefault(
            "loss", tf.reduce_sum(h * h)))
        th.start()
        th.join()
    e = tape.explain(out["loss"], w)
    assert e.cause == ex.TARGET_OTHER_THREAD and "MainThread" in e.message
    assert not e.certain   # or made straight from a NumPy value
    assert tape.gradient(out["loss"], w) is None

    def case(GradientTape):
        tw = tf.Variable([1.0, 2.0])
        res = {}
        with GradientTape() as t:
            hh = tw * 2.0
            other = threading.Thread(target=lambda: res.setdefault(
                "loss", tf.reduce_sum(hh * hh)))
            other.start()
            other.join()
        return t.gradient(res["loss"], tw)
    tf_gives_none(case)


def test_source_used_only_under_a_different_tape(lineage):
    gen = model(1)
    disc = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with GT() as gen_tape:  # gen-tape
        fake = gen(X)
    with GT() as disc_tape:
        d_loss = tf.reduce_mean(disc(fake) ** 2)
    e = disc_tape.explain(d_loss, gen.trainable_variables)[0]
    assert e.cause == ex.OTHER_TAPE and at(e, "gen-tape")
    del gen_tape

    def case(GradientTape):
        g = model(1)
        d = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        with GradientTape() as g_tape:
            f = g(X)
        with GradientTape() as d_tape:
            t_loss = tf.reduce_mean(d(f) ** 2)
        del g_tape
        return d_tape.gradient(t_loss, g.trainable_variables)
    tf_gives_none(case)


def test_explain_before_gradient_leaves_a_non_persistent_tape_usable():
    def case(GradientTape):
        w = tf.Variable([1.0, 2.0])
        c = tf.Variable(3.0, trainable=False)
        with GradientTape() as t:
            y = tf.reduce_sum(w * w * c)
        if GradientTape is GT:
            es = t.explain(y, [w, c])
            assert [e.cause for e in es] == [ex.CONNECTED,
                                             ex.VARIABLE_NOT_TRAINABLE]
        return t.gradient(y, [w, c])
    assert_parity(case, allow_tf_error=False)


def test_explain_after_gradient_raises_like_gradient():
    w = tf.Variable(1.0)
    with GT() as tape:
        y = w * w
    tape.gradient(y, w)
    with pytest.raises(RuntimeError) as explain_err:
        tape.explain(y, w)
    with pytest.raises(RuntimeError) as gradient_err:
        tape.gradient(y, w)
    assert str(explain_err.value) == str(gradient_err.value)


def test_explain_inside_the_with_block_notes_none_of_its_own_ops(explaining):
    w = tf.Variable([0.3, 1.7])
    with GT(persistent=True) as tape:
        loss = tf.reduce_sum(tf.round(w) * w)
        r = tf.round(w)
        before = dict(tape._tape.explain_info.lineage)
        n_ops = tape._tape.core.num_ops
        assert tape.explain(loss, w).cause == ex.CONNECTED
        assert tape.explain(r, w).cause == ex.NOT_DIFFERENTIABLE_OP
        assert tape._tape.explain_info.lineage == before
        assert tape._tape.core.num_ops == n_ops


def test_a_tape_paused_in_a_long_loop_keeps_bounded_facts(monkeypatch):
    monkeypatch.setattr(ex, "EVENT_LIMIT", 10)
    w = tf.Variable(1.0)
    with GT(persistent=True) as tape:
        for _ in range(20):
            with tape.stop_recording():
                s = w * 2.0
        y = w * 3.0
    z = y * 2.0
    assert len(tape._tape.explain_info.events) == 10
    # Made after the last event kept: placed nowhere, no cause drawn from it.
    e = tape.explain(z, w)
    assert e.cause == ex.TARGET_NOT_RECORDED and not e.certain
    assert "not known" in e.message
    assert tape.explain(y, w).cause == ex.CONNECTED
    del s


def test_past_the_lineage_limit_no_cause_is_drawn_from_missing_ops(
        explaining, monkeypatch):
    monkeypatch.setattr(ex, "LINEAGE_LIMIT", 5)
    w = tf.Variable([1.0, 2.0])
    with GT() as tape:
        h = w * 2.0
        for _ in range(5):
            h = h + 1.0
        loss = tf.reduce_sum(tf.constant(h.numpy()) * 2.0)
    assert tape._tape.explain_info.truncated
    e = tape.explain(loss, w)
    assert e.cause == ex.NOT_CONNECTED and not e.certain
    assert "cut short" in e.message


def test_explanations_nest_like_sources():
    w, v = tf.Variable(1.0), tf.Variable(2.0, trainable=False)
    with GT(persistent=True) as tape:
        y = w * v
    out = tape.explain(y, {"w": w, "pair": (v, w)})
    assert out["w"].cause == ex.CONNECTED
    assert out["pair"][0].cause == ex.VARIABLE_NOT_TRAINABLE
    assert "Variable" in str(out["pair"][0]) and "[variable_not_trainable]" in str(out["pair"][0])


# -- explain_none: logging, and nothing changed when off ---------------------------

def test_explain_none_logs_each_none(explaining, caplog):
    m = model()
    with caplog.at_level(logging.WARNING, logger="fasttape"):
        with GT() as tape:
            loss = tf.reduce_mean(tf.cast(tf.argmax(m(X), 1), tf.float32))  # log-argmax
        grads = tape.gradient(loss, m.trainable_variables)
    assert grads == [None] * len(grads)
    records = [r for r in caplog.records if r.name == "fasttape"]
    assert len(records) == len(grads)
    msg = records[0].getMessage()
    assert "gradient is None for" in msg and "ArgMax" in msg
    assert f"test_explain.py:{line('log-argmax')}" in msg
    assert "[non_differentiable_dtype]" in msg


def test_explain_none_silent_for_connected_gradients(explaining, caplog):
    w = tf.Variable(2.0)
    with caplog.at_level(logging.WARNING, logger="fasttape"):
        with GT() as tape:
            y = w * w
        assert float(tape.gradient(y, w)) == 4.0
    assert not [r for r in caplog.records if r.name == "fasttape"]


def _none_cases():
    """Cases whose gradients hold Nones (and warnings: a non-float watch,
    gradient inside a persistent tape)."""
    def frozen(GradientTape):
        mm = model()
        with GradientTape() as t:
            loss = tf.reduce_mean(mm(X, training=True) ** 2)
        return t.gradient(loss, mm.variables)

    def mixed(GradientTape):
        w = tf.Variable([0.3, 1.7])
        x = tf.constant([1, 2])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            r = tf.reduce_sum(tf.round(w) * w + tf.cast(tf.argmax(w), tf.float32))
            g = t.gradient(r, [w, x])   # inside: TF's warning
        return g, t.gradient(r, x), t.gradient(tf.stop_gradient(r) * 2, w)

    def later(GradientTape):
        w = tf.Variable(1.0)
        with GradientTape() as t:
            h = w * 2.0
        return t.gradient(h * 3.0, w, unconnected_gradients="zero")
    return [frozen, mixed, later]


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_results_and_warnings_as_tf_with_explanation_off_or_on(on, caplog):
    previous = fasttape.explain_none(on)
    try:
        for case in _none_cases():
            def logged(GradientTape, case=case):
                with captured_log_first_n(tf_backprop.logging,
                                          ft_tape.logging) as logs:
                    result = case(GradientTape)
                return result, logs
            expected, actual = run_case(logged, "tf"), run_case(logged, "fasttape")
            compare(expected, actual, allow_tf_error=False)
    finally:
        fasttape.explain_none(previous)
    ours = [r for r in caplog.records if r.name == "fasttape"]
    assert bool(ours) == on   # logs only when asked


def test_off_installs_nothing_per_op():
    previous = fasttape.explain_none(False)
    try:
        from fasttape.recording import _recording
        from tensorflow.python.framework import ops
        assert ops._EagerTensorBase._numpy is _recording._original_numpy
        w = tf.Variable(1.0)
        with GT() as tape:
            y = w * 3.0
        assert tape._tape.explain_info.lineage is None
        assert not tape._tape.explain_info.conversions
        del y
    finally:
        fasttape.explain_none(previous)


def test_environment_variable_turns_it_on():
    code = (
        "import logging, tensorflow as tf, fasttape\n"
        "logging.basicConfig(level=logging.WARNING, format='%(name)s %(message)s')\n"
        "c = tf.constant(1.0)\n"
        "with fasttape.GradientTape() as t:\n"
        "    y = c * c\n"
        "print(t.gradient(y, c))\n")
    env = dict(os.environ, FASTTAPE_EXPLAIN_NONE="1", TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                         capture_output=True, timeout=300, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.strip() == "None"
    assert "fasttape gradient is None for" in out.stderr
    assert "[source_not_watched]" in out.stderr and "Mul at <string>:5" in out.stderr


# -- leaks ---------------------------------------------------------------------------

def _explain_everything():
    kernel = tf.Variable(tf.ones([4, 3]))
    frozen = tf.Variable(tf.ones([3]), trainable=False)
    w = tf.Variable([1.0, 2.0])
    c = tf.constant([1.0, 2.0])
    with GT(persistent=True) as tape:
        h = tf.nn.relu(tf.constant(X) @ kernel) * frozen
        k = tf.cast(tf.argmax(h, 1), tf.float32) * w[0]
        r = tf.reduce_sum(tf.round(w) * tf.stop_gradient(w) * c)
        n = tf.constant(h.numpy()) * 2.0
        tape.watch(c)
        with tape.stop_recording():
            s = w * 2.0
    after = h * 2.0
    for target in (k, r, n, s, after):
        for e in tape.explain(target, [w, c, kernel, frozen]):
            str(e)
    grads = tape.gradient(r, [w, c, kernel, frozen])
    del tape, grads


def test_explanations_leak_nothing(explaining):
    assert_leaks_nothing(_explain_everything)


def test_clear_caches_empties_the_frame_cache(explaining):
    _explain_everything()
    assert _frames._kinds
    fasttape.clear_caches()
    assert not _frames._kinds


def test_inside_tf_function(explaining, caplog):
    """Gradients taken while tracing: explained from the graph's trace."""
    w = tf.Variable([1.0, 2.0])

    @tf.function
    def step(x):
        with GT() as tape:
            y = tf.reduce_sum(tf.round(w * x))
        return tape.gradient(y, w)

    with caplog.at_level(logging.WARNING, logger="fasttape"):
        assert step(tf.constant([0.3, 0.6])) is None
    msgs = [r.getMessage() for r in caplog.records if r.name == "fasttape"]
    assert len(msgs) == 1 and "Round" in msgs[0], msgs
