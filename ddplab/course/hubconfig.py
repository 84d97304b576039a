"""The text of a class's ``jupyterhub_config.py``, from a few choices.

Teaches what a one-server JupyterHub for ddplab needs and why:

- who may log in: the roster and the instructor, nobody else (``allowed_users``, never
  ``allow_all``). By default each is a Unix account (:mod:`ddplab.course.accounts`) and
  JupyterHub's ``PAMAuthenticator`` checks the account's password; an empty password is
  refused, and the hub refuses to start while an allowed account has none. In the unsafe
  one-account mode (``--trusted-class``) JupyterHub's ``SharedPasswordAuthenticator`` takes
  a class password and an instructor password from the environment, and the hub refuses to
  start without them; either way wrong passwords are limited per name and per address
  (:mod:`ddplab.course.logins`);
- a spawner: ``LocalProcessSpawner`` (each server runs as the learner's own account, in its
  0700 home), ``SimpleLocalProcessSpawner`` in the one-account mode (every server runs as the
  hub's user: no isolation at all), or systemdspawner (a transient systemd unit per learner,
  with ``mem_limit`` and ``cpu_limit`` enforced by cgroups and the seat's CPUs as
  ``AllowedCPUs``);
- the proxy: configurable-http-proxy, the npm package, by absolute path; on a LAN address
  with the hub's ``ssl_cert``/``ssl_key``;
- seats (:mod:`ddplab.course.seats`): GPUs and CPUs per learner, taken when a server starts
  and given back when it stops;
- the class's size (:mod:`ddplab.course.capacity`): JupyterHub's ``active_server_limit`` set
  so that the learners' memory limits fit in the machine's memory; past it a learner reads
  "the class is full";
- jupyterhub-idle-culler as a hub service, so an idle learner's server, its kernels and their
  ranks are stopped and the seat freed;
- everything the hub starts (proxy, culler, servers) dies with the hub, even a SIGKILLed one
  (:mod:`ddplab.course.proxy_guard`): a server's SIGTERM stops its kernels, a kernel's end
  stops its ranks;
- the two views: learners' servers read ``learner-config/`` (nbgrader's exchange, the student
  id, Formgrader and Create Assignment switched off); the instructor's opens on the class
  folder and reads the course's own nbgrader config (Formgrader works only on a course
  inside the server's root).

Leaves out: Kubernetes (zero-to-jupyterhub), LTI, OAuth log-in.
References: JupyterHub's configuration reference (Authenticator, Spawner, ssl_cert);
jupyterhub-idle-culler's README; systemdspawner's README; nbgrader's "Exchange" docs.
"""
from __future__ import annotations

import sys

from ddplab.course.logins import LoginLimits

SPAWNERS = ("local", "systemd", "slurm")
PASSWORD_VARS = ("DDPLAB_HUB_PASSWORD", "DDPLAB_HUB_ADMIN_PASSWORD")  # the one-account mode's


