"""%ddp_export --sbatch options that used to pass or crash without a word: zero nodes or ranks
per node, --on-gpus with no GPU count, a time limit shorter than the warning, suggestions that
dropped the user's --nodes; and the classroom command's description of where it runs."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from ddplab.notebook import sbatch
from ddplab.notebook.magics import DDPMagics


def opts(line, world=2, ran_on="gloo", asked="auto"):
    return sbatch.from_magic(parse_argstring(DDPMagics.ddp_export, line), world, ran_on, asked)


def test_zero_nodes_is_refused_in_words_before_anything_divides_by_it():
    with pytest.raises(UsageError, match="--nodes takes 1 or more"):
        opts("x.py --sbatch --nodes 0")
    with pytest.raises(UsageError, match="--nodes takes 1 or more"):
        opts("x.py --sbatch --nodes 0", ran_on="nccl")


def test_zero_ranks_per_node_is_refused_like_a_negative_count():
    for n in ("0", "-2"):
        with pytest.raises(UsageError, match=f"--ntasks-per-node {n}: it takes 1 or more"):
            opts(f"x.py --sbatch --gpus-per-node 0 --ntasks-per-node {n}")
    with pytest.raises(ValueError, match="--ntasks-per-node 0"):
        sbatch.check(sbatch.BatchOptions(gpus_per_node=2, ntasks_per_node=0))


def test_on_gpus_without_a_gpu_count_is_refused_saying_what_to_add():
    with pytest.raises(UsageError, match=r"--on-gpus asks for GPU nodes, but no --gpus-per-node says how many"
                                         r"(.|\n)*--nodes 1 --gpus-per-node 2"):
        opts("x.py --sbatch --on-gpus")
    with pytest.raises(UsageError, match="--gpus-per-node 0 asks for none"):
        opts("x.py --sbatch --on-gpus --gpus-per-node 0")
    job = opts("x.py --sbatch --on-gpus --gpus-per-node 2")
    assert (job.gpus_per_node, job.ntasks_per_node) == (2, 2)


def test_a_time_limit_shorter_than_the_warning_and_a_minute_is_refused_naming_both_flags():
    with pytest.raises(UsageError, match=r"--time 2 \(120 s\) with --warn-s 90(.|\n)*at least 150 s"):
        opts("x.py --sbatch --time 2")
    with pytest.raises(ValueError, match=r"--time 00:05:00 \(300 s\) with --warn-s 600"):
        sbatch.check(sbatch.BatchOptions(time="00:05:00", warn_s=600))
    assert opts("x.py --sbatch --time 3").time == "3"  # 180 s: warned after 90
    assert opts("x.py --sbatch --time 2 --warn-s 0").time == "2"  # no warning, nothing to fit
    assert opts("x.py --sbatch --time 0").time == "0"  # Slurm's 0: no limit


def test_slurms_time_formats_in_seconds():
    assert [sbatch.seconds(t) for t in ("30", "5:30", "01:02:03", "1-2", "1-02:30", "1-00:00:10", "0")] == [
        1800, 330, 3723, 93600, 95400, 86410, 0]


def test_world_size_suggestions_keep_the_users_nodes_when_the_ranks_divide_evenly():
    with pytest.raises(UsageError, match=r"Ask for 8 ranks \(e\.g\. --nodes 2 --gpus-per-node 4\)"):
        opts("x.py --sbatch --nodes 2 --gpus-per-node 8", world=8, ran_on="nccl")
    with pytest.raises(UsageError, match=r"--nodes 2 --gpus-per-node 0 --ntasks-per-node 2\)"):
        opts("x.py --sbatch --nodes 2 --gpus-per-node 0 --ntasks-per-node 3", world=4)
    with pytest.raises(UsageError, match=r"Ask for 3 ranks \(e\.g\. --nodes 1 --gpus-per-node 3\)"):
        opts("x.py --sbatch --nodes 2 --gpus-per-node 3", world=3, ran_on="nccl")


def test_the_classroom_commands_help_says_it_also_runs_on_slurm(capsys):
    from ddplab.__main__ import main

    with pytest.raises(SystemExit):
        main(["classroom", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "on one server" not in text
    assert "--spawner slurm submits each one as a Slurm job" in text
