"""A class on one GPU server: which GPUs a Cluster takes, refuses, and warns about.

GPU discovery is replaced by lists of fake GPUs, so these rules run on CPU machines.
"""
import pytest

from ddplab.pg import backend as rank_backend
from ddplab.placement.gpus import BUSY_MIB, GPU, discover, place, visible


def _server(*users, used=None):
    """A 4-GPU server; ``users[i]`` are the pids on GPU i (None: NVML cannot tell)."""
    gpus = []
    for i in range(4):
        pids = users[i] if i < len(users) else ()
        mem = (used or {}).get(i, 3)
        gpus.append(GPU(i, "H100", f"GPU-{i}aaa", 81559, mem, pids))
    return gpus


def test_auto_takes_only_gpus_nobody_else_holds():
    p = place(2, "auto", found=_server((4242,), (), (77,), ()))
    assert p == place(2, "auto", found=_server((4242,), (), (77,), ()))
    assert (p.backend, p.gpus, p.notes) == ("nccl", (1, 3), ())


def test_auto_falls_back_to_gloo_and_says_who_holds_the_gpus():
    p = place(3, "auto", found=_server((4242,), (), (77,), ()))
    assert p.backend == "gloo" and p.gpus == ()
    (why,) = p.notes
    assert "2 of 4 are free" in why and "pid(s) 4242" in why and "pid(s) 77" in why
    assert "gpus=[...]" in why


def test_a_cpu_machine_picks_gloo_without_a_word():
    assert place(2, "auto", found=[]) == place(2, "gloo", found=[])
    assert place(2, "auto", found=[]).notes == ()


def test_own_ranks_do_not_count_as_other_users():
    found = _server((10, 11), (12,))
    assert place(2, "auto", found=found, own_pids={10, 11, 12}).gpus == (0, 1)


def test_without_process_lists_memory_decides_and_the_reason_says_so():
    found = [GPU(0, used_mib=BUSY_MIB + 500, total_mib=80000, pids=None),
             GPU(1, used_mib=2, total_mib=80000, pids=None)]
    assert place(1, "auto", found=found).gpus == (1,)
    p = place(2, "auto", found=found)
    assert p.backend == "gloo" and "judged by memory" in p.notes[0]


def test_named_gpus_are_taken_even_when_busy_with_a_warning():
    p = place(2, "auto", gpus=[2, 3], found=_server((), (), (99,), ()))
    assert (p.backend, p.gpus) == ("nccl", (2, 3))
    assert len(p.notes) == 1 and "GPU 2 is used by pid(s) 99" in p.notes[0]


@pytest.mark.parametrize("gpus, match", [
    ([0], "names 1 GPU"),
    ([1, 1], "names a GPU twice"),
    ([0, 7], "no GPU 7 here"),
    ("0,1", "list of GPU indices"),
    ([0, True], "list of GPU indices"),
])
def test_bad_gpu_lists_say_what_to_do(gpus, match):
    with pytest.raises(ValueError, match=match):
        place(2, "auto", gpus=gpus, found=_server())


def test_gpus_with_gloo_is_refused():
    with pytest.raises(ValueError, match="backend='gloo'"):
        place(2, "gloo", gpus=[0, 1], found=_server())


def test_nccl_prefers_free_gpus_then_warns_about_busy_ones():
    p = place(3, "nccl", found=_server((5,), (), (6,), ()))
    assert p.gpus == (0, 1, 3) and len(p.notes) == 1 and "pid(s) 5" in p.notes[0]
    with pytest.raises(ValueError, match="world_size<=4"):
        place(5, "nccl", found=_server())
    with pytest.raises(ValueError, match="no GPU is visible"):
        place(1, "nccl", found=[])


def test_cuda_visible_devices_renumbers_by_index_or_uuid_and_stops_at_a_bad_entry():
    phys = _server()
    assert [g.uuid for g in visible(phys, "2,0")] == ["GPU-2aaa", "GPU-0aaa"]
    assert [g.index for g in visible(phys, "2,0")] == [0, 1]
    assert [g.uuid for g in visible(phys, "GPU-3,1")] == ["GPU-3aaa", "GPU-1aaa"]
    assert [g.uuid for g in visible(phys, "1,9,2")] == ["GPU-1aaa"]  # CUDA stops at GPU 9
    assert visible(phys, "") == [] and visible(phys, None) == phys


def test_discover_answers_on_this_machine_without_touching_cuda():
    import torch

    found = discover()
    assert all(isinstance(g, GPU) for g in found)
    assert not torch.cuda.is_initialized()


def test_backend_names_read_the_device_mapped_group():
    # the ranks join through the observing group, which wraps gloo (and NCCL for CUDA tensors)
    assert rank_backend.init_string("nccl") == "ddplab_nccl"
    assert rank_backend.init_string("gloo") == "ddplab_gloo"
    assert rank_backend.gradient_backend("ddplab_nccl") == "nccl"
    assert rank_backend.gradient_backend("ddplab_gloo") == "gloo"
    assert rank_backend.gradient_backend("cpu:gloo,cuda:nccl") == "nccl"
    assert rank_backend.gradient_backend("cuda:nccl,cpu:gloo") == "nccl"
    assert rank_backend.gradient_backend("cpu:gloo") == "gloo"
    assert rank_backend.gradient_backend("gloo") == "gloo" and rank_backend.gradient_backend("nccl") == "nccl"


