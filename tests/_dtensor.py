"""A fully_shard parameter gathered whole, for the FSDP tests that compare with torch's own."""
import torch
import torch.distributed as dist


def full_tensor(p):
    """A DTensor sharded on dim 0, gathered by hand: ``full_tensor()`` makes a coalesced
    all-gather that gloo does not have (through the observing group)."""
    local, ws = p.to_local().detach(), dist.get_world_size()
    rows = -(-p.shape[0] // ws)  # fully_shard's chunks: the last ones short or empty
    padded = torch.zeros((rows, *p.shape[1:]))
    padded[:local.shape[0]] = local
    out = torch.empty((rows * ws, *p.shape[1:]))
    dist.all_gather_single(out, padded)
    return out[:p.shape[0]]
