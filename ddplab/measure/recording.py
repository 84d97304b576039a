"""Your run, recorded: per-bucket timelines of a torch DDP model you already train.

Teaches: everything ddplab draws for its own strategies can be drawn for any
``torch.nn.parallel.DistributedDataParallel`` model, with one call and no change
to the training loop::

    ddp = DistributedDataParallel(model, ...)
    rec = ddplab.record(ddp, steps=range(5, 15), out="run")   # the one added line
    for batch in loader:                                        # the loop as it was
        loss_fn(ddp(batch)).backward(); opt.step(); opt.zero_grad()

What is stamped, and from where (every stamp says its source):
- a forward pre-hook and a forward hook on the DDP module: the iteration's
  start and its forward phase; backward is taken to start when forward ends
  (the loss in between is counted as backward, ``derived``);
- a post-accumulate-grad hook on every parameter: when its gradient became
  ready (``GradRecord``, per parameter, so the run can be re-bucketed later);
- a comm hook: when each bucket was launched and when its all-reduce ended.
  torch takes ONE comm hook per model, so the recorder registers a hook that
  dispatches: to the plain all-reduce (divide, SUM) until you register yours,
  then to yours (``register_comm_hook`` on this model is wrapped, so a later
  call of yours lands here). If a hook was registered BEFORE the call (yours,
  or the one ``mixed_precision=`` installs), the recorder cannot wrap it: the
  buckets are then taken from torch's logging data with their ready times,
  and their communication is marked not measured.

The recording finishes by itself at the end of the last step asked for: right
after the optimizer step that follows that step's backward (a global
``torch.optim`` post-step hook; DDP has waited for every bucket by then, so the
next collective is safe on every rank), else at the next forward. Then every
rank aligns its clock with rank 0's (``ddplab.timeline.clock``), rank 0 gathers
the parts and writes ``out.json`` (the timeline, the parameters, torch's
logging data), ``out.trace.json`` (Perfetto / chrome://tracing) and, when given
a page writer (``ddplab.record`` gives the labs' figures), ``out.html``.
A run that ends before that (a shorter loop, no ``torch.optim`` optimizer, the
process group destroyed, an error) is never silent: at exit, rank 0 says which
steps were recorded, that nothing was written and what to call
(``rec.finish()`` on every rank, before ``destroy_process_group``).
``finish()`` never waits forever for a rank that does not come: its first
collective is a barrier with a time limit. (The endings: ddplab.measure.recording_end.)

Leaves out, compared with the profiler: kernels, memory, the optimizer step as a
phase of its own (the recorder never sees your optimizer: the time after the
last all-reduce until the next forward is the iteration's end). On NCCL the
phases, the gradients' ready times and each bucket's all-reduce are CUDA events
(``ddplab.timeline.cuda_events``; source ``cuda_event``): a gradient's event is
recorded on the stream that made it, a bucket's end on a side stream after
``work.wait()``, all placed on the host clock. A comm hook of yours returns a
future only, and an NCCL future completes when the work is queued: its end is
then not measured (said in the run's meta). Written and tested against a fake
NCCL and a fake CUDA device; never run on a GPU here.
References: torch/nn/parallel/distributed.py (register_comm_hook,
_get_ddp_logging_data); torch.Tensor.register_post_accumulate_grad_hook;
torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py (allreduce_hook).
"""
from __future__ import annotations

import json
from pathlib import Path

from ddplab.launchers import jobstore
from ddplab.measure.recording_end import DESTROYED, FINISH_TIMEOUT_S, UNFINISHED, gather, group_alive, machine
from ddplab.measure.recording_layout import NOT_MEASURED, buckets_from_logging, logged_buckets
from ddplab.timeline.clock import now
from ddplab.timeline.recorder import Recorder
from ddplab.timeline.records import GradRecord, Timeline
from ddplab.timeline.trace import write_chrome_trace

NOT_ON_DEVICE = ("on NCCL a comm hook's future completes when its all-reduce is queued, so "
                 "its end is not measured: the recorder times only the all-reduce it makes itself")


