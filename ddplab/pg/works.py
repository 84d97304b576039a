"""What an observer of the observing group is, and the work a caller of that group gets.

Teaches: a ``dist.Work`` is a promise about one collective: ``wait()`` (with an
optional limit), ``get_future()``, ``is_completed()``. The observing group
(``pg/group.py``) hands its callers this wrapper, so that every wait, however the
caller came to make it (``dist.all_reduce``'s own wait on a blocking call, a
learner's ``work.wait()``, torch DDP's reducer), passes the observers first, with
the shortest limit any of them asks for. On NCCL a wait without a limit makes the
caller's current CUDA stream wait; with a limit the host blocks until the op ends
or the limit passes (ProcessGroupNCCL.hpp, ``WorkNCCL::wait``).

Leaves out: the rest of torch's Work (``_get_op_type``, profiling hooks), which
ddplab's callers do not use.

References: torch/include/torch/csrc/distributed/c10d/Work.hpp and
PyProcessGroup.hpp (which Work methods Python may override);
ddplab.contracts.protocols.Observer.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from ddplab.pg.p2p_blocks import close_open_blocks


class ObserverBase:
    """An observer that notes nothing: subclass it and override what you need
    (the methods of ``ddplab.contracts.protocols.Observer``)."""

    timeout: float | None = None

    def launched(self, op, tensors, group, peer):
        return None

    def started(self, token, work):
        return None

    def waiting(self, token):
        pass

    def future_taken(self, token):
        pass

    def failed(self, token, exc):
        pass


class ForwardingWork(dist._Work):
    """A work that answers for ``work``: a subclass overrides what it watches (``wait``)."""

    def __init__(self, work):
        super().__init__()
        self.work = work

    def is_completed(self):
        return self.work.is_completed()

    def is_success(self):
        return self.work.is_success()

    def exception(self):
        return self.work.exception()

    def synchronize(self):
        return self.work.synchronize()

    def source_rank(self):
        return self.work.source_rank()

    def result(self):
        return self.work.result()


class ObservedWork(ForwardingWork):
    """The work a caller gets: waits go through the observers (timeouts, notes)."""

    def __init__(self, work, group, calls: list, cap=None):
        super().__init__(work)
        self.group, self.calls, self.cap = group, calls, cap

    def wait(self, timeout=None):
        limit = self.group.wait_limit(timeout, self.cap)
        try:
            for observer, token in self.calls:
                observer.waiting(token)
        except BaseException:
            close_open_blocks()  # a stall an observer found must not leave NCCL's group open
            raise
        try:
            if limit is None:
                return self.work.wait()
            return self.work.wait(datetime.timedelta(seconds=limit))
        except RuntimeError as exc:
            for observer, token in self.calls:
                observer.failed(token, exc)  # may raise its own error (a grader's Stalled)
            raise

    def get_future(self):
        for observer, token in self.calls:
            observer.future_taken(token)
        return self.work.get_future()


def completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a failed or aborted work is not pending any more
        return True
