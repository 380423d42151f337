"""The hook's own time: what gradcomp's hook spends per bucket beyond the work it hands to torch, against torch's
allreduce hook, with every bucket sent plain (policy="time"'s choice where plain wins).

    python benchmarks/hook_overhead.py           # 2 ranks (gloo, loopback), the large-gradient MLP, 300 steps
    python benchmarks/hook_overhead.py --quick   # 20 steps

Why it matters: where the policy sends plain, its step should be plain DDP's. Both hooks divide the bucket and start
its allreduce; gradcomp's also finds the bucket's plan, counts its bytes and runs the step's machinery. Inside
backward that Python runs cold (backward's kernels have just swept the caches): on this machine a call of an empty
Python function there took about 4 us, 80 times its time in a loop, so the hook's time follows how much code a bucket
touches.

One process group runs torch's allreduce hook, gradcomp's hook with every bucket plain, and the no-communication
limit, one step of each in turn (in an order shuffled per step, the same on every rank, a barrier before each step).
Per hook call, its time less the time inside its division of the bucket and its all_reduce call (both wrapped here
to be timed): the hook's own time. Per configuration: the median step, its ratio to the limit's, the median own
time per call, and its step over torch's hook's, step by step (median). Beside them, the same run's time to copy a
bucket of the mean size once (memory bandwidth, as a yardstick). Results: hook_overhead[_quick].{json,csv,png} in
--out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import gradcomp
import gradcomp.policy as time_policy

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")]
from bench_common import ROOT, machine, write_results  # noqa: E402
from scaling import make_model as large_gradient_mlp, no_communication, sgd_step  # noqa: E402
from train_ddp import finish_spawned_rank  # noqa: E402

CONFIGS = ("torch's allreduce hook", "gradcomp, every bucket plain", "no communication (limit)")
WARMUP = 12  # DDP's bucket rebuild, the policy's warm-up steps and its decision


class OwnTime:
    """Times hook calls less the time inside the division and all_reduce calls they make (wrapped while it lives)."""

    def __init__(self):
        self.inside, self.calls = 0.0, {name: [] for name in CONFIGS}
        self._all_reduce, self._div = dist.all_reduce, torch.Tensor.div_
        dist.all_reduce, torch.Tensor.div_ = self._timed(self._all_reduce), self._timed(self._div)

    def _timed(self, function):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - started
        return timed

    def hook(self, name: str, hook):
        def timed_hook(state, bucket):
            self.inside, started = 0.0, time.perf_counter()
            future = hook(state, bucket)
            self.calls[name].append(time.perf_counter() - started - self.inside)
            return future
        return timed_hook

    def close(self) -> None:
        dist.all_reduce, torch.Tensor.div_ = self._all_reduce, self._div


def every_bucket_plain(decide):
    """The policy's decision with plain chosen for every bucket, whatever the cost model predicted."""
    def decide_plain(*args, **kwargs):
        decision = decide(*args, **kwargs)
        for bucket in decision["buckets"]:
            bucket["choice"] = "plain"
        return decision
    return decide_plain


def build(name: str, rank: int, own: OwnTime):
    """One configuration: (its step function, its state or None)."""
    model = large_gradient_mlp()
    ddp = DistributedDataParallel(model)
    state = None
    if name == CONFIGS[0]:
        ddp.register_comm_hook(None, own.hook(name, default_hooks.allreduce_hook))
    elif name == CONFIGS[1]:
        state = gradcomp.CompressionState("signsgd", policy="time", trial_steps=0, model=model)
        ddp.register_comm_hook(state, own.hook(name, gradcomp.hook))
    else:
        ddp.register_comm_hook(None, no_communication)
    return sgd_step(model, ddp, rank), state


