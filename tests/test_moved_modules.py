"""Public modules that moved into a layer subpackage still import from their
old path: the same module object (so a flag set through either name is one
flag), with a DeprecationWarning that names the new path."""
import importlib
import sys

import pytest

import fasttape

MOVED = {
    "fasttape.explain": "fasttape.diagnostics.explain",
    "fasttape.anomaly": "fasttape.diagnostics.anomaly",
    "fasttape.profiler": "fasttape.diagnostics.profiler",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_new_module_with_a_warning(old, monkeypatch):
    new = MOVED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delattr(fasttape, old.rpartition(".")[2], raising=False)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")) as record:
        __import__(old)   # as an import statement does
        module = sys.modules[old]
    assert module is importlib.import_module(new)
    assert record[0].filename == __file__   # points at the import statement
    monkeypatch.delitem(sys.modules, old)
    monkeypatch.delattr(fasttape, old.rpartition(".")[2])
    with pytest.warns(DeprecationWarning):
        exec(f"from fasttape import {old.rpartition('.')[2]} as m", {})


def test_public_names_unchanged_and_quiet(recwarn):
    for name in fasttape.__all__:
        assert getattr(fasttape, name) is not None
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)
                and "moved to" in str(w.message)]
