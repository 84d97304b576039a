"""What the test process itself holds: threads, file descriptors, child processes, memory."""
from __future__ import annotations

import os
import time


def gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def wait_gone(pids, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return all(gone(p) for p in pids)


def rank_children() -> set[int]:
    """Live rank processes whose parent is this process."""
    me, found = os.getpid(), set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"ddplab.cluster.worker" in cmd:
            found.add(int(name))
    return found


def wait_rank_children(expected: set[int], timeout: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and rank_children() != expected:
        time.sleep(0.05)
    return rank_children()


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def listening_inodes() -> dict[int, str]:
    """Every listening TCP socket of this network namespace: inode -> local address."""
    found = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A":  # LISTEN
                found[int(cols[9])] = _address(cols[1], v6)
    return found


def _address(hex_addr: str, v6: bool) -> str:
    import ipaddress

    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if v6:
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        return f"[{ipaddress.IPv6Address(raw)}]:{int(port, 16)}"
    return f"{ipaddress.IPv4Address(raw[::-1])}:{int(port, 16)}"


def socket_inodes(pid: int | str = "self") -> set[int]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[8:-1]))
    return found
