"""Autograding in a sandbox: a submission's cells run as an account that can read nothing of the course.

Teaches why and how a class's grading keeps learners' code away from what it is graded against.
``nbgrader autograde`` runs each submitted notebook's cells in a kernel of the account that runs
it, the instructor's: a cell could copy the solutions (``course/source``), the gradebook or other
learners' submissions. Here the course's nbgrader config swaps nbgrader's ``Execute`` step for
:class:`SandboxedExecute`, which sends the notebook to a second process running as the class's
grading account (a Unix account with no password and no rights: ``python -m ddplab classroom``
creates it beside the learners). That process (:func:`main`):

1. makes itself undumpable (``prctl(PR_SET_DUMPABLE, 0)``): the kernel it starts runs as the
   same uid, and could otherwise write into its answer pipe through ``/proc/<pid>/fd`` or
   ptrace it;
2. lowers its own limits (address space, processes, file size, core dumps), which no later
   code of that account can raise again; where the class has cgroups, it already runs in the
   submission's own memory, pids and cpu groups (:class:`ddplab.course.limits.GradingRun`),
   which the instructor's process made and joined just before it started the sandbox: they
   hold the kernel and its ranks together, not each process alone, and are removed after;
3. writes the notebook into a fresh scratch folder in the grading account's 0700 home, and
   points HOME, IPython's and Jupyter's folders and TMPDIR inside it, with no user
   site-packages (``python -s``, ``PYTHONNOUSERSITE``): a startup file, kernel spec or ``.pth``
   file one submission writes is never read while grading the next;
4. executes it with nbgrader's own ``Execute`` (the same per-cell timeout and error handling);
5. sends the executed notebook back on stdout, removes the scratch folder, ends every process
   of the grading account (``kill(-1)`` as that account) and removes its files from /tmp,
   /var/tmp and /dev/shm (unlinked by lstat through directory descriptors, as itself, never
   root), so nothing a submission left outlives its grading or meets the next learner's notebook.

The instructor's process ends the grading account's processes (and its files) again before and
after each notebook, in a ``finally``: an autograde interrupted by Ctrl-C leaves no kernel
running. It keeps the notebook it sent and takes back only each cell's outputs and execution
count, never a source or a cell's metadata, and of the outputs only an allow-list
(:func:`allowed`): streams, errors, and results reduced to plain text and PNG images, without
metadata; HTML, JavaScript, SVG and widgets, which would run in the instructor's browser in
Formgrader, are dropped, and so are markdown cells' attachments. nbgrader's later steps
(output limits, scores into the gradebook) run as the instructor, as before. The switch of
account is ``runuser`` when autograde runs as root, else ``sudo -n -u GRADER`` (the class
installs the one sudo rule this needs); one submission is graded at a time per course (a lock
in the course root the instructor's config names, never found near a submission).

Leaves out: a container or a network namespace (a submission can still open sockets), and
anything against a submission that fakes its own grade cells' results: its code runs in the same
kernel as its graders (it can replace the checks they call, or print "passed" and exit), as in
every nbgrader course; the sandbox keeps the course's files from it, not its own grade.
References: nbgrader's "Autograding resources" and its Execute preprocessor; setrlimit(2), the
kernel's cgroup-v1 documentation (cgroups.txt on who may move a process),
kill(2) ("If pid equals -1"); prctl(2) (PR_SET_DUMPABLE), proc(5) on
ptrace access mode; sudo(8), runuser(1).
"""
from __future__ import annotations

import fcntl
import functools
import json
import os
import pathlib
import pwd
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

# What the sudo rule allows the instructor to run as GRADER; -s: no user site-packages, which
# an earlier submission could have filled with a .pth file that runs at every start.
ENTRY = ["-s", "-m", "ddplab.course.gradebox"]
ELSEWHERE = ["/tmp", "/var/tmp", "/dev/shm"]  # where the grading account's files are removed after each run
# What comes back of a cell's outputs: no HTML, JavaScript, SVG or widget (they would run in the
# instructor's browser in Formgrader), no output metadata.
KEPT_DATA = ("text/plain", "image/png")


