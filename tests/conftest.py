"""Shared pytest setup: tests marked ``gpu`` skip cleanly when no CUDA device is visible."""

from __future__ import annotations

import functools
import os
import sys

import pytest

# The helper modules (cases, oracle) import by name whatever pytest's import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def gpu_available() -> bool:
    """True when JAX sees at least one GPU (False on CPU-only jaxlib, where 'gpu' is unknown)."""
    import jax
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


# A GPU test at these models' full expert weights holds 15-30 GB: beside other test processes on one card it
# runs out of memory, so it is marked ``whole_gpu`` and tests/gpu_session.sh runs those in one process (a
# test of other models that needs as much carries the mark itself).
WHOLE_GPU_MODELS = ("deepseek_v3", "qwen35_397b")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    for item in gpu_items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if params and any(isinstance(v, str) and v in WHOLE_GPU_MODELS for v in params.values()):
            item.add_marker(pytest.mark.whole_gpu)
    if not gpu_items or gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: jax.devices('gpu') is unavailable")
    for item in gpu_items:
        item.add_marker(skip)
