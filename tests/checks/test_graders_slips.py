"""The slips the graders name beyond the fast subset's (tests/checks/test_graders_catalogue.py): each
planted once, and each must end in a CheckFailed naming that very slip.

make check runs this file (test-unit-more): each slip waits out a short timeout or a hang, about
40 s together on an idle 2-core machine. The whole catalogue is ``make test-graders``.
"""
import graders_catalogue as C
import pytest

from ddplab.checks import CheckFailed

pytestmark = [pytest.mark.timeout(300), pytest.mark.more]


@pytest.fixture
def clusters(request):
    """The session's shared ranks (conftest): ``clusters(world)`` is cluster2 or cluster3."""
    return lambda world: request.getfixturevalue(f"cluster{world}")


# The slips the graders name beyond the fast subset's: each planted once here.
SLIPS = [("00 ring all-reduce", name) for name in ("ring_float64_buffers", "ring_float32_buffers",
                                                   "ring_isend_never_waited")] + \
        [("08 pipeline step", name) for name in ("pipe_shape_transposed", "pipe_float64_buffer",
                                                  "pipe_isend_never_waited")] + \
        [("05 batch statistics", "stats_count_local_times_world"),
         ("07 comm hook", "hook_waits_inside"), ("07 comm hook", "hook_value_one_short"),
         ("02 OverlapDDP", "OverlapTiedTwice")]  # at 2 ranks its numbers can come out right


@pytest.mark.slow
@pytest.mark.parametrize("name,fn_name", SLIPS, ids=[f for _, f in SLIPS])
def test_each_named_slip(clusters, name, fn_name):
    entry = C.CATALOGUE[name]
    fn, mistake = next((f, m) for f, m in entry["wrong"] if f.__name__ == fn_name)
    with pytest.raises(CheckFailed) as info:
        entry["check"](clusters(entry["world"]), fn)
    assert info.value.mistake == mistake, str(info.value)
