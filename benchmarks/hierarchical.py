"""Bytes across each node's link, and step time, on emulated nodes: the flat schemes against the hierarchical one.

    sudo python benchmarks/hierarchical.py            # (N, L) = (2, 1), (2, 2), (2, 4), (4, 2) (about 15 minutes)
    sudo python benchmarks/hierarchical.py --quick    # (2, 2), a few configurations and steps

N nodes of L ranks: each node is a network namespace (`ip netns add`) holding its L ranks, which talk to each
other over its loopback; its eth0 is one end of a veth pair whose other end joins one bridge, so every byte that
leaves a node crosses its own eth0. Two passes per layout:
    unshaped: the bytes each node sends per step, read from the kernel's counters of its eth0
        (/sys/class/net/eth0/statistics/tx_bytes: payload plus TCP/IP headers and ACKs), next to what gradcomp's
        stats report for the same steps (node_link_bytes: what the node's ranks send across its link);
    1 Gbit/s: a tc token bucket on both ends of each node's veth, and the step time (the median over the measured
        steps of the slowest rank), as ratios to plain DDP and to the no-communication limit of the same layout.
Every codec runs flat (scheme="flat": allgather, two-phase, allreduce or powersgd, as at W ranks) and
hierarchical (scheme="hierarchical", node_size=L). At one rank per node the hierarchical scheme
is the flat one: that layout is the saving a codec gets when nothing shares a node. The model (MLP, 2.4M
parameters, a 9.5 MB fp32 gradient, batch 8 per rank) has a large gradient and little compute; with W ranks on a
few cores the compute is shared W ways, so step times are compared within a layout only.

The report (hierarchical[_quick].{json,csv,png} in --out) gives per layout and configuration the bytes per node
and step, measured and from the stats, the saving against plain DDP across the node boundary, and the step time;
and per codec the target: at (2, 4) the hierarchical scheme's saving is at least 0.9x the saving at (2, 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")]
from bench_common import (Namespaces, machine, namespace_rank_main, run_rank_commands, shaping_problem,  # noqa: E402
                          write_results)
from scaling import make_model, measure  # noqa: E402 - the flat scaling runs' model, and how a configuration is run
from train_ddp import finish_spawned_rank  # noqa: E402

LAYOUTS = [(2, 1), (2, 2), (2, 4), (4, 2)]
QUICK_LAYOUTS = [(2, 2)]
CODECS = ["fp16", "signsgd", "terngrad", "qsgd", "topk:ratio=0.01", "randomk:ratio=0.01", "powersgd:rank=4"]
# (label, kind, spec, scheme): kind "plain" (no hook), "limit" (no communication) or "gradcomp".
CONFIGS = [("plain DDP", "plain", None, None), ("no communication (limit)", "limit", None, None)]
CONFIGS += [(f"{spec} flat", "gradcomp", spec, "flat") for spec in CODECS]
CONFIGS += [(f"{spec} hierarchical", "gradcomp", spec, "hierarchical") for spec in CODECS]
QUICK_CONFIGS = ["plain DDP", "no communication (limit)", "signsgd flat", "signsgd hierarchical",
                 "topk:ratio=0.01 flat", "topk:ratio=0.01 hierarchical"]
TARGET = 0.9  # at (2, 4): the hierarchical saving over the saving at one rank per node
SUBNET = "10.79.0"


STATS_KEYS = ("node_link_bytes", "node_link_raw_bytes", "wire_bytes", "raw_bytes")


def rank_main(args) -> None:
    """One rank, inside its node's namespace: every configuration in turn; rank 0 writes what all measured."""
    namespace_rank_main(args, SUBNET, CONFIGS,
                        lambda kind, spec, scheme: measure(args.rank, kind, spec, scheme, args,
                                                           {"node_size": args.node_size}, STATS_KEYS))


# -- the namespaces ----------------------------------------------------------------------------------------------------

