"""Your own link, measured: all-reduces of a range of sizes, and the ring model fitted to them.

Teaches: the what-if needs a link (a latency and a bandwidth), and the one you train on can be
measured where you train. ``measure_link`` runs on EVERY rank of a process group that is up
(torchrun's, through ``python -m ddplab link``; a Cluster's, through ``cluster.run``): for each
size it runs ``warmup`` untimed all-reduces, then times ``repeats`` blocking ones of each size,
going round the sizes, each after a barrier (``ddplab.netsim.costmodel.measure_allreduce``:
float32 tensors on the rank's device;
on NCCL the host waits for the GPU with ``torch.cuda.synchronize``, since a blocking NCCL
all-reduce only blocks the stream). Each rank keeps its median; an all-reduce is over for the
job when it is over on its slowest rank, so the slowest rank's median is the time of that size.
On a Cluster's rank it first waits for the rank's background import (``wait_for_cluster_import``).

The model is the one the simulated link and the what-if use
(``ddplab.netsim.link.LinkModel.allreduce_seconds``), a ring over p ranks of n bytes:

    seconds = 2(p-1) * latency  +  2(p-1)/p * n / bandwidth

It is a line in n, ``a + b n``: ``fit_link`` fits it and reads latency = a / (2(p-1)) seconds
and bandwidth = (2(p-1)/p) / b bytes per second. The fit is least squares on RELATIVE errors
(each time weighted by 1/t^2): sizes span four orders of magnitude, and a plain least-squares
line follows the large sizes and may miss a 4 KiB all-reduce by several times. A negative
intercept (no latency to see) is fitted again through zero; times that do not grow with size
are refused. The residuals (fit against measured, relative) are kept beside the fit, and a
time more than half off its fit (``OFF_LINE``) is said in the file's ``warning``: a busy
machine, or a link whose cost is not one line over these sizes (a protocol switch).

Rank 0 writes the measurement as JSON (``write_link``); ``load_link`` turns the file into a
LinkModel labelled "link measured by ddplab link on <host>, <date>", which is what
``ddplab.measure.whatif.predict(..., link="link.json")`` does (``link=`` also takes the dict
``measure_link`` returned). Reading it back fits the times again: a file whose latency or
bandwidth no longer follows from its times (edited by hand) is refused, and a fit that failed
after measuring leaves the times in the file with no fit.

Leaves out, compared with nccl-tests and torch: other collectives, dtypes other than float32,
NCCL's algorithms and protocols (ring, tree; LL, LL128, Simple: one line through all of
them), concurrent all-reduces, and timing on the GPU (CUDA events): the host clock around a
synchronized all-reduce includes the launch. Ranks on one machine talk through loopback or
shared memory: such a measurement says nothing about a network between machines.
References: Thakur, Rabenseifner and Gropp (2005) for the ring cost; nccl-tests' bus bandwidth
notes (PERFORMANCE.md); torch.distributed.all_reduce and all_gather_object.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import socket
import sys
from pathlib import Path

from ddplab.netsim.link import LinkModel

FORMAT = "ddplab link 1"  # the file's "format": load_link refuses anything else
DEFAULT_SIZES = tuple(4 ** k * 2 ** 12 for k in range(8))  # 4 KiB, 16 KiB, ... 64 MiB
COMMAND = "torchrun --nproc-per-node 2 -m ddplab link -o link.json"
NO_GROUP = ("measure_link() times all-reduces on a process group, and none is initialized: "
            f"from a shell run `{COMMAND}`; in a notebook, cluster.run(measure_link) on a "
            "ddplab Cluster's ranks")


def fit_link(sizes_bytes, seconds, world_size: int) -> dict:
    """The ring model through measured (bytes, seconds), on relative errors (module docstring).

    Returns latency_s, bandwidth_bytes_per_s, the LinkModel's units (latency_us,
    bandwidth_gbps), the predicted seconds and the relative residuals; ValueError in words
    when no line can be fitted."""
    xs, ys, p = [float(n) for n in sizes_bytes], [float(t) for t in seconds], world_size
    if p < 2:
        raise ValueError(f"a link needs at least 2 ranks to measure, got world size {p}")
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("fit_link needs one time per size and at least two different sizes")
    if min(ys) <= 0 or not all(map(math.isfinite, ys)):
        raise ValueError(f"all-reduce times must be positive seconds, got {ys}")
    try:
        w = [1 / y ** 2 for y in ys]
        s, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
        sxx = sum(wi * x * x for wi, x in zip(w, xs))
        sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
        b = (s * sxy - sx * sy) / (s * sxx - sx * sx)
        a = (sy - b * sx) / s
        if a < 0:  # no latency to see at these sizes: the line through zero
            a, b = 0.0, sxy / sxx
        if not (math.isfinite(a) and math.isfinite(b)):
            raise OverflowError
    except (OverflowError, ZeroDivisionError):  # 1/t^2 of times like 1e-200 or 1e300 s
        raise ValueError(f"all-reduce times out of any range a clock gives ({ys} s): no line can be "
                         "fitted to them") from None
    if b <= 0:
        raise ValueError(f"the all-reduce times did not grow with size ({ys} s for {xs} bytes), so "
                         "no bandwidth can be fitted: measure larger sizes, on a quieter machine")
    latency_s = a / (2 * (p - 1))
    bandwidth = 2 * (p - 1) / p / b
    model = LinkModel(8 * bandwidth / 1e9, 1e6 * latency_s)
    predicted = [model.allreduce_seconds(int(x), p) for x in xs]
    residuals = [(f - y) / y for f, y in zip(predicted, ys)]
    return {"model": "seconds = 2(p-1) * latency + 2(p-1)/p * bytes / bandwidth "
                     "(ddplab.netsim.link.LinkModel.allreduce_seconds)",
            "weighting": "least squares on relative errors (each time weighted by 1/t^2)",
            "latency_s": latency_s, "bandwidth_bytes_per_s": bandwidth,
            "latency_us": model.latency_us, "bandwidth_gbps": model.bandwidth_gbps,
            "predicted_seconds": predicted, "relative_residuals": residuals,
            "sizes": len(set(xs)),  # two: the line goes through both, and the residuals are 0
            "max_abs_relative_residual": max(map(abs, residuals)),
            "rms_relative_residual": math.sqrt(sum(r * r for r in residuals) / len(residuals))}


def check_sizes(sizes_bytes) -> list:
    """Sizes in bytes, whole float32 elements, at least two different ones: or ValueError."""
    sizes = list(sizes_bytes)
    bad = [n for n in sizes if isinstance(n, bool) or not isinstance(n, int) or n < 4 or n % 4]
    if bad:
        raise ValueError(f"sizes must be whole numbers of bytes, multiples of 4 (float32) and >= 4, "
                         f"got {bad}")
    if len(set(sizes)) < 2:
        raise ValueError(f"at least two different sizes are needed to fit latency and bandwidth, got {sizes}")
    return sorted(set(sizes))


def measure_link(group=None, sizes_bytes=DEFAULT_SIZES, repeats: int = 7, warmup: int = 2,
                 out=None) -> dict:
    """Run on EVERY rank: time all-reduces of ``sizes_bytes`` on ``group`` (the default group
    when None), fit the ring model, and return the measurement (the same dict on every rank).
    With ``out``, rank 0 also writes it there as JSON (``write_link``)."""
    import torch
    import torch.distributed as dist

    from ddplab.netsim.costmodel import measure_allreduce
    from ddplab.pg.backend import backend_name, device

    if not dist.is_initialized():
        raise RuntimeError(NO_GROUP)
    if isinstance(sizes_bytes, (str, bytes)):
        raise TypeError(f"sizes_bytes must be a list of sizes in bytes, e.g. [4096, 65536, 2**20], got "
                        f"the string {sizes_bytes!r} (the command line's --sizes takes 4K,64K,1M)")
    sizes = check_sizes(sizes_bytes)
    if out is not None:
        why = cannot_write(Path(out))
        if why:  # before the minutes of measuring, not after them
            raise ValueError(why)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a whole number >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a whole number >= 0, got {warmup!r}")
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    if p < 2:
        raise ValueError(f"a link needs at least 2 ranks: this group has {p}; start 2 or more "
                         f"(`{COMMAND}`)")
    check_memory(sizes, device(group))
    wait_for_cluster_import()
    times = measure_allreduce(sizes, repeats, group, warmup)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    mine = {"host": socket.gethostname(), "seconds": [times[n] for n in sizes], "date": now}
    parts = [None] * p
    dist.all_gather_object(parts, mine, group=group)
    seconds = [max(part["seconds"][i] for part in parts) for i in range(len(sizes))]
    hosts = [part["host"] for part in parts]
    measurement = {
        "format": FORMAT,
        "what": "blocking all-reduces timed by python -m ddplab link (ddplab.measure.link), and the "
                "ring model fitted to them",
        "date": parts[0]["date"],  # rank 0's clock, so that every rank returns the same
        "world_size": p, "backend": backend_name(group), "device": device(group).type,
        "hosts": hosts, "one_machine": len(set(hosts)) == 1, "torch": torch.__version__,
        "dtype": "float32", "warmup": warmup, "repeats": repeats,
        "statistic": "median of the repeats on each rank; the slowest rank's median per size",
        "sizes_bytes": sizes, "seconds": seconds,
        "seconds_by_rank": [part["seconds"] for part in parts],
    }
    if measurement["one_machine"]:
        measurement["note"] = ONE_MACHINE
    try:  # the same data on every rank: the same answer, or the same refusal
        measurement["fit"] = fit_link(sizes, seconds, p)
    except ValueError as e:
        # the minutes of measuring are not thrown away: the times are written without a fit
        measurement["fit"], measurement["fit_error"] = None, str(e)
        if out is not None and rank == 0:
            write_link(measurement, out)
        kept = ("" if out is None else f" (the measured times are in {out}, without a fit)" if rank == 0
                else f" (rank 0 writes the measured times to {out}, without a fit)")
        raise ValueError(f"{e}{kept}") from None
    warning = fit_warning(measurement["fit"])
    if warning:
        measurement["warning"] = warning
    if out is not None and rank == 0:
        write_link(measurement, out)
    return measurement


def fit_warning(fit: dict):
    """What the file's ``warning`` says about ``fit``, or None when the line fits the times."""
    if fit["sizes"] == 2:
        return ("only two sizes were measured, and a line passes through any two points: the fit is "
                "0% off by construction, which says nothing about how well the ring model describes "
                "this link; measure three sizes or more (--sizes)")
    off = fit["max_abs_relative_residual"]
    if off > OFF_LINE:
        return (f"a measured time is {100 * off:.0f}% off the fitted line: the machine was busy, or the "
                "link's cost is not one line over these sizes; measure again on a quiet machine, or over "
                "a narrower range (--sizes)")
    return None


