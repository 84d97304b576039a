"""One registry of gradient-synchronization strategies: a name, and how to build it.

Teaches: a strategy is "take a model, return something that trains it in
step with the other ranks". Here each one is ONE entry: a name, a build
function and a line of description. compare(), the lessons, the graders,
the control panel, the demo, the tests and the benchmarks all build
strategies through ``build_strategy``; adding a strategy is adding one
entry, in this file or in your own:

    @ddplab.register_strategy("my_sync", description="all-reduce once, after backward")
    def my_sync(module, process_group=None):
        return module, lambda: my_average(module, process_group)

A build function takes the module (already on its device) and keyword
options, and returns either the model to train (a wrapper that syncs by
itself during backward), ``(model, after_backward)`` where
``after_backward()`` runs after ``loss.backward()``, or a ``Built``.

Options: a build function declares what it takes. ``recorder``,
``process_group``, ``bucket_cap_mb`` and ``device_ids`` are offered by the
engine to every strategy and passed only to those that accept them (a
strategy without buckets has no use for a cap); any other option a
strategy does not take is an error.

Reaching the ranks: compare() looks names up HERE, in the process that
asks, and ships the entries with the job (cloudpickle, functions defined in
a notebook cell by value). So a strategy registered in a notebook cell runs
on the ranks without ever being registered there. ``load_strategy
("path/to/file.py:name")`` (the CLI's ``--strategy``) loads one from a file.

Importing this module imports no torch: the widgets read names from it.
Leaves out: strategy options with their own UI (the panel shows names only).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
from typing import Any, Callable

ENGINE_OPTIONS = ("recorder", "process_group", "bucket_cap_mb", "device_ids")
# How a strategy's communication sits in a step: what the demo draws for it.
SHAPES = ("none", "after_backward", "after_backward_flat", "per_parameter", "buckets", "torch_ddp")


@dataclasses.dataclass
class Built:
    """A strategy applied to one model: what the training step needs."""

    model: Any  # forward and the optimizer use this
    after_backward: Callable | None = None  # called after loss.backward(), if any
    tracer: Any = None  # torch DDP: a ddplab.sync.ddp_trace.DDPTracer watching its process group
    optimizer: Callable | None = None  # optimizer(params, lr=...): the step's optimizer (ZeRO)


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    build: Callable
    description: str = ""
    shape: str = "after_backward"
    # torch DDP: recording it changes its speed (a Python hook per parameter), so
    # compare times a copy built without a recorder and draws a recorded one.
    time_unrecorded: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z_][\w.-]*", self.name):
            raise ValueError(f"a strategy name is a word (letters, digits, _ . -), got {self.name!r}")
        if not callable(self.build):
            raise TypeError(f"strategy {self.name!r}: build must be callable as build(module, **options)")
        if self.shape not in SHAPES:
            raise ValueError(f"strategy {self.name!r}: shape must be one of {', '.join(SHAPES)}")

    def accepts(self, option: str) -> bool:
        """Does build take ``option``? Engine options only when named (not via **options)."""
        params = inspect.signature(self.build).parameters.values()
        return any((p.name == option and p.kind is not p.VAR_POSITIONAL) or
                   (p.kind is p.VAR_KEYWORD and option not in ENGINE_OPTIONS) for p in params)

    def __call__(self, module, **options) -> Built:
        """Build this strategy around ``module`` (see ``build_strategy``)."""
        given = {k: v for k, v in options.items() if k not in ENGINE_OPTIONS or self.accepts(k)}
        unknown = [k for k in given if not self.accepts(k)]
        if unknown:
            takes = [p for p in inspect.signature(self.build).parameters][1:]
            raise TypeError(f"strategy {self.name!r} takes no option {unknown[0]!r}; "
                            f"it takes: {', '.join(takes) or 'nothing'}")
        out = self.build(module, **given)
        if isinstance(out, Built):
            return out
        if isinstance(out, tuple) and len(out) == 2:
            return Built(out[0], out[1])
        if out is None:
            raise TypeError(f"strategy {self.name!r}: build returned None; return the model to "
                            "train, or (model, after_backward)")
        return Built(out)


_REGISTRY: dict[str, Strategy] = {}


def register_strategy(name: str, build: Callable | None = None, *, description: str = "",
                      shape: str = "after_backward", time_unrecorded: bool = False,
                      replace: bool = False):
    """Add a strategy; usable as ``@register_strategy("name")`` over its build function."""
    def add(fn):
        if name in _REGISTRY and not replace:
            raise ValueError(f"a strategy named {name!r} is already registered; pick another name "
                             "or pass replace=True")
        entry = Strategy(name, fn, description or (inspect.getdoc(fn) or "").split("\n")[0],
                         shape, time_unrecorded)
        _REGISTRY[name] = entry
        return fn
    return add if build is None else add(build)


def unregister_strategy(name: str) -> None:
    _REGISTRY.pop(name, None)


def strategy_names() -> tuple:
    return tuple(_REGISTRY)


def get_strategy(name) -> Strategy:
    """The entry for ``name`` (a registered name, a Strategy, or "file.py:name" / "module:name")."""
    if isinstance(name, Strategy):
        return name
    if isinstance(name, str) and ":" in name:
        return load_strategy(name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}: choose any of {', '.join(_REGISTRY)}, "
                         "register one with ddplab.register_strategy, or give FILE.py:NAME")
    return _REGISTRY[name]


def build_strategy(name, module, **options) -> Built:
    """Apply strategy ``name`` to ``module``: a ``Built`` (``.model``, ``.after_backward``)."""
    return get_strategy(name)(module, **options)


def load_user_module(where: str, origin: str):
    """The module at ``where`` (a ``.py`` path or a dotted name), registered to pickle by
    value so that ranks which cannot import it still get its functions. ``origin`` names
    the option that asked for it, for the error message."""
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise ValueError(f"no such file {where!r} (from {origin})")
        mod_name = "ddplab_user_" + re.sub(r"\W", "_", os.path.abspath(where))
        module = sys.modules.get(mod_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(mod_name, where)
            module = importlib.util.module_from_spec(loader)
            sys.modules[mod_name] = module
            loader.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    return module


def load_strategy(spec: str) -> Strategy:
    """``"path/to/file.py:name"`` or ``"package.module:name"``: a strategy defined in a file.

    ``name`` is a Strategy, a registered name, or a build function. The file's
    module is pickled by value, so ranks that cannot import it still get it.
    """
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ValueError(f"a strategy from a file looks like FILE.py:NAME or module:NAME, got {spec!r}")
    module = load_user_module(where, f"strategy {spec!r}")
    obj = getattr(module, attr, None)
    if obj is None and attr in _REGISTRY:  # the file registered it under that name
        return _REGISTRY[attr]
    if callable(obj) and not isinstance(obj, Strategy):
        obj = Strategy(attr, obj, (inspect.getdoc(obj) or "").split("\n")[0])
    if not isinstance(obj, Strategy):
        raise ValueError(f"{spec!r}: {attr!r} is not a strategy or a build function in {where}")
    known = _REGISTRY.get(obj.name)
    if known is not None and known.build is not obj.build:
        raise ValueError(f"{spec!r}: a different strategy named {obj.name!r} is already registered")
    _REGISTRY[obj.name] = obj  # from now on, known by its name here (and shipped to ranks)
    return obj


# -- the built-in strategies ----------------------------------------------------------

@register_strategy("none", shape="none")
def _none(module):
    """compute only: no synchronization (the baseline)"""
    return module


@register_strategy("manual", shape="after_backward")
def _manual(module, process_group=None, recorder=None):
    """average_gradients after backward, one all-reduce per parameter"""
    from ddplab.sync import average_gradients

    return module, lambda: average_gradients(module, process_group, recorder=recorder)


@register_strategy("manual_flat", shape="after_backward_flat")
def _manual_flat(module, process_group=None, recorder=None):
    """average_gradients(flat=True) after backward: one all-reduce of a flat buffer"""
    from ddplab.sync import average_gradients

    return module, lambda: average_gradients(module, process_group, flat=True, recorder=recorder)


@register_strategy("overlap", shape="per_parameter")
def _overlap(module, process_group=None, recorder=None, **options):
    """OverlapDDP: one async all-reduce per parameter, from its gradient hook"""
    from ddplab.sync import OverlapDDP

    return OverlapDDP(module, process_group=process_group, recorder=recorder, **options)


@register_strategy("bucketed", shape="buckets")
def _bucketed(module, bucket_cap_mb=None, process_group=None, recorder=None, **options):
    """BucketedDDP: buckets in reverse order, launched in index order during backward"""
    from ddplab.sync import BucketedDDP

    return BucketedDDP(module, bucket_cap_mb=bucket_cap_mb, process_group=process_group,
                       recorder=recorder, **options)


@register_strategy("ddp", shape="torch_ddp", time_unrecorded=True)
def _ddp(module, bucket_cap_mb=None, process_group=None, recorder=None, device_ids=None,
         **options):
    """torch's DistributedDataParallel, drawn from its process group

    ``bucket_cap_mb=None`` is torch's own default (a small first bucket, then
    25 MB); an explicit 25 gives no small first bucket. Its ``tracer`` watches
    the observing group (``with built.tracer.watching():``): it counts the
    buckets and, given a recorder, stamps them.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.sync.ddp_trace import DDPTracer

    model = DDP(module, bucket_cap_mb=bucket_cap_mb, device_ids=device_ids,
                process_group=process_group, **options)
    return Built(model, tracer=DDPTracer(model, recorder, process_group))


