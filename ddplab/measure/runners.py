"""One training step per strategy, recorded: the rank side of ``compare``.

Teaches: the strategies differ ONLY in how gradients become averaged; the
step around them is the same, so it is written once here:

    forward -> loss -> zero_grad -> backward -> [sync] -> optimizer.step()

Each strategy comes from ``ddplab.sync.registry`` (the one registry): what
``build_strategy`` returns says whether the sync happens inside backward
(a wrapper's hooks) or after it (``after_backward``). Two ways to be drawn:

- ddplab's own strategies take a ``recorder`` and stamp their buckets
  themselves, through ``ddplab.sync.comm`` ("comm_path": ``ddplab.sync.comm``);
- everything else, torch DDP, the reference reducers (``core_*``) and your
  code (``ddplab.as_strategy``), is drawn from outside: a
  ``GroupRecorder`` watches the observing process group during its steps
  ("comm_path": ``observing process group``), timed with its gradient-ready
  hooks on, as ddplab's own are timed with their stamps on. torch DDP alone
  is timed on a copy that only counts (recording costs its C++ path a Python
  hook per parameter) and drawn from a second, recorded copy, ``ddp_traced``.

A simulated link sits on the process group itself, so every row pays it.

A straggler is made by SLEEPING on one rank during forward (``factor`` times
its usual compute), not by burning a core that the other rank needs.

The model, its batches and its loss come from ``ddplab.measure.workload``:
a built-in model or the user's own functions.

Leaves out: data loading, mixed precision, learning-rate schedules.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from ddplab.measure import workload
from ddplab.pg.group import observing_group
from ddplab.sync import comm
from ddplab.timeline.on_group import GroupRecorder
from ddplab.timeline.recorder import Recorder

TRACED_SUFFIX = "_traced"  # the drawn copy of a strategy timed without recording
# where a row's all-reduces were counted and stamped
COMM_PATHS = {False: "ddplab.sync.comm", True: "observing process group"}


class StrategyRunner:
    """One strategy on this rank: ``step(i)`` trains and stamps one iteration.

    ``strategy``: a ``ddplab.sync.registry.Strategy`` (or a registered name);
    ``spec``: the run's ``RunSpec``; ``traced``: build the recorded copy of a
    strategy that is timed unrecorded (its name gets ``_traced``).
    """

    def __init__(self, strategy, spec, rank: int, world_size: int, backend: str, traced=False):
        from ddplab.sync.registry import get_strategy

        strategy = get_strategy(strategy)
        self.name = strategy.name + (TRACED_SUFFIX if traced else "")
        self.spec, self.rank = spec, rank
        # NCCL: each rank owns the GPU the Cluster selected for it (pg/backend.py).
        from ddplab.pg.backend import device

        self.device = device()
        base = workload.build_model(spec.model, spec.seed, spec.model_kwargs).to(self.device)
        self.loss_fn = spec.loss or workload.default_loss
        # Phases are always stamped; bucket events only when recording is on.
        self.recorder = Recorder(self.name, rank, world_size, backend)
        if backend == "nccl":
            # CPU stamps would be when the host queued NCCL work, not when it ran.
            from ddplab.timeline.cuda_events import CudaStamps

            self.recorder.device_timer = CudaStamps(self.device)
        unrecorded = strategy.time_unrecorded and not traced
        rec = self.recorder if spec.record and not unrecorded else None
        options = {"recorder": rec, "bucket_cap_mb": spec.bucket_cap_mb,
                   "device_ids": [self.device.index] if self.device.type == "cuda" else None}
        self.watch = None  # drawn from the observing group: its hooks go on before the strategy's
        if strategy.shape != "none" and not strategy.accepts("recorder"):
            self.watch = GroupRecorder(rec, base.parameters())
        self.built = strategy(base, **options)
        self.watch = self.built.tracer or self.watch
        if self.watch is not None and observing_group() is None:
            raise RuntimeError(
                f"{self.name} is drawn from the observing process group, and this rank's group "
                "is a plain one: start the ranks with ddplab.init_from_env() under torchrun (or "
                "init_process_group('ddplab_gloo') after ddplab.pg.group.register()), "
                "or use a ddplab.Cluster")
        self.model = self.built.model
        self.opt = (self.built.optimizer or torch.optim.SGD)(self.model.parameters(), lr=spec.lr)
        self.compute_s: list[float] = []
        self.comm_bytes = 0

    def _straggle(self) -> float:
        s = self.spec.straggler
        if not s or s[0] != self.rank or not self.compute_s:
            return 0.0
        pause = (s[1] - 1.0) * statistics.median(self.compute_s[-5:])
        time.sleep(max(0.0, pause))
        return pause

    def step(self, i: int) -> None:
        spec, rec, built = self.spec, self.recorder, self.built
        x, y = workload.make_batch(spec.model, spec.batch, spec.batch_size, self.rank, i,
                                   self.device)
        rec.begin_iteration(i, {"warmup"} if i < spec.warmup else set())
        watch = self.watch
        with comm.counting() as counted, watch.watching() if watch else contextlib.nullcontext():
            with rec.phase("forward"):
                slept = self._straggle()
                loss = self.loss_fn(self.model(x), y)
            self.opt.zero_grad(set_to_none=True)
            with rec.phase("backward"):
                loss.backward()
            if built.after_backward is not None:
                # ddplab's own stamp their wait; code drawn from outside waits in this call
                with rec.phase("wait") if watch else contextlib.nullcontext():
                    built.after_backward()
            if watch is not None:
                end = watch.end_iteration()
                self._split_at_last_gradient(end)
        # outside the watch: a sharded optimizer's broadcasts are counted here, once, not
        # drawn as the next iteration's buckets
        with rec.phase("step"), self._step_traffic() as stepped:
            self.opt.step()
        self.comm_bytes = end["nbytes"] if watch is not None else counted.grad_bytes
        self.comm_bytes += stepped.nbytes if stepped is not None else 0
        rec.end_iteration()
        # Forward + backward compute from the resolved phases: GPU time on a GPU (the host
        # only queues kernels there, in about a millisecond), host time on the CPU.
        it = rec.timeline.iterations[-1]
        self.compute_s.append(it.phases["backward"][1] - it.phases["forward"][0] - slept)

    @contextlib.contextmanager
    def _step_traffic(self):
        """A sharded optimizer's step sends too (its owners' broadcasts): count it at the
        observing group. Other rows' steps send nothing and are not watched."""
        if self.built.optimizer is None:
            yield None
            return
        from ddplab.pg.group import observe
        from ddplab.timeline.op_bytes import OpBytes

        with observe(OpBytes()) as counted:
            yield counted

    def _split_at_last_gradient(self, end: dict) -> None:
        """Backward's compute ended at the last gradient-ready stamp: what followed inside
        ``loss.backward()`` (a wrapper waiting in a queued callback) is wait, and so is the
        wait after it (``finish_gradient_synchronization`` or a function after backward)."""
        rec = self.recorder
        after = rec.phase_span("wait")  # the after_backward call, when there was one
        if rec.split_phase("backward", end["backward_compute_end"], "wait", source="derived",
                           event=end["backward_compute_end_event"]) and after is not None:
            rec.set_phase("wait", rec.phase_span("wait")[0], after[1], "derived")
        if end["on_cpu"] and self.device.type != "cpu" and comm.REQUIRE_DEVICE_GRADS:
            raise RuntimeError(f"{self.name}: a gradient all-reduce carried a CPU tensor on a GPU "
                               "rank: the model or its data stayed on the CPU")

    def finish(self) -> dict:
        tl = self.recorder.result()
        tracer = self.built.tracer
        if tracer is not None:  # torch DDP: its one-bucket and rebuild iterations, its layout
            for it in tl.iterations:
                it.flags |= tracer.iteration_flags().get(it.iteration, set())
            tl.meta["bucket_layout"] = tracer.bucket_layout()
        elif isinstance(getattr(self.model, "bucket_layout", None), list):
            tl.meta["bucket_layout"] = self.model.bucket_layout
        # gradient payload bytes of the last step, counted where the strategy's
        # all-reduces were seen: the one definition of comm_bytes_per_step
        tl.meta["comm_bytes_per_step"] = self.comm_bytes
        tl.meta["comm_path"] = COMM_PATHS[self.watch is not None]
        flat = torch.cat([p.reshape(-1).double() for p in _full_parameters(self.model)])
        from ddplab.measure.memory import held

        return {"timeline": tl.to_dict(), "checksum": float(flat.sum()),
                "memory": held(self.model, self.opt),
                "params": flat[: 4096].clone()}


@torch.no_grad()
def _full_parameters(model) -> list:
    """The model's full parameters on every rank, also where each rank holds a shard:
    ddplab's FSDP gathers them itself; a DTensor of torch's fully_shard gathers with
    ``full_tensor()`` (on gloo the observing group issues its coalesced all-gather one
    tensor at a time: ddplab.pg.group)."""
    if hasattr(model, "full_parameters"):
        return list(model.full_parameters().values())
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for p in model.parameters()]
