"""BucketedDDP: gradients grouped in buckets, each all-reduced as soon as it can be.

Teaches how torch's DistributedDataParallel really synchronizes: the
parameters are split into buckets of about ``bucket_cap_mb`` (torch's rule
and torch's layouts, first iteration and rebuild: ``layout.py``), each
bucket owns one flat buffer, and a hook on every parameter marks its
gradient ready (``bucket.py``). The plain version, to read first, is
``ddplab.sync.core.bucketed``; this one adds torch's options, each one
named layer: ``layout`` (caps, rebuild), ``unused_policy`` (unused
parameters), ``sparse``, ``comm_hooks``. A bucket whose gradients are all in
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

``model.bucket_layout`` lists each bucket's parameter names and bytes. As in
torch, the first synchronizing backward uses ONE bucket per dtype (unless
``bucket_cap_mb_list``, or ``find_unused_parameters`` without
``static_graph``), and the buckets are rebuilt at the next forward in the
order gradients became ready (rank 0's order); with
``find_unused_parameters`` and no ``static_graph`` the first layout stays.

Host cost per gradient tensor. torch's reducer is C++; here every gradient
costs one Python hook, so what each hook does is what this class costs.
The hook (``_grad_ready``) takes one of two paths, picked once at
construction. ``_mark_ready``, with neither unused-parameter option and no
sparse bucket (the default): find its (bucket, slot), refuse a second
firing, count the slot, and launch only when its bucket is full and next
in line; no torch call per gradient, the copies in and out are one fused
call per bucket (``bucket.py``). ``_mark_ready_with_policy``: the same after
asking the unused-parameter policy (``unused_policy.py``). At world size 1
on CPU the short path puts this class at torch DDP's cost per tensor:
benchmarks/per_tensor.py, figures in docs/benchmarks.md.

torch's options, same names, same meaning (each tested against torch DDP
with the same option in tests/sync/test_sync_options.py):

- ``bucket_cap_mb=None`` (the default, as in torch): 25 MB with a 1 MB first
  bucket; ``bucket_cap_mb_list`` (torch 2.13): a limit per bucket;
  ``first_bucket_cap_mb`` (ddplab's): a small first bucket for any cap;
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

Leaves out, compared with torch DDP: see ``layout.py``, ``sparse.py`` (comm
hooks on sparse gradients) and ``wrapper_duties.py`` (device placement, Join,
mixed precision). A gradient hook that fires twice in one
backward without ``static_graph`` is an error, as in torch.

References: torch/csrc/distributed/c10d/reducer.cpp; torch/nn/parallel/
distributed.py; Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020; picotron/data_parallel/
data_parallel.py.
"""
from __future__ import annotations

import torch

from ddplab.sync import comm
from ddplab.sync.bucket import Bucket
from ddplab.sync.comm_hooks import check_hook, run_hook
from ddplab.sync.layout import Caps, initial_layout, rebuilds, rebuilt_layout
from ddplab.sync.sparse import SparseBucket, sparse_parameter_ids
from ddplab.sync.unused_policy import unused_policy
from ddplab.sync.wrapper_duties import GradSyncModule


