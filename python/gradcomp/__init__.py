"""gradcomp: gradient compression for PyTorch DistributedDataParallel.

    import gradcomp
    state = gradcomp.register(ddp_model, "topk:ratio=0.01")   # the DDP communication hook
    # scheme="auto": per bucket, allgather or two-phase (chunks to owners), whichever sends fewer bytes
    state.stats(), state.state_dict()                         # bytes on the wire; checkpoints
    gradcomp.every_rank(state)               # every rank's state in one object (rank-0-only checkpoints)
    gradcomp.dcp_stateful(state)             # the same for torch.distributed.checkpoint
    gradcomp.lightning.GradcompCallback(spec), gradcomp.accelerate.register(accelerator, model, spec),
    gradcomp.transformers.register(trainer, spec)          # Hugging Face Trainer
    gradcomp.available()                      # every codec with its parameters and defaults
    c = gradcomp.codec("qsgd:levels=16,block=512")
    payload = c.encode(grad, residual)        # residual (error feedback) is updated in place
    c.decode_sum(torch.stack(payloads), out, alpha=1 / world_size)
"""

from . import _ops  # noqa: F401  (loads gradcomp._C: registers torch.ops.gradcomp.*)
from .checkpoint import dcp_stateful, every_rank
from .codecs import Codec, PayloadCodec, available, codec, count_for_ratio, describe, parse_spec
from .hook import hook
from .registration import register
from .state import CompressionState
from .powersgd import PowerSGD

__version__ = "0.1.0"
cuda_built = _ops._C.cuda_built
cpu_isa = _ops._C.cpu_isa

__all__ = ["Codec", "CompressionState", "PayloadCodec", "PowerSGD", "available", "codec", "count_for_ratio", "dcp_stateful",
           "describe", "every_rank", "hook", "parse_spec", "register"]


def __getattr__(name: str):
    """gradcomp.lightning, gradcomp.accelerate, gradcomp.transformers and gradcomp.fsdp load on first use: the first
    three's frameworks are optional extras."""
    if name in ("lightning", "accelerate", "transformers", "fsdp"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gradcomp' has no attribute {name!r}")
