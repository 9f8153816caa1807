"""The package's layers, read from its own imports.

Imports run one way, down this list (a layer may import its own layer and
the ones below it, never one above), and no two modules import each other,
directly or around a loop:

    public face   fasttape/__init__, __main__, tape, forwardprop, functional,
                  _patch, privacy, bench/
    backward      fasttape/backward/
    diagnostics   fasttape/diagnostics/
    recording     fasttape/recording/
    gradients     fasttape/gradients/
    core          fasttape/_core (.pyx/.pxd): imports no TensorFlow

Every import counts, also one inside a function (a lazy import is still a
dependency). Python files are read with ``ast``; Cython files (.pyx/.pxd)
line by line for their ``import``/``cimport`` statements. No TensorFlow here.
"""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "fasttape")

LAYERS = ("core", "gradients", "recording", "diagnostics", "backward", "public")
_RANK = {name: rank for rank, name in enumerate(LAYERS)}
# Names that `from fasttape import NAME` may take from any layer: plain
# globals of fasttape/__init__.py (it runs before any submodule anyway).
_ROOT_CONSTANTS = {"__version__"}


def layer_of(module):
    """The layer of a module name inside fasttape."""
    parts = module.split(".")
    assert parts[0] == "fasttape", module
    if len(parts) == 1:
        return "public"
    if parts[1] == "_core":
        return "core"
    if parts[1] in ("gradients", "recording", "diagnostics", "backward"):
        return parts[1]
    return "public"   # tape, forwardprop, functional, _patch, privacy, __main__, bench


def _module_name(path):
    rel = os.path.relpath(path, ROOT)
    stem = os.path.splitext(rel)[0].split(os.sep)
    if stem[-1] == "__init__":
        stem = stem[:-1]
    return ".".join(stem)


def library_files(package=PACKAGE):
    """{module name: [files]} for every .py/.pyx/.pxd under ``package``."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(package):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
        for fn in sorted(filenames):
            if fn.endswith((".py", ".pyx", ".pxd")):
                path = os.path.join(dirpath, fn)
                found.setdefault(_module_name(path), []).append(path)
    return found


_CY_FROM = re.compile(r"^\s*from\s+([\w.]+)\s+c?import\s+\(?\s*([\w\s,]*)", re.M)
_CY_IMPORT = re.compile(r"^\s*c?import\s+([\w.]+(?:\s*,\s*[\w.]+)*)", re.M)


def _raw_imports(path):
    """[(module, [names])] imported by one file (names: those of `from M
    import a, b`, else [])."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    if path.endswith(".py"):
        package = _module_name(path)
        if not path.endswith("__init__.py"):
            package = package.rpartition(".")[0]
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.Import):
                out.extend((a.name, []) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    module = ".".join(base + ([module] if module else []))
                out.append((module, [a.name for a in node.names]))
        return out
    text = re.sub(r"#.*", "", text)
    text = re.sub(r'"""[\s\S]*?"""', "", text)
    for m in _CY_FROM.finditer(text):
        names = [n.strip() for n in m.group(2).split(",") if n.strip()]
        out.append((m.group(1), [n.split()[0] for n in names]))
    for m in _CY_IMPORT.finditer(text):
        out.extend((name.strip(), []) for name in m.group(1).split(","))
    return out


def import_graph(files=None):
    """{module: {imported fasttape module: [files where]}}, and
    {module: set of top-level non-fasttape packages it imports}."""
    files = library_files() if files is None else files
    modules = set(files)
    graph, external = {}, {}
    for module, paths in files.items():
        edges = graph.setdefault(module, {})
        ext = external.setdefault(module, set())
        for path in paths:
            for target, names in _raw_imports(path):
                top = target.split(".")[0]
                if top != "fasttape":
                    ext.add(top)
                    continue
                hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
                rest = [n for n in names if f"{target}.{n}" not in modules]
                if target == "fasttape" and rest and set(rest) <= _ROOT_CONSTANTS:
                    rest = []
                if rest or not names:
                    hits.append(target)
                for hit in hits:
                    if hit != module:
                        edges.setdefault(hit, []).append(os.path.relpath(path, ROOT))
    return graph, external


def upward_imports(graph):
    return sorted(
        f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)}) "
        f"in {', '.join(sorted(set(where)))}"
        for module, edges in graph.items() for target, where in edges.items()
        if _RANK[layer_of(target)] > _RANK[layer_of(module)])


