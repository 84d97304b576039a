"""The small contracts between the communication choke point and what it talks to.

Teaches: ``ddplab.sync.comm`` calls out to two optional helpers, a recorder
(ddplab.timeline) and a simulated link (ddplab.netsim). Both sit BELOW or
beside the choke point in the layers, so the choke point may not import
them, and they may not import it. These protocols, at the bottom of the
package, are all either side knows of the other: any object with these
methods works (``typing.Protocol``: structural, no inheritance needed).

- ``EventRecorder.record(event, t, **info)``: stamps (see ``ddplab.sync.comm``
  for the events and their info). ``device_timer`` (optional, ``None`` when
  absent): on GPUs, a ``DeviceTimer`` that times collectives with device events.
- ``Link.wrap(work, nbytes, group, device=None, op="all_reduce") -> LinkWork``:
  hand back a work that completes no earlier than the modelled transfer (an
  ``op`` of ``nbytes``, its full size), nor (on a GPU: ``device``, the
  tensor's) before the real one.
- ``LinkWork``: ``wait()``, ``get_future()`` like a torch ``Work``, and
  ``done_stamp()``: called when it completes, the extra info for the "done"
  stamp (``start``, ``simulated``, ``source``: who decided the end).

Leaves out: anything torch-specific (a ``Work`` here is anything with
``wait()`` and ``get_future()``).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EventRecorder(Protocol):
    def record(self, event: str, t: float, **info) -> None: ...


class DeviceTimer(Protocol):
    def launched(self, work: Any, bucket: Any, kind: str) -> None: ...


class LinkWork(Protocol):
    def wait(self, timeout=None) -> bool: ...

    def get_future(self) -> Any: ...

    def done_stamp(self) -> dict: ...


@runtime_checkable
class Link(Protocol):
    def wrap(self, work: Any, nbytes: int, group=None, device=None, op: str = "all_reduce") -> LinkWork: ...


class Observer(Protocol):
    """What the observing process group (ddplab.pg.group) tells an observer.

    ``launched(op, tensors, group, peer)`` before the op is handed to the real
    backend (``peer``: the other rank of a send/recv, else None); it returns a
    token the other calls get back, and may raise to refuse the op.
    ``started(token, work)`` may return another work to hand out (a simulated
    link's), or None to keep it. ``waiting(token)`` when someone waits on the
    work, ``future_taken(token)`` when someone takes its future (torch DDP's
    reducer does), ``failed(token, exc)`` when a wait raised (it may raise its own
    error instead). An optional ``timeout`` attribute (seconds) caps every wait.
    """

    def launched(self, op: str, tensors: list, group: Any, peer: Any) -> Any: ...

    def started(self, token: Any, work: Any) -> Any: ...

    def waiting(self, token: Any) -> None: ...

    def future_taken(self, token: Any) -> None: ...

    def failed(self, token: Any, exc: BaseException) -> None: ...
