"""Log-ins limited per name and per address: a burst of wrong passwords is refused before PAM sees it.

Teaches: JupyterHub's ``PAMAuthenticator`` checks each password on a thread of its pool
(``executor_threads``, 4 by default), and PAM makes a wrong password wait on that thread
(Debian's ``login`` service, the one JupyterHub uses, waits 3 s with ``pam_faildelay``). A few
wrong passwords sent at once fill a small pool, and everybody's log-in, the instructor's too,
waits behind them. :class:`LoginLimits` counts failed log-ins over a sliding window; past a
limit it answers at once, with the seconds to wait, and the password is not checked. Its rules:

- a name and a password longer than any real one (:data:`MAX_NAME`, :data:`MAX_PASSWORD`) are
  refused like a wrong password, before any limit, any name lookup or PAM: a name of megabytes
  reaches ``getpwnam`` inside PAM, and systemd's user database (``passwd: files systemd`` in
  ``/etc/nsswitch.conf``) aborts the whole hub on it;
- names are compared as JupyterHub stores them (stripped, lower-case), and checked that way, so
  ``Ann`` from a phone's keyboard logs in as ``ann``;
- a name is limited per address: ``per_name`` failures for a name from one address refuse that
  name from that address only, so nobody can lock a learner (or the instructor) out from
  elsewhere. ``per_name_everywhere`` failures for a name from all addresses together (guessing
  from many machines) refuse it from every address that has never logged in as it; the
  addresses it logged in from before still get in. The trade-off: someone with that many
  machines can keep a learner who has not yet logged in out for one window; the instructor
  clears it with ``classroom --unlock NAME``;
- an address is limited across names (``per_address``), whoever logs in from it meanwhile;
- an attempt counts as a failure from the moment it starts, so that many sent at once cannot all
  slip past a limit while PAM is still busy with the first; a success clears only the failures
  of its own name from its own address;
- the address is the one configurable-http-proxy saw (the last entry of ``X-Forwarded-For``,
  which the proxy appends to whatever the browser sent), or, when that one is a proxy of yours
  listed in ``trusted_proxies``, the entry that proxy appended before it. Tornado's
  ``remote_ip`` would take a browser's own ``X-Real-Ip`` header instead, so anyone could pick
  an address.

:class:`RateLimitedLogins` puts the limits in front of any JupyterHub authenticator (the class
config writes ``class ClassAuthenticator(RateLimitedLogins, PAMAuthenticator)``); a refusal is a
``tornado.web.HTTPError(429, message)`` with a ``Retry-After`` header, which JupyterHub's login
page shows in place of "Invalid username or password". So that a right password is not queued
behind wrong ones, its PAM check runs on a pool of its own (:data:`CLEAN_THREADS`) when neither
its name nor its address failed within the window; the others run on a second pool
(:data:`SUSPECT_THREADS`) whose threads have the lowest CPU priority, so that hashing a burst of
wrong passwords does not slow down the check of a right one either.

Leaves out: limits shared between hubs (the counts live in the hub's memory, and a restart
clears them), locking accounts, CAPTCHAs; fail2ban reading the hub's log does these system-wide.
References: JupyterHub's ``Authenticator.authenticate`` (raising ``web.HTTPError`` sets the
message shown) and ``PAMAuthenticator.executor_threads``; Tornado's ``run_on_executor``,
``HTTPServer(xheaders=True)`` and ``RequestHandler.set_default_headers``; pam_faildelay(8);
setpriority(2); useradd(8) (names of at most 32 characters); configurable-http-proxy's
``--no-x-forward`` (off by default); RFC 6585 (429 and ``Retry-After``).
"""
from __future__ import annotations

import asyncio
import inspect
import ipaddress
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

