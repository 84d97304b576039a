"""compare()'s sharded rows: ZeRO-1 and FSDP, ddplab's references beside torch's.

Teaches nothing by itself: it registers four strategies in the one registry
(``ddplab.sync.registry``) so compare(), the panel and the benchmarks build them the way
they build every other row: ``zero1`` (torch DDP + ``ddplab.ShardedOptimizer``),
``torch_zero`` (torch DDP + ``ZeroRedundancyOptimizer``), ``fsdp`` (``ddplab.FSDP``) and
``torch_fsdp2`` (``fully_shard`` on every Linear and Embedding, then on the model).

Leaves out, compared with torch: the rows use the same plain SGD as every other row, so the
optimizer state they hold is zero here (labs 11 and 12 use Adam).

References: torch/distributed/optim/zero_redundancy_optimizer.py;
torch/distributed/fsdp/_fully_shard/_fully_shard.py.
"""
from ddplab.sync.registry import build_strategy, register_strategy

# -- sharding the optimizer (ZeRO-1): torch DDP averages the gradients, and the
# optimizer (the same SGD as every other row's) keeps the state of each rank's share,
# steps it and broadcasts it; compare counts the broadcasts at the observing group ----

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


# -- sharded data parallel (after DDP): drawn from the observing process group ---------

@register_strategy("fsdp", shape="buckets")
def _fsdp(module, compute_dtype=None, process_group=None):
    """the reference FSDP: per layer, all-gather before forward and backward, reduce-scatter"""
    from ddplab.sync.core.fsdp import FSDP

    model = FSDP(module, compute_dtype=compute_dtype, process_group=process_group)
    return model, model.finish_gradient_synchronization


@register_strategy("torch_fsdp2", shape="buckets")
def _torch_fsdp2(module):
    """torch's fully_shard on every nn.Linear and nn.Embedding, then on the model"""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for m in list(module.modules()):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            fully_shard(m)
    return fully_shard(module)
