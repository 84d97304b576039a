"""A link measured by ``python -m ddplab link`` (ddplab.measure.link), in-process: the ring fit,
the file the what-if takes, and the words when something is missing. No process is started:
the command itself under torchrun is tests/measure/test_link_more.py."""
import json
import re
import sys
import threading
import time
import types
from pathlib import Path

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


def measurement(sizes, seconds, hosts=("nodeA", "nodeA")) -> dict:
    """What measure_link returns for these times (every rank as slow), without ranks."""
    p = len(hosts)
    return {"format": FORMAT, "date": "2026-11-27T10:00:00+00:00", "world_size": p, "backend": "gloo",
            "device": "cpu", "hosts": list(hosts), "one_machine": len(set(hosts)) == 1, "sizes_bytes": sizes,
            "seconds": seconds, "seconds_by_rank": [list(seconds)] * p, "fit": fit_link(sizes, seconds, p)}


def measured_file(path, hosts=("nodeA", "nodeA"), link=MEASURED):
    """A file as measure_link writes it, from times ``link`` gives (no ranks started here)."""
    write_link(measurement(SIZES, [link.allreduce_seconds(n, len(hosts)) for n in SIZES], hosts), path)
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
    assert parse_sizes("4K,64k,1M,2MiB,100") == [100, 4096, 65536, 2 ** 20, 2 ** 21]
    with pytest.raises(Exception, match="give sizes in bytes"):
        parse_sizes("4K,lots")


@pytest.mark.parametrize("args, words", [
    (["--sizes", "3,4K"], "multiples of 4"), (["--sizes", "4K"], "at least two different sizes"),
    (["--repeats", "0"], "whole number >= 1"), (["--warmup", "-1"], "whole number >= 0"),
    (["--repeats", "2.5"], "whole number >= 1"), (["--timeout", "0"], "seconds more than 0"),
    (["--timeout", "inf"], "seconds more than 0"), (["--sizes", "4K,"], "give sizes in bytes"),
    (["--sizes", "4K,inf"], "give sizes in bytes"), (["--sizes", "1.3K,8K"], "not a whole number of bytes")])
def test_arguments_that_cannot_measure_are_refused_by_the_parser_before_any_rank_starts(args, words, capsys):
    import argparse

    from ddplab.cli.link import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(args)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


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


def edited(path, **changes):
    """The file at ``path`` with keys changed (``fit__latency_us`` reaches into the fit)."""
    m = json.loads(open(path).read())
    for key, value in changes.items():
        outer, _, inner = key.partition("__")
        target = m[outer] if inner else m
        if value is None:
            target.pop(inner or outer)
        else:
            target[inner or outer] = value
    open(path, "w").write(json.dumps(m))
    return path


def test_a_file_edited_by_hand_or_cut_short_is_refused_and_says_what_to_pass_instead(tmp_path):
    path = measured_file(tmp_path / "link.json")
    edited(path, fit__latency_us=1.0)  # a what-if on a link nobody measured, labelled "measured"
    with pytest.raises(ValueError, match=r"fit's latency_us \(1.0\) is not what its measured times give.*"
                                         r"LinkModel\(bandwidth_gbps=\.\.\., latency_us=\.\.\.\)"):
        predict(one_size_recording(), link=path)
    for missing in ("hosts", "date", "seconds", "fit"):
        path = edited(measured_file(tmp_path / f"no-{missing}.json"), **{missing: None})
        with pytest.raises(ValueError, match=f"lacks {missing} .*ddplab link -o link.json"):
            load_link(path)
    with pytest.raises(ValueError, match="lacks world_size"):
        load_link(edited(measured_file(tmp_path / "w.json"), world_size="2"))


def test_a_measurement_dict_is_a_link_and_a_dict_without_the_model_s_keys_is_refused_in_words(tmp_path):
    m = json.loads(open(measured_file(tmp_path / "link.json")).read())
    from_dict = predict(one_size_recording(), link=m)
    from_file = predict(one_size_recording(), link=str(tmp_path / "link.json"))
    assert from_dict.meta["labels"] == from_file.meta["labels"]
    assert summarize(from_dict)["step_ms"] == pytest.approx(summarize(from_file)["step_ms"])
    with pytest.raises(ValueError, match="needs bandwidth_gbps .* lacks latency_us"):
        predict(one_size_recording(), link={"bandwidth_gbps": 10.0})
    with pytest.raises(ValueError, match="not a link measured by"):
        predict(one_size_recording(), link={**m, "format": "ddplab link 0"})