def render(*, folder: str, learners: list[str], admin: str, gpus_per_learner: int, threads: int,
           mem_gib: float | None, spawner: str, trusted: bool, ip: str, port: int, proxy_cmd: str,
           idle_timeout: int, ssl_cert: str | None = None, ssl_key: str | None = None,
           python: str = sys.executable, hub_ip: str = "127.0.0.1", time_limit: str = "02:00:00",
           partition: str = "", hub_user: str = "root",
           login_limits: dict | None = None, max_servers: int | None = None, spawns: int = 2) -> str:
    if spawner not in SPAWNERS:
        raise ValueError(f"spawner must be one of {SPAWNERS}, got {spawner!r}")
    if bool(ssl_cert) != bool(ssl_key):
        raise ValueError("TLS needs both a certificate and its key")
    mem = f"{mem_gib}G" if mem_gib else None
    login_limits = dict(login_limits or {})
    LoginLimits(**login_limits)  # refused in words here, never as a config the hub cannot load
    lines = [
        '"""JupyterHub for a ddplab class; written by `python -m ddplab classroom` (edit freely)."""',
        "import os",
        "import pathlib",
        "",
        "from ddplab.course.seats import Seats",
        "",
        f"HERE = pathlib.Path({folder!r})",
        f"PYTHON = {python!r}  # the environment with ddplab, jupyterlab and nbgrader",
        f"LEARNERS = {sorted(learners)!r}",
        f"INSTRUCTOR = {admin!r}",
        f"seats = Seats(gpus_per_learner={gpus_per_learner}, threads={threads})",
        "",
        "c = get_config()  # noqa: F821 (JupyterHub defines it)",
        f"c.JupyterHub.ip = {ip!r}",
        f"c.JupyterHub.port = {port}",
    ]
    if ssl_cert:
        lines += [f"c.JupyterHub.ssl_cert = {ssl_cert!r}  # browsers reach the class over https",
                  f"c.JupyterHub.ssl_key = {ssl_key!r}"]
    lines += [
        (f"c.JupyterHub.hub_ip = {hub_ip!r}  # the hub's API: where the nodes' servers reach it"
         if spawner == "slurm" else "c.JupyterHub.hub_ip = '127.0.0.1'  # the hub's API: loopback only"),
        "c.JupyterHub.hub_port = c.JupyterHub.port + 2  # not 8081: two classes on one server",
        "c.ConfigurableHTTPProxy.api_url = 'http://127.0.0.1:%d' % (c.JupyterHub.port + 1)",
        "# Whatever the hub starts dies with it, even a SIGKILLed hub (ddplab/course/proxy_guard.py);",
        "# the hub's pid (this file runs in the hub) ends too what it started just before it died.",
        "GUARD = [PYTHON, '-m', 'ddplab.course.proxy_guard', '--parent', str(os.getpid())]",
        f"c.ConfigurableHTTPProxy.command = GUARD + [{proxy_cmd!r}]",
        "# The hub's own state (sessions, tokens) in a folder only the hub's user reads.",
        "(HERE / 'hub').mkdir(mode=0o700, exist_ok=True)",
        "c.JupyterHub.db_url = 'sqlite:///' + str(HERE / 'hub' / 'jupyterhub.sqlite')",
        "c.JupyterHub.cookie_secret_file = str(HERE / 'hub' / 'jupyterhub_cookie_secret')",
        "c.JupyterHub.pid_file = str(HERE / 'hub' / 'jupyterhub.pid')",
        "c.JupyterHub.cleanup_servers = True  # the hub's stop stops every learner's server",
        "c.JupyterHub.shutdown_on_logout = True  # logging out stops that learner's server",
        "",
        *full_class_lines(max_servers, spawns),
        "# Wrong passwords past these limits are refused at once, without checking the password",
        "# (ddplab/course/logins.py): a burst of them would hold up everybody's log-in.",
        "from ddplab.course.logins import LoginLimits, RateLimitedLogins",
        "",
        "# `python -m ddplab classroom FOLDER --unlock NAME` leaves NAME in hub/unlock/; the next",
        "# log-in attempt reads it and forgets NAME's failures.",
        "LIMITS = LoginLimits(" + "".join(f"{k}={v!r}, " for k, v in login_limits.items())
        + "unlock_dir=HERE / 'hub' / 'unlock')",
        "",
        "# Only the roster and the instructor log in: no allow_all (it would override the list).",
        "c.Authenticator.allowed_users = set(LEARNERS) | {INSTRUCTOR}",
        "c.Authenticator.admin_users = {INSTRUCTOR}",
    ]
    if trusted:
        lines += [
            "# UNSAFE one-account mode (--trusted-class): every server runs as the hub's user, so",
            "# every learner can read the solutions, the gradebook and each other's work.",
            "# One class password for the learners, one for the instructor, from the environment.",
            "# JupyterHub's SharedPasswordAuthenticator wants 8 characters or more, 32 for the admin's.",
            "missing = [f'{v} ({n} characters or more)' if not os.environ.get(v) else",
            "           f'a longer {v} ({len(os.environ[v])} characters is too short: {n} or more)'",
            f"           for v, n in zip({PASSWORD_VARS!r}, (8, 32)) if len(os.environ.get(v, '')) < n]",
            f"if not missing and os.environ[{PASSWORD_VARS[0]!r}] == os.environ[{PASSWORD_VARS[1]!r}]:",
            "    missing = ['two different passwords']",
            "if missing:",
            "    raise SystemExit(f'set {\" and \".join(missing)} before starting '",
            "                     'the hub: this class has no other passwords')",
            "from jupyterhub.authenticators.shared import SharedPasswordAuthenticator",
            "",
            "",
            "class ClassAuthenticator(RateLimitedLogins, SharedPasswordAuthenticator):",
            "    limits = LIMITS",
            "",
            "",
            "c.JupyterHub.authenticator_class = ClassAuthenticator",
            f"c.SharedPasswordAuthenticator.user_password = os.environ[{PASSWORD_VARS[0]!r}]",
            f"c.SharedPasswordAuthenticator.admin_password = os.environ[{PASSWORD_VARS[1]!r}]",
        ]
    else:
        lines += [
            "# Each learner is a Unix account with its own password (ddplab/course/accounts.py);",
            "# PAM checks it against /etc/shadow, where only its hash is kept.",
            "from ddplab.course.accounts import AccountError, check_logins",
            "from jupyterhub.auth import PAMAuthenticator",
            "",
            "try:  # refuses to start if one has no password: one line saying so, not a traceback",
            "    check_logins(LEARNERS + [INSTRUCTOR])",
            "except AccountError as e:",
            "    raise SystemExit(f'the class cannot start: {e}') from None",
            "if os.geteuid() == 0:  # the checkout's answers closed to learners again (a git pull opens them)",
            "    from ddplab.course.safety import close_checkout",
            "",
            "    close_checkout()",
            "",
            "",
            "class ClassAuthenticator(RateLimitedLogins, PAMAuthenticator):",
            "    limits = LIMITS",
            "",
            "    # PAM's `nullok` would let an account without a password in with an empty one.",
            "    async def authenticate(self, handler, data):",
            "        if not data.get('password'):",
            "            return None",
            "        return await super().authenticate(handler, data)",
            "",
            "",
            "c.JupyterHub.authenticator_class = ClassAuthenticator",
            "c.PAMAuthenticator.open_sessions = False  # no login session (utmp, loginuid) per server",
        ]
    lines += [
        "",
        "# Every server: JupyterLab from this environment, by absolute path, dying with the hub.",
        "c.Spawner.cmd = GUARD + [PYTHON, '-m', 'jupyterhub.singleuser']",
        "c.Spawner.default_url = '/lab'",
        "# A busy server (20 learners logging in at 9:00) imports jupyter_server slowly: the",
        "# defaults (30 s to answer, 60 s to start) give up on servers that would have come up.",
        "c.Spawner.http_timeout = 120",
        "c.Spawner.start_timeout = 180",
        "c.Spawner.notebook_dir = '~'",
        "c.Spawner.environment = {",
        "    'JUPYTERHUB_ACTIVITY_INTERVAL': os.environ.get('DDPLAB_HUB_ACTIVITY_INTERVAL', '60'),",
        "    # the environment's bin first (nbgrader, alembic), never the hub's own PATH additions",
        "    'PATH': os.path.dirname(PYTHON) + ':/usr/local/bin:/usr/bin:/bin',",
        "}",
        f"c.Spawner.mem_limit = {mem!r}  # enforced by systemdspawner (and the cgroups below)",
        f"c.Spawner.cpu_limit = {float(threads)!r}  # enforced by systemdspawner (and the cgroups below)",
        "",
    ]
    if spawner == "local" and trusted:
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
        ]
    elif spawner == "local":
        lines += limited_spawner_lines(mem_gib or 3.0, threads)
        if trusted:
            lines += [
                "if os.geteuid() == 0:  # jupyter_server refuses root unless told (every learner is root!)",
                "    c.Spawner.args = ['--ServerApp.allow_root=True']",
                "c.SimpleLocalProcessSpawner.home_dir_template = str(HERE / 'homes' / '{username}')",
            ]
    elif spawner == "slurm":
        lines += slurm_lines(gpus_per_learner, threads, mem_gib, time_limit, partition, hub_user)
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
        ("    seat = seats.take(spawner.user.name)" if spawner != "slurm" else
         "    # on Slurm the job's --gres, --cpus-per-task and --mem are the seat (Slurm enforces them)"),
        "    # the instructor's server reads the course's nbgrader config (Formgrader on the course);",
        "    # the learners' read learner-config/ (exchange, student id, no Formgrader)",
        "    config = HERE / ('course' if spawner.user.name == INSTRUCTOR else 'learner-config')",
        ("    spawner.environment = {**spawner.environment, **seat.environment()," if spawner != "slurm"
         else "    spawner.environment = {**spawner.environment,"),
        "                           'JUPYTER_CONFIG_PATH': str(config)}",
    ]
    if spawner == "systemd":
        lines.append("    spawner.unit_extra_properties = {'AllowedCPUs': ','.join(map(str, seat.cpus))}")
    if spawner == "local" and not trusted:
        lines += [
            "    if spawner.user.name != INSTRUCTOR and CGROUPS:  # (+ every GPU node but the seat's denied)",
            f"        limits.prepare(CLASS, spawner.user.name, MEMORY, {threads}, seat.cpus,",
            "                       denied_gpus=gpu_nodes.denied(seat.gpus) if 'devices' in CGROUPS else ())",
            "        # the class weighs as many processes as it has servers, not as one (capacity.py)",
            f"        capacity.weigh_class(CLASS, {max_servers or len(learners)})",
        ]
    lines += [
        "    if spawner.user.name == INSTRUCTOR:  # Formgrader wants the course inside the server's root",
        "        spawner.notebook_dir = str(HERE)",
    ]
    if spawner != "slurm":
        lines += [
            "    spawner.log.info('ddplab seat for %s: GPUs [%s], CPUs %s %s', seat.user,",
            "                     ','.join(seat.gpus), seat.cpus, seat.note)",
        ]
    lines += [
        "",
        "",
        "c.Spawner.pre_spawn_hook = take_seat",
        ("# each job's end frees its resources in Slurm: no seats to give back" if spawner == "slurm" else
         "c.Spawner.post_stop_hook = end_learner  # the seat back, every process of theirs ended"
         if spawner == "local" and not trusted else
         "c.Spawner.post_stop_hook = lambda spawner: seats.release(spawner.user.name)"),
        "",
        "# Idle servers are stopped (their kernels, ranks and seat with them).",
        "c.JupyterHub.load_roles = [{'name': 'idle-culler', 'services': ['idle-culler'],",
        "                            'scopes': ['list:users', 'read:users:activity', 'read:servers',",
        "                                       'delete:servers']}]",
        "c.JupyterHub.services = [{'name': 'idle-culler', 'command': GUARD + [",
        f"    PYTHON, '-m', 'jupyterhub_idle_culler', '--timeout={idle_timeout}',",
        "    '--url=http://127.0.0.1:%d/hub/api' % c.JupyterHub.hub_port,  # its default is 8081",
        f"    '--cull-every={max(5, min(60, idle_timeout // 3))}']}}]",
        "",
    ]
    return "\n".join(lines)


