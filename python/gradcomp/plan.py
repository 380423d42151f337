"""Before a run: the predicted communication per step of plain DDP, of each codec under each scheme, and of
policy="time", for a cluster you describe. The same cost model as the policy (gradcomp.policy), with the collectives'
costs from the cluster's links instead of measured ones.

    gradcomp-plan --nodes 8 --gpus-per-node 8 --inter-gbit 25 --params 1e9 --gpu h100
    python -m gradcomp.plan --nodes 2 --gpus-per-node 1 --inter-gbit 1 --params 11e6 --dtype float32

Collectives (NCCL-like, every bucket's alone on the links): a ring over all ranks crosses each node's link with
2(W-1)/W of an allreduce's bytes and (W-1) x an all-gather's per-rank payload; an all-to-all sends each node's
L x (W-L)/W of its ranks' data across; inside a node a ring over L ranks at the intra-node bandwidth; across nodes
the L local ranks' groups run at once and share their node's link (or its NICs). Latency: 2 log2(p) message steps
per allreduce of p ranks, log2(p) per all-gather, p-1 per all-to-all. Kernels: this machine's, measured now on
random data (--kernels measure, the default), or a stated GPU's (--gpu): memory-bound codec passes at 70% of its
memory bandwidth, PowerSGD's matrix products at 50% of its dense bf16 rate, 5 us per kernel launch; plain DDP's
bucket divided by the world size before its allreduce through a comm hook, one such pass (DDP without a hook
divides as it copies the gradients into the bucket: the "plain DDP allreduce" row). Overlap with backward: the
buckets become ready evenly over --backward-ms (0, the default: none hidden, an upper bound).
powersgd's buckets hold matrices of --layer-shape (default: square ones of the bucket's size).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from .codecs import codec as make_codec
from .powersgd import PowerSGD
from . import measure
from . import policy as time_policy

GPU_PROFILES = {  # memory bandwidth (bytes/s), dense bf16 matrix rate (flop/s): the vendors' figures
    "h100": (3.35e12, 989e12), "h200": (4.8e12, 989e12), "a100": (2.0e12, 312e12), "l40s": (0.864e12, 362e12)}
MEMORY_EFFICIENCY, MATMUL_EFFICIENCY, LAUNCH_S = 0.7, 0.5, 5e-6
DEFAULT_CODECS = ["signsgd", "qsgd", "topk:ratio=0.01", "powersgd:rank=4"]


def cluster_links(nodes: int, per_node: int, inter_bytes_s: float, intra_bytes_s: float, inter_alpha: float,
                  intra_alpha: float) -> dict[str, time_policy.Line]:
    """The collectives' Lines (seconds for bytes per rank) of every level, from the cluster's links."""
    world = nodes * per_node
    steps = lambda p: math.log2(p) if p > 1 else 0.0  # noqa: E731
    crossing = nodes > 1
    bw, alpha = (inter_bytes_s, inter_alpha) if crossing else (intra_bytes_s, intra_alpha)
    share = per_node if crossing else 1  # a node's ranks share its link across nodes
    lines = {
        "world/allreduce": time_policy.Line(2 * steps(world) * alpha, 2 * (world - 1) / world / bw),
        "world/all-gather": time_policy.Line(steps(world) * alpha, (world - 1) / bw),
        "world/all-to-all": time_policy.Line((world - 1) * alpha, share * (world - share) / world / bw if crossing
                                             else (world - 1) / world / bw),
        "inside/reduce-scatter": time_policy.Line(steps(per_node) * intra_alpha,
                                                  (per_node - 1) / per_node / intra_bytes_s),
        "inside/all-gather": time_policy.Line(steps(per_node) * intra_alpha, (per_node - 1) / intra_bytes_s),
        "across/allreduce": time_policy.Line(2 * steps(nodes) * inter_alpha,
                                             per_node * 2 * (nodes - 1) / nodes / inter_bytes_s),
        "across/all-gather": time_policy.Line(steps(nodes) * inter_alpha, per_node * (nodes - 1) / inter_bytes_s),
        "across/all-to-all": time_policy.Line((nodes - 1) * inter_alpha,
                                              per_node * (nodes - 1) / nodes / inter_bytes_s),
    }
    lines["world/reduce-scatter"] = time_policy.Line(lines["world/allreduce"].fixed / 2,
                                                     lines["world/allreduce"].per_unit / 2)
    return lines


def gpu_kernels(codec, gpu: str, dtype: torch.dtype) -> dict[str, time_policy.Line]:
    """A stated GPU's kernel costs: encode reads the gradient and residual and writes the residual and payload (about
    3 passes), a decode reads a payload and updates the output (about 2); PowerSGD 6 x rank flop per element; plain
    DDP's division by the world size reads and writes the bucket (2)."""
    memory, matmul = GPU_PROFILES[gpu]
    per_pass = dtype.itemsize / (MEMORY_EFFICIENCY * memory)
    divide = time_policy.Line(LAUNCH_S, 2 * per_pass)
    if isinstance(codec, PowerSGD):
        return {"powersgd": time_policy.Line(4 * LAUNCH_S, 6 / (MATMUL_EFFICIENCY * matmul)), "divide": divide}
    return {"encode": time_policy.Line(2 * LAUNCH_S, 3 * per_pass), "decode": time_policy.Line(LAUNCH_S, 2 * per_pass),
            "divide": divide}


