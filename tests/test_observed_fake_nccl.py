"""tests/test_observed.py again, on ranks whose observing group is ``ddplab_nccl`` over the fake NCCL.

The fake (tests/_fake_nccl.py) answers blocking ops with no work, completes futures at
enqueue and words its timeouts as NCCL does; every tensor of the ranks goes to the
group's NCCL half. The same observers must see the same ops, counts must equal gloo's,
torch DDP's buckets must be seen, a short limit must end a stall and replace the ranks,
and ranks that issued the same collectives must be kept. (In make check: test-unit-more.)
"""
import itertools

import pytest
from test_observed import (  # noqa: F401 - the tests, collected here again
    test_a_plain_group_is_refused_with_a_way_out,
    test_a_short_timeout_ends_a_stall_and_the_ranks_are_replaced,
    test_counts_equal_plain_gloo,
    test_every_spelling_is_seen,
    test_ranks_that_issued_the_same_collectives_are_kept,
    test_torch_ddp_buckets_seen_as_its_logging_data_says,
)

from ddplab.cluster.cluster import Cluster

_STORES = itertools.count()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(2, timeout=30) as c:
        c.fake_nccl_dir = tmp_path_factory.mktemp("fake-nccl")
        yield c


def _backend():
    import torch.distributed as dist

    return str(dist.get_backend())


def _rejoin(path):
    import _fake_nccl

    return _fake_nccl.rejoin(path)


@pytest.fixture(autouse=True)
def on_fake_nccl(cluster):
    """Ranks replaced by an earlier test are gloo ranks again: move them onto the fake."""
    cluster.ensure_ready()
    if cluster.run(_backend) != ["ddplab_nccl"] * 2:
        path = str(cluster.fake_nccl_dir / f"store{next(_STORES)}")
        assert cluster.run(_rejoin, path) == ["ddplab_nccl"] * 2
