"""Shared fixtures for the Python module's tests (run by ctest `python`, which puts the built
module on PYTHONPATH; by hand: PYTHONPATH=build/dev/python /usr/bin/python3 -m pytest tests/python)."""
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def kv(rng, tokens, heads=2, depth=4, dtype=np.float32):
    """Keys or values [1, heads, tokens, depth]."""
    return rng.standard_normal((1, heads, tokens, depth)).astype(dtype)


def run_script(source, timeout=60):
    """Runs `source` in a fresh interpreter; a script still running after `timeout` s fails the
    test (a deadlock) instead of hanging it."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], env=os.environ,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the script did not finish in {timeout} s (deadlock?): {expired.stdout}")
