"""A Lightning job on 2 CPU ranks whose only gradcomp line is the callback.

    python lightning_job.py OUT_DIR first CODEC...    # 4 epochs straight; 2 epochs with ModelCheckpoint
    python lightning_job.py OUT_DIR resume CODEC...   # from OUT_DIR/CODEC-ckpt/last.ckpt to epoch 4
    python lightning_job.py OUT_DIR mismatch CODEC    # resume CODEC's checkpoint under another codec

Lightning starts rank 1 itself by running this script again. Rank 0 writes the final weights to
OUT_DIR/CODEC-{straight,half,resumed}.pt.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import gradcomp.lightning
from common import (BATCH, CODECS, EPOCHS, STEPS_PER_EPOCH, end_process_group, make_dataset, make_network,
                    make_optimizer, save_weights)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_network()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer, schedule = make_optimizer(self.parameters(), EPOCHS * STEPS_PER_EPOCH)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):  # Lightning puts a DistributedSampler under it and sets its epoch, also on resume
        return torch.utils.data.DataLoader(make_dataset(), batch_size=BATCH, shuffle=True)


def fit(out_dir: str, codec: str, name: str, epochs: int, spec: str, ckpt_path: str | None = None) -> None:
    L.seed_everything(0, verbose=False)
    model = Classifier()
    checkpoints = [ModelCheckpoint(dirpath=os.path.join(out_dir, f"{codec}-ckpt"), save_last=True)] if name == "half" \
        else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, log_every_n_steps=4,
                        callbacks=[gradcomp.lightning.GradcompCallback(spec), *checkpoints],
                        enable_checkpointing=bool(checkpoints),
                        logger=CSVLogger(out_dir, name=f"{codec}-{name}"), enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        save_weights(model, out_dir, f"{codec}-{name}")


def main() -> None:
    out_dir, phase, codecs = sys.argv[1], sys.argv[2], sys.argv[3:]
    for codec in codecs:
        last = os.path.join(out_dir, f"{codec}-ckpt", "last.ckpt")
        if phase == "first":
            fit(out_dir, codec, "straight", EPOCHS, CODECS[codec])
            fit(out_dir, codec, "half", EPOCHS // 2, CODECS[codec])
        elif phase == "resume":
            fit(out_dir, codec, "resumed", EPOCHS, CODECS[codec], ckpt_path=last)
        elif phase == "mismatch":
            other = next(spec for name, spec in CODECS.items() if name != codec)
            fit(out_dir, codec, "mismatch", EPOCHS, other, ckpt_path=last)
    end_process_group()  # Lightning leaves its group to the interpreter's exit, where gloo's threads can abort it


if __name__ == "__main__":
    main()
