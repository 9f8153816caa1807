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


def _replacements():
    return {backprop.GradientTape: GradientTape,
            forwardprop.ForwardAccumulator: ForwardAccumulator}


def patch():
    """Swap fasttape's classes into every loaded module that holds TF's.

    Returns the number of module attributes swapped. Code that imported the
    class by name *after* this call gets fasttape's; an object created before
    stays TF's.
    """
    _recording.install()
    return _recording.swap_classes(_replacements())


def unpatch():
    """Restore TF's classes exactly where patch() put fasttape's."""
    _recording.restore_classes()


def is_patched():
    return bool(_recording.swapped_locations())


@contextlib.contextmanager
def patched():
    """``with fasttape.patched(): ...`` — patch() for the block only."""
    patch()
    try:
        yield
    finally:
        unpatch()
