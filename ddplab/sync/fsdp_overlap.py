"""FSDP with overlap: the next unit's all-gather runs while this unit computes.

What it teaches. The reference ``ddplab.FSDP`` (ddplab/sync/core/fsdp.py) waits
for every collective where it makes it, so each unit's all-gather stands between
the previous unit's compute and its own. ``OverlapFSDP`` is that FSDP, hooks and
flat shards unchanged, with the collectives moved off the critical path, as
torch's ``fully_shard`` (FSDP2) moves them:

1. forward prefetch: in a unit's pre-forward hook, once its own weights are in,
   the NEXT unit's all-gather is issued (``async_op=True``) before this unit
   computes. The order is the one the previous step's forward ran in (the first
   step has none and prefetches nothing), as ``set_modules_to_forward_prefetch``
   gives FSDP2 an explicit next unit;
2. backward prefetch: just before a unit's backward (its output's gradient
   hook), the unit that ran BEFORE it in this step's forward is gathered
   asynchronously: backward meets units in reverse forward order. This is
   FSDP2's implicit backward prefetch (``FSDPParamGroup._backward_prefetch``:
   ``post_forward_order[i - 1]``);
3. reduce-scatters issued async once a unit's backward is done, one in flight:
   the previous one is waited for when the next is issued (FSDP2's
   ``post_backward`` waits for its oldest, ``reduce_scatter_max_input_buffers``
   being 1 by default), the last at the end of backward (the final callback, as
   FSDP2's ``_root_post_backward_final_callback``);
4. ``reshard_after_forward=False``: the full weights stay from forward to
   backward, so backward gathers nothing (more memory, a third less traffic).
   A unit that IS the wrapped model (the root) always stays gathered after
   forward: FSDP2 does the same for the root when ``reshard_after_forward`` is
   left at its default (``FSDPState._lazy_init`` sets the root's
   ``post_forward_mesh_info = None``: "the parameters would be freed and
   all-gathered immediately"). Parameters outside every unit are replicated
   here, whole on every rank, as in the reference;
5. ``reduce_dtype``: each gradient is cast to it before the reduce-scatter
   (float32 by default, the reference's choice), the rank's piece is averaged
   in that dtype and cast back to float32 for the shard's ``.grad``.
   ``compute_dtype`` plays FSDP2's ``param_dtype``, as in the reference.

What a prefetch costs: one unit's full weights more alive at a time.

Leaves out, next to ``fully_shard``: CUDA streams and events (on gloo the
collective runs on the backend's own threads; on a GPU FSDP2 also overlaps
the copy-out with separate streams); a prefetch limit other than one unit;
explicit prefetch lists per unit; the ``int`` form of
``reshard_after_forward`` (reshard to a smaller group); FSDP2's pre/post
divide factors for float16 (here: sum, then divide); everything the
reference leaves out (DTensor, offload, HSDP, no_sync).

References: torch/distributed/fsdp/_fully_shard/: _fsdp_state.py
(``_pre_forward``, ``_pre_backward``, ``_lazy_init``,
``_root_post_backward_final_callback``), _fsdp_param_group.py (``unshard``,
``wait_for_unshard``, ``_backward_prefetch``, ``_prefetch_unshard``,
``post_backward``), _fully_shard.py (``set_modules_to_forward_prefetch``,
``set_modules_to_backward_prefetch``, ``MixedPrecisionPolicy``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddplab.sync.core.fsdp import FSDP, Unit, pad


class OverlapFSDP(FSDP):
    """``ddplab.FSDP`` with prefetched all-gathers and async reduce-scatters.

        model = OverlapFSDP(net, reshard_after_forward=True, reduce_dtype=torch.float32)
        loss_fn(model(x), y).backward()          # gathers ahead, reduce-scatters behind
        model.finish_gradient_synchronization()  # the replicated parameters
        opt.step()
    """

    def __init__(self, module, compute_dtype=None, reshard_after_forward: bool = True,
                 reduce_dtype=None, prefetch: bool = True, **options):
        if not isinstance(reshard_after_forward, bool):
            raise TypeError("reshard_after_forward must be True or False (FSDP2's int form, "
                            "resharding to a smaller group, is not taught here)")
        if reduce_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"reduce_dtype must be None, float32, float16 or bfloat16, "
                             f"not {reduce_dtype}")
        super().__init__(module, compute_dtype=compute_dtype, **options)
        self.reshard_after_forward = reshard_after_forward
        self.reduce_dtype = reduce_dtype or torch.float32
        self.prefetch = prefetch
        self._pending = {}  # id(unit) -> (work, gathered buffer): an all-gather in flight
        self._reducing = []  # (unit, work, this rank's piece, rows kept alive, which had grads)
        self._forward_order, self._last_forward_order = [], []  # units, as their forwards ran
        self._keeping = None  # the unit whose post-forward keeps it gathered

    # -- all-gather: issue now, wait when the unit needs its weights ------------------------

    def _issue(self, unit: Unit) -> None:
        """Start the unit's all-gather (async) unless it is gathered or already on its way."""
        if unit.gathered or id(unit) in self._pending:
            return
        pieces = torch.cat([sp.shard.detach().to(self.compute_dtype) for sp in unit.params])
        gathered = pieces.new_empty(self.world_size * pieces.numel())
        work = dist.all_gather_single(gathered, pieces, group=self.process_group, async_op=True)
        self._pending[id(unit)] = (work, gathered)

    def all_gather(self, unit: Unit) -> list:
        """The unit's full weights: from its prefetched all-gather if one is in flight."""
        self._issue(unit)
        work, gathered = self._pending.pop(id(unit))
        work.wait()
        columns = gathered.view(self.world_size, -1).split(
            [sp.shard_numel for sp in unit.params], dim=1)
        return [c.reshape(-1)[:sp.numel].view(sp.shape) for sp, c in zip(unit.params, columns)]

    def _drop_pending(self, unit: Unit) -> None:
        """A prefetch nobody used: wait for it (the group needs every call finished) and drop it."""
        pending = self._pending.pop(id(unit), None)
        if pending is not None:
            pending[0].wait()

    # -- the hooks: the reference's, with a prefetch after each unshard ----------------------

    def _unshard(self, unit: Unit) -> None:
        super()._unshard(unit)  # waits for this unit's own all-gather (prefetched or not)
        if not self.prefetch:
            return
        if _in_backward():  # backward runs units in reverse forward order: the one before
            order = self._forward_order
            # the last time this unit ran in forward; the unit before that is backward's next
            at = max((i for i, u in enumerate(order) if u is unit), default=None)
            if at:
                self._issue(order[at - 1])
        else:
            self._forward_order.append(unit)
            nxt = _after(self._last_forward_order, unit)
            if nxt is not None:
                self._issue(nxt)

    def _reshard(self, unit: Unit) -> None:
        self._drop_pending(unit)
        if unit is self._keeping:  # kept gathered until backward: the shards go back, the
            for m, pname, sp in unit.slots:  # full weights stay (the next _unshard finds them)
                m._parameters[pname] = sp.shard
            return
        super()._reshard(unit)

    def _post_forward(self, unit: Unit):
        hook = super()._post_forward(unit)  # (registered by FSDP.__init__, before ours is set)

        def post_forward(module, args, output):
            keep = not self.reshard_after_forward or unit.module is self.module  # the root
            if not (keep and torch.is_grad_enabled()):  # no backward, nothing to keep for
                return hook(module, args, output)
            self._keeping = unit
            try:
                return hook(module, args, output)
            finally:
                self._keeping = None
        return post_forward

    # -- reduce-scatter: issue when the unit's backward is done, wait at the end of backward --

    def _post_backward(self, unit: Unit) -> None:
        grads = [full.grad for full in unit.fulls]
        if any(g is not None for g in grads):
            for full in unit.fulls:
                full.grad = None
            sizes = [sp.shard_numel for sp in unit.params]
            rows = torch.cat([  # each gradient in reduce_dtype, padded, one row per rank
                pad(sp.shard[:0].to(self.reduce_dtype) if g is None
                    else g.reshape(-1).to(self.reduce_dtype), n * self.world_size)
                .view(self.world_size, n) for sp, n, g in zip(unit.params, sizes, grads)], dim=1)
            mine = rows.new_empty(sum(sizes))
            # one reduce-scatter in flight at a time: the previous one is finished first, as
            # FSDP2 waits for its oldest before the next (reduce_scatter_max_input_buffers=1)
            self._finish_reduces()
            work = dist.reduce_scatter_single(mine, rows.reshape(-1), group=self.process_group,
                                              async_op=True)
            self._reducing.append((unit, work, mine, rows, [g is not None for g in grads]))
        self._reshard(unit)

    def _finish_reduces(self) -> None:
        """Wait for the reduce-scatters in flight and add each rank's piece to its shard's .grad."""
        for unit, work, mine, _rows, had in self._reducing:
            work.wait()
            mine /= self.world_size  # averaged in reduce_dtype, as FSDP2 averages
            sizes = [sp.shard_numel for sp in unit.params]
            for sp, piece, got in zip(unit.params, mine.split(sizes), had):
                if got:
                    piece = piece.to(torch.float32)  # back to the master weights' dtype
                    sp.shard.grad = piece.clone() if sp.shard.grad is None else sp.shard.grad + piece
        self._reducing = []

    def _final(self) -> None:
        super()._final()  # units whose backward had no end of their own, then every unit resharded
        self._finish_reduces()
        self._last_forward_order = _first_calls(self._forward_order)
        self._forward_order = []

    def _forward(self, *args, **kwargs):
        if self._forward_order:  # a forward without a backward since (validation): its order
            self._last_forward_order = _first_calls(self._forward_order)  # counts, and the
            self._forward_order = []  # list starts afresh, so that it never grows
        output = super()._forward(*args, **kwargs)
        for unit in self.units:  # prefetched for a unit this forward did not call: dropped
            if unit.gathered is False:
                self._drop_pending(unit)
        return output


def _in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (the reference asks alike)."""
    return torch._C._current_graph_task_id() != -1


def _after(order: list, unit: Unit):
    """The unit after ``unit``'s first place in ``order``, or None."""
    for i, u in enumerate(order[:-1]):
        if u is unit:
            return order[i + 1]
    return None


def _first_calls(order: list) -> list:
    """``order`` with each unit at its first call only (a unit called twice is prefetched once)."""
    seen, out = set(), []
    for u in order:
        if id(u) not in seen:
            seen.add(id(u))
            out.append(u)
    return out