@functools.cache
def step_class() -> type:
    """The instructor's autograde step, :class:`SandboxedExecute` (defined on first use: nbgrader
    takes seconds of CPU to import, and the sandbox's ``--end``, run twice per notebook, needs
    none of it)."""
    from nbgrader.preprocessors import Execute
    from traitlets import Float, Integer, Unicode

    class SandboxedExecute(Execute):
        """nbgrader's Execute, with the cells run as ``user`` in a scratch folder, under limits."""

        user = Unicode("", help="the grading account: it may read no file of the course").tag(config=True)
        memory_gib = Float(4.0, help="address space of the grading process and each of its children").tag(config=True)
        wall_s = Integer(1800, help="the longest one notebook's grading may take, all cells together").tag(config=True)
        max_output_mib = Integer(64, help="the most the sandbox may send back").tag(config=True)
        cgroup_class = Unicode("", help="the class's cgroup name (limits.class_name): each submission "
                                        "in groups of its own under it; empty: rlimits only").tag(config=True)
        group_memory_gib = Float(3.0, help="memory of a submission's kernel and ranks together "
                                           "(its cgroup)").tag(config=True)
        group_cpus = Float(2.0, help="CPU time per second of a submission's kernel and ranks "
                                     "(its cgroup)").tag(config=True)
        group_tasks = Integer(1024, help="processes and threads of a submission (its cgroup)").tag(config=True)

        def preprocess(self, nb, resources):
            import nbformat

            if not self.user:
                raise ValueError("SandboxedExecute.user is not set: name the class's grading account in "
                                 "nbgrader_config.py (python -m ddplab classroom writes it)")
            request = {"notebook": nbformat.writes(nb), "timeout": self.timeout,
                       "memory_bytes": int(self.memory_gib * 2**30),
                       "env": {k: os.environ[k] for k in ("PYTHONPATH", "LANG", "OMP_NUM_THREADS") if k in os.environ}}
            with _one_at_a_time(self.coursedir_lock()):
                end_all(self.user)  # whatever an interrupted grading left running ends before this one
                group = self.group()
                try:
                    back = run_as(self.user, json.dumps(request), self.wall_s, self.max_output_mib * 2**20,
                                  join=group.join if group else None)
                finally:  # also when autograde is interrupted (Ctrl-C): no kernel outlives its grading
                    end_all(self.user)
                    if group and group.end():
                        self.log.warning("a submission's processes outlived its grading: %s", group.groups)
            executed = nbformat.reads(back, as_version=4)
            if [c.get("id") for c in executed.cells] != [c.get("id") for c in nb.cells]:
                raise RuntimeError("the sandbox sent back a notebook with other cells: graded nothing")
            for mine, theirs in zip(nb.cells, executed.cells):
                mine.pop("attachments", None)  # a markdown cell's attached files: nothing grading needs
                if mine.cell_type == "code":  # outputs only: the sources and metadata stay the instructor's
                    mine.outputs = allowed(theirs.get("outputs", []))
                    mine.execution_count = theirs.get("execution_count")
            return nb, resources

        def group(self):
            """This submission's cgroups, or None (then its limits are the rlimits alone)."""
            from ddplab.course import limits

            if not self.cgroup_class:
                return None
            made = limits.GradingRun.make(self.cgroup_class, int(self.group_memory_gib * 2**30),
                                          self.group_tasks, self.group_cpus)
            if made is None:
                self.log.warning("grading without cgroups (only rlimits per process): the class's "
                                 "grading groups are not there; start the hub once as root")
            return made

        def coursedir_lock(self) -> pathlib.Path:
            """The course's lock file, in the course root the instructor's config names (never found
            by looking for a config file near the submission, which a submission could carry)."""
            from nbgrader.coursedir import CourseDirectory

            return pathlib.Path(CourseDirectory(config=self.config).root).resolve() / ".autograde.lock"

    return SandboxedExecute


def __getattr__(name: str):
    if name == "SandboxedExecute":  # gradebox.SandboxedExecute, as nbgrader's config names it
        return step_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def allowed(outputs: list) -> list:
    """The outputs that may come back: streams, errors, and results or displays reduced to
    plain text and PNG images (an output with nothing else is dropped), without metadata."""
    import nbformat

    kept = []
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream" and out.get("name") in ("stdout", "stderr"):
            kept.append(nbformat.v4.new_output("stream", name=out["name"], text=_text(out.get("text"))))
        elif kind == "error":
            kept.append(nbformat.v4.new_output("error", ename=str(out.get("ename", "")),
                                               evalue=str(out.get("evalue", "")),
                                               traceback=[str(t) for t in out.get("traceback", [])]))
        elif kind in ("execute_result", "display_data"):
            data = {k: _text(v) for k, v in (out.get("data") or {}).items() if k in KEPT_DATA}
            if not re.fullmatch(r"[A-Za-z0-9+/=\s]*", data.get("image/png", "")):
                del data["image/png"]  # not base64: no image, whatever else it is
            if data:
                extra = {"execution_count": out.get("execution_count")} if kind == "execute_result" else {}
                kept.append(nbformat.v4.new_output(kind, data=data, **extra))
    return kept


