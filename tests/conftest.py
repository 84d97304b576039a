"""What every test file shares: the ranks, how test code travels to them, and the GPU rule.

Shared ranks. Starting a Cluster spawns its ranks and each one imports torch
(1-2 s for two ranks on an idle 2-core machine, far more under load), so the
suite starts one Cluster per size for the whole session and hands it to every
test that asks for ``cluster1``, ``cluster2`` or ``cluster3``. Before each such
test the fixture calls ``Cluster.ensure_ready()``: ranks that a previous test
killed, interrupted or left out of step are replaced there, so no test inherits
another's broken ranks. ``cluster2_short`` has a 3 s collective timeout, for the
graders' planted hangs (they wait the timeout out). A test that must own its
ranks (it counts processes, interrupts the start, or shuts the cluster down)
still makes its own ``ddplab.Cluster``.

What the ranks keep between tests is what any notebook's ranks keep between
cells: module globals and imported modules. Tests seed their own generators
and build their own models, so none depends on what ran before it.

Test code on the ranks. A function defined in a test module is sent to the
ranks by value (cloudpickle), like a function defined in a notebook cell: the
ranks never import test modules (which would import pytest and run their
module-level code on every rank). Helper modules (``tests/_*.py``) are
imported on the ranks by name, since ``tests/`` is on the ranks' ``sys.path``.

GPU tests. ``@pytest.mark.gpu`` needs one GPU (world size 1 over nccl: NCCL
allows one rank per GPU, so a 1-GPU machine still runs the NCCL paths);
``@pytest.mark.gpu(2)`` needs two. Without them the test skips saying why.

``@pytest.mark.slow``: takes more than a few seconds; ``make test-fast`` leaves it out.

``@pytest.mark.more``: left to make check (``make test-unit-more``), to keep ``make test-unit``
within 5 minutes; every test of a file in ``MORE_FILES`` gets it here. They are the stress
tests of the ranks' life cycle (an Interrupt at every point, a killed kernel, a classroom day
of jobs, faults, late ranks), the graders' planted-mistake suites beyond the fast catalogue
subset (each mistake waits out a short timeout or a hang), the fake-NCCL reruns of existing
suites and the fake-NCCL contract, the sharding suites (each starts its own ranks), and single
tests that start processes of their own (command lines, torchrun, the classroom command).
make test still grades one correct and one wrong solution of every exercise
(tests/test_graders_catalogue.py).
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

# Helper modules whose functions stand for a learner's code: they go by value as well.
BY_VALUE_HELPERS = ("_exercise_solutions",)

MORE_FILES = {
    "test_cluster_interrupts.py", "test_cluster_kernel.py", "test_cluster_soak.py", "test_cluster_faults.py",
    "test_observed_timeouts.py", "test_ring.py", "test_checks_labs06_08.py", "test_graders_slips.py",
    "test_recording_endings.py", "test_observed_fake_nccl.py", "test_sharded_optimizer_more.py",
    "test_checks_sharding.py", "test_fsdp.py", "test_fsdp_seen.py", "test_recorder_fake_nccl.py",
    "test_graders_fake_nccl.py", "test_memory_more.py", "test_fits_more.py", "test_sharded_optimizer.py",
    "test_memory.py", "test_fits.py", "test_zero_rows.py", "test_sharding_one_axis.py", "test_gpu_check.py",
    "test_record_fake_nccl.py", "test_nccl_contract.py", "test_observed_coalesced.py", "test_launchers.py",
    "test_classroom.py", "test_exercises.py", "test_handouts.py", "test_proxy_guard.py",
}


def pytest_collection_modifyitems(config, items):
    from ddplab.placement.resources import visible_gpus

    gpus = visible_gpus()
    for item in items:
        if item.path.name in MORE_FILES:
            item.add_marker(pytest.mark.more)
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.args[0] if marker.args else 1
        if gpus < need:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} GPU(s), one per rank; {gpus} visible (runs under make test-gpu)"))


def pytest_collection_finish(session):
    """Register every collected test module, and the helpers above, for pickling by value."""
    modules = {getattr(item, "module", None) for item in session.items}
    modules |= {sys.modules[name] for name in BY_VALUE_HELPERS if name in sys.modules}
    for module in modules - {None}:
        cloudpickle.register_pickle_by_value(module)


def _session_cluster(world_size: int, **options):
    @pytest.fixture(scope="session")
    def started():
        import ddplab

        with ddplab.Cluster(world_size=world_size, **options) as c:
            yield c
    return started


session_cluster1 = _session_cluster(1)
session_cluster2 = _session_cluster(2)
session_cluster3 = _session_cluster(3)
session_cluster2_short = _session_cluster(2, timeout=3.0)


@pytest.fixture
def cluster1(session_cluster1):
    session_cluster1.ensure_ready()
    return session_cluster1


@pytest.fixture
def cluster2(session_cluster2):
    session_cluster2.ensure_ready()
    return session_cluster2


@pytest.fixture
def cluster3(session_cluster3):
    session_cluster3.ensure_ready()
    return session_cluster3


@pytest.fixture
def cluster2_short(session_cluster2_short):
    session_cluster2_short.ensure_ready()
    return session_cluster2_short


@pytest.fixture
def gpu_world() -> int:
    """Ranks for a GPU test: one per visible GPU, at most 2."""
    from ddplab.placement.resources import visible_gpus

    return max(1, min(2, visible_gpus()))


@pytest.fixture(scope="session")
def browsing(tmp_path_factory):
    """One JupyterLab and one Chromium for every browser test of the session (tests/_browser.py)."""
    from _browser import open_browsing

    with open_browsing(tmp_path_factory) as shared:
        yield shared
