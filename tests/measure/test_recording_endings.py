"""Every way a user's recorded run can end, as a user runs it: tests/_your_script.py (an
Embedding, Linear and GELU model under torch DDP at bucket_cap_mb=0.25, AdamW) under
``torchrun --standalone --nproc-per-node=2`` with ``rec = ddplab.record(ddp, steps=range(2, 8),
out=...)`` and nothing else. Each ending either writes the three files or says on rank 0,
once, what happened and what to call; none hangs."""
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.more]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = (".json", ".trace.json", ".html")


def torchrun(out, *options, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", os.path.join(ROOT, "tests", "_your_script.py"),
                           str(out), *options], env=env, capture_output=True, text=True,
                          timeout=timeout)
    return done, time.monotonic() - t0


def said(done) -> list:
    return [line for line in done.stderr.splitlines() if line.startswith("ddplab.record:")]


def recorded_steps(out) -> dict:
    from ddplab.measure.recording import load_run

    tl = load_run(out.with_suffix(".json"))
    return {r: sorted(it.iteration for it in tl.iterations if it.rank == r) for r in (0, 1)}


def test_a_loop_that_runs_to_the_last_step_asked_for_writes_the_files_by_itself(tmp_path):
    out = tmp_path / "myrun"
    done, _ = torchrun(out, "--steps", "8")  # range(2, 8) and 8 steps: no step after the last
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(out.with_suffix(s).is_file() for s in FILES)
    assert recorded_steps(out) == {0: list(range(2, 8)), 1: list(range(2, 8))}
    assert said(done) == []


def test_a_loop_that_ends_later_stops_recording_at_the_last_step_asked_for(tmp_path):
    out = tmp_path / "myrun"
    done, _ = torchrun(out, "--steps", "11")
    assert done.returncode == 0, done.stderr[-3000:]
    assert recorded_steps(out) == {0: list(range(2, 8)), 1: list(range(2, 8))}
    assert said(done) == []


def test_a_loop_that_ends_sooner_says_on_rank_0_what_was_recorded_and_what_to_call(tmp_path):
    out = tmp_path / "myrun"
    # the group left alive at exit (gloo may then abort at teardown: the exit code is not asserted)
    done, _ = torchrun(out, "--steps", "5", "--no-destroy")
    assert not any(out.with_suffix(s).exists() for s in FILES)
    lines = said(done)
    assert len(lines) == 1, done.stderr[-3000:]  # rank 0 only
    assert lines[0].startswith(f"ddplab.record: nothing was written to {out}.json: steps 2-4 of "
                               "steps=range(2, 8) were recorded, but the run ended before the end "
                               "of step 7, the last one asked for. To write it, call rec.finish() "
                               "on every rank after your loop, or ask for steps=range(2, 5).")
    # ... and doing what it says writes the files, with the steps that ran
    done, _ = torchrun(out, "--steps", "5", "--finish")
    assert done.returncode == 0 and said(done) == [], done.stderr[-3000:]
    assert recorded_steps(out) == {0: [2, 3, 4], 1: [2, 3, 4]}


def test_a_group_destroyed_before_finish_is_said_at_exit_and_by_finish(tmp_path):
    out = tmp_path / "myrun"
    done, _ = torchrun(out, "--steps", "5")  # the loop ends sooner, then destroy_process_group()
    assert done.returncode == 0, done.stderr[-3000:]
    lines = said(done)
    assert len(lines) == 1 and "steps 2-4 of steps=range(2, 8) were recorded" in lines[0]
    assert ("call rec.finish() on every rank after your loop and BEFORE "
            "dist.destroy_process_group() (the group was destroyed first)") in lines[0]
    done, _ = torchrun(out, "--steps", "5", "--destroy-first")  # destroy, then rec.finish()
    assert done.returncode != 0
    assert "the process group was destroyed before finish()" in done.stderr
    assert "call rec.finish() on every rank BEFORE dist.destroy_process_group()" in done.stderr
    assert not out.with_suffix(".json").exists()


def test_a_rank_raising_mid_run_ends_the_run_without_a_hang(tmp_path):
    out = tmp_path / "myrun"
    done, took = torchrun(out, "--steps", "8", "--raise-at", "1:4:forward")
    assert done.returncode != 0
    assert "a planted error on rank 1 at step 4" in done.stderr + done.stdout
    assert took < 600, took  # not the group's 30-minute timeout (torchrun start-up is slow under load)
    assert not out.with_suffix(".json").exists()


def test_a_rank_raising_while_the_others_finish_does_not_leave_them_waiting(tmp_path):
    # rank 1 raises after step 7's backward, before its optimizer step: rank 0 has stepped
    # and is in finish(), whose barrier rank 1 never reaches
    out = tmp_path / "myrun"
    done, took = torchrun(out, "--steps", "8", "--raise-at", "1:7:after_backward")
    assert done.returncode != 0
    assert "a planted error on rank 1 at step 7" in done.stderr + done.stdout
    assert took < 600, took
    assert not out.with_suffix(".json").exists()


def test_finish_on_one_rank_only_raises_in_words_instead_of_waiting(tmp_path):
    out = tmp_path / "myrun"
    done, took = torchrun(out, "--steps", "5", "--finish-on", "0", "--no-destroy")
    assert done.returncode != 0
    assert "ddplab.record: finish() on rank 0 could not gather the run" in done.stderr
    assert "Every rank must reach finish() within 2 s" in done.stderr
    assert took < 600, took  # the group's own timeout is 1800 s