class BucketedDDP(GradSyncModule):
    """Wrap ``module``; gradients travel in buckets of about ``bucket_cap_mb`` MB.

    ``.module``, ``.no_sync()``, ``.finish_gradient_synchronization()``,
    ``.register_comm_hook(state, hook)``, ``.buckets`` (``Bucket`` objects)
    and ``.bucket_layout`` (plain data). ``recorder`` (see
    ``ddplab.sync.comm``) receives grad-ready, launch, done and wait stamps
    by bucket index. The keyword options are torch's; see the module
    docstring.
    """

    def __init__(self, module, bucket_cap_mb: float | None = None, process_group=None,
                 broadcast_buffers: bool = True, recorder=None, *,
                 bucket_cap_mb_list=None,
                 first_bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False,
                 static_graph: bool = False):
        # Checked before anything talks to other ranks, so a typo fails at once.
        self._caps = Caps.create(bucket_cap_mb, bucket_cap_mb_list, first_bucket_cap_mb)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.static_graph = bool(static_graph)
        super().__init__(module, process_group, broadcast_buffers, recorder,
                         mark_used=self.find_unused_parameters or self.static_graph)
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        sparse_ids = sparse_parameter_ids(module)
        self._sparse = {i for i, p in enumerate(self._params) if id(p) in sparse_ids}
        self._comm_hook = None  # (state, hook) once registered
        self._build_buckets(initial_layout(self._params, self._caps, self.find_unused_parameters,
                                           self.static_graph, self._sparse))
        # none / find_unused_parameters / static_graph: see unused_policy.py
        self._policy = unused_policy(self.find_unused_parameters, self.static_graph,
                                     self._params, self.grad_marks, process_group, recorder)
        self._unused_marked = False  # this backward's unused parameters are marked ready
        # Which hook path: a hook that only marks its slot when no policy needs more.
        # (A flag, not a bound method kept on self: that would be a reference cycle, and a
        # wrapper replaced in a notebook would live on, its hooks still firing.)
        self._short_path = self._policy.only_marks and not self._sparse
        # The rebuild (layout.py): the first synchronizing backward records the
        # order gradients arrive in; the next grad-enabled forward re-lays the buckets.
        self._ready_order = [] if rebuilds(self.find_unused_parameters, self.static_graph) \
            else None
        self._seen = set()
        self._rebuild_due = False

    def _build_buckets(self, layout) -> None:
        self.buckets = []
        self._where = {}  # parameter index -> (bucket, slot in the bucket)
        for b, indices in enumerate(layout):
            if indices[0] in self._sparse:
                i = indices[0]
                bucket = SparseBucket(b, self._params[i], self._names[i], self.world_size)
            else:
                bucket = Bucket(b, [self._params[i] for i in indices],
                                [self._names[i] for i in indices], self.world_size,
                                as_view=self.gradient_as_bucket_view)
            bucket.divide = self._comm_hook is None  # a comm hook divides by itself
            self.buckets.append(bucket)
            for slot, i in enumerate(indices):
                self._where[i] = (bucket, slot)
        self._next_bucket = 0  # the lowest bucket index not launched yet

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
        sparse = [self._names[i] for i in sorted(self._sparse)]
        if sparse:
            raise RuntimeError(f"register_comm_hook: parameter(s) {', '.join(sparse)} have sparse "
                               "gradients, and ddplab's comm hooks take dense buckets only. Use "
                               "sparse=False for those modules, or no comm hook.")
        self._comm_hook = (state, hook)
        for bucket in self.buckets:
            bucket.divide = False

    # -- forward: the rebuild, and what this backward will not produce -------------
    def forward(self, *args, **kwargs):
        if self._rebuild_due and torch.is_grad_enabled() and not self._hooks_fired:
            self._rebuild_buckets()
        out = super().forward(*args, **kwargs)
        if self._expect_hooks and torch.is_grad_enabled():
            self._policy.at_forward(out)
        return out

    def _rebuild_buckets(self) -> None:
        """Once: the caps over rank 0's gradient-ready order (torch's rebuild_buckets)."""
        n = len(self._params)
        order = torch.full((n,), -1, dtype=torch.int64, device=self._params[0].device)
        order[:len(self._ready_order)] = torch.tensor(self._ready_order, dtype=torch.int64)
        comm.broadcast(order, self._src, self.process_group, kind="rebuild")
        ready = [i for i in order.tolist() if i >= 0]
        self._build_buckets(rebuilt_layout(self._params, self._caps, ready, self._sparse))
        self._ready_order, self._rebuild_due = None, False

    # -- backward --------------------------------------------------------------------
    def _bucket_of(self, index) -> int:
        return self._where[index][0].index

    def _grad_ready(self, index, param):
        if self._ready_order is not None and index not in self._seen:
            self._seen.add(index)  # first synchronizing backward: the order, for the rebuild
            self._ready_order.append(index)
        if self._short_path:
            self._mark_ready(index)
        else:
            self._mark_ready_with_policy(index)

    def _mark_ready(self, index):
        """The short path (no unused-parameter policy, no sparse bucket): count the slot,
        launch only when its bucket is full and next in line."""
        bucket, slot = self._where[index]
        ready = bucket.ready_slots
        if ready[slot]:
            raise self._ready_twice(index)
        ready[slot] = True
        bucket.n_ready += 1
        if bucket.n_ready == bucket.size and bucket.index == self._next_bucket:
            self._launch_ready()

    def _mark_ready_with_policy(self, index):
        """The unused-parameter policy first (watching, early marks, repeated hooks)."""
        policy = self._policy
        if policy.watching:  # static_graph's first backward: only watch
            policy.watch(index)
            return
        if policy.unused and not self._unused_marked:  # first hook of this backward
            self._unused_marked = True
            for i in sorted(policy.unused):
                b, s = self._where[i]
                b.mark_ready(s)
        if index in policy.unused:
            raise policy.unexpected(self._names[index])
        if index in policy.fires_needed and not policy.last_fire(index):
            return  # static_graph: this hook fires again later in this backward
        bucket, slot = self._where[index]
        if bucket.ready_slots[slot]:
            raise self._ready_twice(index)
        bucket.mark_ready(slot)
        self._launch_ready()

    def _launch_ready(self):
        # Launch every bucket that is ready and has no unlaunched bucket before it.
        n = len(self.buckets)
        while self._next_bucket < n and self.buckets[self._next_bucket].ready:
            bucket = self.buckets[self._next_bucket]
            bucket.fill()  # its copies, all at once
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
        for i in range(len(self._params)):  # a .grad of None contributes zeros
            bucket, slot = self._where[i]
            bucket.mark_ready(slot)
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
        if self._ready_order is not None and not self._not_ready():
            self._rebuild_due = True  # a whole synchronizing backward: its order counts

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
        if self._ready_order is not None and not self._rebuild_due:
            self._ready_order, self._seen = [], set()  # a backward that broke off: record anew