def cannot_write(out: Path):
    """Why ``out`` cannot take the measurement, in words, or None: tried by writing a file
    beside it, since a folder can look writable and still refuse files (/proc, a full disk)."""
    import tempfile

    out = out.expanduser()
    if out.is_dir():
        return f"cannot write {out}: it is a folder; give a file name, e.g. {out / 'link.json'}"
    folder = out.resolve().parent
    if not folder.is_dir():
        return f"cannot write {out}: the folder {folder} does not exist"
    if out.exists() and not os.access(out, os.W_OK):
        return f"cannot write {out}: no permission to write it; give a path you can write"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ddplab-link-", suffix=".json") as probe:
            probe.write(b"{}")
            probe.flush()
    except OSError as e:
        return f"cannot write {out}: {e.strerror or e} in {folder}; give a path you can write"
    return None


def check_memory(sizes, where) -> None:
    """Refuse sizes whose tensors would not fit: every size's tensor is allocated at once
    (ddplab.netsim.costmodel.measure_allreduce), on every rank of this machine."""
    need = sum(max(4, n) for n in sizes)
    if where.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(where)
        ranks, room, what = 1, free, "free on this rank's GPU"
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        room, what = available_memory(), "available on this machine"
    if room is not None and need * ranks > 0.8 * room:
        raise ValueError(f"the sizes need {need / 2**30:.1f} GiB per rank ({ranks} rank(s) here), more than "
                         f"80% of the {room / 2**30:.1f} GiB {what}: measure smaller sizes (--sizes)")