def test_doctor_lists_each_gpu_with_free_memory_and_users(monkeypatch, capsys):
    from ddplab.cli import doctor
    from ddplab.placement import gpus

    fake = _server((4242,), (), (), ()) + [GPU(4, "H100", "GPU-4", 81559, 900, None)]
    monkeypatch.setattr(gpus, "discover", lambda: fake)
    doctor.main((2, 5))
    out = capsys.readouterr().out
    assert "GPU 0: H100, 81556 of 81559 MiB free, used by pid(s) 4242  <- busy" in out
    assert "GPU 1: H100, 81556 of 81559 MiB free, no processes" in out
    assert "GPU 4: H100, 80659 of 81559 MiB free, users unknown  <- busy" in out
    assert "world_size=2: nccl on GPUs [1, 2]" in out
    assert "world_size=5: gloo" in out and "3 of 5 are free" in out
    assert "cpu:gloo,cuda:nccl" in out and "ddplab rank(s) running here" in out


def test_labs_read_their_world_size_and_say_why_a_cell_skips(monkeypatch, capsys):
    import types

    import ddplab

    monkeypatch.delenv("DDPLAB_WORLD_SIZE", raising=False)
    assert ddplab.lab_world_size() == 2
    monkeypatch.setenv("DDPLAB_WORLD_SIZE", "1")
    assert ddplab.lab_world_size() == 1
    monkeypatch.setenv("DDPLAB_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="not a number of ranks"):
        ddplab.lab_world_size()
    one_gpu = types.SimpleNamespace(world_size=1, backend="nccl")
    assert not ddplab.runs_here(one_gpu, ranks=2, what="the straggler cell")
    assert "skipped: the straggler cell needs 2 ranks (this cluster has 1" in capsys.readouterr().out
    assert not ddplab.runs_here(one_gpu, cpu=True) and ddplab.runs_here(one_gpu, gpu=True)
    two_cpu = types.SimpleNamespace(world_size=2, backend="gloo")
    assert ddplab.runs_here(two_cpu, ranks=2) and not ddplab.runs_here(two_cpu, gpu=True)


def test_make_test_gpu_refuses_gradients_left_on_the_cpu_of_an_nccl_rank(monkeypatch):
    import torch

    from ddplab.pg import backend
    from ddplab.sync import comm

    monkeypatch.setattr(backend, "backend_name", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="stayed on the CPU. Put them on ddplab.device"):
        comm._check_device(torch.ones(3), None, "grad")
    comm._check_device(torch.ones(3), None, "used_map")  # CPU bookkeeping stays allowed
    monkeypatch.setattr(backend, "backend_name", lambda group=None: "gloo")
    comm._check_device(torch.ones(3), None, "grad")  # gloo ranks reduce CPU gradients


@pytest.mark.slow
def test_strict_device_check_leaves_gloo_ranks_training():
    import ddplab

    def step():

        from ddplab.lessons import training
        from ddplab.sync import comm

        assert comm.REQUIRE_DEVICE_GRADS
        return max(training.single_process_gap_on_rank("bucketed", steps=2))

    with ddplab.Cluster(2, env={"DDPLAB_REQUIRE_DEVICE_GRADS": "1"}) as c:
        assert max(c.run(step)) < 1e-12


# -- a fake nvidia-smi on PATH: what the driver prints, in the formats NVIDIA documents --------
# --query-gpu / --query-compute-apps with --format=csv,noheader,nounits; -L as R470+ drivers
# print it (MIG devices indented under their GPU), and the older MIG-GPU-<uuid>/<gi>/<ci> form.
A100 = "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77"
H100 = "GPU-9f1c2e44-0a6b-4c1d-8e2f-3b4a5c6d7e8f"
QUERY_GPU = (f"0, {A100}, NVIDIA A100-SXM4-40GB, 40960, 87\n"
             f"1, {H100}, NVIDIA H100 80GB HBM3, 81559, 1203\n")
LISTING = (f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {A100})\n"
           "  MIG 3g.20gb     Device  0: (UUID: MIG-8e5d2b8c-7b1f-5b4b-9a0c-7c6d1e3e6f11)\n"
           "  MIG 2g.10gb     Device  1: (UUID: MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb)\n"
           f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {H100})\n")
