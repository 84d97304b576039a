"""A /tmp and a /dev/shm of its own for each learner's server, gone when the server stops.

Teaches what a mount namespace gives a class. On one machine every learner shares ``/tmp`` and
``/dev/shm``: each sees the others' file names (torch's and ddplab's files in them say who runs
what), can fill them for everyone, and what a learner leaves there outlives their server. The
hub (root) gives each learner's server a mount namespace of its own in the spawner's preexec,
before the switch to the learner's account (:func:`enter`):

1. ``unshare(CLONE_NEWNS)``: from now on this process and its children have their own copy of
   the machine's mount table;
2. ``/`` made a *slave* mount, recursively: mounts made in here never propagate back to the
   machine, while mounts the machine makes later (a new disk) still come in;
3. a fresh ``tmpfs`` on ``/tmp`` and on ``/dev/shm``, size-limited, mode 1777 like the usual ones.

Everything the server starts (terminal, kernels, ranks) inherits the namespace, so what ddplab's
ranks put in ``/tmp`` still meets: the Cluster's FileStore folder and the ranks' stack files
(``tempfile``), torch's compile caches, NCCL's ``/dev/shm`` segments between one learner's ranks.
Nothing else changes: the network is the machine's (the hub still reaches the server over TCP),
and so are the learner's home and the class folder (a class written under /tmp has its folder,
its environment and ddplab's checkout bound back into the new /tmp at their own paths: ``keep``).
A learner cannot undo it: unmounting needs root. When the last process in the namespace ends
(the learner's groups end them all when the server stops, :func:`ddplab.course.limits.end`), the
namespace and its two tmpfs go, with every file in them.

A tmpfs holds its files in memory, and the kernel charges them to the memory cgroup of the
process that wrote them: a learner's /tmp counts against their memory limit as well as its size.
GPU lock files (:mod:`ddplab.placement.gpu_locks`) must be seen by every learner, so a class
puts them in ``/var/tmp`` (``DDPLAB_GPU_LOCK_DIR``), which stays shared.

Leaves out: ``/var/tmp`` (shared; the end of a class gives its learners' files there to the
instructor), user namespaces (the hub is root), pid and network namespaces. systemdspawner's
``isolate_tmp`` is the same idea with systemd's ``PrivateTmp``.
References: unshare(2) (CLONE_NEWNS), mount_namespaces(7) (shared subtrees: MS_SLAVE),
mount(2), tmpfs(5) (size=, mode=), the kernel's cgroup-v1 memory.txt (shmem is charged); NCCL's
troubleshooting guide on its shared memory in /dev/shm.
"""
from __future__ import annotations

import ctypes
import os
import stat
import tempfile

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_SLAVE = 0x2, 0x4, 0x1000, 0x4000, 0x80000
PLACES = ("/tmp", "/dev/shm")

# Loaded here, in the hub, not in the forked child: a child of a process with threads must not
# take locks (dlopen's) that another thread may have held at the fork.
_libc = ctypes.CDLL(None, use_errno=True)
_unshare, _mount = _libc.unshare, _libc.mount


class NamespaceError(OSError):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise NamespaceError(errno, f"{what}: {os.strerror(errno)}")


def options(size_bytes: int) -> bytes:
    """tmpfs's mount options: at most ``size_bytes``, every user may create, none may remove
    another's (1777)."""
    return f"size={int(size_bytes)},mode=1777".encode()


def _under(path: str, place: str) -> bool:
    return path.startswith(place.rstrip("/") + "/")


def kept_paths(*paths) -> list[str]:
    """The folders a class's servers need that must stay visible through a private /tmp (the
    class's folder, the environment, ddplab's checkout, when any of them lies under /tmp), made
    absolute without following a file's last symlink (a venv's python links to the system's)."""
    out = []
    for p in paths:
        p = os.path.realpath(os.path.abspath(os.fspath(p)))
        if p not in out:
            out.append(p)
    return out


def enter(size_bytes: int, places=PLACES, keep=()) -> None:
    """This process (and all it starts) gets its own mount table with a fresh tmpfs on each of
    ``places``. As root, in the spawner's preexec, before the switch of account.

    A folder of ``keep`` that lies under one of ``places`` (a class written under /tmp: its
    learners' homes, the environment their servers run) is bound back at its own path inside the
    new tmpfs, with the folders above it made again with their owners and modes: the tmpfs would
    hide it otherwise, and the server could not even enter its home."""
    opts = options(size_bytes)
    _check(_unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "making / a slave mount")
    for place in places:
        kept = []
        for path in keep:
            if _under(path, place) and os.path.isdir(path):
                above, d = [], os.path.dirname(path)
                while _under(d, place):  # the folders between the place and the kept one
                    above.insert(0, (d, os.stat(d)))
                    d = os.path.dirname(d)
                # the original, reached through a descriptor once the tmpfs covers its path
                kept.append((path, above, os.stat(path), os.open(path, os.O_PATH | os.O_DIRECTORY)))
        _check(_mount(b"tmpfs", place.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), f"tmpfs on {place}")
        for path, above, st, fd in kept:
            for d, dst in above + [(path, st)]:
                if not os.path.isdir(d):
                    os.mkdir(d)
                    os.chmod(d, stat.S_IMODE(dst.st_mode))
                    os.chown(d, dst.st_uid, dst.st_gid)
            _check(_mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC, None),
                   f"keeping {path} visible in the private {place}")
            os.close(fd)


def works() -> str | None:
    """None where :func:`enter` works on this machine, else why not. Tried in a forked child on
    a folder of its own (the machine's /tmp is left alone)."""
    if os.geteuid() != 0:
        return "needs root (the hub's): a mount namespace with a tmpfs cannot be checked as a user"
    probe = tempfile.mkdtemp(prefix="ddplab-ns-probe-")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        try:
            os.close(read)
            enter(1 << 20, places=(probe,))
            said = b""
        except BaseException as e:  # noqa: BLE001 (any failure is the answer)
            said = str(e).encode() or b"failed"
        os.write(write, said)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    os.rmdir(probe)
    return said or None
