"""nbgrader's own exchange, end to end, in a one-account course (`python -m ddplab classroom --trusted-class`).

(The default class, learners as their own Unix accounts, goes through the same exchange in
tests/course/test_classroom_hub.py.) The instructor releases lab 00; two learners, as the one-account
mode's hub servers run them (one uid, each with
JUPYTERHUB_USER set and JUPYTER_CONFIG_PATH on the classroom's learner-config), fetch it, one
fills in the solutions, both submit; the instructor collects: the submissions are filed under the
HUB user names (not the one OS user). Then autograde, feedback generated and returned, and each
learner fetches their own feedback.
"""
import os
import subprocess
import sys

import _classroom as room
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.hub, pytest.mark.skipif(
    not os.environ.get("DDPLAB_HUB_TEST"), reason="runs under make test-hub (DDPLAB_HUB_TEST=1)")]


def learner(folder, home, user, *args):
    # one uid: every learner has the same Jupyter data folder (here one of the test's own)
    env = dict(room.env(), JUPYTERHUB_USER=user, JUPYTER_CONFIG_PATH=str(folder / "learner-config"),
               JUPYTER_DATA_DIR=str(folder / "jupyter-data"))
    out = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=home, capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, f"{user}: nbgrader {' '.join(args)}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return out


@pytest.mark.timeout(900)
def test_release_fetch_submit_collect_autograde_and_feedback_under_hub_user_names(tmp_path):
    import nbformat

    lab = room.LAB
    roster = tmp_path / "roster.txt"
    roster.write_text("ann\nbob\n")
    folder = room.make_room(tmp_path / "class", "--roster", str(roster), "--cpu-only", "--trusted-class",
                            "--proxy", sys.executable)
    course = folder / "course"
    room.nbgrader(course, "db", "student", "import", "roster.csv")
    room.nbgrader(course, "generate_assignment", lab, "--force")
    room.nbgrader(course, "release_assignment", lab, "--force")
    homes = {}
    for user in ("ann", "bob"):
        homes[user] = tmp_path / "home" / user
        homes[user].mkdir(parents=True)
        learner(folder, homes[user], user, "fetch_assignment", lab)
        fetched = homes[user] / lab / f"{lab}.ipynb"
        assert fetched.is_file()
        assert "raise NotImplementedError" in fetched.read_text()  # the exercise, not the solution
    nbformat.write(room.solved(), homes["bob"] / lab / f"{lab}.ipynb")  # bob solves; ann does not
    for user in ("ann", "bob"):
        learner(folder, homes[user], user, "submit", lab)
    room.nbgrader(course, "collect", lab)
    for user in ("ann", "bob"):  # filed under the hub's user names, not the OS user
        assert (course / "submitted" / user / lab / f"{lab}.ipynb").is_file(), user
    assert not (course / "submitted" / os.environ.get("USER", "root")).exists()
    room.nbgrader(course, "autograde", lab, "--force")
    scores = room.scores(course, ["ann", "bob"])
    assert scores["bob"] == sum(room.points().values()) and scores["ann"] == 0.0
    room.nbgrader(course, "generate_feedback", lab, "--force")
    room.nbgrader(course, "release_feedback", lab)
    pages = {}
    for user in ("ann", "bob"):
        learner(folder, homes[user], user, "fetch_feedback", lab)
        # each learner gets their own feedback only (one uid shares nbgrader's submit cache
        # unless the learners' config gives each learner one)
        found = list((homes[user] / lab / "feedback").rglob("*.html"))
        assert len(found) == 1, (user, found)
        pages[user] = found[0].read_text()
    assert "not implemented yet" in pages["ann"] and "not implemented yet" not in pages["bob"]
