"""A differential test: random small models x torch's options, each strategy vs torch DDP and one process.

The reference reducers (``ddplab.sync.core``) run on every case they accept
and must equal their full versions, torch DDP and one process after every
step, at 2 and 3 ranks, ranks starting from different weights.

``make test`` runs a few dozen seeded cases at 2 and 3 ranks, batched into
one Cluster job per world size (see _differential.py for what a case is).
More cases behind a flag, and one case by its seed:

    DDPLAB_DIFF_CASES=500 .venv/bin/python -m pytest -q tests/sync/test_sync_differential.py
    DDPLAB_DIFF_SEED=123 .venv/bin/python -m pytest -q tests/sync/test_sync_differential.py -s

A disagreement is printed with its seed and its whole config, so it can be
reproduced and turned into a test of its own.
"""
from __future__ import annotations

import os
import pprint

import _differential as D
import pytest

import ddplab

N_CASES = int(os.environ.get("DDPLAB_DIFF_CASES", "24"))
N_PLAIN = int(os.environ.get("DDPLAB_DIFF_PLAIN_CASES", "8"))  # cases the reference accepts
ONE_SEED = os.environ.get("DDPLAB_DIFF_SEED")


def _seeds(world_size):
    if ONE_SEED is not None:
        return [int(ONE_SEED)]
    seeds = list(range(N_CASES)) + list(range(D.PLAIN_FROM, D.PLAIN_FROM + N_PLAIN))
    return [s for s in seeds if 2 + s % 2 == world_size]  # half at 2 ranks, half at 3


def test_case_configs_cover_every_feature_and_option():
    configs = [D.make_config(s) for s in range(N_CASES + N_PLAIN)]
    for key in ("shared", "tied", "frozen", "unused", "data_dependent", "batchnorm", "float32",
                "zero_size", "sparse", "find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
        assert any(c[key] for c in configs), key
    assert {c["cap_mb"] for c in configs} == set(D.CAPS)
    assert {c["hook"] for c in configs} == set(D.HOOKS)
    assert {c["micro_steps"] for c in configs} == {1, 2}
    assert D.make_config(7) == D.make_config(7)  # a seed is a reproducible case
    # every reference reducer meets cases at both world sizes
    for ws in (2, 3):
        names = {n for s in _seeds(ws) for n in D.strategies_for(D.make_config(s))}
        assert set(D.FULL_OF) <= names, (ws, set(D.FULL_OF) - names)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.more)])
def test_random_models_and_options_train_like_torch_ddp_and_one_process(world_size):
    seeds = _seeds(world_size)
    with ddplab.Cluster(world_size=world_size, timeout=60) as cluster:
        per_rank = cluster.run(D.run_cases, seeds)
    bad = {}
    for rank, found in enumerate(per_rank):
        for seed, config, what in found:
            bad.setdefault(seed, (config, []))[1].extend(f"rank {rank}: {w}" for w in what)
    report = "\n\n".join(f"DDPLAB_DIFF_SEED={seed} (world size {world_size})\n"
                         f"{pprint.pformat(config)}\n" + "\n".join(what)
                         for seed, (config, what) in sorted(bad.items()))
    print(f"{len(seeds)} cases at world size {world_size}, {len(bad)} disagreeing")
    assert not bad, f"{len(bad)} of {len(seeds)} cases disagree with torch DDP:\n\n{report}"