LEGACY_LISTING = (f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {A100})\n"
                  f"  MIG 3g.20gb Device 0: (UUID: MIG-{A100}/1/0)\n")


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """Put an ``nvidia-smi`` that prints the given texts on PATH (an empty process list:
    what a container sees however many processes the host runs on its GPUs)."""
    def install(query_gpu=QUERY_GPU, apps="", listing=LISTING):
        for name, text in (("gpu", query_gpu), ("apps", apps), ("list", listing)):
            (tmp_path / name).write_text(text)
        smi = tmp_path / "bin" / "nvidia-smi"
        smi.parent.mkdir(exist_ok=True)
        smi.write_text("#!/bin/sh\n"
                       f'case "$1" in --query-gpu=*) cat {tmp_path}/gpu;; '
                       f"--query-compute-apps=*) cat {tmp_path}/apps;; -L) cat {tmp_path}/list;; "
                       "*) exit 2;; esac\n")
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{smi.parent}:" + __import__("os").environ["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("DDPLAB_GPU_LOCK_DIR", str(tmp_path / "locks"))
    return install


def test_in_a_container_an_empty_process_list_does_not_make_a_used_gpu_free(fake_smi):
    fake_smi(apps="")  # the host's processes are invisible from inside the container
    found = discover()
    assert [(g.index, g.pids, g.used_mib) for g in found] == [(0, (), 87), (1, (), 1203)]
    assert "judged by memory" in found[1].busy_reason()
    assert place(1, "auto", found=found).gpus == (0,)
    p = place(2, "auto", found=found)
    assert p.backend == "gloo" and "1 of 2 are free" in p.notes[0]


def test_listed_processes_still_name_the_user(fake_smi):
    fake_smi(apps=f"{H100}, 4242\n")
    assert discover()[1].pids == (4242,)
    assert "pid(s) 4242" in place(2, "auto").notes[0]


@pytest.mark.parametrize("listing, entry", [
    (LISTING, "MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb"),
    (LISTING, "MIG-cba663e8"),  # a prefix, as CUDA accepts
    (LEGACY_LISTING, f"MIG-{A100}/1/0"),  # drivers before R470
])
def test_a_mig_device_in_cuda_visible_devices_is_found(fake_smi, monkeypatch, listing, entry):
    fake_smi(listing=listing)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", entry)
    (mig,) = discover()
    assert mig.mig and mig.index == 0 and mig.uuid.startswith(entry)
    assert "MIG 3g.20gb" in mig.name or "MIG 2g.10gb" in mig.name
    assert (place(1, "auto", found=[mig]).backend, place(1, "auto", found=[mig]).gpus) == ("nccl", (0,))


def test_two_mig_devices_cannot_serve_two_ranks(fake_smi, monkeypatch):
    fake_smi()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-8e5d2b8c,MIG-cba663e8")
    found = discover()
    assert [g.mig for g in found] == [True, True]
    p = place(2, "auto", found=found)
    assert p.backend == "gloo" and "one MIG device per process" in p.notes[0]
    with pytest.raises(ValueError, match="MIG devices serve world size 1"):
        place(2, "nccl", found=found)


def test_a_reserved_gpu_is_not_given_to_the_next_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAB_GPU_LOCK_DIR", str(tmp_path))
    found = _server()
    first = place(2, "auto", found=found, reserve=True)
    second = place(2, "auto", found=found, reserve=True)
    assert (first.gpus, second.gpus) == ((0, 1), (2, 3))  # the same facts, disjoint GPUs
    third = place(1, "auto", found=found, reserve=True)
    assert third.backend == "gloo" and "reserved by another ddplab Cluster" in third.notes[0]
    first.reservation.release()
    again = place(2, "auto", found=found, reserve=True)
    assert again.gpus == (0, 1)
    for p in (second, again):
        p.reservation.release()
    assert place(2, "auto", found=found).gpus == (0, 1)  # without reserve, nothing is held


def test_a_lock_held_by_another_process_counts_and_dies_with_it(tmp_path, monkeypatch):
    import subprocess
    import sys

    from ddplab.placement import gpu_locks

    monkeypatch.setenv("DDPLAB_GPU_LOCK_DIR", str(tmp_path))
    found = _server()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, fcntl; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
         str(tmp_path / gpu_locks.key(found[0]))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        p = place(1, "auto", found=found, reserve=True)
        assert p.gpus == (1,)
        p.reservation.release()
    finally:
        holder.kill()
        holder.wait()
    p = place(1, "auto", found=found, reserve=True)  # a dead holder leaves no lock behind
    assert p.gpus == (0,)
    p.reservation.release()


def test_a_hub_gets_disjoint_free_gpus_for_its_learners():
    from ddplab.placement.gpus import assign

    found = _server((), (4242,), (), ()) + [GPU(4, "H100", "GPU-4", 81559, 3, ()),
                                             GPU(5, "H100", "GPU-5", 81559, 3, ())]
    sets = assign(found, [2, 1, 2])
    assert [[g.index for g in s] for s in sets] == [[0, 2], [3], [4, 5]]
    assert len({g.uuid for s in sets for g in s}) == 5  # nobody shares
    with pytest.raises(ValueError, match="need 6 GPU.*5 of 6 are free.*pid\\(s\\) 4242"):
        assign(found, [3, 3])