# Sane for a class: a learner mistyping five times in two minutes waits at most two minutes;
# one address gets ten wrong passwords in two minutes, whatever names they are for.
PER_NAME = 5
PER_ADDRESS = 10
# A name's failures from all addresses together: six addresses at the per-name limit. Below it
# guessing a generated password (60 bits) from many machines gets 30 tries every two minutes.
PER_NAME_EVERYWHERE = 30
WINDOW_S = 120.0
MAX_WINDOW_S = 86400.0  # a day: longer is a lock that only a restart or --unlock lifts
# useradd (shadow 4.13, Debian 12) refuses a 33-character name; no account has a longer one.
MAX_NAME = 32
# Far longer than any password a person types; bounds what reaches PAM's hashing.
MAX_PASSWORD = 1024
# PAM checks run on two pools of threads: one for attempts whose name and address have no
# failures in the window, one, at the lowest CPU priority, for the others. Each wrong password
# holds its thread for PAM's fail delay (3 s), and hashing the password (yescrypt, some 60 ms of
# CPU here) competes for the CPU with every other check in the hub's process; the limits bound
# how many are in flight per address, so mostly sleeping threads cost little.
CLEAN_THREADS = 16
SUSPECT_THREADS = 48


class Refusal(NamedTuple):
    message: str
    wait_s: int


class LoginLimits:
    """Failed log-ins within ``window_s``: per name from one address, per address, per name from
    all addresses; 0 turns a limit off. ``unlock_dir`` is where ``classroom --unlock`` leaves
    names to clear; ``trusted_proxies`` are addresses (or networks) of reverse proxies of yours."""

    def __init__(self, per_name: int = PER_NAME, per_address: int = PER_ADDRESS, window_s: float = WINDOW_S,
                 per_name_everywhere: int = PER_NAME_EVERYWHERE, trusted_proxies=(), unlock_dir=None,
                 clock=time.monotonic):
        counts = {"per_name (--login-failures)": per_name, "per_address (--login-address-failures)": per_address,
                  "per_name_everywhere (--login-name-failures-everywhere)": per_name_everywhere}
        for what, n in counts.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"the log-in limit {what} must be a whole number, 0 (off) or more: got {n!r}")
        if (isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not math.isfinite(window_s)
                or not 0 < window_s <= MAX_WINDOW_S):
            raise ValueError(f"the log-in window (--login-window) must be a number of seconds above 0 and at "
                             f"most {MAX_WINDOW_S:.0f} (a day): got {window_s!r}")
        self.limits = {"pair": per_name, "address": per_address, "name": per_name_everywhere}
        self.window_s, self.clock = float(window_s), clock
        self.trusted = trusted_networks(trusted_proxies)
        self.unlock_dir = Path(unlock_dir) if unlock_dir else None
        # each key -> (time, other): ("pair", name, address) -> (time, None),
        # ("address", address) -> (time, name), ("name", name) -> (time, address)
        self.failures: dict[tuple, deque] = {}
        self.known: dict[str, deque] = {}  # name -> the last addresses it logged in from
        self._lanes = {}  # clean (True) or not -> its ThreadPoolExecutor, made at first use

    def start(self, name: str, address: str) -> Refusal | None:
        """A refusal saying when to try again, or None: then the attempt counts as failed until
        :meth:`succeeded` says otherwise."""
        now = self.clock()
        self.forget_before(now - self.window_s)
        name, address = name_key(name), address[:64]
        counted = {"pair": ("pair", name, address), "address": ("address", address), "name": ("name", name)}
        for kind, key in counted.items():
            limit, seen = self.limits[kind], self.failures.get(key, ())
            if kind == "name" and address in self.known.get(name, ()):
                continue  # it logged in from here before: its owner, most likely
            if limit and len(seen) >= limit:
                wait = max(math.ceil(seen[-limit][0] + self.window_s - now), 1)
                who = {"pair": "for this name", "address": "from your address",
                       "name": "for this name from many addresses"}[kind]
                return Refusal(f"too many failed log-ins {who}: try again in {wait} s", wait)
        self.failures.setdefault(counted["pair"], deque()).append((now, None))
        self.failures.setdefault(counted["address"], deque()).append((now, name))
        self.failures.setdefault(counted["name"], deque()).append((now, address))
        return None

    def clean(self, name: str, address: str) -> bool:
        """True when neither the name nor the address has failed within the window."""
        self.forget_before(self.clock() - self.window_s)
        return ("name", name_key(name)) not in self.failures and ("address", address[:64]) not in self.failures

    def succeeded(self, name: str, address: str) -> None:
        """Clears this name's failures from this address, nothing else."""
        name, address = name_key(name), address[:64]
        self.failures.pop(("pair", name, address), None)
        self._drop(("address", address), lambda other: other == name)
        self._drop(("name", name), lambda other: other == address)
        known = self.known.setdefault(name, deque(maxlen=8))
        if address not in known:
            known.append(address)

    def unlock(self, name: str) -> None:
        """Every failure counted for ``name``, from every address, forgotten."""
        name = name_key(name)
        for key in [k for k in self.failures if k[0] == "pair" and k[1] == name]:
            del self.failures[key]
        self.failures.pop(("name", name), None)
        for key in [k for k in self.failures if k[0] == "address"]:
            self._drop(key, lambda other: other == name)

    def take_unlocks(self) -> list[str]:
        """Names that ``classroom --unlock`` left in ``unlock_dir`` since the last call, unlocked."""
        try:
            requests = list(os.scandir(self.unlock_dir)) if self.unlock_dir else []
        except FileNotFoundError:
            return []
        names = []
        for entry in requests:
            try:
                text = Path(entry.path).read_text()[:4096]
                os.unlink(entry.path)
            except OSError:
                continue
            names += text.split()
        for name in names:
            self.unlock(name)
        return names

    def lane(self, clean: bool) -> ThreadPoolExecutor:
        """The threads a PAM check runs on: the suspects' at the lowest CPU priority, so that a
        burst of them neither holds up nor slows down the others' checks."""
        if clean not in self._lanes:
            self._lanes[clean] = (ThreadPoolExecutor(CLEAN_THREADS, thread_name_prefix="login-check") if clean else
                                  ThreadPoolExecutor(SUSPECT_THREADS, thread_name_prefix="login-check-suspect",
                                                     initializer=lowest_priority))
        return self._lanes[clean]

    def _drop(self, key: tuple, match) -> None:
        kept = deque(entry for entry in self.failures.get(key, ()) if not match(entry[1]))
        if kept:
            self.failures[key] = kept
        else:
            self.failures.pop(key, None)

    def forget_before(self, oldest: float) -> None:
        for key in list(self.failures):
            times = self.failures[key]
            while times and times[0][0] <= oldest:  # counted for window_s, not a moment more
                times.popleft()
            if not times:
                del self.failures[key]


