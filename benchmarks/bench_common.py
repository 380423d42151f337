"""What the benchmark scripts share: the machine a result came from, writing JSON and CSV, whether this
process can shape links, and the network namespaces that give each rank or node a link of its own."""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

import gradcomp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine() -> dict:
    """CPU, cores, the codecs' CPU variant, versions, commit and date: recorded with every committed result. The
    model name alone does not tell machines apart: ResNet-18's 26.5 MB topk bucket took 30-40 ms to encode on one
    "AMD EPYC" and 8-9 ms on another, under the avx512 variant."""
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu, "cores": os.cpu_count(), "cpu_variant": gradcomp.cpu_isa(), "torch": torch.__version__,
            "python": platform.python_version(), "gradcomp": gradcomp.__version__, "commit": commit,
            "date": time.strftime("%Y-%m-%d")}


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


def namespace_rank_main(args, subnet: str, configs: list, measure_one) -> None:
    """One rank of a benchmark run inside a network namespace (gloo over eth0, rank 0 at <subnet>.1):
    measure_one(kind, spec, scheme) for each configuration (label, kind, spec, scheme) that args.configs names;
    rank 0 writes every rank's results, {label: [per rank]}, to args.rank_out."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{subnet}.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    try:
        results = {}
        for label, kind, spec, scheme in configs:
            if label not in args.configs:
                continue
            everyone = [None] * args.world
            dist.all_gather_object(everyone, measure_one(kind, spec, scheme))
            results[label] = everyone
        if args.rank == 0:
            with open(args.rank_out, "w") as f:
                json.dump(results, f)
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
    """Why this process cannot set up network namespaces and tc rate limits, or None. Root is not enough: a
    container's root may lack the capabilities, so Namespaces makes and removes one shaped namespace to see."""
    if not sys.platform.startswith("linux"):
        return "network namespaces and tc are Linux features"
    if os.geteuid() != 0:
        return "setting up network namespaces and tc rate limits needs root (CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (Debian: apt-get install iproute2)"
    try:
        with Namespaces("gcprobe", 1, "10.254.254", "1gbit"):
            pass
    except subprocess.CalledProcessError as refused:
        said = (refused.stderr or "").strip() or refused.returncode
        return f"this machine refused `{' '.join(refused.cmd[:4])}`: {said}"
    return None


def refused_without_shaping(script: str) -> bool:
    """Whether this machine cannot give every rank a namespace and a shaped link of its own; if so, says why."""
    problem = shaping_problem()
    if problem:
        print(f"{script} needs root to give every rank a namespace and a link of its own: {problem}. "
              f"Nothing was measured.")
    return problem is not None


# The token bucket's depth: 128 KB passes at once after an idle link. Behind 100 Mbit/s that is 10 ms of the link
# per step for free, which a real link never gives (see policy.py's --burst).
DEFAULT_BURST = "128kb"


class Namespaces:
    """count network namespaces <prefix>-<i>, each with eth0 = one end of a veth pair whose other end joins one
    bridge, namespace i at <subnet>.<i+1>; rate: a tc token bucket on both ends of every veth (what the namespace
    sends and what it receives), or None; burst: the bucket's depth, what passes at the veth's own speed after the
    link has been idle for burst / rate. Every byte that leaves a namespace crosses its own eth0."""

    def __init__(self, prefix: str, count: int, subnet: str, rate: str | None, burst: str = DEFAULT_BURST):
        self.prefix, self.count, self.subnet, self.rate = f"{prefix}{os.getpid() % 100000}", count, subnet, rate
        self.burst = burst
        self.bridge = f"{self.prefix}br"
        self.previous_sigterm = None

    def namespace(self, i: int) -> str:
        return f"{self.prefix}-{i}"

    def __enter__(self):
        # captured: a refusal's CalledProcessError carries what the machine said (shaping_problem names it)
        run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)  # noqa: E731
        self.previous_sigterm = exit_on_sigterm()
        try:
            run("ip", "link", "add", self.bridge, "type", "bridge")
            run("ip", "link", "set", self.bridge, "up")
            for i in range(self.count):
                ns, host_end = self.namespace(i), f"{self.prefix}v{i}"
                inside = ["ip", "netns", "exec", ns]
                run("ip", "netns", "add", ns)
                run("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
                run("ip", "link", "set", host_end, "master", self.bridge, "up")
                run(*inside, "ip", "addr", "add", f"{self.subnet}.{i + 1}/24", "dev", "eth0")
                run(*inside, "ip", "link", "set", "eth0", "up")
                run(*inside, "ip", "link", "set", "lo", "up")
                if self.rate:
                    shape = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency", "100ms"]
                    run(*inside, "tc", "qdisc", "add", "dev", "eth0", *shape)  # what the namespace sends
                    run("tc", "qdisc", "add", "dev", host_end, *shape)  # what it receives
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_):
        for i in range(self.count):  # the veth pair first: a namespace's deletion frees it only later
            subprocess.run(["ip", "link", "del", f"{self.prefix}v{i}"], check=False, stderr=subprocess.DEVNULL)
            subprocess.run(["ip", "netns", "del", self.namespace(i)], check=False, stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, stderr=subprocess.DEVNULL)
        if self.previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self.previous_sigterm)
            self.previous_sigterm = None


def exit_on_sigterm():
    """Makes SIGTERM (a kill, a job's time limit) raise SystemExit, so that the process leaves through its with-blocks
    and what they made is removed; by default it dies on the spot, and namespaces outlive it. Returns the handler it
    replaced (None off the main thread, where Python takes no signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def leave(signum, _frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, leave)


def run_in_namespaces(prefix: str, world: int, subnet: str, rate: str | None, script: str, port: int,
                      arguments: list[str], timeout: float, what: str, burst: str = DEFAULT_BURST):
    """Runs `script` once per rank, each in a namespace of its own (Namespaces) with gloo on its eth0, as
    `script --rank R --world W --port P --rank-out OUT *arguments`; returns what rank 0 wrote to OUT."""
    with tempfile.TemporaryDirectory() as tmp, Namespaces(prefix, world, subnet, rate, burst) as links:
        out = os.path.join(tmp, "result.json")
        environment = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        commands = [["ip", "netns", "exec", links.namespace(rank), sys.executable, os.path.abspath(script),
                     "--rank", str(rank), "--world", str(world), "--port", str(port), "--rank-out", out, *arguments]
                    for rank in range(world)]
        return run_rank_commands(commands, environment, out, timeout, what)


def run_rank_commands(commands: list[list[str]], environment: dict, out_path: str, timeout: float, what: str) -> dict:
    """Starts every rank's command (each inside its namespace), waits for all (killing those left past timeout),
    and returns the JSON that rank 0 wrote to out_path; a failed rank is a RuntimeError naming what ran."""
    processes = [subprocess.Popen(command, env=environment) for command in commands]
    try:
        codes = [p.wait(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(f"{what}: exit codes {codes}")
    with open(out_path) as f:
        return json.load(f)
