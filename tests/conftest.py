"""Shared test settings: GPU tests run wherever enough GPUs are visible, else skip saying why.

``@pytest.mark.gpu`` needs one GPU (world size 1 over nccl: NCCL allows one rank
per GPU, so a 1-GPU machine still runs the NCCL paths); ``@pytest.mark.gpu(2)``
needs two.
"""
import pytest


def pytest_collection_modifyitems(config, items):
    from ddplab.cluster.resources import visible_gpus

    gpus = visible_gpus()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.args[0] if marker.args else 1
        if gpus < need:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} GPU(s), one per rank; {gpus} visible (runs under make test-gpu)"))


@pytest.fixture
def gpu_world() -> int:
    """Ranks for a GPU test: one per visible GPU, at most 2."""
    from ddplab.cluster.resources import visible_gpus

    return max(1, min(2, visible_gpus()))
