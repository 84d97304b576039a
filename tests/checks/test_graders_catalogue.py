"""The graders' mutation catalogue, fast subset: per exercise, its first correct solution passes
and its first wrong one ends in a CheckFailed naming the mistake listed beside it.

The whole catalogue (every solution, false accepts and rejects counted) is
``python tests/graders_catalogue.py`` (``make test-graders``).
"""
import graders_catalogue as C
import pytest

from ddplab.checks import CheckFailed

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