# -- the reference reducers (ddplab.sync.core): plain torch.distributed calls, drawn
# from the observing process group like torch DDP (they take no recorder) ------------

@register_strategy("core_manual", shape="after_backward")
def _core_manual(module, process_group=None):
    """the reference average_gradients: one all-reduce per parameter, after backward"""
    from ddplab.sync import core

    return module, lambda: core.average_gradients(module, process_group)


@register_strategy("core_manual_flat", shape="after_backward_flat")
def _core_manual_flat(module, process_group=None):
    """the reference average_gradients_flat: one all-reduce of a flat buffer, after backward"""
    from ddplab.sync import core

    return module, lambda: core.average_gradients_flat(module, process_group)


@register_strategy("core_overlap", shape="per_parameter")
def _core_overlap(module, process_group=None):
    """the reference OverlapDDP: one async all-reduce per parameter, from its hook"""
    from ddplab.sync import core

    return core.OverlapDDP(module, process_group=process_group)


@register_strategy("core_bucketed", shape="buckets")
def _core_bucketed(module, bucket_cap_mb=None, process_group=None):
    """the reference BucketedDDP: torch's buckets, launched in index order during backward"""
    from ddplab.sync import core

    return core.BucketedDDP(module, bucket_cap_mb=bucket_cap_mb, process_group=process_group)