def test_two_sizes_fit_exactly_and_the_file_and_the_prediction_say_that_proves_nothing(tmp_path):
    sizes, times = [2 ** 12, 2 ** 20], [1e-3, 9e-3]  # any two times: the line goes through both
    fit = fit_link(sizes, times, 2)
    assert fit["sizes"] == 2 and fit["max_abs_relative_residual"] == pytest.approx(0.0, abs=1e-12)
    write_link(measurement(sizes, times), tmp_path / "two.json")
    model, source = load_link(tmp_path / "two.json")
    assert "only two sizes measured, the fit unchecked" in model.label
    assert "0% off by construction" in source["warning"]
    tl = predict(one_size_recording(), link=str(tmp_path / "two.json"))
    assert "the fit unchecked" in tl.meta["labels"][0]  # where the prediction is shown


def test_a_fit_that_is_far_off_its_times_is_said_in_the_prediction_s_label(tmp_path):
    times = [50e-6, 60e-6, 900e-6, 40e-3]  # bent at the large end
    fit = fit_link(SIZES, times, 2)
    assert fit["max_abs_relative_residual"] > 0.5
    write_link(measurement(SIZES, times), tmp_path / "bent.json")
    tl = predict(one_size_recording(), link=str(tmp_path / "bent.json"))
    assert f"a measured time {100 * fit['max_abs_relative_residual']:.0f}% off the fit" in tl.meta["labels"][0]


def test_a_fit_that_fails_after_measuring_keeps_the_times_in_the_file(tmp_path, monkeypatch):
    import ddplab.netsim.costmodel as costmodel

    falling = {n: 1e-3 / (i + 1) for i, n in enumerate(SIZES)}  # times that shrink with size: no fit
    monkeypatch.setattr(costmodel, "measure_allreduce", lambda sizes, repeats, group, warmup: falling)
    fake = types.SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda g=None: 2,
                                 get_rank=lambda g=None: 0,
                                 all_gather_object=lambda parts, mine, group=None: parts.__setitem__(
                                     slice(None), [mine, mine]))
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    import torch
    monkeypatch.setattr(torch, "distributed", fake, raising=False)
    monkeypatch.setattr("ddplab.pg.backend.backend_name", lambda group=None: "gloo")
    monkeypatch.setattr("ddplab.pg.backend.device", lambda group=None: torch.device("cpu"))
    out = tmp_path / "link.json"
    with pytest.raises(ValueError, match=f"did not grow with size.*the measured times are in {out}, without a fit"):
        measure_link(sizes_bytes=SIZES, out=out)
    kept = json.loads(out.read_text())
    assert kept["seconds"] == [falling[n] for n in SIZES] and kept["fit"] is None
    with pytest.raises(ValueError, match="holds measured times but no fit .*did not grow with size"):
        load_link(out)


