"""What the benchmark scripts share: the machine a result came from, writing JSON and CSV, and whether
this process can shape links."""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import gradcomp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine() -> dict:
    """CPU, cores, versions, commit and date: recorded with every committed result."""
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "gradcomp": gradcomp.__version__, "commit": commit, "date": time.strftime("%Y-%m-%d")}


def run_plan(rank: int, world: int, backend: str, plan: list, run_one, describe, results_path: str,
             threads: int) -> None:
    """A rank of a sweep: every item of plan in turn in one process group, run_one(item, device) giving a run
    (a dict). Rank 0 prints describe(run) after each and keeps the runs so far in results_path + ".partial", so
    an interrupted sweep keeps its progress; the finished list is renamed to results_path."""
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if backend == "nccl" else "cpu")
    try:
        runs = []
        for item in plan:
            runs.append(run_one(item, device))
            if rank == 0:
                print(describe(runs[-1]), flush=True)
                with open(results_path + ".partial", "w") as f:
                    json.dump(runs, f)
        if rank == 0:
            os.replace(results_path + ".partial", results_path)
    finally:
        dist.destroy_process_group()


def write_results(stem: str, report: dict, rows: list[dict]) -> None:
    """stem.json (the whole report) and stem.csv (one line per row)."""
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def shaping_problem() -> str | None:
    """Why this process cannot set up network namespaces and tc rate limits, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces and tc are Linux features"
    if os.geteuid() != 0:
        return "setting up network namespaces and tc rate limits needs root (CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (Debian: apt-get install iproute2)"
    return None
