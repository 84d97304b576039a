"""Another user on the same server can neither reach nor disturb a learner's rendezvous."""
from __future__ import annotations

import glob
import json
import os
import stat
import subprocess
import sys

import pytest
from _procs import listening_inodes, socket_inodes

import ddplab

NOBODY = 65534

PROBE = r"""
import json, os, socket, sys
store_dir, store_file, kernel_listeners = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
seen = {"uid": os.getuid()}
def attempt(name, fn):
    try:
        fn()
        seen[name] = "allowed"
    except OSError as exc:
        seen[name] = type(exc).__name__
attempt("list_store_dir", lambda: os.listdir(store_dir))
attempt("read_store", lambda: open(store_file, "rb").read())
attempt("rewrite_store", lambda: open(store_file, "ab").write(b"gen1/evil"))
attempt("plant_next_store", lambda: open(os.path.join(store_dir, "gen1.store"), "wb").close())
for host_port in kernel_listeners:
    host, port = host_port.rsplit(":", 1)
    attempt("connect " + host_port,
            lambda: socket.create_connection((host.strip("[]"), int(port)), timeout=2).close())
print(json.dumps(seen))
"""


@pytest.fixture
def cluster(cluster2):
    return cluster2  # shared for the session (conftest.py)


def _kernel_listeners() -> list[str]:
    mine = socket_inodes()
    return [addr for inode, addr in listening_inodes().items() if inode in mine]


def test_the_kernel_listens_on_no_port(cluster):
    # torch's TCPStore server listened on every interface, unauthenticated.
    assert _kernel_listeners() == []


def test_the_store_lives_in_a_directory_only_this_user_can_enter(cluster):
    store_dir = cluster._gens.rendezvous.dir
    assert stat.S_IMODE(os.stat(store_dir).st_mode) == 0o700
    assert os.stat(store_dir).st_uid == os.getuid()
    assert len(glob.glob(os.path.join(store_dir, "*.store"))) == 1  # this generation's only


def test_gloo_listens_on_loopback_only(cluster):
    # What a multi-user server still exposes (README): gloo's own listeners, on 127.0.0.1.
    listening = listening_inodes()
    for pid in cluster.pids:
        for inode in socket_inodes(pid) & set(listening):
            assert listening[inode].startswith(("127.", "[::1]", "[::ffff:127.")), listening[inode]


def _interpreter_nobody_can_run() -> str:
    # The probe needs only the standard library: any Python 3 other users may execute.
    for path in (os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"):
        path = os.path.realpath(path)
        parts = path.split("/")
        dirs = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
        if os.path.exists(path) and all(os.stat(d).st_mode & 0o001 for d in dirs) \
                and os.stat(path).st_mode & 0o001:
            return path
    pytest.skip("no Python interpreter here that another user may run")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (CI runs as root)")
def test_another_user_can_neither_read_nor_rewrite_the_rendezvous(cluster):
    store_dir = cluster._gens.rendezvous.dir
    store_file = glob.glob(os.path.join(store_dir, "*.store"))[0]
    python = _interpreter_nobody_can_run()
    probe = subprocess.run(
        [python, "-I", "-S", "-c", PROBE, store_dir, store_file, json.dumps(_kernel_listeners())],
        user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True, timeout=60,
        cwd="/",
    )
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout)
    assert seen["uid"] == NOBODY
    for what in ("list_store_dir", "read_store", "rewrite_store", "plant_next_store"):
        assert seen[what] == "PermissionError", (what, seen)
    assert not [k for k, v in seen.items() if k.startswith("connect") and v == "allowed"]
    # ...and the learner's cluster carries on, replacements included.
    assert cluster.run(lambda: 1) == [1, 1]


@pytest.mark.slow
def test_shutdown_deletes_the_store():
    c = ddplab.Cluster(2, timeout=20)
    store_dir = c._gens.rendezvous.dir
    c.run(lambda: 0)
    c.shutdown()
    assert not os.path.exists(store_dir)


def test_a_dead_kernels_rendezvous_folder_is_removed_and_a_live_ones_kept(tmp_path):
    import subprocess
    import sys

    from ddplab.cluster import rendezvous

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    dead, live, other = tmp_path / "ddplab-dead", tmp_path / "ddplab-live", tmp_path / "ddplab-lab05-x"
    for folder, pid in ((dead, gone), (live, str(os.getppid()))):
        folder.mkdir()
        (folder / rendezvous.OWNER).write_text(pid)
        (folder / "gen0.store").write_bytes(b"")
    other.mkdir()  # no owner file: not a rendezvous folder, never touched
    assert rendezvous.remove_leftovers(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and other.exists()