def available_memory():
    """MemAvailable from /proc/meminfo in bytes, or None where there is none (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def wait_for_cluster_import(limit_s: float = 120.0) -> None:
    """On a Cluster's rank, wait until its background import is over (``preimported`` in
    ddplab.cluster.worker): for the seconds after the ranks start it holds the GIL, and
    all-reduces timed then took 30-450 ms instead of 0.5 ms here (2 loaded cores). Looked up
    in sys.modules, not imported: only a Cluster's rank has that module, and its event."""
    worker = sys.modules.get("ddplab.cluster.worker")
    if worker is not None and getattr(worker, "channel", None) is not None:
        worker.preimported.wait(limit_s)


OFF_LINE = 0.5  # a residual above this says the line does not describe the times
ONE_MACHINE = ("every rank ran on one machine: the all-reduces crossed loopback or shared memory, "
               "not a network, so this says nothing about a link between machines")


def write_link(measurement: dict, path) -> str:
    """Write a ``measure_link`` result as JSON at ``path``; returns the path."""
    Path(path).write_text(json.dumps(measurement, indent=1) + "\n", encoding="utf-8")
    return str(path)


def is_link_file(link) -> bool:
    """Whether ``link`` (what predict's ``link=`` got) names a file rather than a preset."""
    if isinstance(link, Path):
        return True
    return isinstance(link, str) and (link.endswith(".json") or Path(link).is_file())


