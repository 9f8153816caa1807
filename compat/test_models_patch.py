"""fasttape.patch() / unpatch() / patched(): the round trip over every loaded
module (with Keras 3 and tf_keras imported, as in the model tests)."""

import sys
import types
import warnings

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


# -- all or nothing: modules that refuse, failures midway, nesting -------------


class _Refusing(types.ModuleType):
    """A module whose __setattr__ runs ``on_set`` (to raise, or to ignore
    the write) once ``armed``."""

    def __init__(self, name, on_set):
        super().__init__(name)
        object.__setattr__(self, "on_set", on_set)
        object.__setattr__(self, "armed", True)
        object.__setattr__(self, "GradientTape", _TF["GradientTape"])

    def __setattr__(self, key, value):
        if self.armed:
            self.on_set(self, key, value)
        else:
            object.__setattr__(self, key, value)


@pytest.fixture
def add_module(monkeypatch):
    """Load a module (it is scanned last: sys.modules keeps insertion order,
    so patch() has swapped TF's own holders when it reaches it)."""
    def add(on_set):
        name = f"fasttape_test_refusing_{len(sys.modules)}"
        module = _Refusing(name, on_set)
        monkeypatch.setitem(sys.modules, name, module)
        return module
    return add


def _read_only(module, key, value):
    raise AttributeError("read-only module")


def _ignores(module, key, value):
    pass


@pytest.mark.parametrize("on_set", [_read_only, _ignores], ids=["raises", "ignores"])
def test_a_module_that_refuses_the_swap_is_skipped_and_named(add_module, on_set):
    before = _holders(_TF["GradientTape"])
    module = add_module(on_set)
    with pytest.warns(fasttape.PatchSkippedWarning, match=module.__name__):
        with fasttape.patched():
            assert tf.GradientTape is fasttape.GradientTape
            assert module.GradientTape is _TF["GradientTape"]
            assert (module.__name__, "GradientTape") not in \
                fasttape._patch._recording.swapped_locations()
    assert not fasttape.is_patched()
    assert tf.GradientTape is _TF["GradientTape"]
    assert _holders(_TF["GradientTape"]) == before | {(module.__name__, "GradientTape")}


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_midway_rolls_the_whole_patch_back(add_module, interrupt):
    seen = []

    def on_set(module, key, value):
        seen.append(fasttape.is_patched())   # TF's own holders already swapped
        raise interrupt()
    add_module(on_set)
    before = _holders(_TF["GradientTape"])
    with pytest.raises(interrupt):
        fasttape.patch()
    assert seen == [True]
    assert not fasttape.is_patched()
    assert _holders(_TF["GradientTape"]) == before
    assert tf.GradientTape is _TF["GradientTape"]
    with pytest.raises(interrupt):
        with fasttape.patched():
            pytest.fail("the block must not run")
    assert not fasttape.is_patched()
    assert _holders(_TF["GradientTape"]) == before


def test_patch_is_idempotent_and_one_unpatch_undoes_it():
    before = _holders(_TF["GradientTape"])
    first = fasttape.patch()
    try:
        assert first > 0
        assert fasttape.patch() == 0          # nothing new to swap
        locations = fasttape._patch._recording.swapped_locations()
        assert len(locations) == len(set(locations)) == first
    finally:
        fasttape.unpatch()
    assert not fasttape.is_patched()
    assert _holders(_TF["GradientTape"]) == before


def test_patched_inside_a_patched_program_keeps_the_outer_patch(monkeypatch):
    before = _holders(_TF["GradientTape"])
    fasttape.patch()
    try:
        late = types.ModuleType("fasttape_test_late_import")
        late.GradientTape = _TF["GradientTape"]   # imported after patch()
        monkeypatch.setitem(sys.modules, late.__name__, late)
        with fasttape.patched():
            assert late.GradientTape is fasttape.GradientTape
        assert late.GradientTape is _TF["GradientTape"]   # the block's swap undone
        assert tf.GradientTape is fasttape.GradientTape    # the outer one kept
        assert fasttape.is_patched()
    finally:
        fasttape.unpatch()
    assert _holders(_TF["GradientTape"]) == before | {(late.__name__, "GradientTape")}


def test_unpatch_leaves_an_attribute_reassigned_since(monkeypatch):
    holder = types.ModuleType("fasttape_test_reassigned")
    holder.GradientTape = _TF["GradientTape"]
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    with fasttape.patched():
        assert holder.GradientTape is fasttape.GradientTape
        holder.GradientTape = mine = type("MyTape", (), {})
    assert holder.GradientTape is mine
    assert tf.GradientTape is _TF["GradientTape"]


def test_a_module_that_refuses_to_take_tf_back_is_named(add_module):
    module = add_module(_read_only)
    object.__setattr__(module, "armed", False)
    fasttape.patch()
    assert module.GradientTape is fasttape.GradientTape
    object.__setattr__(module, "armed", True)   # read-only from now on
    with pytest.warns(fasttape.PatchSkippedWarning, match=module.__name__):
        fasttape.unpatch()
    assert tf.GradientTape is _TF["GradientTape"]
    assert fasttape._patch._recording.swapped_locations() == [
        (module.__name__, "GradientTape")]        # still listed: honest
    object.__setattr__(module, "armed", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fasttape.unpatch()
    assert not fasttape.is_patched()
    assert module.GradientTape is _TF["GradientTape"]


class _InterruptAt:
    """A tracer that raises KeyboardInterrupt at the n-th line or return
    event in the frames of ``codes`` (n = None: only counts them), as a
    signal may between any two bytecodes."""

    def __init__(self, codes, n=None):
        self.codes, self.n, self.events = codes, n, 0

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code in self.codes:
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event in ("line", "return"):
            self.events += 1
            if self.events == self.n:
                raise KeyboardInterrupt
        return self._local


def _run_traced(tracer, fn):
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)


def test_an_interrupt_at_any_point_of_patch_or_unpatch_leaves_no_half_patch():
    """An interrupt at every line of a swap (patch()) rolls back everything;
    one at every line of a restore (unpatch()) leaves what is not yet
    restored listed, and the next unpatch() restores it."""
    from fasttape.recording import _recording
    before = _holders(_TF["GradientTape"])
    swap_codes = {_recording._set.__code__}
    restore_codes = {_recording._restore_to.__code__, _recording._set.__code__}
    counter = _InterruptAt(swap_codes)
    _run_traced(counter, fasttape.patch)
    fasttape.unpatch()
    assert counter.events > 3 * len(before)
    # Every point of the first swaps (each swap runs the same lines), and
    # the last ones.
    points = sorted(set(range(1, min(counter.events, 30) + 1)) |
                    set(range(max(1, counter.events - 5), counter.events + 1)))
    for n in points:
        with pytest.raises(KeyboardInterrupt):
            _run_traced(_InterruptAt(swap_codes, n), fasttape.patch)
        assert not fasttape.is_patched(), n
        assert _holders(_TF["GradientTape"]) == before, n
    fasttape.patch()
    counter = _InterruptAt(restore_codes)
    _run_traced(counter, fasttape.unpatch)
    points = sorted(set(range(1, min(counter.events, 30) + 1)) |
                    set(range(max(1, counter.events - 5), counter.events + 1)))
    for n in points:
        fasttape.patch()
        with pytest.raises(KeyboardInterrupt):
            _run_traced(_InterruptAt(restore_codes, n), fasttape.unpatch)
        fasttape.unpatch()
        assert not fasttape.is_patched(), n
        assert _holders(_TF["GradientTape"]) == before, n


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
