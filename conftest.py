"""`pytest` from the repository root also runs every Python block of
README.md and docs/*.md (Sybil).

Each block runs as pasted: in a namespace of its own (nothing defined by an
earlier block), in a temporary working directory (so files it writes go
there). Blocks in other languages (shell commands) are not run. A block
that needs Graphviz is preceded by
``<!-- skip: next if(dot_missing, reason="needs Graphviz's dot") -->``.
"""

import linecache
import os
import shutil
import sys
import tempfile

import pytest

from sybil import Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.markdown import CodeBlockParser, SkipParser

# What the skip conditions may read; every other name is dropped before a
# block runs.
_SETUP = {"dot_missing"}


class _AsPasted(PythonEvaluator):
    def __call__(self, example):
        namespace = example.namespace
        for name in [n for n in namespace if n not in _SETUP and n != "__name__"]:
            del namespace[name]
        super().__call__(example)


def _setup(namespace):
    namespace["dot_missing"] = shutil.which("dot") is None
    namespace["_cwd"] = os.getcwd()
    namespace["_tmp"] = tempfile.TemporaryDirectory(prefix="fasttape-docs-")
    os.chdir(namespace["_tmp"].name)
    _SETUP.update(("_cwd", "_tmp"))


def _teardown(namespace):
    os.chdir(namespace["_cwd"])
    namespace["_tmp"].cleanup()


pytest_collect_file = Sybil(
    parsers=[CodeBlockParser("python", _AsPasted()), SkipParser()],
    patterns=["README.md", "docs/*.md"],
    setup=_setup, teardown=_teardown,
).pytest()


# -- the order files run in under pytest-xdist -------------------------------
#
# With ``--dist loadfile`` each worker runs whole files, taking the next file
# in the queue when it is nearly done with its own. xdist's default queue
# puts the files with the most tests first, so files of a few slow tests
# (subprocesses, TF's nested forward-mode traces) come last, where one
# worker may run them alone while the other has finished. pyproject.toml's
# ``--no-loadscope-reorder`` keeps the queue in collection order, and each
# worker sorts its collection the same way: files not listed below first
# (their cost unknown: never left for last), then the listed ones, slowest
# first (longest processing time first). The seconds are one worker's on a
# loaded 2-core machine; only their order matters. Within a file the order
# stays as written.
FILE_SECONDS = {
    "compat/test_per_example_rules.py": 374,
    "compat/test_op_corpus.py": 336,
    "compat/test_memory_budget.py": 285,
    "compat/test_op_corpus_modes.py": 279,
    "compat/test_per_example.py": 185,
    "compat/test_faults.py": 142,
    "compat/test_tf_accumulator_mix.py": 132,
    "compat/test_models_fresh_process.py": 121,
    "compat/test_models_loops.py": 114,
    "compat/test_per_example_traced.py": 109,
    "compat/test_reliability_backward.py": 108,
    "compat/test_forwardprop.py": 82,
    "compat/test_faults_compiled.py": 75,
    "compat/test_models_fit.py": 62,
    "compat/test_reliability_tracing.py": 62,
    "compat/test_compiled_backward.py": 38,
    "compat/test_per_example_row_ops.py": 37,
    "compat/test_reliability_memory.py": 35,
    "compat/test_forwardprop_ops.py": 24,
    "compat/test_tf_differences.py": 19,
    "compat/test_models_patch.py": 16,
    "compat/test_api_parity.py": 16,
    "compat/test_reliability_forward.py": 12,
    "compat/test_models_threads.py": 8,
    "compat/test_tf_order.py": 3,
}


def pytest_collection_modifyitems(config, items):
    """An xdist worker's collection in the order above."""
    if not hasattr(config, "workerinput"):
        return
    unknown = float("inf")
    items.sort(key=lambda item: -FILE_SECONDS.get(item.nodeid.split("::")[0],
                                                   unknown))


# -- the source AutoGraph reads ----------------------------------------------
#
# AutoGraph converts a function when it is first traced, reading its source
# through inspect and linecache at the line its code object was compiled at,
# and first reads the file again from disk (autograph's
# inspect_utils._fix_linecache_record calls linecache.updatecache for every
# function it converts). A test file edited (or checked out) while the suite
# runs then hands AutoGraph the lines of whatever stands there now: a
# module-level tf.function first traced late in a file was converted from
# another def and raised TypeError ("tf___reference() takes 3 positional
# arguments but 4 were given"). So each module under the root directory
# keeps, in linecache, the source it was imported from (read right after
# each test module is collected): the code that runs is that one.

_PINNED = {}
_SEEN = set()
_UPDATECACHE = linecache.updatecache


def _updatecache(filename, module_globals=None):
    lines = _PINNED.get(filename)
    if lines is None:
        return _UPDATECACHE(filename, module_globals)
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return lines


def pin_sources(root):
    """Keep the loaded modules' files under ``root`` in linecache as they
    are now (the first time each is seen), whatever happens to them on
    disk."""
    root = os.path.join(os.path.abspath(str(root)), "")
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if (not isinstance(path, str) or path in _SEEN
                or not path.startswith(root) or not path.endswith(".py")):
            continue
        _SEEN.add(path)
        lines = linecache.getlines(path, module.__dict__)
        if lines:
            _PINNED[path] = lines
            _updatecache(path)
    if _PINNED:
        linecache.updatecache = _updatecache


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if isinstance(collector, pytest.Module):
        pin_sources(collector.config.rootpath)
    return report
