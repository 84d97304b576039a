"""Gradient synchronization three ways, each checked against torch's own DDP.

- ``average_gradients(model, group=None, flat=False)``: by hand, after backward.
- ``OverlapDDP(module)``: one async all-reduce per parameter, launched from
  its post-accumulate-grad hook while backward goes on.
- ``BucketedDDP(module, bucket_cap_mb=None)``: torch DDP's design and torch's
  bucket layouts (``layout``), launched in index order as soon as they are ready;
  with torch's options ``find_unused_parameters``, ``gradient_as_bucket_view``,
  ``static_graph``, a small first bucket (``first_bucket_cap_mb``) and
  ``register_comm_hook`` (hooks, fp16/bf16 compression: ``comm_hooks``);
  what it does about unused parameters is one policy object per option
  (``unused_policy``), and sparse gradients get buckets of one (``sparse``).

Where they part from torch's DDP they raise at the first step, naming the
parameter and what to do, rather than train wrong in silence
(tests/sync/test_sync_torch_parity.py, tests/sync/test_sync_differential.py).

The reference versions of all three, in plain torch.distributed calls, one
file each, are ``ddplab.sync.core``: read those first.

Every collective goes through ``ddplab.sync.comm`` (bytes counted, optional
recorder, the place a simulated link attaches). These modules know nothing
about notebooks or clusters: they take a module and an optional process group.
"""
# Names load on first use (PEP 562): importing the package must not import torch, because the
# widgets and the front doors read the strategy registry (ddplab.sync.registry) without training.
_NAMES = {
    "average_gradients": "manual", "broadcast_parameters": "manual", "OverlapDDP": "overlap",
    "BucketedDDP": "bucketed", "counting": "comm", "ListRecorder": "comm",
    "assign_buckets": "layout", "MB": "layout",
}

__all__ = ["average_gradients", "broadcast_parameters", "OverlapDDP", "BucketedDDP", "comm",
           "comm_hooks", "counting", "ListRecorder", "assign_buckets", "MB"]


def __getattr__(name):
    import importlib

    if name in ("comm", "comm_hooks"):
        return importlib.import_module(f"ddplab.sync.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"ddplab.sync.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'ddplab.sync' has no attribute {name!r}")
