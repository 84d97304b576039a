"""Import paths of the previous layout, each failing with a message that names the new one.

The package was reorganised so that its folders show its layers (see docs/architecture.md).
Code written against the old paths gets a ModuleNotFoundError that says where the module went,
instead of a bare "No module named ...".
"""
from __future__ import annotations

import sys

MOVED = {
    "ddplab.clock": "ddplab.contracts.clock",
    "ddplab.protocols": "ddplab.contracts.protocols",
    "ddplab.torchrun": "ddplab.cluster.torchrun (or simply ddplab.init_from_env)",
    "ddplab.labsetup": "ddplab.course.labsetup (or ddplab.lab_world_size / ddplab.runs_here)",
    "ddplab.exercises": "ddplab.course.exercises (python -m ddplab.course.exercises)",
    "ddplab.handouts": "ddplab.course.handouts (python -m ddplab.course.handouts)",
    "ddplab.strategies": "ddplab.sync.registry (or ddplab.register_strategy / ddplab.build_strategy)",
    "ddplab.doctor": "ddplab.cli.doctor (python -m ddplab doctor)",
    "ddplab.magics": "ddplab.notebook.magics (%load_ext ddplab)",
    "ddplab.ddpcell": "ddplab.notebook.ddpcell",
    "ddplab.completion": "ddplab.notebook.completion",
    "ddplab.rankview": "ddplab.notebook.rankview",
    "ddplab.export": "ddplab.notebook.export",
    "ddplab.ring": "ddplab.lessons.ring",
    "ddplab.firstgroup": "ddplab.lessons.firstgroup",
    "ddplab.checks.uneven": "ddplab.checks.hangs",
    "ddplab.checks.comm_hook": "ddplab.checks.compression",
    "ddplab.experiments": ("ddplab.measure (compare, RunSpec, print_table, sweep, models) and "
                           "ddplab.lessons (each lab's rank programs)"),
    "ddplab.experiments.lessons": "ddplab.lessons.training",
}
for _m in ("spec", "runners", "compare", "sweep", "report", "models"):
    MOVED[f"ddplab.experiments.{_m}"] = f"ddplab.measure.{_m}"
for _m in ("checkpoints", "claims", "compression", "data", "hangs", "pipeline", "reducer_map"):
    MOVED[f"ddplab.experiments.{_m}"] = f"ddplab.lessons.{_m}"


class MovedModuleFinder:
    """A meta path finder consulted first: it answers only for the old names."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname in MOVED:
            raise ModuleNotFoundError(
                f"{fullname} moved: import {MOVED[fullname]} instead", name=fullname)
        return None


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
