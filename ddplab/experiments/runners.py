"""One training step per strategy, recorded: the rank side of ``compare``.

Teaches: the strategies differ ONLY in how gradients become averaged; the
step around them is the same, so it is written once here:

    forward -> loss -> zero_grad -> backward -> [sync] -> optimizer.step()

- ``none``: no synchronization at all (the compute-only baseline);
- ``manual`` / ``manual_flat``: ``average_gradients`` after backward
  (per parameter / one flat buffer): nothing overlaps;
- ``overlap``: ``OverlapDDP``, one async all-reduce per parameter from its hook;
- ``bucketed``: ``BucketedDDP``, hook-driven buckets launched in index order;
- ``ddp``: torch's DistributedDataParallel, untraced (its step time is the
  reference), and ``ddp_traced``: the same with a recording comm hook (drawn).

A straggler is made by SLEEPING on one rank during forward (``factor`` times
its usual compute), not by burning a core that the other rank needs.

Leaves out: data loading, mixed precision, learning-rate schedules.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from ..sync import comm
from ..timeline.clock import now
from ..timeline.recorder import Recorder
from . import models

STRATEGIES = ("none", "manual", "manual_flat", "overlap", "bucketed", "ddp")


class StrategyRunner:
    def __init__(self, name: str, cfg: dict, rank: int, world_size: int, backend: str):
        self.name, self.cfg, self.rank = name, cfg, rank
        # NCCL: each rank owns the GPU the Cluster selected for it (torch.cuda.set_device).
        self.device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                       else torch.device("cpu"))
        base = models.build(cfg["model"], seed=cfg["seed"], **cfg.get("model_kwargs", {}))
        base = base.to(self.device)
        # Phases are always stamped; bucket events only when recording is on.
        # torch DDP ("ddp") is never traced: its step time is the reference.
        self.recorder = Recorder(name, rank, world_size, backend)
        if backend == "nccl":
            # CPU stamps would be when the host queued NCCL work, not when it ran.
            from ..timeline.cuda_events import CudaStamps

            self.recorder.cuda_stamps = CudaStamps(self.device)
        rec = self.recorder if cfg.get("record", True) else None
        self.tracer = None
        self.sync_after_backward = None
        if name in ("none", "manual", "manual_flat"):
            self.model = base
            if name != "none":
                from ..sync import average_gradients

                flat = name == "manual_flat"
                self.sync_after_backward = lambda: average_gradients(base, flat=flat, recorder=rec)
        elif name == "overlap":
            from ..sync import OverlapDDP

            self.model = OverlapDDP(base, recorder=rec)
        elif name == "bucketed":
            from ..sync import BucketedDDP

            self.model = BucketedDDP(base, bucket_cap_mb=cfg["bucket_cap_mb"], recorder=rec)
        elif name in ("ddp", "ddp_traced"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DDP(base, bucket_cap_mb=cfg["bucket_cap_mb"], device_ids=ids)
            if name == "ddp" and cfg.get("link"):
                # The simulated link lives in ddplab.sync.comm: without this hook
                # torch DDP's all-reduces would never meet it (a faster network).
                from ..sync.ddp_trace import choke_point_hook

                self.model.register_comm_hook(None, choke_point_hook)
            if name == "ddp_traced":
                from ..sync.ddp_trace import DDPTracer

                self.tracer = DDPTracer(self.model, rec)
        else:
            raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg["lr"])
        self.compute_s: list[float] = []
        self.comm_bytes = 0

    def _straggle(self) -> float:
        s = self.cfg.get("straggler")
        if not s or s[0] != self.rank or not self.compute_s:
            return 0.0
        pause = (s[1] - 1.0) * statistics.median(self.compute_s[-5:])
        time.sleep(max(0.0, pause))
        return pause

    def step(self, i: int) -> None:
        cfg, rec = self.cfg, self.recorder
        x, y = models.batch(cfg["model"], cfg["batch_size"], self.rank, i)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        flags = {"warmup"} if i < cfg["warmup"] else set()
        rec.begin_iteration(i, flags)
        with comm.counting() as counted:
            t0 = now()
            with rec.phase("forward"):
                slept = self._straggle()
                loss = F.cross_entropy(self.model(x), y)
            self.opt.zero_grad(set_to_none=True)
            with rec.phase("backward"):
                loss.backward()
            if self.sync_after_backward is not None:
                self.sync_after_backward()
            if self.tracer is not None:
                self._split_ddp_backward()
            compute_end = rec._it.phases["backward"][1]
            self.compute_s.append(compute_end - t0 - slept)
            with rec.phase("step"):
                self.opt.step()
        self.comm_bytes = counted.grad_bytes
        rec.end_iteration()

    def _split_ddp_backward(self) -> None:
        # DDP waits for its buckets inside backward; the last grad-ready marks
        # where backward's compute ended and the wait began.
        info = self.tracer.end_iteration()
        it = self.recorder._it
        b0, b1 = it.phases["backward"]
        end = info["backward_compute_end"]
        if end is not None and b0 <= end <= b1:
            it.phases["backward"] = (b0, end)
            it.phases["wait"] = (end, b1)
            it.sources["wait"] = "derived"

    def finish(self) -> dict:
        tl = self.recorder.result()
        if self.tracer is not None:
            for it in tl.iterations:
                it.flags |= self.tracer.iteration_flags().get(it.iteration, set())
            tl.meta["bucket_layout"] = self.tracer.bucket_layout()
        elif hasattr(self.model, "bucket_layout"):
            tl.meta["bucket_layout"] = self.model.bucket_layout
        flat = torch.cat([p.detach().reshape(-1).double() for p in self.model.parameters()])
        return {"timeline": tl.to_dict(), "checksum": float(flat.sum()),
                "params": flat[: 4096].clone(), "comm_bytes_per_step": self.comm_bytes}
