"""The rank process: join the process group once, then run jobs until told to stop.

Teaches: what a long-lived rank is. torchrun starts a fresh process per rank
for one script; a notebook wants ranks that keep their state (models, hooks,
optimizers) across cells. Each rank here is ``python -m ddplab.cluster.worker``
spawned by the kernel (never forked: a forked child inherits the kernel's
OpenMP and CUDA state and can hang). It joins the group on a FileStore in a
directory only this user can open (see rendezvous.py), then waits on a
private socket for cloudpickled jobs.

Why each odd line is here:
- SIGINT is ignored: Jupyter's Interrupt signals the kernel's whole process
  group, and the kernel, not the rank, decides what an interrupt means.
- SIGUSR1 dumps every thread's Python stack (faulthandler) into a private
  file, so the kernel can show where a stuck rank was even while it sits
  inside a C++ collective, and even while it floods its stdout.
- PR_SET_PDEATHSIG and EOF on the socket end the rank when the kernel dies,
  even by SIGKILL: no orphans.
- The kernel starts each rank in a session (and process group) of its own,
  and the rank starts a tiny reaper, ``sh``, in that group: it waits for EOF
  on the kernel's lifeline pipe and then kills the whole group. So every
  process a job starts (``subprocess.Popen``, DataLoader workers) dies with
  the rank: the kernel kills the group at shutdown and replacement, the
  reaper when the kernel dies. A process that leaves the group on purpose
  (``setsid``, ``start_new_session=True``, a double-forking daemon) escapes.
- After every job the rank reports each process group's sequence number
  (how many collectives it has issued): when ranks disagree, collectives
  no longer line up and the kernel replaces the ranks.
- The rank leaves by ``os._exit`` once its last message is sent: gloo can
  abort a process in interpreter teardown (docs/pitfalls.md), and a learner
  should never see "terminate called without an active exception".
- ``channel`` and ``job_id`` let code running in a job send the kernel more
  than its result (``%%ddp`` display objects); frames whose function sets
  ``__tracebackhide__`` (IPython's and pytest's convention) are left out of
  the traceback the kernel shows.

Leaves out, compared with torchrun: elastic restarts, multi-node launch (use
``ddplab.init_from_env`` under torchrun for that), per-rank log files.

References: torch.distributed.init_process_group, FileStore; faulthandler;
prctl(2); setsid(2); ProcessGroup._get_sequence_number_for_group.
"""
from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from ddplab.cluster.results import to_cpu

CONFIG_VAR = "DDPLAB_WORKER"

# The namespace %%ddp cells run in on this rank; it lives as long as the rank.
namespace: dict = {"__name__": "__ddp__"}
# Set once the background pre-import is over; timing code waits for it so that
# the import (which holds the GIL) does not land inside a measured step.
preimported = threading.Event()
# The kernel's end of this rank's socket, and the id of the job running now:
# code in a job may send ("display", job_id, payload) through it.
channel: "_Channel | None" = None
job_id: int | None = None


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            PR_SET_PDEATHSIG = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() != parent_pid:  # the kernel died before prctl took effect
        os._exit(1)


def error_info(exc: BaseException, skip_frames: int = 1, elapsed: float = 0.0) -> dict:
    """What the kernel needs to rebuild the traceback with its own cell sources.

    Errors are classified by type, never by their wording: torch raises
    ``DistError`` and its subclasses (DistBackendError, DistNetworkError,
    DistStoreError) for NCCL and store failures, while gloo raises a plain
    RuntimeError even for its timeouts; the kernel tells those apart with the
    sequence numbers and the elapsed time (see diagnosis.py)."""
    import cloudpickle
    import torch.distributed as dist

    shown = [(f, n) for f, n in traceback.walk_tb(exc.__traceback__)][skip_frames:]
    frames = traceback.StackSummary.extract(
        (f, n) for f, n in shown if not f.f_locals.get("__tracebackhide__"))
    try:
        pickled = cloudpickle.dumps(exc)
    except Exception:
        pickled = None
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "frames": [(f.filename, f.lineno, f.name, f.line) for f in frames],
        "exception": pickled,
        "dist_error": isinstance(exc, getattr(dist, "DistError", ())),
        "runtime_error": isinstance(exc, RuntimeError),  # gloo's errors, DistError included
        "timeout": isinstance(exc, TimeoutError),
        # raised from inside a torch.distributed call, or the observing group's wait on
        # the real work (pg/works.py): its connections may be closed
        "in_collective": bool(shown) and _in_collective(shown[-1][0].f_code.co_filename),
        "elapsed": elapsed,
        "text": "".join(traceback.format_exception(exc)),
    }


