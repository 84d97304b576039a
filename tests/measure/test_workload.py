"""Your own model, batch and loss in compare(), the sweep's engine, the CLI and the panel;
checked before any rank starts; the built-in transformer."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from ddplab.measure import workload
from ddplab.measure.compare import compare
from ddplab.measure.spec import RunSpec

# Functions written as in a notebook cell: their module is __main__, so cloudpickle
# ships them to the ranks by value (the ranks cannot import this test file's copy).
CELL = textwrap.dedent('''
    import torch
    from torch import nn

    def make_model():
        return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(),
                             nn.Linear(40, 1))

    def make_batch(batch_size, rank, step):
        g = torch.Generator().manual_seed(97 * step + rank)
        x = torch.randn(batch_size, 12, generator=g)
        return x, x[:, :1] * 2.0

    def mse(output, target):
        return ((output - target) ** 2).mean()
''')


def cell():
    ns = {"__name__": "__main__"}
    exec(compile(CELL, "<cell>", "exec"), ns)
    return ns["make_model"], ns["make_batch"], ns["mse"]


@pytest.fixture
def cluster(cluster2):
    return cluster2  # shared for the session (conftest.py)


def _params(model_fn):
    return sum(p.numel() for p in model_fn().parameters())


def test_bad_models_batches_and_losses_say_what_is_wrong_before_any_rank_starts():
    make_model, make_batch, mse = cell()
    cases = [
        (dict(model=make_model), "your own batch function"),
        (dict(model=make_model(), batch=make_batch), "not make_model()"),
        (dict(model=lambda: 3, batch=make_batch), "must return a torch.nn.Module"),
        (dict(model=lambda: torch.nn.Identity(), batch=make_batch), "no trainable parameters"),
        (dict(model=lambda: torch.nn.Linear(5, 1), batch=make_batch), "does not fit the model"),
        (dict(model=make_model, batch=make_batch, loss=lambda o, t: o - t), "scalar"),
        (dict(model=make_model, batch=make_batch, loss=lambda o, t: torch.tensor(1.0)),
         "does not depend"),
        (dict(model=make_model, batch=lambda b: None), "must take 3 arguments"),
        (dict(model=make_model, batch=lambda b, r, s: torch.zeros(b, 12)), r"\(inputs, target\)"),
        (dict(model="gpt"), "transformer"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            RunSpec(**kwargs)
    # compare raises the same error without starting a cluster of its own
    with pytest.raises(ValueError, match="no trainable"):
        compare(None, "ddp", model=lambda: torch.nn.Identity(), batch=make_batch)


def test_the_check_runs_on_the_cpu_or_the_meta_device_never_a_gpu(monkeypatch):
    make_model, make_batch, mse = cell()
    got = workload.check(make_model, make_batch, mse, 8)
    assert got == {"parameters": _params(make_model), "tensors": 6, "device": "cpu"}
    monkeypatch.setattr(workload, "CPU_CHECK_PARAMS", 10)  # "large": shapes only
    workload.check.cache_clear()
    assert workload.check(make_model, make_batch, mse, 8)["device"] == "meta"
    with pytest.raises(ValueError, match="does not fit"):
        workload.check(lambda: torch.nn.Linear(5, 1), make_batch, mse, 8)
    workload.check.cache_clear()


def test_the_transformer_has_many_tensors_and_ties_its_output_to_its_embedding():
    from ddplab.measure.models import batch, build

    net = build("transformer", n_layer=2)
    names = [n for n, _ in net.named_parameters()]
    assert net.head.weight is net.tok.weight and "head.weight" not in names
    assert len(names) == 2 + 2 * 12 + 2  # embeddings, 12 tensors per block, final LayerNorm
    untied = build("transformer", n_layer=2, tied=False)
    assert len(list(untied.parameters())) == len(names) + 1
    ids, targets = batch("transformer", 3, rank=1, step=0)
    assert ids.shape == targets.shape == (3, 64) and torch.equal(ids[:, 1:], targets[:, :-1])
    assert not torch.equal(ids, batch("transformer", 3, rank=0, step=0)[0])  # each rank its own
    # causal: changing a later token leaves earlier logits unchanged
    late = ids.clone()
    late[:, -1] = (late[:, -1] + 1) % 512
    assert torch.allclose(net(ids)[:, :-1], net(late)[:, :-1], atol=1e-6)


@pytest.mark.slow
def test_a_cell_model_trains_under_compare_and_ranks_agree_with_torch_ddp(cluster):
    make_model, make_batch, mse = cell()
    r = compare(cluster, "none,bucketed,ddp", steps=2, model=make_model, batch=make_batch,
                loss=mse, bucket_cap_mb=0.001)
    n = _params(make_model)
    for name in ("bucketed", "ddp"):
        m = r.metrics[name]
        assert m["ranks_agree"], name
        assert m["comm_bytes_per_step"] == 4 * n, name  # the user's model's gradients, float32
        assert r.timelines[name].buckets
    assert r.to_json()["config"]["model"].endswith("make_model")
    assert r.to_json()["config"]["loss"].endswith("mse")


@pytest.mark.slow
def test_the_builtin_transformer_under_compare(cluster):
    from ddplab.measure.models import build

    r = compare(cluster, "none,ddp", steps=1, model="transformer", depth=2, batch_size=2,
                bucket_cap_mb=0.25)
    n = sum(p.numel() for p in build("transformer", n_layer=2).parameters())
    assert r.metrics["ddp"]["ranks_agree"]
    assert r.metrics["ddp"]["n_buckets"] > 1
    assert r.metrics["ddp"]["comm_bytes_per_step"] in (0, 4 * n)  # torch DDP's reducer: uncounted


@pytest.mark.slow
@pytest.mark.more
def test_the_command_line_takes_a_model_from_a_file(tmp_path):
    (tmp_path / "mine.py").write_text(CELL)
    out = subprocess.run(
        [sys.executable, "-m", "ddplab", "compare", "--world-size", "2", "--strategies",
         "none,bucketed", "--steps", "1", "--model", f"{tmp_path}/mine.py:make_model",
         "--batch", f"{tmp_path}/mine.py:make_batch", "--loss", f"{tmp_path}/mine.py:mse",
         "--json", str(tmp_path / "m.json")], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["config"]["model"].endswith("make_model")
    assert m["strategies"]["bucketed"]["comm_bytes_per_step"] == 4 * (12 * 40 + 40 + 40 * 40 + 40 + 41)
    bad = subprocess.run([sys.executable, "-m", "ddplab", "compare", "--model",
                          f"{tmp_path}/mine.py:make_model"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "your own batch function" in bad.stderr


@pytest.mark.slow
def test_the_panel_runs_a_cell_model(cluster):
    from ddplab.widgets.panel import ControlPanel

    make_model, make_batch, mse = cell()
    panel = ControlPanel(cluster=cluster, strategies=("bucketed",), model=make_model,
                         batch=make_batch, loss=mse, steps=1, link=None, world_size=2)
    spec = panel.spec()
    assert spec.model is make_model and spec.batch is make_batch and spec.loss is mse
    assert panel.controls["n_params"].disabled
    panel.run()
    assert panel.last_error is None, panel.last_error
    assert panel.result["metrics"]["bucketed"]["comm_bytes_per_step"] == 4 * _params(make_model)
