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

Host cost per gradient tensor. torch's reducer is C++; here every gradient
costs one Python hook, so what each hook does is what this class costs.
With neither unused-parameter option and no sparse bucket (the default)
the hook takes a short path: find its (bucket, slot), refuse a second
firing, count the slot, and launch only when its bucket is full and next
in line. No torch call per gradient: the copies in and out are one fused
call per bucket (``bucket.py``, "What it costs"). At world size 1 on CPU
that puts this class at torch DDP's cost per tensor (it was 4.3-4.5 us
per tensor over it): benchmarks/per_tensor.py, figures in
docs/benchmarks.md. The options' checks run on the long path, unchanged.

torch's options, same names, same meaning (each tested against torch DDP
with the same option in tests/test_sync_options.py):

- ``first_bucket_cap_mb``: a smaller cap for bucket 0, which is what torch's
  ``bucket_cap_mb=None`` means (see ``bucket.py``);
- ``find_unused_parameters``: parameters that get no gradient in a step
  (a branch skipped on some iterations or some ranks) are found by walking
  the autograd graph at forward and marked ready at backward's first hook;
  one small all-reduce tells which were unused on every rank (``unused.py``);
- ``gradient_as_bucket_view``: ``param.grad`` is a view into its bucket's
  buffer, no copies in or out (``bucket.py``);
- ``static_graph``: the graph is declared the same every iteration, so
  what ``find_unused_parameters`` recomputes at every step is learned once.
  The first synchronizing backward only watches which hooks fire; at its
  end one all-reduce of the used map, then every bucket, in index order.
  From then on the unused set is reused: no graph walk, no used-map
  all-reduce. A parameter unused in the first iteration that gets a
  gradient later is an error, as in torch. A hook that fired k times in
  the first iteration (reentrant activation checkpointing reusing a layer)
  is ready at its k-th firing, as in torch. With both flags set,
  static_graph wins, as in torch. The three behaviours are three policy
  objects (``unused_policy.py``), picked once at construction;
- ``register_comm_hook(state, hook)``: torch's hook signature, and fp16/bf16
  compression (``comm_hooks.py``).

Sparse gradients (``nn.Embedding(sparse=True)``) get a bucket of their own
and are all-reduced as sparse tensors (``sparse.py``).

Leaves out, compared with torch DDP: see ``bucket.py`` (layout rebuilding),
``sparse.py`` (comm hooks on sparse gradients) and ``_common.py`` (device
placement, Join, mixed precision). A gradient hook that fires twice in one
backward without ``static_graph`` is an error, as in torch.

