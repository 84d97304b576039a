"""From what you train with to the DDP wrapper that ``ddplab.record`` times.

Teaches: every trainer that runs torch DDP keeps one
``torch.nn.parallel.DistributedDataParallel`` object, and that object (not your
model, not the trainer) is what runs the all-reduces. Where each keeps it:

- PyTorch Lightning: ``trainer.strategy.model``, set while ``fit`` starts
  (a ``Callback.on_train_start`` sees it; a LightningModule reaches it
  through its ``trainer``);
- accelerate: the object ``accelerator.prepare(model)`` returns (the
  Accelerator itself keeps only the model it was given);
- the Hugging Face Trainer: ``trainer.model_wrapped``, once ``train()`` has
  wrapped the model (a ``TrainerCallback.on_train_begin`` sees it; the
  callback's own ``model=`` is the unwrapped model).

``record(x, ...)`` takes any of these (an Accelerator gets a sentence naming
prepare()'s model). A Lightning or Hugging Face Trainer handed over before
training adds a small callback that starts the recording when training starts
and finishes it when training ends (on every rank), and returns a handle that
becomes the recorder then. Nothing here imports a
trainer you did not hand over.

A module torch's ``fully_shard`` (FSDP2) was applied to has no DDP wrapper and
no buckets: it is handed to ddplab.measure.recording_fsdp, which records its
all-gathers and reduce-scatters per unit.

Leaves out: DeepSpeed and Lightning's or accelerate's FSDP strategies (not DDP,
and their models are not handed over here).
References: lightning/pytorch/strategies/ddp.py (DDPStrategy.model),
accelerate/accelerator.py (prepare_model), transformers/trainer.py
(model_wrapped), transformers/trainer_callback.py (CallbackHandler).
"""
from __future__ import annotations

WHAT_TO_PASS = ("pass the DistributedDataParallel object that wraps your model: the object "
                "DistributedDataParallel(...) or accelerator.prepare(model) returned, a Lightning Trainer "
                "(trainer.strategy.model) or a Hugging Face Trainer (trainer.model_wrapped); or the "
                "module torch's fully_shard(...) was applied to last (the root)")


def _fully_sharded(x) -> bool:
    """Whether ``x`` is a module torch's ``fully_shard`` was applied to (FSDP2's FSDPModule)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch
        return False
    return isinstance(x, FSDPModule)


TRAINER_NAMES = {"lightning_trainer": "Lightning", "lightning_module": "Lightning",
                 "hf_trainer": "Hugging Face Trainer"}


def _prepared_by_accelerate(ddp_model) -> bool:
    # accelerate.prepare() marks the model it wraps (accelerate/accelerator.py, prepare_model)
    module = getattr(ddp_model, "module", None)
    return bool(getattr(module, "_is_accelerate_prepared", False) or getattr(ddp_model, "_is_accelerate_prepared",
                                                                             False))


def _family(x) -> str | None:
    """Which trainer's object ``x`` is, from its classes' names (no trainer imported)."""
    for cls in type(x).__mro__:
        top = cls.__module__.split(".")[0]
        if top in ("lightning", "pytorch_lightning"):
            if cls.__name__ == "Trainer":
                return "lightning_trainer"
            if cls.__name__ == "LightningModule":
                return "lightning_module"
        if top == "accelerate" and cls.__name__ == "Accelerator":
            return "accelerator"
        if top == "transformers" and cls.__name__ == "Trainer":
            return "hf_trainer"
    return None


def find_wrapper(x):
    """The DDP wrapper ``x`` holds, None for a trainer that has not wrapped your model yet
    (record() then waits for training to start), or a TypeError saying what to pass."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(x, DistributedDataParallel):
        return x
    if _fully_sharded(x):  # its all-gathers and reduce-scatters: ddplab.measure.recording_fsdp
        return x
    family = _family(x)
    if family == "lightning_trainer":
        inner = getattr(getattr(x, "strategy", None), "model", None)
        return None if inner is None else _checked(inner, "trainer.strategy.model")
    if family == "lightning_module":
        trainer = getattr(x, "_trainer", None)
        if trainer is None:
            raise TypeError("this LightningModule is not attached to a Trainer yet: pass the Trainer "
                            "before trainer.fit(...) (ddplab.record(trainer, ...)) instead")
        found = find_wrapper(trainer)
        if found is None:
            raise TypeError("this LightningModule's Trainer has not wrapped it in DDP yet: pass the "
                            "Trainer before trainer.fit(...) instead")
        return found
    if family == "accelerator":
        # accelerate 1.15 keeps the model it was given in _models, not the DDP it wraps it in
        # (accelerator.py, prepare_model: only FSDP replaces the entry)
        raise TypeError("an Accelerator does not keep the DistributedDataParallel it made: pass the "
                        "model accelerator.prepare(model) returned (with 2 or more processes)")
    if family == "hf_trainer":
        inner = getattr(x, "model_wrapped", None)
        return inner if isinstance(inner, DistributedDataParallel) else None
    if isinstance(x, torch.nn.Module) and any(_fully_sharded(m) for m in x.modules()):
        # several roots: their parameters outside any unit are not sharded, and no one root
        # runs all the collectives; one fully_shard on the whole model makes it the root
        sharded = [name for name, m in x.named_modules() if _fully_sharded(m)]
        raise TypeError(f"ddplab.record got a {type(x).__name__} that is not fully_shard-ed itself, while "
                        f"{len(sharded)} of its submodules are ({', '.join(sharded[:4])}): call "
                        f"fully_shard on the {type(x).__name__} too, after them (it becomes the root), "
                        "and pass it")
    if isinstance(x, torch.nn.Module):
        raise TypeError(f"ddplab.record got a {type(x).__name__}, not the DistributedDataParallel "
                        f"wrapping it: {WHAT_TO_PASS}")
    raise TypeError(f"ddplab.record cannot find a DDP model in a {type(x).__name__}: {WHAT_TO_PASS}")


