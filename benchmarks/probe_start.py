"""A lone collective's time on gloo behind a slow link, by how its ranks start: as they come, or together.

    sudo python benchmarks/probe_start.py            # 2 ranks behind 100 Mbit/s, 1-8 MiB, 10 runs of each (2 minutes)
    sudo python benchmarks/probe_start.py --quick    # 1 Gbit/s, 64 KiB and 1 MiB, 3 runs of each

Why it matters: gloo sends only into a receive its peer has posted, and the notices that a receive is posted travel
on the same TCP stream as the data. A rank that starts after its peer's notice has arrived writes its data at once,
and its own notice behind it; the peer's data waits until that has crossed the link. Run after run, the rank that
finished last starts last again. gradcomp's policy probes each collective kind alone (gradcomp.measure) to price the
link, so it starts every run together, a one-element allreduce first, and keeps the least of a few.

Each rank runs in a network namespace of its own behind --rate (bench_common.Namespaces). For each kind (all-gather,
all-to-all, allreduce) and size per rank: one untimed run, then --runs back to back as they come (a rank starts its
next run when its last ends), then --runs each after the one-element allreduce. Per run, rank 0's milliseconds.
Beside them the link's time: the bytes a rank sends (all-gather (W-1)x the size, all-to-all (W-1)/W x, allreduce's
ring 2(W-1)/W x) at the rate, without TCP's headers: the floor. Results: probe_start[_quick].{json,csv,png} in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

from gradcomp.measure import collective_launcher

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")]
from bench_common import ROOT, machine, refused_without_shaping, run_in_namespaces, write_results  # noqa: E402
from train_ddp import finish_spawned_rank  # noqa: E402

SUBNET = "10.252.252"
KINDS = ("all-gather", "all-to-all", "allreduce")
STARTS = ("as they come", "together")
SENT_PER_BYTE = {"all-gather": lambda w: w - 1, "all-to-all": lambda w: (w - 1) / w,
                 "allreduce": lambda w: 2 * (w - 1) / w}


def rank_main(rank: int, args) -> None:
    """One rank, inside its namespace: every kind, size and start in turn; rank 0 writes its runs' seconds."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{SUBNET}.1:{args.port}", rank=rank, world_size=args.world)
    together = torch.zeros(1)
    try:
        runs = {}
        for kind in args.kinds:
            for size in args.sizes:
                _, run = collective_launcher(None, kind, size, torch.device("cpu"))  # as the policy probes it
                run().wait()
                for start in STARTS:
                    seconds = []
                    for _ in range(args.runs):
                        if start == "together":
                            dist.all_reduce(together, async_op=True).wait()
                        began = time.perf_counter()
                        run().wait()
                        seconds.append(time.perf_counter() - began)
                    runs[f"{kind}|{size}|{start}"] = seconds
        if rank == 0:
            with open(args.rank_out, "w") as f:
                json.dump(runs, f)
    finally:
        dist.destroy_process_group()


def bytes_per_second(rate: str) -> float:
    """tc's rate ("100mbit", "1gbit", "500kbit") in bytes per second."""
    number, unit = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.lower()).groups()
    return float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit] / 8


def table_rows(runs: dict, world: int, rate: str) -> list[dict]:
    rows = []
    for key, seconds in runs.items():
        kind, size, start = key.split("|")
        link = SENT_PER_BYTE[kind](world) * int(size) / bytes_per_second(rate)
        least, median = min(seconds), statistics.median(seconds)
        rows.append({"kind": kind, "bytes": int(size), "start": start, "runs_ms": [1e3 * s for s in seconds],
                     "least_ms": 1e3 * least, "median_ms": 1e3 * median, "link_ms": 1e3 * link,
                     "least_vs_link": least / link, "median_vs_link": median / link,
                     "near_least": sum(s <= 1.1 * least for s in seconds) / len(seconds)})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(KINDS), figsize=(4.2 * len(KINDS), 3.6), sharey=True)
    for ax, kind in zip(axes, KINDS):
        for start, color, nudge in zip(STARTS, ("tab:red", "tab:blue"), (0.93, 1.07)):
            points = [(r["bytes"] * nudge, ms / r["link_ms"]) for r in rows if (r["kind"], r["start"]) == (kind, start)
                      for ms in r["runs_ms"]]
            if points:
                ax.scatter(*zip(*points), s=14, color=color, alpha=0.7, label=start)
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(kind)
        ax.set_xlabel("bytes per rank")
    axes[0].set_ylabel("run / the link's time")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rate", default="100mbit", help="tc rate of each rank's link, e.g. 100mbit or 1gbit")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 2 << 20, 4 << 20, 8 << 20],
                        help="bytes per rank")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--runs", type=int, default=10, help="timed runs of each kind, size and start")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--quick", action="store_true", help="1 Gbit/s, 64 KiB and 1 MiB, 3 runs")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank inside its namespace
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rate, args.sizes, args.runs = "1gbit", [64 << 10, 1 << 20], 3
    if not re.fullmatch(r"[0-9.]+[kmg]?bit", args.rate.lower()):
        parser.error(f"--rate {args.rate!r}: a tc rate in bits per second, e.g. 100mbit, 1gbit or 500kbit")
    bad = [s for s in args.sizes if s < 4 * args.world]
    if args.world < 2 or args.runs < 1 or bad:
        parser.error(f"need --world >= 2 (got {args.world}), --runs >= 1 (got {args.runs}) and --sizes of at least "
                     f"4 bytes per rank (got {bad})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        finish_spawned_rank(args.rank, rank_main, args)  # exits 0 (a gloo thread can abort shutdown)
        return 0
    if refused_without_shaping("probe_start.py"):
        return 0
    arguments = ["--runs", str(args.runs), "--sizes", *map(str, args.sizes),
                 "--kinds", *args.kinds]
    runs = run_in_namespaces("gcq", args.world, SUBNET, args.rate, __file__, 29450, arguments, args.timeout,
                             f"{args.world} ranks behind {args.rate}")
    rows = table_rows(runs, args.world, args.rate)
    print(f"{'kind':11s} {'bytes':>9s} {'start':13s} {'link ms':>8s} {'least':>6s} {'median':>7s} {'near least':>10s}"
          f"  (least and median as multiples of the link's time)")
    for r in rows:
        print(f"{r['kind']:11s} {r['bytes']:9d} {r['start']:13s} {r['link_ms']:8.1f} {r['least_vs_link']:6.2f} "
              f"{r['median_vs_link']:7.2f} {r['near_least']:10.0%}")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "probe_start_quick" if args.quick else "probe_start")
    report = {"machine": machine(), "world": args.world, "rate": args.rate, "runs": args.runs, "rows": rows}
    write_results(stem, report, [{**r, "runs_ms": json.dumps([round(ms, 3) for ms in r["runs_ms"]])} for r in rows])
    plot(rows, stem + ".png")
    print(f"wrote {stem}.json, .csv, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
