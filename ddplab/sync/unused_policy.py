"""What BucketedDDP does about parameters that get no gradient: one policy per option.

Teaches the three answers torch's DistributedDataParallel gives, as three
small classes behind one interface, picked once when the wrapper is built
(``unused_policy(find_unused_parameters, static_graph, ...)``):

- ``EveryParameterUsed`` (neither option): every trainable parameter must
  get a gradient in every synchronizing backward. One that does not keeps
  its bucket from ever leaving, and the wrapper names it at the end of
  backward.
- ``FindUnused`` (``find_unused_parameters=True``): at every forward, walk
  the autograd graph from the outputs (``unused.unused_parameters``); the
  parameters not reached are marked ready with zeros at backward's first
  hook; one small all-reduce of the used map, right behind the last
  bucket, tells which were unused on EVERY rank (their ``.grad`` is left
  alone).
- ``StaticGraph`` (``static_graph=True``, with or without
  ``find_unused_parameters``): the first synchronizing backward only
  watches which hooks fire, and how many times; at its end the used map
  travels once and every bucket is reduced. From then on the unused set is
  reused (no walk, no used map), and a parameter whose hook fired k times
  in that first backward (reentrant activation checkpointing reuses a
  layer) is ready at its k-th firing, as in torch.

What BucketedDDP calls: ``only_marks`` (True: a hook only marks its slot,
nothing else to do, so BucketedDDP takes its short path); ``at_forward(outputs)``; ``watching`` (hooks only
watch: ``watch(index)``); ``unused`` (marked ready at the first hook; a
gradient for one is ``unexpected(name)``); ``fires_needed`` and
``last_fire(index)``; ``all_launched()``; ``learn()``;
``unused_everywhere()``; ``reset()``; ``missing_hint`` (the end of the
"got no gradient" message).

Leaves out, compared with torch: torch's warning when
find_unused_parameters finds nothing unused, and its lazy wait on the used
map (see ``unused.py``).

References: torch/csrc/distributed/c10d/reducer.cpp (``prepare_for_backward``,
``search_unused_parameters``, ``delay_all_reduce``,
``numGradHooksTriggeredMap_``); torch/nn/parallel/distributed.py
(``_set_static_graph``).
"""
from __future__ import annotations

from ddplab.sync.unused import UsedMap, unused_parameters

_NONE = frozenset()


class EveryParameterUsed:
    """Neither option: nothing is marked ready early, nothing is skipped."""

    only_marks = True
    watching = False
    unused = _NONE
    fires_needed: dict = {}
    missing_hint = ("Make every trainable parameter take part in the loss, or freeze it "
                    "(p.requires_grad_(False)) before wrapping. (For parameters that sit out "
                    "some iterations or some ranks, BucketedDDP and torch's "
                    "DistributedDataParallel take find_unused_parameters=True.)")

    def at_forward(self, outputs) -> None:
        pass

    def all_launched(self) -> None:
        pass

    def unused_everywhere(self):
        return ()

    def reset(self) -> None:
        pass


class FindUnused(EveryParameterUsed):
    """find_unused_parameters=True: walk the graph at every forward."""

    only_marks = False

    missing_hint = (
        "find_unused_parameters=True is set, and these parameters WERE reached from the "
        "forward's outputs, so an output that depends on them is not part of the loss. Make "
        "every output of forward take part in the loss (or return it detached), as torch's "
        "DistributedDataParallel also asks.")

    def __init__(self, params, used: UsedMap):
        self.params = params
        self.used = used
        self.unused = _NONE

    def at_forward(self, outputs) -> None:
        self.unused = frozenset(unused_parameters(outputs, self.params))

    def all_launched(self) -> None:
        if not self.used.launched:  # right behind the last bucket, on every rank alike
            self.used.launch()

    def unused_everywhere(self):
        if not self.used.launched:  # a bucket never left: the missing-gradient error follows
            return ()
        # waited for even when nothing is unused here, so no work is left pending
        return self.used.unused_everywhere(self.unused)

    def unexpected(self, name: str) -> RuntimeError:
        return RuntimeError(
            f"BucketedDDP(find_unused_parameters=True): parameter {name} got a gradient "
            "although it was not reached from the forward's outputs. Was it used outside "
            "forward (a loss term computed from model.module directly), or inside "
            "torch.utils.checkpoint(..., use_reentrant=True), whose graph stays hidden until "
            "backward (use use_reentrant=False)? Or does forward return "
            "it inside an object other than tensors, lists, tuples, dicts and dataclasses "
            "(where torch's DDP and ddplab look for output tensors)?")

    def reset(self) -> None:
        self.used.reset()
        self.unused = _NONE


class StaticGraph(EveryParameterUsed):
    """static_graph=True: learn the unused set and the hook counts once."""

    only_marks = False

    missing_hint = ("static_graph=True: they got a gradient in the first iteration and none "
                    "now: the graph changed, which static_graph forbids (as in torch). Use "
                    "find_unused_parameters=True instead.")

    def __init__(self, n_params: int, used: UsedMap):
        self.used = used
        self.watching = True  # the first synchronizing backward
        self._fired = [0] * n_params  # hook firings per parameter while watching
        self._everywhere = _NONE
        self._learned_unused = _NONE
        self.unused = _NONE
        self.fires_needed = {}  # parameter index -> firings per backward, where more than one
        self._count: dict = {}

    def at_forward(self, outputs) -> None:
        self.unused = self._learned_unused  # empty while watching

    def watch(self, index: int) -> None:
        self._fired[index] += 1

    def learn(self) -> None:
        """End of the first synchronizing backward: what was unused, what fired more than once."""
        # the marks, not the firings: a use in a no_sync micro-step before it counts too
        self._learned_unused = frozenset(i for i, m in enumerate(self.used.local) if not m)
        self.fires_needed = {i: n for i, n in enumerate(self._fired) if n > 1}
        self.used.launch()  # once in the whole run: which parameters are used on some rank
        self._everywhere = frozenset(self.used.unused_everywhere(self._learned_unused))
        self.unused = self._learned_unused
        self.watching = False

    def last_fire(self, index: int) -> bool:
        """Count one firing of a hook that fires several times; True at the last one."""
        n = self._count.get(index, 0) + 1
        self._count[index] = n
        if n > self.fires_needed[index]:
            raise self.changed(f"the gradient hook of a parameter fired {n} times in one backward "
                               f"where it fired {self.fires_needed[index]} times in the first")
        return n == self.fires_needed[index]

    def unused_everywhere(self):
        return self._everywhere if self.unused else ()

    def unexpected(self, name: str) -> RuntimeError:
        return self.changed(f"parameter {name} got no gradient in the first iteration but got "
                            "one now")

    @staticmethod
    def changed(what: str) -> RuntimeError:
        return RuntimeError(
            f"BucketedDDP(static_graph=True): {what}: the graph changed, which static_graph "
            "forbids (as in torch). Use find_unused_parameters=True instead.")

    def reset(self) -> None:
        self._count = {}
        if self.watching:  # a first backward broke off: learn from a whole one
            self.used.reset()
            self._fired = [0] * len(self._fired)


def unused_policy(find_unused_parameters: bool, static_graph: bool, params, marks,
                  group=None, recorder=None):
    """The policy for these options. ``marks``: the wrapper's ``grad_marks``
    (None when neither option is set)."""
    if not (find_unused_parameters or static_graph):
        return EveryParameterUsed()
    used = UsedMap(marks, group, recorder, device=params[0].device)
    if static_graph:  # with both flags set, static_graph wins after the first iteration (torch)
        return StaticGraph(len(params), used)
    return FindUnused(params, used)
