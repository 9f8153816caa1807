"""python -m fasttape {bench,run} ...

``run`` behaves like ``python`` (coverage.py's ``coverage run`` is the
model): the script runs as ``__main__`` with its folder at ``sys.path[0]``
and ``sys.argv`` as python sets it, ``-m`` runs a module, and the script's
exit code and uncaught exceptions come out as python gives them, the
traceback showing the script's frames only. TensorFlow is imported only
once there is a script to run.
"""

import os
import sys

USAGE = """usage: python -m fasttape COMMAND [ARGS]

commands:
  bench [options]          fasttape against tf.GradientTape, side by side
  run SCRIPT [ARGS...]     run SCRIPT with fasttape patched in for TF's classes
  run -m MODULE [ARGS...]  the same for a module, as python -m MODULE
"""

RUN_USAGE = """usage: python -m fasttape run SCRIPT [ARGS...]
       python -m fasttape run -m MODULE [ARGS...]

Run SCRIPT (or MODULE) as python would, with fasttape.patch() applied first:
tf.GradientTape and tf.autodiff.ForwardAccumulator are fasttape's in the
script and in everything it imports. ARGS go to the script's sys.argv.
"""

PROG = "python -m fasttape run"


def _user_traceback(tb):
    """``tb`` without its leading frames of this file and of runpy."""
    import runpy
    ours = {os.path.normcase(__file__), runpy.run_path.__code__.co_filename}
    while tb is not None and os.path.normcase(tb.tb_frame.f_code.co_filename) in ours:
        tb = tb.tb_next
    return tb


def _set_path0(path):
    # `python -m fasttape` put the working directory at sys.path[0], where
    # python puts the script's folder; under -P (safe_path) python puts none.
    if getattr(sys.flags, "safe_path", False):
        return
    if path is None:
        del sys.path[0]
    else:
        sys.path[0] = path


def _exec_file(path):
    """Run a source or .pyc file as ``__main__``, as python does."""
    import importlib.machinery
    import pkgutil
    import types

    full = os.path.abspath(path)
    with open(full, "rb") as f:
        code = pkgutil.read_code(f)       # None unless it is a .pyc
    if code is None:
        with open(full, "rb") as f:
            source = f.read()
        code = compile(source, full, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__file__ = full
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", full)
    main.__builtins__ = sys.modules["builtins"]
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _run(argv):
    """Run what argv names; exceptions propagate (see run_script)."""
    import runpy
    if argv[0] == "-m":
        _set_path0(os.getcwd())
        sys.argv = ["-m", *argv[2:]]     # run_module sets argv[0] to the file
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    path = argv[0]
    sys.argv = list(argv)
    if os.path.isdir(path) or not os.path.isfile(path) and os.path.exists(path):
        _set_path0(None)                 # run_path puts the folder/zip there
        runpy.run_path(path, run_name="__main__")
    else:
        _set_path0(os.path.dirname(os.path.realpath(path)))
        _exec_file(path)


def run_script(argv):
    if not argv or argv[0] == "-m" and len(argv) < 2:
        print(RUN_USAGE, file=sys.stderr, end="")
        return 2
    if argv[0] in ("-h", "--help"):
        print(RUN_USAGE, end="")
        return 0
    if argv[0] != "-m" and not os.path.exists(argv[0]):
        print(f"{PROG}: can't open file {os.path.abspath(argv[0])!r}: "
              f"[Errno 2] No such file or directory", file=sys.stderr)
        return 2

    import fasttape
    fasttape.patch()
    try:
        _run(argv)
    except SystemExit:
        raise                            # the script's exit code, as python
    except BaseException as exc:
        tb = _user_traceback(exc.__traceback__)
        if tb is None and isinstance(exc, ImportError):
            # runpy could not find the module: python's one line, exit 1.
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 1
        # The default hook prints exc.__traceback__, not its tb argument.
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        # python exits by SIGINT after an uncaught KeyboardInterrupt: a
        # shell sees 130.
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        fasttape.unpatch()
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from fasttape import bench
        return bench.main(rest)
    if command == "run":
        return run_script(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
