"""An Accelerate job on 2 CPU ranks (torchrun --nproc-per-node 2 accelerate_job.py ...).

    accelerate_job.py OUT_DIR first CODEC...    # 4 epochs straight; 2 epochs, then save_state
    accelerate_job.py OUT_DIR resume CODEC...   # load_state, then epochs 3 and 4

The main process writes the final weights to OUT_DIR/CODEC-{straight,half,resumed}.pt.
"""

from __future__ import annotations

import os
import sys

from accelerate import Accelerator
from accelerate.utils import set_seed

import gradcomp.accelerate
from common import (CODECS, EPOCHS, STEPS_PER_EPOCH, end_process_group, make_network, make_optimizer, save_weights,
                    train_epochs)


def train(out_dir: str, codec: str, name: str, epochs: int, resume: bool = False) -> None:
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = make_network()
    optimizer, schedule = make_optimizer(model.parameters(), EPOCHS * STEPS_PER_EPOCH)
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    gradcomp.accelerate.register(accelerator, model, CODECS[codec])
    checkpoint = os.path.join(out_dir, f"{codec}-state")
    first_epoch = 0
    if resume:
        accelerator.load_state(checkpoint)
        first_epoch = EPOCHS // 2
    train_epochs(model, optimizer, schedule, accelerator.backward, accelerator.num_processes,
                 accelerator.process_index, first_epoch, epochs)
    if name == "half":
        accelerator.save_state(checkpoint)
    if accelerator.is_main_process:
        save_weights(accelerator.unwrap_model(model), out_dir, f"{codec}-{name}")
    accelerator.wait_for_everyone()


def main() -> None:
    out_dir, phase, codecs = sys.argv[1], sys.argv[2], sys.argv[3:]
    for codec in codecs:
        if phase == "first":
            train(out_dir, codec, "straight", EPOCHS)
            train(out_dir, codec, "half", EPOCHS // 2)
        else:
            train(out_dir, codec, "resumed", EPOCHS, resume=True)
    end_process_group()


if __name__ == "__main__":
    main()
