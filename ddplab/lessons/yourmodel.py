"""Lab 10's rank program: your model under torch DDP, recorded with ``ddplab.record``.

Teaches: the loop is the one you would write (DDP, a loss, SGD); one added call records it.
``record_on_rank`` trains ``steps`` iterations at a given ``bucket_cap_mb`` and returns rank 0's
recording (a ``Timeline`` as a dict): per-bucket ready/launch/done and per-parameter ready times.
The lab reads which bucket is exposed from it, asks the what-if
(``ddplab.measure.whatif``) which cap to use, then records again at that cap to check.

The model, batch and loss are yours: three functions defined in a cell (they travel to the
ranks by value) or the built-in ``"transformer"`` (``ddplab.measure.transformer``).

Leaves out: GPU placement beyond ``ddplab.device()`` and the optimizer (plain SGD: what it
costs does not change which bucket is exposed).
References: ddplab/measure/recording.py; torch.nn.parallel.DistributedDataParallel.
"""
from __future__ import annotations


def record_on_rank(model="transformer", batch=None, loss=None, bucket_cap_mb=None, steps=8,
                   batch_size=8, seed=0):
    """On every rank: DDP(model) at ``bucket_cap_mb`` (None: torch's default), ``steps``
    iterations, iterations 2.. recorded (0 is torch's one-bucket iteration, 1 its first after
    the rebuild). Returns the recording as a dict on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.measure import models
    from ddplab.measure.recording import record
    from ddplab.pg.backend import device

    if steps < 4:
        raise ValueError(f"steps={steps}: record at least 4 (iteration 0 is torch's one-bucket "
                         "iteration; 2.. are recorded)")
    rank, dev = dist.get_rank(), device()
    torch.manual_seed(seed)
    net = (models.build(model, seed=seed) if isinstance(model, str) else model()).to(dev)
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None, **kwargs)
    rec = record(ddp, steps=range(2, steps))  # no page: the lab draws it
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(steps):  # the recording finishes by itself after the last step's opt.step()
        if batch is None:
            x, y = models.batch(model if isinstance(model, str) else "mlp", batch_size, rank, step)
        else:
            x, y = batch(batch_size, rank, step)
        x, y = x.to(dev), y.to(dev)
        out = ddp(x)
        if loss is not None:
            value = loss(out, y)
        else:
            value = torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())
        value.backward()
        opt.step()
        opt.zero_grad()
    return None if rec.timeline is None else rec.timeline.to_dict()


def measured_step_ms(timeline) -> float:
    """The median step time of a recording, in ms, over every rank's recorded iterations."""
    from ddplab.timeline.metrics import summarize

    return summarize(timeline)["step_ms"]


def link_of_this_machine(cluster):
    """This machine's all-reduce, measured: blocking all-reduces of 4 KiB to 8 MiB timed on the
    ranks (median of 7 each) and a line fitted through them, as a LinkModel for the what-if.

    The lab's fallback when the recording cannot teach the link: its buckets are all about one
    size (a cap of 1 MB gives ~1 MB buckets), so on a busy machine the fitted bandwidth can come
    out negative, and the what-if refuses it rather than predict from it."""
    from ddplab.netsim.costmodel import fit, measure_allreduce

    times = cluster.run(measure_allreduce)[0]
    line = fit(list(times), list(times.values()), cluster.world_size)
    if line.per_byte_s <= 0:  # 4 KiB against 8 MiB: only a broken machine gets here
        raise RuntimeError(f"all-reduce times did not grow from 4 KiB to 8 MiB: {times}")
    return line.as_link()
