"""The rank process: join the process group once, then run jobs until told to stop.

Teaches: what a long-lived rank is. torchrun starts a fresh process per rank
for one script; a notebook wants ranks that keep their state (models, hooks,
optimizers) across cells. Each rank here is ``python -m ddplab.cluster.worker``
spawned by the kernel (never forked: a forked child inherits the kernel's
OpenMP and CUDA state and can hang). It joins the group on a TCPStore the
kernel hosts, then waits on a private socket for cloudpickled jobs.

Why each odd line is here:
- SIGINT is ignored: Jupyter's Interrupt signals the kernel's whole process
  group, and the kernel, not the rank, decides what an interrupt means.
- SIGUSR1 dumps every thread's Python stack (faulthandler), so the kernel can
  show where a stuck rank was even while it sits inside a C++ collective.
- PR_SET_PDEATHSIG and EOF on the socket end the rank when the kernel dies,
  even by SIGKILL: no orphans.
- The rank leaves by ``os._exit`` once its last message is sent: gloo can
  abort a process in interpreter teardown (see PITFALLS.md), and a learner
  should never see "terminate called without an active exception".
- ``channel`` and ``job_id`` let code running in a job send the kernel more
  than its result (``%%ddp`` display objects); frames whose function sets
  ``__tracebackhide__`` (IPython's and pytest's convention) are left out of
  the traceback the kernel shows.

Leaves out, compared with torchrun: elastic restarts, multi-node launch (use
``ddplab.init_from_env`` under torchrun for that), per-rank log files.

References: torch.distributed.init_process_group, TCPStore, PrefixStore;
faulthandler; prctl(2).
"""
from __future__ import annotations

import ctypes
import datetime
import faulthandler
import json
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

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


def to_cpu(obj):
    """Results travel to the kernel on CPU so the kernel never touches CUDA."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(to_cpu(x) for x in obj)
    if type(obj) is dict:
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def error_info(exc: BaseException, skip_frames: int = 1) -> dict:
    """What the kernel needs to rebuild the traceback with its own cell sources."""
    import cloudpickle
    import torch.distributed as dist

    shown = [(f, n) for f, n in traceback.walk_tb(exc.__traceback__)][skip_frames:]
    frames = traceback.StackSummary.extract(
        (f, n) for f, n in shown if not f.f_locals.get("__tracebackhide__"))
    try:
        pickled = cloudpickle.dumps(exc)
    except Exception:
        pickled = None
    dist_error = isinstance(exc, getattr(dist, "DistError", ())) or any(
        s in str(exc) for s in ("Timed out", "timed out", "Connection closed by peer", "Connection reset")
    )
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "frames": [(f.filename, f.lineno, f.name, f.line) for f in frames],
        "exception": pickled,
        "dist_error": dist_error,
        "timeout": "imed out" in str(exc) or isinstance(exc, TimeoutError),
        "text": "".join(traceback.format_exception(exc)),
    }


class _Channel:
    """The rank's end of the private socket; sends are serialised by a lock."""

    def __init__(self, fd: int):
        self.conn = Connection(fd)
        self.lock = threading.Lock()

    def send(self, obj) -> None:
        import cloudpickle

        data = cloudpickle.dumps(obj)
        with self.lock:
            self.conn.send_bytes(data)

    def recv(self):
        import cloudpickle

        return cloudpickle.loads(self.conn.recv_bytes())


def _init_group(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads"])
    timeout = datetime.timedelta(seconds=cfg["timeout"])
    device_id = None
    if cfg["backend"] == "nccl":
        # Each rank owns one GPU and must select it before any CUDA work.
        torch.cuda.set_device(cfg["rank"])
        device_id = torch.device("cuda", cfg["rank"])
    store = dist.TCPStore(cfg["host"], cfg["port"], is_master=False, timeout=timeout)
    store = dist.PrefixStore(cfg["prefix"], store)
    kwargs = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(
        cfg["backend"], store=store, rank=cfg["rank"], world_size=cfg["world_size"],
        timeout=timeout, **kwargs,
    )


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


try:
    _LIBC = ctypes.CDLL(None)  # this process's C library: its stdio buffers C/C++ output
except OSError:
    _LIBC = None


def _flush_output() -> None:
    """Push the job's output into the pipes (Python's and C's stdio) before its
    result is sent, so the kernel finds all of it there once the result arrives."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _LIBC is not None:
        _LIBC.fflush(None)


def _run_job(chan: _Channel, job_id: int, job: bytes) -> None:
    import cloudpickle

    globals()["job_id"] = job_id
    try:
        fn, args, kwargs = cloudpickle.loads(job)
        result = to_cpu(fn(*args, **kwargs))
        _flush_output()
        chan.send(("ok", job_id, result))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the kernel
        _flush_output()
        chan.send(("err", job_id, error_info(exc, skip_frames=1)))


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
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
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
            _run_job(chan, *msg[1:])
        elif msg[0] == "shutdown":
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:
                pass
            chan.send(("bye",))
            _leave(0)


if __name__ == "__main__":
    main()
