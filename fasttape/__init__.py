"""fasttape: a gradient tape for TensorFlow with a Cython core.

``fasttape.GradientTape`` is a drop-in for ``tf.GradientTape``;
``fasttape.patch()`` swaps it into unmodified TF/Keras code.

TensorFlow is imported on first use of a TF-facing name, so that
``fasttape._core`` stays importable (and testable) without it.
"""

__version__ = "0.1.0"

_LAZY = {
    "GradientTape": ("fasttape.tape", "GradientTape"),
    "ForwardAccumulator": ("fasttape.forwardprop", "ForwardAccumulator"),
    "patch": ("fasttape._patch", "patch"),
    "unpatch": ("fasttape._patch", "unpatch"),
    "patched": ("fasttape._patch", "patched"),
    "is_patched": ("fasttape._patch", "is_patched"),
    "PatchSkippedWarning": ("fasttape._patch", "PatchSkippedWarning"),
    "profile": ("fasttape.profiler", "profile"),
    "hvp": ("fasttape.functional", "hvp"),
    "hessian": ("fasttape.functional", "hessian"),
    "clear_caches": ("fasttape._recording", "clear_caches"),
    "explain_none": ("fasttape.explain", "explain_none"),
    "Explanation": ("fasttape.explain", "Explanation"),
    "detect_anomaly": ("fasttape.anomaly", "detect_anomaly"),
    "is_anomaly_enabled": ("fasttape.anomaly", "is_anomaly_enabled"),
    "AnomalyError": ("fasttape.anomaly", "AnomalyError"),
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'fasttape' has no attribute {name!r}") from None
    import importlib
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
