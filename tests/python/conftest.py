"""Shared fixtures for the Python module's tests (run by ctest `python`, which puts the built
module on PYTHONPATH; by hand: PYTHONPATH=build/dev/python /usr/bin/python3 -m pytest tests/python)."""
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def kv(rng, tokens, heads=2, depth=4, dtype=np.float32):
    """Keys or values [1, heads, tokens, depth]."""
    return rng.standard_normal((1, heads, tokens, depth)).astype(dtype)
