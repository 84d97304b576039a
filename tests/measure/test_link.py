"""A link measured by ``python -m ddplab link`` (ddplab.measure.link), in-process: the ring fit,
the file the what-if takes, and the words when something is missing. No process is started:
the command itself under torchrun is tests/measure/test_link_more.py."""
import json
import sys
import threading
import time
import types

import pytest
from test_whatif import recording

from ddplab.cli.link import parse_sizes
from ddplab.measure.link import FORMAT, fit_link, load_link, measure_link, wait_for_cluster_import, write_link
from ddplab.measure.whatif import predict
from ddplab.netsim.link import LinkModel
from ddplab.timeline.metrics import summarize

SIZES = [2 ** 12, 2 ** 16, 2 ** 20, 2 ** 24]
MEASURED = LinkModel(8.0, 30.0)  # the link the files below were "measured" on


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_fit_gives_back_the_link_that_made_the_times_in_ring_terms(world_size):
    link = LinkModel(10.0, 25.0)  # 10 Gbit/s, 25 us per ring step
    times = [link.allreduce_seconds(n, world_size) for n in SIZES]
    fit = fit_link(SIZES, times, world_size)
    assert fit["bandwidth_gbps"] == pytest.approx(10.0)
    assert fit["latency_us"] == pytest.approx(25.0)
    assert fit["bandwidth_bytes_per_s"] == pytest.approx(10e9 / 8)
    assert fit["latency_s"] == pytest.approx(25e-6)
    assert fit["max_abs_relative_residual"] == pytest.approx(0.0, abs=1e-9)


def test_the_fit_follows_relative_errors_so_a_small_size_is_not_missed_by_times():
    # a line bent at the large end (as a busy machine's last size often is): a plain
    # least-squares line would follow the 16 MiB point and miss 4 KiB by several times
    times = [50e-6, 60e-6, 900e-6, 40e-3]
    fit = fit_link(SIZES, times, 2)
    assert abs(fit["relative_residuals"][0]) < 0.5
    assert fit["max_abs_relative_residual"] == max(map(abs, fit["relative_residuals"]))


def test_times_that_do_not_grow_with_size_are_refused_and_no_latency_is_fitted_through_zero():
    with pytest.raises(ValueError, match="did not grow with size"):
        fit_link(SIZES, [4e-3, 3e-3, 2e-3, 1e-3], 2)
    fit = fit_link(SIZES, [n / 1e9 for n in SIZES], 2)  # no fixed cost at all
    assert fit["latency_us"] >= 0.0 and fit["bandwidth_bytes_per_s"] == pytest.approx(1e9)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        fit_link(SIZES, [1e-3] * 4, 1)


def measured_file(path, hosts=("nodeA", "nodeA"), link=MEASURED):
    """A file as measure_link writes it, from times ``link`` gives (no ranks started here)."""
    p = len(hosts)
    seconds = [link.allreduce_seconds(n, p) for n in SIZES]
    write_link({"format": FORMAT, "date": "2026-11-27T10:00:00+00:00", "world_size": p,
                "backend": "gloo", "device": "cpu", "hosts": list(hosts), "sizes_bytes": SIZES,
                "seconds": seconds, "fit": fit_link(SIZES, seconds, p)}, path)
    return str(path)


def one_size_recording():
    rec = recording()  # its all-reduces are all 2 MiB
    rec.meta.clear()  # a real link: the recording's own times are all it has
    return rec


def test_a_recording_with_one_all_reduce_size_is_predicted_on_a_measured_link_and_says_so(tmp_path):
    with pytest.raises(ValueError, match="ddplab link -o link.json"):
        predict(one_size_recording())  # the refusal names the command that measures one
    path = measured_file(tmp_path / "link.json")
    tl = predict(one_size_recording(), link=path)
    label = tl.meta["labels"][0]
    assert "link measured by ddplab link on nodeA, 2026-11-27" in label
    assert "on one machine: not a network" in label
    assert tl.meta["measured_link"]["file"] == path and tl.meta["measured_link"]["one_machine"]
    # the same step as the link the file was measured from
    by_hand = predict(one_size_recording(), link=MEASURED)
    assert summarize(tl)["step_ms"] == pytest.approx(summarize(by_hand)["step_ms"])
    four = predict(one_size_recording(), link=path, world_size=4)
    assert "measured at 2 ranks and carried to 4 by the ring model" in four.meta["labels"][0]


def test_a_link_measured_across_machines_names_them(tmp_path):
    model, source = load_link(measured_file(tmp_path / "l.json", hosts=("a", "b", "a", "b")))
    assert model.label.startswith("link measured by ddplab link on 2 machines (a, b), 2026-11-27")
    assert "not a network" not in model.label and not source["one_machine"]


def test_a_missing_or_foreign_link_file_is_refused_with_the_command_that_writes_one(tmp_path):
    with pytest.raises(ValueError, match="no link file .*-m ddplab link -o mine.json"):
        predict(one_size_recording(), link="mine.json")
    other = tmp_path / "run.json"
    other.write_text(json.dumps({"iterations": []}))
    with pytest.raises(ValueError, match="is not a link measured by `python -m ddplab link`"):
        predict(one_size_recording(), link=str(other))
    with pytest.raises(ValueError, match="unknown link preset"):
        predict(one_size_recording(), link="carrier-pigeon")


def test_measuring_without_a_process_group_says_how_to_start_one():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this pytest process has a process group")
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2 -m ddplab link"):
        measure_link()


def test_sizes_on_the_command_line_read_as_bytes():
    assert parse_sizes("4K,64k,1M,2MiB,100") == [4096, 65536, 2 ** 20, 2 ** 21, 100]
    with pytest.raises(Exception, match="give sizes in bytes"):
        parse_sizes("4K,lots")


def test_on_a_clusters_rank_measuring_waits_for_the_ranks_background_import(monkeypatch):
    # a Cluster's rank imports torch._dynamo on a thread after it starts, holding the GIL:
    # all-reduces timed then were 30-450 ms instead of 0.5 ms. A stand-in rank here.
    rank = types.SimpleNamespace(channel=object(), preimported=threading.Event())
    monkeypatch.setitem(sys.modules, "ddplab.cluster.worker", rank)
    threading.Timer(0.3, rank.preimported.set).start()  # the import ends 0.3 s from now
    t0 = time.monotonic()
    wait_for_cluster_import(limit_s=10)
    assert rank.preimported.is_set() and time.monotonic() - t0 < 5
    rank.preimported.clear()
    rank.channel = None  # the module imported, but this process is no Cluster's rank
    t0 = time.monotonic()
    wait_for_cluster_import(limit_s=10)
    assert time.monotonic() - t0 < 1


def test_an_output_path_rank_0_cannot_write_is_refused_before_measuring(tmp_path, monkeypatch):
    import argparse

    from ddplab.cli.link import add_arguments, refusal

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    assert refusal(tmp_path / "link.json") is None
    assert "it is a folder" in refusal(tmp_path)
    assert "does not exist" in refusal(tmp_path / "no" / "link.json")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--timeout", bad])
    assert parser.parse_args(["--timeout", "2.5"]).timeout == 2.5
