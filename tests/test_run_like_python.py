"""`python -m fasttape run` behaves like `python`.

Each test runs the same script under `python` and under `python -m fasttape
run` in subprocesses and compares what the script sees (sys.path[0],
sys.argv) and what the caller sees (exit code, stdout, the traceback).
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The checkout's fasttape (the subprocesses run in a temporary directory).
# PYTHONPATH is after sys.path[0], so it does not change what python puts
# there.
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
           PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))

SHOW = """
import sys
print("path0", sys.path[0])
print("argv", sys.argv)
print("name", __name__)
"""


def _python(args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)


def _both(args, cwd):
    """(python's result, fasttape run's result) for the same arguments."""
    return _python(args, cwd), _python(["-m", "fasttape", "run", *args], cwd)


def _traceback(stderr):
    """From the last 'Traceback' line to the end (TF may log before it)."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    return lines[starts[-1]:] if starts else []


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_script_beside_a_helper_module_it_imports(tmp_path):
    _write(tmp_path / "proj" / "helper.py", "VALUE = 'helper here'\n")
    _write(tmp_path / "proj" / "train.py", SHOW + "import helper\nprint(helper.VALUE)\n")
    py, ft = _both(["proj/train.py", "--lr", "0.1", "--help"], tmp_path)
    assert py.returncode == 0, py.stderr
    assert ft.returncode == 0, ft.stderr
    assert ft.stdout == py.stdout
    assert f"path0 {tmp_path / 'proj'}" in ft.stdout
    assert "argv ['proj/train.py', '--lr', '0.1', '--help']" in ft.stdout


def test_dash_m_runs_a_module_as_python_does(tmp_path):
    _write(tmp_path / "pkg" / "__init__.py", "")
    _write(tmp_path / "pkg" / "helper.py", "VALUE = 'helper here'\n")
    _write(tmp_path / "pkg" / "mod.py",
           SHOW + "from pkg import helper\nprint(helper.VALUE, __package__)\n")
    py, ft = _both(["-m", "pkg.mod", "a", "-b"], tmp_path)
    assert py.returncode == 0, py.stderr
    assert ft.returncode == 0, ft.stderr
    assert ft.stdout == py.stdout
    assert f"argv ['{tmp_path / 'pkg' / 'mod.py'}', 'a', '-b']" in ft.stdout
    assert f"path0 {tmp_path}" in ft.stdout


def test_dash_m_of_a_missing_module_is_pythons_one_line(tmp_path):
    py, ft = _both(["-m", "no_such_module_here"], tmp_path)
    assert ft.returncode == py.returncode == 1
    assert ft.stderr.strip().splitlines()[-1] == \
        "python -m fasttape run: No module named no_such_module_here"
    assert py.stderr.split(": ", 1)[1] == ft.stderr.splitlines()[-1].split(": ", 1)[1] + "\n"


def test_missing_file_is_pythons_one_line_and_exit_code_2(tmp_path):
    py, ft = _both(["missing.py", "x"], tmp_path)
    assert ft.returncode == py.returncode == 2
    assert ft.stdout == py.stdout == ""
    # python names itself ("/usr/bin/python: can't open file ..."), run names
    # the command; the rest is the same line.
    assert ft.stderr == "python -m fasttape run: " + py.stderr.split(": ", 1)[1]
    assert "can't open file" in ft.stderr and "[Errno 2]" in ft.stderr


def test_uncaught_exception_shows_the_scripts_frames_only(tmp_path):
    _write(tmp_path / "proj" / "fails.py", """
        import sys
        print("before")
        def inner(x):
            return {}[x]
        def outer():
            try:
                inner("key")
            except KeyError as e:
                raise ValueError("boom") from e
        outer()
    """)
    py, ft = _both(["proj/fails.py"], tmp_path)
    assert ft.returncode == py.returncode == 1
    assert ft.stdout == py.stdout == "before\n"
    py_tb, ft_tb = _traceback(py.stderr), _traceback(ft.stderr)
    assert py_tb[-1] == "ValueError: boom"
    # Frames, chained cause and carets: the same lines as python's.
    assert ft_tb == py_tb
    assert "fasttape" not in ft.stderr.split("Traceback", 1)[1]
    assert "runpy" not in ft.stderr


def test_dash_m_exception_shows_the_modules_frames_only(tmp_path):
    _write(tmp_path / "pkg" / "__init__.py", "")
    _write(tmp_path / "pkg" / "bad.py", "def f():\n    1 / 0\nf()\n")
    py, ft = _both(["-m", "pkg.bad"], tmp_path)
    assert ft.returncode == py.returncode == 1
    py_tb, ft_tb = _traceback(py.stderr), _traceback(ft.stderr)
    assert ft_tb[-1] == py_tb[-1] == "ZeroDivisionError: division by zero"
    # python -m shows its own runpy frames first; run shows none of them.
    user = [line for line in py_tb if "runpy" not in line]
    assert ft_tb == user
    assert "fasttape" not in ft.stderr.split("Traceback", 1)[1]


@pytest.mark.parametrize("exit_call, code, stderr", [
    ("sys.exit(3)", 3, ""), ("sys.exit(0)", 0, ""), ("sys.exit('bad input')", 1, "bad input\n")])
def test_the_scripts_exit_code(tmp_path, exit_call, code, stderr):
    _write(tmp_path / "quit.py", f"import sys\nprint('out')\n{exit_call}\nprint('not here')\n")
    py, ft = _both(["quit.py"], tmp_path)
    assert py.returncode == ft.returncode == code
    assert ft.stdout == py.stdout == "out\n"
    assert py.stderr == stderr
    assert ft.stderr.endswith(stderr)


def test_the_script_runs_with_fasttape_patched_in(tmp_path):
    _write(tmp_path / "train.py", """
        import tensorflow as tf
        import fasttape
        x = tf.constant(3.0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x * x
        print(tf.GradientTape is fasttape.GradientTape, type(tape).__module__,
              tf.autodiff.ForwardAccumulator is fasttape.ForwardAccumulator,
              float(tape.gradient(y, x)))
    """)
    ft = _python(["-m", "fasttape", "run", "train.py"], tmp_path)
    assert ft.returncode == 0, ft.stderr
    assert ft.stdout.split() == ["True", "fasttape.tape", "True", "6.0"]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_run_help_does_not_import_tensorflow(tmp_path, flag):
    code = ("import sys; from fasttape.__main__ import main; "
            f"rc = main(['run', '{flag}']); print('tf imported', 'tensorflow' in sys.modules, rc)")
    out = _python(["-c", code], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m fasttape run SCRIPT" in out.stdout
    assert out.stdout.splitlines()[-1] == "tf imported False 0"
