"""Log-ins limited per name and per address (ddplab/course/logins.py), on a fake clock with a fake
password check, and in the hub config the classroom writes (loaded, no hub started)."""
import asyncio
import os
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from ddplab.course import logins
from ddplab.course.logins import LoginLimits, RateLimitedLogins, client_address

web = pytest.importorskip("tornado.web")
run_on_executor = pytest.importorskip("tornado.concurrent").run_on_executor


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Checked:
    """A fake PAM: the password is 'right'; counts the checks and can make them slow."""

    def __init__(self, seconds=0.0):
        self.calls, self.seconds = 0, seconds
        self.log = types.SimpleNamespace(warning=lambda *a: None, info=lambda *a: None)

    async def authenticate(self, handler, data):
        self.calls += 1
        await asyncio.sleep(self.seconds)
        return data["username"] if data["password"] == "right" else None


def authenticator(limits, seconds=0.0):
    class Limited(RateLimitedLogins, Checked):
        pass

    Limited.limits = limits
    return Limited(seconds)


def request(address, **headers):
    """A log-in form's handler, as far as the limits use it (its request, its response's headers)."""
    return types.SimpleNamespace(request=types.SimpleNamespace(remote_ip="127.0.0.1", headers={
        "X-Forwarded-For": address, **headers}), set_default_headers=lambda: None, set_header=lambda *a: None)


def log_in(auth, name, password, address="10.0.0.1"):
    return asyncio.run(auth.authenticate(request(address), {"username": name, "password": password}))


def test_past_the_limit_a_name_is_refused_at_once_from_that_address_saying_when_then_let_in_again():
    clock = Clock()
    auth = authenticator(LoginLimits(per_name=3, per_address=0, window_s=60, clock=clock))
    for _ in range(3):
        assert log_in(auth, "ann", "wrong") is None
        clock.t += 10
    with pytest.raises(web.HTTPError) as refused:
        log_in(auth, "Ann", "right")  # the name as JupyterHub compares it: case does not matter
    assert refused.value.status_code == 429 and auth.calls == 3  # the password was not checked
    assert "try again in 30 s" in refused.value.log_message  # when the first failure leaves the window
    assert log_in(auth, "ann", "right", address="10.0.0.2") == "ann"  # nobody locks ann out from elsewhere
    clock.t += 30
    assert log_in(auth, "ann", "right") == "ann"
    assert log_in(auth, "bob", "wrong") is None  # other names never waited


def test_a_name_guessed_from_many_addresses_is_refused_only_where_it_never_logged_in():
    clock = Clock()
    limits = LoginLimits(per_name=2, per_address=0, per_name_everywhere=4, window_s=60, clock=clock)
    auth = authenticator(limits)
    assert log_in(auth, "ann", "right", address="10.0.0.1") == "ann"  # her own laptop, this morning
    for attacker in ("10.6.0.1", "10.6.0.2"):
        for _ in range(2):
            assert log_in(auth, "ann", "wrong", address=attacker) is None
    with pytest.raises(web.HTTPError, match="for this name from many addresses: try again in 60 s"):
        log_in(auth, "ann", "wrong", address="10.6.0.3")
    assert log_in(auth, "ann", "right", address="10.0.0.1") == "ann"  # where she logged in before
    with pytest.raises(web.HTTPError, match="many addresses"):  # a new address of hers waits: the trade-off
        log_in(auth, "ann", "right", address="10.0.0.9")
    limits.unlock("ANN")  # the instructor's --unlock
    assert log_in(auth, "ann", "right", address="10.0.0.9") == "ann"


def test_the_instructors_unlock_reaches_the_limits_through_a_file_read_at_the_next_attempt(tmp_path):
    clock = Clock()
    limits = LoginLimits(per_name=2, per_address=0, window_s=60, unlock_dir=tmp_path / "unlock", clock=clock)
    auth = authenticator(limits)
    for _ in range(2):
        log_in(auth, "ann", "wrong")
    with pytest.raises(web.HTTPError):
        log_in(auth, "ann", "right")
    (tmp_path / "unlock").mkdir()
    (tmp_path / "unlock" / "1-1").write_text("ann\nbob\n")
    assert log_in(auth, "ann", "right") == "ann"
    assert list((tmp_path / "unlock").iterdir()) == []  # read once