def _checked(inner, where: str):
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(inner, DistributedDataParallel):
        raise TypeError(f"{where} is a {type(inner).__name__}, not DistributedDataParallel: record "
                        "needs the DDP strategy (strategy='ddp') with 2 or more processes")
    return inner


class Pending:
    """What ``record(trainer, ...)`` returns before training: the recorder once training starts
    (``.recorder``); ``finish()``, ``wait()`` and ``timeline`` pass through to it."""

    def __init__(self, attach):
        self.recorder = None
        self._attach = attach

    def start(self, ddp_model) -> None:
        if self.recorder is None:
            self.recorder = self._attach(ddp_model)

    def end(self) -> None:
        """Training ended (on every rank): finish if the last step asked for never came."""
        if self.recorder is not None and not self.recorder.finished:
            self.recorder.finish()

    def finish(self):
        return None if self.recorder is None else self.recorder.finish()

    def wait(self, timeout: float | None = None) -> dict:
        return {} if self.recorder is None else self.recorder.wait(timeout)

    @property
    def timeline(self):
        return None if self.recorder is None else self.recorder.timeline


def lightning_callback(pending: Pending):
    """A Lightning ``Callback`` that starts ``pending`` at ``on_train_start`` (where
    ``trainer.strategy.model`` is the DDP wrapper) and ends it at ``on_train_end``."""
    import sys

    if "lightning" in sys.modules or "pytorch_lightning" not in sys.modules:
        from lightning.pytorch.callbacks import Callback
    else:  # the standalone package: its Trainer accepts only its own Callback class
        from pytorch_lightning.callbacks import Callback

    class RecordCallback(Callback):
        def on_train_start(self, trainer, pl_module):
            pending.start(_checked(trainer.strategy.model, "trainer.strategy.model"))

        def on_train_end(self, trainer, pl_module):
            pending.end()

    return RecordCallback()


def hf_callback(trainer, pending: Pending):
    """A Hugging Face ``TrainerCallback`` that starts ``pending`` at ``on_train_begin`` with
    ``trainer.model_wrapped`` (its own ``model=`` is unwrapped) and ends it at ``on_train_end``."""
    from transformers import TrainerCallback

    class RecordCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            pending.start(_checked(trainer.model_wrapped, "trainer.model_wrapped"))

        def on_train_end(self, args, state, control, **kwargs):
            pending.end()

    return RecordCallback()


def record(x, steps, out, process_group, write_page):
    """``ddplab.record``: the recorder on the wrapper ``x`` holds, or a Pending one that a
    trainer's callback starts when training starts."""
    from ddplab.measure.recording import record as attach

    found = find_wrapper(x)
    if _fully_sharded(found):
        from ddplab.measure.recording_fsdp import record as attach_fsdp

        return attach_fsdp(found, steps, out, process_group, write_page)
    family = _family(x)
    trainer = TRAINER_NAMES.get(family, "accelerate" if _prepared_by_accelerate(found) else "torch DDP")
    if found is not None:
        return attach(found, steps, out, process_group, write_page, trainer)
    pending = Pending(lambda ddp: attach(ddp, steps, out, process_group, write_page, trainer))
    if family == "lightning_trainer":
        x.callbacks.append(lightning_callback(pending))
    elif family == "hf_trainer":
        x.add_callback(hf_callback(x, pending))
    return pending
