"""gradcomp under Hugging Face Accelerate (`pip install accelerate`).

    import gradcomp.accelerate
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    state = gradcomp.accelerate.register(accelerator, model, "powersgd", rank=4)
    accelerator.load_state(ckpt_dir)         # optional resume: after register, like any registered object
    ...
    accelerator.save_state(ckpt_dir)         # on every rank: each rank's compression state goes with it

Accelerate's own `DistributedDataParallelKwargs(comm_hook=...)` takes only torch's built-in hooks,
and `save_state` writes registered objects from the main process only; this registers gradcomp's
hook on the prepared model and its every-rank state (gradcomp.every_rank) for checkpointing.
"""

from __future__ import annotations

from typing import Any

try:
    from accelerate.utils import DistributedType
except ImportError as missing:
    raise ImportError('gradcomp.accelerate needs Accelerate: pip install accelerate') from missing

from .checkpoint import every_rank
from .registration import find_ddp, register as register_hook
from .state import CompressionState

DDP_TYPES = {DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}


def register(accelerator, model, spec: "str | CompressionState" = "topk", *, state_dir: str | None = None,
             **options: Any) -> CompressionState:
    """Registers codec `spec` on `model` (what accelerator.prepare returned) and its state for save_state/load_state.

    spec, options: as gradcomp.register takes them. state_dir: every rank writes its state to a file of its own
    there (for large states; reachable from every node) instead of into the checkpoint folder's object."""
    if accelerator.num_processes < 2:
        raise ValueError("gradcomp.accelerate.register compresses what DDP's ranks exchange, and this Accelerator "
                         "runs a single process; launch 2 or more (torchrun --nproc-per-node N, or accelerate "
                         "launch --multi_gpu / --num_processes N with a multi-CPU config)")
    if accelerator.distributed_type not in DDP_TYPES:
        raise ValueError(f"gradcomp.accelerate.register works with Accelerate's DDP ("
                         f"{', '.join(sorted(t.value for t in DDP_TYPES))}); this Accelerator runs "
                         f"{accelerator.distributed_type.value}, which does not exchange gradients through DDP's "
                         f"communication hooks")
    compiled = getattr(model, "_orig_mod", None)  # torch.compile's wrapper around the prepared model
    state = register_hook(find_ddp(compiled if compiled is not None else model), spec, **options)
    accelerator.register_for_checkpointing(every_rank(state, state_dir))
    return state
