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
within 5 minutes. Each file says so itself (``pytestmark = pytest.mark.more``, or the mark on
one test): the stress tests of the ranks' life cycle, the graders' planted-mistake suites beyond
the fast catalogue subset, the fake-NCCL reruns and contract, the sharding suites, and tests that
start processes of their own. make test still grades one correct and one wrong solution of every
exercise (tests/checks/test_graders_catalogue.py).

Folders. tests/ mirrors the package's rooms (tests/pg/ for ddplab/pg/, tests/sync/ for
ddplab/sync/, ...; tests/project/ for the repository as a whole, tests/browser/ for JupyterLab in
Chromium), each with a conftest that says what it covers. The helpers (``tests/_*.py``) stay here,
one folder for every room, since the ranks import them by name.

Fake NCCL. ``fake_nccl_cluster`` is two ranks whose group is the observing group over the fake
ProcessGroupNCCL of ``tests/_fake_nccl.py`` (CPU tensors answered as ProcessGroupNCCL answers),
moved back onto it before every test that asks for it: a test that planted a hang may have left
gloo ranks behind. A module sets ``FAKE_NCCL_ON_HOST = True`` to have the fake stamp on the host.
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

# Helper modules whose functions stand for a learner's code: they go by value as well.
BY_VALUE_HELPERS = ("_exercise_solutions",)



def pytest_collection_modifyitems(config, items):
    from ddplab.placement.resources import visible_gpus

    gpus = visible_gpus()
    for item in items:
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


_FAKE_STORES = iter(range(1_000_000))


@pytest.fixture(scope="module")
def _fake_nccl_ranks(tmp_path_factory):
    import ddplab

    with ddplab.Cluster(2, timeout=30) as c:
        c.fake_nccl_dir = tmp_path_factory.mktemp("fake-nccl")
        yield c


@pytest.fixture
def fake_nccl_cluster(_fake_nccl_ranks, request):
    """Two ranks on the fake NCCL (``tests/_fake_nccl.py``), moved back onto it when needed."""
    import _fake_nccl

    cluster = _fake_nccl_ranks
    cluster.ensure_ready()
    if cluster.run(_fake_nccl.backend_string) != ["ddplab_nccl"] * 2:
        path = str(cluster.fake_nccl_dir / f"store{next(_FAKE_STORES)}")
        on_host = getattr(request.module, "FAKE_NCCL_ON_HOST", False)
        assert cluster.run(_fake_nccl.rejoin, path, on_host=on_host) == ["ddplab_nccl"] * 2
    return cluster
