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
    "MemoryBudgetWarning": ("fasttape.recording._budget", "MemoryBudgetWarning"),
    "profile": ("fasttape.diagnostics.profiler", "profile"),
    "hvp": ("fasttape.functional", "hvp"),
    "hessian": ("fasttape.functional", "hessian"),
    "clear_caches": ("fasttape.recording._recording", "clear_caches"),
    "explain_none": ("fasttape.diagnostics.explain", "explain_none"),
    "Explanation": ("fasttape.diagnostics.explain", "Explanation"),
    "detect_anomaly": ("fasttape.diagnostics.anomaly", "detect_anomaly"),
    "is_anomaly_enabled": ("fasttape.diagnostics.anomaly", "is_anomaly_enabled"),
    "AnomalyError": ("fasttape.diagnostics.anomaly", "AnomalyError"),
}

__all__ = sorted(_LAZY)


# Public submodules, imported on first use as attributes (``fasttape.privacy``
# after ``import fasttape``); not in __all__: they are modules, not names.
_SUBMODULES = ("privacy",)


def __getattr__(name):
    import importlib
    if name in _SUBMODULES:
        return importlib.import_module(f"fasttape.{name}")
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'fasttape' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


# Public modules that moved into a layer subpackage: the old import path gives
# the same module object (so setting a module flag still works) and a
# DeprecationWarning. No file stays at the old path.
_MOVED = {
    "fasttape.explain": "fasttape.diagnostics.explain",
    "fasttape.anomaly": "fasttape.diagnostics.anomaly",
    "fasttape.profiler": "fasttape.diagnostics.profiler",
}


class _MovedModules:
    """A sys.meta_path finder and loader for the names in _MOVED."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        del path, target
        if fullname not in _MOVED:
            return None
        import importlib.util
        return importlib.util.spec_from_loader(fullname, _MovedModules)

    @staticmethod
    def create_module(spec):
        import importlib
        import warnings
        new = _MOVED[spec.name]
        # stacklevel 2: the import statement (warnings skips importlib's frames)
        warnings.warn(f"{spec.name} moved to {new}; import it from there "
                      "(the public names stay in fasttape itself)",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    @staticmethod
    def exec_module(module):
        del module


def _install_moved_modules():
    import sys
    if _MovedModules not in sys.meta_path:
        # first: an editable install's finder would otherwise answer the old
        # path from another checkout
        sys.meta_path.insert(0, _MovedModules)


_install_moved_modules()


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + list(_SUBMODULES))
