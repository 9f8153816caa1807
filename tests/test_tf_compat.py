"""The TensorFlow version gate (fasttape/gradients/_tf_compat.py)."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from fasttape.gradients import _tf_compat as compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOW = compat.ALLOW_ENV


@pytest.mark.parametrize("version,expected", [
    ("2.21.0", (2, 21)), ("2.16.0-rc1", (2, 16)), ("2.22.0-dev20260101", (2, 22)),
    ("10.3", (10, 3)), ("unknown", None), ("", None)])
def test_parse(version, expected):
    assert compat.parse(version) == expected


@pytest.mark.parametrize("version", ["2.16.0", "2.16.2", "2.18.1", "2.20.0rc0",
                                     "2.21.0"])
def test_supported_releases_pass(version):
    compat.check(version, environ={})


@pytest.mark.parametrize("version", ["2.15.1", "2.15.0.post1", "2.22.0",
                                     "2.22.0-dev20270101", "3.0.0", "1.15.5",
                                     "unknown"])
def test_unsupported_releases_are_refused_with_the_range_and_the_way_out(version):
    with pytest.raises(ImportError) as exc:
        compat.check(version, environ={})
    message = str(exc.value)
    assert f"TensorFlow {version}" in message
    assert "2.16 to 2.21" in message
    assert f"{ALLOW}=1" in message
    assert "tensorflow>=2.16,<2.22" in message


def test_the_environment_variable_lets_an_untested_release_through_with_a_warning():
    with pytest.warns(compat.UntestedTensorFlowWarning, match="2.16 to 2.21"):
        compat.check("2.22.0", environ={ALLOW: "1"})
    for value in ("0", "", "yes"):
        with pytest.raises(ImportError):
            compat.check("2.22.0", environ={ALLOW: value})


def test_the_check_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv(ALLOW, "1")
    with pytest.warns(compat.UntestedTensorFlowWarning):
        compat.check("2.15.0")
    monkeypatch.delenv(ALLOW)
    with pytest.raises(ImportError):
        compat.check("2.15.0")


def test_pyproject_declares_the_same_range():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    oldest = ".".join(map(str, compat.OLDEST))
    after = f"{compat.NEWEST[0]}.{compat.NEWEST[1] + 1}"
    specs = re.findall(r'"(tensorflow|tf-keras)([^"]*)"', text)
    assert specs, "no tensorflow requirement in pyproject.toml"
    for name, spec in specs:
        assert spec == f">={oldest},<{after}", (name, spec)


def test_importing_fasttape_under_an_unsupported_tf_fails_at_import():
    """End to end, in a fresh process: TF reports an old version; importing
    fasttape's tape refuses it; with the variable set it imports and works."""
    script = textwrap.dedent(f"""
        import os, sys, warnings
        import tensorflow as tf
        tf.__version__ = "2.15.1"
        import fasttape                      # TF-free: not checked
        try:
            import fasttape.tape
        except ImportError as e:
            print("refused:", e)
        else:
            print("imported")
        assert "fasttape.tape" not in sys.modules
        os.environ["{ALLOW}"] = "1"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from fasttape.tape import GradientTape
        print("warned:", [str(w.message)[:40] for w in caught
                          if w.category.__name__ == "UntestedTensorFlowWarning"])
        x = tf.constant(3.0)
        with GradientTape() as tape:
            tape.watch(x)
            y = x * x
        print("grad:", float(tape.gradient(y, x)))
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.pop(ALLOW, None)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused: fasttape ") and "found TensorFlow 2.15.1" in lines[0]
    assert lines[1].startswith("warned: ['fasttape ") and "tested with" in lines[1]
    assert lines[2] == "grad: 6.0"


def test_tf_version_is_the_running_release():
    import tensorflow as tf
    assert compat.TF_VERSION == compat.parse(tf.__version__)
    assert compat.OLDEST <= compat.TF_VERSION <= compat.NEWEST
