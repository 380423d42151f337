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

import gradcomp
from common import (CODECS, EPOCHS, STEPS_PER_EPOCH, end_process_group, make_network, make_optimizer, save_weights,
                    train_epochs)


def train(fabric: L.Fabric, out_dir: str, codec: str, name: str, epochs: int, resume: bool = False) -> None:
    model = make_network()
    optimizer, schedule = make_optimizer(model.parameters(), EPOCHS * STEPS_PER_EPOCH)
    model, optimizer = fabric.setup(model, optimizer)
    state = gradcomp.register(model, CODECS[codec])
    checkpoint = {"model": model, "optimizer": optimizer, "schedule": schedule, "gradcomp": gradcomp.every_rank(state),
                  "epoch": 0}
    path = os.path.join(out_dir, f"{codec}-fabric.ckpt")
    if resume:
        fabric.load(path, checkpoint)
    train_epochs(model, optimizer, schedule, fabric.backward, fabric.world_size, fabric.global_rank,
                 checkpoint["epoch"], epochs)
    checkpoint["epoch"] = epochs
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
    end_process_group()


if __name__ == "__main__":
    main()
