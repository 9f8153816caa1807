"""The TensorFlow releases fasttape supports, checked when TF is first needed.

fasttape reaches into TF's private Python modules (``tensorflow.python.*``:
the tape, the op callbacks, the gradient registry, pfor), which change
between releases without notice, so it states a range of releases rather
than a minimum: the ones its parity suite runs against (``noxfile.py``, one
session per release). Every fasttape module that imports TensorFlow imports
this one first, so a TF outside the range fails at ``import`` with the reason
rather than later with a missing private name. ``import fasttape`` alone (and
the TF-free ``fasttape._core``) never imports TF and is not checked.

``FASTTAPE_ALLOW_UNTESTED_TF=1`` lets an untested release through with a
warning.

``TF_VERSION`` is the release in use, for the places that depend on it.
Version-dependent references to TF internals belong here (none so far: the
private names fasttape uses are the same in every release of the range; the
parity corpus knows that TF 2.16 cannot take a few second derivatives that
later releases can, ``compat/op_corpus.py``).
"""

import os
import re
import warnings

# Inclusive (major, minor) bounds; pyproject.toml's extras say the same
# (tensorflow>=2.16,<2.22) and noxfile.py runs each release between.
OLDEST = (2, 16)
NEWEST = (2, 21)
ALLOW_ENV = "FASTTAPE_ALLOW_UNTESTED_TF"


class UntestedTensorFlowWarning(UserWarning):
    """TensorFlow outside the supported range, let through by
    FASTTAPE_ALLOW_UNTESTED_TF=1."""


def parse(version):
    """(major, minor) of a TF version string ("2.21.0", "2.16.0-rc1",
    "2.22.0-dev20260101"); None when it does not start with two numbers."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def supported(version):
    mm = parse(version)
    return mm is not None and OLDEST <= mm <= NEWEST


def _range():
    return f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def check(version, where="", environ=None):
    """Raise ImportError for a TF ``version`` outside the supported range,
    unless ``FASTTAPE_ALLOW_UNTESTED_TF=1`` (then warn)."""
    if supported(version):
        return
    environ = os.environ if environ is None else environ
    from fasttape import __version__
    found = f"TensorFlow {version}" + (f" ({where})" if where else "")
    if environ.get(ALLOW_ENV, "") == "1":
        warnings.warn(
            f"fasttape {__version__} is tested with TensorFlow {_range()}, "
            f"not {found}; running anyway ({ALLOW_ENV}=1). It relies on TF "
            "internals: check results against tf.GradientTape "
            "(the compat/ suite).", UntestedTensorFlowWarning, stacklevel=3)
        return
    raise ImportError(
        f"fasttape {__version__} supports TensorFlow {_range()}; found "
        f"{found}. fasttape uses TensorFlow internals that change between "
        f"releases, so other releases are refused: install a supported one "
        f"(pip install 'tensorflow>=2.16,<2.22'), or set {ALLOW_ENV}=1 to "
        "try this one anyway.")


def _check_installed():
    import tensorflow as tf
    version = getattr(tf, "__version__", "unknown")
    check(version, where=os.path.dirname(getattr(tf, "__file__", None) or "") or "")
    return parse(version) or (0, 0)


# (major, minor) of the TensorFlow in use: compare with tuples, e.g.
# ``TF_VERSION < (2, 17)``.
TF_VERSION = _check_installed()
