"""A representative subset of the grader suite on NCCL ranks, over the fake ProcessGroupNCCL.

Two ranks of a ddplab Cluster rejoin as ``ddplab_nccl`` whose NCCL half is the fake
(tests/_fake_nccl.py) in its host-device mode (``host_device``). On them: lab 02's and
lab 07's graders (average_gradients, OverlapDDP, the comm hook) pass their first correct
solution and name their first wrong one's mistake, as on gloo (tests/checks/test_graders_catalogue.py);
and the hang grader stops a collective issued on one rank only and names it.

What this exercises: the graders' watch over the observing group when its collectives go
to an NCCL half that answers blocking ops with no work (the group asks for async works and
waits on them) and words its timeouts as NCCL does; the
graders' NCCL branches (``backend_name() == "nccl"``). What it does not: ``device()``
answers ``cpu`` here, so the learner's tensors are CPU tensors routed to the fake, not
CUDA tensors; no kernels, no real NCCL stream, no watchdog; and, the host being the
device, a work's future completes when its transfer has (on a GPU: at enqueue, with stream
order keeping a comm hook's division after the collective). (In make check: test-unit-more.)
"""

import graders_catalogue as C
import pytest

from ddplab.checks import CheckFailed

pytestmark = [pytest.mark.timeout(300), pytest.mark.more]
CASES = [(name, kind) for name in ("02 average_gradients", "02 OverlapDDP", "07 comm hook")
         for kind in ("correct", "wrong")]


FAKE_NCCL_ON_HOST = True  # the graders' stamps come from the host here


@pytest.fixture
def cluster(fake_nccl_cluster):
    """Two ranks on the fake NCCL (tests/conftest.py), back on it before each test."""
    return fake_nccl_cluster


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_graders_on_nccl_ranks(cluster, name, kind):
    entry = C.CATALOGUE[name]
    assert entry["world"] == 2
    if kind == "correct":
        entry["check"](cluster, entry["correct"][0])
        return
    fn, mistake = entry["wrong"][0]
    with pytest.raises(CheckFailed) as info:
        entry["check"](cluster, fn)
    assert mistake is None or info.value.mistake == mistake, str(info.value)


def test_a_hang_on_nccl_ranks_is_stopped_and_named(cluster):
    from test_checks import avg_only_rank0

    from ddplab import checks
    from ddplab.checks import mistakes as M

    with pytest.raises(CheckFailed) as info:
        checks.check_average_gradients(cluster, avg_only_rank0, timeout=3, draw=False)
    assert info.value.mistake == M.HUNG
    assert "rank 0 was waiting for all_reduce on the gradient of" in str(info.value)
