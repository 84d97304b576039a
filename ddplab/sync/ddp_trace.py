"""Watching torch's own DistributedDataParallel: a comm hook that records, and its bucket layout.

Teaches: torch DDP is not a black box. ``register_comm_hook(state, hook)``
lets us take over each bucket's all-reduce: the hook gets a ``GradBucket``
(``index()``, ``buffer()``, ``parameters()``, ``is_last()``) when the reducer
launches it, and returns a future holding the reduced buffer. Two facts to see:

- with a comm hook, DDP no longer divides by world size while copying into
  the bucket; the hook must divide itself (this one does, in the future's
  callback);
- with ``find_unused_parameters`` left False (the default), iteration 0 uses
  ONE bucket holding every parameter; before iteration 1 the reducer
  rebuilds its buckets in the order gradients became ready (with
  ``find_unused_parameters=True`` it never rebuilds). Those two iterations
  are flagged ("ddp_one_bucket", "ddp_rebuild"), drawn, labelled, and left
  out of averages.

Grad-ready times come from post-accumulate-grad hooks added next to DDP's own
(they observe, they do not reduce); the last of them marks the end of
backward's compute, so the time DDP spends waiting for its buckets at the end
of backward shows up as the "wait" phase.

Tracing has a cost (a Python hook per bucket instead of C++), so
``compare`` times an untraced DDP and draws this traced one. Under a
simulated link the untimed-by-hooks copy cannot stay hook-free: its
all-reduces would never meet the link, which lives in ``ddplab.sync.comm``.
There ``choke_point_hook`` sends each bucket through the choke point (no
recorder, nothing else), and the row is labelled so.

Leaves out: torch's built-in hooks (fp16/bf16 compression, PowerSGD; see
torch.distributed.algorithms.ddp_comm_hooks), which this file imitates only
for the plain all-reduce.
References: torch/nn/parallel/distributed.py (register_comm_hook,
_get_ddp_logging_data); torch/csrc/distributed/c10d/reducer.cpp.
"""
from __future__ import annotations

from ddplab.sync import comm


def choke_point_hook(process_group, bucket):
    """torch DDP's own bucket all-reduce, sent through ``ddplab.sync.comm``.

    Divide, then SUM-all-reduce (what DDP does without a hook), but through
    the choke point, so that a simulated link delays torch DDP exactly as it
    delays ddplab's strategies. Register with
    ``ddp_model.register_comm_hook(process_group_or_None, choke_point_hook)``.
    """
    import torch.distributed as dist

    tensor = bucket.buffer().div_(dist.get_world_size(process_group))
    work = comm.all_reduce(tensor, process_group, async_op=True, bucket=bucket.index())
    return work.get_future().then(lambda fut: fut.value()[0])


class DDPTracer:
    """Attach to a ``torch.nn.parallel.DistributedDataParallel`` model before its first step.

    ``recorder`` gets the same events as ddplab's own strategies, through the
    same choke point, so torch DDP's timeline is drawn with the same code.
    """

    def __init__(self, ddp_model, recorder=None, process_group=None):
        import torch.distributed as dist

        self.ddp = ddp_model
        self.recorder = recorder
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        named = [(n, p) for n, p in ddp_model.module.named_parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in named}
        self.ready: dict[int, float] = {}
        self.buckets_seen: list[list[int]] = []  # per iteration: bucket sizes in elements
        self._current: list[int] = []
        for _, p in named:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        ddp_model.register_comm_hook(self, DDPTracer._hook)

    def _grad_ready(self, param) -> None:
        self.ready[id(param)] = comm.now()
        timer = getattr(self.recorder, "device_timer", None)
        if timer is not None:  # the same moment on the GPU's clock, for GPU-timed phases
            self._ready_event = timer.phase_event()

    @staticmethod
    def _hook(state: "DDPTracer", bucket):
        params = bucket.parameters()
        ready = [state.ready.get(id(p)) for p in params]
        ready = [t for t in ready if t is not None]
        if ready and state.recorder is not None:
            # the bucket became ready when its last gradient did, not when the hook ran
            state.recorder.record("grad_ready", max(ready), bucket=bucket.index(),
                                  param=state.names.get(id(params[-1]), "?"))
        state._current.append(bucket.buffer().numel())
        work = comm.all_reduce(bucket.buffer(), state.group, async_op=True, bucket=bucket.index(),
                               params=[state.names.get(id(p), "?") for p in params],
                               recorder=state.recorder)
        world = state.world_size

        def divide(fut):
            # DDP skips its own division when a hook is registered.
            return fut.value()[0].div_(world)

        return work.get_future().then(divide)

    def end_iteration(self) -> dict:
        """Call after backward: returns {"backward_compute_end": t, "n_buckets": n} (and,
        with a device timer, "backward_compute_end_event": the same moment as a GPU event)."""
        last = max(self.ready.values()) if self.ready else None
        event, self._ready_event = getattr(self, "_ready_event", None), None
        self.ready = {}
        self.buckets_seen.append(self._current)
        self._current = []
        return {"backward_compute_end": last, "n_buckets": len(self.buckets_seen[-1]),
                "backward_compute_end_event": event}

    def iteration_flags(self) -> dict:
        """Iteration -> flags for the early iterations whose layout differs from the last."""
        flags: dict[int, set] = {}
        if not self.buckets_seen:
            return flags
        final = self.buckets_seen[-1]
        for i, sizes in enumerate(self.buckets_seen):
            if i == 0 and sizes != final:
                flags.setdefault(i, set()).add("ddp_one_bucket")
            elif i > 0 and sizes != self.buckets_seen[i - 1]:
                flags.setdefault(i, set()).add("ddp_rebuild")
        return flags

    def bucket_layout(self) -> list[dict]:
        """Buckets after the rebuild, from DDP's logging data: index, params, nbytes."""
        data = self.ddp._get_ddp_logging_data()
        spec = data.get("rebuilt_per_bucket_param_indices")
        if not spec:
            return []
        named = [(n, p) for n, p in self.ddp.module.named_parameters() if p.requires_grad]
        layout = []
        for index, chunk in enumerate(spec.split(",")):
            members = [named[int(i)] for i in chunk.split()]
            layout.append({"index": index, "params": [n for n, _ in members],
                           "nbytes": sum(p.numel() * p.element_size() for _, p in members)})
        return layout