def _text(value) -> str:
    return "".join(map(str, value)) if isinstance(value, list) else str(value or "")


def configure(c, user: str, memory_gib: float, cgroup_class: str = "", group_memory_gib: float = 3.0,
              group_cpus: float = 2.0) -> None:
    """The course's nbgrader config ``c``: autograde's Execute step becomes SandboxedExecute;
    with ``cgroup_class``, each submission runs in cgroups of its own with these limits."""
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import Execute

    steps = Autograde.class_traits()["autograde_preprocessors"].default()
    c.Autograde.autograde_preprocessors = [step_class() if s is Execute else s for s in steps]
    c.SandboxedExecute.user = user
    c.SandboxedExecute.memory_gib = memory_gib
    c.SandboxedExecute.cgroup_class = cgroup_class
    c.SandboxedExecute.group_memory_gib = group_memory_gib
    c.SandboxedExecute.group_cpus = group_cpus


def python() -> str:
    """This environment's Python by the path the class's sudo rule names."""
    return os.path.join(sys.prefix, "bin", "python")


def sudo_rule(instructor: str, grader: str) -> str:
    """The one sudo rule autograde needs: the instructor may run the sandbox as the grading account."""
    command = " ".join([python(), *ENTRY])
    return (f"# python -m ddplab classroom: {instructor}'s autograde runs each submission as {grader}\n"
            f"{instructor} ALL=({grader}) NOPASSWD: {command}, {command} --end\n")


class _one_at_a_time:
    # Ending the grading account's processes (kill -1) would end another grading's kernel.
    def __init__(self, path: pathlib.Path):
        self.path = path

    def __enter__(self):
        self.file = open(self.path, "a")  # noqa: SIM115 (closed in __exit__)
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def switch(user: str) -> list[str]:
    """The command prefix that runs this environment's Python as ``user``."""
    if os.geteuid() == 0:
        return ["runuser", "-u", user, "--", python()]
    if not shutil.which("sudo"):
        raise RuntimeError("autograde runs each submission as the grading account, which needs sudo "
                           "(apt-get install sudo; python -m ddplab classroom installs its rule) or "
                           "autograde run as root")
    return ["sudo", "-n", "-u", user, python()]


def run_as(user: str, request: str, wall_s: int, max_bytes: int, join=None) -> str:
    """Send ``request`` to :func:`main` running as ``user``; its executed notebook, as text.
    ``join``: called in the child before it execs (it joins the submission's cgroups, which
    the switch of account and everything after inherit)."""
    command = switch(user) + ENTRY
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd="/", start_new_session=True, preexec_fn=join)
    try:
        out, err = proc.communicate(request.encode(), timeout=wall_s)
    except subprocess.TimeoutExpired:
        end_all(user)
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"this submission ran past {wall_s} s (SandboxedExecute.wall_s): it was "
                           "stopped and graded nothing") from None
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0 or not out:
        if b"a password is required" in err or b"may not run sudo" in err:
            raise RuntimeError(f"sudo does not let {pwd.getpwuid(os.getuid()).pw_name} run "
                               f"{' '.join(command[-4:])} as {user}: reinstall the class's sudo rule "
                               "(docs/classroom.md, 'Grading')")
        raise RuntimeError(f"the sandbox failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    if len(out) > max_bytes:
        raise RuntimeError(f"the submission's outputs exceed {max_bytes >> 20} MiB: graded nothing")
    return out.decode()


def end_all(user: str) -> None:
    """Every process of ``user`` ended and its files in /tmp, /var/tmp, /dev/shm removed (the
    sandbox's own last step, run again before and after each grading, and after a timeout)."""
    subprocess.run(switch(user) + ENTRY + ["--end"], stdin=subprocess.DEVNULL,
                   capture_output=True, timeout=60, cwd="/")


def _kill_every_process_of_mine() -> None:
    # kill(-1) signals every process this uid may signal, except this one: the grading
    # account's own (it has no others), repeated while a fork outpaces one pass.
    for _ in range(20):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def remove_mine(uid: int, places: list[str]) -> int:
    """Remove every entry owned by ``uid`` under ``places``, judged by lstat and reached through
    directory descriptors (os.fwalk), so no link is followed: a link is unlinked as itself, and
    a folder of another's is left with what is not ``uid``'s. Run as the grading account (never
    root). Its own folders go last, when they are empty; how many entries went."""
    gone = 0
    for place in places:
        for _, dirs, files, fd in os.fwalk(place, topdown=False, follow_symlinks=False,
                                           onerror=lambda e: None):
            for name in files + dirs:
                try:
                    st = os.lstat(name, dir_fd=fd)
                    if st.st_uid != uid:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        os.rmdir(name, dir_fd=fd)
                    else:
                        os.unlink(name, dir_fd=fd)
                    gone += 1
                except OSError:  # not empty (another's file inside), or gone meanwhile
                    pass
    return gone


def undumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0): this process's /proc/<pid>/fd and memory become root's, and
    ptrace is refused, so the kernel (the same uid) cannot write into the answer pipe."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # 4: PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def limit(memory_bytes: int) -> None:
    """This process's limits, inherited by the kernel and its ranks; an unprivileged account
    may lower a hard limit but never raise it back."""
    for which, value in [(resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_NPROC, 512),
                         (resource.RLIMIT_FSIZE, 1 << 30), (resource.RLIMIT_CORE, 0)]:
        resource.setrlimit(which, (value, value))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    undumpable()  # first: before any code of a submission runs as this uid
    if os.geteuid() == 0:  # and never ends "every process of mine" as root: kill(-1) would end all
        print("the sandbox never runs as root", file=sys.stderr)
        return 2
    if argv == ["--end"]:
        _kill_every_process_of_mine()
        remove_mine(os.getuid(), ELSEWHERE)
        return 0
    request = json.loads(sys.stdin.read())
    # The answer goes out on a private copy of stdout; the kernel and its ranks inherit
    # /dev/null as their stdout and stderr, so nothing they print can garble or flood it.
    answer, errors = os.fdopen(os.dup(1), "w"), os.fdopen(os.dup(2), "w")
    quiet = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(quiet, fd)
    try:
        text = grade(request)
    except Exception as e:  # said to the instructor's process, which raises it
        errors.write(f"{type(e).__name__}: {e}\n")
        errors.flush()
        return 1
    finally:
        _kill_every_process_of_mine()
        remove_mine(os.getuid(), ELSEWHERE)
    answer.write(text)
    answer.flush()
    return 0


