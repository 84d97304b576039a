"""The one comm-hook slot of a torch DDP model: how ``ddplab.record`` takes it and gives it back.

Teaches: torch lets a DDP model's reducer hold ONE comm hook, for its whole life:
``register_comm_hook`` refuses a second one and torch has no call that removes one. The
recorder needs that slot to time each bucket. So it does what torch itself does when a DDP
model is unpickled (``DistributedDataParallel.__setstate__``): it builds the reducer again
from the same parameters. A fresh reducer holds no hook and lays its buckets out again as
torch does at construction (one bucket, then the rebuild after the next backward, or the
``find_unused_parameters`` layout), so the step after it is flagged as torch's first one.

- at ``record()``: a Python hook you registered before is taken out of the old reducer and
  called by the recorder's hook (measured, not lost);
- at ``finish()``: when you had no hook, the reducer is built once more, with none: DDP's
  logging data then says so, as before the recording (with a hook of yours, the recorder's
  stays in front of it and forwards: a fresh reducer would reset a hook's per-bucket state,
  e.g. PowerSGD's error feedback).

Leaves out: a built-in C++ hook (``_register_builtin_comm_hook``) and ``mixed_precision=``'s
hook, which cannot be called from Python: the recorder leaves those in place, unmeasured.
References: torch/nn/parallel/distributed.py (__setstate__, _ddp_init_helper,
register_comm_hook); torch/csrc/distributed/c10d/reducer.cpp (a destroyed reducer removes
its autograd hooks).
"""
from __future__ import annotations

import functools


def python_hook(ddp_model):
    """(hook, state) of a Python comm hook registered on ``ddp_model``, else None."""
    hooks = getattr(ddp_model, "_comm_hooks", None) or []
    return (hooks[-1][0], hooks[-1][1]) if hooks else None


def wrappable(ddp_model) -> bool:
    """Whether the recorder can hold the comm-hook slot: empty, or a Python hook it can call."""
    if getattr(ddp_model, "mixed_precision", None):
        return False
    if python_hook(ddp_model) is not None:
        return True
    return not ddp_model._get_ddp_logging_data().get("comm_hook")  # a built-in one: C++ only


def fresh_reducer(ddp_model) -> None:
    """Build ``ddp_model``'s reducer again, with no comm hook (as torch's __setstate__ does).
    Call it between steps only (no backward in flight), on every rank alike."""
    parameters, expect_sparse = ddp_model._build_params_for_reducer()
    ddp_model._comm_hooks.clear()
    ddp_model._ddp_init_helper(parameters, expect_sparse,
                               ddp_model._build_debug_param_to_name_mapping(parameters),
                               ddp_model.static_graph)
    ddp_model._has_rebuilt_buckets = False
    if ddp_model.static_graph:
        ddp_model.reducer._set_static_graph()
        ddp_model.logger._set_static_graph()
        ddp_model._static_graph_delay_allreduce_enqueued = False


# c10d ops whose SECOND argument is what this rank sends (the first is where results land)
_SENT_SECOND = ("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
                "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
                "alltoall_", "alltoall_base_", "gather_", "scatter_")


def wire_counter(observing=None):
    """A fresh counter of the bytes a comm hook hands to collectives: ``with counter:`` around
    the hook, then ``counter.total``. On torch's own groups, at the dispatcher
    (``_wire_bytes_class``); on ddplab's observing group (a Cluster's ranks, ``observing``),
    whose collectives are Python methods that never reach the dispatcher, as an observer of
    that group (``_ObservedBytes``)."""
    return _wire_bytes_class()() if observing is None else _ObservedBytes(observing)


class _ObservedBytes:
    """An observer of ddplab's observing group (``ddplab.pg.group``) for the hook's call: the
    payload of every op issued on THIS thread meanwhile (the group is shared with the other
    buckets' callbacks, which run on gloo's threads). Leaves out what a hook chains on its
    futures (PowerSGD's later all-reduces run on gloo's threads after the call)."""

    def __init__(self, group):
        import threading

        from ddplab.pg.works import ObserverBase

        self.group, self.sent, self.thread = group, [], threading.get_ident()
        counter = self

        class Observer(ObserverBase):
            def launched(self, op, tensors, group, peer):
                if threading.get_ident() == counter.thread:
                    counter.sent.append(sum(t.numel() * t.element_size() for t in _flat(tensors)))

        self.observer = Observer()

    def __enter__(self):
        self.group.observers.append(self.observer)
        return self

    def __exit__(self, *exc):
        self.group.observers.remove(self.observer)

    @property
    def total(self) -> int:
        return sum(self.sent)


@functools.cache
def _wire_bytes_class():
    """A torch dispatch mode that adds up the bytes a comm hook hands to collectives.

    A compressing hook (``default_hooks.fp16_compress_hook``: the bucket cast to fp16, then
    all-reduced) sends fewer bytes than its bucket holds, and only the collectives it calls
    know how many. Every c10d collective goes through torch's dispatcher (``c10d::allreduce_``
    and its kin), so a ``TorchDispatchMode`` entered around the hook sees each one with its
    tensors. The mode is thread-local: a collective a hook chains on its futures (PowerSGD's
    P and Q all-reduces) is seen only when torch runs that callback at once, on this thread
    (its future was already done); run later on gloo's thread, it is not. So for such a hook
    the count is a lower bound. Counted: the payload this rank hands over (numel x element size), as
    ``ddplab.pg.inner.payload_bytes`` counts it, not a ring's traffic."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class WireBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sent = []  # appended from gloo's threads too (a list append is atomic)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                name = func._opname
                if name not in ("barrier", "monitored_barrier_", "recv_", "recv_any_source_"):
                    sent = args[1] if name in _SENT_SECOND else args[0]
                    sent = sent if isinstance(sent, (list, tuple)) else [sent]
                    self.sent.append(sum(t.numel() * t.element_size() for t in _flat(sent)))
            return func(*args, **(kwargs or {}))

        @property
        def total(self) -> int:
            return sum(self.sent)

    return WireBytes


def _flat(tensors):
    for t in tensors:
        if isinstance(t, (list, tuple)):
            yield from _flat(t)
        else:
            yield t
