"""Starting, watching and stopping a set of rank processes.

Teaches: the plumbing every launcher needs and most tutorials skip.
- Ranks are fresh interpreters (``python -m ddplab.cluster.worker``), not
  forks and not ``multiprocessing`` children: nothing re-imports the caller's
  ``__main__``, and nothing inherits the kernel's threads or CUDA context.
- Each rank talks to the kernel over a private socketpair (no port to
  collide with another classroom user) and its stdout/stderr are pipes: file
  descriptor level, so C++ and NCCL logs arrive too, not just ``print``.
- One pump thread drains every pipe all the time (a full pipe would block the
  rank) and queues chunks for whoever shows them.

Leaves out, compared with torchrun: restarts with backoff, log files,
health checks over the network.
"""
from __future__ import annotations

import json
import os
import queue
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from .worker import CONFIG_VAR


class RankProcesses:
    """``world_size`` rank processes of one generation, their sockets and pipes."""

    def __init__(self, world_size: int, backend: str, host: str, port: int, prefix: str,
                 timeout: float, threads: int, env: dict | None, output: queue.Queue):
        self.world_size = world_size
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.output = output
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        for rank in range(world_size):
            ours, theirs = socket.socketpair()
            cfg = {
                "rank": rank, "world_size": world_size, "backend": backend, "host": host,
                "port": port, "prefix": prefix, "timeout": timeout, "threads": threads,
                "fd": theirs.fileno(), "parent_pid": os.getpid(),
                "sys_path": [p if p else os.getcwd() for p in sys.path], "cwd": os.getcwd(),
            }
            child_env = dict(os.environ)
            child_env.update(env or {})
            child_env.update({
                CONFIG_VAR: json.dumps(cfg),
                "PYTHONUNBUFFERED": "1",  # print() reaches the cell as it happens
                "OMP_NUM_THREADS": str(threads),
                "PYTHONPATH": os.pathsep.join(
                    [package_root] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
                ),
            })
            # Loopback is where the kernel's store lives; without this gloo may
            # pick an address from the hostname that the ranks cannot reach.
            child_env.setdefault("GLOO_SOCKET_IFNAME", _loopback_name())
            proc = subprocess.Popen(
                [sys.executable, "-c", "from ddplab.cluster.worker import main; main()"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),), env=child_env, close_fds=True,
            )
            theirs.close()
            self.procs.append(proc)
            self.conns.append(Connection(ours.detach()))
        self.pids = [p.pid for p in self.procs]
        # Non-blocking pipes and one lock: drain() may read them from the kernel's
        # thread while the pump thread also does, and neither may block or reorder.
        self._read_lock = threading.Lock()
        for proc in self.procs:
            os.set_blocking(proc.stdout.fileno(), False)
            os.set_blocking(proc.stderr.fileno(), False)
        self._pump = threading.Thread(target=self._pump_output, daemon=True,
                                      name=f"ddplab-output-{prefix}")
        self._pump.start()

    def _pump_output(self) -> None:
        sel = selectors.DefaultSelector()
        for rank, proc in enumerate(self.procs):
            sel.register(proc.stdout, selectors.EVENT_READ, (rank, "stdout"))
            sel.register(proc.stderr, selectors.EVENT_READ, (rank, "stderr"))
        open_pipes = 2 * len(self.procs)
        while open_pipes:
            for key, _ in sel.select(timeout=1.0):
                with self._read_lock:
                    still_open = self._read_pipe(key.fileobj, *key.data)
                if not still_open:
                    sel.unregister(key.fileobj)
                    open_pipes -= 1
        sel.close()

    def _read_pipe(self, pipe, rank: int, stream: str) -> bool:
        """Queue what one pipe holds now; False once it is closed (the rank is gone)."""
        while True:
            try:
                data = os.read(pipe.fileno(), 65536)
            except BlockingIOError:
                return True
            except (OSError, ValueError):  # closed under us by stop()
                return False
            if not data:
                return False
            self.output.put((rank, stream, data))

    def drain(self) -> None:
        """Queue everything the ranks wrote so far.

        A rank writes its output before it sends a job's result, but the pump
        thread may not have read it yet when the result arrives; draining
        here keeps a job's output in its own cell instead of the next one."""
        with self._read_lock:
            for rank, proc in enumerate(self.procs):
                for stream in ("stdout", "stderr"):
                    pipe = getattr(proc, stream)
                    if not pipe.closed:
                        self._read_pipe(pipe, rank, stream)

    def wait_ready(self, deadline: float) -> list[tuple]:
        """Wait for every rank's first message; returns them by rank."""
        from multiprocessing.connection import wait

        import cloudpickle

        first: dict[int, tuple] = {}
        while len(first) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait([c for r, c in enumerate(self.conns) if r not in first], timeout=left):
                rank = self.conns.index(conn)
                try:
                    first[rank] = cloudpickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    first[rank] = ("died", self.procs[rank].wait())
        return [first.get(r, ("no answer",)) for r in range(self.world_size)]

    def alive(self, rank: int) -> bool:
        return self.procs[rank].poll() is None

    def dump_stacks(self, ranks) -> None:
        """Ask ranks to print every thread's Python stack (faulthandler on SIGUSR1)."""
        for r in ranks:
            if self.alive(r):
                try:
                    os.kill(self.pids[r], signal.SIGUSR1)
                except ProcessLookupError:
                    pass

    def stop(self, graceful: bool = True, wait_s: float = 5.0) -> list[int]:
        """Ask ranks to leave; kill whoever has not left after ``wait_s``.

        Returns the exit codes (negative: killed by that signal)."""
        import cloudpickle

        if graceful:
            for conn in self.conns:
                try:
                    conn.send_bytes(cloudpickle.dumps(("shutdown",)))
                except OSError:
                    pass
            deadline = time.monotonic() + wait_s
            for proc in self.procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        codes = [proc.wait() for proc in self.procs]
        for conn in self.conns:
            conn.close()
        self._pump.join(timeout=5.0)
        for proc in self.procs:
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
        return codes


def _loopback_name() -> str:
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"
