"""Your model in a comparison: model, batch and loss callables, checked before any rank starts.

Teaches: DDP does not care what the model is; it needs a module with trainable
parameters whose forward produces a scalar loss on each rank's own batch. A
comparison therefore takes three plain functions:

    model()                       -> torch.nn.Module (built on the CPU; ranks move it)
    batch(batch_size, rank, step) -> (inputs, target), this rank's own batch
    loss(output, target)          -> a 0-dim tensor (default: cross-entropy; 3-D logits
                                     of a language model are flattened to tokens)

They travel to the ranks by value (cloudpickle), like strategies registered in
a notebook cell. ``check`` builds the model and runs one forward and loss in the
kernel, on the CPU for models up to ``CPU_CHECK_PARAMS`` parameters and on the
meta device (shapes only, no memory) above, never on a GPU: the kernel may share
that GPU with rank 0. Every rank seeds torch with the run's seed before calling
``model()``, so all ranks start from the same weights.

Leaves out: data loaders and samplers (a batch function stands for them),
models that need arguments (wrap them: ``lambda: Net(width=512)``).
"""
from __future__ import annotations

import functools
import inspect

CPU_CHECK_PARAMS = 50_000_000  # above this the check runs on the meta device


def describe(fn) -> str | None:
    """A JSON-ready name for a callable (None stays None, a built-in name stays itself)."""
    if fn is None or isinstance(fn, str):
        return fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def default_loss(output, target):
    """Cross-entropy; (batch, tokens, vocab) logits are flattened to (batch*tokens, vocab)."""
    import torch.nn.functional as F

    if output.dim() == 3:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())
    return F.cross_entropy(output, target)


def load_callable(where_name: str, what: str = "model"):
    """``"path/to/file.py:make_model"`` or ``"package.module:make_model"`` -> the callable.

    A file's module is registered to pickle by value, so ranks that cannot import it get it.
    """
    where, _, attr = where_name.rpartition(":")
    if not where or not attr:
        raise ValueError(f"--{what} takes a built-in name or FILE.py:NAME, got {where_name!r}")
    from ddplab.sync.registry import load_user_module

    module = load_user_module(where, f"--{what} {where_name!r}")
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{where_name!r}: {where} has no function {attr!r}")
    return obj


def _to(obj, device):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def build_model(model, seed: int, model_kwargs: dict):
    """The run's model on the CPU: a built-in name or the user's callable, seeded."""
    import torch

    from ddplab.measure import models

    if isinstance(model, str):
        return models.build(model, seed=seed, **model_kwargs)
    torch.manual_seed(seed)  # the same initial weights on every rank
    return model()


def make_batch(model, batch, batch_size: int, rank: int, step: int, device=None):
    """This rank's (inputs, target) for ``step``, moved to ``device``."""
    from ddplab.measure import models

    if batch is None:
        got = models.batch(model if isinstance(model, str) else "mlp", batch_size, rank, step)
    else:
        got = batch(batch_size, rank, step)
    return got if device is None else _to(got, device)


def _fail(what, why):
    raise ValueError(f"{what}: {why}")


@functools.lru_cache(maxsize=16)
def check(model, batch, loss, batch_size: int, seed: int = 0, model_kwargs: tuple = ()) -> dict:
    """Build the model and run one forward and loss in this process; raise ValueError saying
    what is wrong. Returns {"parameters", "tensors", "device"} of the check."""
    import torch
    from torch import nn

    if isinstance(model, nn.Module):
        _fail("model=", f"got a {type(model).__name__} instance: pass the function that builds "
              "it (model=make_model, not make_model()), so every rank builds its own copy")
    if isinstance(model, str):
        pass  # a built-in model (its name was checked by RunSpec), maybe with the user's batch
    elif not callable(model):
        _fail("model=", f"give a built-in name or a function that returns a torch.nn.Module, "
              f"not {type(model).__name__}")
    elif batch is None:
        _fail("batch=", "your own model needs your own batch function: "
              "batch(batch_size, rank, step) -> (inputs, target)")
    for name, fn, args in (("batch", batch, 3), ("loss", loss, 2)):
        if fn is None:
            continue
        if not callable(fn):
            _fail(f"{name}=", f"give a function, not {type(fn).__name__}")
        try:
            inspect.signature(fn).bind(*range(args))
        except TypeError:
            sig = "batch(batch_size, rank, step)" if name == "batch" else "loss(output, target)"
            _fail(f"{name}=", f"{describe(fn)} must take {args} arguments: {sig}")
        except ValueError:
            pass  # a builtin without a signature: tried for real below
    kwargs = dict(model_kwargs)
    with torch.device("meta"):
        try:
            shape_only = build_model(model, seed, kwargs)
        except Exception as e:  # noqa: BLE001 - the user's code: report, do not crash the kernel
            _fail("model()", f"raised {type(e).__name__}: {e}")
    if not isinstance(shape_only, nn.Module):
        _fail("model()", f"must return a torch.nn.Module, got {type(shape_only).__name__} "
              "(pass the function, e.g. model=make_model, not make_model())")
    trainable = [p for p in shape_only.parameters() if p.requires_grad]
    if not trainable:
        _fail("model()", "has no trainable parameters (requires_grad=True): DDP would have "
              "nothing to all-reduce")
    n = sum(p.numel() for p in trainable)
    device = torch.device("cpu") if n <= CPU_CHECK_PARAMS else torch.device("meta")
    net = build_model(model, seed, kwargs) if device.type == "cpu" else shape_only
    try:
        got = make_batch(model, batch, min(batch_size, 2), 0, 0)
    except Exception as e:  # noqa: BLE001
        _fail("batch(batch_size, rank, step)", f"raised {type(e).__name__}: {e}")
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        _fail("batch(batch_size, rank, step)", f"must return (inputs, target), got "
              f"{type(got).__name__}" + (f" of length {len(got)}" if hasattr(got, '__len__') else ""))
    x, y = _to(got, device)
    try:
        out = net(x)
    except Exception as e:  # noqa: BLE001
        _fail("the batch does not fit the model", f"model(inputs) raised {type(e).__name__}: {e}")
    try:
        value = (loss or default_loss)(out, y)
    except Exception as e:  # noqa: BLE001
        _fail("loss(output, target)", f"raised {type(e).__name__}: {e}")
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        _fail("loss(output, target)", f"must return a scalar (0-dim) tensor, got {shape}; "
              "reduce it, e.g. .mean()")
    if not value.requires_grad:
        _fail("loss(output, target)", "does not depend on the model's parameters "
              "(requires_grad is False): backward would produce no gradients")
    return {"parameters": n, "tensors": len(trainable), "device": device.type}
