"""gradcomp.register: finds the DistributedDataParallel model in what a user holds (DDP, Fabric's module, a
wrapped LightningModule) and registers a CompressionState on it as its communication hook."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .hook import COMPILED_AUTOGRAD, hook
from .state import CompressionState

WHERE_TO_REGISTER = (
    "call gradcomp.register on the DistributedDataParallel model, once it is wrapped: plain PyTorch: "
    "DistributedDataParallel(model) after dist.init_process_group; Lightning: Trainer(callbacks="
    "[gradcomp.lightning.GradcompCallback(spec)]); Fabric: the module fabric.setup(model) returns; Accelerate: "
    "gradcomp.accelerate.register(accelerator, accelerator.prepare(model), spec)")


def find_ddp(model) -> torch.nn.parallel.DistributedDataParallel:
    """The DistributedDataParallel model inside what a user holds: DDP itself, Fabric's module (fabric.setup's
    result), or a LightningModule whose trainer has wrapped it; otherwise a TypeError saying where to call."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model
    inner = getattr(model, "_forward_module", None)  # Fabric's _FabricModule
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        return inner
    if any(c.__name__ == "LightningModule" for c in type(model).__mro__):
        trainer = getattr(model, "_trainer", None)
        wrapped = getattr(getattr(trainer, "strategy", None), "model", None)
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            return wrapped
        raise TypeError(f"gradcomp.register: this LightningModule ({type(model).__name__}) is not wrapped in "
                        f"DistributedDataParallel (yet); with Lightning, add gradcomp.lightning.GradcompCallback(spec) "
                        f"to the Trainer's callbacks, which registers once the DDP strategy has wrapped the model")
    what = type(model).__name__
    if isinstance(inner, torch.nn.Module):
        what += f" around a {type(inner).__name__} (this process runs no DDP: is the world size 1?)"
    raise TypeError(f"gradcomp.register takes a DistributedDataParallel model, got {what}; {WHERE_TO_REGISTER}")


