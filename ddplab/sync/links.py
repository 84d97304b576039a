"""Where the simulated link is installed: on the process group, so every caller meets it.

Teaches: a simulated network must delay every transfer of a run, whoever makes
it, or the comparison is unfair. On a rank of the observing process group
(``ddplab.pg.group``: every Cluster rank and ``ddplab.init_from_env``) the
link (``ddplab.netsim.simulated.SimulatedLink``) goes on the group itself as an
observer, ``OnGroup``: torch DDP's C++ reducer, the reference reducers and a
learner's code all pay it, with no comm hook and nothing patched. On a group
that is not observed (a plain ``init_process_group``), ``ddplab.sync.comm``
applies it to its own calls only.

Leaves out: groups created inside a ``using_link`` block do not get the link
(comm's own calls on them still do).
"""
from __future__ import annotations

import contextlib

from ddplab.contracts.protocols import Link
from ddplab.pg.group import LIVE, observing_group

# ----------------------------------------------------------------------------
# ddplab.netsim is installed here, and only here.
# ``using_link(link)`` installs a ``ddplab.contracts.protocols.Link``: ``wrap(work, nbytes,
# group, device=...)`` returns a work completing no earlier than the modelled transfer.
# It goes on every observing process group of this process (every Cluster rank; groups
# created inside the block excepted), so every all-reduce, broadcast, all-gather and reduce-scatter meets
# it, whoever calls it (torch DDP's reducer, the reference reducers, a learner's code);
# on any other group these functions wrap their own works.
# The delay lives in the returned object, never in a sleep inside a hook, so overlap
# with backward stays honest.
# ----------------------------------------------------------------------------
_link = None
_on_groups: list = []  # (group, observer) the installed link is on


def set_link(link) -> None:
    """Install (or, with ``None``, remove) a simulated link for this process."""
    global _link
    if link is not None and not isinstance(link, Link):
        raise TypeError(f"a link needs wrap(work, nbytes, group) (ddplab.contracts.protocols.Link); got {link!r}")
    for group, observer in _on_groups:
        group.observers.remove(observer)
    _on_groups.clear()
    _link = link
    if link is not None and hasattr(link, "on_group"):
        for group in list(LIVE):
            observer = link.on_group()
            group.observers.insert(0, observer)  # first: recorders see the delayed work
            _on_groups.append((group, observer))


@contextlib.contextmanager
def using_link(link):
    """Within the block, every collective here goes over ``link`` (a Link or None)."""
    previous = _link
    set_link(link)
    try:
        yield link
    finally:
        set_link(previous)


def link():
    """The installed simulated link, or ``None`` (real communication only)."""
    return _link


def link_on(group) -> bool:
    """Does the installed link already sit on ``group`` (so it delays this work itself)?"""
    pg = observing_group(group)
    return any(g is pg for g, _ in _on_groups)


@contextlib.contextmanager
def link_paused(group):
    """Several collectives that make one transfer (the sparse all-reduce on NCCL): the group
    leaves them undelayed on this thread, and ``ddplab.sync.comm`` delays their result once,
    for the transfer's bytes."""
    with contextlib.ExitStack() as stack:
        pg = observing_group(group)
        for g, observer in _on_groups:
            if g is pg:
                stack.enter_context(observer.paused())
        yield
