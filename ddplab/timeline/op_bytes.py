"""Bytes per collective, counted where they pass: at the observing process group.

Teaches: what travels is read at the group, not worked out. ``OpBytes`` is an
observer (``ddplab.pg.group``): inside ``with observe(OpBytes()) as
c:`` every op the group is handed adds its payload bytes to ``c.nbytes`` and
to ``c.by_op[op]`` ("all_reduce", "broadcast", "all_gather", ...). A
sharded optimizer's broadcasts, FSDP's all-gathers and reduce-scatters are
counted the same way as DDP's all-reduces.

Leaves out: timing (``ddplab.timeline.on_group.GroupRecorder`` draws the
all-reduces), and what a ring moves on the wire per rank (this is the
payload handed to the group, as torch's DDP logging counts it).
References: ddplab.pg.group (the observing group).
"""
from __future__ import annotations

from ddplab.pg.group import ObserverBase
from ddplab.pg.inner import payload_bytes


class OpBytes(ObserverBase):
    """Counts the payload bytes and calls of every op seen, per op name."""

    def __init__(self):
        self.nbytes = 0
        self.by_op: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def launched(self, op, tensors, group, peer):
        n = sum(payload_bytes(t) for t in tensors)
        self.nbytes += n
        self.by_op[op] = self.by_op.get(op, 0) + n
        self.calls[op] = self.calls.get(op, 0) + 1
        return None
