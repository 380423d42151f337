"""gradcomp under Hugging Face Trainer: one line (`pip install transformers`).

    import gradcomp.transformers
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    gradcomp.transformers.register(trainer, "topk", ratio=0.01)
    trainer.train()                          # or trainer.train(resume_from_checkpoint=True)

Run under torchrun (2 or more processes: Trainer then wraps the model in DDP). register adds a
TrainerCallback that registers the hook on Trainer's DDP model when training begins, and rides
Trainer's own checkpoints: every rank writes its state into `checkpoint-N/` beside Trainer's per-rank
RNG files (so the folder must be reachable from every node, as Trainer's own resume needs), those
files go when `save_total_limit` rotates the folder away, and `resume_from_checkpoint` gives each
rank its own state back (a resumed run repeats the uninterrupted one bit for bit). The stats join
Trainer's logs as gradcomp_ratio and gradcomp_wire_MB.

Trainer's callbacks receive the unwrapped model, never the DDP one, nor the checkpoint a run resumes
from: so register takes the trainer, and notes the checkpoint that `trainer.train` is given.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import torch
import torch.distributed as dist

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as missing:
    raise ImportError("gradcomp.transformers needs Hugging Face transformers: pip install transformers") from missing

from torch.nn.parallel import DistributedDataParallel

from .checkpoint import EVERY_RANK_FORMAT, _to_cpu
from .registration import register as register_hook
from .state import CompressionState

STATE_FILE = "gradcomp_state_rank{rank}.pt"
STATE_FILE_NAME = re.compile(r"gradcomp_state_rank(\d+)\.pt")


def register(trainer, spec: "str | CompressionState" = "topk", *, missing_state: str = "error",
             **options: Any) -> "GradcompTrainerCallback":
    """Compresses trainer's DDP gradients with codec `spec` and keeps every rank's state in its checkpoints.

    spec, options: as gradcomp.register takes them (e.g. "topk", ratio=0.01, scheme="auto", start_iter=2).
    missing_state: what a resume does with a checkpoint that holds no gradcomp state (saved without this callback):
        "error" (the default) refuses it; "fresh" starts compression anew from it (empty residuals: what they held
        when it was saved is lost).
    A checkpoint saved on another number of ranks is refused unless elastic=True (an option of gradcomp.register:
    each new rank then takes the saved residuals' average).
    Returns the callback; its `.state` is the CompressionState (stats(), explain())."""
    if any(isinstance(c, GradcompTrainerCallback) for c in trainer.callback_handler.callbacks):
        raise RuntimeError("gradcomp.transformers.register: this Trainer has gradcomp's callback already; DDP takes "
                           "one communication hook per model")
    callback = GradcompTrainerCallback(trainer, spec, missing_state=missing_state, **options)
    # First in line, so that the printer and the loggers after it see the stats it adds to the logs.
    trainer.callback_handler.callbacks.insert(0, callback)
    train = trainer.train

    @functools.wraps(train)
    def train_noting_the_checkpoint(resume_from_checkpoint=None, *args, **kwargs):
        callback.resume_from = _checkpoint_of(trainer, resume_from_checkpoint)
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_noting_the_checkpoint
    return callback


def _checkpoint_of(trainer, resume_from_checkpoint) -> str | None:
    """The folder trainer.train(resume_from_checkpoint=...) resumes from, as Trainer resolves it."""
    if resume_from_checkpoint is True:
        if not os.path.isdir(trainer.args.output_dir):
            return None  # Trainer itself says there is no checkpoint to resume from
        return get_last_checkpoint(trainer.args.output_dir)
    if resume_from_checkpoint in (None, False):
        return None
    return os.fspath(resume_from_checkpoint)


class GradcompTrainerCallback(TrainerCallback):
    """What gradcomp.transformers.register adds to a Trainer (see the module's docstring)."""

    def __init__(self, trainer, spec: "str | CompressionState" = "topk", *, missing_state: str = "error",
                 **options: Any):
        if missing_state not in ("error", "fresh"):
            raise ValueError(f"gradcomp.transformers: missing_state={missing_state!r}; it takes 'error' (refuse a "
                             f"checkpoint without gradcomp's state) or 'fresh' (start compression anew from it)")
        if isinstance(spec, CompressionState) and options:
            raise ValueError(f"gradcomp.transformers: options ({', '.join(options)}) go with a spec, not with a "
                             f"CompressionState, which keeps its own")
        # Bad specs and options fail here, before training starts.
        self.state = spec if isinstance(spec, CompressionState) else CompressionState(spec, **options)
        self.trainer, self.missing_state, self.resume_from = trainer, missing_state, None

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            world = dist.get_world_size() if dist.is_initialized() else 1
            raise ValueError(f"gradcomp.transformers compresses what DDP's ranks exchange, and this Trainer's model is "
                             f"a {type(model).__name__} on {world} process(es) (parallel mode "
                             f"{args.parallel_mode.value}); launch 2 or more with torchrun --nproc-per-node N (FSDP "
                             f"and DeepSpeed do not exchange gradients through DDP's communication hooks)")
        if getattr(model, "_gradcomp_state", None) is not self.state:  # each train() may wrap the model anew
            register_hook(model, self.state)
        if self.resume_from is not None:
            self._load(self.resume_from)

    def on_save(self, args, state, control, **kwargs):
        # Trainer's folder for this step. Made here too: under save_only_model the other ranks write nothing
        # there, and nothing makes them wait for the rank that does.
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE.format(rank=dist.get_rank()))
        torch.save(_to_cpu(self.state.state_dict()), path + ".tmp")
        os.replace(path + ".tmp", path)  # a file is there whole or not at all

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.state.iter > 0:
            total = self.state.stats()["total"]
            logs["gradcomp_ratio"] = round(float(total["ratio"]), 2)
            logs["gradcomp_wire_MB"] = round(total["wire_bytes"] / 1e6, 3)

    def _load(self, folder: str) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        saved = sorted(int(m.group(1)) for m in map(STATE_FILE_NAME.fullmatch, os.listdir(folder)) if m)
        if not saved:
            if self.missing_state == "fresh":
                return
            raise FileNotFoundError(f"gradcomp.transformers: {folder} holds no gradcomp state (saved without "
                                    f"gradcomp's callback?); resuming would start compression with empty residuals. "
                                    f"To do so knowingly, register with missing_state='fresh'")
        if saved == list(range(world)):
            self.state.load_state_dict(self._read(folder, rank))
            return
        if saved != list(range(len(saved))):
            raise ValueError(f"gradcomp.transformers: {folder} holds gradcomp's state of ranks {saved}: some are missing")
        # Saved on another number of ranks: every rank's state, which the state spreads (elastic=True) or refuses.
        self.state.load_state_dict({"format": EVERY_RANK_FORMAT, "gradcomp_every_rank": True, "world_size": len(saved),
                                    "ranks": [self._read(folder, r) for r in saved]})

    @staticmethod
    def _read(folder: str, rank: int) -> dict:
        return torch.load(os.path.join(folder, STATE_FILE.format(rank=rank)), map_location="cpu", weights_only=True)