# -- compare()'s sharded rows: ZeRO-1, ZeRO-2 and FSDP, ddplab's references beside torch's -------
# zero1 (torch DDP + ddplab.ShardedOptimizer), torch_zero (torch DDP + ZeroRedundancyOptimizer),
# zero2 (ddplab's ZeroTwo, no DDP: its step reduce-scatters and all-gathers),
# fsdp (ddplab.FSDP) and torch_fsdp2 (fully_shard on the units ddplab.FSDP makes, then on the
# model). They use the same plain SGD as every other row, so the optimizer state they hold is zero
# here (labs 11 and 12 use Adam). ZeRO-1: torch DDP averages the gradients, and the optimizer
# keeps the state of each rank's share, steps it and broadcasts it; compare counts the broadcasts
# at the observing group.

def _zero_rows(make_optimizer):
    def build(module, bucket_cap_mb=None, process_group=None, recorder=None, device_ids=None):
        built = build_strategy("ddp", module, bucket_cap_mb=bucket_cap_mb, process_group=process_group,
                               recorder=recorder, device_ids=device_ids)
        built.optimizer = lambda params, **kw: make_optimizer(params, process_group, **kw)
        return built
    return build


def _sharded(params, process_group, **kw):
    import torch

    from ddplab.sync.core.sharded_optimizer import ShardedOptimizer

    return ShardedOptimizer(params, torch.optim.SGD, process_group=process_group, **kw)