def lowest_priority() -> None:
    # Linux keeps a nice value per thread: setpriority with a thread's id sets that thread's only
    # (setpriority(2), NOTES); raising one's own needs no privilege
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def name_key(name: str) -> str:
    # as JupyterHub stores a name (its normalize_username lower-cases; its login form strips);
    # longer names never reach the limits (MAX_NAME), the slice only bounds memory in any case
    return name.strip().lower()[:64]


def trusted_networks(given) -> list:
    """``given`` (addresses or networks such as 10.0.0.0/24) as ipaddress networks, said in words if bad."""
    if isinstance(given, str):
        given = [given]
    networks = []
    for entry in given:
        try:
            networks.append(ipaddress.ip_network(str(entry).strip(), strict=False))
        except ValueError:
            raise ValueError(f"--trusted-proxy {entry!r} is not an address or a network (such as 127.0.0.1 "
                             "or 10.0.0.0/24)") from None
    return networks


def _is_trusted(hop: str, trusted) -> bool:
    try:
        address = ipaddress.ip_address(hop)
    except ValueError:
        return False
    return any(address in network for network in trusted)


def client_address(request, trusted=()) -> str:
    """The address configurable-http-proxy saw (the last ``X-Forwarded-For`` entry), else the peer's.

    Where that address is a trusted proxy, the entry it appended before (walking right to left
    past trusted proxies); where every entry is one, its ``X-Real-Ip``. A browser's own headers
    decide nothing unless a trusted proxy passed them on as its own.
    """
    hops = [hop.strip() for hop in request.headers.get("X-Forwarded-For", "").split(",") if hop.strip()]
    if not hops:
        return request.remote_ip or "unknown"
    while trusted and len(hops) > 1 and _is_trusted(hops[-1], trusted):
        hops.pop()
    if trusted and _is_trusted(hops[-1], trusted):
        return request.headers.get("X-Real-Ip", "").strip() or hops[-1]
    return hops[-1]


