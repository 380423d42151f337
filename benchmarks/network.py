"""Step time of DDP on a shaped link: every gradcomp codec against plain allreduce, torch's own hooks
and a hook that communicates nothing (the limit).

    sudo python benchmarks/network.py              # 1 and 10 Gbit/s, 2 ranks, ResNet-18 (about 10 minutes)
    python benchmarks/network.py --no-shaping      # the host's own loopback, no root needed
    python benchmarks/network.py --tiny            # a small model and a few steps (shaped only when root)

All ranks run inside a network namespace whose loopback carries a tc token-bucket rate limit
(`ip netns add NS; ip netns exec NS ip link set lo up; ip netns exec NS tc qdisc add dev lo root
tbf rate 1gbit ...`), every rank on 127.0.0.1, so all gloo traffic crosses the shaped link. The
script sets the namespace up and tears it down itself; that needs root (CAP_NET_ADMIN), and without
it the script says so and exits cleanly. Loopback has one queue for both directions: the rate is
shared by everything the ranks send.

The model is ResNet-18 for 32x32 images (11.2M parameters, a 44.7 MB fp32 gradient: large enough
for the link to matter). Per hook: warm-up steps (past DDP's bucket rebuild and gradcomp's
start_iter), then the median wall time of a full step (forward, backward with the hook, SGD step)
on rank 0. The limit is the same step with a hook that returns the local gradient untouched.
Results: network[_tiny].{json,csv,png} in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gradcomp

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")]
from bench_common import machine, shaping_problem, write_results  # noqa: E402
from train_ddp import find_free_port, finish_spawned_rank  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POWERSGD_RANK = 2
ONE_BUCKET_MB = 1024  # DDP's bucket cap that puts the whole gradient in one bucket
# (label, kind, spec, bucket_cap_mb): kind "plain" (no hook), "limit", "torch-fp16", "torch-powersgd" or
# "gradcomp"; bucket_cap_mb None is DDP's default (25 MB). torch's powerSGD_hook runs with one bucket:
# it starts Q's allreduce from P's callback, and with several buckets on gloo the ranks then issue
# them in different orders and gloo aborts ("Received data size doesn't match"); gradcomp's powersgd
# runs both ways, one bucket being the like-for-like comparison.
HOOKS = [("allreduce (plain DDP)", "plain", None, None), ("no communication (limit)", "limit", None, None),
         ("torch fp16_compress_hook", "torch-fp16", None, None),
         (f"torch powerSGD_hook rank {POWERSGD_RANK}, one bucket", "torch-powersgd", None, ONE_BUCKET_MB)]
HOOKS += [(f"gradcomp {spec}", "gradcomp", spec, None) for spec in
          ("none", "fp16", "bf16", "signsgd", "terngrad", "qsgd", "topk:ratio=0.01", "randomk:ratio=0.01",
           f"powersgd:rank={POWERSGD_RANK}")]
HOOKS += [(f"gradcomp powersgd:rank={POWERSGD_RANK}, one bucket", "gradcomp", f"powersgd:rank={POWERSGD_RANK}",
           ONE_BUCKET_MB)]
RATES = ["1gbit", "10gbit"]


# -- the model ---------------------------------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18(num_classes: int = 10, width: int = 64) -> nn.Module:
    """ResNet-18 for 32x32 inputs (3x3 stem, no max-pool), as in the CIFAR literature."""
    layers, c_in = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()], width
    for i, c_out in enumerate((width, 2 * width, 4 * width, 8 * width)):
        layers += [BasicBlock(c_in, c_out, 1 if i == 0 else 2), BasicBlock(c_out, c_out, 1)]
        c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes)]
    return nn.Sequential(*layers)


# -- the ranks ---------------------------------------------------------------------------------------------------------

def no_communication(_, bucket):
    """The limit's hook: the local gradient, untouched (a CUDA-aware future for a CUDA bucket)."""
    buffer = bucket.buffer()
    done = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
    done.set_result(buffer)
    return done


