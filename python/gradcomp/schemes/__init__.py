"""How a bucket's compressed gradient travels: one module per scheme, each a bucket plan behind one
small interface (base.ResidualPlan's docstring).

| scheme    | codecs                          | bytes a rank sends per bucket             |
|-----------|---------------------------------|-------------------------------------------|
| allreduce | none, fp16, bf16, randomk       | 2(W-1)/W x the summed values              |
| allgather | signsgd, terngrad, qsgd, topk   | (W-1) x the payload                       |
| two-phase | signsgd, terngrad, qsgd, topk   | about 2(W-1)/W x the payload + 2(W-1) headers |
| powersgd  | powersgd                        | 2(W-1)/W x (P + Q)                        |

For the codecs that can go either way, scheme="auto" (the default) picks per bucket the scheme that
sends fewer bytes at this world size: allgather at 2 ranks, two-phase from 3 on, except for buckets so
small that W chunk headers outweigh the saving.
"""

from __future__ import annotations

import torch

from ..powersgd import PowerSGD
from .allgather import AllgatherBucket
from .allreduce import AllreduceBucket
from .base import ring_allreduce_bytes
from .powersgd import PowerSGDBucket
from .two_phase import TwoPhaseBucket

SCHEME_OPTIONS = ("auto", "allgather", "two-phase")
PLANS = {plan.scheme: plan for plan in (AllreduceBucket, AllgatherBucket, TwoPhaseBucket, PowerSGDBucket)}
GATHERED = (AllgatherBucket, TwoPhaseBucket)  # the schemes of the codecs whose payloads cannot be summed

__all__ = ["AllgatherBucket", "AllreduceBucket", "GATHERED", "PLANS", "PowerSGDBucket", "SCHEME_OPTIONS", "TwoPhaseBucket",
           "check_scheme", "fixed_scheme", "plan_class", "ring_allreduce_bytes"]


def fixed_scheme(codec) -> str | None:
    """The one scheme a codec travels by, or None when it can take either gathered scheme."""
    if isinstance(codec, PowerSGD):
        return PowerSGDBucket.scheme
    return AllreduceBucket.scheme if codec.collective == "allreduce" else None


def check_scheme(codec, scheme) -> str:
    if scheme not in SCHEME_OPTIONS:
        raise ValueError(f"gradcomp: scheme={scheme!r}; valid: {', '.join(map(repr, SCHEME_OPTIONS))}")
    fixed = fixed_scheme(codec)
    if fixed is not None and scheme != "auto":
        raise ValueError(f"gradcomp: {codec.name} travels by {fixed}; scheme={scheme!r} applies to signsgd, "
                         f"terngrad, qsgd and topk (leave it 'auto')")
    return scheme


def plan_class(codec, scheme: str, numel: int, dtype: torch.dtype, world: int) -> type:
    """The plan a bucket of numel elements takes under scheme at this world size (the same on every rank)."""
    fixed = fixed_scheme(codec)
    if fixed is not None:
        return PLANS[fixed]
    if scheme != "auto":
        return PLANS[scheme]
    gather, two_phase = (plan.expected_sent(codec, numel, dtype, world) for plan in GATHERED)
    return TwoPhaseBucket if two_phase < gather else AllgatherBucket
