"""How a recording's parts reach rank 0 off the training step: a gloo group of its own.

Teaches: collectives on one process group must be issued in the same order on every
rank, because that order is all that pairs rank 0's call with rank 1's (torch says so for
gloo in ProcessGroupGloo.hpp: "All functions on this class are expected to be called in
the same order across processes in the group [...] For multi-threaded usage of process
groups, you can consider using multiple process group instances"). ``ddplab.record``
gathers the ranks' parts after the last step asked for, while your loop goes on; had it
gathered on the training's group from a thread, its all-gather could have met the other
rank's next gradient all-reduce. So it gathers on a second group, used by that thread alone:

- made when ``ddplab.record()`` is called, on every rank at the same point of the script.
  Making it is itself a meeting of the ranks: each rank posts its address in the job's
  store and connects to every other (gloo's full mesh), so ``record()`` waits for the
  others, for ``FINISH_TIMEOUT_S`` at most, then says in words that a rank did not come.
  The ranks agree on the group's name with no message: each counts itself in at the store
  (``store.add``), and a rank that gives up counts itself out again and marks that name
  spoiled (the address it posted there is closed), so the next meeting takes a fresh one;
- gloo, also under NCCL: the parts travel pickled, in CPU tensors, so no GPU and no current
  CUDA device is needed for them;
- a ``ProcessGroupGloo`` built over a ``PrefixStore`` of the job's store, as torch builds
  its own helper group for ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``_create_process_group_wrapper``),
  and not with ``dist.new_group``: a group from ``new_group`` is registered with torch, and
  ``dist.destroy_process_group()``, which most scripts call right after their loop, would
  take it away while the gather may still run. This one outlives it; its threads end when
  the recorder lets go of it (after the gather).

Once every rank has passed the gathering's first barrier, rank 0 deletes the meeting's count
of spoiled tries from the store (each rank read it before making the group); the count of
meetings stays, since it numbers the next one.

Then, on a thread of the recorder's own: a barrier whose own time limit is finish()'s
``timeout`` (a rank that never finishes is said in words, not waited for until the group's
timeout), 9 rounds of clock readings (``ddplab.timeline.clock``), and the parts, gathered
as torch's ``all_gather_object`` does: the sizes first, then every part's bytes padded to
the longest.

Leaves out: gathering to rank 0 alone (``gather``, not ``all_gather``: every rank gets every
part, which is what torch's object collectives do on gloo too); a group that is lazily
connected (``TORCH_GLOO_LAZY_INIT=1`` makes gloo connect at the first op instead, so
``record()`` no longer waits for the others and the barrier does).
References: torch/csrc/distributed/c10d/ProcessGroupGloo.hpp (the order rule, the
constructor, TORCH_GLOO_LAZY_INIT); torch/csrc/distributed/c10d/Types.hpp (BarrierOptions'
own timeout, unset by default: the group's then); torch/distributed/distributed_c10d.py
(_create_process_group_wrapper, all_gather_object, _get_default_store).
"""
from __future__ import annotations

import pickle
from datetime import timedelta

from ddplab.timeline.clock import now, offsets_from

CLOCK_ROUNDS = 9  # as ddplab.timeline.clock.estimate_offsets


class SideGroup:
    """finish()'s own gloo group, over the ranks of the training's ``group``."""

    def __init__(self, group, timeout: float):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store  # torch has no public one

        ranks = dist.get_process_group_ranks(group)
        self.rank, self.world = dist.get_rank(group), len(ranks)
        store = _get_default_store()
        key = "ddplab.record/" + "_".join(map(str, ranks))
        # Which meeting this is, the same number on every rank with no message sent: each rank
        # counts itself in, and none can count itself into the next meeting before all have
        # met in this one (making the group waits for them), so the arrivals come in whole rounds.
        meeting = (store.add(key, 1) - 1) // self.world
        # A meeting that failed left its ranks' addresses in the store, under its name, and
        # those ports are closed now: the next meeting under the same number must not read
        # them (gloo would connect to a port no one listens on). So a rank that gives up
        # spoils the name first, and the ranks meet under the number of spoiled tries too.
        spoiled = f"{key}/{meeting}/spoiled"
        name = f"{key}/{meeting}/{store.add(spoiled, 0)}/"
        self._store, self._spoiled = store, spoiled
        try:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), self.rank,
                                            self.world, timedelta(seconds=timeout))
        except RuntimeError as e:
            store.add(spoiled, 1)
            # counted out again, so that the ranks' next record() meets under one number
            store.add(key, -1)
            raise RuntimeError(
                f"ddplab.record() on rank {self.rank}: the other ranks did not call ddplab.record() "
                f"within {timeout:g} s ({e}). It makes a gloo group of its own for the recording's "
                "gathering, which every rank joins: call it on every rank, at the same point of "
                "your script") from e

    def forget_meeting(self) -> None:
        """Rank 0, once every rank has passed the gathering's first barrier: the meeting's
        count of spoiled tries goes from the store (every rank read it before making the group,
        and the next meeting has a number of its own). The count of meetings stays: it numbers
        the next one. The addresses gloo posted under the group's prefix stay too: their names
        are gloo's own, and a store cannot list keys."""
        try:
            self._store.delete_key(self._spoiled)
        except (RuntimeError, NotImplementedError):  # a store that cannot delete: one key left
            pass

    def barrier(self, timeout: float) -> None:
        """A barrier that gives up after ``timeout`` seconds (its own limit, not the group's)."""
        import torch.distributed as dist

        opts = dist.BarrierOptions()
        opts.timeout = timedelta(seconds=timeout)
        self.pg.barrier(opts).wait()

    def all_gather(self, tensor) -> list:
        import torch

        out = [torch.empty_like(tensor) for _ in range(self.world)]
        self.pg.allgather([out], [tensor]).wait()
        return out

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, as torch's all_gather_object: sizes, then padded bytes."""
        import torch

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [int(s) for s in self.all_gather(torch.tensor([data.numel()], dtype=torch.int64))]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:data.numel()] = data
        return [pickle.loads(t[:n].numpy().tobytes()) for t, n in zip(self.all_gather(padded), sizes)]

    def clock(self, rounds: int = CLOCK_ROUNDS) -> dict:
        """The ranks' clock offsets from rank 0's, as ``ddplab.timeline.clock.estimate_offsets``."""
        import torch

        samples = []
        for _ in range(rounds):
            self.pg.barrier().wait()
            readings = self.all_gather(torch.tensor([now()], dtype=torch.float64))
            samples.append([r.item() - readings[0].item() for r in readings])
        return offsets_from(samples)

    def close(self) -> None:
        """Let go of the group: gloo's threads and connections end with it."""
        self.pg = None


def gather(part: dict, side: SideGroup, timeout: float):
    """finish()'s collectives, on ``side``: (clock offsets, every rank's part), or an error in words.

    A rank that never comes (its loop ended sooner, it skipped finish()) must not keep the
    others here until the group's own timeout: the first barrier waits ``timeout`` seconds
    at most. A rank that died makes the collectives fail; said the same way."""
    try:
        side.barrier(timeout)
        if side.rank == 0:  # every rank has made the group: its meeting's key can go
            side.forget_meeting()
        clock = side.clock()
        parts = side.all_gather_object(part)
    except RuntimeError as e:
        raise RuntimeError(
            f"ddplab.record: finish() on rank {side.rank} could not gather the run ({e}); nothing "
            f"was written. Every rank must reach finish() within {timeout:g} s: call "
            "rec.finish() on every rank at the same point of the loop (or let it finish by "
            "itself at the end of the last step asked for)") from e
    return clock, parts
