"""ShardedOptimizer's heavier correctness cases (make check: test-unit-more): uneven
shares, tied weights, a parameter idle every other step with momentum, param groups with their
own learning rate, and 3 ranks; each after every step against one process and torch's ZeRO
(the cases and the checks are tests/sync/test_sharded_optimizer.py's)."""
from __future__ import annotations

import pytest
from test_sharded_optimizer import _check, _train

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


@pytest.mark.parametrize("kind,opt_name", [("uneven", "adam"), ("tied", "adamw"),
                                           ("idle", "sgd_momentum")])
def test_sharded_optimizer_equals_one_process_after_every_step_on_2_ranks(cluster2, kind,
                                                                        opt_name):
    _check(cluster2.run(_train, kind, opt_name), 2)


@pytest.mark.parametrize("kind,opt_name", [("uneven", "adam"), ("tied", "sgd_momentum"),
                                           ("mlp", "adamw")])
def test_sharded_optimizer_equals_one_process_after_every_step_on_3_ranks(cluster3, kind,
                                                                        opt_name):
    _check(cluster3.run(_train, kind, opt_name), 3)


def test_param_groups_with_their_own_learning_rate(cluster2):
    _check(cluster2.run(_train, "uneven", "adam", 3, True), 2)