def attach(ddp: DistributedDataParallel, kind: str, spec: str | None):
    """Registers the hook; returns gradcomp's state (None for the others)."""
    if kind == "limit":
        ddp.register_comm_hook(None, no_communication)
    elif kind == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif kind == "gradcomp":
        return gradcomp.register(ddp, spec)
    return None


def measure(rank: int, world: int, kind: str, spec: str | None, bucket_cap_mb: float | None, args) -> dict:
    torch.manual_seed(0)
    model = resnet18(width=args.width)
    ddp = DistributedDataParallel(model, **({"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb else {}))
    state = attach(ddp, kind, spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()  # every step starts together: the skew of one step does not leak into the next
        started = time.perf_counter()
        loss = nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    result = {"median_s": statistics.median(times[args.warmup:]), "min_s": min(times[args.warmup:]),
              "max_s": max(times[args.warmup:]), "steps": args.steps, "loss": loss.item()}
    if state is not None:
        last = state.stats()["last"]
        result.update(wire_bytes_per_step=last["wire_bytes"], raw_bytes_per_step=last["raw_bytes"])
    return result


def rank_main(rank: int, world: int, port: int, args, out_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for label, kind, spec, bucket_cap_mb in HOOKS:
            if args.hooks and label not in args.hooks and (spec or kind) not in args.hooks:
                continue
            result = measure(rank, world, kind, spec, bucket_cap_mb, args)
            worst = torch.tensor([result["median_s"], result["min_s"], result["max_s"]], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
            result["median_s"], result["min_s"], result["max_s"] = worst.tolist()
            results[label] = result
            if rank == 0:
                print(f"  {label:36s} {1e3 * result['median_s']:8.1f} ms", flush=True)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def worker(args) -> None:
    """Runs every hook on args.nprocs local ranks (on whatever loopback this process sees)."""
    # The ranks run on the CPUs: hide any GPU from them, since torch's powerSGD_hook synchronizes CUDA wherever it is
    # available, CPU tensors or not ("Expected a cuda device, but got: cpu").
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    mp.spawn(finish_spawned_rank, args=(rank_main, args.nprocs, find_free_port(), args, args.worker_out),
             nprocs=args.nprocs, join=True)


# -- the shaped link ---------------------------------------------------------------------------------------------------

def run_worker(args, rate: str | None) -> dict:
    """One worker process for one link: inside a fresh namespace shaped to `rate`, or unshaped (None)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker-out", out, "--nprocs", str(args.nprocs),
                   "--threads", str(args.threads), "--batch", str(args.batch), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--width", str(args.width)]
        if args.hooks:
            command += ["--hooks", *args.hooks]
        if rate is None:
            subprocess.run(command, check=True)
        else:
            namespace = f"gradcomp-bench-{os.getpid()}"
            burst = "1mb" if rate.startswith("10") else "128kb"  # at least the 64 KB loopback MTU
            setup = [["ip", "netns", "add", namespace],
                     ["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"],
                     ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                      "rate", rate, "burst", burst, "latency", "100ms"]]
            try:
                for step in setup:
                    subprocess.run(step, check=True)
                subprocess.run(["ip", "netns", "exec", namespace, *command], check=True)
            finally:
                subprocess.run(["ip", "netns", "del", namespace], check=False, stderr=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


# -- the report --------------------------------------------------------------------------------------------------------

def table_rows(results: dict[str, dict]) -> list[dict]:
    rows = []
    for link, by_hook in results.items():
        limit = by_hook.get("no communication (limit)", {}).get("median_s")
        for label, r in by_hook.items():
            rows.append({"link": link, "hook": label, "median_ms": 1e3 * r["median_s"],
                         "min_ms": 1e3 * r["min_s"], "max_ms": 1e3 * r["max_s"],
                         "vs_limit": r["median_s"] / limit if limit else None,
                         "wire_mb_per_step": r["wire_bytes_per_step"] / 1e6 if "wire_bytes_per_step" in r else None})
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    hooks = list(dict.fromkeys(r["hook"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(hooks) * len(links) + 1.5))
    height = 0.8 / len(links)
    for i, link in enumerate(links):
        values = {r["hook"]: r["median_ms"] for r in rows if r["link"] == link}
        positions = [h + i * height for h in range(len(hooks))]
        bars = ax.barh(positions, [values.get(h, 0) for h in hooks], height=height, label=link)
        limit = values.get("no communication (limit)")
        for bar, hook in zip(bars, hooks):
            if limit and hook in values:
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {values[hook] / limit:.2f}x",
                        va="center", fontsize=7)
    ax.set_yticks([h + 0.4 - height / 2 for h in range(len(hooks))])
    ax.set_yticklabels(hooks, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms); labels: ratio to the no-communication limit on the same link")
    ax.set_title(title)
    ax.legend(title="link")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=RATES, help="tc rates of the shaped links (default: 1gbit 10gbit)")
    parser.add_argument("--no-shaping", action="store_true", help="run on the host's loopback as it is")
    parser.add_argument("--tiny", action="store_true",
                        help="a narrow ResNet-18, 3 steps: a smoke test (shaped at 1gbit when root, else unshaped)")
    parser.add_argument("--hooks", nargs="+", metavar="LABEL_OR_SPEC", help="only these hooks (labels or specs)")
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--batch", type=int, default=16, help="images per rank per step")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per hook")
    parser.add_argument("--warmup", type=int, default=4, help="steps before measuring (>= gradcomp's start_iter 2)")
    parser.add_argument("--width", type=int, default=64, help="ResNet width (64: ResNet-18's 11.2M parameters)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # internal: run the ranks here, write this file
    args = parser.parse_args(argv)
    if args.tiny:
        args.width, args.batch, args.steps, args.warmup = 8, 4, 3, 3
        args.rates = args.rates[:1]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker_out:
        worker(args)
        return 0
    problem = None if args.no_shaping else shaping_problem()
    if problem and not args.tiny:
        print(f"network.py: cannot shape a link here: {problem}.\n"
              f"Run it as root for the shaped measurement, or with --no-shaping to measure the host's own loopback.")
        return 0
    links = [None] if (args.no_shaping or problem) else args.rates
    if problem:
        print(f"network.py --tiny: {problem}; measuring on the unshaped loopback instead")
    parameters = sum(p.numel() for p in resnet18(width=args.width).parameters())
    print(f"ResNet-18 (width {args.width}): {parameters / 1e6:.1f}M parameters, {4 * parameters / 1e6:.1f} MB "
          f"gradient; {args.nprocs} ranks, batch {args.batch} per rank, median of {args.steps} steps")
    started = time.time()
    results = {}
    for rate in links:
        link = rate or "unshaped loopback"
        print(f"{link}:", flush=True)
        results[link] = run_worker(args, rate)
    rows = table_rows(results)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "network" + ("_tiny" if args.tiny else ""))
    report = {"machine": machine(), "model": f"resnet18 width {args.width}", "parameters": parameters,
              "gradient_bytes": 4 * parameters, "world_size": args.nprocs, "batch_per_rank": args.batch,
              "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
              "seconds": time.time() - started, "rows": rows, "results": results}
    write_results(stem, report, rows)
    plot(rows, stem + ".png", f"DDP step time, ResNet-18 ({4 * parameters / 1e6:.0f} MB gradient), "
                              f"{args.nprocs} ranks, gloo on a shaped loopback")
    print(f"\n{'link':18s} {'hook':36s} {'median ms':>10s} {'vs limit':>9s} {'MB/step':>8s}")
    for r in rows:
        vs = f"{r['vs_limit']:.2f}x" if r["vs_limit"] else "-"
        mb = f"{r['wire_mb_per_step']:.2f}" if r["wire_mb_per_step"] is not None else "-"
        print(f"{r['link']:18s} {r['hook']:36s} {r['median_ms']:10.1f} {vs:>9s} {mb:>8s}")
    print(f"wrote {stem}.json, .csv and .png in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
