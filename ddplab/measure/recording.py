"""Your run, recorded: per-bucket timelines of a torch DDP model you already train.

Teaches: everything ddplab draws for its own strategies can be drawn for any
``torch.nn.parallel.DistributedDataParallel`` model, with one call and no change
to the training loop::

    ddp = DistributedDataParallel(model, ...)
    rec = ddplab.record(ddp, steps=range(5, 15), out="run")   # the one added line
    for batch in loader:                                        # the loop as it was
        loss_fn(ddp(batch)).backward(); opt.step(); opt.zero_grad()

Steps are optimizer steps: a step runs from its first forward to the end of the
``torch.optim`` step that closes it (global step pre/post hooks, kept to optimizers
holding this model's parameters). Gradient-accumulation micro-steps run under
``no_sync`` are one phase of their step (``no_sync``); forwards with gradients off
(validation, sanity checks) are listed in the meta and belong to no step; the steps
before torch rebuilds its buckets (one bucket) are flagged ``ddp_one_bucket``.

What is stamped, and from where (every stamp says its source):
- a forward pre-hook and a forward hook on the DDP module: the step's
  start and its forward phase; backward is taken to start when forward ends
  (the loss in between is counted as backward, ``derived``);
- a post-accumulate-grad hook on every parameter: when its gradient became
  ready (``GradRecord``, per parameter, so the run can be re-bucketed later);
- a comm hook: when each bucket was launched and when its all-reduce ended.
  torch takes ONE comm hook per model, so the recorder registers a hook that
  dispatches: to the plain all-reduce (divide, SUM) until you register yours,
  then to yours (``register_comm_hook`` on this model is wrapped, so a later
  call of yours lands here). A Python hook registered BEFORE the call is taken
  out and dispatched to as well; at finish() an empty slot is given back empty
  (ddplab.measure.recording_hooks), and a hook of yours keeps running behind a
  forwarder, named in DDP's logging data. A built-in C++ hook or the one
  ``mixed_precision=`` installs cannot be wrapped: the buckets are then taken
  from torch's logging data with their ready times, and their communication is
  marked not measured.

The recording finishes by itself at the end of the last step asked for:
right after its optimizer step (DDP has waited for every bucket by then), else
at the next forward. That step pays only for what must happen between steps on
every rank alike (the hooks removed, the comm-hook slot given back). The rest
runs on a thread of the recorder's own while your loop goes on: every rank
aligns its clock with rank 0's (``ddplab.timeline.clock``), the ranks gather
their parts to rank 0 on a gloo group made for it at ``record()`` (never on
the training's group, whose collectives that thread would interleave with:
ddplab.measure.recording_gather), and rank 0 writes ``out.json`` (the
timeline, the parameters, torch's logging data), ``out.trace.json`` (Perfetto
/ chrome://tracing) and, when given a page writer (``ddplab.record`` gives the
labs' figures), ``out.html``. ``wait()`` joins that thread; ``timeline`` waits
for the gathering; the interpreter waits for it before it exits (not a daemon).
A run that ends before that (a shorter loop, no ``torch.optim`` optimizer, the
process group destroyed, an error) is never silent: at exit, rank 0 says which
steps were recorded, that nothing was written and what to call
(``rec.finish()`` on every rank, before ``destroy_process_group``). Called
by you, ``finish()`` waits for the gathering and raises what it raised; it never
waits forever for a rank that does not come: its first collective is a barrier
with a time limit. (The endings: ddplab.measure.recording_end.)

Leaves out, compared with the profiler: kernels and memory. On NCCL the
phases, the gradients' ready times and each bucket's all-reduce are CUDA events
(``ddplab.timeline.cuda_events``; source ``cuda_event``): a gradient's event is
recorded on the stream that made it, a bucket's end on a side stream after
``work.wait()``, all placed on the host clock. A comm hook of yours returns a
future only, and an NCCL future completes when the work is queued: its end is
then not measured (said in the run's meta). Written and tested against a fake
NCCL and a fake CUDA device; never run on a GPU here.
References: torch/nn/parallel/distributed.py (register_comm_hook,
_get_ddp_logging_data); torch.Tensor.register_post_accumulate_grad_hook; Python's
threading (the interpreter joins threads that are not daemons before it exits);
torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py (allreduce_hook).
"""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from ddplab.launchers import jobstore
from ddplab.measure.recording_end import DESTROYED, FINISH_TIMEOUT_S, UNFINISHED, group_alive, machine
from ddplab.measure.recording_gather import SideGroup, gather
from ddplab.measure.recording_hooks import fresh_reducer, python_hook, wire_counter, wrappable
from ddplab.measure.recording_layout import NOT_MEASURED, buckets_from_logging, logged_buckets
from ddplab.timeline.clock import now
from ddplab.timeline.recorder import Recorder
from ddplab.timeline.records import GradRecord, Timeline
from ddplab.timeline.trace import write_chrome_trace

