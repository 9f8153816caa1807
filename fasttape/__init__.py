"""fasttape: a gradient tape for TensorFlow with a Cython core."""
from fasttape import _core

__version__ = "0.1.0"