def rank_main(rank: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=args.world)
    time_policy.decide = every_bucket_plain(time_policy.decide)
    own = OwnTime()
    configs = {name: build(name, rank, own) for name in CONFIGS}
    for _ in range(WARMUP):
        for step, _ in configs.values():
            step()
    state = configs[CONFIGS[1]][1]
    schemes = state.stats()["schemes"]
    bucket = torch.randn(sum(plan.numel for plan in state._plans.values()) // len(state._plans))
    copies = []
    for _ in range(21):
        started = time.perf_counter()
        bucket.clone()
        copies.append(time.perf_counter() - started)
    for calls in own.calls.values():
        calls.clear()
    order, seconds = random.Random(0), {name: [] for name in CONFIGS}
    for _ in range(args.steps):
        names = list(CONFIGS)
        order.shuffle(names)
        for name in names:
            dist.barrier()
            started = time.perf_counter()
            configs[name][0]()
            seconds[name].append(time.perf_counter() - started)
    own.close()
    slowest = {name: torch.tensor(s, dtype=torch.float64) for name, s in seconds.items()}
    for tensor in slowest.values():  # a step's time is its slowest rank's
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"seconds": {n: t.tolist() for n, t in slowest.items()}, "own_seconds": own.calls,
                       "schemes": schemes, "bucket_numel": bucket.numel(), "copy_s": statistics.median(copies)}, f)
    dist.destroy_process_group()


def summarize(measured: dict) -> list[dict]:
    seconds, own = measured["seconds"], measured["own_seconds"]
    limit = statistics.median(seconds[CONFIGS[2]])
    rows = []
    for name in CONFIGS:
        step = statistics.median(seconds[name])
        rows.append({"configuration": name, "step_ms": 1e3 * step, "vs_limit": step / limit,
                     "own_us_per_call": 1e6 * statistics.median(own[name]) if own[name] else 0.0,
                     "calls_per_step": len(own[name]) / len(seconds[name]),
                     "vs_torch_paired": statistics.median(a / b for a, b in zip(seconds[name], seconds[CONFIGS[0]]))})
    return rows


def plot(rows: list[dict], copy_us: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hooks = [row for row in rows if row["calls_per_step"]]
    fig, (own, steps) = plt.subplots(1, 2, figsize=(11, 4))
    own.bar([row["configuration"] for row in hooks], [row["own_us_per_call"] for row in hooks], color="tab:blue")
    own.axhline(copy_us, color="gray", linestyle="--", label=f"copy of a mean bucket: {copy_us:.0f} us")
    own.set_ylabel("the hook's own time per call (us)")
    own.legend(loc="upper left")
    steps.bar([row["configuration"] for row in rows], [row["vs_limit"] for row in rows], color="tab:orange")
    steps.set_ylabel("step / no-communication limit")
    for axis in (own, steps):
        axis.tick_params(axis="x", labelsize=7)
    fig.suptitle("gradcomp's hook sending every bucket plain, against torch's allreduce hook")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 steps")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--port", type=int, default=29641)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 20
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "hook_overhead" + ("_quick" if args.quick else ""))
    args.result = stem + ".raw.json"
    mp.spawn(finish_spawned_rank, args=(rank_main, args), nprocs=args.world)
    with open(args.result) as f:
        measured = json.load(f)
    os.remove(args.result)
    rows = summarize(measured)
    copy_us = 1e6 * measured["copy_s"]
    print(f"copy of a mean bucket ({measured['bucket_numel']} elements): {copy_us:.0f} us")
    print(f"{'configuration':30} {'step ms':>8} {'x limit':>8} {'own us/call':>12} {'calls/step':>11} "
          f"{'x torch (paired)':>17}")
    for row in rows:
        print(f"{row['configuration']:30} {row['step_ms']:8.2f} {row['vs_limit']:8.3f} {row['own_us_per_call']:12.1f} "
              f"{row['calls_per_step']:11.1f} {row['vs_torch_paired']:17.3f}")
    write_results(stem, {"machine": machine(), "world": args.world, "steps": args.steps,
                         "gradcomp_schemes": measured["schemes"], "bucket_numel": measured["bucket_numel"],
                         "copy_us": copy_us, "rows": rows}, rows)
    plot(rows, copy_us, stem + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
