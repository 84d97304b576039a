"""Starting, watching and stopping a set of rank processes.

Teaches: the plumbing every launcher needs and most tutorials skip.
- Ranks are fresh interpreters (``python -c 'from ddplab.cluster.worker ...'``),
  not forks and not ``multiprocessing`` children: nothing re-imports the
  caller's ``__main__``, and nothing inherits the kernel's threads or CUDA
  context.
- Each rank is the leader of a session and process group of its own, so a
  job's child processes are in the rank's group and die with it: stopping a
  rank kills the group (``killpg``). The group is signalled while the rank is
  still alive or a zombie (not yet reaped), because only then can its id not
  have been reused by an unrelated process.
- Each rank talks to the kernel over a private socketpair (no port to
  collide with another classroom user) and its stdout/stderr are pipes: file
  descriptor level, so C++ and NCCL logs arrive too, not just ``print``.
- One pump thread per generation drains every pipe all the time (a full pipe
  would block the rank), keeps a bounded share of each job's output (see
  output.OutputBudget) and queues it for whoever shows it. It ends when told
  to, even if a process that escaped the group still holds a pipe open.

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

from ddplab.cluster.output import OutputBudget
from ddplab.cluster.worker import CONFIG_VAR


class RankProcesses:
    """``world_size`` rank processes of one generation, their sockets and pipes."""

    def __init__(self, world_size: int, backend: str, generation: int, rendezvous, timeout: float,
                 threads: int, env: dict | None, output: queue.Queue, lifeline_fd: int,
                 gpus: tuple = ()):
        self.world_size = world_size
        self.generation = generation
        self.stacks_paths = [rendezvous.stacks_path(generation, r) for r in range(world_size)]
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.output = output
        self.budget = OutputBudget(world_size)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        for rank in range(world_size):
            ours, theirs = socket.socketpair()
            cfg = {
                "rank": rank, "world_size": world_size, "backend": backend,
                "store_path": rendezvous.store_path(generation), "timeout": timeout,
                "stacks_path": self.stacks_paths[rank], "threads": threads,
                "gpu": gpus[rank] if gpus else None,
                "fd": theirs.fileno(), "lifeline_fd": lifeline_fd, "parent_pid": os.getpid(),
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
            if gpus:  # number GPUs as nvidia-smi does, which is how the kernel chose them
                child_env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            # gloo and NCCL's bootstrap listen on the interface they are given: loopback
            # keeps them off the network (one machine; env= may override either).
            child_env.setdefault("GLOO_SOCKET_IFNAME", _loopback_name())
            child_env.setdefault("NCCL_SOCKET_IFNAME", _loopback_name())
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-c", "from ddplab.cluster.worker import main; main()"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    pass_fds=(theirs.fileno(), lifeline_fd), env=child_env, close_fds=True,
                    start_new_session=True,  # the rank's own process group: see killpg below
                )
            except BaseException:
                ours.close()
                theirs.close()
                self._abort_start()
                raise
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
        self._wake_r, self._wake_w = os.pipe()
        self._pump = threading.Thread(target=self._pump_output, daemon=True,
                                      name=f"ddplab-output-gen{generation}")
        self._pump.start()

    def _abort_start(self) -> None:
        for proc in self.procs:
            _kill_group(proc.pid)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        for conn in self.conns:
            conn.close()

    # -- output ----------------------------------------------------------------
    def _pump_output(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        for rank, proc in enumerate(self.procs):
            sel.register(proc.stdout, selectors.EVENT_READ, (rank, "stdout"))
            sel.register(proc.stderr, selectors.EVENT_READ, (rank, "stderr"))
        open_pipes = 2 * len(self.procs)
        stopping = False
        while open_pipes and not stopping:
            for key, _ in sel.select(timeout=1.0):
                if key.data is None:  # stop() asks us to end
                    stopping = True
                    continue
                with self._read_lock:
                    still_open = self._read_pipe(key.fileobj, *key.data)
                if not still_open:
                    sel.unregister(key.fileobj)
                    open_pipes -= 1
        sel.close()
        # This thread owns the pipes: closing them here can never race a select().
        with self._read_lock:
            for rank, proc in enumerate(self.procs):
                for stream in ("stdout", "stderr"):
                    pipe = getattr(proc, stream)
                    if not pipe.closed:
                        self._read_pipe(pipe, rank, stream)
                        pipe.close()
        os.close(self._wake_r)

    def _read_pipe(self, pipe, rank: int, stream: str) -> bool:
        """Queue what one pipe holds now (within budget); False once it is closed."""
        while True:
            try:
                data = os.read(pipe.fileno(), 65536)
            except BlockingIOError:
                return True
            except (OSError, ValueError):
                return False
            if not data:
                return False
            shown = self.budget.take(rank, stream, data)
            if shown:
                self.output.put((rank, stream, shown))

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

    def begin_job(self) -> None:
        with self._read_lock:
            self.budget.reset()

    def end_job(self) -> dict:
        """The job's output past the budget: {rank: (dropped bytes, tail chunks)}."""
        with self._read_lock:
            return self.budget.reset()

    # -- health ----------------------------------------------------------------
    def wait_ready(self, deadline: float, progress=None) -> list[tuple]:
        """Wait for every rank's first message; returns them by rank. ``progress(n_ready)``
        is called about once a second while waiting."""
        from multiprocessing.connection import wait

        import cloudpickle

        first: dict[int, tuple] = {}
        while len(first) < self.world_size:
            if progress is not None:
                progress(len(first))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait([c for r, c in enumerate(self.conns) if r not in first],
                             timeout=min(left, 1.0)):
                rank = self.conns.index(conn)
                try:
                    first[rank] = cloudpickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    first[rank] = ("died", self.exit_status(rank, wait_s=1.0))
        return [first.get(r, ("no answer",)) for r in range(self.world_size)]

    def exit_status(self, rank: int, wait_s: float = 0.0) -> int | None:
        """The rank's exit code (negative: killed by that signal), or None while it runs.

        Looks without reaping (WNOWAIT): the rank stays a zombie, so its process
        group id stays reserved until stop() has signalled the group."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = os.waitid(os.P_PID, self.pids[rank], os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # already reaped
                return self.procs[rank].returncode
            if info is not None and info.si_pid:
                killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
                return -info.si_status if killed else info.si_status
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def alive(self, rank: int) -> bool:
        return self.exit_status(rank) is None

    def dump_stacks(self, ranks, wait_s: float = 1.0) -> dict:
        """Every thread's Python stack of the given live ranks (faulthandler on SIGUSR1).

        faulthandler writes into the rank's private stacks file, not its
        stderr, so a rank that floods its output still shows where it was."""
        ranks = [r for r in ranks if self.alive(r)]
        for r in ranks:
            open(self.stacks_paths[r], "w").close()
            try:
                os.kill(self.pids[r], signal.SIGUSR1)
            except ProcessLookupError:
                pass
        texts, sizes = {}, {}
        deadline = time.monotonic() + wait_s
        while ranks and time.monotonic() < deadline:
            time.sleep(0.05)
            for r in ranks:
                size = os.path.getsize(self.stacks_paths[r]) if os.path.exists(self.stacks_paths[r]) else 0
                if size and sizes.get(r) == size:  # stopped growing: the dump is complete
                    with open(self.stacks_paths[r], errors="replace") as f:
                        texts[r] = f.read()
                sizes[r] = size
            ranks = [r for r in ranks if r not in texts]
        return texts

    # -- stopping --------------------------------------------------------------
    def stop(self, graceful: bool = True, wait_s: float = 5.0) -> list[int]:
        """Ask ranks to leave; kill whoever has not left after ``wait_s``; then kill
        every process left in each rank's group. Returns the exit codes
        (negative: killed by that signal)."""
        import cloudpickle

        if graceful:
            for conn in self.conns:
                try:
                    conn.send_bytes(cloudpickle.dumps(("shutdown",)))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + wait_s
            for r in range(self.world_size):
                self.exit_status(r, wait_s=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            _kill_group(proc.pid)  # alive or a zombie: the group id is still ours
        codes = [proc.wait() for proc in self.procs]
        for conn in self.conns:
            conn.close()
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pump already ended: every pipe had closed
            pass
        self._pump.join(timeout=5.0)
        os.close(self._wake_w)
        return codes


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _loopback_name() -> str:
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"
