"""Watching a learner's synchronization from the outside, on the rank, while it runs.

Teaches what can be known about gradient synchronization code WITHOUT
reading it: every collective reaches the rank's process group, however the
code spells it (``dist.all_reduce``, a name imported earlier,
``distributed_c10d.*``, a Work's ``wait()`` or future, torch DDP's reducer).
The ranks' group is the observing one (``ddplab.pg.group``), and
while the learner's code runs this watch is installed on it as an observer
that notes

- which collective ran and on WHAT: a parameter's gradient, the parameter
  itself (weights, not gradients!), or a tensor of the learner's own (a
  flat bucket buffer, a copy), and how many elements;
- WHEN, in backward's own terms: which gradient hook fired last before it,
  and, for async work, whether ``work.wait()`` was called before the NEXT
  hook fired (then nothing overlapped with backward) or only at the end.

The order of events is the order things happened on this rank; no clock is
read to decide anything (clock stamps only feed the drawn timeline).

The grader's own hooks ("markers") are registered on every trainable
parameter BEFORE the learner's wrapper exists, so each marker runs just
before the learner's hook of the same parameter, and the first marker of a
backward queues a callback that runs when backward's compute is over,
before any callback the learner queues.

Every wait the learner's code makes is capped at the grader's short timeout
(the watch's ``timeout``): a rank left waiting for a collective its peer
never calls gets an error after that time, which becomes a message naming
what it was waiting for (``Stalled``), not a frozen notebook.

Leaves out: point-to-point ops (``ddplab.pg.p2p_watch`` pairs those),
functional collectives (they do not reach the group object), and CUDA
streams. Object collectives are seen as the tensor collectives they are made of.
References: torch.distributed.all_reduce (``async_op=True`` returns a
``Work``); torch.Tensor.register_post_accumulate_grad_hook;
torch.autograd.Variable._execution_engine.queue_callback.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ddplab.pg.group import observe
from ddplab.pg.inner import timed_out
from ddplab.timeline.clock import now


class Stalled(RuntimeError):
    """A rank waited for a collective that did not complete (its text says "timed out",
    so the Cluster replaces the ranks afterwards: a stuck group is not reused)."""

    def __init__(self, rank: int, what: str):
        self.rank, self.what = rank, what
        super().__init__(f"rank {rank} timed out: {what}")

    def __reduce__(self):
        return (Stalled, (self.rank, self.what))


class Watch:
    """Install with ``with watch.installed():``; markers with ``attach_markers(model)``.

    It is an observer of the observing group (``ddplab.contracts.protocols.Observer``)."""

    def __init__(self, model, group=None, recorder=None, hang_s: float | None = None):
        self.group, self.hang_s = group, hang_s
        self.rank = dist.get_rank()
        self.recorder = recorder
        self.named = list(model.named_parameters())  # frozen ones too: they can be misused
        self.events: list = []
        self.step = None  # set by the grader's loop
        self.phase = "construction"
        self.backwards = 0  # backward passes seen (marker hooks)
        self._in_backward = False
        self._seq = 0
        self._launches_in_step = 0
        self._last_hook_t = None
        self._saved: dict = {}

    # -- markers: the grader's hooks ----------------------------------------------
    def attach_markers(self, model) -> None:
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._marker(name))

    def _marker(self, name):
        def marker(param):
            if not self._in_backward:
                self._in_backward = True
                self.backwards += 1
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            self._last_hook_t = now()
            self._add("hook", param=name)
        return marker

    def _backward_end(self):
        self._in_backward = False
        self._add("backward_end")

    # -- installing: an observer on the observing process group --------------------
    def installed(self):
        """While the block runs, this watch observes the default group and ``self.group``."""
        stack = contextlib.ExitStack()
        groups = [None] if self.group in (None, dist.group.WORLD) else [None, self.group]
        for group in groups:
            stack.enter_context(observe(self, group))
        return stack

    @property
    def timeout(self):
        """Every wait the learner's code makes is capped at the grader's hang time."""
        return self.hang_s

    def launched(self, op, tensors, group, peer):
        if op in ("send", "recv"):
            return None  # point-to-point passes unobserved here (see ddplab.pg.p2p_watch)
        tensor = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        return self._launch(op, tensor if op != "barrier" else None)

    def started(self, event, work):
        if event is not None and self.recorder is not None \
                and event["phase_"] in ("backward", "after backward"):
            self._record(event, work)
        return None

    def waiting(self, event):
        if event is not None:
            self._add("wait", seq=event["seq"])

    def future_taken(self, event):
        if event is not None:
            event["future"] = True  # waiting through the future is not visible here

    def failed(self, event, exc):
        if event is not None and timed_out(exc):  # gloo's words or NCCL's (wrapped.timed_out)
            raise Stalled(self.rank, self.describe(event)) from None

    # -- what happened ------------------------------------------------------------------
    def _add(self, what, **info):
        info.update(what=what, step=self.step, phase=self.phase)
        self.events.append(info)
        return info

    def _launch(self, op, tensor):
        self._seq += 1
        kind, param = self.classify(tensor)
        where = self.phase
        if self._in_backward:
            where = "backward"
        return self._add("launch", seq=self._seq, op=op, kind=kind, param=param,
                         backward=self.backwards if where == "backward" else None,
                         numel=0 if tensor is None else tensor.numel(), phase_=where,
                         device="cpu" if tensor is None else tensor.device.type,
                         ptr=tensor.data_ptr() if isinstance(tensor, torch.Tensor) else None,
                         nbytes=0 if tensor is None else tensor.numel() * tensor.element_size())

    def classify(self, tensor):
        """("grad", name), ("weight", name) or ("own", None): what a collective ran on."""
        if not isinstance(tensor, torch.Tensor):
            return "own", None
        ptr = tensor.untyped_storage().data_ptr()
        for name, p in self.named:
            if p.untyped_storage().data_ptr() == ptr:
                return "weight", name
            if p.grad is not None and p.grad.untyped_storage().data_ptr() == ptr:
                return "grad", name
        return "own", None

    def describe(self, event) -> str:
        on = {"grad": f"the gradient of {event['param']}", "weight": f"the weight {event['param']}",
              "own": f"a tensor of {event['numel']} elements"}[event["kind"]]
        hooks = []
        for e in self.events:
            if e is event:
                break
            if e["what"] == "hook" and e["step"] == event["step"]:
                hooks.append(e)
        if event["phase_"] == "backward" and hooks:
            when = f"launched in backward, after the hook of {hooks[-1]['param']}"
        else:
            when = f"called {event['phase_']}"
        step = "" if event["step"] is None else f" in step {event['step']}"
        n = sum(1 for e in self.events if e["what"] == "launch" and e["step"] == event["step"])
        return (f"was waiting for {event['op']} on {on} ({when}){step}; this rank had started "
                f"{n} collective(s) in that step")

    def _record(self, event, work):
        rec, index = self.recorder, self._launches_in_step
        self._launches_in_step += 1
        if event["phase_"] == "backward" and self._last_hook_t is not None:
            rec.grad_ready(index, self._last_hook_t)
        label = event["param"] or f"your tensor ({event['numel']} elements)"
        rec.launch(index, event["nbytes"], (f"{event['op']} {event['kind']} {label}",))
        if event["device"] == "cpu":
            work.get_future().then(lambda _f: rec.comm_done(index))
        else:  # an NCCL future completes when the op is queued: that is no transfer's end
            work.get_future().then(lambda _f: rec.record("enqueued", now(), bucket=index))

    def begin_step(self, step: int) -> None:
        self.step, self._launches_in_step, self.phase = step, 0, "forward"

    # -- facts for the grader ----------------------------------------------------------------
    def step_facts(self, step: int) -> dict:
        evs = [e for e in self.events if e["step"] == step]
        launches = []
        for i, e in enumerate(evs):
            if e["what"] != "launch":
                continue
            waits = [j for j in range(i + 1, len(evs))
                     if evs[j]["what"] == "wait" and evs[j]["seq"] == e["seq"]]
            marks = [j for j in range(i + 1, len(evs)) if evs[j]["what"] in ("hook", "backward_end")]
            waited_at = waits[0] if waits else None
            launches.append({
                "op": e["op"], "kind": e["kind"], "param": e["param"], "numel": e["numel"],
                "ptr": e.get("ptr"),
                "phase": e["phase_"], "backward": e.get("backward", None),
                "waited": waited_at is not None or e.get("future", False),
                "waited_before_next_hook": (waited_at is not None and e["phase_"] == "backward"
                                            and (not marks or waited_at < marks[0])),
                "description": self.describe(e)})
        return {"launches": launches, "hooks": [e["param"] for e in evs if e["what"] == "hook"],
                "backward_ends": sum(1 for e in evs if e["what"] == "backward_end")}

