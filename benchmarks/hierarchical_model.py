"""A cost model of communication across nodes, fitted to hierarchical.py's runs and carried to GPU clusters.

    python benchmarks/hierarchical_model.py       # reads results/hierarchical.json; writes hierarchical_model.*

The model: a step's communication takes
    alpha x (message steps a rank waits on one after another)
    + (bytes a node sends across its link) / (bandwidth between nodes)
    + (bytes a rank sends inside its node) / (bandwidth inside a node),
the phases one after another (the hierarchical scheme's reduce-scatter, exchange and all-gather do not overlap).
Bytes come from gradcomp's own formulas (the stats'), which the runs read within a few % on each node's eth0.
Message steps: gloo's rings in the fit (2(p-1) per allreduce of p ranks, p-1 per all-gather); on the cluster,
NCCL's trees and concurrent sends, 2 log2(p) per allreduce and log2(p) per all-gather or all-to-all.

1. Fit: the 1 Gbit/s runs (each node's link shaped, its ranks on one loopback), step time over the same layout's
   no-communication limit, least squares on the three terms. The bandwidth between nodes should come out near the
   shaped 1 Gbit/s; inside a node the "link" here is TCP over loopback on a few shared CPU cores, so its fitted
   bandwidth describes this machine, not NVLink.
2. Carry it to a cluster of 8 GPUs per node, 2 to 128 nodes, 25, 100 and 400 Gbit/s between nodes, NVLink inside
   (INTRA_GBPS per GPU, one way) and NCCL's per-message latency (ALPHA_S): these are stated, not fitted; and
   3200 Gbit/s, a node with one 400 Gbit/s NIC per GPU (rails). The gradient: 1B parameters in bf16 (2 GB), in
   DDP's 25 MB buckets. Plain DDP: a ring over all ranks (each node's link carries 2(W-1)/W of the gradient);
   "none hierarchical" is the two levels without a codec; each codec flat (its scheme as at W ranks) and
   hierarchical. Codec kernels are not in the model (the time policy weighs them): communication time alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

import gradcomp
from gradcomp.codecs import chunk_bounds
from gradcomp.schemes import AllgatherBucket, AllreduceBucket, TwoPhaseBucket, fixed_scheme

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
from bench_common import write_results  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PARAMETERS, DTYPE = 10**9, torch.bfloat16
BUCKET_BYTES = 25 * 2**20
GPUS_PER_NODE = 8
NODES = [2, 4, 8, 16, 32, 64, 128]
INTER_GBITS = [25, 100, 400, 3200]
INTRA_GBPS = 300.0  # NVLink, per GPU and direction, what a ring achieves (H100: 450 GB/s nominal)
ALPHA_S = 10e-6  # NCCL's latency per sequential message step
CODECS = ["none", "fp16", "signsgd", "terngrad", "qsgd", "topk:ratio=0.01", "randomk:ratio=0.01"]


# -- bytes and messages per bucket of n elements ----------------------------------------------------------------------

def flat_plan(codec, n: int, world: int) -> type:
    fixed = fixed_scheme(codec)
    if fixed == "allreduce":
        return AllreduceBucket
    gather, two = (p.expected_sent(codec, n, DTYPE, world) for p in (AllgatherBucket, TwoPhaseBucket))
    return TwoPhaseBucket if two < gather else AllgatherBucket


def flat_node_bytes(codec, n: int, nodes: int, size: int) -> float:
    """What one node's ranks send across its link for a bucket under the codec's flat scheme at W = nodes x size."""
    world = nodes * size
    plan = flat_plan(codec, n, world)
    if plan is AllreduceBucket or plan is AllgatherBucket:  # rings: one rank per node crosses, with all it sends
        return plan.expected_sent(codec, n, DTYPE, world)
    sizes = [codec.payload_nbytes(b - a, DTYPE) for a, b in chunk_bounds(n, world)]
    others = sum(sizes) * (world - size) / world  # each rank's chunk payloads for owners on other nodes
    return size * others + (world - 1) * max(sizes)  # and the all-gather's ring, crossing once


def hierarchical_node_bytes(codec, n: int, nodes: int, size: int) -> float:
    shard = -(-n // size)
    return size * flat_plan(codec, shard, nodes).expected_sent(codec, shard, DTYPE, nodes)


def ring_steps(plan: type | None, world: int) -> int:
    """Sequential message steps of a flat exchange on world ranks over gloo's rings (None: a ring allreduce)."""
    return (world - 1) if plan is AllgatherBucket else 2 * (world - 1)


