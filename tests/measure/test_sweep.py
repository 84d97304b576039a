"""Bucket-size sweep and scaling on real ranks: shapes of the answers, predictions present."""
import pytest

import ddplab
from ddplab.measure.sweep import bucket_sweep, scaling


@pytest.mark.slow
def test_bucket_sweep_measures_and_predicts_on_a_simulated_link():
    with ddplab.Cluster(2) as c:
        s = bucket_sweep(c, caps_mb=(0.5, 64), link="10gbe", steps=2, n_params=1e6, depth=6)
    small, big = s["rows"]
    assert small["n_buckets"] > big["n_buckets"] == 1
    assert s["simulated_link"]["simulated"]
    for row in s["rows"]:
        assert row["predicted_step_ms"] >= row["compute_only_ms"] * 0.5
        assert row["step_ms"] > 0 and row["exposed_comm_ms"] >= 0


@pytest.mark.slow
@pytest.mark.more
def test_scaling_rows_and_efficiencies():
    sc = scaling((1, 2), steps=2, n_params=2e5, global_batch=16)
    rows = sc["rows"]
    assert [r["world_size"] for r in rows] == [1, 2]
    assert rows[0]["weak_efficiency"] == pytest.approx(1.0)
    assert all(r["strong_efficiency"] > 0 and r["weak_efficiency"] > 0 for r in rows)
    assert all(r["oversubscribed"] == (r["world_size"] > sc["usable_cpus"]) for r in rows)
