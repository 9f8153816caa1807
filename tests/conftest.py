import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy_vspace as nv  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_recorders():
    """No tape or accumulator leaks from one test into the next."""
    nv.reset()
    yield
    nv.reset()


@pytest.fixture
def vs():
    return nv.NumpyVSpace()


@pytest.fixture
def rng():
    return __import__("numpy").random.default_rng(1234)
