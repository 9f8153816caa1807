"""Ops may be recorded without output metadata (None): the targets' ones then
come from the caller's target_meta, and a missing one is a loud error."""

import pytest

import numpy_vspace as nv

core = nv.core


class ScalarVSpace(core.VSpace):
    def __init__(self):
        super().__init__()
        self.ones = []

    def call_backward(self, op_type, payload, unneeded, out_grads):
        return [out_grads[0] * payload]

    def ones_like(self, meta):
        self.ones.append(meta)
        return 1.0

    def zeros_like(self, meta):
        return 0.0

    def aggregate(self, grads):
        return sum(grads)

    def num_elements(self, grad):
        return 1


def _tape():
    tape = core.GradientTapeCore(False)
    tape.watch(1)
    tape.record_operation("Scale", [1], [2], (None,), 3.0)
    tape.record_operation("Scale", [2], [3], (None,), 5.0)
    return tape


def test_target_meta_supplies_the_ones():
    vs = ScalarVSpace()
    [g] = _tape().compute_gradient(vs, [3], [1], None, None, True, False,
                                   ["target-meta"])
    assert g == 15.0
    assert vs.ones == ["target-meta"]


def test_missing_meta_for_a_target_raises():
    with pytest.raises(ValueError, match="No metadata"):
        _tape().compute_gradient(ScalarVSpace(), [3], [1])


def test_given_output_gradient_needs_no_meta():
    [g] = _tape().compute_gradient(ScalarVSpace(), [3], [1], None, [2.0])
    assert g == 30.0
