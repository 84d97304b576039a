"""Log-ins limited per name and per address (ddplab/course/logins.py), on a fake clock with a fake
password check, and in the hub config the classroom writes (loaded, no hub started)."""
import asyncio
import types

import pytest

from ddplab.course.logins import LoginLimits, RateLimitedLogins, client_address

web = pytest.importorskip("tornado.web")


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Checked:
    """A fake PAM: the password is 'right'; counts the checks and can make them slow."""

    def __init__(self, seconds=0.0):
        self.calls, self.seconds = 0, seconds
        self.log = types.SimpleNamespace(warning=lambda *a: None)

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
    return types.SimpleNamespace(request=types.SimpleNamespace(remote_ip="127.0.0.1", headers={
        "X-Forwarded-For": address, **headers}))


def log_in(auth, name, password, address="10.0.0.1"):
    return asyncio.run(auth.authenticate(request(address), {"username": name, "password": password}))


def test_past_the_limit_a_name_is_refused_at_once_saying_when_then_let_in_again():
    clock = Clock()
    auth = authenticator(LoginLimits(per_name=3, per_address=0, window_s=60, clock=clock))
    for _ in range(3):
        assert log_in(auth, "ann", "wrong") is None
        clock.t += 10
    with pytest.raises(web.HTTPError) as refused:
        log_in(auth, "Ann", "right")  # the name as JupyterHub compares it: case does not matter
    assert refused.value.status_code == 429 and auth.calls == 3  # the password was not checked
    assert "try again in 30 s" in refused.value.log_message  # when the first failure leaves the window
    clock.t += 30
    assert log_in(auth, "ann", "right") == "ann"
    assert log_in(auth, "bob", "wrong") is None  # other names never waited


def test_an_address_is_limited_across_names_and_a_success_clears_it():
    clock = Clock()
    auth = authenticator(LoginLimits(per_name=0, per_address=3, window_s=60, clock=clock))
    for name in ("ann", "bob", "cid"):
        assert log_in(auth, name, "wrong") is None
    with pytest.raises(web.HTTPError, match="from your address"):
        log_in(auth, "dan", "right")
    assert log_in(auth, "dan", "right", address="10.0.0.2") == "dan"  # another address is not held up
    limits = LoginLimits(per_name=3, per_address=3, window_s=60, clock=clock)
    auth = authenticator(limits)
    for _ in range(2):
        log_in(auth, "ann", "wrong")
    assert log_in(auth, "ann", "right") == "ann"
    assert limits.failures == {}  # the name and the address start again
    for _ in range(2):
        assert log_in(auth, "ann", "wrong") is None


def test_attempts_sent_at_once_count_before_their_passwords_are_checked():
    # 8 wrong passwords at once while the check is slow: only the limit's worth reach the check
    auth = authenticator(LoginLimits(per_name=3, per_address=10, window_s=60, clock=Clock()), seconds=0.05)

    async def burst():
        tries = [auth.authenticate(request("10.0.0.9"), {"username": "t", "password": "x"}) for _ in range(8)]
        return await asyncio.gather(*tries, return_exceptions=True)

    answers = asyncio.run(burst())
    assert auth.calls == 3
    assert sum(isinstance(a, web.HTTPError) for a in answers) == 5


def test_the_address_is_the_one_the_proxy_appended_not_one_the_browser_claims():
    forged = request("1.2.3.4, 10.0.0.7", **{"X-Real-Ip": "9.9.9.9"}).request
    assert client_address(forged) == "10.0.0.7"
    assert client_address(types.SimpleNamespace(remote_ip="10.0.0.8", headers={})) == "10.0.0.8"


def test_limits_that_make_no_sense_are_refused():
    with pytest.raises(ValueError, match="0 .off. or more"):
        LoginLimits(per_name=-1)
    with pytest.raises(ValueError, match="window"):
        LoginLimits(window_s=0)


@pytest.mark.more  # importing JupyterHub takes seconds
def test_the_hub_config_the_classroom_writes_limits_its_log_ins(tmp_path, monkeypatch):
    pytest.importorskip("jupyterhub")
    from traitlets.config import Config

    from ddplab.course import hubconfig

    pam = hubconfig.render(folder=str(tmp_path), learners=["ann"], admin="t", gpus_per_learner=0, threads=1,
                           mem_gib=3.0, spawner="local", trusted=False, ip="127.0.0.1", port=8000,
                           proxy_cmd="/opt/chp", idle_timeout=600, login_limits=(2, 7, 30.0))
    assert "class ClassAuthenticator(RateLimitedLogins, PAMAuthenticator)" in pam
    assert "LIMITS = LoginLimits(per_name=2, per_address=7, window_s=30.0)" in pam
    # the one-account mode's config needs no accounts: load it as the hub would and log in
    trusted = hubconfig.render(
        folder=str(tmp_path), learners=["ann"], admin="t", gpus_per_learner=0, threads=1, mem_gib=3.0,
        spawner="local", trusted=True, ip="127.0.0.1", port=8000, proxy_cmd="/opt/chp", idle_timeout=600,
        login_limits=(2, 7, 30.0))
    monkeypatch.setenv(hubconfig.PASSWORD_VARS[0], "learners-password")
    monkeypatch.setenv(hubconfig.PASSWORD_VARS[1], "a" * 31)  # JupyterHub's traceback, were it let through
    with pytest.raises(SystemExit, match=r"DDPLAB_HUB_ADMIN_PASSWORD \(32 characters or more\)"):
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
