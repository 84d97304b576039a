"""The conda and Binder environments list what pyproject asks for, so `make lab`,
conda and Binder give a learner the same lab."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
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


def test_ci_builds_the_handouts_and_the_workflow_runs_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make handouts" in ci
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    steps = [s.get("run", "") for job in workflow["jobs"].values() for s in job["steps"]]
    assert "bash .ci/run" in steps
