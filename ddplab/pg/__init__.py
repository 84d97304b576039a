"""The observing process group: the bottom room every rank joins through.

One entry point: ``ddplab.pg.group.ObservingGroup``, a Python ``dist.ProcessGroup``
(backends ``ddplab_gloo`` and ``ddplab_nccl``) that hands every op to a real gloo or
NCCL group and tells the observers installed on it (``group.observe``) what ran.

- ``group``: the group itself, ``observing_group()`` to find it, ``observe()`` to watch it;
- ``works``: what an observer is (``ObserverBase``) and the works callers get back;
- ``inner``: the real gloo and NCCL groups inside it and their two limits;
- ``p2p_blocks``: NCCL's coalesced sends and recvs (one group depth per thread);
- ``p2p_watch``: sends and recvs counted and paired for the lessons and graders;
- ``backend``: backend strings, ``init_group`` on a rank, ``device()``.
"""
