"""nbgrader autograde on live ranks, every lab, in one course folder written by `python -m ddplab classroom`.

The instructor's commands (tests/_classroom.py) on every lab's submissions in one course:
generate_assignment and autograde, each once for every assignment ("*"; nbgrader autogrades one
notebook at a time, so at most one lab's ranks run at once):

- "slipped", in every lab: one planted slip in EVERY exercise of the lab. Every grader loses
  its points, and each grader's own words (its CheckFailed mistake, or the assert's message for
  labs 01 and 04, whose graders are plain asserts) are in the autograded notebook, which is
  what the feedback shows. Every cell that is not a grader ran without an error: the whole lab
  runs under nbgrader's kernel and folder, not just its graders.
- "solution", in the labs of ``SOLVED``: full marks through nbgrader. In the other labs the
  same solution notebook runs under nbval (make test) and in the handouts (make check) with
  every grader cell passing; running it once more here would cost a lab's run per lab (about
  25 s each on 2 cores) and prove what those runs prove, given the points ``points`` reads.
- "untouched", in lab 00: 0 points, "not implemented yet".

The slips here are one per grader: they prove that a grader's failure reaches the gradebook and
the feedback through nbgrader. Every other planted mistake of every grader is run against the
grader itself by the catalogue (tests/graders_catalogue.py, `make test-graders`, also in make
check): running each through a whole notebook would cost a lab's run per mistake.

Lab 00's "solution" and "untouched" go through nbgrader's own exchange, as the one-account
class's hub servers run it (one uid; each learner with JUPYTERHUB_USER set and
JUPYTER_CONFIG_PATH on the classroom's learner-config): the instructor releases lab 00, both
fetch it, "solution" fills in the solutions, both submit, the instructor collects (the
submissions are filed under the HUB user names, not the one OS user); after the one autograde,
feedback is generated and returned and each learner fetches their own. (The default class,
learners as their own Unix accounts, goes through the same exchange in
tests/course/test_classroom_hub.py.)
"""
import os
import subprocess
import sys

import _classroom as room
import nbformat
import pytest

from ddplab.checks import (
    compression,
    data,
    firstgroup,
    hangs,
    mistakes,
    pipeline,
    reducer_map,
    ring,
    sharding,
    yourmodel,
)
from ddplab.checks import fsdp as fsdp_check

pytestmark = [pytest.mark.slow, pytest.mark.hub, pytest.mark.skipif(
    not os.environ.get("DDPLAB_HUB_TEST"), reason="runs under make test-hub (DDPLAB_HUB_TEST=1)")]

# lab -> [(line of a solution, what replaces it, the words its grader must say), ...], one per grader
SLIPS = {
    "00-first-process-group": [
        ("        work.wait()\n    return buf", "        work.wait()\n    return t", firstgroup.WRONG_VALUES),
        ("    chunks = torch.tensor_split(t, p)",
         "    dist.all_reduce(t)\n    return\n    chunks = torch.tensor_split(t, p)", ring.COLLECTIVE)],
    "01-when-is-the-sync": [
        ("    dist.all_reduce(t)          # SUM over the ranks; every rank ends with the result", "    pass",
         "every rank should end with")],
    "02-average-gradients-vs-ddp": [
        ("            p.grad /= world             # the mean loss's gradient", "            pass",
         mistakes.NO_DIVISION),
        ("            dist.broadcast(p.data, src=0)           # every rank starts from rank 0's weights",
         "            pass", mistakes.NO_BROADCAST)],
    "03-buckets-network-no-sync": [
        ("torch.cat([p.grad.reshape(-1) for p in bucket]) / self.world_size",
         "torch.cat([p.grad.reshape(-1) for p in bucket])", mistakes.NO_DIVISION),
        ("loss = loss_fn(model(x), y) / n", "loss = loss_fn(model(x), y)", mistakes.NO_SYNC_NO_DIVISION)],
    "04-stragglers-traffic-claims": [
        ("    dist.all_reduce(t)\n", "", "rank 0 should wait about delay_s")],
    "05-data-and-checkpoints": [
        ("    return indices[rank:total:world_size]",
         "    share = total // world_size\n    return indices[rank * share:(rank + 1) * share]", data.BLOCKS),
        ("    dist.all_reduce(packed)\n", "", data.LOCAL_STATS)],
    "06-hangs-and-errors": [
        ("dist.ReduceOp.MIN", "dist.ReduceOp.MAX", hangs.MAXIMUM)],
    "07-compression-and-beyond": [
        ("buffer.to(torch.float16).div_(dist.get_world_size())", "buffer.to(torch.float16)",
         compression.NO_DIVISION)],
    "08-traffic-data-vs-model-parallel": [
        ("    h.requires_grad_()\n", "", pipeline.NO_REQUIRES_GRAD)],
    "09-inside-torch-reducer": [
        ("    for i in ready_order:", "    for i in range(len(params)):", reducer_map.DECLARATION_ORDER)],
    "10-your-model": [
        ('b["comm_end"] > backward_end', 'b["comm_end"] >= backward_end', yourmodel.AT_THE_END)],
    "11-sharded-optimizer": [
        ("        dist.broadcast(p.data, src=owner[p])", "        pass", sharding.NO_BROADCAST)],
    "12-fsdp": [
        ("        piece /= ws\n", "", fsdp_check.NO_DIVISION)],
}


