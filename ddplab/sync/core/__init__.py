"""The reference reducers: gradient synchronization in plain torch.distributed, one file each.

Read them in this order; each is complete on its own:

- ``average.py``: ``average_gradients`` (one all-reduce per parameter, after
  backward) and ``average_gradients_flat`` (one all-reduce of a flat buffer);
- ``overlap.py``: ``OverlapDDP``, one async all-reduce per parameter launched
  from its post-accumulate-grad hook while backward goes on;
- ``bucketed.py``: ``BucketedDDP``, torch's design in torch's words
  (``autograd_hook``, ``mark_variable_ready``, ``mark_bucket_ready``,
  ``finalize_backward``, buckets assigned by size in reverse order and
  launched in index order) with ``no_sync``;
- ``fsdp.py``: ``FSDP``, after DDP: each rank keeps a shard of every layer's
  weights, all-gathers a layer just before its forward and its backward, and
  reduce-scatters its gradients.

After DDP, sharding: ``sharded_optimizer.py``, ``ShardedOptimizer`` (ZeRO
stage 1): each rank keeps the optimizer state of its share of the
parameters, steps it, and broadcasts the updated parameters.

They make the collective calls a learner would write, with nothing else on
them: ddplab draws their timelines by watching the process group from
outside. They refuse options they do not support, naming the full
implementation that does (``ddplab.average_gradients``, ``ddplab.OverlapDDP``,
``ddplab.BucketedDDP``: options, edge cases, speed), which is tested to train
exactly like these and like torch's DistributedDataParallel
(tests/sync/test_sync_differential.py).
"""
from ddplab.sync.core.average import average_gradients, average_gradients_flat, broadcast_parameters
from ddplab.sync.core.bucketed import BucketedDDP, compute_bucket_assignment_by_size
from ddplab.sync.core.fsdp import FSDP
from ddplab.sync.core.overlap import OverlapDDP
from ddplab.sync.core.sharded_optimizer import ShardedOptimizer

__all__ = ["average_gradients", "average_gradients_flat", "broadcast_parameters", "OverlapDDP",
           "BucketedDDP", "compute_bucket_assignment_by_size", "ShardedOptimizer", "FSDP"]