NOT_ON_DEVICE = ("on NCCL a comm hook's future completes when its all-reduce is queued, so "
                 "its end is not measured: the recorder times only the all-reduce it makes itself")

# What a recorded bucket's two byte counts are (said in the run's meta, beside them)
BUCKET_BYTES = {"nbytes": "what the bucket held: its gradients' bytes, before any compression",
                "wire_nbytes": "what went on the wire: the bytes this rank handed to the collectives "
                               "the comm hook called while it ran (a compressing hook's smaller tensor; "
                               "the payload, not a ring's traffic). Collectives a hook launches later "
                               "from its futures' callbacks (PowerSGD's P and Q) may be missed: a "
                               "lower bound for such a hook"}


class RunRecorder:
    """Attached to one DDP model by ``record()``; see the module docstring."""

    def __init__(self, ddp_model, steps=range(1, 6), out=None, process_group=None,
                 write_page=None, trainer="torch DDP"):
        import torch.distributed as dist

        if not isinstance(steps, range) or len(steps) == 0 or steps.start < 0 or steps.step != 1:
            raise ValueError(f"steps={steps!r}: give a non-empty range of optimizer steps, e.g. "
                             "range(5, 15) (step 0 is the first one after this call)")
        if not dist.is_initialized():
            raise RuntimeError("ddplab.record() needs the process group your DDP model uses: "
                               "call it after init_process_group() and DistributedDataParallel(...)")
        self.ddp, self.steps, self.out, self.write_page = ddp_model, steps, out, write_page
        self.group = process_group if process_group is not None else ddp_model.process_group
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.backend = dist.get_backend(self.group)
        # finish()'s own group, made now: making it is a meeting of every rank (see
        # ddplab.measure.recording_gather), and record() is called at the same point on each
        self.side = SideGroup(self.group, FINISH_TIMEOUT_S)
        self.params = list(ddp_model.module.parameters())
        self.names = [n for n, _ in ddp_model.module.named_parameters()]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        meta = {"recorded": "your run (ddplab.record)", "model": type(ddp_model.module).__name__,
                "params": [{"name": n, "numel": p.numel(), "dtype": str(p.dtype).replace("torch.", ""),
                            "requires_grad": p.requires_grad} for n, p in zip(self.names, self.params)],
                "place": jobstore.place(),  # this rank's job, node and host; rank 0 lists them all
                # what the page and `ddplab view` label the run by
                "run_name": None if out is None else Path(out).name, "trainer": trainer,
                "bucket_bytes": BUCKET_BYTES}
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
        # On the CPU path a gradient's hook keeps (step, parameter, time) only: the records are
        # made at the end, off the training step (ddplab.record's hooks run in every backward)
        self._grad_times: list[tuple] = []
        self._nbytes = [p.numel() * p.element_size() for p in self.params]
        self._last_grad = None  # this step's last gradient: where its backward ended
        import torch

        self._grad_enabled = torch.is_grad_enabled
        self.step = 0  # optimizer steps completed since record() (the step being run)
        self.started = -1  # the last step whose first forward has run
        self._micro = 0  # forwards with a backward (micro-steps) in this step so far
        self._sync_now = True  # whether this micro-step's backward synchronizes (not no_sync)
        self._synced = False  # this step's synchronizing backward has run
        self._stepper_seen = False  # an optimizer holding these parameters has stepped
        self._holders: dict[int, bool] = {}  # id(optimizer) -> whether it steps these parameters
        self._nosync: list | None = None  # [start, end] of this step's no_sync micro-steps
        self._step_t0 = None
        self._micro_steps: dict[int, int] = {}  # recorded step -> its micro-steps
        self._evals: list = []  # forwards with no backward in recorded steps: [step, start, end]
        # torch rebuilds its buckets once, at the first forward after a backward, unless
        # find_unused_parameters (without static_graph) keeps the layout it was built with;
        # until then the reducer holds ONE bucket (distributed.py, compute_bucket_size_limits)
        self._rebuilt = not (getattr(ddp_model, "static_graph", False)
                             or not getattr(ddp_model, "find_unused_parameters", False))
        self.finished = False
        self._finishing: threading.Thread | None = None  # gathers, then writes (rank 0)
        self._gathered = threading.Event()
        self._timeline: Timeline | None = None  # rank 0's gathered run
        self._gather_error: BaseException | None = None
        self._ready: dict[int, float] = {}
        self._user_hook = None
        # the one comm-hook slot (ddplab.measure.recording_hooks): a Python hook of yours
        # already there is taken out (a fresh reducer) and called by ours; a built-in one
        # (only torch's logging data remembers it) or mixed_precision='s cannot be
        from ddplab.pg.group import observing_group

        # a Cluster's ranks (ddplab's observing group): a hook's bytes are counted by the group
        self._observing = observing_group(self.group)
        self.comm_measured = wrappable(ddp_model)
        if self.comm_measured and python_hook(ddp_model) is not None:
            self._user_hook = python_hook(ddp_model)
            fresh_reducer(ddp_model)
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles = [ddp_model.register_forward_pre_hook(self._forward_start),
                         ddp_model.register_forward_hook(self._forward_end),
                         register_optimizer_step_pre_hook(self._before_optimizer_step),
                         register_optimizer_step_post_hook(self._after_optimizer_step)]
        self._handles += [p.register_post_accumulate_grad_hook(self._grad_ready)
                          for p in self.params if p.requires_grad]
        if self.comm_measured:
            ddp_model.register_comm_hook(self, RunRecorder._dispatch)
            ddp_model.register_comm_hook = self._register_user_hook  # yours, wrapped when it comes
            if self._user_hook is not None:
                self._register_user_hook(self._user_hook[1], self._user_hook[0], again=True)
        else:
            self.recorder.timeline.meta["comm_not_measured"] = NOT_MEASURED
        UNFINISHED.add(self)

    # -- the user's hook, when it comes after us ------------------------------------
    def _register_user_hook(self, state, hook, again=False):
        if self._user_hook is not None and not again:
            raise RuntimeError("register_comm_hook can only be called once per DDP model "
                               "(torch's rule; ddplab.record() keeps it)")
        self._user_hook = (hook, state)
        self.ddp.logger._set_comm_hook_name(hook.__qualname__)  # what torch would log
        self.recorder.timeline.meta["comm_hook"] = hook.__qualname__

    # -- hooks ------------------------------------------------------------------------
    def _recording(self) -> bool:
        return self.step in self.steps and not self.finished

    def _forward_start(self, module, args):
        if self.finished:
            return
        if not self._grad_enabled():  # validation, a sanity check: no backward follows
            self._eval_t0 = now()
            return
        if self._synced and not self._stepper_seen:
            # no torch.optim optimizer steps these parameters: a step ends at the forward
            # after its synchronizing backward
            self._end_step()
            if self.finished:
                return
        if self._micro == 0 and self._recording():
            self.recorder.begin_iteration(self.step)
            self._ready, self._last_comm, self._nosync, self._step_t0 = {}, None, None, None
            self._last_grad = None
        self._micro += 1
        self.started = self.step
        self._sync_now = self.ddp.require_backward_grad_sync
        if self._recording():
            t = now()
            if not self._sync_now:  # a gradient-accumulation micro-step (no_sync)
                self._nosync = [t, t] if self._nosync is None else self._nosync
                return
            self._forward_t0 = t
            if self.timer is not None:
                self._forward_e0 = self.timer.phase_event()
                self._grad_events.new_step()

    def _forward_end(self, module, args, output):
        if self.finished:
            return
        if not self._grad_enabled():
            if self._recording():
                self._evals.append([self.step, getattr(self, "_eval_t0", None), now()])
            return
        if not self._recording():
            return
        t = now()
        if not self._sync_now:
            self._nosync[1] = t
            return
        self.recorder.set_phase("forward", self._forward_t0, t, "cpu")
        self._backward_t0 = t
        if self.timer is not None:  # the same phase on the GPU's clock (at the step's end)
            self._backward_e0 = self.timer.phase_event()
            self.timer.add_phase("forward", self._forward_e0, self._backward_e0)
        if not self._rebuilt:
            # DDP rebuilds inside its forward (_pre_forward, which sets _has_rebuilt_buckets;
            # the logging data's flag waits for its sampled runtime stats): read after it
            if getattr(self.ddp, "_has_rebuilt_buckets", True):
                self._rebuilt = True
            else:
                self.recorder.flag("ddp_one_bucket")

    def _grad_ready(self, param):
        if not self._sync_now:
            if self._recording():
                self._nosync[1] = now()
            return
        self._synced = True
        if self._recording():
            t = now()
            i = self._index[id(param)]
            self._ready[i] = self._last_grad = t
            if self.timer is None:
                self._grad_times.append((self.step, i, t))
                return
            self.grads.append(GradRecord(self.rank, self.step, i, self._nbytes[i], t))
            # on the stream that made the gradient, after it
            event = self._grad_events.ready(i, self.grads[-1])
            self.timer.add_phase("backward", self._backward_e0, event)  # the last one counts

    def _set_backward(self) -> None:
        """The step's backward: from the end of its forward to its last gradient (set once,
        at the step's end, not at every gradient)."""
        if self._last_grad is not None and getattr(self, "_backward_t0", None) is not None:
            self.recorder.set_phase("backward", self._backward_t0, self._last_grad, "derived")

    def _holds(self, optimizer) -> bool:
        """Whether ``optimizer`` steps this model's parameters (the hooks are global)."""
        held = self._holders.get(id(optimizer))
        if held is None:
            held = self._holders[id(optimizer)] = any(
                id(p) in self._index for g in optimizer.param_groups for p in g["params"])
        return held

    def _before_optimizer_step(self, optimizer, args, kwargs):
        # Lightning calls optimizer.step(closure) BEFORE its synchronizing forward and backward
        # (the closure runs them): then no step phase, also after no_sync micro-steps
        if self._synced and self._recording() and self._holds(optimizer):
            self._step_t0 = now()

    def _after_optimizer_step(self, optimizer, args, kwargs):
        """The end of a step: its backward is over (so DDP has waited for every bucket on
        this rank) and the optimizer has stepped. Every rank gets here at the same point of
        its loop, so finish()'s collectives line up after the last step asked for."""
        if self.finished or not self._holds(optimizer):
            return
        self._stepper_seen = True
        if self._micro == 0:  # a second optimizer over the same parameters: one step
            return
        if self._recording() and self._step_t0 is not None:
            self.recorder.set_phase("step", self._step_t0, now(), "cpu")
        self._end_step()

    def _end_step(self) -> None:
        if self._recording():
            self._set_backward()
            self._close_wait()
            if self._nosync is not None:
                self.recorder.set_phase("no_sync", self._nosync[0], self._nosync[1], "cpu")
            self._micro_steps[self.step] = self._micro
            if not self._synced:  # every micro-step of it was no_sync: nothing was all-reduced
                self.recorder.flag("no_sync")
            self.recorder.end_iteration()
        self.step += 1
        self._micro, self._synced, self._nosync = 0, False, None
        if self.step == self.steps.stop:
            self._stop(FINISH_TIMEOUT_S, waited_for=False)  # training goes on while it gathers

    @staticmethod
    def _dispatch(state: "RunRecorder", bucket):
        import torch.distributed as dist

        if not state._recording():  # between recorded steps: the hook as it would run alone
            if state._user_hook is not None:
                hook, user_state = state._user_hook
                return hook(user_state, bucket)
            work = dist.all_reduce(bucket.buffer().div_(state.world), group=state.group, async_op=True)
            return work.get_future().then(_first)  # DDP wants the tensor, not [tensor]
        index, buffer, t = bucket.index(), bucket.buffer(), now()
        members = [state._index.get(id(p)) for p in bucket.parameters()]
        ready = state._ready
        # the bucket was ready when its last gradient was; a gradient whose own hook has
        # not run yet (DDP's hook ran first) was ready by the time DDP launched
        state.recorder.grad_ready(index, max((ready[i] for i in members if i in ready), default=t))
        held = buffer.numel() * buffer.element_size()  # what the bucket holds (before any compression)
        b = state.recorder.launch(index, held, [state.names[i] for i in members if i is not None], t)
        if state._user_hook is not None:
            # what went on the wire is what the hook's collectives were handed: counted at the
            # dispatcher (ddplab.measure.recording_hooks.wire_counter), read when its future is done
            hook, user_state = state._user_hook
            counter = wire_counter(state._observing)
            with counter:
                fut = hook(user_state, bucket)
        else:  # what DDP does without a hook: divide, then SUM (default_hooks.allreduce_hook)
            work = dist.all_reduce(buffer.div_(state.world), group=state.group, async_op=True)
            fut, counter = work.get_future(), None
            if b is not None:  # the bucket itself went on the wire
                b.wire_nbytes = held
        if state.timer is not None:
            # NCCL: the future completes when the all-reduce is queued, so its callback
            # would say "enqueued", never "done". The end is an event after work.wait() on
            # a side stream; a hook of yours hands back a future only: not measured then.
            if counter is None:
                state.timer.launched(work, index, "grad", state._grad_events.span(members))
                return fut.then(_first)
            state.recorder.timeline.meta["comm_end_not_measured"] = NOT_ON_DEVICE

            def counted(f):
                if b is not None:
                    b.wire_nbytes = counter.total
                return f.value()

            return fut.then(counted)

        def done(f):  # one callback: the stamps and the unwrapping together
            t = now()
            if counter is not None and b is not None:
                b.wire_nbytes = counter.total
            state.recorder.comm_done(index, t)
            state._last_comm = t if state._last_comm is None else max(state._last_comm, t)
            return f.value()[0] if counter is None else f.value()

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
        destroyed. Called by itself at the end of the last step asked for (then it gathers
        on a thread while training goes on); call it yourself if the loop ends sooner: then
        it waits for the gathering. Returns the gathered run on rank 0 (None elsewhere) and
        writes the files there (on that thread: ``wait()``). A rank that does not reach it
        within ``timeout`` seconds makes it raise (in words) instead of waiting for the
        group's own timeout."""
        if not self.finished:
            self._stop(timeout, waited_for=True)
        return self.timeline

    @property
    def timeline(self) -> Timeline | None:
        """Rank 0's gathered run (None on the other ranks, and before finish()). Reading it
        waits for the gathering (not for the files), and raises what the gathering raised."""
        if self._finishing is None:
            return None
        self._gathered.wait()
        if self._gather_error is not None:
            raise self._gather_error
        return self._timeline

    def _stop(self, timeout: float, waited_for: bool) -> None:
        """What must happen between two steps, on every rank alike; then the gathering and
        the files on a thread. ``waited_for``: a call of yours will raise its error (else the
        thread says it)."""
        if not group_alive(self.group):
            self.finished = True
            UNFINISHED.discard(self)
            raise RuntimeError(DESTROYED)
        self.finished = True
        UNFINISHED.discard(self)
        for h in self._handles:
            h.remove()
        # torch's layout and logging data as the recorded steps ran (before a fresh reducer)
        meta = {"logged_bucket_sizes": logged_buckets(self.ddp), "machine": machine(self.world),
                "ddp_logging_data": {k: v for k, v in self.ddp._get_ddp_logging_data().items()
                                     if isinstance(v, (int, float, str))}}
        if self.comm_measured and self._user_hook is None:  # the hook slot empty again
            del self.ddp.register_comm_hook  # torch's own method again
            fresh_reducer(self.ddp)
        # With a hook of yours, ours stays in front of it and only forwards (its name is what
        # DDP's logging data says): a fresh reducer would lay the buckets out again, and a
        # hook that keeps state per bucket (PowerSGD's error feedback) would start over.
        if self.step in self.steps:  # a step cut short by finish(): what it had so far
            self._set_backward()
        self._close_wait()
        part = self.recorder.result()  # on NCCL: synchronizes and resolves the events
        if self.timer is not None:
            from ddplab.timeline.cuda_events import waits_from_buckets

            self._grad_events.resolve()
            waits_from_buckets(part)
        part.grads = self.grads  # the CPU path's are made on the thread (_grad_records)
        part.meta.update(micro_steps={str(k): v for k, v in self._micro_steps.items()},
                         steps_are="optimizer steps", forwards_without_backward=self._evals)
        if not self.comm_measured:
            self._grad_records()  # read by the layout's ready times
            buckets_from_logging(self, part)
        # Not a daemon: the interpreter waits for it before it exits (and so does
        # ddplab.launchers.torchrun.finish before its os._exit).
        self._finishing = threading.Thread(target=self._gather_and_write, name="ddplab.record finish",
                                           args=(part, meta, timeout, waited_for))
        self._finishing.start()

    def _gather_and_write(self, part, meta: dict, timeout: float, waited_for: bool) -> None:
        """On the recorder's thread: the gathering (on its own group), then the files (rank 0)."""
        try:
            self._grad_records()
            start = now()
            clock, parts = gather(part.to_dict(), self.side, timeout)
            meta["gathered"] = [start, now()]  # on rank 0's clock: after the last recorded step
            if self.rank == 0:
                tl = Timeline.merge([Timeline.from_dict(p) for p in parts]).shifted(clock["offsets"])
                tl.meta.pop("place", None)  # rank 0's alone: every rank's is in "ranks"
                tl.meta["ranks"] = [{"rank": r, **(p.get("meta") or {}).get("place", {})}
                                    for r, p in enumerate(parts)]
                tl.meta.update(meta, clock_bound_s=clock["bound_s"])
                self._timeline = tl
        except BaseException as e:  # raised by finish(), wait() and timeline
            self._gather_error = e
            if not waited_for:  # nobody's call is there to raise it: say it now
                print(e, file=sys.stderr, flush=True)
            return
        finally:
            self.side.close()
            self._gathered.set()
        if self.rank == 0 and self.out is not None:
            try:
                self.paths = self.save(self.out)
            except BaseException as e:  # said by wait(); a thread's error would go to stderr only
                self._write_error = e

    def _grad_records(self) -> None:
        """The CPU path's gradient stamps as GradRecords (kept as tuples while training ran)."""
        times = getattr(self, "_grad_times", None)  # a fully_shard recorder keeps none
        if times:
            self.grads += [GradRecord(self.rank, step, i, self._nbytes[i], t) for step, i, t in times]
            self._grad_times = []

    def wait(self, timeout: float | None = None) -> dict:
        """Wait for finish()'s gathering and files (rank 0 writes them in the background):
        their paths. Raises what the gathering or the writing raised."""
        if self._finishing is not None:
            self._finishing.join(timeout)
            if self._finishing.is_alive():
                raise TimeoutError(f"ddplab.record: {self.out} is still being gathered or written "
                                   f"after {timeout:g} s")
        if self._gather_error is not None:
            raise self._gather_error
        if getattr(self, "_write_error", None) is not None:
            raise RuntimeError(f"ddplab.record: writing {self.out} failed") from self._write_error
        return getattr(self, "paths", {})

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
            self.write_page(paths["html"], {run_label(self.timeline, out.name): self.timeline})
        return {k: str(v) for k, v in paths.items()}


def _first(fut):
    """A work's future holds [tensor]; DDP's comm hook must hand back the tensor."""
    return fut.value()[0]


def run_label(tl: Timeline, fallback: str) -> str:
    """A recorded run's name on a page: its name (``out``'s) and the trainer it ran under."""
    name = tl.meta.get("run_name") or fallback
    return f"{name} ({tl.meta['trainer']})" if tl.meta.get("trainer") else name


def record(ddp_model, steps=range(1, 6), out=None, process_group=None, write_page=None, trainer="torch DDP"):
    """Record ``steps`` of a torch DDP model's training on every rank; see the module docstring."""
    return RunRecorder(ddp_model, steps, out, process_group, write_page, trainer)


def load_run(path) -> Timeline:
    """A run saved by ``record(..., out=...)`` (or ``compare --json``'s timelines), as a Timeline."""
    data = json.loads(Path(path).read_text())
    if "iterations" not in data:
        raise ValueError(f"{path} is not a recorded run: it has no 'iterations' (write one with "
                         "ddplab.record(ddp_model, out=...))")
    return Timeline.from_dict(data)