def grade(request: dict) -> str:
    me = pwd.getpwuid(os.getuid())
    os.environ.clear()
    limit(request["memory_bytes"])
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="grading-", dir=me.pw_dir))
    os.environ.update({"USER": me.pw_name, "LOGNAME": me.pw_name,
                       "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
                       **request.get("env", {}), **scratch_env(scratch)})
    tempfile.tempdir = None
    try:
        return execute(request["notebook"], scratch, request["timeout"])
    finally:
        os.chdir("/")
        shutil.rmtree(scratch, ignore_errors=True)


def scratch_env(scratch: pathlib.Path) -> dict[str, str]:
    """HOME, Jupyter's and IPython's folders, and TMPDIR inside this run's scratch folder (removed
    after it), and no user site-packages: nothing one submission writes there (a startup file,
    a kernel spec, a .pth file) is read while grading the next."""
    places = {"HOME": "home", "IPYTHONDIR": "home/.ipython", "JUPYTER_CONFIG_DIR": "home/.jupyter",
              "JUPYTER_DATA_DIR": "home/.local/share/jupyter", "JUPYTER_RUNTIME_DIR": "runtime",
              "TMPDIR": "tmp"}  # TMPDIR: torchrun's and torch's temporary files too
    for rel in places.values():
        (scratch / rel).mkdir(mode=0o700, parents=True, exist_ok=True)
    return {**{k: str(scratch / rel) for k, rel in places.items()}, "PYTHONNOUSERSITE": "1"}


def execute(text: str, folder: pathlib.Path, timeout: int) -> str:
    """nbgrader's Execute on the notebook in ``folder``; the executed notebook as text."""
    import nbformat
    from nbgrader.preprocessors import Execute

    os.chdir(folder)
    nb = nbformat.reads(text, as_version=4)
    (folder / "submission.ipynb").write_text(text)
    step = Execute(timeout=timeout)
    with _autograde_env():
        nb, _ = step.preprocess(nb, {"metadata": {"path": str(folder)}})
    return nbformat.writes(nb)


class _autograde_env:
    # nbgrader sets NBGRADER_EXECUTION while autograding: graders may read it.
    def __enter__(self):
        os.environ["NBGRADER_EXECUTION"] = "autograde"

    def __exit__(self, *exc):
        os.environ.pop("NBGRADER_EXECUTION", None)


if __name__ == "__main__":
    sys.exit(main())
