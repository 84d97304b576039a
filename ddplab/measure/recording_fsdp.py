"""Your run, recorded, when torch's ``fully_shard`` (FSDP2) trains it: every all-gather and reduce-scatter.

Teaches: a ``fully_shard``-ed model has no buckets. Each FSDP unit (each module ``fully_shard``
was applied to, the root included) keeps only its shard of its parameters and, per step:

- all-gathers its parameters before its forward (every unit);
- all-gathers them again before its backward when it resharded after forward (every unit but
  the root, by default: ``reshard_after_forward=None`` keeps the root unsharded);
- reduce-scatters its gradients after its backward (every unit), so each rank keeps the sum of
  its own shard only.

``ddplab.record(model, steps=range(2, 8), out="run")`` on the root records those collectives
per optimizer step and per unit, with launch and end times on the host clock, their bytes, the
unit's name and the phase (forward or backward), plus the step's forward and backward phases,
and writes the same three files as for DDP. ``ddplab.view("ddp.json", "fsdp.json")`` draws a
DDP run of the same model beside it: the collectives sit on rows of their own per rank.

How, and which private torch names it relies on (torch 2.13; all of them private, so a later
torch may rename them; each is checked at ``record()``, and one that is missing raises a
RuntimeError naming the torch version, never an empty recording):

- ``FSDPModule._get_fsdp_state()`` and ``FSDPState._fsdp_param_groups``
  (torch/distributed/fsdp/_fully_shard/_fully_shard.py, _fsdp_state.py): the units' parameter
  groups, found from the root's submodules;
- ``FSDPParamGroup._all_gather_comm`` and ``._reduce_scatter_comm``
  (_fsdp_param_group.py): the objects every all-gather (``unshard``, via
  ``foreach_all_gather``) and every reduce-scatter (``post_backward``, via ``foreach_reduce``)
  is made through (_fsdp_collectives.py). They are instances of the ``AllGather`` and
  ``ReduceScatter`` interfaces of the private module ``_fsdp_api.py`` (torch.distributed.fsdp
  does not export them), the types the public ``FSDPModule.set_custom_all_gather`` and
  ``set_custom_reduce_scatter`` take and set. The recorder puts a timing ``AllGather`` and
  ``ReduceScatter`` in front of whatever is there (torch's default, or yours), per group, and
  puts the previous object back at ``finish()`` and when a step raises;
- ``FSDPParamGroup._module_fqn`` (set by ``FSDPState._init_fqns`` at the first forward): the
  unit's name ("" for the root, drawn as "(root)"); ``FSDPParamGroup.mesh_info``'s class
  ``FSDPMeshInfo``: a 1-D shard mesh (HSDP's all-reduce goes around these objects: refused).

Bytes (``BucketRecord.nbytes``): the tensor the collective was handed: an all-gather's output
(the unit's parameters, each dim 0 padded to a multiple of the world size,
``_get_dim0_padded_size`` in _fsdp_common.py, in the dtype they are gathered in: a
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` halves it) and a reduce-scatter's input
(the padded gradients of the unit's parameters that got one, in the reduce dtype: a frozen
parameter is gathered but not reduce-scattered). Each rank sends (p-1)/p of it on a ring for
either (``ddplab.timeline.metrics.ring_bytes``, the figure ``view`` sets beside DDP's). A
collective's ``params`` are ``(op, phase, unit)``; an all-gather has no ``grads_ready`` (no
gradient is involved), a reduce-scatter's is its launch (``derived``).

Steps are optimizer steps, as for DDP (ddplab.measure.recording): a step runs from its first
forward with gradients on to the end of the ``torch.optim`` step that closes it, and ONLY a
``torch.optim`` step (its global hooks, kept to optimizers holding this model's parameters)
closes one: a forward after a backward may be the next micro-step of the same step (gradient
accumulation, with or without ``set_requires_gradient_sync(False)``), which no hook can tell
from a new step (a loop without a ``torch.optim`` optimizer is one step, until ``finish()``).
Micro-steps: the last one's forward and backward are the step's; the ones before it are one
phase, ``no_sync`` (drawn as DDP's accumulation micro-steps; here they may reduce-scatter), and
``micro_steps`` in the meta counts them. A forward with gradients off (validation), and a
forward with gradients on whose backward never came before the step ended (``model.eval();
model(x)`` without ``no_grad``), is not a micro-step: its all-gathers are counted in the meta
(``forwards_without_backward``: step, start, end, all-gathers), not drawn in a step. One made
between the last backward and the optimizer step still lies inside the step's time. So is a
collective made in a recorded step before its first forward (``collectives_outside_steps``:
step, op, unit, launch; e.g. your ``unshard(async_op=True)`` before it).

Only the root is recorded: a unit under it sees its own collectives only (the root's hooks run
the rest), so it is refused naming the root; a module that is not ``fully_shard``-ed itself
while its submodules are (several roots), and one of several roots, are refused saying to
``fully_shard`` the whole model too. The parents are found with ``gc.get_referrers`` (a module
does not know its parent), once at ``record()``.
Stamps:
the step's start and forward from a forward pre-hook (put before FSDP's own) and a forward hook
on the root; backward from the forward's end to an autograd-engine callback queued
by a hook on the root's output, after FSDP's own final callback (which reduce-scatters the
units whose inputs needed no gradient: the root, a first block fed the data): the last
reduce-scatter lies inside backward
(the phase is ``derived``: its start is not a stamp of its own).
A collective's launch and end: the host clock around the call (gloo runs it before returning),
or a callback on its work's future when FSDP asks for an asynchronous one.

When a step raises: an error inside a forward (a root forward hook with ``always_call=True``
sees it) or inside a collective puts everything back at once; an error inside backward is seen
at the next forward, optimizer step or ``finish()`` (its engine callback never came). The
recording then stops, says so on rank 0, and writes nothing (``finish()`` raises saying why).

Leaves out, next to torch's profiler (whose ``FSDP::all_gather`` and ``FSDP::post_backward_reduce``
labels mark the same calls): kernels, memory, the copy-in and copy-out around each collective.
Only CPU (gloo) runs: on a GPU a host stamp is when the host queued the collective, not when it
ran, so a CUDA model is refused in a sentence (DDP's recorder uses CUDA events there). Gradient
accumulation: the earlier micro-steps are one phase (above).
References: torch/distributed/fsdp/_fully_shard/ (the files above);
torch/nn/modules/module.py (``register_forward_hook(always_call=True)``);
torch.autograd's ``Variable._execution_engine.queue_callback`` (as FSDP's _fsdp_state.py).
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

from ddplab.launchers import jobstore
from ddplab.measure.recording import RunRecorder
from ddplab.measure.recording_end import FINISH_TIMEOUT_S, UNFINISHED, machine
from ddplab.measure.recording_gather import SideGroup
from ddplab.timeline.clock import now
from ddplab.timeline.recorder import Recorder

ALL_GATHER, REDUCE_SCATTER = "all_gather_into_tensor", "reduce_scatter_tensor"  # the page's names
STRATEGY = "fully_shard"


def _missing(what: str) -> RuntimeError:
    import torch

    return RuntimeError(f"ddplab.record cannot record this fully_shard-ed model with torch {torch.__version__}: "
                        f"{what} is not there (written against torch 2.13's private FSDP2 names, "
                        "ddplab/measure/recording_fsdp.py); nothing is recorded")


def param_groups(model) -> list:
    """Every FSDPParamGroup under ``model``, in module order, each once (a grouped
    ``fully_shard([a, b])`` shares one state)."""
    from torch.distributed.fsdp import FSDPModule

    groups, seen = [], set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        if not hasattr(module, "_get_fsdp_state"):
            raise _missing("FSDPModule._get_fsdp_state")
        state = module._get_fsdp_state()
        if not hasattr(state, "_fsdp_param_groups"):
            raise _missing("FSDPState._fsdp_param_groups")
        for g in state._fsdp_param_groups:
            if id(g) in seen:
                continue
            seen.add(id(g))
            for name in ("_all_gather_comm", "_reduce_scatter_comm", "_module_fqn", "mesh_info"):
                if not hasattr(g, name):
                    raise _missing(f"FSDPParamGroup.{name}")
            mesh = type(g.mesh_info).__name__
            if mesh not in ("FSDPMeshInfo", "HSDPMeshInfo", "DDPMeshInfo"):  # _fsdp_common.py's three
                raise _missing(f"the mesh class FSDPMeshInfo (found {mesh})")
            if mesh != "FSDPMeshInfo":  # HSDP/replicate: an all-reduce too
                raise TypeError(f"ddplab.record records 1-D fully_shard meshes; this one is "
                                f"{mesh} (HSDP or replicate), whose all-reduce is not "
                                "made through the objects it times")
            groups.append(g)
    return groups


def _parents(module) -> list:
    """The modules that hold ``module`` as a child (in their ``_modules``). A module does not
    know its parent, so they are found from the garbage collector's referrers (once, at
    ``record()``)."""
    import gc

    import torch

    found = []
    for holder in gc.get_referrers(module):
        if not isinstance(holder, dict):
            continue
        for ref in gc.get_referrers(holder):  # the parent, or its __dict__ holding _modules
            for parent in [ref] if not isinstance(ref, dict) else gc.get_referrers(ref):
                if isinstance(parent, torch.nn.Module) and parent._modules is holder and parent not in found:
                    found.append(parent)
    return found


def _name_in(top, module) -> str:
    return next((name for name, m in top.named_modules() if m is module), "?")


def check_root(model) -> None:
    """Refuse a module that is not the root of its fully_shard-ed model: recorded alone, a unit
    under the root sees its own collectives only (the root's hooks run the others), and one of
    several roots sees its own part of the model only. Says which module to pass."""
    from torch.distributed.fsdp import FSDPModule

    state = model._get_fsdp_state()
    chain, top = [], model
    while True:  # up to the module that holds everything (bounded: a module tree has no cycle)
        up = _parents(top)
        if not up:
            break
        top = up[0]
        chain.append(top)
    above = [m for m in chain if isinstance(m, FSDPModule)]
    if above or getattr(state, "_is_root", None) is False:  # _is_root: set at the first forward
        root = above[-1] if above else None
        where = (f"the {type(root).__name__} that holds it as its submodule {_name_in(root, model)!r}"
                 if root is not None else "the module fully_shard(...) was applied to last")
        raise TypeError(f"ddplab.record got a fully_shard-ed {type(model).__name__} that is not the root of "
                        f"its model: its root runs the others' all-gathers and reduce-scatters, so record "
                        f"the root: pass {where}")
    if chain:
        others = [name for name, m in top.named_modules() if isinstance(m, FSDPModule)
                  and m is not model and not any(m is s for s in model.modules())]
        if others:
            raise TypeError(f"ddplab.record got one of several fully_shard roots: the {type(top).__name__} "
                            f"holding it is not fully_shard-ed itself, and {len(others)} other root(s) "
                            f"({', '.join(others[:4])}) run their own collectives; call fully_shard on "
                            f"that {type(top).__name__} too (after its blocks) and pass it")


def _timed_comms():
    """The two timing classes, made on first use (torch's FSDP interfaces import torch)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:
        raise _missing("torch.distributed.fsdp._fully_shard._fsdp_api.AllGather") from None

    class TimedAllGather(AllGather):
        def __init__(self, inner, rec, group):
            self.inner, self.rec, self.group = inner, rec, group

        def allocate(self, size, *, dtype, device):
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return self.rec._timed(ALL_GATHER, self.group, output_tensor, lambda: self.inner(
                output_tensor, input_tensor, group, async_op))

    class TimedReduceScatter(ReduceScatter):
        def __init__(self, inner, rec, group):
            self.inner, self.rec, self.group = inner, rec, group

        def allocate(self, size, *, dtype, device):
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return self.rec._timed(REDUCE_SCATTER, self.group, input_tensor, lambda: self.inner(
                output_tensor, input_tensor, group, op, async_op))

    return TimedAllGather, TimedReduceScatter


def _tensors(output) -> list:
    """The tensors in a forward's output (a tensor, or tuples, lists and dicts of them)."""
    import torch

    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


def units(model) -> list[dict]:
    """The units from the model's structure (public names only): each FSDPModule and the
    parameters it holds itself (not those of a fully_shard-ed submodule)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        inner = {id(p) for sub_name, sub in module.named_modules() if sub_name and isinstance(sub, FSDPModule)
                 for p in sub.parameters()}
        out.append({"unit": name or "(root)", "params": [f"{name}.{n}" if name else n for n, p in
                                                        module.named_parameters() if id(p) not in inner]})
    return out


class FsdpRecorder(RunRecorder):
    """Attached to a fully_shard-ed root by ``record()``; see the module docstring. The
    gathering, the files, ``finish()``, ``wait()`` and ``timeline`` are RunRecorder's."""

    def __init__(self, model, steps=range(1, 6), out=None, process_group=None, write_page=None,
                 trainer="torch fully_shard"):
        import torch.distributed as dist
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if not isinstance(steps, range) or len(steps) == 0 or steps.start < 0 or steps.step != 1:
            raise ValueError(f"steps={steps!r}: give a non-empty range of optimizer steps, e.g. "
                             "range(5, 15) (step 0 is the first one after this call)")
        if not dist.is_initialized():
            raise RuntimeError("ddplab.record() needs the process group your model uses: call it after "
                               "init_process_group() and fully_shard(...)")
        self.ddp, self.steps, self.out, self.write_page = model, steps, out, write_page  # ddp: the model
        self.params = list(model.parameters())
        if any(p.device.type != "cpu" for p in self.params):
            raise TypeError("ddplab.record records fully_shard on CPU (gloo) only: on a GPU a host stamp "
                            "is when the host queued a collective, not when it ran; record the same model "
                            "wrapped in DistributedDataParallel (CUDA events), or use torch.profiler")
        self.groups = param_groups(model)  # raises, naming the torch version, before anything changes
        check_root(model)  # a unit under the root, or one of several roots: refused, naming what to pass
        timed_ag, timed_rs = _timed_comms()  # the same
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.side = SideGroup(self.group, FINISH_TIMEOUT_S)  # finish()'s own group (recording_gather)
        self.names = [n for n, _ in model.named_parameters()]
        self._ids = {id(p) for p in self.params}
        meta = {"recorded": "your run (ddplab.record)", "model": type(model).__name__,
                "params": [{"name": n, "numel": p.numel(), "dtype": str(p.dtype).replace("torch.", ""),
                            "requires_grad": p.requires_grad} for n, p in zip(self.names, self.params)],
                "fsdp_units": units(model), "place": jobstore.place(),
                "run_name": None if out is None else Path(out).name, "trainer": trainer}
        self.recorder = Recorder(STRATEGY, self.rank, self.world, dist.get_backend(self.group), meta)
        self.timer = None
        self.step, self.started, self._micro = 0, -1, 0
        self._stepper_seen, self._backward_done, self._in_forward = False, False, False
        self._forward_ended = False  # this micro-step's forward is over
        # this step's micro-steps (forwards with gradients on): forward [start, end], backward
        # [start, end] or None (none came), the indices of their collectives, their all-gathers
        self._micros: list[dict] = []
        self._backward_open = False  # backward began and its engine callback has not come yet
        self._holders: dict[int, bool] = {}
        self._step_t0, self._calls, self._micro_steps, self._evals = None, 0, {}, []
        self._eval = None  # [step, start, end, all-gathers] of a forward with gradients off
        self._in_step = False  # a recorded step's first forward has begun, its end not come
        self._outside: list = []  # [step, op, unit, launch] of collectives in no step's span
        self.finished, self.failed = False, None
        self._finishing: threading.Thread | None = None
        self._gathered = threading.Event()
        self._timeline, self._gather_error = None, None
        # the patch: a timing comm in front of each group's own, the previous one kept to put back
        self._patched = []
        for g in self.groups:
            for attr, cls in (("_all_gather_comm", timed_ag), ("_reduce_scatter_comm", timed_rs)):
                before = getattr(g, attr)
                setattr(g, attr, cls(before, self, g))
                self._patched.append((g, attr, before, getattr(g, attr)))
        torch_hooks = [model.register_forward_pre_hook(self._forward_start, prepend=True),  # before FSDP's
                       model.register_forward_hook(self._forward_end, always_call=True),
                       register_optimizer_step_pre_hook(self._before_optimizer_step),
                       register_optimizer_step_post_hook(self._after_optimizer_step)]
        self._handles = torch_hooks
        UNFINISHED.add(self)

    # -- the collectives ------------------------------------------------------------------
    def _timed(self, op: str, group, tensor, call):
        """Run one collective through the group's own comm; stamp it when it is in a step."""
        if self.finished:
            return call()
        counted = self._recording() and self._eval is None
        t0 = now()
        try:
            work = call()
        except BaseException as e:
            self._give_up(f"{op} of unit {group._module_fqn or '(root)'} raised {type(e).__name__}")
            raise
        if self._eval is not None:
            self._eval[3] += op == ALL_GATHER
        if not counted:
            return work
        if not self._in_step:  # in a recorded step's range, before its first forward: said, not drawn
            self._outside.append([self.step, op, group._module_fqn or "(root)", t0])
            return work
        # after the forward, before the step's end: backward's (FSDP's pre-backward hook on the
        # root's output runs before ours, so its first all-gather comes before _backward_begins)
        phase = ("forward" if self._in_forward else "backward" if self._forward_ended
                 else "outside forward and backward")
        index, self._calls = self._calls, self._calls + 1
        self.recorder.launch(index, tensor.numel() * tensor.element_size(),
                             (op, phase, group._module_fqn or "(root)"), t0)
        made = self.recorder._buckets.get(index)
        if made is not None and op == ALL_GATHER:  # no gradient is ready for an all-gather
            made.grads_ready = None
            made.sources.pop("grads_ready", None)
        if self._micros:
            self._micros[-1]["calls"].append(index)
            self._micros[-1]["gathers"] += op == ALL_GATHER
        if work is None:  # a blocking call: gloo has run it when it returns
            self.recorder.comm_done(index, now())
            return work
        try:
            future = work.get_future()
        except RuntimeError:  # a work without a future: its end is not measured
            self.recorder.timeline.meta["comm_end_not_measured"] = "a work without a future"
            return work
        future.then(lambda _f: self.recorder.comm_done(index, now()))
        return work

    # -- the step's hooks -----------------------------------------------------------------
    def _recording(self) -> bool:
        return self.step in self.steps and not self.finished

    def _forward_start(self, module, args):
        import torch

        if self.finished:
            return
        if self._backward_open:  # the last backward never reached its end: it raised
            self._give_up("the previous backward raised (its end never came)")
            return
        if not torch.is_grad_enabled():  # validation: no backward follows, not a step
            self._eval = [self.step, now(), None, 0]
            return
        # a step ends at a torch.optim step only: a forward after a backward may be the next
        # micro-step of the same step (gradient accumulation), which no hook can tell apart
        if self._micro == 0 and self._recording():
            self.recorder.begin_iteration(self.step)
            self._calls, self._step_t0, self._in_step, self._micros = 0, None, True, []
        self._micro += 1
        self.started = self.step
        self._in_forward, self._forward_ended, self._forward_t0 = True, False, now()
        self._backward_hooked = False
        if self._in_step:
            self._micros.append({"forward": [self._forward_t0, None], "backward": None, "calls": [],
                                 "gathers": 0})

    def _forward_end(self, module, args, output):
        if self.finished:
            return
        if output is None and sys.exc_info()[1] is not None:  # always_call: the forward raised
            self._give_up(f"the forward raised {type(sys.exc_info()[1]).__name__}")
            return
        if self._eval is not None:
            self._eval[2] = now()
            if self._recording():
                self._evals.append(self._eval)
            self._eval = None
            return
        t = now()
        self._in_forward, self._forward_ended = False, True
        if self._in_step and self._micros:
            self._micros[-1]["forward"][1] = t
        self._backward_t0 = t
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._backward_begins)

    def _backward_begins(self, grad):
        from torch.autograd import Variable

        if not self._backward_hooked and not self.finished:
            # queued after FSDP's own final callback (its hook on this output ran first)
            self._backward_hooked = self._backward_open = True
            if self._in_step and self._micros:
                self._micros[-1]["backward"] = [self._backward_t0, None]
            Variable._execution_engine.queue_callback(self._backward_end)
        return grad

    def _backward_end(self):
        self._backward_open, self._backward_done = False, True
        if self._in_step and self._micros and self._micros[-1]["backward"] is not None:
            # its start is the forward's end (derived), its end the engine's callback
            self._micros[-1]["backward"][1] = now()

    def _close_micros(self) -> int:
        """The step's phases from its micro-steps; returns how many had a backward. A forward
        with gradients on whose backward never came (a validation forward without no_grad)
        is no micro-step: its collectives leave the step and it is listed with the forwards
        without backward. The last micro-step is the step's forward and backward; the ones
        before it are one phase, drawn as DDP's ``no_sync`` micro-steps are."""
        real = [m for m in self._micros if m["backward"] is not None]
        for m in self._micros:
            if m["backward"] is None:
                for index in m["calls"]:
                    self.recorder._buckets.pop(index, None)
                self._evals.append([self.step, m["forward"][0], m["forward"][1], m["gathers"]])
        self._evals.sort(key=lambda e: (e[0], e[1]))
        if not real:
            return 0
        last = real[-1]
        if self.recorder._it is not None:  # the step starts at its first micro-step's forward
            self.recorder._it.start = real[0]["forward"][0]
        self.recorder.set_phase("forward", *last["forward"], "cpu")
        if last["backward"][1] is not None:
            self.recorder.set_phase("backward", *last["backward"], "derived")
        if len(real) > 1:
            self.recorder.set_phase("no_sync", real[0]["forward"][0], real[-2]["backward"][1] or
                                    real[-2]["backward"][0], "cpu")
        return len(real)

    def _holds(self, optimizer) -> bool:
        held = self._holders.get(id(optimizer))
        if held is None:
            held = self._holders[id(optimizer)] = any(
                id(p) in self._ids for g in optimizer.param_groups for p in g["params"])
        return held

    def _before_optimizer_step(self, optimizer, args, kwargs):
        if self._backward_open and not self.finished and self._holds(optimizer):
            self._give_up("the backward raised (its end never came)")
        if self._backward_done and self._recording() and self._holds(optimizer):
            self._step_t0 = now()

    def _end_step(self) -> None:
        if self._recording() and self._in_step:
            self._micro_steps[self.step] = self._close_micros()
            self.recorder.end_iteration()
        self.step += 1
        self._micro, self._backward_done, self._forward_ended, self._in_step = 0, False, False, False
        if self.step == self.steps.stop:
            self._stop(FINISH_TIMEOUT_S, waited_for=False)

    # -- putting back -----------------------------------------------------------------------
    def _put_back(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for g, attr, before, mine in self._patched:
            # a comm you set while recording (set_custom_all_gather) is yours: left in place
            if getattr(g, attr) is mine:
                setattr(g, attr, before)
        self._patched = []

    def _give_up(self, why: str) -> None:
        """A step raised: everything back at once, nothing gathered (a rank that raised cannot be
        expected at finish()'s collectives), said on rank 0, and by finish()."""
        self.finished = True
        UNFINISHED.discard(self)
        self._put_back()
        self.side.close()
        self.failed = (f"ddplab.record: stopped at step {self.step}: {why}; the recorder's hooks and "
                       "FSDP's comms were put back, and nothing will be written")
        if self.rank == 0:
            print(self.failed, file=sys.stderr, flush=True)

    def finish(self, timeout: float = FINISH_TIMEOUT_S):
        if self.failed is not None:
            raise RuntimeError(self.failed)
        if not self.finished and self._backward_open:
            self._give_up("the backward raised (its end never came)")
            raise RuntimeError(self.failed)
        return super().finish(timeout)

    def wait(self, timeout: float | None = None) -> dict:
        if self.failed is not None:  # nothing will be written: say why, not an empty {}
            raise RuntimeError(self.failed)
        return super().wait(timeout)

    def _stop(self, timeout: float, waited_for: bool) -> None:
        from ddplab.measure.recording_end import DESTROYED, group_alive

        if not group_alive(self.group):
            self.finished = True
            UNFINISHED.discard(self)
            self._put_back()
            raise RuntimeError(DESTROYED)
        if self._in_step and self._recording():  # finish() inside a step: what it had so far
            self._micro_steps[self.step] = self._close_micros()
        self.finished = True
        UNFINISHED.discard(self)
        self._put_back()
        part = self.recorder.result()
        part.meta.update(micro_steps={str(k): v for k, v in self._micro_steps.items()},
                         steps_are="optimizer steps", forwards_without_backward=self._evals,
                         collectives_outside_steps=self._outside)
        meta = {"machine": machine(self.world)}
        self._finishing = threading.Thread(target=self._gather_and_write, name="ddplab.record finish",
                                           args=(part, meta, timeout, waited_for))
        self._finishing.start()


def record(model, steps=range(1, 6), out=None, process_group=None, write_page=None,
           trainer="torch fully_shard"):
    """Record ``steps`` of a fully_shard-ed model's training on every rank; see the module docstring."""
    return FsdpRecorder(model, steps, out, process_group, write_page, trainer)
