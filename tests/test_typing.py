"""A user's typed code sees fasttape's public API (fasttape/__init__.pyi):
mypy finds every name of fasttape.__all__, none of them Any."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

import fasttape

pytest.importorskip("mypy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_CODE = """
import fasttape

def train_step(tape: fasttape.GradientTape, x: object) -> None:
    tape.watch(x)

with fasttape.GradientTape(persistent=True) as tape:
    pass
with fasttape.detect_anomaly():
    pass
with fasttape.profile() as prof:
    pass
seconds: float = prof.total_seconds
swapped: int = fasttape.patch()
was_on: bool = fasttape.explain_none(False)
dot: str = tape.to_dot()
held: int = tape.summary().held_bytes
epsilon: float = fasttape.privacy.compute_epsilon(
    noise_multiplier=1.1, batch_size=256, num_examples=60000, epochs=1, delta=1e-5)
"""


def _mypy(tmp_path, code):
    (tmp_path / "user.py").write_text(textwrap.dedent(code))
    env = dict(os.environ, MYPYPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
         "--cache-dir", os.devnull, "user.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_every_public_name_is_typed_and_none_is_any(tmp_path):
    names = fasttape.__all__
    code = USER_CODE + "".join(f"reveal_type(fasttape.{n})\n" for n in names)
    out = _mypy(tmp_path, code)
    revealed = re.findall(r'Revealed type is "(.*)"', out.stdout)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert not errors, out.stdout
    assert len(revealed) == len(names), out.stdout
    for name, shown in zip(names, revealed):
        assert shown != "Any" and not shown.startswith("Any"), (name, shown)
        # A class shows its constructor, a function its signature.
        assert shown.startswith("def ") or shown.startswith("Overload("), (name, shown)


def test_a_wrong_argument_is_caught(tmp_path):
    out = _mypy(tmp_path, """
        import fasttape
        fasttape.GradientTape(persistent="yes")
        fasttape.explain_none(flag=1.5)
    """)
    assert out.stdout.count(": error:") == 2, out.stdout
    assert 'incompatible type "str"' in out.stdout


def _stub():
    import ast
    with open(os.path.join(ROOT, "fasttape", "__init__.pyi"), encoding="utf-8") as f:
        return ast.parse(f.read())


def _stub_params(fn):
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    return [n for n in names if n != "self"]


def _runtime_params(fn):
    import inspect
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        out.append(f"*{p.name}" if p.kind is p.VAR_POSITIONAL else p.name)
    return out


def test_the_stub_says_what_the_code_does():
    """Each public function and method of the stub has the runtime's
    parameters, and every public method of the classes is in the stub."""
    import ast
    stub = {n.name: n for n in _stub().body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name in fasttape.__all__:
        node, value = stub[name], getattr(fasttape, name)
        if isinstance(node, ast.FunctionDef):
            assert _stub_params(node) == _runtime_params(value), name
            continue
        methods = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
        public = {m for m in vars(value) if not m.startswith("_") and callable(vars(value)[m])}
        assert public <= set(methods), (name, public - set(methods))
        for m, fn in methods.items():
            if (m in public or m == "__init__") and \
                    not any(isinstance(d, ast.Name) and d.id == "property"
                            for d in fn.decorator_list):
                assert _stub_params(fn) == _runtime_params(getattr(value, m)), (name, m)


def test_the_privacy_stub_says_what_the_code_does():
    """fasttape/privacy.pyi (a stub, so that mypy reads no further into
    fasttape's untyped modules) has the module's public functions, each
    with the runtime's parameters."""
    import ast
    from fasttape import privacy
    with open(os.path.join(ROOT, "fasttape", "privacy.pyi"), encoding="utf-8") as f:
        stub = {n.name: n for n in ast.parse(f.read()).body
                if isinstance(n, ast.FunctionDef)}
    public = {n for n, v in vars(privacy).items()
              if callable(v) and not n.startswith("_")
              and getattr(v, "__module__", None) == privacy.__name__}
    assert public == set(stub)
    for name in public:
        assert _stub_params(stub[name]) == _runtime_params(getattr(privacy, name)), name
