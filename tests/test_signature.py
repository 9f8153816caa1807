"""backward_signature: what keys a compiled backward pass besides tensor
values. Equal signatures must mean the same pass (a false match would
replay the wrong function: a silently wrong gradient); unequal ones cost
only a build."""

import types

import pytest
import tensorflow as tf
from tensorflow.python.framework import dtypes

import fasttape
from fasttape.gradients._payloads import (EagerOp, Signature,
                                          backward_signature, words_hash)


def _entry(attrs, saved=(), metas=(None,), op_type="Op", num_inputs=None):
    n_in = len(saved) if num_inputs is None else num_inputs
    return types.SimpleNamespace(op_type=op_type, output_meta=tuple(metas),
                                 payload=EagerOp(attrs, tuple(saved), n_in))


def _sig(*entries):
    signed = backward_signature(list(entries), {}, lambda op_type: ())
    assert signed is not None
    return signed[0]


def _same(a, b):
    return a == b and hash(a) == hash(b)


@pytest.mark.parametrize("a, b", [
    (("a", "bc"), ("ab", "c")),          # strings keep their bounds
    (("x", 1), ("x", True)),             # an int is no bool
    (("x", 1), ("x", 1.0)),
    (("x", 1), ("x", "1")),
    (("x", 1), ("x", tf.float32)),       # nor a DType
    (("x", tf.float32), ("x", tf.float64)),
    (("x", [[1], [2]]), ("x", [[1, 2]])),
    (("x", [1, 2]), ("x", [1, 2, 3])),
    (("x", None), ("x", ())),
    (("x", b"ab"), ("x", "ab")),
    (("x", 2 ** 70), ("x", 2 ** 70 + 1)),   # kept as Python ints
    (("x", frozenset({1})), ("x", frozenset({2}))),   # kept as objects
])
def test_different_attrs_give_different_signatures(a, b):
    assert _sig(_entry(a)) != _sig(_entry(b))


@pytest.mark.parametrize("a, b", [
    (("x", [1, 2]), ("x", (1, 2))),      # a list attr is its tuple
    (("x", tf.float32), ("x", dtypes.DType(1))),   # a DType by its enum
    (("x", frozenset({1})), ("x", frozenset({1}))),
    (("x", 2 ** 70), ("x", 2 ** 70)),
])
def test_equal_attrs_give_equal_signatures(a, b):
    assert _same(_sig(_entry(a)), _sig(_entry(b)))


def test_op_type_metas_and_saved_tensors_are_in_it():
    x32 = tf.ones((2, 3))
    base = _sig(_entry(("T", 1), [x32]))
    assert _same(base, _sig(_entry(("T", 1), [tf.zeros((2, 3))])))
    assert base != _sig(_entry(("T", 1), [x32], op_type="Other"))
    assert base != _sig(_entry(("T", 1), [tf.ones((3, 2))]))
    assert base != _sig(_entry(("T", 1), [tf.ones((2, 3), tf.float64)]))
    assert base != _sig(_entry(("T", 1), [None]))
    assert base != _sig(_entry(("T", 1), [x32], metas=[((2, 3), 1)]))
    # Where one entry ends and the next begins is part of it.
    assert _sig(_entry(("T", 1)), _entry(())) != _sig(_entry(()), _entry(("T", 1)))


def test_an_attr_that_cannot_be_a_key_fails_at_the_hash():
    sig = _sig(_entry(("x", {"a": 1})))
    assert isinstance(sig, Signature)
    with pytest.raises(TypeError):
        hash(sig)


def test_words_hash_reads_every_word():
    a = bytes(8 * 40)
    b = bytearray(a)
    b[8 * 39] = 1
    assert words_hash(a) != words_hash(bytes(b))
    assert words_hash(a) == words_hash(bytes(8 * 40))


def test_a_replayed_program_finds_its_pass():
    # The same recorded program, step after step: built once, then replayed
    # (its signatures, built anew at every step, are equal).
    from fasttape.gradients import _compiled
    w = tf.Variable(tf.ones((3, 3)))
    x = tf.ones((2, 3))
    _compiled.CACHE.clear()
    previous = _compiled.set_mode("always")
    try:
        for _ in range(4):
            with fasttape.GradientTape() as t:
                y = tf.reduce_sum(tf.tanh(tf.matmul(x, w, transpose_b=True)))
            t.gradient(y, w)
        stats = dict(_compiled.CACHE.stats)
    finally:
        _compiled.set_mode(previous)
        _compiled.CACHE.clear()
    assert stats.get("built") == 1 and stats.get("replayed") == 3, stats


def test_the_words_hold_values_not_addresses():
    # Every word is a tag, a length or a value: none is an object's address
    # (which a later object could reuse: a false match).
    import numpy as np
    sig = _sig(_entry((True, False, 7, tf.float32, dtypes.DType(2)),
                      [tf.ones((512, 300))], num_inputs=1))
    words = [int(v) for v in np.frombuffer(sig.words, np.int64)]
    op_type = [-2, 2, int.from_bytes(b"Op", "little")]
    attrs = [-8, 5, -5, 1, -5, 0, -4, 7, -7, 1, -7, 2]
    metas = [1, -1]
    saved = [1, -10, 1, 2, 512, 300]
    assert words == op_type + attrs + metas + saved
    assert sig.extras == ()


def test_tensor_reads_call_tf_c_methods_and_agree_with_them():
    # The signature and the recorder read an eager tensor's dtype and
    # shape through the C functions of its _datatype_enum and _shape_tuple
    # (skipping Tensor's __getattr__ hook); on a release where they are no
    # longer plain METH_NOARGS functions, the methods are called instead.
    from fasttape.gradients import _payloads
    assert _payloads.fast_tensor_reads() == (True, True)
    import numpy as np
    for x in (tf.ones((512, 300)), tf.constant(3, tf.int64),
              tf.zeros((0, 4, 1), tf.float16), tf.constant([b"a"]),
              tf.constant([True, False])):
        sig = _sig(_entry((), [x], num_inputs=1))
        words = [int(v) for v in np.frombuffer(sig.words, np.int64)]
        shape = list(x._shape_tuple())
        assert words[-3 - len(shape):] == [-10, x._datatype_enum(),
                                           len(shape)] + shape