def run_layout(args, nodes: int, node_size: int, rate: str | None, configs: list[str]) -> dict:
    """Every configuration on nodes x node_size ranks: {label: [each rank's result]}."""
    world = nodes * node_size
    with tempfile.TemporaryDirectory() as tmp, Namespaces("gch", nodes, SUBNET, rate) as namespaces:
        out = os.path.join(tmp, "result.json")
        environment = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        environment.pop("LOCAL_WORLD_SIZE", None)
        commands = [["ip", "netns", "exec", namespaces.namespace(rank // node_size), sys.executable,
                     os.path.abspath(__file__), "--rank", str(rank), "--world", str(world), "--node-size",
                     str(node_size), "--port", "29400", "--rank-out", out, "--steps", str(args.steps), "--warmup",
                     str(args.warmup), "--configs", *configs] for rank in range(world)]
        return run_rank_commands(commands, environment, out, args.timeout,
                                 f"{nodes} x {node_size} ranks ({rate or 'unshaped'})")


# -- the report --------------------------------------------------------------------------------------------------------

def table_rows(runs: dict) -> list[dict]:
    """One row per (link, layout, configuration): bytes per node (the mean over the nodes, each read by its first
    rank), and the step time of the slowest rank."""
    rows = []
    for (link, nodes, size), results in sorted(runs.items()):
        firsts = lambda ranks: ranks[::size]  # noqa: E731 - each node's first rank
        limit = max(r["median_s"] for r in results["no communication (limit)"]) if (
            "no communication (limit)" in results) else None
        plain = results.get("plain DDP")
        plain_tx = statistics.fmean(r["tx_per_step"] for r in firsts(plain)) if plain else None
        plain_s = max(r["median_s"] for r in plain) if plain else None
        for label, kind, spec, scheme in CONFIGS:
            if label not in results:
                continue
            ranks = results[label]
            mean = lambda key: statistics.fmean(r[key] for r in firsts(ranks)) if key in ranks[0] else None  # noqa
            row = {"link": link, "nodes": nodes, "node_size": size, "world": nodes * size, "config": label,
                   "kind": kind, "spec": spec, "scheme": scheme, "schemes": ranks[0].get("schemes"),
                   "node_tx_bytes_per_step": mean("tx_per_step"),  # each node's eth0, read by its first rank
                   "stats_node_link_bytes_per_step": mean("node_link_bytes_per_step"),
                   "stats_node_link_raw_bytes_per_step": mean("node_link_raw_bytes_per_step"),
                   "median_ms": 1e3 * max(r["median_s"] for r in ranks)}
            stats = row["stats_node_link_bytes_per_step"]
            row["tx_vs_stats"] = row["node_tx_bytes_per_step"] / stats if stats else None
            row["saving_vs_plain_measured"] = (plain_tx / row["node_tx_bytes_per_step"] if plain_tx and
                                               kind != "limit" and row["node_tx_bytes_per_step"] > 0 else None)
            row["vs_limit"] = row["median_ms"] / (1e3 * limit) if limit else None
            row["vs_plain"] = row["median_ms"] / (1e3 * plain_s) if plain_s else None
            rows.append(row)
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """Per codec: the hierarchical saving at (2, 4) over the saving at (2, 1) (one rank per node), unshaped."""
    saving = {(r["nodes"], r["node_size"], r["config"]): r["saving_vs_plain_measured"] for r in rows
              if r["link"] == "unshaped"}
    out = []
    for spec in CODECS:
        alone, shared = saving.get((2, 1, f"{spec} flat")), saving.get((2, 4, f"{spec} hierarchical"))
        flat = saving.get((2, 4, f"{spec} flat"))
        kept = shared / alone if alone and shared else None
        out.append({"codec": spec, "saving at (2, 1)": alone, "saving at (2, 4)": shared,
                    "flat saving at (2, 4)": flat, "kept": kept,
                    "met": None if kept is None else kept >= TARGET})
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({(r["nodes"], r["node_size"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    for i, spec in enumerate(CODECS):
        for scheme, style in (("flat", "--"), ("hierarchical", "-")):
            points = [(f"{n}x{s}", r["saving_vs_plain_measured"]) for n, s in layouts for r in rows
                      if r["link"] == "unshaped" and (r["nodes"], r["node_size"]) == (n, s)
                      and r["config"] == f"{spec} {scheme}"]
            if points:
                axes[0].plot(*zip(*points), style, color=f"C{i}", marker="o", label=f"{spec} {scheme}")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("nodes x ranks per node")
    axes[0].set_ylabel("saving vs plain DDP across the node boundary (eth0 bytes)")
    axes[0].set_title("dashed: flat schemes; solid: hierarchical", fontsize=9)
    axes[0].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    shaped = [r for r in rows if r["link"] != "unshaped" and r["vs_limit"]]
    labels = [c[0] for c in CONFIGS if any(r["config"] == c[0] for r in shaped)]
    for offset, (n, s) in enumerate(layouts):
        values = [next((r["vs_limit"] for r in shaped if r["config"] == label and (r["nodes"], r["node_size"]) ==
                        (n, s)), 0) for label in labels]
        axes[1].bar([i + 0.8 * offset / len(layouts) for i in range(len(labels))], values,
                    width=0.8 / len(layouts), label=f"{n}x{s}")
    axes[1].set_xticks(range(len(labels)), labels, rotation=75, fontsize=6)
    axes[1].set_ylabel("step time / no-communication limit (1 Gbit/s per node)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="(2, 2) only, a few configurations and steps")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the results in --out")
    parser.add_argument("--layouts", nargs="+", help="N x L, e.g. 2x4 4x2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rate", default="1gbit", help="each node's link for the timed pass (tc rate)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    # One rank (inside a namespace), started by the driver:
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--node-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        finish_spawned_rank(args.rank, lambda _: rank_main(args))  # exits 0 (a gloo thread can abort shutdown)
    stem = os.path.join(args.out, "hierarchical_quick" if args.quick else "hierarchical")
    if args.replot:
        with open(stem + ".json") as f:
            plot(json.load(f)["rows"], stem + ".png")
        print(f"redrew {stem}.png")
        return 0
    problem = shaping_problem()
    if problem:
        print(f"hierarchical.py needs root for its network namespaces: {problem}; nothing measured")
        return 0
    if args.quick:
        args.steps, args.warmup = 3, 3
    layouts = ([tuple(int(x) for x in text.split("x")) for text in args.layouts] if args.layouts
               else QUICK_LAYOUTS if args.quick else LAYOUTS)
    configs = QUICK_CONFIGS if args.quick else [c[0] for c in CONFIGS]
    runs = {}
    started = time.perf_counter()
    for nodes, size in layouts:
        for link, rate in (("unshaped", None), (args.rate, args.rate)):
            print(f"-- {nodes} nodes x {size} ranks, {link}", flush=True)
            runs[(link, nodes, size)] = run_layout(args, nodes, size, rate, configs)
    rows = table_rows(runs)
    goals = targets(rows)
    print(f"{'layout':7s} {'link':9s} {'configuration':32s} {'node MB/step':>12s} {'stats MB':>9s} {'eth0/stats':>10s} "
          f"{'saving':>7s} {'vs limit':>8s} {'vs plain':>8s}")
    for r in rows:
        cell = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"{r['nodes']}x{r['node_size']:<5d} {r['link']:9s} {r['config']:32s} "
              f"{cell(r['node_tx_bytes_per_step'] / 1e6, '12.3f')} "
              f"{cell(r['stats_node_link_bytes_per_step'] and r['stats_node_link_bytes_per_step'] / 1e6, '9.3f')} "
              f"{cell(r['tx_vs_stats'], '10.3f')} {cell(r['saving_vs_plain_measured'], '7.1f')} "
              f"{cell(r['vs_limit'], '8.2f')} {cell(r['vs_plain'], '8.2f')}")
    for goal in goals:
        verdict = "not measured" if goal["met"] is None else "met" if goal["met"] else "MISSED"
        print(f"target {goal['codec']}: saving at (2, 4) {goal['saving at (2, 4)']} over (2, 1) "
              f"{goal['saving at (2, 1)']} = {goal['kept']} ({verdict})")
    os.makedirs(args.out, exist_ok=True)
    parameters = sum(p.numel() for p in make_model().parameters())
    report = {"machine": machine(), "parameters": parameters, "gradient_bytes": 4 * parameters, "steps": args.steps,
              "warmup": args.warmup, "rate": args.rate, "elapsed_s": round(time.perf_counter() - started),
              "rows": rows, "targets": goals}
    write_results(stem, report, rows)
    plot(rows, stem + ".png")
    print(f"wrote {stem}.json, .csv, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
