"""ddplab.record from the trainer you already use, as docs/recording.md's recipes give it: a plain
torch loop, Lightning, accelerate and the Hugging Face Trainer, each under torchrun on 2 gloo ranks
(tests/_trainer_script.py). Each writes its three files, its last step's buckets equal torch's own
logging data, every all-reduce is timed (accelerate's comm hook, registered in prepare(), too),
steps are optimizer steps (accumulation micro-steps inside their step, validation forwards left
out), and torch's one-bucket step before its rebuild never reaches a what-if."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINERS = {"torch": None, "lightning": "lightning", "accelerate": "accelerate", "hf": "transformers"}
NAMES = {"torch": "torch DDP", "lightning": "Lightning", "accelerate": "accelerate", "hf": "Hugging Face Trainer"}
ACCUMULATES = {"torch": 2, "lightning": 2, "accelerate": 2, "hf": 2}  # micro-steps per optimizer step
VALIDATES = {"torch", "lightning"}  # forwards under no_grad during the recorded steps


@pytest.mark.slow
@pytest.mark.more  # a torchrun of its own per trainer
@pytest.mark.timeout(300)
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_each_recipe_records_optimizer_steps_whose_buckets_equal_torchs(trainer, tmp_path):
    from ddplab.measure.recording import load_run
    from ddplab.timeline.metrics import summarize

    if TRAINERS[trainer] and importlib.util.find_spec(TRAINERS[trainer]) is None:
        pytest.skip(f"{TRAINERS[trainer]} is not installed (pip install -c constraints.txt -e '.[trainers]')")
    out = tmp_path / trainer
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           os.path.join(ROOT, "tests", "_trainer_script.py"), trainer, str(out)],
                          env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    for suffix in (".json", ".trace.json", ".html"):
        assert out.with_suffix(suffix).is_file(), suffix
    tl = load_run(out.with_suffix(".json"))
    assert (tl.meta["run_name"], tl.meta["trainer"]) == (trainer, NAMES[trainer])
    logged = tl.meta["logged_bucket_sizes"]
    assert len(logged) == 2  # CAP_MB's two buckets, as torch rebuilt them
    for rank in (0, 1):
        assert sorted(it.iteration for it in tl.iterations if it.rank == rank) == [1, 2, 3, 4]
        assert [b.nbytes for b in tl.buckets_of(rank, 4)] == logged
    assert not any(it.flags for it in tl.iterations)  # steps 1-4: after torch's rebuild
    assert tl.meta["micro_steps"] == {str(i): ACCUMULATES[trainer] for i in range(1, 5)}
    assert all(("no_sync" in it.phases) == (ACCUMULATES[trainer] > 1) for it in tl.iterations)
    for it in tl.iterations:  # an optimizer step comes after its backward (Lightning's closure runs both)
        if "step" in it.phases:
            assert it.phases["step"][0] >= it.phases["backward"][1], (trainer, it.iteration, it.phases)
    evals = tl.meta["forwards_without_backward"]
    assert bool(evals) == (trainer in VALIDATES)
    for step, start, end in evals:  # a validation forward lies outside every recorded step
        it = tl.iteration(0, step)
        assert it is None or not (it.start <= start and end <= it.end), (step, start, end)
    for b in tl.buckets:  # every bucket's all-reduce measured: ready, launched, done
        assert b.grads_ready <= b.launch <= b.comm_end, b
    assert "comm_not_measured" not in tl.meta
    if trainer == "accelerate":  # the hook prepare() registered before record() was taken out and timed
        assert tl.meta["comm_hook"] == tl.meta["ddp_logging_data"]["comm_hook"] == "fp16_compress_hook"
    summary = summarize(tl)
    assert summary["n_buckets"] == len(logged) and summary["iterations_counted"] == 4


def record_from_step_0(steps):
    """On every rank: a 2-bucket DDP model recorded from its very first step."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddplab

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = DDP(model, bucket_cap_mb=0.1)
    rec = ddplab.record(ddp, steps=steps)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(steps.stop):
        ddp(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {"timeline": None if rec.timeline is None else rec.timeline.to_dict()}


@pytest.mark.slow
def test_the_one_bucket_step_before_torchs_rebuild_is_flagged_and_never_replayed(cluster2):
    from ddplab.measure import whatif
    from ddplab.timeline import Timeline

    r0 = cluster2.run(record_from_step_0, range(0, 3))[0]
    tl = Timeline.from_dict(r0["timeline"])
    assert len(tl.meta["logged_bucket_sizes"]) == 2  # torch's layout while it was recorded
    assert tl.iteration(0, 0).flags == {"ddp_one_bucket"}
    assert len(tl.buckets_of(0, 0)) == 1  # torch's layout before the rebuild
    assert all(not tl.iteration(r, i).flags for r in (0, 1) for i in (1, 2))
    predicted = whatif.predict(tl, bucket_cap_mb="recorded", link="nvlink")
    assert {len(predicted.buckets_of(r, i)) for r in (0, 1) for i in predicted.iteration_numbers()} == {2}
    only_warmup = Timeline.from_dict(cluster2.run(record_from_step_0, range(0, 1))[0]["timeline"])
    with pytest.raises(ValueError, match="no step with gradients and communication"):
        whatif.predict(only_warmup, bucket_cap_mb="recorded", link="nvlink")


def test_anything_that_is_not_a_ddp_model_gets_one_sentence_naming_what_to_pass():
    import torch

    from ddplab.integrations import find_wrapper

    for wrong in (torch.nn.Linear(2, 2), object()):
        with pytest.raises(TypeError, match="DistributedDataParallel object that wraps your model") as e:
            find_wrapper(wrong)
        assert "\n" not in str(e.value)


@pytest.mark.more  # needs the trainers extra (make test-unit-more installs it)
def test_a_lightning_module_before_fit_says_to_pass_the_trainer_which_waits_for_fit():
    pl = pytest.importorskip("lightning.pytorch")
    from ddplab.integrations import find_wrapper

    with pytest.raises(TypeError, match="not attached to a Trainer yet: pass the Trainer"):
        find_wrapper(pl.LightningModule())
    assert find_wrapper(pl.Trainer(accelerator="cpu", devices=1, logger=False)) is None  # waits for fit


def test_saved_runs_are_labelled_by_their_name_and_trainer_and_alike_ones_by_their_folder(tmp_path):
    import json

    from ddplab.cli.view import load_runs
    from ddplab.timeline import Timeline

    paths = []
    for folder, trainer in (("before", "Lightning"), ("after", "Lightning"), ("hf", "Hugging Face Trainer")):
        (tmp_path / folder).mkdir()
        tl = Timeline("ddp", 2, meta={"run_name": "run", "trainer": trainer})
        paths.append(tmp_path / folder / "run.json")
        paths[-1].write_text(json.dumps(tl.to_dict()))
    assert list(load_runs(paths)) == ["before/run (Lightning)", "after/run (Lightning)", "run (Hugging Face Trainer)"]