@pytest.mark.parametrize("edit, words", [
    ({"hosts": ["a", "b"]}, "one_machine is True and the hosts are"),  # the "not a network" caveat would go
    ({"hosts": ["a", "a", "a"]}, "3 host name(s) for world_size 2"),
    ({"hosts": []}, "0 host name(s)"),
    ({"date": "yesterday"}, "not the ISO date"),
    ({"sizes_bytes": [65536, 4096, 2 ** 20, 2 ** 24]}, "not in increasing order"),
    ({"sizes_bytes": [4096.5, 65536, 2 ** 20, 2 ** 24]}, "sizes must be whole numbers"),
    ({"seconds_by_rank": [[1.0, 2.0, 3.0, 4.0]]}, "one time per size for each of the 2 ranks"),
])
def test_edits_that_keep_the_fit_but_break_the_rest_are_refused(tmp_path, edit, words):
    m = json.loads(open(measured_file(tmp_path / "link.json")).read())
    m.update(edit)
    (tmp_path / "e.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=re.escape(words) + ".*the file was edited"):
        load_link(tmp_path / "e.json")


def test_times_scaled_with_their_fit_are_refused_by_the_ranks_own_times(tmp_path):
    m = json.loads(open(measured_file(tmp_path / "link.json")).read())
    faster = fit_link(SIZES, [t / 10 for t in m["seconds"]], 2)  # consistent with itself...
    m.update(seconds=[t / 10 for t in m["seconds"]], fit=faster)
    (tmp_path / "x.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="not the slowest rank's time of each size"):  # ...not with the ranks'
        load_link(tmp_path / "x.json")
    m = json.loads(open(measured_file(tmp_path / "link.json")).read())
    m["fit"]["latency_s"] = 1.0  # a number of the fit the what-if does not read: refused too
    (tmp_path / "y.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="its fit's latency_s"):
        load_link(tmp_path / "y.json")


def test_a_file_that_is_not_json_any_more_says_where_and_a_bom_is_read(tmp_path):
    text = open(measured_file(tmp_path / "link.json")).read()
    (tmp_path / "comma.json").write_text(text.rstrip()[:-1] + ",}")
    with pytest.raises(ValueError, match=r"is not valid JSON \(.* at line \d+, column \d+\)"):
        load_link(tmp_path / "comma.json")
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_link(tmp_path / "bom.json")[0].latency_us == pytest.approx(MEASURED.latency_us)
    (tmp_path / "u16.json").write_bytes(text.encode("utf-16"))
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        load_link(tmp_path / "u16.json")
    with pytest.raises(ValueError, match="is a folder, not a link file"):
        load_link(tmp_path)


def test_times_out_of_any_clock_s_range_are_refused_in_words():
    for times in ([1e300, 1e301, 1e302, 1e303], [1e-200, 2e-200, 3e-200, 4e-200]):
        with pytest.raises(ValueError, match="out of any range a clock gives"):
            fit_link(SIZES, times, 2)


def test_buckets_far_past_the_measured_sizes_are_said_in_the_label(tmp_path):
    tiny = [4, 8, 12, 16]  # `--sizes 4,8,12,16` meant as KiB: the recording's buckets are 2 MiB
    write_link(measurement(tiny, [MEASURED.allreduce_seconds(n, 2) for n in tiny]), tmp_path / "tiny.json")
    label = predict(one_size_recording(), link=str(tmp_path / "tiny.json")).meta["labels"][0]
    assert "buckets of up to 2 MiB, the link measured only up to 1.53e-05 MiB: carried past its sizes" in label
    assert "carried past" not in predict(one_size_recording(), link=measured_file(tmp_path / "ok.json")
                                         ).meta["labels"][0]  # 4 KiB to 16 MiB holds 2 MiB


def test_a_link_at_one_rank_is_refused_saying_to_pass_world_size(tmp_path):
    one = one_size_recording()
    with pytest.raises(ValueError, match="at 1 rank there is nothing to all-reduce.*world_size="):
        predict(one, link=measured_file(tmp_path / "l.json"), world_size=1)


def test_an_output_no_file_can_be_written_in_is_refused_before_measuring(tmp_path):
    from ddplab.measure.link import cannot_write

    assert cannot_write(tmp_path / "fine.json") is None and not list(tmp_path.iterdir())  # the probe is gone
    assert "it is a folder" in cannot_write(tmp_path)
    assert "does not exist" in cannot_write(tmp_path / "no" / "l.json")
    if Path("/proc").is_dir():
        assert "cannot write /proc/link.json" in cannot_write(Path("/proc/link.json"))


def test_sizes_whose_tensors_would_not_fit_in_memory_are_refused(monkeypatch):
    import torch

    from ddplab.measure.link import check_memory

    monkeypatch.setattr("ddplab.measure.link.available_memory", lambda: 8 * 2 ** 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_memory([2 ** 12, 2 ** 30], torch.device("cpu"))  # 2 x 1 GiB of 8: fine
    with pytest.raises(ValueError, match=r"need 4.0 GiB per rank \(2 rank\(s\) here\), more than 80% of the 8.0"):
        check_memory([2 ** 12, 2 ** 32], torch.device("cpu"))

