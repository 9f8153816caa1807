"""fasttape.patch(): run unmodified TF/Keras code with fasttape's classes.

The swap itself (a TF monkeypatch) lives in _recording with the others.
"""

import contextlib

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.eager import backprop
from tensorflow.python.eager import forwardprop

from fasttape.recording import _recording
from fasttape.forwardprop import ForwardAccumulator
from fasttape.tape import GradientTape

PatchSkippedWarning = _recording.PatchSkippedWarning


# TF's classes, read before any patch(): once patched, backprop.GradientTape
# is fasttape's, and a second patch() must still find TF's class elsewhere.
_REPLACEMENTS = {backprop.GradientTape: GradientTape,
                 forwardprop.ForwardAccumulator: ForwardAccumulator}


def patch():
    """Swap fasttape's classes into every loaded module that holds TF's.

    Returns the number of module attributes this call swapped. Code that
    imported the class by name *after* this call gets fasttape's; an object
    created before stays TF's.

    All or nothing, and idempotent:
      - a module that refuses the swap (a read-only module whose
        ``__setattr__`` raises, or one that ignores the write) is skipped and
        named in a ``PatchSkippedWarning``: a third-party module must not
        stop the patch, and code reaching TF's class through it keeps TF's;
      - any other failure midway (an exception, a KeyboardInterrupt) puts
        back everything this call swapped before it propagates;
      - calling it again swaps only holders of TF's class that appeared
        since (modules imported in between) and returns their number (0 if
        none); one ``unpatch()`` undoes every call.
    """
    _recording.install()
    return _recording.swap_classes(_REPLACEMENTS)


def unpatch():
    """Restore TF's classes exactly where patch() put fasttape's (and
    nowhere else: an attribute reassigned since is left as it is). A module
    that refuses to take TF's class back is named in a PatchSkippedWarning
    and stays listed (is_patched() stays True)."""
    _recording.restore_classes()


def is_patched():
    return bool(_recording.swapped_locations())


@contextlib.contextmanager
def patched():
    """``with fasttape.patched(): ...`` — patch() for the block only.

    Leaves TF as it found it, whatever happens inside: it undoes exactly the
    swaps its own patch() made (so a ``patched()`` inside a patched program
    leaves the outer patch in place), also when patch() itself fails."""
    mark = _recording.swap_mark()
    try:
        patch()
        yield
    finally:
        _recording.restore_classes(mark)
