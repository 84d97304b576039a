"""Shared test settings: GPU tests skip cleanly where fewer than two GPUs are visible."""
import pytest


def pytest_collection_modifyitems(config, items):
    from ddplab.cluster.resources import visible_gpus

    gpus = visible_gpus()
    skip = pytest.mark.skip(reason=f"needs 2 GPUs (one per rank), {gpus} visible; runs on GPU machines")
    for item in items:
        if "gpu" in item.keywords and gpus < 2:
            item.add_marker(skip)
