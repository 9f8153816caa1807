"""The package as a user gets it: sdist -> wheel -> a clean venv -> import.

The sdist must hold the Cython sources and no generated C++ (it is built
with Cython and a C++ compiler alone); the wheel is built from that sdist,
not from the checkout, so a file missing from the sdist fails here. The
wheel goes into a fresh venv that has nothing installed, and fasttape is
imported from ``/`` so that the checkout cannot be what gets imported.

Builds without isolation (no network): the build requirements come from the
test extra. Skipped only where no C++ compiler is found.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cxx():
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return shutil.which(cxx.split()[0])


pytestmark = pytest.mark.skipif(_cxx() is None,
                                reason="no C++ compiler to build the extension")


def _checkout_version():
    spec = importlib.util.spec_from_file_location(
        "_fasttape_init", os.path.join(ROOT, "fasttape", "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.__version__


def _run(args, **kw):
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)
    assert out.returncode == 0, f"{args}\n{out.stdout}\n{out.stderr}"
    return out


def _clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def test_sdist_wheel_and_install_into_a_clean_venv(tmp_path):
    missing = [m for m in ("setuptools", "Cython") if importlib.util.find_spec(m) is None]
    assert not missing, (f"build requirements {missing} missing: "
                         "pip install -e '.[test]' installs them")
    import setuptools
    assert int(setuptools.__version__.split(".")[0]) >= 77, (
        f"setuptools {setuptools.__version__} cannot read pyproject.toml's SPDX "
        "license: pip install -e '.[test]' installs setuptools>=77")

    # 1. sdist, through the PEP 517 hook (what `python -m build --sdist` calls).
    sdist_dir = tmp_path / "sdist"
    sdist_dir.mkdir()
    out = _run([sys.executable, "-c",
                "import sys; from setuptools import build_meta as b; "
                "print(b.build_sdist(sys.argv[1]))", str(sdist_dir)], cwd=ROOT)
    sdist = sdist_dir / out.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    for required in ("LICENSE", "pyproject.toml", "setup.py", "MANIFEST.in",
                     "fasttape/_core.pyx", "fasttape/_core.pxd",
                     "fasttape/recording/_callback.pyx", "fasttape/recording/_budget_core.pyx",
                     "fasttape/gradients/_payloads.pyx",
                     "fasttape/gradients/_payloads.pxd", "fasttape/__init__.py"):
        assert required in names, f"{required} missing from the sdist"
    generated = [n for n in names if n.endswith((".cpp", ".c", ".so", ".o", ".pyc"))]
    assert not generated, f"build outputs in the sdist: {generated}"

    # 2. wheel, built from the sdist (pip unpacks it in a temporary directory).
    wheel_dir = tmp_path / "wheel"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(wheel_dir), str(sdist)], cwd=tmp_path)
    (wheel,) = wheel_dir.glob("fasttape-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    for ext in ("_core", "gradients/_payloads", "recording/_callback",
                "recording/_budget_core"):
        assert any(n.startswith(f"fasttape/{ext}.") and n.endswith((".so", ".pyd"))
                   for n in names), f"compiled {ext} missing from the wheel"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    for typed in ("fasttape/__init__.pyi", "fasttape/privacy.pyi", "fasttape/py.typed"):
        assert typed in names, f"{typed} missing from the wheel (type checkers need it)"
    assert not [n for n in names if n.endswith((".cpp", ".c"))]
    # every module of the checkout (a subpackage, a module that MANIFEST.in
    # or the packages list left out would only fail at a user's import)
    modules = sorted(os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
                     for d, _, files in os.walk(os.path.join(ROOT, "fasttape"))
                     for f in files if f.endswith(".py"))
    assert modules and not [m for m in modules if m not in names], (
        "modules missing from the wheel: "
        + ", ".join(m for m in modules if m not in names))

    # 3. a venv with nothing in it; the wheel installed by this interpreter's
    # pip into it (`pip --python`), before anything else is visible there.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env_dir)
    bindir = "Scripts" if os.name == "nt" else "bin"
    py = str(env_dir / bindir / ("python.exe" if os.name == "nt" else "python"))
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps",
          "--no-index", "-q", str(wheel)], cwd=tmp_path, env=_clean_env())
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
                cwd="/", env=_clean_env()).stdout.strip()
    # fasttape's dependencies (numpy, TensorFlow) from this interpreter's
    # site-packages, after the venv's own: a .pth line adds a directory to
    # sys.path but runs none of that directory's .pth files, so an editable
    # install of the checkout found there stays inert.
    deps = [p for p in sys.path
            if os.path.basename(p) in ("site-packages", "dist-packages")]
    with open(os.path.join(site, "zz_test_deps.pth"), "w") as f:
        f.write("\n".join(deps) + "\n")

    # 4. imported from /, the installed copy and its metadata.
    probe = (
        "import importlib.metadata as md, fasttape, fasttape._core\n"
        "print(fasttape.__file__)\n"
        "print(fasttape._core.__file__)\n"
        "print(fasttape.__version__)\n"
        "print(md.version('fasttape'))\n"
        "import tensorflow as tf\n"
        "x = tf.constant(3.0)\n"
        "with fasttape.GradientTape() as tape:\n"
        "    tape.watch(x)\n"
        "    y = x * x\n"
        "print(type(tape).__module__, float(tape.gradient(y, x)))\n"
    )
    out = _run([py, "-c", probe], cwd="/", env=_clean_env())
    init_file, core_file, version, dist_version, grad = out.stdout.strip().splitlines()[-5:]
    site_real = os.path.realpath(site)
    assert os.path.realpath(init_file) == os.path.join(site_real, "fasttape", "__init__.py")
    assert os.path.realpath(core_file).startswith(os.path.join(site_real, "fasttape", "_core."))
    assert version == dist_version == _checkout_version()
    assert grad == "fasttape.tape 6.0"
