"""tests/pg/test_group.py again, on ranks whose observing group is ``ddplab_nccl`` over the fake NCCL.

The fake (tests/_fake_nccl.py) answers blocking ops with no work, completes futures at
enqueue and words its timeouts as NCCL does; every tensor of the ranks goes to the
group's NCCL half. The same observers must see the same ops, counts must equal gloo's,
torch DDP's buckets must be seen, a short limit must end a stall and replace the ranks,
and ranks that issued the same collectives must be kept. (In make check: test-unit-more.)
"""

import pytest
from test_group import (  # noqa: F401 - the tests, collected here again
    test_a_plain_group_is_refused_with_a_way_out,
    test_a_short_timeout_ends_a_stall_and_the_ranks_are_replaced,
    test_counts_equal_plain_gloo,
    test_every_spelling_is_seen,
    test_ranks_that_issued_the_same_collectives_are_kept,
    test_torch_ddp_buckets_seen_as_its_logging_data_says,
)

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


@pytest.fixture
def cluster(fake_nccl_cluster):
    """Two ranks on the fake NCCL (tests/conftest.py), back on it before each test."""
    return fake_nccl_cluster