def full_class_lines(max_servers: int | None, spawns: int = 2) -> list[str]:
    """The class's size: past it a learner reads "the class is full" (ddplab/course/capacity.py)."""
    if not max_servers:
        return []
    return [
        "# The class is full at this many servers (the instructor's counts as one): by default as many",
        "# as the learners' memory limits fit in this machine's memory, so no learner's use can get",
        "# another's kernel killed; --max-learners may have set it otherwise (classroom warned if above",
        "# that: ddplab/course/capacity.py; `python -m ddplab classroom --plan`). The next learner",
        "# gets JupyterHub's 429 page, which templates/error.html completes with what to do.",
        f"c.JupyterHub.active_server_limit = {max_servers}",
        "# Starting a server is seconds of CPU: all at once, on few cores, they all miss http_timeout.",
        "# One start per CPU at a time; the others read 'Try again in 30-60 seconds' (429) and do.",
        f"c.JupyterHub.concurrent_spawn_limit = {spawns}",
        "c.JupyterHub.template_paths = [str(HERE / 'templates')]",
        "",
    ]


def limited_spawner_lines(mem_gib: float, threads: int) -> list[str]:
    """Each server as its learner's account, in that learner's cgroups (ddplab/course/limits.py)."""
    return [
        "from jupyterhub.spawner import LocalProcessSpawner",
        "",
        "from ddplab.course import capacity, limits",
        "",
        "CLASS = limits.class_name(HERE)",
        f"MEMORY = int({mem_gib!r} * 2**30)",
        "CGROUPS = limits.writable()  # cgroup v1 controllers the hub (root) may use here",
        "for _name in LEARNERS:  # what a killed hub's servers left running",
        "    limits.end(CLASS, _name)",
        *isolation_lines(),
        "",
        "",
        "class SeatedSpawner(LocalProcessSpawner):",
        "    # Each server runs as the learner's account (setuid, then chdir to its 0700 home), in",
        "    # the learner's cgroups (memory, pids, CPU quota, the seat's CPUs), joined while still",
        "    # root; where no cgroup is writable, rlimits per process stand in (limits.rlimits).",
        "    def make_preexec_fn(self, name):",
        "        inner, cpus = super().make_preexec_fn(name), seats.take(self.user.name).cpus",
        "        learner = self.user.name != INSTRUCTOR",
        "",
        "        def preexec():",
        "            if learner and CGROUPS:",
        "                limits.join(CLASS, self.user.name)",
        "            elif learner:",
        f"                limits.rlimits(int(limits.address_space_gib({mem_gib!r}) * 2**30))",
        "            if learner and PRIVATE_TMP:",
        "                private_tmp.enter(MEMORY, keep=KEEP)",
        "            inner()",
        "            os.sched_setaffinity(0, cpus)",
        "        return preexec",
        "",
        "",
        "c.JupyterHub.spawner_class = SeatedSpawner",
        "",
        "",
        "def end_learner(spawner):",
        "    seats.release(spawner.user.name)",
        "    left = limits.end(CLASS, spawner.user.name)",
        "    if left:",
        "        spawner.log.warning('processes of %s outlived their server: %s', spawner.user.name, left)",
    ]


