"""Bytes on the wire of FSDP2's gradient reduce-scatter, plain and under gradcomp.fsdp, read from each rank's network
counters, against what gradcomp's stats report.

    sudo python benchmarks/fsdp_bytes.py            # 2 and 4 ranks, none, fp16, qsgd, signsgd, topk(0.01)
    sudo python benchmarks/fsdp_bytes.py --quick    # 2 ranks, signsgd and topk

Each rank runs in a network namespace of its own (its eth0 the only way out), with an MLP of four Linear layers
(--width 2048: 8.9M parameters, 36 MB of fp32 gradient), each layer its own fully_shard module. A step moves the parameters' all-gathers and the
gradients' reduce-scatters; a run whose reduce-scatter sends nothing (each rank keeps its own row: the "no
reduce-scatter" line) gives the rest, so that reduce-scatter bytes = a step's bytes - that. Results:
fsdp_bytes[_quick].{json,csv,png} in --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples")]
from bench_common import machine, namespace_rank_main, run_in_namespaces, shaping_problem, write_results  # noqa: E402
from scaling import counters  # noqa: E402
from train_ddp import finish_spawned_rank  # noqa: E402

SUBNET = "10.77.0"
CODECS = ["none", "fp16", "qsgd", "signsgd", "topk:ratio=0.01"]
QUICK_CODECS = ["signsgd", "topk:ratio=0.01"]


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, 10))


class KeepOwnRow:
    """A reduce-scatter that sends nothing: each rank keeps its own row (the bytes of everything else in a step)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        output_tensor.copy_(input_tensor.view(dist.get_world_size(group), -1)[dist.get_rank(group)])


def measure(rank: int, kind: str, spec: str | None, args) -> dict:
    """Bytes this rank's eth0 sent per backward (the barriers' bytes taken out), and gradcomp's stats per step. The
    layers stay unsharded from forward to backward (reshard_after_forward=False), so a backward sends the
    reduce-scatters and nothing else."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    import gradcomp.fsdp
    model = make_model(args.width)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # fully_shard's default: the accelerator, if any
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    state = None
    if kind == "gradcomp":
        state = gradcomp.fsdp.register(model, spec, start_iter=0)  # the codec's bytes from the first step
    elif kind == "no reduce-scatter":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(KeepOwnRow())
                module.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 256, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    settle = lambda: (dist.barrier(), time.sleep(0.2))  # noqa: E731 - every rank's last packets are out

    def backward_bytes() -> int:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        settle()
        sent = counters()[0]
        loss.backward()
        settle()
        sent = counters()[0] - sent
        optimizer.step()
        return sent

    for _ in range(args.warmup):
        backward_bytes()
    barriers = []
    for _ in range(args.steps):  # a settle alone: its bytes come out of each backward's
        settle()
        sent = counters()[0]
        settle()
        barriers.append(counters()[0] - sent)
    before = state.stats()["total"] if state else None
    sent = [backward_bytes() for _ in range(args.steps)]
    after = state.stats()["total"] if state else None
    result = {"tx_per_step": statistics.fmean(sent) - statistics.fmean(barriers)}
    if state is not None:
        result.update({key + "_per_step": (after[key] - before[key]) / args.steps for key in ("wire_bytes", "raw_bytes")})
    return result


def rank_main(args) -> None:
    configs = [("plain FSDP2", "plain", None, None), ("no reduce-scatter", "no reduce-scatter", None, None)]
    configs += [(spec, "gradcomp", spec, None) for spec in CODECS]
    namespace_rank_main(args, SUBNET, configs, lambda kind, spec, _: measure(args.rank, kind, spec, args))


def run_world(args, world: int, configs: list[str]) -> dict:
    return run_in_namespaces("gcf", world, SUBNET, None, __file__, 29410,
                             ["--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width),
                              "--configs", *configs], args.timeout, f"{world} ranks")


def rows_of(world: int, runs: dict) -> list[dict]:
    """Per configuration, the mean over ranks of the reduce-scatter's bytes per step (counters) and the stats'."""
    rest = statistics.fmean(r["tx_per_step"] for r in runs["no reduce-scatter"])
    plain = statistics.fmean(r["tx_per_step"] for r in runs["plain FSDP2"]) - rest
    rows = []
    for label, ranks in runs.items():
        if label == "no reduce-scatter":
            continue
        measured = statistics.fmean(r["tx_per_step"] for r in ranks) - rest
        stats = statistics.fmean(r["wire_bytes_per_step"] for r in ranks) if "wire_bytes_per_step" in ranks[0] \
            else None
        stats_raw = statistics.fmean(r["raw_bytes_per_step"] for r in ranks) if stats is not None else None
        rows.append({"world": world, "config": label, "measured_bytes_per_step": measured,
                     "stats_bytes_per_step": stats, "stats_vs_measured": stats / measured if stats else None,
                     "plain_measured_bytes_per_step": plain, "stats_plain_bytes_per_step": stats_raw,
                     "ratio_measured": plain / measured if measured > 0 else None,
                     "ratio_stats": stats_raw / stats if stats else None})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6.5 * len(worlds), 4.5), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        mine = [r for r in rows if r["world"] == world]
        labels = [r["config"] for r in mine]
        ax.bar(range(len(mine)), [r["measured_bytes_per_step"] / 1e6 for r in mine], label="counters", alpha=0.7)
        ax.scatter(range(len(mine)), [(r["stats_bytes_per_step"] or float("nan")) / 1e6 for r in mine],
                   color="black", zorder=3, label="gradcomp's stats")
        ax.set_xticks(range(len(mine)), labels, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("reduce-scatter MB sent per rank per step")
        ax.set_title(f"FSDP2, {world} ranks")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worlds", type=int, nargs="+", help="default 2 4 (quick: 2)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        finish_spawned_rank(args.rank, lambda _: rank_main(args))  # exits 0 (a gloo thread can abort shutdown)
    problem = shaping_problem()
    if problem:
        print(f"fsdp_bytes.py needs root to give every rank a namespace of its own, whose counters it reads: "
              f"{problem}. Nothing was measured.")
        return 0
    worlds = args.worlds or ([2] if args.quick else [2, 4])
    codecs = QUICK_CODECS if args.quick else CODECS
    rows = []
    for world in worlds:
        runs = run_world(args, world, ["plain FSDP2", "no reduce-scatter", *codecs])
        rows += rows_of(world, runs)
    stem = os.path.join(args.out, "fsdp_bytes_quick" if args.quick else "fsdp_bytes")
    os.makedirs(args.out, exist_ok=True)
    write_results(stem, {"machine": machine(), "steps": args.steps, "width": args.width, "rows": rows}, rows)
    plot(rows, stem + ".png")
    print(f"{'ranks':>5} {'config':18s} {'counters MB':>12} {'stats MB':>9} {'stats/counters':>15} "
          f"{'ratio (counters)':>17} {'ratio (stats)':>14}")
    for r in rows:
        stats = f"{r['stats_bytes_per_step'] / 1e6:9.3f}" if r["stats_bytes_per_step"] else f"{'-':>9}"
        agree = f"{r['stats_vs_measured']:15.3f}" if r["stats_vs_measured"] else f"{'-':>15}"
        ratio_stats = f"{r['ratio_stats']:13.1f}x" if r["ratio_stats"] else f"{'-':>14}"
        print(f"{r['world']:>5} {r['config']:18s} {r['measured_bytes_per_step'] / 1e6:12.3f} {stats} {agree} "
              f"{r['ratio_measured']:16.1f}x {ratio_stats}")
    print(f"wrote {stem}.json, .csv, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
