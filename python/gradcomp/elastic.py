"""Resuming on another number of ranks (elastic=True): every rank's saved state, spread over the new ranks.

Error feedback's residuals hold gradient mass not yet sent: rank r's residual e_r reaches the model as e_r / W in
the average of the next steps, so what the model still owes is their average, (1/W) sum_r e_r. Dropping them
loses it; giving rank r' of W' ranks the residual of old rank r' (or none) changes it. So each new rank takes
that average as its own residual: the new ranks' average is the old one, to rounding.

Every scheme's state is taken in a flat scheme's units first (the plans' pieces(), as when DDP lays its buckets
out anew): the two-phase owner's residual of its chunk counts W times (it is a residual of the average, which
counts whole, where a rank's counts 1/W), the hierarchical shard's L times. PowerSGD's Q, the same on every rank
of a flat scheme, is taken from the first rank that holds one (it is a warm start, not gradient mass). The
buckets' layout is kept (the new run's first compressed step lays its plans out as the old run's were), the
stats are those of old rank r' mod W, and policy="time"'s decision is taken anew (it was made for W ranks; the
overlap with backward is not measured again, so it assumes none).
"""

from __future__ import annotations

from typing import Any

import torch

from .checkpoint import STATE_FORMAT, every_rank_world_size, this_ranks_entry
from .schemes import PLANS, AllgatherBucket, fixed_scheme


def spread(state, saved: dict[str, Any], world: int, rank: int) -> dict[str, Any]:
    """This rank's entry (a state_dict() of this world size and rank) from an every-rank state saved on another
    world size: the average of the saved ranks' residuals, per parameter."""
    saved_world = every_rank_world_size(saved)
    entries = [this_ranks_entry(saved, r) for r in range(saved_world)]
    for r, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("format") != STATE_FORMAT:
            raise ValueError(f"gradcomp: rank {r}'s entry of the every-rank state is not a gradcomp state (format "
                             f"{STATE_FORMAT})")
    steps = {int(entry["iter"]) for entry in entries}
    if len(steps) > 1:
        raise ValueError(f"gradcomp: the saved ranks stood at different steps ({sorted(steps)}): not one checkpoint")
    first_config = {k: v for k, v in entries[0]["config"].items() if k != "world_size"}
    for r, entry in enumerate(entries):
        if entry.get("rank") not in (None, r):
            raise ValueError(f"gradcomp: the every-rank state's entry {r} holds rank {entry['rank']}'s state: the "
                             f"entries are not one save of every rank")
        config = {k: v for k, v in entry["config"].items() if k != "world_size"}
        if config != first_config:
            raise ValueError(f"gradcomp: the saved ranks' configurations differ (rank 0: {first_config}, rank {r}: "
                             f"{config}): not one run's checkpoint")
    summed: dict[int, dict[str, torch.Tensor]] = {}
    for r, entry in enumerate(entries):
        for key, piece in _pieces(state, entry, saved_world, r).items():
            into = summed.setdefault(key, {})
            if "q" in piece and "q" not in into:
                into["q"] = piece["q"].clone()
            if "residual" in piece:  # summed in float64, handed back in the dtype it was saved in
                into.setdefault("dtype", piece["residual"].dtype)
                residual = piece["residual"].double()
                into["residual"] = residual if "residual" not in into else into["residual"] + residual
    pool = {}
    shapes = _parameter_shapes(entries)
    layout = PLANS[fixed_scheme(state.codec) or AllgatherBucket.scheme].piece_layout
    for key, piece in summed.items():
        averaged = {**({"q": piece["q"]} if "q" in piece else {}),
                    **({"residual": (piece["residual"] / saved_world).to(piece["dtype"])} if "residual" in piece else {})}
        # In the layout of a flat scheme's pieces (a hierarchical bucket's are flat, PowerSGD's matrices): what has
        # no place there (a vector PowerSGD sends whole) was not held back by its flat scheme either, and is left.
        expected = layout(state.codec, *shapes[key]) if key in shapes else {}
        kept = {name: tensor.reshape(expected[name][0]).to(expected[name][1])
                for name, tensor in averaged.items() if name in expected}
        if kept:
            pool[key] = kept
    first = entries[0]
    layouts = first.get("warmup_buckets") or [
        {"index": b["index"], "keys": b["keys"], "shapes": b["shapes"], "dtype": b["dtype"]} for b in first["buckets"]]
    return {
        "format": STATE_FORMAT, "config": {**first["config"], "world_size": world}, "rank": rank,
        "iter": first["iter"], "buckets": [], "start_buckets": [], "warmup_buckets": layouts, "pool": pool,
        "total": entries[rank % saved_world]["total"], "decision": None,
    }


def _parameter_shapes(entries: list) -> dict:
    """Parameter key -> (shape, dtype), from the saved buckets' layouts."""
    shapes = {}
    for entry in entries:
        for saved in [*entry["buckets"], *entry.get("warmup_buckets", [])]:
            for key, shape in zip(saved["keys"], saved["shapes"]):
                shapes[int(key)] = (torch.Size(shape), getattr(torch, saved["dtype"]))
    return shapes


def _pieces(state, entry: dict, world: int, rank: int) -> dict:
    """A saved rank's state per parameter, in a flat scheme's units (its plans' pieces() and its waiting pool)."""
    pieces = {int(key): dict(piece) for key, piece in entry["pool"].items()}
    for saved in entry["buckets"]:
        plan = state._plan_from_layout(saved, world, rank, state.codec)
        plan.load_tensors(saved["tensors"])
        for key, piece in plan.pieces().items():
            into = pieces.setdefault(key, {})
            for name, tensor in piece.items():
                into[name] = tensor.clone() if name not in into or name == "q" else into[name] + tensor
    return pieces

