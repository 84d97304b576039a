"""Your run's buckets as torch laid them out, when the recorder could not see them launch.

Teaches: torch DDP keeps its bucket layout in its logging data
(``_get_ddp_logging_data()``: the sizes and, once rebuilt, which parameters each bucket
holds). ``ddplab.record`` times each bucket through its own comm hook; when a hook was
there before it (yours, or ``mixed_precision=``'s), that layout and the gradients' ready
times still give each bucket's ready times, and its communication is marked not measured.

Leaves out: steps before torch rebuilt its buckets (only the rebuilt layout's members
are read here).
References: torch/nn/parallel/distributed.py (_get_ddp_logging_data).
"""
from __future__ import annotations

NOT_MEASURED = ("a built-in comm hook (register_builtin_comm_hook) or mixed_precision='s was in place "
                "before ddplab.record(): the recorder cannot call it from Python, so per-bucket "
                "communication is not measured (a Python hook, e.g. default_hooks.fp16_compress_hook, "
                "is measured, registered before or after the call)")


def logged_buckets(ddp_model) -> list[int]:
    """torch's own bucket sizes in bytes, from its logging data: the rebuilt layout once
    the reducer has rebuilt its buckets, else the layout it was built with."""
    data = ddp_model._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") if data.get("has_rebuilt_buckets") else None
    sizes = sizes or data.get("bucket_sizes") or ""
    return [int(s) for s in str(sizes).replace(",", " ").split()]


def buckets_from_logging(rec, part) -> None:
    """Without our hook: the buckets from torch's layout, ready when their last gradient was
    (each with its gradients' source: ``cuda_event`` on NCCL, else ``cpu``)."""
    spec = rec.ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices") or ""
    layout = [[int(i) for i in chunk.split()] for chunk in spec.split(",") if chunk.strip()]
    from ddplab.timeline.records import BucketRecord

    for it in part.iterations:
        if "no_sync" in it.flags:
            continue
        grads = [g for g in rec.grads if g.iteration == it.iteration]
        ready = {g.param: g.ready for g in grads}
        source = grads[0].source if grads else "cpu"
        for index, members in enumerate(layout):
            times = [ready[i] for i in members if i in ready]
            part.buckets.append(BucketRecord(
                rec.rank, it.iteration, index,
                sum(rec.params[i].numel() * rec.params[i].element_size() for i in members),
                tuple(rec.names[i] for i in members), min(times, default=None),
                max(times, default=None), sources={"grads_ready": source}))