def tree_steps(plan: type | None, world: int) -> float:
    """The same on NCCL at scale: trees for allreduce, concurrent sends for all-gather and all-to-all."""
    depth = math.log2(world) if world > 1 else 0.0
    return depth if plan is AllgatherBucket else 2 * depth


def step_time(scheme: str, codec, nodes: int, size: int, inter_bps: float, intra_bps: float, alpha: float) -> float:
    """Seconds of communication per step for the whole gradient (PARAMETERS in DTYPE, BUCKET_BYTES buckets)."""
    itemsize = torch.tensor([], dtype=DTYPE).element_size()
    buckets = math.ceil(PARAMETERS * itemsize / BUCKET_BYTES)
    n = PARAMETERS // buckets
    world = nodes * size
    if scheme == "plain":
        node, inside, sequence = 2 * (world - 1) / world * n * itemsize, 0.0, tree_steps(None, world)
    elif scheme == "flat":
        node, inside = flat_node_bytes(codec, n, nodes, size), 0.0
        sequence = tree_steps(flat_plan(codec, n, world), world)
    else:
        shard = -(-n // size)
        node = hierarchical_node_bytes(codec, n, nodes, size)
        inside = 2 * (size - 1) * shard * itemsize  # reduce-scatter and all-gather, rings of size ranks
        sequence = 2 * tree_steps(AllgatherBucket, size) + tree_steps(flat_plan(codec, shard, nodes), nodes)
    return buckets * (alpha * sequence + node / inter_bps + inside / intra_bps)


# -- the fit --------------------------------------------------------------------------------------------------------

def fit(report: dict) -> dict | None:
    """alpha, the bandwidth between nodes and inside one, from the shaped runs (over their layout's limit)."""
    rows = report["rows"]
    unshaped = {(r["nodes"], r["node_size"], r["config"]): r for r in rows if r["link"] == "unshaped"}
    limits = {(r["nodes"], r["node_size"]): r["median_ms"] / 1e3 for r in rows
              if r["link"] != "unshaped" and r["kind"] == "limit"}
    basis, extra = [], []
    for r in rows:
        if r["link"] == "unshaped" or r["kind"] == "limit" or (r["nodes"], r["node_size"]) not in limits:
            continue
        bytes_row = unshaped.get((r["nodes"], r["node_size"], r["config"]))
        if not bytes_row:
            continue
        world, size = r["world"], r["node_size"]
        schemes = r["schemes"] or {}
        buckets = sum(schemes.values()) or 2
        if r["kind"] == "plain":
            sequence, inside = ring_steps(None, world) * buckets, 0.0
        elif "hierarchical" in schemes:
            nodes = world // size
            sequence = buckets * (2 * (size - 1) + 2 * (nodes - 1))
            inside = 2 * (size - 1) / size * report["gradient_bytes"]
        else:
            sequence, inside = ring_steps(TwoPhaseBucket, world) * buckets, 0.0
        basis.append([sequence, bytes_row["node_tx_bytes_per_step"], inside])
        extra.append(r["median_ms"] / 1e3 - limits[(r["nodes"], r["node_size"])])
    if len(extra) < 4:
        return None
    (alpha, per_inter_byte, per_intra_byte), *_ = np.linalg.lstsq(np.array(basis), np.array(extra), rcond=None)
    return {"alpha_s": float(alpha), "inter_bytes_per_s": 1 / per_inter_byte if per_inter_byte > 0 else None,
            "intra_bytes_per_s": 1 / per_intra_byte if per_intra_byte > 0 else None, "points": len(extra),
            "shaped_rate": report.get("rate")}


# -- the table -------------------------------------------------------------------------------------------------------

def cluster_rows() -> list[dict]:
    rows = []
    for gbits in INTER_GBITS:
        inter = gbits * 1e9 / 8
        for nodes in NODES:
            plain = step_time("plain", None, nodes, GPUS_PER_NODE, inter, INTRA_GBPS * 1e9, ALPHA_S)
            rows.append({"inter_gbit": gbits, "nodes": nodes, "codec": "none", "scheme": "plain DDP",
                         "ms": 1e3 * plain, "vs_plain": 1.0})
            for spec in CODECS:
                codec = gradcomp.codec(spec)
                for scheme in ("flat", "hierarchical") if spec != "none" else ("hierarchical",):
                    seconds = step_time(scheme, codec, nodes, GPUS_PER_NODE, inter, INTRA_GBPS * 1e9, ALPHA_S)
                    rows.append({"inter_gbit": gbits, "nodes": nodes, "codec": spec, "scheme": scheme,
                                 "ms": 1e3 * seconds, "vs_plain": seconds / plain})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(INTER_GBITS), figsize=(6 * len(INTER_GBITS), 5), sharey=True)
    for ax, gbits in zip(axes, INTER_GBITS):
        mine = [r for r in rows if r["inter_gbit"] == gbits]
        plain = [r["ms"] for r in mine if r["scheme"] == "plain DDP"]
        ax.plot(NODES, plain, "k-", linewidth=2.5, label="plain DDP")
        for i, spec in enumerate(CODECS):
            for scheme, style in (("flat", "--"), ("hierarchical", "-")):
                ms = [r["ms"] for r in mine if r["codec"] == spec and r["scheme"] == scheme]
                if ms:
                    ax.plot(NODES, ms, style, color=f"C{i}", label=f"{spec} {scheme}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{gbits} Gbit/s between nodes, {GPUS_PER_NODE} GPUs per node")
        ax.set_xlabel("nodes")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("predicted communication per step, ms (1B bf16 parameters)")
    axes[-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=os.path.join(RESULTS, "hierarchical.json"))
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    fitted = None
    if os.path.exists(args.runs):
        with open(args.runs) as f:
            fitted = fit(json.load(f))
    if fitted:
        print(f"fitted on {fitted['points']} shaped runs: alpha {1e3 * fitted['alpha_s']:.2f} ms per message, between "
              f"nodes {8 * (fitted['inter_bytes_per_s'] or 0) / 1e9:.2f} Gbit/s (shaped at {fitted['shaped_rate']}), "
              f"inside a node {8 * (fitted['intra_bytes_per_s'] or 0) / 1e9:.2f} Gbit/s (loopback on shared cores)")
    rows = cluster_rows()
    for gbits in INTER_GBITS:
        print(f"\n{gbits} Gbit/s between nodes: predicted ms per step (x plain DDP)")
        print("codec / scheme".ljust(34) + "".join(f"{n:>15d}" for n in NODES))
        for spec in CODECS:
            for scheme in (["plain DDP", "hierarchical"] if spec == "none" else ["flat", "hierarchical"]):
                cells = [r for r in rows if r["inter_gbit"] == gbits and r["codec"] == spec and r["scheme"] == scheme]
                print(f"{spec} {scheme}".ljust(34) + "".join(f"{r['ms']:9.1f} ({r['vs_plain']:.2f})" for r in cells))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "hierarchical_model")
    write_results(stem, {"fit": fitted, "assumptions": {"parameters": PARAMETERS, "dtype": str(DTYPE),
                                                        "bucket_bytes": BUCKET_BYTES, "gpus_per_node": GPUS_PER_NODE,
                                                        "intra_gbps_per_gpu": INTRA_GBPS, "alpha_s": ALPHA_S},
                         "rows": rows}, rows)
    plot(rows, stem + ".png")
    print(f"wrote {stem}.json, .csv, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
