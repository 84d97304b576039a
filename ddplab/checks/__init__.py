"""Graders for the exercises: your synchronization code, on live ranks, against torch DDP.

In the exercise notebooks (labs/exercises/) you write the synchronization
yourself with plain ``torch.distributed``, then run a check:

- ``check_average_gradients(cluster, fn)``: ``fn(model)`` after backward;
- ``check_overlap_ddp(cluster, cls)``: a wrapper launching one async
  all-reduce per gradient from its hook;
- ``check_bucketed_ddp(cluster, cls)``: the same with buckets, in index order;
- ``check_no_sync(cluster, fn)``: one optimizer step accumulating micro-batches
  with torch DDP's ``no_sync``;
- ``run_exercise(cluster, fn)`` / ``attempt(fn, ...)``: run a smaller exercise
  (checked by plain asserts) so that an untouched stub says "not implemented
  yet".

Each trains a small float64 net (a tied and a frozen parameter, a different
start and different data on every rank) for a few steps on the Cluster's
ranks, next to one process and torch DDP (``workload``), watching what
your code sends and when (``watch``) without reading its source or timing
it. A pass prints a summary and draws your timeline beside torch DDP's; a
failure raises ``CheckFailed`` (an AssertionError) whose ``.mistake`` names
the likely mistake (``mistakes``).

Leaves out, compared with a full DDP test suite: buffers, uneven batches,
unused parameters, GPUs (the graders run the same on NCCL ranks in
principle, but are tested on gloo only).
References: Stanford CS336 assignment 2 (DDP tests against a single
process, tied and frozen parameters); torch/testing/_internal/distributed.
"""
from ddplab.checks.graders import (
                      CheckResult,
                      attempt,
                      check_average_gradients,
                      check_bucketed_ddp,
                      check_no_sync,
                      check_overlap_ddp,
                      passed,
                      run_exercise,
                      yours_or_ours,
)
from ddplab.checks.mistakes import CheckFailed
from ddplab.checks.workload import loss_fn

__all__ = ["check_average_gradients", "check_overlap_ddp", "check_bucketed_ddp", "check_no_sync",
           "CheckFailed", "CheckResult", "passed", "yours_or_ours", "loss_fn", "attempt",
           "run_exercise"]

# lab 00: a send/recv pair (the warm-up), then the ring all-reduce
from ddplab.checks.firstgroup import check_pass_right  # noqa: E402
from ddplab.checks.ring import check_ring_all_reduce  # noqa: E402

__all__ += ["check_pass_right", "check_ring_all_reduce"]

# lab 05: data and checkpoints
from ddplab.checks.data import check_batch_stats, check_sampler_indices  # noqa: E402

__all__ += ["check_sampler_indices", "check_batch_stats"]

# lab 07: a comm hook on torch DDP (its own module: it grades a different kind of code)
from ddplab.checks.compression import check_comm_hook  # noqa: E402

__all__ += ["check_comm_hook"]

# labs 06 and 08: a loop that agrees on its step count; send/recv between pipeline stages
from ddplab.checks.hangs import check_agreed_steps  # noqa: E402
from ddplab.checks.pipeline import check_pipeline_step  # noqa: E402

__all__ += ["check_pipeline_step", "check_agreed_steps"]

# lab 09: predict torch DDP's buckets, checked against the live reducer
from ddplab.checks.reducer_map import check_bucket_assignment  # noqa: E402

__all__ += ["check_bucket_assignment"]

from ddplab.checks.yourmodel import check_exposed  # noqa: E402

__all__ += ["check_exposed"]

# lab 12: FSDP itself, a unit's four hooks (gather, free, gather again, reduce-scatter)
from ddplab.checks.fsdp import check_fsdp_hooks  # noqa: E402

__all__ += ["check_fsdp_hooks"]
