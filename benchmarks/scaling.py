"""Bytes and step time as the world size grows: every codec and scheme on W ranks, each rank in a
network namespace of its own behind its own link, against plain DDP and the no-communication limit.

    sudo python benchmarks/scaling.py                 # W = 2, 4, 8, 16 (about 10 minutes on 2 cores)
    sudo python benchmarks/scaling.py --quick         # W = 2 and 3, a few configurations and steps

Every rank runs in its own namespace (`ip netns add`), whose eth0 is one end of a veth pair; the other
ends join one bridge, so every byte a rank sends crosses its own eth0. Two passes per world size:
    unshaped: the bytes each rank sends per step, read from the kernel's counters of its eth0
        (/sys/class/net/eth0/statistics/tx_bytes: payload plus TCP/IP headers and ACKs) next to
        what gradcomp's stats report for the same steps;
    1 Gbit/s: a tc token bucket on both ends of each veth (each rank's link is 1 Gbit/s each way),
        and the step time (the median over the measured steps of the slowest rank).
The model (MLP, 2.4M parameters, a 9.5 MB fp32 gradient, batch 8 per rank) has a large gradient and
little compute. With W ranks on 2 cores the compute of a step is shared W ways, so step times are
compared as ratios to the same W's no-communication limit (a hook that returns the local gradient).

A cost model is fitted to the measured bytes (per configuration, one factor over gradcomp's own byte
formulas for this model's buckets at each W: TCP/IP headers and ACKs) and to the shaped step times (alpha per message a rank waits on in sequence, beta per byte it sends),
and extrapolated to 64-1024 ranks with the compute of the 2-rank limit (one GPU per rank would not
share). Results: scaling[_quick].{json,csv,png} in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import gradcomp

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")]
from bench_common import (machine, namespace_rank_main, refused_without_shaping, run_in_namespaces,  # noqa: E402
                          write_results)
from train_ddp import finish_spawned_rank  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GATHERED = ["signsgd", "terngrad", "qsgd", "topk:ratio=0.01"]
# (label, kind, spec, scheme): kind "plain" (no hook), "limit" (no communication) or "gradcomp".
CONFIGS = [("plain DDP", "plain", None, None), ("no communication (limit)", "limit", None, None),
           ("fp16", "gradcomp", "fp16", "auto"), ("randomk:ratio=0.01", "gradcomp", "randomk:ratio=0.01", "auto"),
           ("powersgd:rank=4", "gradcomp", "powersgd:rank=4", "auto")]
CONFIGS += [(f"{spec} {scheme}", "gradcomp", spec, scheme) for spec in GATHERED
            for scheme in ("allgather", "two-phase", "auto")]
QUICK_CONFIGS = ["plain DDP", "no communication (limit)", "signsgd two-phase", "signsgd allgather",
                 "topk:ratio=0.01 auto"]
EXTRAPOLATE = [64, 128, 256, 512, 1024]
SUBNET = "10.78.0"


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                         nn.ReLU(), nn.Linear(1024, 10))


def sgd_step(model: nn.Module, ddp: DistributedDataParallel, rank: int):
    """One step of the MLP under ddp on this rank's own fixed batch (SGD, lr 0.01), as a function."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 256, generator=generator), torch.randint(0, 10, (8,), generator=generator)

    def step():
        loss = nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step


def no_communication(_, bucket):
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def counters() -> tuple[int, int]:
    """Bytes this namespace's eth0 has sent and received."""
    read = lambda name: int(open(f"/sys/class/net/eth0/statistics/{name}").read())  # noqa: E731
    return read("tx_bytes"), read("rx_bytes")


STATS_KEYS = ("wire_bytes", "received_bytes", "raw_bytes")


