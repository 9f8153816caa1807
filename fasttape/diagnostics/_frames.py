"""The one finder of the user's line: whose code a frame runs (the user's,
fasttape's, or a library's: TensorFlow, Keras, the standard library), and
the user's frames on the stack. Anomaly mode names the line an op ran at with
it; explain_none the lines of tape pushes, watches and ops.

Each file name is sorted once and remembered until fasttape.clear_caches().
"""
import os
import sys
import sysconfig

from fasttape.recording import _budget
from fasttape.recording import _recording

USER, FASTTAPE, LIBRARY = 0, 1, 2

# Frames kept per op by user_stack (innermost first).
MAX_FRAMES = 8

# Packages whose frames are not the user's code (besides the standard library).
_LIBRARIES = ("tensorflow", "keras", "tf_keras", "tensorflow_probability")
_FASTTAPE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The bench's workloads stand for a user's program: their frames are the
# user's (a tape entered there is found one frame up, as in a user's loop).
_BENCH = _FASTTAPE + "bench" + os.sep
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep
                 for k in ("stdlib", "platstdlib")})

_kinds = {}   # file name -> USER / FASTTAPE / LIBRARY (a str's hash is cached)


def _library_prefixes():
    prefixes = list(_STDLIB)
    for name in _LIBRARIES:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            prefixes.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(prefixes)


def kind(filename):
    """USER, FASTTAPE or LIBRARY for a code object's file name."""
    k = _kinds.get(filename)
    if k is None:
        path = os.path.abspath(filename)
        if path.startswith(_FASTTAPE) and not path.startswith(_BENCH):
            k = FASTTAPE
        elif filename.startswith("<frozen") or path.startswith(_library_prefixes()):
            k = LIBRARY
        else:
            k = USER
        _kinds[filename] = k
    return k


def user_stack(frame, limit=MAX_FRAMES):
    """The innermost ``limit`` user frames from ``frame`` outward, innermost
    first, as ``(filename, lineno, function)``."""
    f, out = frame, []
    while f is not None and len(out) < limit:
        code = f.f_code
        k = _kinds.get(code.co_filename)
        if k is None:
            k = kind(code.co_filename)
        if k == USER:
            out.append((code.co_filename, f.f_lineno, code.co_name))
        f = f.f_back
    return tuple(out)


def caller(frame):
    """(the innermost user frame from ``frame`` outward as a Where, or None;
    the name of the outermost fasttape function inside it)."""
    f, what = frame, None
    while f is not None:
        code = f.f_code
        k = _kinds.get(code.co_filename)
        if k is None:
            k = kind(code.co_filename)
        if k == USER:
            return Where((code.co_filename, f.f_lineno)), what
        if k == FASTTAPE:
            what = code.co_name
        f = f.f_back
    return None, what


class Where(tuple):
    """(filename, line number), formatted only when shown."""
    __slots__ = ()

    def __str__(self):
        filename, lineno = self
        try:
            rel = os.path.relpath(filename)
            if not rel.startswith(".."):
                filename = rel
        except ValueError:
            pass
        return f"{filename}:{lineno}"


def clear_caches():
    """fasttape.clear_caches(): forget the file names sorted so far."""
    _kinds.clear()


_recording.observe_from_above(clear_caches=clear_caches)


def _innermost_user_line():
    stack = user_stack(sys._getframe(1), 1)  # pylint: disable=protected-access
    return stack[0] if stack else None


# The budget's warning names the user's line with this finder.
_budget.user_line = _innermost_user_line