def isolation_lines() -> list[str]:
    """A private /tmp and /dev/shm per learner's server (ddplab/course/private_tmp.py), GPU seats
    enforced (ddplab/course/gpu_nodes.py), autograde's groups handed to the instructor."""
    return [
        "from ddplab.course import gpu_nodes, private_tmp",
        "",
        "PRIVATE_TMP = private_tmp.works() is None  # a mount namespace and a tmpfs per learner's server",
        "# what the servers need stays visible where it lies under /tmp: the class, the environment, ddplab",
        "KEEP = private_tmp.kept_paths(HERE, os.path.dirname(os.path.dirname(PYTHON)),",
        "                              os.path.dirname(os.path.dirname(private_tmp.__file__)) + '/..')",
        "# /tmp is no longer shared: ddplab's GPU locks go where every learner's Clusters see them",
        "c.Spawner.environment = {**c.Spawner.environment, 'DDPLAB_GPU_LOCK_DIR': '/var/tmp/ddplab-gpu-locks'}",
        "if set(limits.GRADING_CONTROLLERS) <= set(CGROUPS) and os.geteuid() == 0:",
        "    import pwd",
        "",
        "    try:  # the instructor's autograde makes each submission's groups here",
        "        limits.delegate_grading(CLASS, pwd.getpwnam(INSTRUCTOR).pw_uid)",
        "    except KeyError:",
        "        pass  # no such account (a class without accounts): autograde runs on rlimits",
    ]