def _in_collective(filename: str) -> bool:
    path = filename.replace(os.sep, "/")
    return "torch/distributed/" in path or path.endswith(("ddplab/pg/group.py",
                                                          "ddplab/pg/works.py"))


def group_state() -> dict | None:
    """Collectives issued so far on each process group (its sequence number).

    Equal numbers on every rank mean every collective a job issued found its
    partner; unequal numbers mean one rank has a collective in flight that
    the next job's first collective would pair with. None when unknown."""
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            return {}
        state = {}
        for pg, name in list(c10d._world.pg_names.items()):
            seqs = []
            for device in ("cpu", "cuda"):
                try:
                    seqs.append(pg._get_backend(torch.device(device))._get_sequence_number_for_group())
                except Exception:  # no backend for that device in this group
                    pass
            if not seqs:  # the observing group (pg/group.py) has no backend: it counts itself
                seqs.append(pg._get_sequence_number_for_group())
            state[name] = tuple(seqs)
        from ddplab.pg.group import unfinished_device_work

        state.update(unfinished_device_work())  # on a GPU equal counts do not prove work ended
        return state
    except Exception:
        return None


class _Channel:
    """The rank's end of the private socket; sends are serialised by a lock."""

    def __init__(self, fd: int):
        self.conn = Connection(fd)
        self.lock = threading.Lock()

    def send(self, obj) -> None:
        import cloudpickle

        self.send_bytes(cloudpickle.dumps(obj))

    def send_bytes(self, data: bytes) -> None:
        with self.lock:
            self.conn.send_bytes(data)

    def recv(self):
        import cloudpickle

        return cloudpickle.loads(self.conn.recv_bytes())


