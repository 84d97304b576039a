"""compare()'s ZeRO-1 rows: ``zero1`` (ddplab.ShardedOptimizer) and ``torch_zero`` (torch's
ZeroRedundancyOptimizer) train like DDP, and send DDP's all-reduce plus one broadcast of
the parameters per step, counted at the observing group."""
from __future__ import annotations

import pytest

from ddplab.measure.compare import compare

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


def test_zero_rows_send_ddps_bytes_plus_the_parameters_and_agree(cluster2):
    r = compare(cluster2, strategies=("ddp", "zero1", "torch_zero"), steps=3, warmup=1,
                record=False)
    m = r.metrics
    mem = m["zero1"]["memory_per_rank"]
    param_bytes = mem[0]["params"]
    assert param_bytes > 0 and m["ddp"]["comm_bytes_per_step"] > 0
    for row in ("zero1", "torch_zero"):
        assert m[row]["ranks_agree"]
        # every rank hands the group each parameter once (sending it, or receiving it)
        assert m[row]["comm_bytes_per_step"] == m["ddp"]["comm_bytes_per_step"] + param_bytes
        assert m[row]["step_ms"] > 0
    for row in ("ddp", "zero1", "torch_zero"):
        held = m[row]["memory_per_rank"]
        assert len(held) == 2 and all(h["params"] == param_bytes for h in held)
        assert all(h["optimizer_state"] == 0 for h in held)  # plain SGD keeps no state
