"""The graders' mutation catalogue, fast subset: per exercise, its first correct solution passes
and its first wrong one ends in a CheckFailed naming the mistake listed beside it.

The whole catalogue (every solution, false accepts and rejects counted) is
``python tests/graders_catalogue.py`` (``make test-graders``).
"""
import pytest

from ddplab.checks import CheckFailed

import graders_catalogue as C

pytestmark = pytest.mark.timeout(300)
CASES = [(name, kind) for name in C.CATALOGUE for kind in ("correct", "wrong")]


@pytest.fixture
def clusters(request):
    """The session's shared ranks (conftest): ``clusters(world)`` is cluster2 or cluster3."""
    return lambda world: request.getfixturevalue(f"cluster{world}")


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_catalogue_fast_subset(clusters, name, kind):
    entry = C.CATALOGUE[name]
    cluster = clusters(entry["world"])
    if kind == "correct":
        entry["check"](cluster, entry["correct"][0])  # a check's pass is returning without CheckFailed
        return
    fn, mistake = entry["wrong"][0]
    with pytest.raises(CheckFailed) as info:
        entry["check"](cluster, fn)
    assert mistake is None or info.value.mistake == mistake, str(info.value)


# The slips the graders name beyond the fast subset's: each planted once here.
SLIPS = [("00 ring all-reduce", name) for name in ("ring_float64_buffers", "ring_float32_buffers",
                                                   "ring_isend_never_waited")] + \
        [("08 pipeline step", name) for name in ("pipe_shape_transposed", "pipe_float64_buffer",
                                                  "pipe_isend_never_waited")] + \
        [("05 batch statistics", "stats_count_local_times_world"),
         ("07 comm hook", "hook_waits_inside"), ("07 comm hook", "hook_value_one_short")]


@pytest.mark.slow
@pytest.mark.parametrize("name,fn_name", SLIPS, ids=[f for _, f in SLIPS])
def test_each_named_slip(clusters, name, fn_name):
    entry = C.CATALOGUE[name]
    fn, mistake = next((f, m) for f, m in entry["wrong"] if f.__name__ == fn_name)
    with pytest.raises(CheckFailed) as info:
        entry["check"](clusters(entry["world"]), fn)
    assert info.value.mistake == mistake, str(info.value)
