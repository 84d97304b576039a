"""One small model trained four ways, each with the ONE ddplab line docs/recording.md gives.

    torchrun --standalone --nproc-per-node=2 tests/_trainer_script.py TRAINER OUT

TRAINER: ``torch`` (a plain loop: 2 accumulation micro-steps per optimizer step and a
validation forward after every step), ``lightning`` (accumulation of 2, validation every 2 batches),
``accelerate`` (with its fp16 comm hook, registered inside ``prepare()``) and ``hf`` (2
accumulation micro-steps each). Every run trains 6 optimizer
steps and records steps 1-4 (``steps=range(1, 5)``). Run by tests/measure/test_record_trainers.py.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddplab
from ddplab.integrations import find_wrapper

TRAINER, OUT = sys.argv[1], sys.argv[2]
CAP_MB = 0.1  # two buckets once torch has rebuilt them (one before)
STEPS, RECORD = 6, range(1, 5)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(64, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)

    def forward(self, x, labels=None):
        y = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        return y if labels is None else {"loss": F.mse_loss(y, labels), "logits": y}


def data(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, 8, generator=g))


def plain_torch():
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=CAP_MB)
    rec = ddplab.record(ddp, steps=RECORD, out=OUT)  # <- the one line
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = data().tensors
    for _ in range(STEPS):
        for micro in range(2):  # gradient accumulation: the first micro-step does not synchronize
            xs, ys = x[8 * micro:8 * micro + 8] + dist.get_rank(), y[8 * micro:8 * micro + 8]
            if micro == 0:
                with ddp.no_sync():
                    F.mse_loss(ddp(xs), ys).backward()
            else:
                F.mse_loss(ddp(xs), ys).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # validation: a forward through DDP, no backward
            ddp(x[:8])
    rec.wait()
    dist.destroy_process_group()


def lightning():
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, batch, i):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, i):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_train_start(self):  # during training, the module leads to the same wrapper
            assert find_wrapper(self) is self.trainer.strategy.model

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(data(), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo",
                                                                            bucket_cap_mb=CAP_MB),
                         max_steps=STEPS, accumulate_grad_batches=2, val_check_interval=2, limit_val_batches=2,
                         num_sanity_val_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    rec = ddplab.record(trainer, steps=RECORD, out=OUT)  # <- the one line
    trainer.fit(Module(), loader, loader)
    rec.wait()


def accelerate():
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import DDPCommunicationHookType

    # a comm hook registered inside prepare() (torch's fp16_compress_hook): measured all the same
    ddp_kwargs = DistributedDataParallelKwargs(bucket_cap_mb=CAP_MB, comm_hook=DDPCommunicationHookType.FP16)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=[ddp_kwargs])
    torch.manual_seed(0)
    net = Net()
    model, opt, loader = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01),
                                             torch.utils.data.DataLoader(data(256), batch_size=4))
    rec = ddplab.record(model, steps=RECORD, out=OUT)  # <- the one line
    try:  # the Accelerator keeps the unwrapped model only: it says what to pass instead
        find_wrapper(accelerator)
        raise AssertionError("find_wrapper(accelerator) did not refuse")
    except TypeError as e:
        assert "pass the model accelerator.prepare(model) returned" in str(e), e
    for i, (x, y) in enumerate(loader):
        if i == 2 * STEPS:
            break
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    rec.wait()
    accelerator.end_training()


def hf():
    from transformers import Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y = data().tensors

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    args = TrainingArguments(output_dir=OUT + ".hf", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=STEPS, use_cpu=True, ddp_backend="gloo", ddp_bucket_cap_mb=CAP_MB,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, learning_rate=0.01)
    torch.manual_seed(0)
    trainer = Trainer(model=Net(), args=args, train_dataset=Rows())
    rec = ddplab.record(trainer, steps=RECORD, out=OUT)  # <- the one line
    trainer.train()
    rec.wait()
    assert find_wrapper(trainer) is trainer.model_wrapped is rec.recorder.ddp


{"torch": plain_torch, "lightning": lightning, "accelerate": accelerate, "hf": hf}[TRAINER]()
