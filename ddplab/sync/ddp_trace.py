"""Watching torch's own DistributedDataParallel from its process group: buckets and layout.

Teaches: torch DDP is not a black box. Its C++ reducer hands each bucket's
all-reduce to the process group, and on a ddplab rank that group is the
observing one (``ddplab.pg.group``). So DDP is drawn exactly as it
runs: no comm hook, nothing patched, its own C++ path (the default
all-reduce, divided before it is sent). ``DDPTracer`` is the
``ddplab.timeline.on_group.GroupRecorder`` for one DDP model, plus two facts
to see:

- with ``find_unused_parameters`` left False (the default), iteration 0 uses
  ONE bucket holding every parameter; before iteration 1 the reducer
  rebuilds its buckets in the order gradients became ready (with
  ``find_unused_parameters=True`` and no ``static_graph`` it never
  rebuilds). Those two iterations
  are flagged ("ddp_one_bucket", "ddp_rebuild"), drawn, labelled, and left
  out of averages;
- which parameters each bucket holds: the group sees a flat buffer, so the
  layout comes from DDP's logging data (``bucket_layout``).

Grad-ready times come from post-accumulate-grad hooks added next to DDP's own
(they observe, they do not reduce; torch runs them before the reducer's own
hook); the last of them marks the end of backward's compute, so the time DDP
spends waiting for its buckets at the end of backward shows up as the "wait"
phase.

The observer sees every all-reduce on the group while it is installed, so
install it only around this model's steps (``with tracer.watching():``).
Recording costs DDP a Python hook per parameter, so ``compare`` times a copy
with no recorder (it only counts) and draws a recorded one.

Leaves out: torch's built-in hooks (fp16/bf16 compression, PowerSGD; see
torch.distributed.algorithms.ddp_comm_hooks).
References: torch/nn/parallel/distributed.py (_get_ddp_logging_data);
torch/csrc/distributed/c10d/reducer.cpp (mark_bucket_ready, rebuild_buckets).
"""
from __future__ import annotations

from ddplab.timeline.on_group import GroupRecorder


class DDPTracer(GroupRecorder):
    """Attach to a ``torch.nn.parallel.DistributedDataParallel`` model before its first step.

    ``recorder`` (None: count bytes and buckets only) gets the same events as
    ddplab's own strategies, so torch DDP's timeline is drawn with the same code.
    """

    def __init__(self, ddp_model, recorder=None, process_group=None):
        self.ddp = ddp_model
        self.group = process_group
        super().__init__(recorder, ddp_model.module.parameters())

    def watching(self, group=None):
        return super().watching(group if group is not None else self.group)

    def iteration_flags(self) -> dict:
        """Iteration -> flags for the early iterations whose layout differs from the last."""
        flags: dict[int, set] = {}
        seen = self.launches
        if not seen:
            return flags
        for i, sizes in enumerate(seen):
            if i == 0 and sizes != seen[-1]:
                flags.setdefault(i, set()).add("ddp_one_bucket")
            elif i > 0 and sizes != seen[i - 1]:
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