References: torch/csrc/distributed/c10d/reducer.cpp; torch/nn/parallel/
distributed.py; Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020; picotron/data_parallel/
data_parallel.py.
"""
from __future__ import annotations

import torch

from ddplab.sync._common import GradSyncModule
from ddplab.sync.bucket import Bucket, assign_buckets, check_bucket_cap
from ddplab.sync.comm_hooks import check_hook, run_hook
from ddplab.sync.sparse import SparseBucket, sparse_parameter_ids
from ddplab.sync.unused_policy import EveryParameterUsed, unused_policy


class BucketedDDP(GradSyncModule):
    """Wrap ``module``; gradients travel in buckets of at most ``bucket_cap_mb`` MB.

    ``.module``, ``.no_sync()``, ``.finish_gradient_synchronization()``,
    ``.register_comm_hook(state, hook)``, ``.buckets`` (``Bucket`` objects)
    and ``.bucket_layout`` (plain data). ``recorder`` (see
    ``ddplab.sync.comm``) receives grad-ready, launch, done and wait stamps
    by bucket index. The keyword options are torch's; see the module
    docstring.
    """

    def __init__(self, module, bucket_cap_mb: float = 25.0, process_group=None,
                 broadcast_buffers: bool = True, recorder=None, *,
                 first_bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False,
                 static_graph: bool = False):
        # Checked before anything talks to other ranks, so a typo fails at once.
        bucket_cap_mb = check_bucket_cap(bucket_cap_mb)
        if first_bucket_cap_mb is not None:
            first_bucket_cap_mb = check_bucket_cap(first_bucket_cap_mb, "first_bucket_cap_mb")
        self.find_unused_parameters = bool(find_unused_parameters)
        self.static_graph = bool(static_graph)
        super().__init__(module, process_group, broadcast_buffers, recorder,
                         mark_used=self.find_unused_parameters or self.static_graph)
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        sparse_ids = sparse_parameter_ids(module)
        sparse = {i for i, p in enumerate(self._params) if id(p) in sparse_ids}
        self.buckets = []
        self._where = {}  # parameter index -> (bucket, slot in the bucket)
        layout = assign_buckets(self._params, bucket_cap_mb, first_bucket_cap_mb, sparse=sparse)
        for b, indices in enumerate(layout):
            if indices[0] in sparse:
                i = indices[0]
                bucket = SparseBucket(b, self._params[i], self._names[i], self.world_size)
            else:
                bucket = Bucket(b, [self._params[i] for i in indices],
                                [self._names[i] for i in indices], self.world_size,
                                as_view=self.gradient_as_bucket_view)
            self.buckets.append(bucket)
            for slot, i in enumerate(indices):
                self._where[i] = (bucket, slot)
        self._next_bucket = 0  # the lowest bucket index not launched yet
        self._comm_hook = None  # (state, hook) once registered
        # none / find_unused_parameters / static_graph: see unused_policy.py
        self._policy = unused_policy(self.find_unused_parameters, self.static_graph,
                                     self._params, self.grad_marks, process_group, recorder)
        self._unused_marked = False  # this backward's unused parameters are marked ready
        # neither option and no sparse bucket: the hook takes its short path
        self._plain = type(self._policy) is EveryParameterUsed and not sparse

    @property
    def bucket_layout(self) -> list:
        return [{"index": b.index, "params": list(b.names), "nbytes": b.nbytes,
                 "numel": b.numel if isinstance(b, SparseBucket) else b.buffer.numel()}
                for b in self.buckets]

    def register_comm_hook(self, state, hook) -> None:
        """From the next backward on, ``hook(state, bucket)`` reduces each bucket
        (see ``ddplab.sync.comm_hooks``); gradients are no longer divided by
        the world size on the way in: the hook divides. Once per wrapper, as in torch."""
        check_hook(hook)
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once (as in torch); "
                               "wrap the model again to use another hook.")
        if self._hooks_fired:
            raise RuntimeError("register_comm_hook: a backward is under way; register the "
                               "hook between steps.")
        sparse = [b.names[0] for b in self.buckets if isinstance(b, SparseBucket)]
        if sparse:
            raise RuntimeError(f"register_comm_hook: parameter(s) {', '.join(sparse)} have sparse "
                               "gradients, and ddplab's comm hooks take dense buckets only. Use "
                               "sparse=False for those modules, or no comm hook.")
        self._comm_hook = (state, hook)
        for bucket in self.buckets:
            bucket.divide = False

    # -- forward: what this backward will not produce ------------------------------
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self._expect_hooks and torch.is_grad_enabled():
            self._policy.at_forward(out)
        return out

    # -- backward --------------------------------------------------------------------
    def _bucket_of(self, index) -> int:
        return self._where[index][0].index

    def _grad_ready(self, index, param):
        bucket, slot = self._where[index]
        if self._plain:  # no unused-parameter policy: the path every step takes by default
            ready = bucket.ready_slots
            if ready[slot]:
                raise self._ready_twice(index)
            ready[slot] = True
            bucket.n_ready += 1
            # only a full bucket that is next in line can launch anything
            if bucket.n_ready == bucket.size and bucket.index == self._next_bucket:
                self._launch_ready()
            return
        policy = self._policy
        if policy.watching:  # static_graph's first backward: only watch
            policy.watch(index)
            return
        if policy.unused:
            if not self._unused_marked:  # first hook of this backward
                self._unused_marked = True
                for i in sorted(policy.unused):
                    b, s = self._where[i]
                    b.add_grad(s, self._params[i].grad)
            if index in policy.unused:
                raise policy.unexpected(self._names[index])
        if policy.fires_needed and index in policy.fires_needed and not policy.last_fire(index):
            return  # static_graph: this hook fires again later in this backward
        if bucket.ready_slots[slot]:
            raise self._ready_twice(index)
        bucket.add_grad(slot, param.grad)
        self._launch_ready()

    def _launch_ready(self):
        # Launch every bucket that is ready and has no unlaunched bucket before it.
        n = len(self.buckets)
        while self._next_bucket < n and self.buckets[self._next_bucket].ready:
            bucket = self.buckets[self._next_bucket]
            if isinstance(bucket, Bucket):  # its copies, all at once (sparse: made at add_grad)
                bucket.fill()
            if self._comm_hook is None:
                bucket.launch(self.process_group, self.recorder)
            else:
                state, hook = self._comm_hook
                bucket.future = run_hook(state, hook, bucket, n, self.recorder)
            self._next_bucket += 1
            if self._next_bucket == n:
                self._policy.all_launched()

    def _learn_static_graph(self):
        """End of static_graph's first iteration: learn, then reduce everything."""
        self._policy.learn()
        for i, p in enumerate(self._params):  # None contributes zeros
            bucket, slot = self._where[i]
            bucket.add_grad(slot, p.grad)
        self._launch_ready()

    def _wait_launched(self):
        if self._policy.watching:
            self._learn_static_graph()
        reduced = [b.wait() for b in self.buckets[: self._next_bucket]]
        skip: dict = {}
        for i in self._policy.unused_everywhere():
            bucket, slot = self._where[i]
            skip.setdefault(bucket.index, set()).add(slot)
        for bucket, out in zip(self.buckets, reduced):
            bucket.write_back(out, skip.get(bucket.index, ()))

    def _missing_hint(self) -> str:
        return self._policy.missing_hint

    def _not_ready(self):
        return [n for b in self.buckets if not b.ready for n in b.missing()]

    def _reset(self):
        for bucket in self.buckets:
            bucket.reset()
        self._next_bucket = 0
        self._unused_marked = False
        self._policy.reset()
