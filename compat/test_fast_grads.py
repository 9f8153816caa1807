"""Each fast gradient rule (fasttape/_fast_grads.py) against TF's registered
gradient: same values (bit for bit where TF runs the same kernels), for
broadcasting shapes and several dtypes, and proof that the rule really ran.
In graph mode and under a recording tape the rules must stand aside."""

import numpy as np
import pytest
import tensorflow as tf

import fasttape
from fasttape.gradients import _fast_grads
from fasttape.recording import _recording
from harness import assert_same

RNG = np.random.default_rng(7)


def _t(shape, dtype=tf.float32, positive=False):
    a = RNG.normal(size=shape)
    if positive:
        a = np.abs(a) + 0.5
    return tf.constant(a, dtype=dtype)


def _conv_case():
    x, k = _t((2, 6, 6, 3)), _t((3, 3, 3, 4))
    return "Conv2D", lambda x, k: tf.nn.conv2d(x, k, [1, 2, 2, 1], "SAME"), [x, k]


CASES = [
    ("Identity", tf.identity, [_t((3, 2))]),
    ("AddN", lambda a, b: tf.add_n([a, b, a]), [_t((2, 3)), _t((2, 3))]),
    ("AddV2", tf.add, [_t((2, 3)), _t((2, 3))]),
    ("AddV2-broadcast", tf.add, [_t((4, 1, 3)), _t((2, 1))]),
    ("AddV2-scalar", tf.add, [_t((2, 3)), _t(())]),
    ("Sub", tf.subtract, [_t((2, 3)), _t((2, 3))]),
    ("Sub-broadcast", tf.subtract, [_t((3,)), _t((2, 3))]),
    ("Mul", tf.multiply, [_t((2, 3)), _t((2, 3))]),
    ("Mul-broadcast", tf.multiply, [_t((2, 1, 3)), _t((4, 1))]),
    ("Mul-f64", tf.multiply, [_t((2, 3), tf.float64), _t((3,), tf.float64)]),
    ("RealDiv", tf.math.truediv, [_t((2, 3)), _t((2, 3), positive=True)]),
    ("RealDiv-broadcast", tf.math.truediv, [_t((2, 3)), _t((3,), positive=True)]),
    ("Neg", tf.negative, [_t((2, 3))]),
    ("Sin", tf.sin, [_t((2, 3))]),
    ("Cos", tf.cos, [_t((2, 3))]),
    ("Exp", tf.exp, [_t((2, 3))]),
    ("Log", tf.math.log, [_t((2, 3), positive=True)]),
    ("Square", tf.square, [_t((2, 3))]),
    ("Sqrt", tf.sqrt, [_t((2, 3), positive=True)]),
    ("Tanh", tf.tanh, [_t((2, 3))]),
    ("Sigmoid", tf.sigmoid, [_t((2, 3))]),
    ("Relu", tf.nn.relu, [_t((2, 3))]),
    ("Sin-f16", tf.sin, [_t((2, 3), tf.float16)]),
    ("Tanh-f64", tf.tanh, [_t((2, 3), tf.float64)]),
    ("MatMul", tf.matmul, [_t((2, 3)), _t((3, 4))]),
    ("MatMul-ta", lambda a, b: tf.matmul(a, b, transpose_a=True), [_t((3, 2)), _t((3, 4))]),
    ("MatMul-tb", lambda a, b: tf.matmul(a, b, transpose_b=True), [_t((2, 3)), _t((4, 3))]),
    ("MatMul-tab", lambda a, b: tf.matmul(a, b, True, True), [_t((3, 2)), _t((4, 3))]),
    ("BiasAdd", tf.nn.bias_add, [_t((2, 3)), _t((3,))]),
    ("BiasAdd-NCHW", lambda x, b: tf.nn.bias_add(x, b, data_format="NCHW"),
     [_t((2, 3, 2, 2)), _t((3,))]),
    ("SparseSoftmaxCrossEntropyWithLogits",
     lambda logits: tf.nn.sparse_softmax_cross_entropy_with_logits(
         tf.constant([0, 2]), logits), [_t((2, 3))]),
    _conv_case(),
    ("MaxPool", lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID"), [_t((1, 4, 4, 2))]),
    ("Reshape", lambda x: tf.reshape(x, (3, 2)), [_t((2, 3))]),
    ("ExpandDims", lambda x: tf.expand_dims(x, 1), [_t((2, 3))]),
    ("Squeeze", lambda x: tf.squeeze(x, 1), [_t((2, 1, 3))]),
    ("Transpose", lambda x: tf.transpose(x, (2, 0, 1)), [_t((2, 3, 4))]),
    ("Sum-all", tf.reduce_sum, [_t((2, 3))]),
    ("Sum-axis", lambda x: tf.reduce_sum(x, axis=1), [_t((2, 3, 4))]),
    ("Sum-keepdims", lambda x: tf.reduce_sum(x, axis=[0, 2], keepdims=True), [_t((2, 3, 4))]),
    ("Mean-all", tf.reduce_mean, [_t((2, 3))]),
    ("Mean-axis", lambda x: tf.reduce_mean(x, axis=-1), [_t((2, 3, 4))]),
    ("Cast", lambda x: tf.cast(x, tf.float64), [_t((2, 3))]),
    ("ReadVariableOp", None, None),
]


def _op_type(case_id):
    return case_id.split("-")[0]


def _run(GradientTape, fn, inputs):
    w = {}
    with GradientTape() as tape:
        for x in inputs:
            tape.watch(x)
        y = fn(*inputs)
        w = tf.constant(RNG.normal(size=y.shape), dtype=y.dtype)
        loss = tf.reduce_sum(y * w)
    return tape.gradient(loss, inputs)


@pytest.fixture
def rule_calls(monkeypatch):
    calls = {}
    for name, rule in list(_fast_grads.FAST_GRADS.items()):
        def counted(op, g, skip, _rule=rule, _name=name):
            result = _rule(op, g, skip)
            if result is not None:
                calls[_name] = calls.get(_name, 0) + 1
            return result
        monkeypatch.setitem(_fast_grads.FAST_GRADS, name, counted)
    return calls


@pytest.mark.parametrize("case_id,fn,inputs", CASES, ids=[c[0] for c in CASES])
def test_fast_rule_matches_tf(case_id, fn, inputs, rule_calls):
    if fn is None:  # ReadVariableOp
        v = tf.Variable(RNG.normal(size=(2, 3)).astype("float32"))
        fn, inputs = (lambda: v * 3.0), []

        def run(GradientTape):
            with GradientTape() as tape:
                y = tf.reduce_sum(tf.sin(v.read_value()) * 3.0)
            return tape.gradient(y, v)
        expected, got = run(tf.GradientTape), run(fasttape.GradientTape)
    else:
        state = RNG.bit_generator.state
        expected = _run(tf.GradientTape, fn, inputs)
        RNG.bit_generator.state = state
        got = _run(fasttape.GradientTape, fn, inputs)
    assert_same(expected, got)
    assert rule_calls.get(_op_type(case_id), 0) >= 1, (
        f"the fast rule for {_op_type(case_id)} did not run: {rule_calls}")


def test_every_fast_rule_has_a_case():
    covered = {_op_type(c[0]) for c in CASES}
    missing = set(_fast_grads.FAST_GRADS) - covered - {"Add"}
    assert not missing, f"fast rules without a parity case: {sorted(missing)}"


def test_rules_stand_aside_in_graph_mode(rule_calls):
    x = _t((2, 3))

    @tf.function
    def f(x, GradientTape):
        with GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(tf.sin(x) * x)
        return tape.gradient(y, x)

    expected = f(x, tf.GradientTape)
    got = f(x, fasttape.GradientTape)
    assert_same(expected, got)
    assert not rule_calls


def test_rules_stand_aside_under_a_recording_tape(rule_calls):
    """Second order: the recorded backward must be TF's own functions."""
    calls_during_inner = []

    def case(GradientTape):
        x = tf.constant([0.3, 0.7])
        with GradientTape() as outer:
            outer.watch(x)
            with GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(tf.sin(x) * x)
            g = inner.gradient(y, x)
            calls_during_inner.append(dict(rule_calls))
        return outer.gradient(g, x)

    assert_same(case(tf.GradientTape), case(fasttape.GradientTape))
    assert calls_during_inner == [{}, {}]
    assert rule_calls  # the outer backward, recorded by nothing, may use them


def test_rules_off_gives_the_same_values():
    fn, inputs = tf.multiply, [_t((4, 1, 3)), _t((2, 1))]
    state = RNG.bit_generator.state
    with_rules = _run(fasttape.GradientTape, fn, inputs)
    _recording.VSPACE.use_fast_rules = False
    try:
        RNG.bit_generator.state = state
        without = _run(fasttape.GradientTape, fn, inputs)
    finally:
        _recording.VSPACE.use_fast_rules = True
    assert_same(without, with_rules)


def test_fast_rules_only_for_ops_tf_can_differentiate():
    """A fast rule for an op with no registered gradient would answer where
    TF raises LookupError."""
    from tensorflow.python.framework import ops
    for op_type in _fast_grads.FAST_GRADS:
        assert ops._gradient_registry.lookup(op_type) is not None, op_type