def test_an_address_is_limited_across_names_and_a_success_clears_only_its_own_names_failures():
    clock = Clock()
    auth = authenticator(LoginLimits(per_name=0, per_address=3, window_s=60, clock=clock))
    for name in ("ann", "bob", "cid"):
        assert log_in(auth, name, "wrong") is None
    with pytest.raises(web.HTTPError, match="from your address"):
        log_in(auth, "dan", "right")
    assert log_in(auth, "dan", "right", address="10.0.0.2") == "dan"  # another address is not held up
    # a learner who knows their own password cannot wipe the wrong names they tried
    limits = LoginLimits(per_name=5, per_address=3, window_s=60, clock=clock)
    auth = authenticator(limits)
    for name in ("bob", "cid"):
        assert log_in(auth, name, "wrong") is None
    assert log_in(auth, "ann", "right") == "ann"
    assert log_in(auth, "dan", "wrong") is None
    with pytest.raises(web.HTTPError, match="from your address"):
        log_in(auth, "eve", "wrong")
    # ann's own mistakes are hers to clear: two wrong, then right, leave the address its room
    clock.t += 61
    for _ in range(2):
        log_in(auth, "ann", "wrong")
    assert log_in(auth, "ann", "right") == "ann" and limits.failures == {}


def test_attempts_sent_at_once_count_before_their_passwords_are_checked():
    # 8 wrong passwords at once while the check is slow: only the limit's worth reach the check
    auth = authenticator(LoginLimits(per_name=3, per_address=10, window_s=60, clock=Clock()), seconds=0.05)

    async def burst():
        tries = [auth.authenticate(request("10.0.0.9"), {"username": "t", "password": "x"}) for _ in range(8)]
        return await asyncio.gather(*tries, return_exceptions=True)

    answers = asyncio.run(burst())
    assert auth.calls == 3
    assert sum(isinstance(a, web.HTTPError) for a in answers) == 5


