"""gradcomp under PyTorch Lightning: one callback (`pip install lightning`).

    import gradcomp.lightning
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                                callbacks=[gradcomp.lightning.GradcompCallback("topk", ratio=0.01)])
    trainer.fit(model)                       # resume: trainer.fit(model, ckpt_path=...)

The callback registers the hook once the DDP strategy has wrapped the model (on CPU and GPU alike:
Lightning's own `ddp_comm_hook=` is applied on CUDA only), rides Lightning's checkpoints with every
rank's state (ModelCheckpoint and `trainer.save_checkpoint` write rank 0's file only; each rank loads
its own entry on `ckpt_path=` resume), and logs the bytes on the wire through the LightningModule's
logger every `trainer.log_every_n_steps` steps.

Fabric needs no callback: `gradcomp.register(fabric_module, spec)` takes the module `fabric.setup`
returns, and `gradcomp.every_rank(state)` goes into `fabric.save` / `fabric.load`.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the older package name
    try:
        from pytorch_lightning import Callback
        from pytorch_lightning.strategies import DDPStrategy
    except ImportError as missing:
        raise ImportError('gradcomp.lightning needs PyTorch Lightning: pip install lightning') from missing

from torch.nn.parallel import DistributedDataParallel

from .checkpoint import every_rank
from .registration import register
from .state import CompressionState


class GradcompCallback(Callback):
    """Compresses the DDP strategy's gradients with codec `spec` and keeps its state in Lightning's checkpoints.

    spec, options: as gradcomp.register takes them (e.g. "topk", ratio=0.01, scheme="auto", start_iter=2).
    state_dir: every rank writes its state to a file of its own in this folder (for large states; it must be
        reachable from every node), and the checkpoint holds where to find them; by default the checkpoint
        holds every rank's state itself.
    log_stats: log gradcomp/ratio and gradcomp/wire_MB (this rank's totals) through the module's logger.
    """

    def __init__(self, spec: str = "topk", *, state_dir: str | None = None, log_stats: bool = True,
                 **options: Any):
        self.state = CompressionState(spec, **options)  # bad specs and options fail here, before any process starts
        self.state_dir = state_dir
        self.log_stats = log_stats

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if trainer.world_size < 2:
            raise ValueError(f"gradcomp.lightning.GradcompCallback compresses what DDP's ranks exchange, and this "
                             f"Trainer runs a single process ({type(strategy).__name__}); train on 2 or more "
                             f"(Trainer(devices=N, strategy='ddp'), or num_nodes) or leave the callback out")
        if not isinstance(strategy, DDPStrategy):
            raise ValueError(f"gradcomp.lightning.GradcompCallback works with Lightning's DDP strategy "
                             f"(strategy='ddp' or 'ddp_spawn', or DDPStrategy(...)); this Trainer runs "
                             f"{type(strategy).__name__}, which does not exchange gradients through DDP's "
                             f"communication hooks")

    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise RuntimeError(f"gradcomp.lightning.GradcompCallback: the strategy's model is "
                               f"{type(model).__name__}, not DistributedDataParallel")
        if getattr(model, "_gradcomp_state", None) is not self.state:  # each fit wraps the model anew
            register(model, self.state)

    def state_dict(self) -> dict[str, Any]:
        return every_rank(self.state, self.state_dir).state_dict()  # every rank calls it as the checkpoint is made

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before the strategy wraps the model: the state is checked against the
        # configuration and world size now, against the model's parameters when on_fit_start registers it.
        self.state.load_state_dict(state_dict)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.log_stats or trainer.global_step % max(trainer.log_every_n_steps, 1):
            return  # stats() reads the device's counters: only when the logger will write
        total = self.state.stats()["total"]
        pl_module.log_dict({"gradcomp/ratio": float(total["ratio"]), "gradcomp/wire_MB": total["wire_bytes"] / 1e6},
                           on_step=True, on_epoch=False, rank_zero_only=True)
