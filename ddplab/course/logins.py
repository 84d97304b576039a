"""Log-ins limited per name and per address: a burst of wrong passwords is refused before PAM sees it.

Teaches: JupyterHub's ``PAMAuthenticator`` checks each password in a pool of threads (4 by
default, ``executor_threads``), and PAM makes a wrong password wait (Debian's ``login`` service,
the one JupyterHub uses, waits 3 s with ``pam_faildelay``). A few
wrong passwords sent at once fill that pool, and everybody's log-in, the instructor's too, waits
behind them. :class:`LoginLimits` counts failed log-ins per name and per address over a sliding
window; past the limit it answers at once, with the seconds to wait, and the password is not
checked. Three rules keep it fair and short:

- an attempt counts as a failure from the moment it starts, so that many sent at once cannot
  all slip past the limit while PAM is still busy with the first;
- a successful log-in clears its name's failures and its address's (a classroom behind one
  NAT address shares it: the learners who log in keep it open for the one who mistyped);
- the address is the one configurable-http-proxy saw: the last entry of ``X-Forwarded-For``,
  which the proxy appends to whatever the browser sent. (Tornado's ``remote_ip`` would take a
  browser's own ``X-Real-Ip`` header instead, so anyone could pick an address.)

:class:`RateLimitedLogins` puts the limits in front of any JupyterHub authenticator (the class
config writes ``class ClassAuthenticator(RateLimitedLogins, PAMAuthenticator)``); a refusal is a
``tornado.web.HTTPError(429, message)``, which JupyterHub's login page shows in place of
"Invalid username or password".

Leaves out: limits shared between hubs (the counts live in the hub's memory, and a restart
clears them), locking accounts, CAPTCHAs; fail2ban reading the hub's log does these system-wide.
References: JupyterHub's ``Authenticator.authenticate`` (raising ``web.HTTPError`` sets the
message shown) and ``PAMAuthenticator.executor_threads``; pam_faildelay(8); Tornado's
``HTTPServer(xheaders=True)``; configurable-http-proxy's ``--no-x-forward`` (off by default).
"""
from __future__ import annotations

import inspect
import math
import time
from collections import deque

# Sane for a class: a learner mistyping five times in two minutes waits at most two minutes;
# one address gets ten wrong passwords between successful log-ins from it.
PER_NAME = 5
PER_ADDRESS = 10
WINDOW_S = 120.0


class LoginLimits:
    """Failed log-ins per name and per address within ``window_s``; 0 turns a limit off."""

    def __init__(self, per_name: int = PER_NAME, per_address: int = PER_ADDRESS, window_s: float = WINDOW_S,
                 clock=time.monotonic):
        if per_name < 0 or per_address < 0 or window_s <= 0:
            raise ValueError(f"log-in limits must be 0 (off) or more, and the window more than 0 s: got "
                             f"{per_name} per name, {per_address} per address, {window_s} s (classroom's "
                             "--login-failures, --login-address-failures, --login-window)")
        self.limits = {"name": per_name, "address": per_address}
        self.window_s, self.clock = window_s, clock
        self.failures: dict[tuple[str, str], deque] = {}

    def start(self, name: str, address: str) -> str | None:
        """A refusal saying when to try again, or None: then the attempt counts as failed until
        :meth:`succeeded` says otherwise."""
        now = self.clock()
        self.forget_before(now - self.window_s)
        keys = {"name": ("name", name_key(name)), "address": ("address", address)}
        for kind, counted in keys.items():
            seen = self.failures.get(counted, ())
            if self.limits[kind] and len(seen) >= self.limits[kind]:
                wait = math.ceil(seen[-self.limits[kind]] + self.window_s - now)
                who = "for this name" if kind == "name" else "from your address"
                return f"too many failed log-ins {who}: try again in {max(wait, 1)} s"
        for counted in keys.values():
            self.failures.setdefault(counted, deque()).append(now)
        return None

    def succeeded(self, name: str, address: str) -> None:
        self.failures.pop(("name", name_key(name)), None)
        self.failures.pop(("address", address), None)

    def forget_before(self, oldest: float) -> None:
        for key in list(self.failures):
            times = self.failures[key]
            while times and times[0] <= oldest:  # counted for window_s, not a moment more
                times.popleft()
            if not times:
                del self.failures[key]


def name_key(name: str) -> str:
    # JupyterHub lower-cases names; a name is at most 32 characters, so a long one cannot fill memory
    return name.strip().lower()[:64]


def client_address(request) -> str:
    """The address configurable-http-proxy saw (the last ``X-Forwarded-For`` entry), else the peer's."""
    forwarded = request.headers.get("X-Forwarded-For", "")
    return forwarded.split(",")[-1].strip() or request.remote_ip or "unknown"


class RateLimitedLogins:
    """Put first among an authenticator's bases; set ``limits`` on the class (a :class:`LoginLimits`)."""

    limits = LoginLimits()

    async def authenticate(self, handler, data):
        from tornado import web

        name = data.get("username") or ""
        address = client_address(handler.request) if handler is not None else "unknown"
        refusal = self.limits.start(name, address)
        if refusal:
            self.log.warning("log-in refused without checking the password (%r from %s): %s",
                             name[:32], address, refusal)
            raise web.HTTPError(429, refusal)
        user = super().authenticate(handler, data)
        user = await user if inspect.isawaitable(user) else user
        if user:
            self.limits.succeeded(name, address)
        return user
