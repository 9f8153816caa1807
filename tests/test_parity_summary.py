"""The parity suite's closing line: compat/conftest.py names the bit-exact
comparisons that fell back to tolerances (harness.TF_NONDETERMINISTIC),
with or without pytest-xdist, whose workers hand their names to the
controller. Run here on a two-test suite in a subprocess, so that the
hooks are compat's own."""
import os
import subprocess
import sys
import textwrap

import pytest

COMPAT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "compat")

CONFTEST = textwrap.dedent(f"""\
    import importlib.util
    _spec = importlib.util.spec_from_file_location(
        "compat_conftest_under_test", {os.path.join(COMPAT, "conftest.py")!r})
    _compat = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_compat)
    pytest_sessionfinish = _compat.pytest_sessionfinish
    pytest_testnodedown = _compat.pytest_testnodedown
    pytest_terminal_summary = _compat.pytest_terminal_summary
    """)

TESTS = textwrap.dedent("""\
    import harness

    def test_one():
        harness.TF_NONDETERMINISTIC.append("case_one")

    def test_two():
        harness.TF_NONDETERMINISTIC.append("case_two")

    def test_three():
        pass
    """)


@pytest.mark.parametrize("workers", [None, 2])
def test_nondeterministic_comparisons_are_named_at_the_end(tmp_path, workers):
    if workers:
        pytest.importorskip("xdist")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(TESTS)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)]
    if workers:
        args += ["-n", str(workers)]
    else:
        args += ["-p", "no:xdist"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(args, capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("TF's own results differ run to run in 2 comparisons (tolerances "
            "applied): case_one, case_two") in done.stdout, done.stdout