# Full marks through nbgrader: lab 00, beside its untouched exercise. Every other lab's solution
# passes its graders in the handouts and the catalogue, and its whole notebook runs under
# nbgrader here as "slipped".
SOLVED = ("00-first-process-group",)


def students(lab):
    return ["slipped"] + (["solution"] if lab in SOLVED else []) + (["untouched"] if lab == room.LAB else [])


# The learners who go through the exchange (lab 00), as the one-account class's servers run them.
EXCHANGED = ("solution", "untouched")


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One course: lab 00 released, fetched and submitted through the exchange by ``EXCHANGED``,
    every other submission filed directly, then the instructor's one autograde for all of them
    (nbgrader takes "*" for every assignment). Returns (class folder, learners' homes)."""
    tmp = tmp_path_factory.mktemp("grading")
    roster = tmp / "roster.txt"
    roster.write_text("slipped\nsolution\nuntouched\n")
    # --trusted-class: no Unix accounts; nbgrader runs here as the test's own user
    folder = room.make_room(tmp / "class", "--roster", str(roster), "--cpu-only", "--trusted-class",
                            "--proxy", sys.executable)  # no hub is started: any executable stands in
    course = folder / "course"
    room.nbgrader(course, "db", "student", "import", "roster.csv")
    room.nbgrader(course, "generate_assignment", "*", "--force")
    room.nbgrader(course, "release_assignment", room.LAB, "--force")
    homes = {user: tmp / "home" / user for user in EXCHANGED}
    for user, home in homes.items():
        home.mkdir(parents=True)
        learner(folder, home, user, "fetch_assignment", room.LAB)
        fetched = home / room.LAB / f"{room.LAB}.ipynb"
        assert "raise NotImplementedError" in fetched.read_text()  # the exercise, not the solution
    nbformat.write(room.solved(), homes["solution"] / room.LAB / f"{room.LAB}.ipynb")
    for user, home in homes.items():
        learner(folder, home, user, "submit", room.LAB)
    room.nbgrader(course, "collect", room.LAB)
    for lab, slips in SLIPS.items():
        room.submit(course, "slipped", room.solved(lab, changes=[s[:2] for s in slips]), lab)
        if lab in SOLVED and lab != room.LAB:
            room.submit(course, "solution", room.solved(lab), lab)
    room.nbgrader(course, "autograde", "*", "--force", timeout=1800)
    return folder, homes


@pytest.fixture(scope="module")
def course(graded):
    return graded[0] / "course"


def learner(folder, home, user, *args):
    # one uid: every learner has the same Jupyter data folder (here one of the test's own)
    env = dict(room.env(), JUPYTERHUB_USER=user, JUPYTER_CONFIG_PATH=str(folder / "learner-config"),
               JUPYTER_DATA_DIR=str(folder / "jupyter-data"))
    out = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=home, capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, f"{user}: nbgrader {' '.join(args)}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return out


def test_every_lab_is_graded():
    assert sorted(SLIPS) == sorted(p.stem for p in (room.ROOT / "labs").glob("[0-9]*.ipynb"))


@pytest.mark.timeout(1800)  # the first test waits for the fixture: every lab autograded
@pytest.mark.parametrize("lab", sorted(SLIPS))
def test_autograde_a_slip_in_every_exercise_and_the_solution(course, lab):
    scores = room.scores(course, students(lab), lab)
    points = room.points(lab)
    assert len(points) == len(SLIPS[lab]), f"{lab}: a grader without a slip here, or a slip too many"
    assert sum(points.values()) >= 1
    assert scores["slipped"] == 0.0, (lab, scores)   # every grader lost its points
    said = room.feedback(course, "slipped", lab)
    for _, _, words in SLIPS[lab]:
        assert words in said, f"{lab}: the feedback does not say {words!r}"
    errors = room.errors_outside_graders(course, "slipped", lab)
    assert not errors, f"{lab}: cells that are not graders raised under nbgrader: {errors}"
    if lab in SOLVED:
        assert scores["solution"] == sum(points.values()), (lab, scores)
    if lab == room.LAB:
        assert scores["untouched"] == 0.0
        assert "not implemented yet" in room.feedback(course, "untouched", lab)



@pytest.mark.timeout(1800)
def test_the_exchange_files_under_hub_user_names_and_returns_each_learner_their_feedback(graded):
    folder, homes = graded
    course = folder / "course"
    for user in EXCHANGED:  # filed under the hub's user names, not the OS user
        assert (course / "submitted" / user / room.LAB / f"{room.LAB}.ipynb").is_file(), user
    assert not (course / "submitted" / os.environ.get("USER", "root")).exists()
    for user in EXCHANGED:  # (only the exchange's submissions carry the timestamp feedback needs)
        room.nbgrader(course, "generate_feedback", room.LAB, "--student", user, "--force")
        room.nbgrader(course, "release_feedback", room.LAB, "--student", user)
    pages = {}
    for user, home in homes.items():
        learner(folder, home, user, "fetch_feedback", room.LAB)
        # each learner gets their own feedback only (one uid shares nbgrader's submit cache
        # unless the learners' config gives each learner one)
        found = list((home / room.LAB / "feedback").rglob("*.html"))
        assert len(found) == 1, (user, found)
        pages[user] = found[0].read_text()
    assert "not implemented yet" in pages["untouched"] and "not implemented yet" not in pages["solution"]
