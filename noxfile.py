"""fasttape against each supported TensorFlow release.

    pipx install nox             # nox in an environment of its own: its attrs>=24.1
                                 # and dp-accounting's attrs<24 (the test extra)
                                 # do not fit in one
    nox -l                       # the sessions
    nox -s tf-2.18               # one release: its tensorflow-cpu + tf_keras,
                                 # fasttape built from source, the parity subset
    nox -s tf-2.18 -- compat/test_forwardprop.py -x   # other pytest files
    nox -s tf-2.18 -- -n 1 -x    # options alone: the subset with them
    nox -s full                  # the README's install and the whole suite (newest TF)

Each session is a fresh virtualenv (reused with ``nox -r``) and downloads its
TensorFlow (about 250 MB). The releases are read from fasttape/gradients/_tf_compat.py
(OLDEST..NEWEST, what fasttape accepts at import); tests/test_tf_compat.py
checks that pyproject.toml's extras say the same.
"""

import ast
import os
import re
import tomllib

import nox

PYTHON = "3.11"
HERE = os.path.dirname(os.path.abspath(__file__))


def _supported_releases():
    """["2.16", ..., "2.21"] from _tf_compat's OLDEST and NEWEST, read without
    importing it (it imports TensorFlow)."""
    with open(os.path.join(HERE, "fasttape", "gradients", "_tf_compat.py")) as f:
        tree = ast.parse(f.read())
    bounds = {target.id: ast.literal_eval(node.value)
              for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets
              if isinstance(target, ast.Name) and target.id in ("OLDEST", "NEWEST")}
    (major, oldest), (major_newest, newest) = bounds["OLDEST"], bounds["NEWEST"]
    assert major == major_newest, bounds
    return [f"{major}.{minor}" for minor in range(oldest, newest + 1)]


def _test_tools():
    """The test extra of pyproject.toml without TensorFlow and tf_keras
    (each session pins its release): pytest, hypothesis for the fuzzer..."""
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    return [r for r in extra
            if re.split(r"[<>=!~ \[]", r, maxsplit=1)[0].lower().replace("_", "-")
            not in ("tensorflow", "tf-keras")]


TF_RELEASES = _supported_releases()
NEWEST = TF_RELEASES[-1]

# The parity suite's representative part: the public API against TF's, the
# op corpus (every op's gradient), forward mode, training loops, the
# memory budget (its compiled passes build graph ops by hand), the
# version gate itself, and the shipped table of which tensors each of the
# release's gradients reads; compat/test_fuzz.py where the checkout has it.
SUBSET = [
    "compat/test_api_parity.py",
    "compat/test_op_corpus.py",
    "compat/test_forwardprop.py",
    "compat/test_models_loops.py",
    "compat/test_memory_budget.py",
    "compat/test_fuzz.py",
    "tests/test_tf_compat.py",
    "tests/test_saved_table.py",
]

nox.options.sessions = [f"tf-{v}" for v in TF_RELEASES] + ["full"]


def _pytest_args(posargs):
    """The session's pytest arguments: SUBSET's files unless the arguments
    name files of their own, so that options alone (``-- -n 1 -x``) still
    run the subset."""
    names_paths = any(os.path.exists(arg.split("::")[0]) for arg in posargs
                      if not arg.startswith("-"))
    if names_paths:
        return list(posargs)
    return [*posargs, *(p for p in SUBSET if os.path.exists(p))]


def _release_session(release):
    @nox.session(name=f"tf-{release}", python=PYTHON)
    def session(s):
        s.install(f"tensorflow-cpu=={release}.*", f"tf-keras=={release}.*", *_test_tools())
        s.install("-e", ".")
        s.run("python", "-c", "import tensorflow as tf, tf_keras; "
              "print('tensorflow', tf.__version__, 'tf_keras', tf_keras.__version__)",
              env={"TF_CPP_MIN_LOG_LEVEL": "3"})
        s.run("python", "-m", "pytest", "-q", *_pytest_args(s.posargs))

    return session


for _release in TF_RELEASES:
    _release_session(_release)


@nox.session(name="full", python=PYTHON)
def full(s):
    """The README's CI: pip install -e ".[test]" (newest TF) and every test."""
    s.install("-e", ".[test]")
    s.run("python", "-c", f"import tensorflow as tf; "
          f"assert tf.__version__.startswith('{NEWEST}.'), tf.__version__",
          env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    s.run("python", "-m", "pytest", *s.posargs)
