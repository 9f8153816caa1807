"""`pytest` from the repository root also runs every Python block of
README.md and docs/*.md (Sybil).

Each block runs as pasted: in a namespace of its own (nothing defined by an
earlier block), in a temporary working directory (so files it writes go
there). Blocks in other languages (shell commands) are not run. A block
that needs Graphviz is preceded by
``<!-- skip: next if(dot_missing, reason="needs Graphviz's dot") -->``.
"""

import os
import shutil
import tempfile

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
