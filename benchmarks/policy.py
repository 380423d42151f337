"""policy="time" against every fixed choice: step times behind shaped links, with the policy's choices and its
cost model's predictions next to what was measured.

    sudo python benchmarks/policy.py            # 2 and 4 ranks; 100 Mbit/s, 1 and 10 Gbit/s, unshaped; MLP, ResNet-18
    sudo python benchmarks/policy.py --quick    # 2 ranks, 1 Gbit/s and unshaped, the MLP, signsgd and topk

Every rank runs in a network namespace of its own (as scaling.py), its eth0 shaped both ways by a tc token bucket.
Its depth (--burst, default 128kb as in every committed run) passes at once after the link idled: behind 100 Mbit/s,
10 ms of the link per step for free, which a real link never gives; --burst 16kb leaves about 1 ms.
Per world size and link, one process group runs every configuration of every model, ROUNDS times. A round builds
every configuration of a model afresh and warms each up (the policy's decision and trial included), then times
--steps steps of each, one step of every configuration in turn (in an order shuffled anew for each step, the
same on every rank), so that this machine's drift (a core's speed moves by tens of percent within seconds) meets
them all alike; with --block K, K timed steps of each in a row per turn, after one untimed (a job runs its own steps
one after another: its caches hold its own model, not 12 others'); with --block K --no-barrier, one barrier before
each block and none between its steps, as a job runs them (and as the policy's trial times them). A
configuration: plain DDP; the no-communication limit (a hook that returns the local gradient); per codec, each
option fixed for every bucket (the codec under each scheme it can take, min_bucket_ratio=0) and policy="time" (timed
after its trial, gradcomp.trial, which the policy's rows name: "model" where the cost model's choice stood, else the
option the trial kept for every bucket). A step's time is the slowest rank's (a barrier before each step, unless
--no-barrier); a round's figure is the median over its steps; a configuration's, the median over the rounds.
Ratios are to the same link's limit. Beside each row, the spread (max - min) / median over the rounds of the
round's ratio to that round's limit (the figure the tables compare), and the same of its milliseconds ("of ms",
which carries the machine's drift); beside the policy's, the same of its ratio to the fastest fixed option and to
plain DDP in each round (the targets' figures: those configurations' steps interleaved with its own).
The cost model's prediction: the policy's decision predicts each option's exposed communication per step (beyond
the slowest rank's backward without it), and after its trial again at the loads the trial's own steps showed
(gradcomp.policy.in_step): predicted_exposed_ms, and as decided predicted_as_decided_ms. Measured: on each rank the
time from where its backward would have called the last bucket's hook had no hook held it up (the last call less
the time spent inside the calls before it, the encodes that ran on backward's thread) to the completion of the last
bucket's future, read around the hook (plain DDP runs as torch's allreduce hook for this); per step the least over
the ranks, the last rank's through backward (every rank leaves the step together); median over steps and rounds.
Beside it, the step minus the limit's step; the JSON keeps each step's slowest window (the last call to the last
completion: the wait for the last rank in it).
With several ranks on 2 cores the ranks' compute is shared, so times compare only within one world size and link.
How many steps: one step of the MLP varies by 13-16% there, so a median of 48 steps is known to about +-7%; 240 steps
a round brought the spreads of its cells on fast links under 5%, and 96-144 those of ResNet-18 at 2 ranks (one step
9-20%) in 11 of 12 cells (results/policy_more_steps/).
Results: policy[_quick].{json,csv,png} in --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import gradcomp
import gradcomp.measure as measure
import gradcomp.policy as time_policy

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")]
from bench_common import (DEFAULT_BURST, machine, refused_without_shaping, run_in_namespaces,  # noqa: E402
                          write_results)
from network import resnet18  # noqa: E402
from scaling import make_model as large_gradient_mlp, no_communication  # noqa: E402
from train_ddp import finish_spawned_rank  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBNET = "10.79.0"
CODECS = ["signsgd", "qsgd", "topk:ratio=0.01", "powersgd:rank=4"]
LINKS = ["100mbit", "1gbit", "10gbit", "unshaped"]
MODELS = {"mlp": (large_gradient_mlp, lambda g: (torch.randn(8, 256, generator=g), torch.randint(0, 10, (8,),
                                                                                                     generator=g))),
          "resnet18": (resnet18, lambda g: (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,),
                                                                                                       generator=g)))}
START_ITER = 2  # the fixed options'; policy="time" keeps its own default (gradcomp.policy.WARMUP_STEPS)


def configurations(codec_specs: list[str]) -> list[tuple[str, str | None, dict]]:
    """(label, codec spec or None, register's options): plain DDP, the limit, each fixed option, the policy."""
    out = [("plain DDP", None, {}), ("no communication (limit)", None, {"limit": True})]
    for spec in codec_specs:
        fixed = gradcomp.schemes.fixed_scheme(gradcomp.codec(spec))
        schemes = [fixed] if fixed else ["allgather", "two-phase"]
        out += [(f"{spec} {scheme}", spec, {"scheme": "auto" if fixed else scheme, "min_bucket_ratio": 0.0})
                for scheme in schemes]
        out.append((f"{spec} policy", spec, {"policy": "time"}))
    return out


class ExposedWindow:
    """A step's communication as the cost model counts it, on this rank, read around whichever hook runs: from where
    this rank's backward would have called its last bucket's hook had no hook held it up (the last call less the
    time spent inside the calls before it: the encodes, run on backward's thread) to the completion of the last
    bucket's future. The last rank through backward has the least of it (every rank leaves the step together): the
    figure a step shows (time_round)."""

    def __init__(self):
        self.called, self.held, self.done = [], [], []

    def around(self, hook):
        def timed(state, bucket):
            called = time.perf_counter()
            self.called.append(called)

            def completed(future):
                self.done.append(time.perf_counter())
                return future.value()

            future = hook(state, bucket).then(completed)
            self.held.append(time.perf_counter() - called)
            return future

        return timed

    def take(self) -> tuple[float, float]:
        """(exposed, window): the window runs from the last call to the last completion."""
        if self.done:
            window = max(self.done) - max(self.called)
            exposed = window + sum(self.held) - self.held[-1]  # the last call's time is inside its window
        else:
            window = exposed = 0.0
        self.called, self.held, self.done = [], [], []
        return exposed, window


class TrialTimings:
    """--trial-timings: each policy configuration's trial as every rank timed it, for re-scoring the cost model's
    loads offline: per counted step, its hook calls (bucket index, call, return) and its collectives (option, kind,
    bytes per rank, launch, completion), host seconds from the step's first call; and per option its plans'
    launches (bucket index, host seconds: WarmupTimings.launches, the encodes' loads). Read where gradcomp reads
    them, at the verdict (WarmupTimings.collective_loads), into the configuration warming up."""

    sink: list | None = None
    launch_sink: dict | None = None

    @classmethod
    def install(cls) -> None:
        collective_loads = measure.WarmupTimings.collective_loads

        def reading(timings, curves):
            if cls.sink is not None and timings.clock is not None and not timings.clock.cuda:
                cls.sink.extend(cls.steps(timings))
                cls.launch_sink.clear()  # the verdict's launches (the steps above are keyed by step)
                cls.launch_sink.update({option: [list(launch) for launch in launches]
                                        for option, launches in timings.launches.items()})
            return collective_loads(timings, curves)

        measure.WarmupTimings.collective_loads = reading

    @staticmethod
    def steps(timings) -> list[dict]:
        out = []
        for step, entries in sorted(timings.collectives.items()):
            calls = timings.steps.get(step) or []
            if not calls:
                continue
            origin, returns = calls[0][1], timings.returns.get(step, {})
            since = lambda mark: None if mark is None else mark - origin  # noqa: E731 - host seconds
            out.append({"step": step,
                        "calls": [[index, since(mark), since(returns.get(index))] for index, mark in calls],
                        "collectives": [[option, kind, nbytes, since(launched), since(completed)]
                                        for option, kind, nbytes, launched, completed in entries]})
        return out


class Configuration:
    """One configuration on this rank: its model under DDP with its hook, warmed up (and, under the policy, through
    its trial) before any is timed; then one timed step at a time (or --block), interleaved with the others' (so
    that this machine's drift, which moves a whole core's speed within seconds, meets them all alike). Plain DDP
    runs as torch's allreduce hook, so that its window can be read."""

    def __init__(self, rank: int, model_name: str, spec: str | None, options: dict):
        build, batch = MODELS[model_name]
        torch.manual_seed(0)
        self.model = build()
        self.ddp = DistributedDataParallel(self.model)
        self.state, self.window = None, ExposedWindow()
        if options.get("limit"):
            self.ddp.register_comm_hook(None, self.window.around(no_communication))
        elif spec is None:
            self.ddp.register_comm_hook(None, self.window.around(default_hooks.allreduce_hook))
        else:
            start = {} if options.get("policy") == "time" else {"start_iter": START_ITER}
            self.state = gradcomp.CompressionState(spec, model=self.model, **start, **options)
            self.ddp.register_comm_hook(self.state, self.window.around(gradcomp.hook))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x, self.y = batch(torch.Generator().manual_seed(rank))
        self.times, self.exposed, self.windows, self.trial_timings, self.trial_launches = [], [], [], [], {}

    def step(self) -> None:
        loss = nn.functional.cross_entropy(self.ddp(self.x), self.y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def warm_up(self, steps: int) -> None:
        for _ in range(steps):  # DDP's bucket rebuild, start_iter, the decision, the plans laid out
            self.step()
            self.window.take()
        TrialTimings.sink, TrialTimings.launch_sink = self.trial_timings, self.trial_launches
        while self.state is not None and self.state.deciding:  # the policy's trial: its steps are not timed here
            self.step()
            self.window.take()
        TrialTimings.sink = TrialTimings.launch_sink = None

    def timed_step(self, barrier: bool = True) -> None:
        if barrier:  # every rank starts the step together; without: as the step before left it, as a job runs
            dist.barrier()
        started = time.perf_counter()
        self.step()
        self.times.append(time.perf_counter() - started)
        exposed, window = self.window.take()
        self.exposed.append(exposed)
        self.windows.append(window)

    def result(self) -> dict:
        result = {"times": self.times, "exposed": self.exposed, "windows": self.windows,
                  "trial_timings": self.trial_timings, "trial_launches": self.trial_launches}
        if self.state is not None:
            stats = self.state.stats()
            result["schemes"], result["decision"] = stats["schemes"], stats["decision"]
        return result


def in_step_again(entry: dict) -> dict | None:
    """A run's predictions after the trial taken again from its trial's timings as every rank kept them
    (--trial-timings), by this gradcomp: each rank's WarmupTimings.trial_loads (its collectives' loads by kind, and
    its encodes' bucket by bucket where the run kept its launches; else the encodes' as the run saved them), the
    least over the ranks of the compressed options', and plain's window as the run saved it (what the verdict does,
    offline); None where the run kept no timings."""
    decision = entry.get("decision") or {}
    saved = decision.get("in_step")
    if not saved or not entry.get("trial_timings"):
        return None
    curves = time_policy.world_links(decision)
    launches = entry.get("trial_launches") or [None] * len(entry["trial_timings"])
    per_rank = []
    for steps, launched in zip(entry["trial_timings"], launches):
        timings = measure.WarmupTimings()
        timings.clock = measure.Clock(torch.device("cpu"))
        for step in steps:
            timings.steps[step["step"]] = [(index, called) for index, called, _ in step["calls"]]
            timings.collectives[step["step"]] = [list(collective) for collective in step["collectives"]]
        timings.launches = {option: [tuple(launch) for launch in seconds]
                            for option, seconds in (launched or {}).items()}
        per_rank.append(measure.flat_loads(timings.trial_loads(curves, decision)))
    least = {name: min(rank[name] for rank in per_rank) for name in per_rank[0]
             if name[0] != "plain" and all(name in rank for rank in per_rank)}
    loads = measure.nested_loads(least, len(decision["buckets"]))
    if launches[0] is None:  # a run from before the launches were kept: its encodes' loads as it saved them
        for option, kinds in saved["loads"].items():
            if "encode" in kinds:
                loads.setdefault(option, {})["encode"] = kinds["encode"]
    return time_policy.in_step(decision, loads, saved["plain_window_s"])


def predictions(decision: dict, after_trial: bool) -> dict[str, float]:
    """Each option's predicted exposed communication, and the policy's (what it sends after its trial: the model's
    choice, or the option the trial kept for every bucket): as decided, or after_trial with the collectives at the
    loads the trial's own steps showed (as decided where no trial ran)."""
    predicted = decision["predicted_exposed_s"]
    if after_trial and decision.get("in_step"):
        predicted = decision["in_step"]["predicted_exposed_s"]
    chosen = (decision.get("trial") or {}).get("chosen")
    return {**predicted, "policy": predicted["policy" if chosen in (None, "model") else chosen]}


def turns(steps: int, block: int) -> list[int]:
    """The timed steps each configuration takes in a row at each turn: `steps` in runs of `block`."""
    return [min(block, steps - start) for start in range(0, steps, block)]


def time_round(args, round_: int, model_name: str) -> list[dict]:
    """One round of one model: every configuration built and warmed up, then its timed steps, one step of each in
    turn; the rows of every rank's measurements (on rank 0 as on the others). The configurations are freed on
    return, before the next round builds its own."""
    labelled = [(label, spec, Configuration(args.rank, model_name, spec, options))
                for label, spec, options in configurations(args.codecs)]
    for _, _, configuration in labelled:
        configuration.warm_up(args.warmup)
    for turn, timed in enumerate(turns(args.steps, args.block)):  # each turn in another order, the same on every
        order = [configuration for _, _, configuration in labelled]  # rank: a step after a heavy one may run slower
        random.Random(f"{round_} {model_name} {turn}").shuffle(order)
        for configuration in order:
            if args.block > 1:  # a block: one untimed step, after the other configurations', then its timed ones
                if args.no_barrier:
                    dist.barrier()
                configuration.step()
                configuration.window.take()
            for _ in range(timed):
                configuration.timed_step(barrier=not args.no_barrier)
    runs = []
    for label, spec, configuration in labelled:
        mine = configuration.result()
        everyone = [None] * args.world
        dist.all_gather_object(everyone, mine)
        runs.append({"round": round_, "model": model_name, "config": label, "spec": spec,
                     "step_s": [max(r["times"][i] for r in everyone) for i in range(args.steps)],
                     "exposed_s": [min(r["exposed"][i] for r in everyone) for i in range(args.steps)],
                     "slowest_window_s": [max(r["windows"][i] for r in everyone) for i in range(args.steps)],
                     "schemes": mine.get("schemes"), "decision": mine.get("decision")})
        if args.trial_timings and mine["trial_timings"]:
            runs[-1]["trial_timings"] = [r["trial_timings"] for r in everyone]  # per rank
            runs[-1]["trial_launches"] = [r["trial_launches"] for r in everyone]
        if args.rank == 0:
            print(f"  round {round_} {model_name:9s} {label:32s} "
                  f"{1e3 * statistics.median(runs[-1]['step_s']):9.1f} ms", flush=True)
    return runs


def rank_main(args) -> None:
    torch.set_num_threads(1)
    if args.trial_timings:
        TrialTimings.install()
    dist.init_process_group("gloo", init_method=f"tcp://{SUBNET}.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    try:
        runs = []
        for round_ in range(args.rounds):
            for model_name in args.models:
                runs += time_round(args, round_, model_name)
                gc.collect()  # that round's models and states, before the next are built
        if args.rank == 0:
            with open(args.rank_out, "w") as f:
                json.dump(runs, f)
    finally:
        dist.destroy_process_group()


def run_world(args, world: int, link: str) -> list:
    rate = None if link == "unshaped" else link
    return run_in_namespaces("gcp", world, SUBNET, rate, __file__, 29410,
                             ["--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
                              "--block", str(args.block), "--models", *args.models, "--codecs", *args.codecs,
                              *(["--trial-timings"] if args.trial_timings else []),
                              *(["--no-barrier"] if args.no_barrier else [])],
                             args.timeout,
                             f"{world} ranks, {link}", burst=args.burst)


# -- the report --------------------------------------------------------------------------------------------------------

def table_rows(runs: dict, codecs: list[str]) -> list[dict]:
    """One row per (world, link, model, configuration): median over rounds, spread, ratios; the policy's rows with
    its choices, every row with the policy's prediction of its exposed communication next to the measured one."""
    rows = []
    for (world, link), entries in runs.items():
        for model_name in dict.fromkeys(e["model"] for e in entries):
            mine = [e for e in entries if e["model"] == model_name]
            medians, windows = {}, {}
            for e in mine:
                medians.setdefault(e["config"], []).append(statistics.median(e["step_s"]))
                windows.setdefault(e["config"], []).append(statistics.median(e["exposed_s"]))
            limits = medians["no communication (limit)"]
            limit = statistics.median(limits)
            plain = statistics.median(medians["plain DDP"])
            for spec in codecs:
                policy = [e for e in mine if e["config"] == f"{spec} policy"]
                decisions = [e["decision"] for e in policy if e["decision"]]
                after_trial = [predictions(d, after_trial=True) for d in decisions]
                as_decided = [predictions(d, after_trial=False) for d in decisions]
                trials = [d.get("trial") or {} for d in decisions]  # {}: no trial
                fixed_labels = [label for label, s, _ in configurations([spec]) if s == spec and "policy" not in label]
                fastest_label = min(fixed_labels + ["plain DDP"], key=lambda label: statistics.median(medians[label]))
                fastest_fixed = statistics.median(medians[fastest_label])
                for label in ["plain DDP", *fixed_labels, f"{spec} policy"]:
                    rounds = medians[label]
                    median = statistics.median(rounds)
                    to_limit = [r / limit_r for r, limit_r in zip(rounds, limits)]  # both from the same round
                    option = ("plain" if label == "plain DDP" else "policy" if label.endswith("policy")
                              else label.rsplit(" ", 1)[1])
                    predicted = [p[option] for p in after_trial if option in p]
                    decided = [p[option] for p in as_decided if option in p]
                    row = {"world": world, "link": link, "model": model_name, "codec": spec, "config": label,
                           "median_ms": 1e3 * median, "rounds_ms": [1e3 * r for r in rounds],
                           "spread": spread(to_limit), "spread_ms": spread(rounds),
                           "limit_spread_ms": spread(limits), "vs_limit": median / limit,
                           "vs_plain": median / plain, "vs_fastest_fixed": median / fastest_fixed,
                           "measured_exposed_ms": 1e3 * statistics.median(windows[label]),
                           "step_minus_limit_ms": 1e3 * (median - limit),
                           "predicted_exposed_ms": 1e3 * statistics.median(predicted) if predicted else None,
                           "predicted_as_decided_ms": 1e3 * statistics.median(decided) if decided else None,
                           "choices": [e["schemes"] for e in policy] if label.endswith("policy") else None,
                           "trial": [t.get("chosen") for t in trials] if label.endswith("policy") else None,
                           "trial_rounds": [t.get("rounds") for t in trials] if label.endswith("policy") else None}
                    for name, to in (("fastest_fixed", fastest_label), ("plain", "plain DDP")):  # the targets'
                        row[f"spread_vs_{name}"] = spread([r / other for r, other in zip(rounds, medians[to])]) \
                            if label.endswith("policy") else None  # figures, round by round (the drift between them)
                    rows.append(row)
    return rows


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def spread_columns(row: dict) -> str:
    """The ratio's spread and that of the milliseconds; rows from before the interleaving (--replot of an older
    JSON) hold only the latter, under "spread"."""
    if "spread_ms" not in row:
        return f"{'-':>7} {100 * row['spread']:5.0f}%"
    return f"{100 * row['spread']:6.1f}% {100 * row['spread_ms']:5.0f}%"


def policy_spreads(row: dict) -> str:
    """The spreads of the policy's ratios to the fastest fixed option and to plain DDP (rows from before: none)."""
    if row.get("spread_vs_fastest_fixed") is None:
        return ""
    return (f"; spread x best {100 * row['spread_vs_fastest_fixed']:.1f}%, "
            f"x plain {100 * row['spread_vs_plain']:.1f}%")


def summary(rows: list[dict]) -> dict:
    policy = [r for r in rows if r["config"].endswith("policy")]

    def within_25pct(key: str) -> tuple[int, int]:  # rows from before a key existed (--replot) have none
        predicted = [r for r in rows if r.get(key) is not None and r["measured_exposed_ms"] > 0]
        return sum(abs(r[key] / r["measured_exposed_ms"] - 1) <= 0.25 for r in predicted), len(predicted)

    after_trial, as_decided = within_25pct("predicted_exposed_ms"), within_25pct("predicted_as_decided_ms")
    return {"cells": len(policy),
            "policy_within_1.05x_fastest_fixed": sum(r["vs_fastest_fixed"] <= 1.05 for r in policy),
            "policy_within_1.05x_plain": sum(r["vs_plain"] <= 1.05 for r in policy),
            "largest_spread": max((r["spread"] for r in rows), default=None),
            "policy_spreads_under_5pct": sum(max(r.get("spread_vs_fastest_fixed", 1), r.get("spread_vs_plain", 1))
                                             < 0.05 for r in policy),
            "predictions_within_25pct": after_trial[0], "predictions": after_trial[1],
            "predictions_as_decided_within_25pct": as_decided[0], "predictions_as_decided": as_decided[1]}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["world"], r["model"]) for r in rows})
    links = [link for link in LINKS if any(r["link"] == link for r in rows)]
    fig, axes = plt.subplots(len(cells), 1, figsize=(11, 3.2 * len(cells)), squeeze=False)
    for ax, (world, model_name) in zip(axes[:, 0], cells):
        labels = list(dict.fromkeys(r["config"] for r in rows if r["world"] == world and r["model"] == model_name))
        width = 0.8 / len(links)
        for j, link in enumerate(links):
            values = {r["config"]: r["vs_limit"] for r in rows
                      if (r["world"], r["model"], r["link"]) == (world, model_name, link)}
            ax.bar([i + j * width for i in range(len(labels))], [values.get(label, 0) for label in labels], width,
                   label=link)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=60, ha="right", fontsize=6)
        ax.set(title=f"{model_name}, {world} ranks: step / no-communication limit", ylabel="x limit")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", help="world sizes (default 2 4; --quick: 2)")
    parser.add_argument("--links", nargs="+", choices=LINKS, help="default: all; --quick: 1gbit unshaped")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="default: both; --quick: mlp")
    parser.add_argument("--codecs", nargs="+", help=f"default: {' '.join(CODECS)}")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=START_ITER + 2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", type=int, default=1,
                        help="timed steps of a configuration in a row, after one untimed (default 1: one timed step "
                             "of each in turn); a job runs its own steps one after another")
    parser.add_argument("--no-barrier", action="store_true",
                        help="with --block: a barrier before each block only, none between its steps (as a job runs "
                             "them, and as the policy's trial times them); a step's time is still its slowest rank's")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds for one world size and link")
    parser.add_argument("--burst", default=DEFAULT_BURST,
                        help=f"the shaped links' token bucket (tc tbf's burst, default {DEFAULT_BURST}): what passes "
                             "at once after the link idled, which no real link lets through")
    parser.add_argument("--trial-timings", action="store_true",
                        help="keep every rank's timings of each policy trial's steps, and its plans' launches, in the "
                             "JSON's runs (TrialTimings)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replot", action="store_true",
                        help="the tables and plot again from --out's JSON: its rows anew from its runs where it keeps "
                             "them, the predictions after the trial anew where it keeps the trial's timings")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.block < 1:
        parser.error(f"--block {args.block}: give 1 or more timed steps in a row")
    if args.no_barrier and args.block < 2:
        parser.error("--no-barrier times the steps of a block back to back: give --block 2 or more")
    if not re.fullmatch(r"[1-9][0-9]*([kmg]?b|[kmg]|[kmg]?bit)?", args.burst):
        parser.error(f"--burst {args.burst!r}: give a size as tc reads it (bytes, or with b, kb, mb or kbit: 16kb)")
    if args.quick:
        args.worlds = args.worlds or [2]
        args.links = args.links or ["1gbit", "unshaped"]
        args.models = args.models or ["mlp"]
        args.codecs = args.codecs or ["signsgd", "topk:ratio=0.01"]
        args.steps, args.rounds = min(args.steps, 3), min(args.rounds, 2)
    args.worlds, args.links = args.worlds or [2, 4], args.links or LINKS
    args.models, args.codecs = args.models or list(MODELS), args.codecs or CODECS
    for spec in args.codecs:
        try:
            gradcomp.codec(spec)
        except ValueError as error:
            parser.error(str(error))
    return args