def _init_group(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from ddplab.contracts import pristine
    from ddplab.pg.backend import init_group
    from ddplab.pg.inner import startup_timeout

    torch.set_num_threads(cfg["threads"])
    # A fresh file in a mode-0700 directory: no listener, nothing another user can open.
    # Its waits (NCCL's unique id) get the start-up limit: CUDA and NCCL start-up skew
    # between ranks can pass a short collective timeout (lab 06 uses 3 s).
    store = dist.FileStore(cfg["store_path"], cfg["world_size"])
    store.set_timeout(startup_timeout(cfg["timeout"]))
    # nccl ranks: the GPU the kernel chose, and one group for CPU and CUDA tensors (backend.py).
    init_group(cfg["backend"], rank=cfg["rank"], world_size=cfg["world_size"],
               timeout=cfg["timeout"], gpu=cfg.get("gpu"), store=store)
    pristine.capture()  # torch's state before any learner's cell: the graders compare with it


def _preimport() -> None:
    # The first DistributedDataParallel(...) in a process imports torch._dynamo
    # (~1 s); doing it now, off the main thread, keeps that out of a learner's step.
    try:
        import torch._dynamo  # noqa: F401
        import torch.nn.parallel  # noqa: F401
    except Exception:
        pass
    finally:
        preimported.set()


_stacks_file = None  # where faulthandler writes this rank's stacks

try:
    _LIBC = ctypes.CDLL(None)  # this process's C library: its stdio buffers C/C++ output
except OSError:
    _LIBC = None


def flush_output() -> None:
    """Push the job's output into the pipes (Python's and C's stdio) before its
    result is sent, so the kernel finds all of it there once the result arrives."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _LIBC is not None:
        _LIBC.fflush(None)


def _run_job(chan: _Channel, job_id: int, job: bytes) -> None:
    import cloudpickle

    t0 = time.monotonic()
    globals()["job_id"] = job_id
    try:
        fn, args, kwargs = cloudpickle.loads(job)
        result = to_cpu(fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the kernel
        flush_output()
        chan.send(("err", job_id, error_info(exc, 1, time.monotonic() - t0), group_state()))
        return
    flush_output()
    try:
        data = cloudpickle.dumps(("ok", job_id, result, group_state()))
    except Exception as exc:  # the job ran fine; only its value cannot travel
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
        info = error_info(exc, skip_frames=len(traceback.extract_tb(exc.__traceback__)))
        info.update(type="ResultNotPicklable", exception=None, elapsed=time.monotonic() - t0,
                    message=f"the return value of {name} could not be pickled: "
                            f"{type(exc).__name__}: {exc}. Return plain values, tensors or "
                            "dicts/lists of them, and keep other objects on the rank.")
        chan.send(("err", job_id, info, group_state()))
        return
    chan.send_bytes(data)


def _start_reaper(lifeline_fd: int) -> None:
    """A shell in this rank's process group that kills the group once the kernel is gone.

    PR_SET_PDEATHSIG kills this process only; its children would be adopted
    by init and live on. The reaper reads the kernel's lifeline pipe, which
    reaches EOF when the kernel process ends however it ended, then signals
    the whole group (``kill 0``): this rank and everything its jobs started."""
    # The lifeline is the shell's stdin (a redirection like <&64 fails in dash above fd 9).
    subprocess.Popen(["/bin/sh", "-c", "read _; kill -KILL 0"], stdin=lifeline_fd,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    os.close(lifeline_fd)


def _let_threads_finish(limit_s: float = 4.0) -> None:
    """Join the threads a job left running that are not daemons, as the interpreter does at a
    normal exit and ``os._exit`` does not: ``ddplab.record`` gathers and writes its files on
    such a thread after the last step, so a cluster shut down right after a recorded cell
    would otherwise lose them. Bounded by the kernel's own wait for this rank (``stop``'s
    ``wait_s``, 5 s), after which it kills the rank anyway."""
    deadline = time.monotonic() + limit_s
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))


def _leave(code: int = 0) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main() -> None:
    cfg = json.loads(os.environ.pop(CONFIG_VAR))
    _die_with_parent(cfg["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _start_reaper(cfg["lifeline_fd"])
    global _stacks_file
    _stacks_file = open(cfg["stacks_path"], "a")  # noqa: SIM115 - open for the rank's life
    faulthandler.register(signal.SIGUSR1, file=_stacks_file, all_threads=True)
    sys.path[:] = cfg["sys_path"]
    try:
        os.chdir(cfg["cwd"])
    except OSError:
        pass
    chan = _Channel(cfg["fd"])
    globals()["channel"] = chan
    try:
        _init_group(cfg)
    except BaseException as exc:  # noqa: BLE001
        chan.send(("init_failed", error_info(exc, skip_frames=0)))
        _leave(1)
    namespace.update(rank=cfg["rank"], world_size=cfg["world_size"])
    chan.send(("ready", cfg["rank"], os.getpid()))
    threading.Thread(target=_preimport, daemon=True).start()
    while True:
        try:
            msg = chan.recv()
        except (EOFError, OSError):
            _leave(0)  # the kernel is gone
        if msg[0] == "job":
            try:
                _run_job(chan, *msg[1:])
            except OSError:
                _leave(0)  # the kernel went away while the job ran
        elif msg[0] == "shutdown":
            _let_threads_finish()
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:
                pass
            try:
                chan.send(("bye",))
            finally:
                _leave(0)


if __name__ == "__main__":
    main()
