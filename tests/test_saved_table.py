"""The shipped table of which tensors each TF gradient reads
(fasttape/recording/_saved_table.py) against the source reader it stands in
for (fasttape/recording/_saved.py): a TF release whose gradient functions
changed shows here, and `python -m fasttape.recording._saved --regenerate`
under that release writes its table afresh."""

import ast
import os
import subprocess
import sys

import pytest
from tensorflow.python.framework import ops

from fasttape.gradients import _tf_compat
from fasttape.recording import _saved, _saved_table

RELEASE = "%d.%d" % _tf_compat.TF_VERSION
REGENERATE = "python -m fasttape.recording._saved --regenerate"


def _shipped():
    if RELEASE not in _saved_table.TABLES:
        pytest.xfail(f"no shipped table for TF {RELEASE}: the source reader "
                     f"answers for every op; run `{REGENERATE}` under it")
    return _saved_table.TABLES[RELEASE]


def test_the_shipped_table_is_what_the_reader_reads():
    """Read in a fresh process, as the generator reads it: this one's
    registry may hold gradients other modules registered since."""
    shipped = _shipped()
    code = ("from fasttape.recording._saved import read_table; "
            "print(repr(read_table()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    read = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    changed = {op: (shipped[op], read.get(op)) for op in shipped
               if read.get(op) != shipped[op]}
    assert not changed, (f"TF {RELEASE}'s gradients differ from the shipped "
                         f"table (shipped, read): {changed}; run `{REGENERATE}`")
    # and it covers every gradient `import tensorflow` registers
    assert not set(read) - set(shipped), (
        f"not in the shipped table: {sorted(set(read) - set(shipped))}; "
        f"run `{REGENERATE}`")


@pytest.fixture
def fresh_cache():
    saved = dict(_saved._saved_cache)
    _saved._saved_cache.clear()
    yield
    _saved._saved_cache.clear()
    _saved._saved_cache.update(saved)


def test_saved_indices_answers_from_the_table_without_reading(fresh_cache, monkeypatch):
    _shipped()

    def no_reading(*args, **kwargs):
        raise AssertionError("read a gradient function's source")

    monkeypatch.setattr(_saved, "_analyse", no_reading)
    assert _saved.saved_indices("MatMul") == (frozenset({0, 1}), frozenset())
    assert _saved.saved_indices("Tanh") == (frozenset(), frozenset({0}))


def test_ops_outside_the_table_are_read(fresh_cache):
    op_type = "FasttapeSavedTableTestOp"
    assert op_type not in _saved._table

    @ops.RegisterGradient(op_type)
    def _grad(op, grad):
        return [grad * op.outputs[0]]

    try:
        assert _saved.saved_indices(op_type) == (frozenset(), frozenset({0}))
    finally:
        ops._gradient_registry._registry.pop(op_type)  # pylint: disable=protected-access


def test_an_entry_for_another_function_is_not_used(fresh_cache, monkeypatch):
    """A table entry whose function's name is not the registered one's (a
    release that renamed it, a registry another library filled) is read."""
    monkeypatch.setitem(_saved._table, "Tanh", ("_SomeOtherGrad", (), ()))
    assert _saved.saved_indices("Tanh") == (frozenset(), frozenset({0}))