def slurm_lines(gpus: int, threads: int, mem_gib: float | None, time_limit: str, partition: str,
                hub_user: str) -> list[str]:
    """Each learner's server as a Slurm job (ddplab/course/slurmhub.py says why each line)."""
    from ddplab.course.slurmhub import NODE_ADDR, gres

    mem = f"{int(mem_gib * 1024)}M" if mem_gib else ""
    return [
        "# Each server is a Slurm job submitted as its learner: `sudo -E -u NAME sbatch`; the hub's",
        f"# user ({hub_user}) may run only sbatch, squeue and scancel as a learner (the sudoers file).",
        "c.JupyterHub.spawner_class = 'ddplab.course.slurmhub.ClassSlurmSpawner'",
        "BIN = os.path.dirname(PYTHON)  # the learners' accounts must be able to run this environment",
        "c.Spawner.cmd = [os.path.join(BIN, 'jupyterhub-singleuser')]",
        "c.SlurmSpawner.batchspawner_singleuser_cmd = os.path.join(BIN, 'batchspawner-singleuser')",
        f"c.SlurmSpawner.req_gres = {gres(gpus)!r}  # the learner's GPUs",
        f"c.SlurmSpawner.req_nprocs = {str(threads)!r}  # CPUs (--cpus-per-task)",
        f"c.SlurmSpawner.req_memory = {mem!r}",
        f"c.SlurmSpawner.req_runtime = {time_limit!r}  # a job outlives a killed hub only this long",
        f"c.SlurmSpawner.req_partition = {partition!r}",
        "# The server listens on its node's address as Slurm knows it (never 0.0.0.0); the hub",
        "# connects there (ClassSlurmSpawner.state_gethost).",
        f"c.SlurmSpawner.req_prologue = {NODE_ADDR!r}",
        "c.Spawner.args = ['--ServerApp.ip=$DDPLAB_NODE_ADDR']",
        "# sbatch, the job and its srun find a non-default Slurm configuration through SLURM_CONF.",
        "c.Spawner.env_keep = ['PATH', 'PYTHONPATH', 'CONDA_ROOT', 'CONDA_DEFAULT_ENV', 'VIRTUAL_ENV', 'LANG',",
        "                      'LC_ALL', 'JUPYTERHUB_SINGLEUSER_APP', 'SLURM_CONF']  # JupyterHub's, + SLURM_CONF",
        "c.Spawner.start_timeout = 300  # a job may wait in the queue",
    ]