class Pam:
    """A fake PAMAuthenticator: its check runs on a thread (Tornado's ``run_on_executor``) and a
    wrong password holds that thread, as PAM's fail delay does; it notes each check's thread."""

    executor = ThreadPoolExecutor(1)  # PAMAuthenticator's own pool: the limits pick a lane instead

    def __init__(self):
        self.release, self.seen = threading.Event(), []
        self.log = types.SimpleNamespace(warning=lambda *a: None)

    @run_on_executor
    def authenticate(self, handler, data):
        self.seen.append((data["username"], threading.current_thread().name,
                          os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        if data["password"] != "right":
            self.release.wait(20)
            return None
        return data["username"]


def test_a_log_in_without_recent_failures_is_not_queued_behind_wrong_ones_nor_slowed(monkeypatch):
    monkeypatch.setattr(logins, "SUSPECT_THREADS", 2)

    class Limited(RateLimitedLogins, Pam):
        limits = LoginLimits(per_name=10, per_address=10, window_s=60, clock=Clock())

    auth = Limited()

    async def scene():
        def attempt(name, password, address):
            return asyncio.ensure_future(auth.authenticate(request(address), {"username": name, "password": password}))

        first = attempt("t", "x", "10.6.0.1")  # nothing failed yet: the clean lane
        await asyncio.sleep(0)
        suspects = [attempt("t", "x", "10.6.0.1") for _ in range(5)]  # two on the suspects' threads, three queued
        try:  # a hang here would be the instructor queued behind them
            mine = await asyncio.wait_for(attempt("inst", "right", "10.0.0.1"), 15)
        finally:
            auth.release.set()
        await asyncio.gather(first, *suspects)
        return mine

    assert asyncio.run(scene()) == "inst"
    for pool in Limited.limits._lanes.values():
        pool.shutdown()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    lanes = {(name, thread.startswith("login-check-suspect"), nice) for name, thread, nice in auth.seen}
    assert lanes == {("t", False, base), ("t", True, 19), ("inst", False, base)}
    assert len(auth.seen) == 7


def test_a_name_or_password_longer_than_any_real_one_never_reaches_a_name_lookup_or_pam(monkeypatch):
    import pwd

    def looked_up(name):
        raise AssertionError(f"getpwnam called with {len(name)} characters")

    monkeypatch.setattr(pwd, "getpwnam", looked_up)
    auth = authenticator(LoginLimits(clock=Clock()))
    assert log_in(auth, "a" * 5_000_000, "x") is None  # the same answer as a wrong password
    assert log_in(auth, "a" * 33, "right") is None
    assert log_in(auth, "ann", "x" * (logins.MAX_PASSWORD + 1)) is None
    assert auth.calls == 0 and auth.limits.failures == {}
    assert log_in(auth, "a" * 32, "right") == "a" * 32  # useradd's longest name still logs in


def test_a_capitalised_name_is_checked_as_the_account_it_names():
    auth = authenticator(LoginLimits(per_name=2, per_address=0, clock=Clock()))
    assert log_in(auth, " OLTEST01 ", "right") == "oltest01"  # PAM is asked about oltest01
    log_in(auth, "OLTEST01", "wrong")
    log_in(auth, "Oltest01", "wrong")
    with pytest.raises(web.HTTPError):
        log_in(auth, "oltest01", "right")


def test_a_refusal_says_when_to_retry_in_its_header_too():
    headers = {}
    handler = request("10.0.0.3")
    handler.set_header = headers.__setitem__
    handler.set_default_headers = lambda: headers.clear()  # as Tornado's send_error does, then its defaults
    auth = authenticator(LoginLimits(per_name=1, per_address=0, window_s=60, clock=Clock()))
    asyncio.run(auth.authenticate(handler, {"username": "ann", "password": "wrong"}))
    with pytest.raises(web.HTTPError):
        asyncio.run(auth.authenticate(handler, {"username": "ann", "password": "wrong"}))
    handler.set_default_headers()
    assert headers == {"Retry-After": "60"}


def test_the_address_is_the_one_the_proxy_appended_not_one_the_browser_claims():
    forged = request("1.2.3.4, 10.0.0.7", **{"X-Real-Ip": "9.9.9.9"}).request
    assert client_address(forged) == "10.0.0.7"
    assert client_address(types.SimpleNamespace(remote_ip="10.0.0.8", headers={})) == "10.0.0.8"


def test_behind_a_trusted_reverse_proxy_the_address_it_saw_counts_and_only_then():
    trusted = logins.trusted_networks(["127.0.0.1", "10.9.0.0/16"])
    # nginx ($proxy_add_x_forwarded_for) appended the browser's address; the proxy appended nginx's
    behind = request("6.6.6.6, 203.0.113.5, 127.0.0.1").request
    assert client_address(behind, trusted) == "203.0.113.5"
    twice = request("6.6.6.6, 203.0.113.9, 10.9.1.1, 127.0.0.1", **{"X-Real-Ip": "10.9.1.1"}).request
    assert client_address(twice, trusted) == "203.0.113.9"  # right to left past both of yours
    assert client_address(behind) == "127.0.0.1"  # no proxy trusted: one address for the whole class
    only_real_ip = request("10.9.3.3", **{"X-Real-Ip": "203.0.113.6"}).request
    assert client_address(only_real_ip, trusted) == "203.0.113.6"
    # straight from a browser (not a trusted peer): what it claims is ignored
    direct = request("127.0.0.1, 198.51.100.7", **{"X-Real-Ip": "127.0.0.1"}).request
    assert client_address(direct, trusted) == "198.51.100.7"
    with pytest.raises(ValueError, match="not an address or a network"):
        LoginLimits(trusted_proxies=["nginx.local"])


@pytest.mark.parametrize("bad", [dict(per_name=-1), dict(per_name=True), dict(per_address=2.5),
                                 dict(per_name_everywhere="5"), dict(window_s=0), dict(window_s=float("nan")),
                                 dict(window_s=float("inf")), dict(window_s=1e12)])
def test_limits_that_make_no_sense_are_refused_in_words(bad):
    with pytest.raises(ValueError, match="whole number, 0 .off. or more|number of seconds above 0 and at most"):
        LoginLimits(**bad)


@pytest.mark.more  # importing JupyterHub takes seconds
def test_the_hub_config_the_classroom_writes_limits_its_log_ins(tmp_path, monkeypatch):
    pytest.importorskip("jupyterhub")
    LIMITS = dict(per_name=2, per_address=7, window_s=30.0, trusted_proxies=["127.0.0.1/32"])
    from traitlets.config import Config

    from ddplab.course import hubconfig

    pam = hubconfig.render(folder=str(tmp_path), learners=["ann"], admin="t", gpus_per_learner=0, threads=1,
                           mem_gib=3.0, spawner="local", trusted=False, ip="127.0.0.1", port=8000,
                           proxy_cmd="/opt/chp", idle_timeout=600, login_limits=LIMITS)
    assert "class ClassAuthenticator(RateLimitedLogins, PAMAuthenticator)" in pam
    assert ("LIMITS = LoginLimits(per_name=2, per_address=7, window_s=30.0, trusted_proxies=['127.0.0.1/32'], "
            "unlock_dir=HERE / 'hub' / 'unlock')") in pam
    for bad in (float("inf"), float("nan")):  # never written as a config the hub cannot load
        with pytest.raises(ValueError, match="--login-window"):
            hubconfig.render(folder=str(tmp_path), learners=["ann"], admin="t", gpus_per_learner=0, threads=1,
                             mem_gib=3.0, spawner="local", trusted=False, ip="127.0.0.1", port=8000,
                             proxy_cmd="/opt/chp", idle_timeout=600, login_limits={**LIMITS, "window_s": bad})
    # the one-account mode's config needs no accounts: load it as the hub would and log in
    trusted = hubconfig.render(
        folder=str(tmp_path), learners=["ann"], admin="t", gpus_per_learner=0, threads=1, mem_gib=3.0,
        spawner="local", trusted=True, ip="127.0.0.1", port=8000, proxy_cmd="/opt/chp", idle_timeout=600,
        login_limits=LIMITS)
    monkeypatch.setenv(hubconfig.PASSWORD_VARS[0], "7-chars")
    with pytest.raises(SystemExit, match=r"a longer DDPLAB_HUB_PASSWORD \(7 characters is too short: 8 or more\)"):
        exec(compile(trusted, "jupyterhub_config.py", "exec"), {"get_config": Config})
    monkeypatch.setenv(hubconfig.PASSWORD_VARS[0], "learners-password")
    monkeypatch.setenv(hubconfig.PASSWORD_VARS[1], "a" * 31)  # JupyterHub's traceback, were it let through
    with pytest.raises(SystemExit, match=r"DDPLAB_HUB_ADMIN_PASSWORD \(31 characters is too short: 32 or more\)"):
        exec(compile(trusted, "jupyterhub_config.py", "exec"), {"get_config": Config})
    monkeypatch.setenv(hubconfig.PASSWORD_VARS[1], "a" * 32)
    names = {"get_config": Config}
    exec(compile(trusted, "jupyterhub_config.py", "exec"), names)
    c = names["c"]
    auth = c.JupyterHub.authenticator_class(config=c)
    handler = request("10.0.0.5")

    def attempt(password):
        return asyncio.run(auth.get_authenticated_user(handler, {"username": "ann", "password": password}))

    assert attempt("wrong") is None and attempt("wrong") is None
    with pytest.raises(web.HTTPError, match="try again in 30 s"):
        attempt("learners-password")


def test_the_classroom_options_reach_the_limits_and_unlock_reaches_a_running_hubs_folder(tmp_path):
    import argparse

    from ddplab.course import classroom

    parser = argparse.ArgumentParser()
    classroom.add_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--learners", "1", "--trusted-proxy", "10.0.0.0/24",
                              "--login-name-failures-everywhere", "12"])
    limits = LoginLimits(**classroom.login_limits(args))
    assert limits.limits["name"] == 12 and str(limits.trusted[0]) == "10.0.0.0/24"
    for bad in (["--login-window", "nan"], ["--login-failures", "-1"]):
        with pytest.raises(ValueError):
            LoginLimits(**classroom.login_limits(parser.parse_args([str(tmp_path), "--learners", "1", *bad])))
    (tmp_path / "jupyterhub_config.py").write_text("")
    with pytest.raises(SystemExit):  # the hub never started: nothing to unlock, said so
        classroom.run(parser.parse_args([str(tmp_path), "--unlock", "ann"]), parser)
    (tmp_path / "hub").mkdir(mode=0o700)
    assert classroom.run(parser.parse_args([str(tmp_path), "--unlock", "Ann", "bob"]), parser) == 0
    hub = LoginLimits(unlock_dir=tmp_path / "hub" / "unlock")
    assert hub.take_unlocks() == ["ann", "bob"] and hub.take_unlocks() == []
