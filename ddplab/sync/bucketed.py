"""BucketedDDP: gradients grouped in buckets, each all-reduced as soon as it can be.

Teaches how torch's DistributedDataParallel really synchronizes: the
parameters are split into buckets of at most ``bucket_cap_mb`` (see
``bucket.py`` for the rule), each bucket owns one flat buffer, and a hook on
every parameter copies its gradient in. A bucket whose gradients are all in
is launched as ONE async all-reduce, while backward goes on computing the
earlier layers. That gives fewer, larger messages than OverlapDDP, and the
overlap with backward that ``average_gradients`` lacks.

Buckets are launched strictly in index order: bucket k leaves only once it
and every bucket before it are ready. Ranks pair collectives by the order
they are called in, so if one rank launched bucket 2 before bucket 1 (its
gradients happened to be ready in another order) the ranks would add up
the wrong buffers. torch's reducer keeps the same rule.

    model = BucketedDDP(model, bucket_cap_mb=25.0)
    loss_fn(model(x), y).backward()   # buckets leave during backward;
    optimizer.step()                  # the wait ran at the end of backward

``model.bucket_layout`` lists each bucket's parameter names and bytes.

Leaves out, compared with torch DDP: see ``bucket.py`` (layout rebuilding,
gradient_as_bucket_view, the small first bucket) and ``_common.py``
(find_unused_parameters, static_graph, device placement, Join, comm hooks).

References: torch/csrc/distributed/c10d/reducer.cpp; Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020;
picotron/data_parallel/data_parallel.py.
"""
from __future__ import annotations

from ._common import GradSyncModule
from .bucket import Bucket, assign_buckets, check_bucket_cap


class BucketedDDP(GradSyncModule):
    """Wrap ``module``; gradients travel in buckets of at most ``bucket_cap_mb`` MB.

    ``.module``, ``.no_sync()``, ``.finish_gradient_synchronization()``,
    ``.buckets`` (``Bucket`` objects) and ``.bucket_layout`` (plain data).
    ``recorder`` (see ``ddplab.sync.comm``) receives grad-ready, launch,
    done and wait stamps by bucket index.
    """

    def __init__(self, module, bucket_cap_mb: float = 25.0, process_group=None,
                 broadcast_buffers: bool = True, recorder=None):
        # Checked before anything talks to other ranks, so a typo fails at once.
        bucket_cap_mb = check_bucket_cap(bucket_cap_mb)
        super().__init__(module, process_group, broadcast_buffers, recorder)
        self.bucket_cap_mb = bucket_cap_mb
        self.buckets = []
        self._where = {}  # parameter index -> (bucket, slot in the bucket)
        for b, indices in enumerate(assign_buckets(self._params, self.bucket_cap_mb)):
            bucket = Bucket(b, [self._params[i] for i in indices],
                            [self._names[i] for i in indices], self.world_size)
            self.buckets.append(bucket)
            for slot, i in enumerate(indices):
                self._where[i] = (bucket, slot)
        self._next_bucket = 0  # the lowest bucket index not launched yet

    @property
    def bucket_layout(self) -> list:
        return [{"index": b.index, "params": list(b.names), "nbytes": b.nbytes,
                 "numel": b.buffer.numel()} for b in self.buckets]

    def _bucket_of(self, index) -> int:
        return self._where[index][0].index

    def _grad_ready(self, index, param):
        bucket, slot = self._where[index]
        bucket.add_grad(slot, param.grad)
        # Launch every bucket that is ready and has no unlaunched bucket before it.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].ready:
            self.buckets[self._next_bucket].launch(self.process_group, self.recorder)
            self._next_bucket += 1

    def _wait_launched(self):
        for bucket in self.buckets[: self._next_bucket]:
            bucket.wait_and_write_back()

    def _not_ready(self):
        return [n for b in self.buckets for n in b.missing()]

    def _reset(self):
        for bucket in self.buckets:
            bucket.reset()
        self._next_bucket = 0
