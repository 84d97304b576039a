"""Comm hooks: take over how each bucket is reduced, with torch's hook signature.

Teaches what ``DistributedDataParallel.register_comm_hook(state, hook)``
hands you and what it expects back, on ddplab's own BucketedDDP:

- ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` is called
  once per bucket per synchronizing backward, in bucket index order, as
  soon as the bucket (and every bucket before it) is ready. ``state`` is
  whatever you registered (torch's own hooks take the process group, with
  ``None`` meaning the default group);
- ``bucket`` (``GradBucket``) has torch's methods: ``index()``,
  ``buffer()`` (the flat gradients), ``gradients()`` (one view per
  parameter, shaped like it), ``parameters()``, ``is_last()``;
- with a hook registered the wrapper no longer divides by the world size
  while copying gradients in: the hook must (every hook here does);
- the future's value (a tensor shaped like ``buffer()``) is what lands in
  ``param.grad``. It may finish on the backend's thread; the wrapper waits
  for it at the end of backward.

Three hooks, named as in torch.distributed.algorithms.ddp_comm_hooks.
default_hooks: ``allreduce_hook`` (what happens without a hook: divide,
SUM-all-reduce), ``fp16_compress_hook`` and ``bf16_compress_hook`` (cast
the bucket to 16 bits, divide, all-reduce, copy back into the bucket: half
the bytes on the wire, for ~3 (fp16) or ~2 (bf16) significant decimal
digits; fp16 can overflow above 65504, bf16 keeps float32's range). Each
sends through ``all_reduce_bucket``, i.e. ``ddplab.sync.comm``, so the
halved bytes are counted and recorded like any other gradient traffic.

torch's own hooks also run on BucketedDDP (same signature, same methods),
but they call torch.distributed directly: their traffic bypasses the
choke point and is not counted. Write yours with ``all_reduce_bucket``.

Measured on torch 2.13: gloo all-reduces float16 and bfloat16 CPU tensors,
yet torch DDP's ``register_comm_hook`` refuses a hook NAMED
``bf16_compress_hook`` unless CUDA with NCCL >= 2.10 (or XPU) is present.
BucketedDDP checks no names; the tests reach torch's bf16 hook through a
wrapper with another name to compare with it on CPU.

Leaves out, compared with torch: ``GradBucket.set_buffer`` (and so the
``fp16_compress_wrapper`` family), PowerSGD and the other stateful hooks,
``register_builtin_comm_hook`` (C++ hooks), hooks under torch.compile.

References: torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py;
torch/nn/parallel/distributed.py (``register_comm_hook``); torch's "DDP
Communication Hooks" documentation; Note [DDP Communication Hook] in
torch/csrc/distributed/c10d/reducer.cpp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddplab.sync import comm


class GradBucket:
    """One bucket as a comm hook sees it (torch.distributed.GradBucket's methods)."""

    __slots__ = ("_bucket", "_n_buckets", "_recorder")

    def __init__(self, bucket, n_buckets: int, recorder=None):
        self._bucket = bucket
        self._n_buckets = n_buckets
        self._recorder = recorder  # so all_reduce_bucket can stamp by bucket

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket, NOT yet divided by the world size."""
        return self._bucket.buffer

    def gradients(self) -> list:
        """One tensor per parameter: views into ``buffer()``, shaped like the parameters."""
        return list(self._bucket.views)

    def parameters(self) -> list:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """True for the last bucket of the step (the one holding the first layers)."""
        return self._bucket.index == self._n_buckets - 1

    def __repr__(self):
        return (f"GradBucket(index={self.index()}, params={len(self._bucket.params)}, "
                f"numel={self._bucket.buffer.numel()}, dtype={self._bucket.buffer.dtype})")


def all_reduce_bucket(process_group, bucket: GradBucket, tensor: torch.Tensor):
    """SUM-all-reduce ``tensor`` (the bucket's buffer, or a compressed copy)
    through ``ddplab.sync.comm``; returns a future whose value is ``tensor``."""
    work = comm.all_reduce(tensor, process_group, async_op=True, bucket=bucket.index(),
                           params=bucket._bucket.names, recorder=bucket._recorder)
    # A Work's future holds [tensor]; hooks hand on the tensor itself.
    return work.get_future().then(lambda fut: fut.value()[0])


def allreduce_hook(process_group, bucket: GradBucket):
    """Divide by the world size, then SUM-all-reduce: the same result as no hook."""
    # Divide first (as torch's hook does): the sum then stays in range.
    tensor = bucket.buffer().div_(dist.get_world_size(process_group))
    return all_reduce_bucket(process_group, bucket, tensor)


def _compress_hook(dtype, process_group, bucket: GradBucket):
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(process_group))

    def decompress(fut):
        # Back into the bucket's own buffer: no second full-size tensor.
        buffer.copy_(fut.value())
        return buffer

    return all_reduce_bucket(process_group, bucket, compressed).then(decompress)


def fp16_compress_hook(process_group, bucket: GradBucket):
    """Send the bucket as float16 (half the bytes of float32), divided by the world size."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket: GradBucket):
    """Send the bucket as bfloat16: half the bytes, float32's range, fewer mantissa bits."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


def check_hook(hook) -> None:
    if not callable(hook):
        raise TypeError(f"a comm hook must be callable as hook(state, bucket), got {hook!r}")


def run_hook(state, hook, bucket, n_buckets: int, recorder=None):
    """Call ``hook`` for one ddplab ``Bucket``; its future, checked."""
    fut = hook(state, GradBucket(bucket, n_buckets, recorder))
    # torch.futures.Future subclasses torch._C.Future; a Work's future and
    # what .then() returns are the base class, so that is what is checked.
    if not isinstance(fut, torch._C.Future):
        raise TypeError(
            f"comm hook {getattr(hook, '__name__', hook)!r} returned {type(fut).__name__} for "
            f"bucket {bucket.index}; it must return a torch.futures.Future whose value is the "
            "reduced bucket, e.g. all_reduce_bucket(state, bucket, bucket.buffer().div_(world)).")
    return fut
