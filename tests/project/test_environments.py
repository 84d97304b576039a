"""The conda and Binder environments list what pyproject asks for, so `make lab`,
conda and Binder give a learner the same lab; CI runs `make check`, which runs every test."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONDA_NAME = {"torch": "pytorch-cpu"}  # conda-forge's CPU build of torch


def _names(deps):
    return {re.split(r"[<>=!\s]", d, maxsplit=1)[0].lower() for d in deps if isinstance(d, str)}


def test_conda_and_binder_environments_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the lab, and the tools that run the notebooks' checks as CI does
    wanted = _names(project["dependencies"] + project["optional-dependencies"]["lab"]
                    + project["optional-dependencies"]["test"])
    wanted = {CONDA_NAME.get(n, n) for n in wanted}
    for path in (ROOT / "environment.yml", ROOT / "binder" / "environment.yml"):
        env = yaml.safe_load(path.read_text())
        assert env["channels"] == ["conda-forge"], path
        missing = wanted - _names(env["dependencies"])
        assert not missing, f"{path.relative_to(ROOT)} lacks {sorted(missing)}"


def test_binder_installs_the_package_without_pulling_dependencies():
    post = (ROOT / "binder" / "postBuild").read_text()
    assert "pip install --no-deps -e ." in post
    assert (ROOT / "binder" / "postBuild").stat().st_mode & 0o111, "postBuild must be executable"


def _make_dry_run(*targets) -> str:
    """What ``make TARGETS`` would run (its own recursive makes included), without running it."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(["make", "-n", *targets, f"PY={sys.executable}", "STAMP="], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_ci_runs_make_check_and_the_workflow_runs_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    # make check, with one environment from the system's Python (the hub's accounts run it)
    assert re.search(r"^make check PYTHON=/usr/bin/python3 HUB_VENV=\.venv$", ci, re.M), ci[-400:]
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    steps = [s.get("run", "") for job in workflow["jobs"].values() for s in job["steps"]]
    assert "bash .ci/run" in steps


def test_make_check_runs_make_test_then_the_labs_at_world_size_1_and_the_handouts():
    plan = _make_dry_run("check")
    unit, labs_ws1, handouts = (plan.index(s) for s in (
        "--ignore=tests/browser", "DDPLAB_WORLD_SIZE=1", "ddplab.course.handouts"))
    assert unit < labs_ws1 and unit < handouts
    assert "tests/browser/test_browser.py" in plan and "--durations=15" in plan


def test_make_check_installs_everything_before_its_two_lanes_start(tmp_path):
    # a pip install -e in one lane would rewrite the editable install the other lane imports
    plan = _make_dry_run("-B", "check")  # -B: as on a fresh clone, where nothing is installed yet
    lanes = plan.index("-j2 --output-sync=target check-lane-a check-lane-b")
    stamps = (".ddplab-classroom", ".ddplab-hub", ".ddplab-slurm-hub", ".ddplab-npm", ".ddplab-trainers")
    for install in stamps:
        assert re.search(rf"^touch \S*/{re.escape(install)}$", plan[:lanes], re.M), install
    # once installed (the stamps up to date), the lanes themselves install nothing
    for stamp in stamps:
        (tmp_path / stamp).touch()
    lane = _make_dry_run(f"VENV={tmp_path}", f"HUB_VENV={tmp_path}", f"PROXY_INSTALLED={tmp_path}/.ddplab-npm",
                         "check-lane-a", "check-lane-b")
    assert "pip install" not in lane and "npm ci" not in lane
    for each in ("graders_catalogue.py", "DDPLAB_WORLD_SIZE=1", "test_slurm.py", "ddplab.course.handouts",
                 "test_classroom_hub.py", "test_classroom_grading.py", "test_classroom_slurm.py",
                 "-m more tests/browser/test_browser.py tests/browser/test_browser_exercises.py"):
        assert each in lane, each


def test_every_lab_runs_in_make_test_or_make_check():
    # make test: the quick labs under nbval; make check: the handouts execute every lab
    # (labs/*.ipynb when none is named) and fail naming a notebook that raised
    quick = set(re.findall(r"labs/([\w.-]+\.ipynb)", _make_dry_run("test-labs")))
    assert quick and quick < {p.name for p in (ROOT / "labs").glob("*.ipynb")}
    handouts = _make_dry_run("handouts")
    assert "ddplab.course.handouts" in handouts and ".ipynb" not in handouts
    assert "handouts" in _make_dry_run("check")


def test_every_unit_test_runs_in_make_test_or_make_check():
    unit, more = _make_dry_run("test-unit"), _make_dry_run("test-unit-more")
    # the same paths, split by one marker: a test is in exactly one of the two
    assert '-m "not more" -n ' in unit and "-m more -n " in more
    assert unit.count("--dist loadfile tests --ignore=tests/browser") == 1
    assert more.count("--dist loadfile tests --ignore=tests/browser") == 1
    # the marker is set in each file, so a moved or renamed file keeps it
    marked = [p for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.more" in p.read_text()]
    assert len(marked) >= 30


def test_tests_live_in_the_rooms_of_the_package():
    rooms = {p.name for p in (ROOT / "ddplab").iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and (p / "conftest.py").exists()}
    assert not list((ROOT / "tests").glob("test_*.py")), "a test file outside the rooms: move it into one"
    assert folders - {"project", "browser"} <= rooms, folders - rooms
    assert all((ROOT / "tests" / f / "conftest.py").read_text().startswith('"""') for f in folders)


def test_make_test_fast_is_make_test_units_quick_tests():
    # the slow tests, and those make test leaves to make check: a quick pass within 90 s
    plan = _make_dry_run("test-fast")
    assert '-m "not slow and not more"' in plan and "tests " in plan
