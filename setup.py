"""Builds fasttape._core (C++ mode).

FASTTAPE_BUILD=debug    bounds/wraparound checks on, no optimisation flags
FASTTAPE_BUILD=profile  Cython's profile directive on (cProfile sees core calls)
(default)               release: checks off
"""
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

mode = os.environ.get("FASTTAPE_BUILD", "release").lower()
if mode not in ("release", "debug", "profile"):
    raise SystemExit(f"FASTTAPE_BUILD must be release, debug or profile, not {mode!r}")

directives = {
    "language_level": 3,
    "binding": True,
    "boundscheck": mode == "debug",
    "wraparound": mode == "debug",
    "initializedcheck": mode == "debug",
    "cdivision": True,
    "profile": mode == "profile",
}
compile_args = ["-std=c++17"] + (["-O0", "-g"] if mode == "debug" else ["-O2"])
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if mode == "profile":
    macros.append(("CYTHON_TRACE", "1"))

extensions = [
    Extension(
        f"fasttape.{name}",
        [f"fasttape/{name.replace('.', '/')}.pyx"],
        language="c++",
        include_dirs=[numpy.get_include()],
        extra_compile_args=compile_args,
        define_macros=macros,
    )
    for name in ("_core", "gradients._payloads", "recording._callback",
                 "recording._budget_core")
]

setup(
    ext_modules=cythonize(extensions, compiler_directives=directives,
                          build_dir="build/cython"),
)
