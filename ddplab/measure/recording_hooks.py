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
