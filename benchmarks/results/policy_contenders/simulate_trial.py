"""The whole trial simulated under two rules, by gradcomp.trial's own plan and verdict: which candidate it keeps, given
each candidate's true step time and one step's scatter.

    python benchmarks/results/policy_contenders/simulate_trial.py [--trials N]

"before": the trial of 598b409 (read from git), whose close call against plain added rounds of the challenger (picked
once, from the first rounds' medians) and plain alone. "now": the installed gradcomp, whose added rounds hold plain and
every compressed candidate whose gain over it is still possible, the challenger picked again at each verdict.
The candidates are those of signsgd at 4 ranks of the MLP (policy_close_call_mean/mlp_4ranks_10gbit_unshaped/): the
cost model's choice (allgather for one bucket, two-phase for the other), plain, allgather and two-phase, with true
steps as multiples of plain's. One step's time is normal around its truth. Each row: the share of trials keeping each
candidate, the mean kept step over the best, the share keeping one over 1.05x the best (or over 1.05x plain), and the
trial's length in steps. Both rules see the same random steps' sequence per row; one process group of one rank, so no
collective runs. Writes simulate_trial.json beside itself.
"""

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from gradcomp import trial as trial_now

BEFORE = "598b409"
CASES = {  # true step / plain's
    "as measured: allgather 7% quicker, two-phase 2%": {"model": 0.955, "plain": 1.0, "allgather": 0.93,
                                                        "two-phase": 0.98},
    "allgather 6% quicker, the others slower than plain": {"model": 1.03, "plain": 1.0, "allgather": 0.94,
                                                           "two-phase": 1.08},
    "allgather 10% quicker, two-phase 2%": {"model": 0.94, "plain": 1.0, "allgather": 0.90, "two-phase": 0.98},
    "all as quick as plain": {"model": 1.0, "plain": 1.0, "allgather": 1.0, "two-phase": 1.0},
    "all 5-7% slower than plain": {"model": 1.05, "plain": 1.0, "allgather": 1.06, "two-phase": 1.07},
}
SCATTERS = (0.06, 0.09, 0.14)


def rule_before():
    here = os.path.dirname(os.path.abspath(__file__))
    source = subprocess.run(["git", "show", f"{BEFORE}:python/gradcomp/trial.py"], cwd=here, check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "trial_before.py")
    with open(path, "w") as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location("trial_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_trial(rule, truth: dict, scatter: float, rng: random.Random) -> tuple[str, int]:
    decision = {"step": 0, "options": ["plain", "allgather", "two-phase"],
                "buckets": [{"choice": "allgather"}, {"choice": "two-phase"}]}
    trial = rule.plan(decision, rule.DEFAULT_STEPS, plain_step_s=None)
    seconds, measured_up_to = {}, 0
    while True:
        for step in range(measured_up_to, rule.length(trial)):
            seconds[step] = truth[rule.candidate_at(trial, step)] * max(0.05, rng.gauss(1, scatter))
        measured_up_to = rule.length(trial)
        trial = rule.verdict(trial, seconds, None, torch.device("cpu"))
        if trial["chosen"] is not None:
            return trial["chosen"], rule.length(trial)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1000, help="trials per case, scatter and rule")
    args = parser.parse_args()
    rules = {"before": rule_before(), "now": trial_now}
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    rows = []
    print("| case | scatter per step | rule | kept (model, plain, allgather, two-phase) | mean kept step / best | "
          "kept over 1.05x | trial steps (mean) |\n|---|---|---|---|---|---|---|")
    for number, (case, truth) in enumerate(CASES.items()):
        best = min(truth.values())
        for scatter in SCATTERS:
            for name, rule in rules.items():
                rng = random.Random(f"{number} {scatter}")  # the same steps' sequence for both rules
                results = [one_trial(rule, truth, scatter, rng) for _ in range(args.trials)]
                chosen = [c for c, _ in results]
                row = {"case": case, "truth": truth, "scatter": scatter, "rule": name, "trials": args.trials,
                       "kept": {n: chosen.count(n) / args.trials for n in truth},
                       "mean_over_best": statistics.fmean(truth[c] for c in chosen) / best,
                       "over_105": sum(truth[c] / best > 1.05 or truth[c] > 1.05 for c in chosen) / args.trials,
                       "trial_steps": statistics.fmean(n for _, n in results)}
                rows.append(row)
                kept = ", ".join(f"{share:.0%}" for share in row["kept"].values())
                print(f"| {case} | {scatter:.0%} | {name} | {kept} | {row['mean_over_best']:.3f} | "
                      f"{row['over_105']:.1%} | {row['trial_steps']:.0f} |", flush=True)
    dist.destroy_process_group()
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "simulate_trial.json"), "w") as file:
        json.dump({"before": BEFORE, "python": sys.version.split()[0], "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