class RunRecorder:
    """Attached to one DDP model by ``record()``; see the module docstring."""

    def __init__(self, ddp_model, steps=range(0, 5), out=None, process_group=None,
                 write_page=None):
        import torch.distributed as dist

        if not isinstance(steps, range) or len(steps) == 0 or steps.start < 0 or steps.step != 1:
            raise ValueError(f"steps={steps!r}: give a non-empty range of iterations, e.g. "
                             "range(5, 15) (iteration 0 is your first forward after this call)")
        if not dist.is_initialized():
            raise RuntimeError("ddplab.record() needs the process group your DDP model uses: "
                               "call it after init_process_group() and DistributedDataParallel(...)")
        self.ddp, self.steps, self.out, self.write_page = ddp_model, steps, out, write_page
        self.group = process_group if process_group is not None else ddp_model.process_group
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.backend = dist.get_backend(self.group)
        self.params = list(ddp_model.module.parameters())
        self.names = [n for n, _ in ddp_model.module.named_parameters()]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        meta = {"recorded": "your run (ddplab.record)", "model": type(ddp_model.module).__name__,
                "params": [{"name": n, "numel": p.numel(), "dtype": str(p.dtype).replace("torch.", ""),
                            "requires_grad": p.requires_grad} for n, p in zip(self.names, self.params)],
                "place": jobstore.place()}  # this rank's job, node and host; rank 0 lists them all
        self.recorder = Recorder("ddp", self.rank, self.world, self.backend, meta)
        # On NCCL a host stamp says when the host queued work, not when the GPU ran it: the
        # GPU's times come from CUDA events (ddplab.timeline.cuda_events), resolved per step.
        self.timer = None
        if "nccl" in str(self.backend):
            from ddplab.timeline.cuda_events import CudaStamps, GradEvents

            on = next((p.device for p in self.params if p.device.type == "cuda"), None)
            self.timer = self.recorder.device_timer = CudaStamps(on)
            self._grad_events = GradEvents(self.timer)
        self.grads: list[GradRecord] = []
        self.iteration = -1
        self.timeline: Timeline | None = None  # rank 0's gathered run, after finish()
        self.finished = False
        self._ready: dict[int, float] = {}
        self._user_hook = None
        # a hook already there: yours (register_comm_hook), a built-in one
        # (register_builtin_comm_hook, which only torch's logging data remembers) or
        # mixed_precision='s own
        self.comm_measured = not (ddp_model._comm_hooks or getattr(ddp_model, "mixed_precision", None)
                                  or ddp_model._get_ddp_logging_data().get("comm_hook"))
        self._backward_done = -1  # the last iteration whose backward has completed
        self._end_queued = -1
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handles = [ddp_model.register_forward_pre_hook(self._forward_start),
                         ddp_model.register_forward_hook(self._forward_end),
                         register_optimizer_step_post_hook(self._after_optimizer_step)]
        self._handles += [p.register_post_accumulate_grad_hook(self._grad_ready)
                          for p in self.params if p.requires_grad]
        if self.comm_measured:
            ddp_model.register_comm_hook(self, RunRecorder._dispatch)
            ddp_model.register_comm_hook = self._register_user_hook  # yours, wrapped when it comes
        else:
            self.recorder.timeline.meta["comm_not_measured"] = NOT_MEASURED
        UNFINISHED.add(self)

    # -- the user's hook, when it comes after us ------------------------------------
    def _register_user_hook(self, state, hook):
        if self._user_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once per DDP model "
                               "(torch's rule; ddplab.record() keeps it)")
        self._user_hook = (hook, state)
        self.ddp.logger._set_comm_hook_name(hook.__qualname__)  # what torch would log
        self.recorder.timeline.meta["comm_hook"] = hook.__qualname__

    # -- hooks ------------------------------------------------------------------------
    def _recording(self) -> bool:
        return self.iteration in self.steps and not self.finished

    def _forward_start(self, module, args):
        if self.finished:
            return
        self._close_wait()
        self.iteration += 1
        if self.iteration == self.steps.stop:
            self.finish()
            return
        if self._recording():
            flags = () if self.ddp.require_backward_grad_sync else ("no_sync",)
            self.recorder.begin_iteration(self.iteration, flags)
            self._forward_t0, self._ready, self._last_comm = now(), {}, None
            if self.timer is not None:
                self._forward_e0 = self.timer.phase_event()
                self._grad_events.new_step()

    def _forward_end(self, module, args, output):
        if self._recording():
            t = now()
            self.recorder.set_phase("forward", self._forward_t0, t, "cpu")
            self._backward_t0 = t
            if self.timer is not None:  # the same phase on the GPU's clock (at the step's end)
                self._backward_e0 = self.timer.phase_event()
                self.timer.add_phase("forward", self._forward_e0, self._backward_e0)

    def _grad_ready(self, param):
        if self._recording():
            t = now()
            i = self._index[id(param)]
            self._ready[i] = t
            self.grads.append(GradRecord(self.rank, self.iteration, i,
                                         param.numel() * param.element_size(), t))
            if self.timer is not None:  # on the stream that made the gradient, after it
                event = self._grad_events.ready(i, self.grads[-1])
                self.timer.add_phase("backward", self._backward_e0, event)  # the last one counts
            self.recorder.set_phase("backward", self._backward_t0, t, "derived")
            if self._end_queued != self.iteration:
                # runs once this backward is over (DDP's own wait for its buckets included,
                # as it runs in the autograd engine's final callbacks too)
                self._end_queued = self.iteration
                from torch.autograd import Variable

                Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self):
        self._backward_done = self.iteration

    def _after_optimizer_step(self, optimizer, args, kwargs):
        """The end of the last step asked for: its backward is over (so DDP has waited for
        every bucket on this rank) and the optimizer has stepped. Every rank gets here at the
        same point of its loop, so finish()'s collectives line up."""
        last = self.steps.stop - 1
        if not self.finished and self.iteration == last and self._backward_done == last:
            self.finish()

    @staticmethod
    def _dispatch(state: "RunRecorder", bucket):
        import torch.distributed as dist

        recording = state._recording()
        if recording:
            index = bucket.index()
            ready = [state._ready.get(state._index.get(id(p))) for p in bucket.parameters()]
            t = now()
            # the bucket was ready when its last gradient was; a gradient whose own hook has
            # not run yet (DDP's hook ran first) was ready by the time DDP launched
            state.recorder.grad_ready(index, max((r for r in ready if r is not None), default=t))
            state.recorder.launch(index, bucket.buffer().numel() * bucket.buffer().element_size(),
                                  [state.names[state._index[id(p)]] for p in bucket.parameters()
                                   if id(p) in state._index], t)
        if state._user_hook is not None:
            hook, user_state = state._user_hook
            fut, unwrap = hook(user_state, bucket), False
        else:  # what DDP does without a hook: divide, then SUM (default_hooks.allreduce_hook)
            tensor = bucket.buffer().div_(state.world)
            work = dist.all_reduce(tensor, group=state.group, async_op=True)
            fut = work.get_future()
            unwrap = True  # a work's future holds [tensor]; DDP wants the tensor
        if not recording:
            return fut.then(lambda f: f.value()[0]) if unwrap else fut
        index = bucket.index()
        if state.timer is not None:
            # NCCL: the future completes when the all-reduce is queued, so its callback
            # would say "enqueued", never "done". The end is an event after work.wait() on
            # a side stream; a hook of yours hands back a future only: not measured then.
            if state._user_hook is None:
                state.timer.launched(work, index, "grad", state._grad_events.span(
                    [state._index.get(id(p)) for p in bucket.parameters()]))
            else:
                state.recorder.timeline.meta["comm_end_not_measured"] = NOT_ON_DEVICE
            return fut.then(lambda f: f.value()[0]) if unwrap else fut

        def done(f):  # one callback: the stamp and the unwrapping together
            t = now()
            state.recorder.comm_done(index, t)
            state._last_comm = t if state._last_comm is None else max(state._last_comm, t)
            return f.value()[0] if unwrap else f.value()

        return fut.then(done)

    def _close_wait(self) -> None:
        """The iteration's "wait": from its last gradient to its last all-reduce's end (DDP
        waits for every bucket at the end of backward, inside loss.backward())."""
        back = self.recorder.phase_span("backward")
        last = getattr(self, "_last_comm", None)
        if back is not None and last is not None and last > back[1]:
            self.recorder.set_phase("wait", back[1], last, "derived")

    # -- the end ---------------------------------------------------------------------------
    def finish(self, timeout: float = FINISH_TIMEOUT_S) -> Timeline | None:
        """Stop recording; on EVERY rank (it runs collectives), before the process group is
        destroyed. Called by itself at the end of the last step asked for; call it yourself
        if the loop ends sooner. Returns the gathered run on rank 0 (None elsewhere) and
        writes the files there. A rank that does not reach it within ``timeout`` seconds
        makes it raise (in words) instead of waiting for the group's own timeout."""
        if self.finished:
            return self.timeline
        if not group_alive(self.group):
            self.finished = True
            UNFINISHED.discard(self)
            raise RuntimeError(DESTROYED)
        self.finished = True
        UNFINISHED.discard(self)
        for h in self._handles:
            h.remove()
        self._close_wait()
        part = self.recorder.result()  # on NCCL: synchronizes and resolves the events
        if self.timer is not None:
            from ddplab.timeline.cuda_events import waits_from_buckets

            self._grad_events.resolve()
            waits_from_buckets(part)
        part.grads = self.grads
        if not self.comm_measured:
            buckets_from_logging(self, part)
        clock, parts = gather(part.to_dict(), self.group, self.rank, self.world, timeout)
        if self.rank != 0:
            return None
        tl = Timeline.merge([Timeline.from_dict(p) for p in parts]).shifted(clock["offsets"])
        tl.meta.pop("place", None)  # rank 0's alone: every rank's is in "ranks"
        tl.meta["ranks"] = [{"rank": r, **(p.get("meta") or {}).get("place", {})} for r, p in enumerate(parts)]
        tl.meta.update(clock_bound_s=clock["bound_s"], logged_bucket_sizes=logged_buckets(self.ddp),
                       machine=machine(self.world),
                       ddp_logging_data={k: v for k, v in self.ddp._get_ddp_logging_data().items()
                                         if isinstance(v, (int, float, str))})
        self.timeline = tl
        if self.out is not None:
            self.save(self.out)
        return tl

    def save(self, out) -> dict:
        """Write out.json, out.trace.json and (with a page writer) out.html; rank 0 only."""
        if self.timeline is None:
            raise RuntimeError("nothing to save here: the run is gathered on rank 0 by finish()")
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        paths = {"json": out.with_suffix(".json"), "trace": out.with_suffix(".trace.json")}
        paths["json"].write_text(json.dumps(self.timeline.to_dict()))
        write_chrome_trace(paths["trace"], self.timeline)
        if self.write_page is not None:
            paths["html"] = out.with_suffix(".html")
            self.write_page(paths["html"], {out.stem: self.timeline})
        return {k: str(v) for k, v in paths.items()}


def record(ddp_model, steps=range(0, 5), out=None, process_group=None, write_page=None):
    """Record ``steps`` of a torch DDP model's training on every rank; see the module docstring."""
    return RunRecorder(ddp_model, steps, out, process_group, write_page)


def load_run(path) -> Timeline:
    """A run saved by ``record(..., out=...)`` (or ``compare --json``'s timelines), as a Timeline."""
    data = json.loads(Path(path).read_text())
    if "iterations" not in data:
        raise ValueError(f"{path} is not a recorded run: it has no 'iterations' (write one with "
                         "ddplab.record(ddp_model, out=...))")
    return Timeline.from_dict(data)