def register(ddp_model: torch.nn.Module, spec: "str | CompressionState" = "topk", *,
             process_group: dist.ProcessGroup | None = None, scheme: str = "auto", start_iter: int | None = None,
             start_codec: str | None = None, min_bucket_ratio: float = 1.0, log_every: int = 0,
             node_size: int | None = None, policy: str = "codec", remeasure_every: int = 0,
             trial_steps: int | None = None, elastic: bool = False, **codec_params: Any) -> CompressionState:
    """Registers codec `spec` as ddp_model's communication hook; returns its state (for stats and checkpoints).

    ddp_model: a DistributedDataParallel model, or what a framework hands out around one (Fabric's module,
        a LightningModule once its trainer has wrapped it; with Lightning, gradcomp.lightning.GradcompCallback
        registers at the right moment).

    spec: a codec spec, or a CompressionState (say, one unpickled or loaded from a checkpoint), which is
        then registered as it is (with no other options).
    process_group: the group to communicate in; by default the one DDP was built with.
    scheme: how signsgd, terngrad, qsgd and topk payloads travel: "allgather" (every rank's payload to
        every rank: W-1 payloads sent per rank), "two-phase" (chunks to their owners, re-encoded averages
        back: about 2 payloads per rank at any W), "hierarchical" (full precision inside each node, the
        codec's exchange of a 1/L shard between nodes; powersgd's shards are groups of whole parameters), or
        "auto" (the default): hierarchical where the ranks form several nodes of several ranks, else per
        bucket the flat scheme that sends fewer bytes at this world size; "flat" is auto without the
        hierarchical scheme. Other codecs take "auto", "flat" or "hierarchical".
    start_iter: steps of plain allreduce first (past DDP's bucket rebuild after step 0): by default 2, and 5 under
        policy="time" (whose load is read from the last 3 plain steps: gradcomp.policy.WARMUP_STEPS). Under AdamW a
        few % of the run's steps: much of what a codec costs there arises in the first steps.
    start_codec: a codec spec for those first steps in place of plain allreduce, one that keeps no state
        between steps (any codec but powersgd, with error_feedback=false, the default of none, fp16, bf16, qsgd
        and terngrad), e.g. "qsgd:levels=127", about 4x smaller than plain. It travels by `scheme` too.
    min_bucket_ratio: a bucket is compressed only when raw bytes > this x its bytes on the wire.
    log_every: log the cumulative stats to the "gradcomp" logger every N steps (0: never).
    node_size: the ranks per node (ranks n*L .. n*L+L-1 share node n), for the hierarchical scheme; by default
        torchrun's LOCAL_WORLD_SIZE, else the ranks' host names. Given, it also emulates nodes on one machine.
    policy: "codec" (the default): every bucket under the codec, by `scheme`, where it sends fewer bytes than plain
        allreduce (min_bucket_ratio); "time": per bucket the fastest of plain allreduce and the codec under each
        scheme `scheme` allows, from the links, kernels and backward measured during the warm-up (gradcomp.policy;
        state.explain() shows the decision). Never what it predicts slower than plain DDP.
    remeasure_every: under policy="time", measure the links and kernels again and re-decide every N steps (0: never).
    trial_steps: under policy="time", after the model's decision, the steps measured per candidate of its shortlist
        (the model's choice and each option for every bucket, unless predicted far slower), one per round, each
        compared with plain's step of its round; the fastest stands where its gain is clear of the rounds' scatter,
        and the runner-up replaces it where clearly quicker still; a close call adds rounds of those it lies
        between (plain and each candidate whose gain over it is still possible; then the fastest and the runner-up),
        up to 12 x trial_steps in all, then the quicker in the mean (gradcomp.trial).
        0: the model's choice stands; else at least 2. Default 4 under policy="time".
    elastic: a state of every rank (gradcomp.every_rank) saved on another number of ranks loads: each rank takes the
        saved residuals' average, which the new ranks' average then equals (gradcomp.elastic says how each scheme's
        state is spread). Without it such a state is refused.
    """
    ddp_model = find_ddp(ddp_model)
    if getattr(ddp_model, "_use_python_reducer", False):
        raise ValueError(f"gradcomp.register: {COMPILED_AUTOGRAD}")
    if isinstance(getattr(ddp_model, "_gradcomp_state", None), CompressionState):
        raise RuntimeError(f"gradcomp: a hook ({ddp_model._gradcomp_state.spec}) is already registered on this "
                           f"model; DDP takes one communication hook per model")
    group = process_group if process_group is not None else ddp_model.process_group
    if isinstance(spec, CompressionState):
        options = {"scheme": (scheme, "auto"), "start_iter": (start_iter, None), "start_codec": (start_codec, None),
                   "min_bucket_ratio": (min_bucket_ratio, 1.0), "log_every": (log_every, 0),
                   "node_size": (node_size, None), "policy": (policy, "codec"), "remeasure_every": (remeasure_every, 0),
                   "trial_steps": (trial_steps, None), "elastic": (elastic, False),
                   **{k: (v, None) for k, v in codec_params.items()}}
        given = [k for k, (value, default) in options.items() if value != default]
        if given:
            raise ValueError(f"gradcomp.register: options ({', '.join(given)}) go with a spec, not with a "
                             f"CompressionState, which keeps its own")
        state = spec
        if process_group is not None or state.process_group is None:
            state.process_group = group
    else:
        state = CompressionState(spec, process_group=group, scheme=scheme, start_iter=start_iter,
                                 start_codec=start_codec, min_bucket_ratio=min_bucket_ratio, log_every=log_every,
                                 node_size=node_size, policy=policy, remeasure_every=remeasure_every,
                                 trial_steps=trial_steps, elastic=elastic, **codec_params)
    state.bind(ddp_model.module, ddp_model)
    ddp_model.register_comm_hook(state, hook)
    ddp_model._gradcomp_state = state
    return state