def measure(rank: int, kind: str, spec: str | None, scheme: str | None, args, options: dict | None = None,
            stats_keys=STATS_KEYS) -> dict:
    """One configuration on this rank: the bytes its namespace's eth0 sent and received per step (the per-step
    barriers' bytes taken out), its median step time, and per step the stats_keys of gradcomp's stats (options:
    more of register's options)."""
    model = make_model()
    ddp = DistributedDataParallel(model)
    state = None
    if kind == "limit":
        ddp.register_comm_hook(None, no_communication)
    elif kind == "gradcomp":
        state = gradcomp.register(ddp, spec, scheme=scheme, **(options or {}))
    step = sgd_step(model, ddp, rank)
    for _ in range(args.warmup):  # DDP's bucket rebuild, gradcomp's start_iter, the plans laid out
        step()
    settle = lambda: (dist.barrier(), time.sleep(0.3))  # noqa: E731 - every rank's last packets are out
    settle()
    tx0, rx0 = counters()
    for _ in range(args.steps):  # the per-step barriers alone, to take their bytes out
        dist.barrier()
    settle()
    tx1, rx1 = counters()
    stats_before = state.stats()["total"] if state else None
    times = []
    for _ in range(args.steps):
        dist.barrier()  # every step starts together: one step's skew does not leak into the next
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    stats_after = state.stats() if state else None
    settle()
    tx2, rx2 = counters()
    per_step = lambda steps_and_barriers, barriers: (steps_and_barriers - barriers) / args.steps  # noqa: E731
    result = {"tx_per_step": per_step(tx2 - tx1, tx1 - tx0), "rx_per_step": per_step(rx2 - rx1, rx1 - rx0),
              "median_s": statistics.median(times)}
    if state is not None:
        result.update({key + "_per_step": (stats_after["total"][key] - stats_before[key]) / args.steps
                       for key in stats_keys})
        result["schemes"] = stats_after["schemes"]
        result["bucket_numels"] = sorted(plan.numel for plan in state._plans.values())
    return result


def rank_main(args) -> None:
    """One rank, inside its namespace: every configuration in turn; rank 0 writes what all measured."""
    namespace_rank_main(args, SUBNET, CONFIGS,
                        lambda kind, spec, scheme: measure(args.rank, kind, spec, scheme, args))


# -- the namespaces ----------------------------------------------------------------------------------------------------

def run_world(args, world: int, rate: str | None, configs: list[str]) -> dict:
    """Every configuration on world ranks, each in its own namespace: {label: [each rank's result]}."""
    return run_in_namespaces("gcs", world, SUBNET, rate, __file__, 29400,
                             ["--steps", str(args.steps), "--warmup", str(args.warmup), "--configs", *configs],
                             args.timeout, f"{world} ranks ({rate or 'unshaped'})")


# -- the report --------------------------------------------------------------------------------------------------------

SEQUENTIAL_MESSAGES = {"allreduce": 2, "powersgd": 4, "allgather": 1, "two-phase": 2}  # x (W-1) per bucket


def messages(row: dict, buckets: float) -> float:
    """Messages a rank waits on one after another in a step: a ring allreduce takes 2(W-1) steps, an
    all-gather W-1, two-phase's all-to-all and all-gather W-1 each, powersgd two allreduces."""
    w = row["world"] - 1
    if row["kind"] == "limit":
        return 0.0
    if row["kind"] == "plain":
        return 2 * w * buckets
    schemes = row["schemes"] or {"allreduce": buckets}
    compressed = sum(schemes.values())
    return w * (sum(SEQUENTIAL_MESSAGES[s] * n for s, n in schemes.items()) + 2 * max(buckets - compressed, 0))


