"""Shared test set-up: GPU tests run only where a supported CUDA device is present."""
import pytest
import torch


def _gpu_reason():
    if not torch.cuda.is_available():
        return "no CUDA device (GPU tests run on the device machine: perf/device_run.sh)"
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"GPU capability {major}.x is not a target (sm_90a / sm_100a)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
