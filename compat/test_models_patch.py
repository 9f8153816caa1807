"""fasttape.patch() / unpatch() / patched(): the round trip over every loaded
module (with Keras 3 and tf_keras imported, as in the model tests)."""

import sys

import pytest
import tensorflow as tf
import keras  # noqa: F401 - loaded so that its modules are scanned too
import tf_keras  # noqa: F401
import tf_keras.src.engine.training  # noqa: F401
import keras.src.backend.tensorflow.trainer  # noqa: F401
from tensorflow.python.eager import backprop

import fasttape

# Held in a dict: patch() swaps module attributes, so a module-level
# ``TF_TAPE = tf.GradientTape`` in this module would be swapped as well.
_TF = {"GradientTape": tf.GradientTape}
assert _TF["GradientTape"].__module__ == "tensorflow.python.eager.backprop"
# patch() may swap other TF classes as well (ForwardAccumulator); the count
# it returns covers all of them.
TF_CLASSES = [_TF["GradientTape"], tf.autodiff.ForwardAccumulator]
assert all(c.__module__.startswith("tensorflow.") for c in TF_CLASSES)


def _holders(cls):
    """(module name, attribute) of every loaded module attribute that is cls."""
    found = set()
    for name, module in list(sys.modules.items()):
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for attr, value in list(namespace.items()):
            if value is cls:
                found.add((name, attr))
    return found


@pytest.fixture(autouse=True)
def _always_unpatched():
    assert not fasttape.is_patched()
    yield
    if fasttape.is_patched():  # a failed test must not leak the patch
        fasttape.unpatch()
        pytest.fail("test left fasttape patched")


def test_patch_unpatch_round_trip():
    before = _holders(_TF["GradientTape"])
    assert ("tensorflow", "GradientTape") in before
    assert ("tensorflow.python.eager.backprop", "GradientTape") in before
    others_before = {c: _holders(c) for c in TF_CLASSES[1:]}

    count = fasttape.patch()
    try:
        assert count > 0
        assert fasttape.is_patched()
        assert not _holders(_TF["GradientTape"]), sorted(_holders(_TF["GradientTape"]))
        # Every swap is counted once: TF's tape everywhere, plus whatever
        # holders of the other TF classes patch() replaced.
        others_swapped = sum(len(held - _holders(c))
                             for c, held in others_before.items())
        assert count == len(before) + others_swapped, (count, sorted(before))
        for name, attr in before:
            assert getattr(sys.modules[name], attr) is fasttape.GradientTape, (name, attr)
        assert tf.GradientTape is fasttape.GradientTape
        assert tf.autodiff.GradientTape is fasttape.GradientTape
        assert tf.compat.v2.GradientTape is fasttape.GradientTape
        assert backprop.GradientTape is fasttape.GradientTape
    finally:
        fasttape.unpatch()

    assert not fasttape.is_patched()
    assert _holders(_TF["GradientTape"]) == before
    for name, attr in before:
        assert getattr(sys.modules[name], attr) is _TF["GradientTape"], (name, attr)
    assert tf.GradientTape is _TF["GradientTape"]
    for c, held in others_before.items():
        assert _holders(c) == held, c


def test_patched_context_restores_on_exception():
    before = _holders(_TF["GradientTape"])
    with pytest.raises(RuntimeError, match="boom"):
        with fasttape.patched():
            assert tf.GradientTape is fasttape.GradientTape
            raise RuntimeError("boom")
    assert not fasttape.is_patched()
    assert _holders(_TF["GradientTape"]) == before


def test_repeated_round_trips():
    before = _holders(_TF["GradientTape"])
    for _ in range(3):
        with fasttape.patched():
            assert tf.GradientTape is fasttape.GradientTape
        assert _holders(_TF["GradientTape"]) == before
    first = fasttape.patch()
    fasttape.unpatch()
    assert fasttape.patch() == first >= len(before)
    fasttape.unpatch()
    assert _holders(_TF["GradientTape"]) == before


def test_tape_made_while_patched_still_works_after_unpatch():
    """A tape constructed under the patch is fasttape's and stays usable."""
    x = tf.constant(3.0)
    with fasttape.patched():
        tape = tf.GradientTape()
    assert type(tape) is fasttape.GradientTape
    with tape:
        tape.watch(x)
        y = x * x * x
    assert float(tape.gradient(y, x)) == 27.0


def test_what_patch_does_not_reach():
    """docs/differences.md: a tape object made before patch() stays TF's, and
    so does TF's class held anywhere but a module attribute."""
    before = tf.GradientTape()

    def default_argument(cls=tf.GradientTape):
        return cls

    class Holder:
        cls = tf.GradientTape

    with fasttape.patched():
        assert tf.GradientTape is fasttape.GradientTape
        assert type(before) is _TF["GradientTape"]
        assert default_argument() is _TF["GradientTape"]
        assert Holder.cls is _TF["GradientTape"]