def retry_after(handler, seconds: int) -> None:
    """A ``Retry-After`` header on the error page that follows: Tornado's ``send_error`` clears the
    headers set so far and then calls ``set_default_headers``, so the header is added there."""
    default = handler.set_default_headers

    def set_default_headers():
        default()
        handler.set_header("Retry-After", str(seconds))

    handler.set_default_headers = set_default_headers


class RateLimitedLogins:
    """Put first among an authenticator's bases; set ``limits`` on the class (a :class:`LoginLimits`)."""

    limits = LoginLimits()

    async def authenticate(self, handler, data):
        from tornado import web

        name, password = (data.get("username") or "").strip().lower(), data.get("password") or ""
        limits = self.limits
        address = client_address(handler.request, limits.trusted)[:64] if handler is not None else "unknown"
        if len(name) > MAX_NAME or len(password) > MAX_PASSWORD:
            # no name lookup, no PAM: a name of megabytes aborts systemd's user database
            self.log.warning("log-in refused unchecked from %s: a %d-character name or a %d-character password",
                             address, len(name), len(password))
            return None
        for unlocked in limits.take_unlocks():
            self.log.warning("log-in limits: %r unlocked at the instructor's request", unlocked[:32])
        clean = limits.clean(name, address)
        refusal = limits.start(name, address)
        if refusal:
            self.log.warning("log-in refused without checking the password (%r from %s): %s",
                             name, address, refusal.message)
            if handler is not None:
                retry_after(handler, refusal.wait_s)
            raise web.HTTPError(429, refusal.message)
        user = self.check_password(handler, {**data, "username": name}, limits.lane(clean))
        user = await user if inspect.isawaitable(user) else user
        if user:
            limits.succeeded(name, address)
        else:
            self.log.warning("log-in failed (%r from %s, the address the limits count)", name, address)
        return user

    def check_password(self, handler, data, lane: ThreadPoolExecutor):
        """The next authenticator's ``authenticate``; where that runs on its own executor (Tornado's
        ``run_on_executor``, as PAMAuthenticator's does), its function runs on ``lane`` instead."""
        method = super().authenticate
        inner = getattr(method, "__wrapped__", None)
        if inner is None or not hasattr(self, "executor"):
            return method(handler, data)
        return asyncio.wrap_future(lane.submit(inner, self, handler, data))


def request_unlock(folder: Path, given) -> list[str]:
    """``classroom --unlock``: one file per request in the hub's own folder (0700, the hub's
    user's), written whole; the running hub reads and removes it at its next log-in attempt
    (``LoginLimits.take_unlocks``). Returns the names; ValueError says what is wrong."""
    if not (folder / "jupyterhub_config.py").exists():
        raise ValueError(f"{folder} holds no class (no jupyterhub_config.py): pass the class's folder")
    if not (folder / "hub").is_dir():
        raise ValueError(f"{folder}'s hub has never started ({folder / 'hub'} is missing): nothing to unlock")
    names = [n.strip().lower() for n in given]
    bad = [n for n in names if not n or len(n) > MAX_NAME or not n.isprintable() or " " in n]
    if bad:
        raise ValueError(f"not an account name: {bad[0]!r}")
    requests = folder / "hub" / "unlock"
    try:
        requests.mkdir(mode=0o700, exist_ok=True)
        tmp = requests.parent / f".unlock-{os.getpid()}"
        tmp.write_text("\n".join(names) + "\n")
        tmp.replace(requests / f"{os.getpid()}-{time.time_ns()}")  # whole, never half-written
    except PermissionError:
        raise ValueError(f"cannot write in {folder / 'hub'}: run --unlock as the hub's user (root)") from None
    return names

