"""A Hugging Face Trainer job on 2 CPU ranks (torchrun --nproc-per-node 2 trainer_job.py ...): a tiny GPT-2 built
from a config, on random tokens, with gradcomp.transformers.register.

    trainer_job.py OUT_DIR first CODEC...      # STEPS straight; the same run stopped after STEPS // 2
    trainer_job.py OUT_DIR resume CODEC...     # the stopped run's last checkpoint, resumed to STEPS
    trainer_job.py OUT_DIR refusals CODEC      # resumes it (resume_from_checkpoint=True) under another codec:
                                               # refused; then, its gradcomp files deleted, refused again unless
                                               # missing_state="fresh"
    trainer_job.py OUT_DIR elsewhere CODEC     # (on 3 ranks) resumes it on another number of ranks: refused,
                                               # unless elastic=True
    trainer_job.py OUT_DIR single CODEC        # one process: register's refusal

Each refusal is written as "refused: MESSAGE" (every rank raises it) to the rank's OUT_DIR/refusals-PHASE-rankN.txt,
and printed; the job goes on with the next case.

Checkpoints every SAVE_EVERY steps with save_total_limit=2, so that Trainer rotates folders away under
gradcomp's files. The main process writes the final weights to OUT_DIR/CODEC-{straight,half,resumed}.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import transformers

import gradcomp.transformers
from common import end_process_group, save_weights

CODECS = {"topk": "topk:ratio=0.05", "powersgd": "powersgd:rank=2", "signsgd": "signsgd", "qsgd": "qsgd:levels=7"}
OTHER = {"topk": "signsgd"}  # the codec the mismatch phase resumes CODEC's checkpoint under
STEPS, SAVE_EVERY, SEQUENCE, VOCAB = 12, 3, 16, 64


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 96):
        self.tokens = torch.randint(0, VOCAB, (count, SEQUENCE), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class StopAt(transformers.TrainerCallback):
    """Ends training after `step` steps, as a crash after that step's checkpoint would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def make_trainer(out_dir: str, codec: str, name: str, accumulate: int):
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, f"{codec}-{name}"), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate, learning_rate=3e-3, save_strategy="steps", save_steps=SAVE_EVERY,
        save_total_limit=2, logging_steps=SAVE_EVERY, report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=RandomTokens())


def run(out_dir: str, codec: str, name: str, spec: str | None = None, stop_at: int | None = None,
        resume=None, **options) -> None:
    """resume: True (Trainer's last checkpoint in the output folder: the stopped run's own) or a checkpoint folder
    (then the run writes its checkpoints to a folder of its own)."""
    accumulate = 2 if codec == "topk" else 1  # Trainer's gradient accumulation: no_sync micro-steps between
    trainer = make_trainer(out_dir, codec, "half" if resume is True else name, accumulate)
    callback = gradcomp.transformers.register(trainer, spec or CODECS[codec], **options)
    if stop_at is not None:
        trainer.add_callback(StopAt(stop_at))
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        save_weights(trainer.model, out_dir, f"{codec}-{name}")
        print(f"{codec}-{name}: {callback.state.stats()['total']['ratio']:.1f}x", flush=True)


def refused(case, out_dir: str, phase: str) -> None:
    """Runs case; its outcome goes to this rank's own file, OUT_DIR/refusals-PHASE-rankN.txt, a line per case, and is
    printed too. The test reads the files: the ranks' prints share one pipe, and one CI run found a rank's line
    missing from it though every rank had exited cleanly."""
    try:
        case()
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        outcome = f"refused: {error}"
    else:
        outcome = "not refused"
    with open(os.path.join(out_dir, f"refusals-{phase}-rank{os.environ.get('RANK', '0')}.txt"), "a") as f:
        f.write(outcome.replace("\n", " ") + "\n")
    print(outcome, flush=True)


def main() -> None:
    out_dir, phase, codecs = sys.argv[1], sys.argv[2], sys.argv[3:]
    for codec in codecs:
        stopped = os.path.join(out_dir, f"{codec}-half", f"checkpoint-{STEPS // 2}")
        if phase == "first":
            run(out_dir, codec, "straight")
            run(out_dir, codec, "half", stop_at=STEPS // 2)
        elif phase == "resume":
            run(out_dir, codec, "resumed", resume=stopped)
        elif phase == "refusals":
            refused(lambda: run(out_dir, codec, "mismatch", spec=OTHER[codec], resume=True), out_dir, phase)
            torch.distributed.barrier()
            if torch.distributed.get_rank() == 0:
                for name in os.listdir(stopped):
                    if name.startswith("gradcomp_state_rank"):
                        os.remove(os.path.join(stopped, name))
            torch.distributed.barrier()
            refused(lambda: run(out_dir, codec, "missing", resume=stopped), out_dir, phase)
            run(out_dir, codec, "fresh", resume=stopped, missing_state="fresh")
        elif phase == "elsewhere":  # on another number of ranks: refused, unless elastic
            refused(lambda: run(out_dir, codec, "other_world", resume=stopped), out_dir, phase)
            run(out_dir, codec, "elastic", resume=stopped, elastic=True)
        elif phase == "single":
            run(out_dir, codec, "single")
    end_process_group()


if __name__ == "__main__":
    main()
