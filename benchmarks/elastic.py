"""Elastic resume, accuracy: a run stopped halfway on 2 ranks and resumed on 3 or 4 with elastic=True (each new
rank takes the saved residuals' average) against the same run never stopped. accuracy_vs_ratio.py's recipe and
CNN; the global batch and the data each step sees are the same at every world size (the ranks split one
permutation), so the runs differ by the restart alone.

    python benchmarks/elastic.py                  # Fashion-MNIST, topk:ratio=0.01, seeds 0 1 2, resumed on 3 and 4
    python benchmarks/elastic.py --quick          # MNIST-1D, 8 epochs, one seed, resumed on 4 (a minute or two)

Results: elastic[_quick].{json,csv,png} in --out (default benchmarks/results/elastic/).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]
import accuracy_vs_ratio as sweep  # noqa: E402 - the data sets, model and recipe
from bench_common import machine  # noqa: E402


def _rank(rank: int, world: int, store: str, dataset: str, spec: str, seed: int, epochs: int, phase: dict,
          out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        loader, make_model, _, batch_size, lr = sweep.DATASETS[dataset]
        result = sweep.train_one(loader(), make_model, spec, seed, epochs, batch_size, lr, world, rank,
                                 torch.device("cpu"), **phase)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run(world: int, dataset: str, spec: str, seed: int, epochs: int, **phase) -> dict:
    """One phase on `world` fresh processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "result.json")
        mp.start_processes(sweep.main_job.finish_spawned_rank,  # exits 0 once done (a gloo thread can abort shutdown)
                           args=(_rank, world, os.path.join(scratch, "store"), dataset, spec, seed, epochs, phase, out),
                           nprocs=world, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dataset", choices=list(sweep.DATASETS), help="default fashion (quick: mnist1d)")
    parser.add_argument("--spec", default="topk:ratio=0.01")
    parser.add_argument("--seeds", nargs="+", type=int, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--epochs", type=int, help="default the data set's (quick: 8)")
    parser.add_argument("--saved-world", type=int, default=2)
    parser.add_argument("--worlds", nargs="+", type=int, help="the world sizes resumed on (default 3 4; quick: 4)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "elastic"))
    args = parser.parse_args(argv)
    dataset = args.dataset or ("mnist1d" if args.quick else "fashion")
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    worlds = args.worlds or ([4] if args.quick else [3, 4])
    epochs = args.epochs or (8 if args.quick else sweep.DATASETS[dataset][2])
    half = epochs // 2
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in seeds:
            straight = run(args.saved_world, dataset, args.spec, seed, epochs)
            checkpoint = os.path.join(scratch, f"seed{seed}.pt")
            run(args.saved_world, dataset, args.spec, seed, epochs, stop_after=half, save_to=checkpoint)
            rows.append({"seed": seed, "run": f"{args.saved_world} ranks, never stopped",
                         "test_acc": straight["test_acc"], "ratio": straight["ratio"]})
            print(f"seed {seed}: {rows[-1]['run']}: {straight['test_acc']:.2f}%", flush=True)
            for world in worlds:
                resumed = run(world, dataset, args.spec, seed, epochs, resume_from=checkpoint)
                rows.append({"seed": seed, "run": f"{args.saved_world} ranks to epoch {half}, then {world}",
                             "test_acc": resumed["test_acc"], "ratio": resumed["ratio"],
                             "vs_straight": resumed["test_acc"] - straight["test_acc"]})
                print(f"seed {seed}: {rows[-1]['run']}: {resumed['test_acc']:.2f}% "
                      f"({rows[-1]['vs_straight']:+.2f} points)", flush=True)
    summary = []
    for name in dict.fromkeys(r["run"] for r in rows):
        accs = [r["test_acc"] for r in rows if r["run"] == name]
        deltas = [r["vs_straight"] for r in rows if r["run"] == name and "vs_straight" in r]
        summary.append({"run": name, "acc_mean": statistics.fmean(accs),
                        "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                        "vs_straight_mean": statistics.fmean(deltas) if deltas else None,
                        "vs_straight_worst": max(deltas, key=abs) if deltas else None})
    write(args, dataset, epochs, seeds, rows, summary)


def write(args, dataset, epochs, seeds, rows, summary) -> None:
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "elastic_quick" if args.quick else "elastic")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine(), "dataset": dataset, "spec": args.spec, "epochs": epochs, "seeds": seeds,
                   "runs": rows, "summary": summary}, f, indent=1)
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["seed", "run", "test_acc", "ratio", "vs_straight"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{'run':40s} {'accuracy':>16s} {'vs never stopped':>18s}")
    for s in summary:
        delta = "" if s["vs_straight_mean"] is None else \
            f"{s['vs_straight_mean']:+.2f} (worst {s['vs_straight_worst']:+.2f})"
        print(f"{s['run']:40s} {s['acc_mean']:8.2f} +- {s['acc_std']:.2f} {delta:>18s}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["run"] for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, name in enumerate(names):
        accs = [r["test_acc"] for r in rows if r["run"] == name]
        ax.scatter([i] * len(accs), accs, color="tab:blue")
        ax.errorbar([i], [statistics.fmean(accs)], yerr=[statistics.stdev(accs) if len(accs) > 1 else 0],
                    color="black", marker="_", markersize=20, capsize=4)
    ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names])
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title(f"{dataset}, {args.spec}: resumed on other world sizes (elastic=True), {len(seeds)} seed(s)")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    print(f"wrote {stem}.json, .csv, .png")


if __name__ == "__main__":
    main()
