"""The text of a class's ``jupyterhub_config.py``, from a few choices.

Teaches what a one-server JupyterHub for ddplab needs and why:

- an authenticator: DummyAuthenticator (any name, shared password or none:
  tests and one-day workshops on a closed network), PAM (the server's real
  accounts) or the first-use authenticator (learners pick their password at
  first login; the instructor allows the names);
- a spawner: SimpleLocalProcessSpawner (every server runs as the hub's own
  user, in a folder per learner; no isolation, no memory limit) or
  systemdspawner (a transient systemd unit per learner, with ``mem_limit``
  and ``cpu_limit`` enforced by cgroups and the seat's CPUs as ``AllowedCPUs``);
- the proxy: configurable-http-proxy, the npm package, by absolute path;
- seats (:mod:`ddplab.course.seats`): GPUs and CPUs per learner, taken when a
  server starts and given back when it stops;
- jupyterhub-idle-culler as a hub service, so an idle learner's server, its
  kernels and their ranks are stopped and the seat freed;
- the learners' nbgrader settings (``JUPYTER_CONFIG_PATH``): the course, the
  exchange folder, and the student id from ``JUPYTERHUB_USER`` (nbgrader takes
  the OS user name otherwise, which is the same for every learner under one uid).

Leaves out: TLS (put a reverse proxy with a certificate in front, or set
``ssl_cert``/``ssl_key``), Kubernetes (zero-to-jupyterhub), LTI.
References: JupyterHub's configuration reference; jupyterhub-idle-culler's
README; systemdspawner's README; nbgrader's "Exchange" docs.
"""
from __future__ import annotations

import sys

AUTHENTICATORS = {
    "dummy": "dummy",
    "pam": "jupyterhub.auth.PAMAuthenticator",
    "firstuse": "firstuseauthenticator.FirstUseAuthenticator",
}
SPAWNERS = ("local", "systemd")


