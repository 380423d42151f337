"""A Lightning Fabric job on 2 CPU ranks: gradcomp.register on the module fabric.setup returns, and
gradcomp.every_rank(state) in fabric.save / fabric.load.

    fabric_job.py OUT_DIR first CODEC...    # 4 epochs straight; 2 epochs, then fabric.save
    fabric_job.py OUT_DIR resume CODEC...   # fabric.load, then epochs 3 and 4

Fabric starts rank 1 itself. Rank 0 writes the final weights to OUT_DIR/CODEC-{straight,half,resumed}.pt.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F

import gradcomp
from common import BATCH, CODECS, SAMPLES, make_dataset, make_network, make_optimizer, save_weights

EPOCHS = 4
STEPS_PER_EPOCH = SAMPLES // 2 // BATCH


def train(fabric: L.Fabric, out_dir: str, codec: str, name: str, epochs: int, resume: bool = False) -> None:
    model = make_network()
    optimizer, schedule = make_optimizer(model.parameters(), EPOCHS * STEPS_PER_EPOCH)
    model, optimizer = fabric.setup(model, optimizer)
    # A sampler of our own: Fabric's loader would set the sampler's epoch by counting its iterations from 0,
    # so a resumed run would replay the first epochs' order.
    sampler = torch.utils.data.DistributedSampler(make_dataset(), fabric.world_size, fabric.global_rank, seed=0)
    loader = torch.utils.data.DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)
    state = gradcomp.register(model, CODECS[codec])
    checkpoint = {"model": model, "optimizer": optimizer, "schedule": schedule, "gradcomp": gradcomp.every_rank(state),
                  "epoch": 0}
    path = os.path.join(out_dir, f"{codec}-fabric.ckpt")
    if resume:
        fabric.load(path, checkpoint)
    for epoch in range(checkpoint["epoch"], epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            schedule.step()
        checkpoint["epoch"] = epoch + 1
    if name == "half":
        fabric.save(path, checkpoint)
    if fabric.global_rank == 0:
        save_weights(model.module, out_dir, f"{codec}-{name}")
    fabric.barrier()


def main() -> None:
    out_dir, phase, codecs = sys.argv[1], sys.argv[2], sys.argv[3:]
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    for codec in codecs:
        fabric.seed_everything(0, verbose=False)
        if phase == "first":
            train(fabric, out_dir, codec, "straight", EPOCHS)
            fabric.seed_everything(0, verbose=False)
            train(fabric, out_dir, codec, "half", EPOCHS // 2)
        else:
            train(fabric, out_dir, codec, "resumed", EPOCHS, resume=True)


if __name__ == "__main__":
    main()