def measured_kernels(codec, largest: int, dtype: torch.dtype) -> dict[str, time_policy.Line]:
    sample = torch.randn(min(largest, 1 << 20), generator=torch.Generator().manual_seed(0)).to(dtype)
    return measure.measure_kernels(codec, sample, largest, measure.Clock(sample.device))


def buckets_of(params: float, bucket_mb: float, dtype: torch.dtype, layer_shape) -> list[dict]:
    """DDP's buckets of a model of `params` parameters: full ones of bucket_mb and the rest. Each holds as many
    matrices of layer_shape as fit and the rest as rows of one (only powersgd reads the shapes); without a
    layer_shape, one square matrix. A matrix larger than bucket_mb fills a bucket of its own, as DDP never splits a
    parameter between buckets."""
    per_bucket = max(1, int(bucket_mb * 2**20 // dtype.itemsize))
    if layer_shape:
        per_bucket = max(per_bucket, math.prod(layer_shape))
    total, out = int(params), []
    while total > 0:
        n = min(per_bucket, total)
        if layer_shape:
            rows, cols = layer_shape
            count, rest = divmod(n, rows * cols)
            shapes = [(rows, cols)] * count + ([(rest // cols, cols)] if rest >= cols else []) + \
                ([(rest % cols,)] if rest % cols else [])
        else:
            side = max(1, int(math.sqrt(n)))
            shapes = [(side, n // side)] + ([(n - side * (n // side),)] if n % side else [])
        out.append({"index": len(out), "shapes": shapes, "dtype": dtype})
        total -= n
    return out


def predict(codec, buckets: list[dict], links: dict, kernels: dict, nodes: int, per_node: int,
            backward_s: float) -> dict:
    """Predicted exposed communication per step (seconds) of plain DDP ("plain DDP": no hook, which divides by the
    world size as it copies the gradients into the bucket; "plain": the same allreduces through a communication hook,
    which divides in a pass of its own, as gradcomp's plain buckets do), of the codec under each option fixed for
    every bucket, and of the policy's choice; with the policy's choices."""
    world = nodes * per_node
    model = time_policy.CostModel(links, kernels)
    two_levels = nodes > 1 and per_node > 1
    ready = [backward_s * (i + 1) / len(buckets) for i in range(len(buckets))]
    decision = time_policy.decide(model, ready, buckets, codec, "auto", world, per_node if two_levels else None, 0)
    chosen = {}
    for bucket in decision["buckets"]:
        chosen[bucket["choice"]] = chosen.get(bucket["choice"], 0) + 1
    without_hook = time_policy.exposed(ready, [time_policy.Cost(0.0, *bucket["predicted_s"]["plain"][1:])
                                               for bucket in decision["buckets"]])
    return {"predicted_s": {"plain DDP": without_hook, **decision["predicted_exposed_s"]}, "choices": chosen}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="gradcomp-plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node (default 1)")
    parser.add_argument("--inter-gbit", type=float, required=True, help="each node's link to the others, Gbit/s")
    parser.add_argument("--nics-per-node", type=int, default=1, help="links of that speed per node (rails)")
    parser.add_argument("--intra-gbyte", type=float, default=300.0,
                        help="per GPU inside a node, GB/s one way (default 300: NVLink as a ring achieves it)")
    parser.add_argument("--inter-latency-us", type=float, default=10.0)
    parser.add_argument("--intra-latency-us", type=float, default=5.0)
    parser.add_argument("--params", type=float, required=True, help="the model's parameters, e.g. 1e9")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (default 25)")
    parser.add_argument("--layer-shape", default=None, help="ROWSxCOLS of the model's matrices, for powersgd")
    parser.add_argument("--backward-ms", type=float, default=0.0,
                        help="backward's duration, over which buckets become ready (0: no overlap)")
    parser.add_argument("--codecs", default=";".join(DEFAULT_CODECS),
                        help="codec specs separated by ';' (default: %(default)s)")
    parser.add_argument("--gpu", choices=sorted(GPU_PROFILES), default=None,
                        help="kernel costs of this GPU, stated (default: measured on this machine)")
    args = parser.parse_args(argv)
    for name in ("nodes", "gpus_per_node", "nics_per_node"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    for name in ("inter_gbit", "intra_gbyte", "params", "bucket_mb"):
        if not 0 < getattr(args, name) < math.inf:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive and finite")
    if args.params < 1:
        parser.error(f"--params={args.params} must be at least 1")
    for name in ("inter_latency_us", "intra_latency_us", "backward_ms"):
        if not 0 <= getattr(args, name) < math.inf:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be zero or more, and finite")
    if args.layer_shape is not None:
        try:
            rows, cols = (int(x) for x in args.layer_shape.lower().split("x"))
        except ValueError:
            parser.error(f"--layer-shape={args.layer_shape!r}: give ROWSxCOLS, e.g. 4096x4096")
        if rows < 1 or cols < 1:
            parser.error(f"--layer-shape={args.layer_shape!r}: rows and columns must be at least 1")
        args.layer_shape = (rows, cols)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dtype = getattr(torch, args.dtype)
    links = cluster_links(args.nodes, args.gpus_per_node, args.inter_gbit * args.nics_per_node * 1e9 / 8,
                          args.intra_gbyte * 1e9, args.inter_latency_us * 1e-6, args.intra_latency_us * 1e-6)
    buckets = buckets_of(args.params, args.bucket_mb, dtype, args.layer_shape)
    largest = max(sum(math.prod(s) for s in b["shapes"]) for b in buckets)
    kernels_from = f"{args.gpu} (stated)" if args.gpu else "this machine's CPU (measured)"
    print(f"{args.nodes} nodes x {args.gpus_per_node} GPUs, {args.inter_gbit:g} Gbit/s x {args.nics_per_node} "
          f"between nodes, {args.intra_gbyte:g} GB/s inside; {args.params:.3g} parameters in {args.dtype}, "
          f"{len(buckets)} buckets of <= {largest * dtype.itemsize / 2**20:.3g} MB; kernels: {kernels_from}; "
          f"backward {args.backward_ms:g} ms")
    print(f"{'codec':<22} {'option':<34} {'ms/step':>10} {'vs plain':>9}")
    specs = [s for s in args.codecs.split(";") if s]
    for spec in specs:
        try:
            codec = make_codec(spec)
        except ValueError as error:
            print(f"gradcomp-plan: {error}", file=sys.stderr)
            return 2
        kernels = gpu_kernels(codec, args.gpu, dtype) if args.gpu else measured_kernels(codec, largest, dtype)
        result = predict(codec, buckets, links, kernels, args.nodes, args.gpus_per_node, args.backward_ms * 1e-3)
        predicted = result["predicted_s"]
        plain = predicted["plain DDP"]
        rows = [("plain DDP", "allreduce", plain), ("plain DDP", "allreduce in a comm hook", predicted["plain"])] \
            if spec == specs[0] else []
        rows += [(spec, option, seconds) for option, seconds in predicted.items()
                 if option not in ("plain DDP", "plain", "policy")]
        choices = ", ".join(f"{n} {o}" for o, n in sorted(result["choices"].items()))
        rows.append((spec, f"policy='time' ({choices})", predicted["policy"]))
        for name, option, seconds in rows:
            print(f"{name:<22} {option:<34} {seconds * 1e3:10.2f} {seconds / plain if plain else 1.0:8.2f}x")
    if args.nodes == 1:
        print("(one node: no link between nodes; the times are the intra-node ones)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
