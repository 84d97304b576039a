"""Slurm's and Open MPI's variables, read as torchrun's (ddplab/launchers/schedulers.py), and the
batch file %ddp_export --sbatch writes (ddplab/notebook/sbatch.py).

Environment dicts as srun and mpirun set them (the Slurm ones copied from a
2-node job of the real Slurm that tests/launchers/test_slurm.py starts), and a fake
``scontrol`` on PATH that answers as Slurm 22.05 does and logs its calls.
tests/launchers/test_slurm.py runs the same code in real Slurm jobs.
"""
from __future__ import annotations

import os
import stat
import subprocess

import pytest

from ddplab.launchers import schedulers
from ddplab.launchers.schedulers import TorchrunEnvError, adopt, tasks_on_node
from ddplab.launchers.schedulers import torchrun_variables as derive
from ddplab.notebook import sbatch

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

FAKE_SCONTROL = """#!/bin/sh
echo "$*" >> "{log}"
case "$1 $2" in
  "show hostnames") for n in {hosts}; do echo "$n"; done ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1"
               echo "   NodeAddr={addr} NodeHostName=localhost Port=6818 Version=22.05.8" ;;
  *) echo "scontrol: unknown $*" >&2; exit 1 ;;
esac
"""


@pytest.fixture
def scontrol(tmp_path):
    """PATH with a fake scontrol (n[1-2] -> n1 n2, NodeAddr 10.1.2.3); its calls in ``.log``."""
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    exe = bin_dir / "scontrol"
    exe.write_text(FAKE_SCONTROL.format(log=log, hosts="n1 n2", addr="10.1.2.3"))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    log.touch()

    class Fake:
        path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}"
        calls = staticmethod(lambda: log.read_text().splitlines())
    return Fake