def cycles(graph):
    """Each strongly connected set of two or more modules (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


@pytest.fixture(scope="module")
def graph_and_external():
    return import_graph()


def test_every_module_is_read(graph_and_external):
    graph, _ = graph_and_external
    for expected in ("fasttape._core", "fasttape.recording._callback",
                     "fasttape.recording._recording", "fasttape.gradients._tf_vspace",
                     "fasttape.diagnostics.explain", "fasttape.tape", "fasttape.bench"):
        assert expected in graph
    # the readers see both kinds of file: a cimport in .pyx, a lazy import in .py
    assert "fasttape._core" in graph["fasttape.recording._callback"]
    assert "fasttape.recording._recording" in graph["fasttape.diagnostics.profiler"]


def test_no_upward_import(graph_and_external):
    graph, _ = graph_and_external
    upward = upward_imports(graph)
    assert not upward, ("imports that run up the layers (public face > backward > "
                        "diagnostics > recording > gradients > core):\n  " + "\n  ".join(upward))


def test_no_import_cycle(graph_and_external):
    graph, _ = graph_and_external
    found = cycles(graph)
    assert not found, "modules that import each other: " + "; ".join(
        " <-> ".join(c) for c in found)


def test_core_imports_no_tensorflow(graph_and_external):
    graph, external = graph_and_external
    assert "tensorflow" not in external["fasttape._core"]
    assert not graph["fasttape._core"], graph["fasttape._core"]


def test_the_checks_can_fail(tmp_path):
    """The reader and both checks on a made-up package: an upward import, a
    cycle, a cimport in a .pyx."""
    pkg = tmp_path / "fasttape"
    (pkg / "gradients").mkdir(parents=True)
    (pkg / "diagnostics").mkdir()
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "_core.pyx").write_text("from libc.stdint cimport int64_t\n")
    (pkg / "gradients" / "__init__.py").write_text("")
    (pkg / "gradients" / "a.py").write_text(
        "from fasttape import __version__\n"
        "def f():\n    from fasttape.diagnostics import b\n")
    (pkg / "gradients" / "c.pyx").write_text(
        "from fasttape._core cimport X\ncimport fasttape.gradients.a\n")
    (pkg / "diagnostics" / "__init__.py").write_text("")
    (pkg / "diagnostics" / "b.py").write_text("from fasttape.gradients import a\n")
    files = {}
    for dirpath, _, filenames in os.walk(pkg):
        for fn in filenames:
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, tmp_path)
            stem = os.path.splitext(rel)[0].split(os.sep)
            name = ".".join(stem[:-1] if stem[-1] == "__init__" else stem)
            files.setdefault(name, []).append(path)
    graph, _ = import_graph(files)
    assert graph["fasttape.gradients.c"].keys() == {"fasttape._core",
                                                    "fasttape.gradients.a"}
    assert "fasttape" not in graph["fasttape.gradients.a"]   # __version__ only
    assert [u.split(" in ")[0] for u in upward_imports(graph)] == [
        "fasttape.gradients.a (gradients) imports fasttape.diagnostics.b (diagnostics)"]
    assert cycles(graph) == [["fasttape.diagnostics.b", "fasttape.gradients.a"]]


def test_the_top_level_holds_only_the_public_face_and_the_core():
    """Machinery lives in a layer's subpackage; the package's top level is
    the public API, the CLI and the core (whose path the design names)."""
    top = {os.path.splitext(fn)[0] for fn in os.listdir(PACKAGE)
           if fn.endswith((".py", ".pyx", ".pxd", ".pyi"))}
    assert top <= {"__init__", "__main__", "tape", "forwardprop", "functional",
                   "_patch", "privacy", "_core"}, sorted(top)
