"""Holding a GPU from the moment it is chosen: one lock file per GPU.

Teaches: asking ``nvidia-smi`` who uses a GPU and then starting ranks on it
is a race. Between the question and the ranks' first CUDA context (a second
or more: spawning, importing torch) a second learner's kernel asks the same
question, gets the same answer, and both clusters land on one GPU. So the
kernel that picks a GPU takes an exclusive ``flock`` on a file named after
it (its UUID, stable whatever ``CUDA_VISIBLE_DEVICES`` says) before it
starts anything, and keeps it until its Cluster shuts down. The kernel
does not need to stay polite: the operating system drops the lock when the
process that holds it dies, however it dies, so a crashed kernel never
leaves a GPU reserved.

The folder is shared by every user of the machine (``DDPLAB_GPU_LOCK_DIR``,
by default ``ddplab-gpu-locks`` in the temporary directory, mode 1777 like
``/tmp`` itself, so nobody can delete another user's file). A lock file
holds nothing: any user may open it read-only and lock it.

Leaves out: processes that are not ddplab Clusters (they take no lock; the
process list and the used memory in ``gpus.py`` catch them once they hold
a context), and machines whose temporary directory is not shared by the
learners' servers (give them one ``DDPLAB_GPU_LOCK_DIR``). A user who
holds a lock forever keeps that GPU from other ddplab Clusters; the
``doctor`` names it as reserved.

References: flock(2) (locks belong to the open file description and go
away with it); the sticky bit in chmod(2).
"""
from __future__ import annotations

import fcntl
import os
import re
import tempfile

ENV = "DDPLAB_GPU_LOCK_DIR"


def lock_dir() -> str:
    """The shared folder of lock files, created (mode 1777) if missing."""
    path = os.environ.get(ENV) or os.path.join(tempfile.gettempdir(), "ddplab-gpu-locks")
    if not os.path.isdir(path):
        try:
            os.makedirs(path, exist_ok=True)
            os.chmod(path, 0o1777)  # every user may add a file, none may remove another's
        except OSError as exc:
            raise RuntimeError(f"cannot make the GPU lock folder {path} ({exc}); set {ENV} to a "
                               "folder every learner on this machine can write") from None
    return path


def key(gpu) -> str:
    """The lock file's name for a ``gpus.GPU``: its UUID, else its index."""
    name = gpu.uuid or f"index-{gpu.index}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".lock"


def _open(name: str):
    path = os.path.join(lock_dir(), name)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o644)  # readable by the others whatever this user's umask
    except OSError:
        pass
    return os.fdopen(fd, "rb")  # a file object: closed (lock dropped) when collected


def _try_lock(f) -> bool:
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def held_elsewhere(gpu) -> bool:
    """True when another Cluster (another user, kernel, or Cluster of this process) holds it."""
    with _open(key(gpu)) as f:
        if not _try_lock(f):
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False


class Reservation:
    """The locks of the GPUs one Cluster took; ``release()`` (idempotent) gives them back."""

    def __init__(self, files: dict):
        self._files = files  # key -> open file holding the lock

    @property
    def keys(self) -> tuple:
        return tuple(self._files)

    def release(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()  # closing the last descriptor drops the flock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def reserve(gpus) -> tuple[Reservation, list]:
    """Lock every GPU it can; returns (the reservation of those, the GPUs someone else holds)."""
    files, lost = {}, []
    for g in gpus:
        f = _open(key(g))
        if _try_lock(f):
            files[key(g)] = f
        else:
            f.close()
            lost.append(g)
    return Reservation(files), lost
