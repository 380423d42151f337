"""The whole trial simulated, by gradcomp.trial's own plan and verdict: which candidate it keeps, given each
candidate's true step time and one step's scatter. For the case the last-round rule cannot help: several compressed
candidates within a few percent of each other, where the challenger is picked once, from the first rounds' medians.

    python benchmarks/results/policy_close_call_mean/simulate_trial.py

The candidates are those of signsgd at 4 ranks on 10 Gbit/s (policy_close_call_mean/mlp_4ranks_10gbit_unshaped/):
the cost model's choice (allgather for one bucket, two-phase for the other), plain, allgather and two-phase, with
true steps as multiples of plain's. One step's time is normal around its truth (a ratio of two steps then scatters
by about 1.4x as much). 2000 trials per row; one process group of one rank, so no collective runs.
"""

import os
import random
import statistics
import tempfile

import torch
import torch.distributed as dist

from gradcomp import trial as policy_trial

TRIALS = 2000
CASES = {  # true step / plain's: as timed in the committed run (allgather 6-7% quicker, two-phase 1-3%)
    "allgather 7% quicker, two-phase 2%": {"model": 0.955, "plain": 1.0, "allgather": 0.93, "two-phase": 0.98},
    "allgather 10% quicker, two-phase 2%": {"model": 0.94, "plain": 1.0, "allgather": 0.90, "two-phase": 0.98},
}


def one_trial(truth: dict, scatter: float, rng: random.Random) -> str:
    decision = {"step": 0, "options": ["plain", "allgather", "two-phase"],
                "buckets": [{"choice": "allgather"}, {"choice": "two-phase"}]}
    trial = policy_trial.plan(decision, policy_trial.DEFAULT_STEPS, plain_step_s=None)
    seconds, measured_up_to = {}, 0
    while True:
        for step in range(measured_up_to, policy_trial.length(trial)):
            name = policy_trial.candidate_at(trial, step)
            seconds[step] = truth[name] * max(0.05, rng.gauss(1, scatter))
        measured_up_to = policy_trial.length(trial)
        trial = policy_trial.verdict(trial, seconds, None, torch.device("cpu"))
        if trial["chosen"] is not None:
            return trial["chosen"]


def main() -> None:
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    rng = random.Random(11)
    for case, truth in CASES.items():
        for scatter in (0.06, 0.09, 0.14):
            chosen = [one_trial(truth, scatter, rng) for _ in range(TRIALS)]
            cost = statistics.fmean(truth[name] for name in chosen) / min(truth.values())
            shares = ", ".join(f"{name} {chosen.count(name) / TRIALS:.0%}" for name in truth)
            missed = sum(truth[name] / min(truth.values()) > 1.05 for name in chosen) / TRIALS
            print(f"{case}; one step's scatter {scatter:.0%}: kept {shares}; mean step {cost:.3f}x the best; "
                  f"over 1.05x the best in {missed:.0%}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
