"""What the framework jobs share: a small classifier, its synthetic data, the codecs under test, how a
job writes the weights it ends with (compared bit for bit by test_frameworks.py), and how it ends."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

CODECS = {"topk": "topk:ratio=0.05", "powersgd": "powersgd:rank=2", "qsgd": "qsgd:levels=7"}
SAMPLES, FEATURES, CLASSES, BATCH = 256, 32, 10, 16  # per rank: 128 samples, 16 steps per epoch at 2 ranks
LR = 0.1
EPOCHS = 4  # a straight run; the interrupted one stops after EPOCHS // 2 and resumes
STEPS_PER_EPOCH = SAMPLES // 2 // BATCH  # the jobs run on 2 ranks


def make_dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def make_network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def make_optimizer(params, total_steps: int):
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)


def save_weights(module: nn.Module, out_dir: str, name: str) -> None:
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, os.path.join(out_dir, f"{name}.pt"))


def train_epochs(model, optimizer, schedule, backward, world: int, rank: int, first_epoch: int, epochs: int) -> None:
    """The training loop of the Fabric and Accelerate jobs; backward is the framework's (fabric.backward,
    accelerator.backward). The data go through a DistributedSampler of our own, keyed by the epoch alone: Fabric's
    loader would number its sampler's epochs by counting iterations from 0 in each process, and Accelerate's
    prepared loader draws its order from RNG state, so a resumed run would not see the uninterrupted run's data."""
    sampler = torch.utils.data.DistributedSampler(make_dataset(), world, rank, seed=0)
    loader = torch.utils.data.DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            backward(loss)
            optimizer.step()
            schedule.step()


def end_process_group() -> None:
    """Destroys the process group while the interpreter is whole, once the objects holding it are collected: torn
    down with the interpreter, gloo's worker threads can abort the exit ("terminate called without an active
    exception", an upstream torch issue; see examples/train_ddp.py's end_process_group)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
