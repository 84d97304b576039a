"""Memory per rank against N (ddplab.measure.memory_vs_ranks): the predicted curve is what ZeRO's
formula says, except where whole parameters make ZeRO-1 fall in steps. No ranks here (the
measured points at N = 1..4: tests/measure/test_fits_more.py)."""
from __future__ import annotations

import pytest

from ddplab.measure import memory_vs_ranks as mvr
from ddplab.measure.memory import default_model
from ddplab.widgets.memory import memory_vs_ranks_figure


@pytest.fixture(scope="module")
def curve():
    return mvr.default_curve()


def test_the_formula_is_zeros_family_in_float32():
    psi = 1000
    assert [mvr.formula(psi, 1, row) for row in mvr.ROWS] == [16000, 16000, 20000, 16000]
    assert mvr.formula(psi, 4, "zero1") == 8 * psi + 8 * psi / 4  # 4Ψ + 4Ψ + KΨ/N
    assert mvr.formula(psi, 4, "zero2") == 4 * psi + 16 * psi / 4  # 4Ψ + (4 + K)Ψ/N, K = 12
    assert mvr.formula(psi, 4, "fsdp") == 16 * psi / 4
    assert mvr.formula(psi, 8, "ddp") == 16 * psi


def test_the_curve_is_the_formula_and_zero1_falls_in_steps(curve):
    params = list(default_model().parameters())
    steps = 4 * len(params)  # Adam's step counts: in the prediction, not in the formula
    ns, pred, form = curve["world_sizes"], curve["predicted"], curve["formula"]
    assert ns == list(range(1, 9)) and curve["psi"] == sum(p.numel() for p in params)
    assert [p - f for p, f in zip(pred["ddp"], form["ddp"])] == [steps] * 8
    for row in ("zero2", "fsdp"):  # even slices: 1/N up to the padding and the step counts
        for n, p, f in zip(ns, pred[row], form[row]):
            assert 0 <= p - f <= steps + 16 * len(params) * n, (row, n, p, f)
    z1, f1 = pred["zero1"], form["zero1"]
    assert z1[0] - f1[0] == steps and all(p >= f for p, f in zip(z1, f1))
    # four equal weights dealt whole: the largest share is two weights at 2 and 3 ranks, one from 4
    # (2 and 3 ranks differ by two biases' Adam state, 4 KiB; the formula by a tenth)
    assert abs(z1[2] / z1[1] - 1) < 0.002 and f1[2] / f1[1] < 0.9
    assert max(z1[3:]) / min(z1[3:]) < 1.001 and f1[7] / z1[7] < 0.91
    fig = memory_vs_ranks_figure(curve, {("zero1", 3): z1[2]})
    drawn = {t.name: t for t in fig.data}
    assert len(fig.data) == 2 * 4 + 1 and list(drawn["zero1: measured"].x) == [3]
    assert list(drawn["ZeRO-1 (whole parameters dealt): predicted"].y) == [v / 2 ** 20 for v in z1]


def test_rows_and_world_sizes_are_refused_in_words_before_any_rank_runs():
    from ddplab.measure.memory import checked, measure_sizes

    class NoRanks:  # a cluster that must not be asked to run anything
        world_size = 3

        def run(self, *a, **k):
            raise AssertionError("ranks were asked to run")

    assert checked(("ddp",), (3, 1, 3, 2)) == (("ddp",), (3, 1, 2))  # each size once, in order
    for rows, sizes, words in [("ddp", (2,), "not one string"), (("nope",), (2,), "unknown rows ['nope']"),
                               ((), (2,), "no rows"), (("ddp",), (0,), "from 1 up, got 0"),
                               (("ddp",), (2.0,), "got 2.0"), (("ddp",), (), "no world sizes"),
                               (("ddp",), (2, 4), "start a Cluster of 4")]:
        with pytest.raises((TypeError, ValueError), match=words.replace("[", r"\[").replace("]", r"\]")):
            measure_sizes(NoRanks(), rows, sizes)