def report(rows: list[dict], stem: str, meta: dict) -> None:
    print(f"\n{'ranks':>5} {'link':>8} {'model':>8} {'config':32} {'ms':>9} {'spread':>7} {'of ms':>6} {'x limit':>8} "
          f"{'x plain':>8} {'x best':>7} {'pred ms':>8} {'meas ms':>8}")
    for r in rows:
        predicted = f"{r['predicted_exposed_ms']:8.1f}" if r["predicted_exposed_ms"] is not None else f"{'-':>8}"
        print(f"{r['world']:5d} {r['link']:>8} {r['model']:>8} {r['config']:32} {r['median_ms']:9.1f} "
              f"{spread_columns(r)} {r['vs_limit']:8.2f} "
              f"{r['vs_plain']:8.2f} {r['vs_fastest_fixed']:7.2f} "
              f"{predicted} {r['measured_exposed_ms']:8.1f}" + (f"  {r['choices']} trial {r['trial']} "
                                                                 f"rounds {r.get('trial_rounds')}" + policy_spreads(r)
                                                                 if r["choices"] else ""))
    totals = summary(rows)
    print("\n" + json.dumps(totals))
    write_results(stem, {**meta, "summary": totals, "rows": rows},
                  [{k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in r.items()} for r in rows])
    plot(rows, stem + ".png")
    print(f"wrote {stem}.json, .csv, .png")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        finish_spawned_rank(args.rank, lambda _: rank_main(args))
        return 0
    stem = os.path.join(args.out, "policy_quick" if args.quick else "policy")
    if args.replot:  # the rows again from the runs where the JSON keeps them (new columns), else as saved
        with open(stem + ".json") as f:
            saved = json.load(f)
        rows = saved["rows"]
        if saved.get("runs"):
            by_link: dict = {}
            for entry in saved["runs"]:
                again = in_step_again(entry)
                if again is not None:
                    entry["decision"]["in_step"] = again
                by_link.setdefault((entry["world"], entry["link"]), []).append(entry)
            rows = table_rows(by_link, saved["codecs"])
        report(rows, stem, {k: v for k, v in saved.items() if k not in ("rows", "summary")})
        return 0
    if refused_without_shaping("policy.py"):
        return 0
    runs = {}
    for world in args.worlds:
        for link in args.links:
            started = time.perf_counter()
            runs[(world, link)] = run_world(args, world, link)
            print(f"{world} ranks, {link}: {time.perf_counter() - started:.0f} s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    parameters = {name: sum(p.numel() for p in build().parameters()) for name, (build, _) in MODELS.items()}
    report(table_rows(runs, args.codecs), stem,
           {"machine": machine(), "parameters": parameters, "steps": args.steps, "warmup": args.warmup,
            "rounds": args.rounds, "block": args.block, "no_barrier": args.no_barrier, "worlds": args.worlds,
            "links": args.links, "codecs": args.codecs, "burst": args.burst,
            "runs": [{"world": w, "link": link, **e} for (w, link), entries in runs.items() for e in entries]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
