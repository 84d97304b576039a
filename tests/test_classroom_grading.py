"""nbgrader autograde on live ranks, in a course folder written by `python -m ddplab classroom`.

The instructor's commands (tests/_classroom.py) on four submissions of lab 00: the solution
scores full marks, the untouched exercise 0, and each planted mistake loses its grader's point
with the grader's CheckFailed message in the autograded notebook (what the feedback shows).
nbgrader autogrades one notebook at a time, so at most one lab's ranks run at once.
"""
import os

import pytest

from ddplab.checks import ring
import _classroom as room

pytestmark = [pytest.mark.slow, pytest.mark.hub, pytest.mark.skipif(
    not os.environ.get("DDPLAB_HUB_TEST"), reason="runs under make test-hub (DDPLAB_HUB_TEST=1)")]

MISTAKES = {  # student -> ((line of a solution, what replaces it), the mistake, the grader that names it)
    "collective": (("    chunks = torch.tensor_split(t, p)",
                    "    dist.all_reduce(t)\n    return\n    chunks = torch.tensor_split(t, p)"),
                   ring.COLLECTIVE, "check_my_ring_all_reduce"),
}


@pytest.mark.timeout(900)
def test_autograde_solution_untouched_and_planted_mistakes(tmp_path):
    course = room.make_room(tmp_path / "class", "--roster", str(_roster(tmp_path)),
                            "--cpu-only", "--proxy", _any_executable()) / "course"
    room.submit(course, "solution", room.solved())
    room.submit(course, "untouched", room.exercise())
    for student, (change, _, _) in MISTAKES.items():
        room.submit(course, student, room.solved(change=change))
    scores = room.instructor_grade(course, ["solution", "untouched", *MISTAKES])
    full = sum(room.points().values())
    assert full >= 1 and scores["solution"] == full
    assert scores["untouched"] == 0.0
    assert "not implemented yet" in room.feedback(course, "untouched")
    for student, (_, mistake, grader) in MISTAKES.items():
        assert scores[student] == full - room.points()[grader], student
        assert mistake in room.feedback(course, student), student


def _roster(tmp_path):
    path = tmp_path / "roster.txt"
    path.write_text("\n".join(["solution", "untouched", *MISTAKES]) + "\n")
    return path


def _any_executable():
    # No hub is started here: any executable stands in for the proxy the config names.
    import sys
    return sys.executable