def table_rows(runs: dict) -> list[dict]:
    """One row per (link, world, configuration), the ranks' figures averaged (time: the slowest rank)."""
    rows = []
    for (link, world), results in sorted(runs.items(), key=lambda item: (item[0][0], item[0][1])):
        limit = max(r["median_s"] for r in results["no communication (limit)"]) if (
            "no communication (limit)" in results) else None
        plain_tx = statistics.fmean(r["tx_per_step"] for r in results["plain DDP"]) if "plain DDP" in results else None
        for label, kind, spec, scheme in CONFIGS:
            if label not in results:
                continue
            ranks = results[label]
            mean = lambda key: statistics.fmean(r[key] for r in ranks) if key in ranks[0] else None  # noqa: E731
            row = {"link": link, "world": world, "config": label, "kind": kind, "spec": spec, "scheme": scheme,
                   "schemes": ranks[0].get("schemes"), "tx_bytes_per_step": mean("tx_per_step"),
                   "rx_bytes_per_step": mean("rx_per_step"), "stats_wire_bytes_per_step": mean("wire_bytes_per_step"),
                   "stats_received_bytes_per_step": mean("received_bytes_per_step"),
                   "stats_raw_bytes_per_step": mean("raw_bytes_per_step"),
                   "median_ms": 1e3 * max(r["median_s"] for r in ranks)}
            row["tx_vs_stats"] = (row["tx_bytes_per_step"] / row["stats_wire_bytes_per_step"]
                                  if row["stats_wire_bytes_per_step"] else None)
            row["saving_vs_plain_measured"] = (plain_tx / row["tx_bytes_per_step"]
                                               if plain_tx and row["tx_bytes_per_step"] > 0 else None)
            row["saving_vs_plain_stats"] = (row["stats_raw_bytes_per_step"] / row["stats_wire_bytes_per_step"]
                                            if row["stats_wire_bytes_per_step"] else None)
            row["vs_limit"] = row["median_ms"] / (1e3 * limit) if limit else None
            rows.append(row)
    return rows


def formula_bytes(row: dict, world: int, numels: list[int]) -> float:
    """What gradcomp's stats formulas give a rank to send per step at world ranks for this configuration
    (the gathered codecs' scheme chosen per bucket at that world size, as the run would)."""
    ring = lambda nbytes: 2 * (world - 1) * nbytes / world  # noqa: E731
    if row["kind"] == "plain":
        return sum(ring(4 * n) for n in numels)
    codec = gradcomp.codec(row["spec"])
    if gradcomp.schemes.fixed_scheme(codec) is not None:  # allreduce and powersgd: what is summed, as a ring
        return ring(row["summed_bytes"])
    return sum(gradcomp.schemes.plan_class(codec, row["scheme"], n, torch.float32, world).expected_sent(
        codec, n, torch.float32, world) for n in numels)


def fit_bytes(rows: list[dict], numels: list[int]) -> dict[str, float]:
    """Per configuration: the factor between the eth0 counters and the stats formula (TCP/IP headers and
    ACKs), least squares over the unshaped points: the bytes model is that factor x the formula."""
    fits = {}
    summed = {r["config"]: r["stats_wire_bytes_per_step"] for r in rows if r["link"] == "unshaped" and r["world"] == 2}
    for row in rows:
        row["summed_bytes"] = summed.get(row["config"])  # at 2 ranks a ring sends what is summed, once
    for label in {r["config"] for r in rows if r["link"] == "unshaped" and r["kind"] != "limit"}:
        points = [(formula_bytes(r, r["world"], numels), r["tx_bytes_per_step"]) for r in rows
                  if r["link"] == "unshaped" and r["config"] == label]
        fits[label] = sum(f * t for f, t in points) / sum(f * f for f, _ in points)
    return fits


