"""The command line's arguments: ``python -m ddplab compare --link`` takes a preset or a link
file (read by the loader the what-if uses), the defaults it states are RunSpec's, and ``--help``
of compare and link answers without importing torch."""
import os
import subprocess
import sys

import pytest
from test_link import MEASURED, edited, measured_file

from ddplab.netsim.link import LinkModel


def test_compare_takes_a_link_file_as_its_simulated_link_and_refuses_a_wrong_one_in_words(tmp_path, capsys):
    import argparse

    from ddplab.cli.compare import add_arguments, spec_from_args

    def spec(link):
        parser = argparse.ArgumentParser(prog="python -m ddplab compare")
        add_arguments(parser)
        return spec_from_args(parser.parse_args(["--link", link]), parser)

    path = measured_file(tmp_path / "mine.json")
    link = spec(path).link
    assert (link.bandwidth_gbps, link.latency_us) == pytest.approx((MEASURED.bandwidth_gbps, MEASURED.latency_us))
    assert "measured by ddplab link" in link.label
    assert spec("10gbe").link.label == LinkModel.preset("10gbe").label  # presets as before
    for wrong, words in ((str(tmp_path / "nope.json"), "no link file"), (str(tmp_path), "is a folder"),
                         (edited(measured_file(tmp_path / "e.json"), fit__latency_us=1.0), "is not what its measured"),
                         ("10gbit", "unknown link preset")):
        with pytest.raises(SystemExit):
            spec(wrong)
        assert words in capsys.readouterr().err, wrong


def test_the_defaults_compare_states_without_torch_are_runspecs():
    from ddplab.cli.compare import DEFAULTS
    from ddplab.measure.spec import RunSpec

    spec = RunSpec()
    assert DEFAULTS == {"world_size": spec.world_size, "strategies": ",".join(spec.strategies),
                        "steps": spec.steps, "warmup": spec.warmup, "model": spec.model,
                        "params": spec.n_params, "depth": spec.depth, "batch_size": spec.batch_size,
                        "bucket_cap_mb": spec.bucket_cap_mb}


@pytest.mark.slow
@pytest.mark.more  # a process of its own
def test_help_and_a_bad_argument_are_answered_before_torch_is_imported():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys\nimport ddplab.__main__ as m\n"
            "for argv in (['compare', '--help'], ['link', '--help'], ['compare', '--steps', 'x'],"
            " ['link', '--repeats', '0']):\n"
            "    try:\n        m.main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=root))
    assert "torch imported: False" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--link PRESET|FILE.json" in done.stdout and "--sizes" in done.stdout
    assert "invalid int value: 'x'" in done.stderr and "must be a whole number >= 1" in done.stderr
