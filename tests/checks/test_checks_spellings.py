"""Each exercise passes at least three correct solutions written differently, and the grader
sees their collectives (imported names, ``distributed_c10d``, futures, torch DDP's buckets)."""
import sys

import _exercise_solutions as S
import _spelled_solutions as V
import cloudpickle
import pytest

import ddplab
from ddplab import checks
from ddplab.sync import core

cloudpickle.register_pickle_by_value(S)
cloudpickle.register_pickle_by_value(V)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SOLUTIONS = [
    (checks.check_average_gradients, S.my_average_gradients),
    (checks.check_average_gradients, V.avg_imported),
    (checks.check_average_gradients, V.avg_c10d_async),
    (checks.check_average_gradients, V.avg_flat_futures),
    (checks.check_overlap_ddp, S.MyOverlapDDP),
    (checks.check_overlap_ddp, V.OverlapImported),
    (checks.check_overlap_ddp, V.OverlapC10d),
    (checks.check_bucketed_ddp, S.MyBucketedDDP),
    (checks.check_bucketed_ddp, V.BucketedImported),
    (checks.check_bucketed_ddp, core.BucketedDDP),
    (checks.check_no_sync, S.my_accumulation_step),
    (checks.check_no_sync, V.acc_exit_stack),
    (checks.check_no_sync, V.acc_one_context_per_batch),
]


@pytest.fixture(scope="module")
def cluster():
    with ddplab.Cluster(world_size=2) as c:
        yield c


@pytest.mark.parametrize("check, code", SOLUTIONS,
                         ids=[f"{c.__name__}-{code.__name__}" for c, code in SOLUTIONS])
def test_a_correct_solution_passes_however_it_is_spelled(cluster, check, code, capsys):
    result = check(cluster, code, draw=False)
    assert "passed" in capsys.readouterr().out
    # the learner's collectives were seen: they are on the drawn timeline
    assert result.timelines()["yours"].buckets