def fit_alpha_beta(rows: list[dict], buckets: float) -> tuple[float, float] | None:
    """Step time over the same W's limit = alpha x sequential messages + beta x bytes sent, shaped points."""
    shaped = [r for r in rows if r["link"] != "unshaped" and r["kind"] != "limit" and r["vs_limit"]]
    limits = {r["world"]: r["median_ms"] for r in rows if r["link"] != "unshaped" and r["kind"] == "limit"}
    if len(shaped) < 3:
        return None
    unshaped_tx = {(r["world"], r["config"]): r["tx_bytes_per_step"] for r in rows if r["link"] == "unshaped"}
    basis = np.array([[messages(r, buckets), unshaped_tx.get((r["world"], r["config"]), r["tx_bytes_per_step"])]
                      for r in shaped])
    extra = np.array([(r["median_ms"] - limits[r["world"]]) / 1e3 for r in shaped])
    (alpha, beta), *_ = np.linalg.lstsq(basis, extra, rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def extrapolate(rows, fits, alpha_beta, buckets, numels) -> list[dict]:
    compute = next((r["median_ms"] / 1e3 for r in rows if r["link"] != "unshaped" and r["kind"] == "limit"
                    and r["world"] == min(x["world"] for x in rows)), None)
    out = []
    plain_row = next(r for r in rows if r["config"] == "plain DDP")
    for label, factor in sorted(fits.items()):
        kind = next(r for r in rows if r["config"] == label and r["link"] == "unshaped")
        for world in EXTRAPOLATE:
            sent = factor * formula_bytes(kind, world, numels)
            plain = fits["plain DDP"] * formula_bytes(plain_row, world, numels)
            row = {"world": world, "config": label, "model_bytes_per_step": sent,
                   "saving_vs_plain": plain / sent if sent else None}
            if alpha_beta and compute:
                alpha, beta = alpha_beta
                probe = {**kind, "world": world}
                row["model_step_ms"] = 1e3 * (compute + alpha * messages(probe, buckets) + beta * sent)
                row["model_vs_compute"] = row["model_step_ms"] / (1e3 * compute)
            out.append(row)
    return out


def plot(rows: list[dict], model: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [c[0] for c in CONFIGS if c[1] != "limit" and any(r["config"] == c[0] for r in rows)]
    colors = {label: plt.cm.tab20(i % 20) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, 3, figsize=(19, 6))
    for label in labels:
        style = "--" if label.endswith("allgather") else "-"
        mine = sorted((r for r in rows if r["config"] == label and r["link"] == "unshaped"), key=lambda r: r["world"])
        if mine:
            axes[0].plot([r["world"] for r in mine], [r["tx_bytes_per_step"] / 1e6 for r in mine], style, marker="o",
                         color=colors[label], label=label)
            stats = [r for r in mine if r["stats_wire_bytes_per_step"]]
            axes[0].plot([r["world"] for r in stats], [r["stats_wire_bytes_per_step"] / 1e6 for r in stats], "x",
                         color=colors[label])
        extra = sorted((m for m in model if m["config"] == label), key=lambda m: m["world"])
        savings = [(r["world"], r["saving_vs_plain_measured"]) for r in mine if r["saving_vs_plain_measured"]]
        savings += [(m["world"], m["saving_vs_plain"]) for m in extra if m["saving_vs_plain"]]
        if savings and label != "plain DDP":
            axes[1].plot(*zip(*savings), style, marker=".", color=colors[label], label=label)
        shaped = sorted((r for r in rows if r["config"] == label and r["link"] != "unshaped"), key=lambda r: r["world"])
        if shaped:
            axes[2].plot([r["world"] for r in shaped], [r["vs_limit"] for r in shaped], style, marker="o",
                         color=colors[label], label=label)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set(title="bytes a rank sends per step (o: eth0 counters, x: gradcomp's stats)", xlabel="ranks",
                ylabel="MB per rank and step", yscale="log")
    axes[1].set(title="saving against plain DDP (measured; from 64 ranks: the fitted model)", xlabel="ranks",
                ylabel="plain DDP's bytes / the codec's", yscale="log")
    if model:
        axes[1].axvline(48, color="grey", lw=0.8, ls=":")
    axes[2].set(title="step time / no-communication limit, 1 Gbit/s per rank", xlabel="ranks", ylabel="x limit")
    axes[2].axhline(1.0, color="black", lw=0.8)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", help="world sizes (default 2 4 8 16; --quick: 2 3)")
    parser.add_argument("--configs", nargs="+", help="configuration labels (default: all)")
    parser.add_argument("--rate", default="1gbit", help="tc rate of each rank's link for the timed pass")
    parser.add_argument("--no-shaped", action="store_true", help="only the unshaped pass (bytes)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for one world size's pass")
    parser.add_argument("--quick", action="store_true", help="2 and 3 ranks, a few configurations, 2 steps")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank inside its namespace
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds = args.worlds or [2, 3]
        args.configs = args.configs or QUICK_CONFIGS
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 3)
    args.worlds = args.worlds or [2, 4, 8, 16]
    args.configs = args.configs or [c[0] for c in CONFIGS]
    unknown = sorted(set(args.configs) - {c[0] for c in CONFIGS})
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; valid: {[c[0] for c in CONFIGS]}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        finish_spawned_rank(args.rank, lambda _: rank_main(args))  # exits 0 (a gloo thread can abort shutdown)
        return 0
    if refused_without_shaping("scaling.py"):
        return 0
    configs = list(dict.fromkeys(["plain DDP", "no communication (limit)", *args.configs]))
    runs = {}
    for world in args.worlds:
        for rate in [None] + ([] if args.no_shaped else [args.rate]):
            started = time.perf_counter()
            runs[("unshaped" if rate is None else rate, world)] = run_world(args, world, rate, configs)
            print(f"{world:3d} ranks, {rate or 'unshaped':8s}: {time.perf_counter() - started:6.1f} s", flush=True)
    rows = table_rows(runs)
    numels = next(r["bucket_numels"] for ranks in runs.values() for label, r in
                  ((label, results[0]) for label, results in ranks.items()) if "bucket_numels" in r)
    buckets = len(numels)
    fits = fit_bytes(rows, numels)
    alpha_beta = fit_alpha_beta(rows, buckets)
    model = extrapolate(rows, fits, alpha_beta, buckets, numels) if "plain DDP" in fits else []

    print(f"\n{'config':32s} {'ranks':>5s} {'eth0 MB/step':>12s} {'stats MB':>9s} {'eth0/stats':>10s} "
          f"{'saving':>7s} {'1Gbit ms':>9s} {'x limit':>8s}")
    shaped = {(r["world"], r["config"]): r for r in rows if r["link"] != "unshaped"}
    for r in (r for r in rows if r["link"] == "unshaped"):
        timed = shaped.get((r["world"], r["config"]), {})
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{r['config']:32s} {r['world']:5d} {r['tx_bytes_per_step'] / 1e6:12.3f} "
              f"{fmt(r['stats_wire_bytes_per_step'] and r['stats_wire_bytes_per_step'] / 1e6, '9.3f')} "
              f"{fmt(r['tx_vs_stats'], '10.3f')} {fmt(r['saving_vs_plain_measured'], '7.1f')} "
              f"{fmt(timed.get('median_ms'), '9.1f')} {fmt(timed.get('vs_limit'), '8.2f')}")
    if alpha_beta:
        print(f"\nalpha {alpha_beta[0] * 1e6:.1f} us per message, beta {alpha_beta[1] * 1e9:.2f} ns per byte "
              f"({8 / alpha_beta[1] / 1e9 if alpha_beta[1] else float('inf'):.2f} Gbit/s)")
    for m in model:
        if m["world"] in (64, 1024):
            print(f"model {m['config']:32s} {m['world']:5d} ranks: {m['model_bytes_per_step'] / 1e6:9.3f} MB/step, "
                  f"saving {m['saving_vs_plain'] or 0:7.1f}x"
                  + (f", step {m['model_vs_compute']:.2f}x compute" if "model_vs_compute" in m else ""))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "scaling_quick" if args.quick else "scaling")
    parameters = sum(p.numel() for p in make_model().parameters())
    report = {"machine": machine(), "parameters": parameters, "gradient_bytes": 4 * parameters,
              "steps": args.steps, "warmup": args.warmup, "rate": args.rate, "worlds": args.worlds,
              "bucket_numels": numels, "rows": rows, "bytes_fit": fits, "alpha_beta": alpha_beta, "buckets": buckets, "model": model}
    write_results(stem, report, [{k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in r.items()}
                                 for r in rows])
    plot(rows, model, stem + ".png")
    print(f"wrote {stem}.json, .csv, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