def render(*, folder: str, users: list[str], admin: str, gpus_per_learner: int, threads: int,
           mem_gib: float | None, spawner: str, auth: str, ip: str, port: int, proxy_cmd: str,
           idle_timeout: int, python: str = sys.executable) -> str:
    if spawner not in SPAWNERS:
        raise ValueError(f"spawner must be one of {SPAWNERS}, got {spawner!r}")
    if auth not in AUTHENTICATORS:
        raise ValueError(f"auth must be one of {sorted(AUTHENTICATORS)}, got {auth!r}")
    mem = f"{mem_gib}G" if mem_gib else None
    lines = [
        '"""JupyterHub for a ddplab class; written by `python -m ddplab classroom` (edit freely)."""',
        "import os",
        "import pathlib",
        "",
        "from ddplab.course.seats import Seats",
        "",
        f"HERE = pathlib.Path({folder!r})",
        f"PYTHON = {python!r}  # the environment with ddplab, jupyterlab and nbgrader",
        f"seats = Seats(gpus_per_learner={gpus_per_learner}, threads={threads})",
        "",
        "c = get_config()  # noqa: F821 (JupyterHub defines it)",
        f"c.JupyterHub.ip = {ip!r}",
        f"c.JupyterHub.port = {port}",
        "c.JupyterHub.hub_ip = '127.0.0.1'  # the hub's API: loopback only",
        "c.JupyterHub.hub_port = c.JupyterHub.port + 2  # not 8081: two classes on one server",
        "c.ConfigurableHTTPProxy.api_url = 'http://127.0.0.1:%d' % (c.JupyterHub.port + 1)",
        "# The proxy dies with the hub, even a SIGKILLed one (ddplab/course/proxy_guard.py).",
        f"c.ConfigurableHTTPProxy.command = [PYTHON, '-m', 'ddplab.course.proxy_guard', {proxy_cmd!r}]",
        "c.JupyterHub.db_url = 'sqlite:///' + str(HERE / 'jupyterhub.sqlite')",
        "c.JupyterHub.cookie_secret_file = str(HERE / 'jupyterhub_cookie_secret')",
        "c.JupyterHub.pid_file = str(HERE / 'jupyterhub.pid')",
        "c.JupyterHub.cleanup_servers = True  # the hub's stop stops every learner's server",
        "",
        f"c.Authenticator.allowed_users = set({sorted(users)!r})",
        f"c.Authenticator.admin_users = {{{admin!r}}}",
    ]
    if auth == "dummy":
        lines += ["c.JupyterHub.authenticator_class = 'dummy'",
                  "# Any name may log in (without allow_all, JupyterHub 5+ lets no one in):",
                  "# only on loopback or a closed network, and with a shared password there.",
                  "c.DummyAuthenticator.allow_all = True",
                  "c.DummyAuthenticator.password = os.environ.get('DDPLAB_HUB_PASSWORD', '')"]
    else:
        lines.append(f"c.JupyterHub.authenticator_class = {AUTHENTICATORS[auth]!r}")
    lines += [
        "",
        "# Every learner's server: JupyterLab from this environment, by absolute path.",
        "c.Spawner.cmd = [PYTHON, '-m', 'jupyterhub.singleuser']",
        "c.Spawner.default_url = '/lab'",
        "# A busy server (20 learners logging in at 9:00) imports jupyter_server slowly: the",
        "# defaults (30 s to answer, 60 s to start) give up on servers that would have come up.",
        "c.Spawner.http_timeout = 120",
        "c.Spawner.start_timeout = 180",
        "c.Spawner.notebook_dir = '~'",
        "c.Spawner.environment = {",
        "    'JUPYTER_CONFIG_PATH': str(HERE / 'learner-config'),  # nbgrader: course, exchange, student id",
        "    'JUPYTERHUB_ACTIVITY_INTERVAL': os.environ.get('DDPLAB_HUB_ACTIVITY_INTERVAL', '60'),",
        "    'PATH': os.environ.get('PATH', ''),",
        "}",
        f"c.Spawner.mem_limit = {mem!r}  # enforced by systemdspawner only",
        f"c.Spawner.cpu_limit = {float(threads)!r}  # enforced by systemdspawner only",
        "",
    ]
    if spawner == "local":
        lines += [
            "from jupyterhub.spawner import SimpleLocalProcessSpawner",
            "",
            "",
            "class SeatedSpawner(SimpleLocalProcessSpawner):",
            "    # Every server runs as the hub's user; the seat's CPUs become its affinity mask.",
            "    # mem_limit is NOT enforced by a local-process spawner.",
            "    def make_preexec_fn(self, name):",
            "        inner, cpus = super().make_preexec_fn(name), seats.take(self.user.name).cpus",
            "",
            "        def preexec():",
            "            inner()",
            "            os.sched_setaffinity(0, cpus)",
            "        return preexec",
            "",
            "",
            "c.JupyterHub.spawner_class = SeatedSpawner",
            "if os.geteuid() == 0:  # a container or CI job run as root: jupyter_server refuses root",
            "    c.Spawner.args = ['--ServerApp.allow_root=True']  # unless told (every learner is root!)",
            "c.SimpleLocalProcessSpawner.home_dir_template = str(HERE / 'homes' / '{username}')",
        ]
    else:
        lines += [
            "c.JupyterHub.spawner_class = 'systemdspawner.SystemdSpawner'",
            "c.SystemdSpawner.isolate_tmp = True",
            "c.SystemdSpawner.isolate_devices = False  # the learner's ranks need /dev/nvidia*",
        ]
    lines += [
        "",
        "",
        "def take_seat(spawner):",
        "    seat = seats.take(spawner.user.name)",
        "    spawner.environment = {**spawner.environment, **seat.environment()}",
    ]
    if spawner == "systemd":
        lines.append("    spawner.unit_extra_properties = {'AllowedCPUs': ','.join(map(str, seat.cpus))}")
    lines += [
        "    spawner.log.info('ddplab seat for %s: GPUs [%s], CPUs %s %s', seat.user,",
        "                     ','.join(seat.gpus), seat.cpus, seat.note)",
        "",
        "",
        "c.Spawner.pre_spawn_hook = take_seat",
        "c.Spawner.post_stop_hook = lambda spawner: seats.release(spawner.user.name)",
        "",
        "# Idle servers are stopped (their kernels, ranks and seat with them).",
        "c.JupyterHub.load_roles = [{'name': 'idle-culler', 'services': ['idle-culler'],",
        "                            'scopes': ['list:users', 'read:users:activity', 'read:servers',",
        "                                       'delete:servers']}]",
        "c.JupyterHub.services = [{'name': 'idle-culler', 'command': [",
        f"    PYTHON, '-m', 'jupyterhub_idle_culler', '--timeout={idle_timeout}',",
        "    '--url=http://127.0.0.1:%d/hub/api' % c.JupyterHub.hub_port,  # its default is 8081",
        f"    '--cull-every={max(5, min(60, idle_timeout // 3))}']}}]",
        "",
    ]
    return "\n".join(lines)