def _torch_zero_optimizer(params, process_group, **kw):
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, torch.optim.SGD, process_group=process_group, **kw)


register_strategy("zero1", _zero_rows(_sharded), shape="torch_ddp", time_unrecorded=True,
                  description="torch DDP + ddplab.ShardedOptimizer: each rank steps its share "
                              "of the parameters and broadcasts it")
register_strategy("torch_zero", _zero_rows(_torch_zero_optimizer), shape="torch_ddp",
                  time_unrecorded=True,
                  description="torch DDP + torch's ZeroRedundancyOptimizer (the reference)")


@register_strategy("zero2", shape="after_backward_flat")
def _zero2(module, process_group=None):
    """ZeRO-2 as the paper has it, no DDP: reduce-scatter the gradients, step a slice, all-gather

    All its traffic is in the optimizer's step (``Built.optimizer``: ddplab.sync.core.zero2's
    ZeroTwo over plain SGD, like the other rows), and it sends DDP's ring bytes.
    """
    def optimizer(params, **kw):
        import torch

        from ddplab.sync.core.zero2 import ZeroTwo

        return ZeroTwo(params, torch.optim.SGD, process_group=process_group, **kw)

    return Built(module, optimizer=optimizer)


# -- sharded data parallel (after DDP): drawn from the observing process group ---------

@register_strategy("fsdp", shape="buckets")
def _fsdp(module, compute_dtype=None, process_group=None):
    """the reference FSDP: per layer, all-gather before forward and backward, reduce-scatter"""
    from ddplab.sync.core.fsdp import FSDP

    model = FSDP(module, compute_dtype=compute_dtype, process_group=process_group)
    return model, model.finish_gradient_synchronization


@register_strategy("torch_fsdp2", shape="buckets")
def _torch_fsdp2(module, process_group=None):
    """torch's fully_shard on each unit ddplab's FSDP makes (Linear, Embedding, MultiheadAttention), then on the model

    An ``nn.MultiheadAttention`` is one unit with its ``out_proj``: its forward hands
    ``out_proj.weight`` to ``F.multi_head_attention_forward`` without calling ``out_proj``, so
    ``fully_shard(out_proj)``'s hooks would never gather it (the forward then meets a sharded
    DTensor beside plain tensors and raises). Parameters outside every unit (a LayerNorm's)
    are left to ``fully_shard(model)``, the root, which shards them too.
    """
    from torch.distributed.fsdp import fully_shard

    from ddplab.sync.core.fsdp import unit_owners

    mesh = None  # fully_shard's default: a 1-D mesh over every rank
    if process_group is not None:  # a 1-D mesh over the group's ranks
        from torch.distributed.device_mesh import DeviceMesh

        from ddplab.pg.backend import device

        mesh = DeviceMesh.from_group(process_group, device().type)
    units = {id(u) for u in unit_owners(module).values() if u is not None and u is not module}
    for m in reversed(list(module.modules())):  # inner units first, as fully_shard expects
        if id(m) in units:
            fully_shard(m, mesh=mesh)
    return fully_shard(module, mesh=mesh)


@register_strategy("fsdp_overlap", shape="buckets")
def _fsdp_overlap(module, compute_dtype=None, reshard_after_forward=True, process_group=None):
    """FSDP with overlap: the next layer's all-gather runs under this layer's compute"""
    from ddplab.sync.fsdp_overlap import OverlapFSDP

    model = OverlapFSDP(module, compute_dtype=compute_dtype, process_group=process_group,
                        reshard_after_forward=reshard_after_forward)
    return model, model.finish_gradient_synchronization
