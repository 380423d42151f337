"""How a bucket's compressed gradient travels: one module per scheme, each a bucket plan behind one
small interface (base.ResidualPlan's docstring).

| scheme    | codecs                          | bytes a rank sends per bucket             |
|-----------|---------------------------------|-------------------------------------------|
| allreduce | none, fp16, bf16, randomk       | 2(W-1)/W x the summed values              |
| allgather | signsgd, terngrad, qsgd, topk   | (W-1) x the payload                       |
| two-phase | signsgd, terngrad, qsgd, topk   | about 2(W-1)/W x the payload + 2(W-1) headers |
| powersgd  | powersgd                        | 2(W-1)/W x (P + Q)                        |
| hierarchical | every codec                     | across nodes: the codec's exchange of a 1/L shard (a node: one  |
|           |                                 | flat exchange of the bucket on N ranks); inside: full precision |
| plain     | every codec (policy="time")     | 2(W-1)/W x the bucket, uncompressed, as plain DDP               |

For the codecs that can go either way, scheme="auto" (the default) picks per bucket the scheme that
sends fewer bytes at this world size: allgather at 2 ranks, two-phase from 3 on, except for buckets so
small that W chunk headers outweigh the saving; and the hierarchical scheme wherever the ranks form more
than one node of more than one rank (gradcomp.nodes): it always sends fewer bytes across nodes.
scheme="flat" is auto without the hierarchical scheme. Under policy="time" (gradcomp.policy) the scheme
of each bucket, or plain, is the one a cost model measured on the job predicts fastest.
"""

from __future__ import annotations

import torch

from ..powersgd import PowerSGD
from .allgather import AllgatherBucket
from .allreduce import AllreduceBucket
from .base import ring_allreduce_bytes, ring_crosses
from .hierarchical import HierarchicalBucket
from .plain import PlainBucket
from .powersgd import PowerSGDBucket
from .two_phase import TwoPhaseBucket

SCHEME_OPTIONS = ("auto", "allgather", "two-phase", "hierarchical", "flat")
PLANS = {plan.scheme: plan for plan in (AllreduceBucket, AllgatherBucket, TwoPhaseBucket, PowerSGDBucket,
                                        HierarchicalBucket, PlainBucket)}
GATHERED = (AllgatherBucket, TwoPhaseBucket)  # the schemes of the codecs whose payloads cannot be summed

__all__ = ["AllgatherBucket", "AllreduceBucket", "GATHERED", "HierarchicalBucket", "PLANS", "PlainBucket", "PowerSGDBucket",
           "SCHEME_OPTIONS", "TwoPhaseBucket", "check_scheme", "fixed_scheme", "make_plan", "plan_class",
           "ring_allreduce_bytes", "ring_crosses"]


def fixed_scheme(codec) -> str | None:
    """The one scheme a codec travels by, or None when it can take either gathered scheme."""
    if isinstance(codec, PowerSGD):
        return PowerSGDBucket.scheme
    return AllreduceBucket.scheme if codec.collective == "allreduce" else None


def check_scheme(codec, scheme) -> str:
    if scheme not in SCHEME_OPTIONS:
        raise ValueError(f"gradcomp: scheme={scheme!r}; valid: {', '.join(map(repr, SCHEME_OPTIONS))}")
    fixed = fixed_scheme(codec)
    if fixed is not None and scheme not in ("auto", "hierarchical", "flat"):
        raise ValueError(f"gradcomp: {codec.name} travels by {fixed}; scheme={scheme!r} applies to signsgd, "
                         f"terngrad, qsgd and topk (leave it 'auto', or give 'flat' or 'hierarchical')")
    return scheme


def plan_class(codec, scheme: str, numel: int, dtype: torch.dtype, world: int, nodes=None) -> type:
    """The plan a bucket of numel elements takes under scheme at this world size (the same on every rank). nodes:
    the node layout (gradcomp.nodes.NodeLayout) where the ranks form several nodes of several ranks, else None."""
    if nodes is not None and scheme in ("auto", "hierarchical"):
        return HierarchicalBucket
    if scheme in ("hierarchical", "flat"):  # the flat scheme auto takes without several nodes of several ranks
        scheme = "auto"
    fixed = fixed_scheme(codec)
    if fixed is not None:
        return PLANS[fixed]
    if scheme != "auto":
        return PLANS[scheme]
    gather, two_phase = (plan.expected_sent(codec, numel, dtype, world) for plan in GATHERED)
    return TwoPhaseBucket if two_phase < gather else AllgatherBucket


def make_plan(plan_type: type, codec, index: int, keys, shapes, dtype: torch.dtype, device, *, world: int, rank: int,
              node_size: int | None = None):
    """A plan of plan_type; the hierarchical scheme's also takes the ranks per node."""
    extra = {"node_size": node_size} if plan_type is HierarchicalBucket else {}
    return plan_type(codec, index, keys, shapes, dtype, device, world=world, rank=rank, **extra)