def load_link(path) -> tuple[LinkModel, dict]:
    """(LinkModel, where it came from) for a file ``python -m ddplab link`` wrote."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a folder, not a link file: pass the file `python -m ddplab link -o` "
                         "wrote (link.json by default)")
    if not path.is_file():
        raise ValueError(f"no link file {str(path)!r}: write one with `{COMMAND.replace('link.json', str(path))}` "
                         "(under the launcher you train with), or pass a preset name or a LinkModel")
    try:
        m = json.loads(path.read_text(encoding="utf-8-sig"))  # -sig: a BOM an editor may have added
    except UnicodeDecodeError:
        raise ValueError(f"{str(path)!r} is not UTF-8 text: a link file is the JSON `{COMMAND}` "
                         "writes; if you saved it from an editor, save it as UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): "
                         f"if you edited it, undo the edit, or measure again with `{COMMAND}`") from None
    model, source = link_from_measurement(m, repr(str(path)))
    source["file"] = str(path)
    return model, source


# what a measurement must hold to be read back, and what each must be
FIELDS = {"world_size": int, "backend": str, "hosts": list, "one_machine": bool, "date": str,
          "sizes_bytes": list, "seconds": list, "seconds_by_rank": list, "fit": dict}


def inconsistent(m: dict):
    """What in a measurement does not agree with the rest of it, or None: what measure_link
    writes always agrees, so a disagreement is an edit (or a file cut short)."""
    p, sizes, hosts = m["world_size"], m["sizes_bytes"], m["hosts"]
    if p < 2:
        return f"world_size is {p}, and a link is measured on 2 ranks or more"
    if len(hosts) != p or not all(isinstance(h, str) and h for h in hosts):
        return f"hosts holds {len(hosts)} host name(s) for world_size {p}"
    if m["one_machine"] != (len(set(hosts)) == 1):
        return f"one_machine is {m['one_machine']} and the hosts are {sorted(set(hosts))}"
    try:
        if check_sizes(sizes) != sizes:
            return "sizes_bytes is not in increasing order"
        datetime.datetime.fromisoformat(m["date"])
    except ValueError as e:
        return str(e) if "sizes" in str(e) else f"date {m['date']!r} is not the ISO date measure_link writes"
    by_rank = m["seconds_by_rank"]
    if len(by_rank) != p or not all(isinstance(r, list) and len(r) == len(sizes) for r in by_rank):
        return f"seconds_by_rank does not hold one time per size for each of the {p} ranks"
    try:
        slowest = [max(r[i] for r in by_rank) for i in range(len(sizes))]
    except TypeError:
        return "seconds_by_rank holds something other than numbers"
    if slowest != m["seconds"]:
        return "seconds is not the slowest rank's time of each size in seconds_by_rank"
    return None


def link_from_measurement(m, what: str = "the measurement") -> tuple[LinkModel, dict]:
    """(LinkModel, where it came from) for what ``measure_link`` returned (or wrote, read back).

    The model is fitted again from the measured times, and the file's own fit must agree with
    it: a file whose latency or bandwidth was edited by hand would give a prediction labelled
    "measured" for a link nobody measured."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{what} is not a link measured by `python -m ddplab link` (its JSON has "
                         f"no \"format\": {FORMAT!r}); write one with `{COMMAND}`")
    if m.get("fit") is None and m.get("fit_error"):
        raise ValueError(f"{what} holds measured times but no fit ({m['fit_error']}): measure again")
    bad = [k for k, kind in FIELDS.items()
           if not isinstance(m.get(k), kind) or (kind is not bool and isinstance(m.get(k), bool))]
    if bad:
        raise ValueError(f"{what} lacks {', '.join(bad)} (or holds something else there): it was not "
                         f"written whole by `python -m ddplab link`; write it again with `{COMMAND}`")
    why = inconsistent(m)
    if why:
        raise ValueError(f"{what}: {why}: the file was edited, or not written whole; measure again with "
                         f"`{COMMAND}`")
    try:
        fit = fit_link(m["sizes_bytes"], m["seconds"], m["world_size"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: its measured times cannot be fitted ({e}); measure again") from None
    stored = m["fit"]
    for key in ("latency_us", "bandwidth_gbps", "latency_s", "bandwidth_bytes_per_s"):
        value = stored.get(key)
        if not isinstance(value, (int, float)) or not math.isclose(value, fit[key], rel_tol=1e-9, abs_tol=1e-12):
            raise ValueError(
                f"{what}: its fit's {key} ({value!r}) is not what its measured times give ({fit[key]:.6g}): "
                "the file was edited. For a link of your own choosing, pass "
                "LinkModel(bandwidth_gbps=..., latency_us=...) (ddplab.netsim.link) instead of a file")
    hosts = sorted(set(map(str, m["hosts"])))
    where = hosts[0] if len(hosts) == 1 else f"{len(hosts)} machines ({', '.join(hosts)})"
    label = f"link measured by ddplab link on {where}, {m['date'][:10]}"
    label += (f" ({m['backend']}, {m['world_size']} ranks on one machine: not a network)" if len(hosts) == 1
              else f" ({m['backend']}, {m['world_size']} ranks)")
    warning = fit_warning(fit)
    if warning:  # said where the prediction is shown, not only in the file
        label += "; only two sizes measured, the fit unchecked" if fit["sizes"] == 2 else \
            f"; a measured time {100 * fit['max_abs_relative_residual']:.0f}% off the fit"
    model = LinkModel(fit["bandwidth_gbps"], fit["latency_us"], label)
    source = {"hosts": m["hosts"], "date": m["date"], "backend": m["backend"], "sizes_bytes": m["sizes_bytes"],
              "world_size": m["world_size"], "one_machine": len(hosts) == 1,
              "max_abs_relative_residual": fit["max_abs_relative_residual"]}
    if warning:
        source["warning"] = warning
    return model, source