def srun_task(path, procid=3, nodeid=1, localid=1, **extra):
    """A task of `srun` in a 2-node x 2-task job (job 4242), as Slurm 22.05 sets it."""
    env = {"PATH": path, "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_PROCID": str(procid),
           "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": "4",
           "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": "4",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
           "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
           "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_a_slurm_task_gets_rank_sizes_and_the_first_nodes_nodeaddr(scontrol):
    launcher, derived = derive(srun_task(scontrol.path))
    assert launcher == "slurm"
    assert derived == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": str(20000 + 4242 % 12000)}
    # n1 does not resolve here, so its NodeAddr is asked for, after the list was expanded
    assert scontrol.calls() == ["show hostnames n[1-2]", "show node n1"]


def test_a_first_node_whose_name_resolves_is_used_by_name(scontrol):
    env = srun_task(scontrol.path, SLURM_STEP_NODELIST="localhost")
    assert derive(env)[1]["MASTER_ADDR"] == "localhost"
    assert scontrol.calls() == []  # one plain name: nothing to expand, nothing to look up


def test_two_jobs_on_one_node_meet_at_different_ports_below_the_ephemeral_range(scontrol):
    ports = {derive(srun_task(scontrol.path, SLURM_JOB_ID=j))[1]["MASTER_PORT"]
             for j in (4242, 4243, 99999, 16241)}
    assert len(ports) == 4 and all(20000 <= int(p) < 32768 for p in ports)


def test_torchruns_variables_win_and_what_the_user_set_is_kept(scontrol):
    # srun --ntasks-per-node=1 torchrun ...: each worker has torchrun's and Slurm's variables
    env = srun_task(scontrol.path, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT="29411")
    before = dict(env)
    assert adopt(env) == "torchrun" and env == before
    # a batch file that exports MASTER_PORT itself keeps it; the rest comes from Slurm
    env = srun_task(scontrol.path, MASTER_PORT="31000")
    assert adopt(env) == "slurm"
    assert (env["RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("3", "10.1.2.3", "31000")
    assert adopt({"PATH": scontrol.path}) == "none"


def test_srun_starting_two_torchruns_on_a_node_is_refused_in_their_workers(scontrol):
    worker = dict(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.1.2.3",
                  MASTER_PORT="29400", TORCHELASTIC_RUN_ID="4242")
    two = srun_task(scontrol.path, **worker)  # srun --ntasks-per-node=2 torchrun ...
    with pytest.raises(TorchrunEnvError, match=r"srun started 2 tasks on this node and each runs torchrun"
                                               r"(.|\n)*srun --ntasks-per-node=1 torchrun"):
        adopt(two)
    one = srun_task(scontrol.path, SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_STEP_NUM_TASKS="2", **worker)
    assert adopt(one) == "torchrun"


def test_the_batch_scripts_own_process_is_refused_saying_to_use_srun(scontrol):
    batch = {k: v for k, v in srun_task(scontrol.path, procid=0, nodeid=0, localid=0).items()
             if not k.startswith("SLURM_STEP")}
    with pytest.raises(TorchrunEnvError, match=r"batch script's own process.*4 task\(s\) on 2 node"
                                               r"(.|\n)*srun python train.py"):
        derive(batch)
    one = dict(batch, SLURM_NTASKS="1", SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1",
               SLURM_TASKS_PER_NODE="1", SLURM_JOB_NODELIST="localhost")
    assert derive(one)[1]["WORLD_SIZE"] == "1"  # a one-task job is a group of one


def test_a_one_task_step_in_a_job_of_two_nodes_or_gpus_is_refused(scontrol):
    one = dict(srun_task(scontrol.path, procid=0, nodeid=0, localid=0), SLURM_STEP_NUM_TASKS="1",
               SLURM_NTASKS="1", SLURM_STEP_TASKS_PER_NODE="1", SLURM_STEP_NODELIST="n1")
    with pytest.raises(TorchrunEnvError, match="one task, but the job has 2 nodes(.|\n)*torchrun"):
        derive(one)
    with pytest.raises(TorchrunEnvError, match="one task, but the job has 4 GPUs on this node"):
        derive(dict(one, SLURM_JOB_NUM_NODES="1", SLURM_GPUS_ON_NODE="4"))


def test_tasks_and_gpus_that_do_not_match_are_refused(scontrol):
    with pytest.raises(TorchrunEnvError, match=r"runs 2 task\(s\) .* 4 GPU\(s\)(.|\n)*"
                                               r"--ntasks-per-node=4"):
        derive(srun_task(scontrol.path, SLURM_GPUS_ON_NODE="4"))
    assert derive(srun_task(scontrol.path, SLURM_GPUS_ON_NODE="2"))[1]["LOCAL_WORLD_SIZE"] == "2"


def test_slurms_compressed_tasks_per_node_and_malformed_values():
    assert [tasks_on_node("3(x2),1", n) for n in range(3)] == [3, 3, 1]
    assert tasks_on_node("4", 0) == 4
    with pytest.raises(TorchrunEnvError, match="cannot read"):
        tasks_on_node("2(y2)", 0)
    with pytest.raises(TorchrunEnvError, match="SLURM_PROCID='x' is not an integer"):
        derive({"SLURM_PROCID": "x"})


def test_without_scontrol_or_a_nodeaddr_it_says_to_set_master_addr(scontrol, tmp_path):
    with pytest.raises(TorchrunEnvError, match="scontrol is not on PATH: set MASTER_ADDR"):
        derive(srun_task(str(tmp_path / "empty")))
    # a node that Slurm shows without a NodeAddr
    (tmp_path / "bin" / "scontrol").write_text('#!/bin/sh\n[ "$2" = hostnames ] && echo n1 || echo NodeName=n1\n')
    with pytest.raises(TorchrunEnvError, match="'n1' does not resolve"):
        derive(srun_task(scontrol.path))


def test_open_mpi_ranks_win_over_the_slurm_job_around_mpirun(scontrol):
    ompi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    # mpirun inside a 2-node allocation: Slurm's variables describe mpirun's daemon (one per node)
    env = dict(srun_task(scontrol.path, procid=1, nodeid=1, localid=0, SLURM_STEP_NUM_TASKS="2",
                         SLURM_STEP_TASKS_PER_NODE="1(x2)"), **ompi)
    launcher, derived = derive(env)
    assert launcher == "openmpi"
    assert derived == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": str(schedulers.job_port(env))}
    # alone on one machine: loopback, but mpirun has no port to give
    alone = dict(ompi, OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_LOCAL_RANK="1",
                 OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    with pytest.raises(TorchrunEnvError, match="mpirun -x MASTER_PORT"):
        derive(alone)
    assert derive(dict(alone, MASTER_PORT="29999"))[1]["MASTER_ADDR"] == "127.0.0.1"
    with pytest.raises(TorchrunEnvError, match="several machines(.|\n)*-x MASTER_ADDR"):
        derive(ompi)


# -- the batch file -------------------------------------------------------------------------------
def test_the_default_batch_file_starts_one_task_per_gpu_with_srun():
    text = sbatch.batch_text("train.py", sbatch.BatchOptions(
        nodes=2, gpus_per_node=4, time="01:00:00", partition="gpu", python="/opt/env/bin/python"))
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=train", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4", "#SBATCH --time=01:00:00", "#SBATCH --partition=gpu",
        "#SBATCH --output=%x-%j.out", "#SBATCH --signal=USR1@90", "#SBATCH --requeue",
        "#SBATCH --open-mode=append"]
    assert "PYTHON=${PYTHON:-/opt/env/bin/python}" in lines
    # a failed task ends the job at once (a hung peer would hold the nodes until the limit)
    assert lines[-1] == 'srun --kill-on-bad-exit=1 --label "$PYTHON" "$SCRIPT"'
    assert "torch.distributed.run" not in text
    assert 'echo "=== job $SLURM_JOB_ID attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 ))' in text
    assert "8 ranks in all" in text and "sbatch train.sbatch" in text


def test_the_torchrun_batch_file_starts_one_torchrun_per_node():
    text = sbatch.batch_text("train.py", sbatch.BatchOptions(nodes=2, gpus_per_node=4, launcher="torchrun"))
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --gpus-per-node=4" in text
    assert "--partition" not in text  # the site's default partition
    assert ("srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'trap \"\" USR1; exec \"$@\"' torchrun \\\n"
            '    "$PYTHON" -m torch.distributed.run') in text
    assert '--nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node=4' in text
    assert '--rdzv-backend=c10d --rdzv-endpoint="$head_addr:$port" --rdzv-id="$SLURM_JOB_ID"' in text


def test_a_cpu_batch_file_asks_for_no_gpus():
    text = sbatch.batch_text("t.py", sbatch.check(sbatch.BatchOptions(nodes=2, gpus_per_node=0)))
    assert "#SBATCH --ntasks-per-node=1" in text and "gpus" not in text


def test_batch_options_slurm_would_refuse_or_that_leave_gpus_idle_are_refused():
    with pytest.raises(ValueError, match="each rank takes one GPU"):
        sbatch.check(sbatch.BatchOptions(gpus_per_node=4, ntasks_per_node=2))
    with pytest.raises(ValueError, match="--time '1 hour'"):
        sbatch.check(sbatch.BatchOptions(time="1 hour"))
    with pytest.raises(ValueError, match="srun or torchrun"):
        sbatch.check(sbatch.BatchOptions(launcher="mpirun"))
    assert sbatch.check(sbatch.BatchOptions(time="1-12:00:00")).ntasks_per_node == 1
    with pytest.raises(ValueError, match="--warn-s -1"):
        sbatch.check(sbatch.BatchOptions(warn_s=-1))
    assert "--signal" not in sbatch.batch_text("t.py", sbatch.BatchOptions(warn_s=0))


def test_the_batch_files_rendezvous_lines_agree_with_init_from_env(scontrol):
    """The torchrun batch file finds the head node in bash; init_from_env does it in Python:
    both must give the same address (the NodeAddr of a name that does not resolve) and port."""
    text = sbatch.batch_text("t.py", sbatch.BatchOptions(nodes=2, gpus_per_node=0, launcher="torchrun"))
    lines = [line for line in text.splitlines() if line.startswith(("head_node=", "head_addr=", "port="))]
    env = srun_task(scontrol.path)
    done = subprocess.run(["bash", "-euc", "\n".join([*lines, 'echo "$head_addr:$port"'])],
                          env=env, capture_output=True, text=True, timeout=30, check=True)
    derived = derive(env)[1]
    assert done.stdout.strip() == f"{derived['MASTER_ADDR']}:{derived['MASTER_PORT']}" == "10.1.2.3:24242"


def test_ddp_export_parses_the_batch_options():
    from IPython.core.error import UsageError
    from IPython.core.magic_arguments import parse_argstring

    from ddplab.notebook.magics import DDPMagics

    def parse(line):
        return parse_argstring(DDPMagics.ddp_export, line)

    args = parse("train.py --sbatch --nodes 2 --time 10 --partition gpu --other-world-size")
    opts = sbatch.from_magic(args, world_size=4, ran_on="nccl")  # the notebook's 4 GPU ranks: 4 GPUs per node
    assert (opts.nodes, opts.gpus_per_node, opts.ntasks_per_node, opts.time, opts.partition,
            opts.launcher) == (2, 4, 4, "10", "gpu", "srun")
    cpu = sbatch.from_magic(parse("t.py --sbatch --gpus-per-node 0"), 2)
    assert (cpu.gpus_per_node, cpu.ntasks_per_node) == (0, 2)
    assert sbatch.from_magic(parse("t.py"), 2) is None
    with pytest.raises(UsageError, match="each rank takes one GPU(.|\n)*CPU job pass --gpus-per-node 0"):
        sbatch.from_magic(parse("t.py --sbatch --gpus-per-node 4 --ntasks-per-node 2"), 2, ran_on="nccl")


def test_the_exports_defaults_follow_the_notebooks_backend():
    from IPython.core.magic_arguments import parse_argstring

    from ddplab.notebook.magics import DDPMagics

    def opts(line, world, ran_on):
        return sbatch.from_magic(parse_argstring(DDPMagics.ddp_export, line), world, ran_on)

    gloo = opts("t.py --sbatch", 2, "gloo")  # a CPU notebook: a CPU job, no GPUs asked for
    assert (gloo.nodes, gloo.gpus_per_node, gloo.ntasks_per_node) == (1, 0, 2)
    assert "gpus" not in sbatch.batch_text("t.py", gloo)
    two_nodes = opts("t.py --sbatch --nodes 2", 2, "gloo")
    assert (two_nodes.gpus_per_node, two_nodes.ntasks_per_node) == (0, 1)
    nccl = opts("t.py --sbatch", 2, "nccl")
    assert (nccl.gpus_per_node, nccl.ntasks_per_node) == (2, 2)


def test_a_job_of_another_shape_than_the_notebook_is_refused_saying_what_to_pass():
    from IPython.core.error import UsageError
    from IPython.core.magic_arguments import parse_argstring

    from ddplab.notebook.magics import DDPMagics

    def opts(line, world=2, ran_on="gloo", asked="auto"):
        return sbatch.from_magic(parse_argstring(DDPMagics.ddp_export, line), world, ran_on, asked)

    # 2 tasks per node on 2 nodes: world size 4 for a 2-rank notebook; the user's 2 nodes kept
    with pytest.raises(UsageError, match=r"the job would have 4 ranks \(2 node\(s\) x 2\), the notebook had 2"
                                         r"(.|\n)*--nodes 2 --gpus-per-node 0 --ntasks-per-node 1"
                                         r"(.|\n)*--other-world-size"):
        opts("t.py --sbatch --nodes 2 --gpus-per-node 0 --ntasks-per-node 2")
    assert opts("t.py --sbatch --nodes 2 --gpus-per-node 0 --ntasks-per-node 2 --other-world-size").nodes == 2
    # GPUs for a notebook that ran on the CPU: refused, naming --gpus-per-node 0
    with pytest.raises(UsageError, match=r"--gpus-per-node 4: the notebook's ranks ran on the CPU"
                                         r"(.|\n)*Pass --gpus-per-node 0 for a CPU job(.|\n)*--on-gpus"):
        opts("t.py --sbatch --gpus-per-node 4", world=4)
    assert opts("t.py --sbatch --gpus-per-node 4 --on-gpus", world=4).gpus_per_node == 4
    with pytest.raises(UsageError, match="asked for backend 'gloo'"):  # its script would never use them
        opts("t.py --sbatch --gpus-per-node 4 --on-gpus", world=4, asked="gloo")
