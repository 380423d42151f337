"""policy="time"'s trial: the cost model shortlists, the job's own steps decide.

The cost model (gradcomp.policy) errs most where its choice mixes plain and compressed buckets, or where compute
shares the link's cores, and an error there can make the policy slower than the option a user would have fixed.
So after the model has decided, the run tries its shortlist for a few steps each and keeps the one whose steps
measured fastest:
    the shortlist: the model's choice and each option applied to every bucket (plain included), without those whose
        predicted step (the warm-up's measured plain step, less plain's predicted exposed communication, plus the
        candidate's) is over PRUNE x the best predicted one: plain at 100 Mbit/s is not worth a trial;
    the schedule: ROUNDS rounds, each running every candidate for one block of trial_steps / ROUNDS + 1 steps, in
        the shortlist's order; the first step of a block (the switch, new plans laid out) is not counted;
    a step's time: from its first bucket's hook call to the next step's (forward, backward, communication and the
        optimizer all in it), host seconds on the CPU, CUDA events on a GPU (read at the end of the trial: one sync);
    the verdict, at the first step after the trial: every rank's median, fastest and slowest step per candidate,
        combined by one allreduce (MAX: the slowest rank sets the pace), then the fastest median; but plain stands
        where it is within PLAIN_PREFERENCE of that, and also unless every counted step of the fastest (on any
        rank) ran quicker than plain's fastest (the slowest rank's). Plain is whichever candidate sends every
        bucket plain: the model's choice itself, where that is plain for every bucket. A policy that promises never
        to be slower than plain DDP takes compression only where the measured gain is beyond the steps' scatter;
        where steps scatter by 25%, as on a shared CPU, that keeps plain in close calls.
Every step of the trial is a real training step: a switch hands the error-feedback residuals over as any decision
does (nothing lost). The schedule is fixed at the decision, so a run resumed during the trial sends each step as the
uninterrupted one did; its verdict counts only the steps it measured itself, and may differ.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

ROUNDS = 2
DEFAULT_STEPS = 4  # measured steps per candidate under policy="time" unless trial_steps says otherwise
PRUNE = 1.5
PLAIN_PREFERENCE = 0.02
MODEL = "model"  # the candidate that is the cost model's own choice


def check_trial_steps(trial_steps, policy: str) -> int:
    if isinstance(trial_steps, bool) or not isinstance(trial_steps, int) or trial_steps < 0 or \
            trial_steps % ROUNDS:
        raise ValueError(f"gradcomp: trial_steps={trial_steps!r} must be 0 (the cost model's choice stands) or a "
                         f"positive multiple of {ROUNDS} (the measured steps per candidate, in {ROUNDS} rounds)")
    if trial_steps and policy != "time":
        raise ValueError(f"gradcomp: trial_steps={trial_steps} tries policy='time''s shortlist; this state has "
                         f"policy={policy!r}")
    return trial_steps


def plan(decision: dict, trial_steps: int, plain_step_s: float | None) -> dict | None:
    """The trial for a decision, JSON-able (kept in the decision): None where the shortlist holds one candidate."""
    if not trial_steps:
        return None
    model_choice = [bucket["choice"] for bucket in decision["buckets"]]
    predicted = decision["predicted_exposed_s"]
    candidates = {MODEL: model_choice}
    for option in decision["options"]:
        uniform = [option] * len(model_choice)
        if uniform not in candidates.values():
            candidates[option] = uniform
    if plain_step_s is not None:  # the backward, forward and optimizer's share of a step, as the warm-up measured it
        compute = max(plain_step_s - predicted["plain"], 0.0)
        step = {name: compute + predicted["policy" if name == MODEL else name] for name in candidates}
        best = min(step.values())
        candidates = {name: c for name, c in candidates.items() if step[name] <= PRUNE * best}
    if len(candidates) < 2:
        return None
    return {"start": decision["step"], "block": trial_steps // ROUNDS + 1, "rounds": ROUNDS,
            "names": list(candidates), "choices": candidates, "plain_step_s": plain_step_s,
            "measured_step_s": None, "chosen": None}


def length(trial: dict) -> int:
    return len(trial["names"]) * trial["block"] * trial["rounds"]


def candidate_at(trial: dict, step: int) -> str | None:
    """The candidate that sends step `step`, None outside the trial."""
    offset = step - trial["start"]
    if not 0 <= offset < length(trial):
        return None
    return trial["names"][(offset // trial["block"]) % len(trial["names"])]


def counted(trial: dict, step: int) -> bool:
    """Whether step `step`'s time counts for its candidate (not the first of its block: the switch)."""
    return candidate_at(trial, step) is not None and (step - trial["start"]) % trial["block"] != 0


def max_over_ranks(seconds: float | None, group, device: torch.device) -> float | None:
    """The largest of every rank's value (one allreduce); None where any rank has none."""
    tensor = torch.tensor([0.0 if seconds is None else seconds, 1.0 if seconds is None else 0.0],
                          dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    value, missing = tensor.cpu().tolist()
    return None if missing else value


def all_plain(trial: dict) -> str | None:
    """The name of the candidate that sends every bucket plain (plan lists it once), None where none does."""
    return next((name for name in trial["names"] if set(trial["choices"][name]) == {"plain"}), None)


def verdict(trial: dict, step_seconds: dict[int, float], group, device: torch.device) -> dict:
    """The trial with its measured step times and the chosen candidate, the same on every rank. step_seconds: this
    rank's measured steps (step -> seconds); one allreduce (MAX) combines the ranks' medians, fastest and slowest
    steps."""
    names = trial["names"]
    medians, fastest, slowest = [], [], []
    for name in names:
        times = [s for step, s in step_seconds.items() if counted(trial, step) and candidate_at(trial, step) == name]
        medians.append(statistics.median(times) if times else math.inf)
        fastest.append(min(times) if times else math.inf)
        slowest.append(max(times) if times else math.inf)
    tensor = torch.tensor(medians + fastest + slowest, dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    values = tensor.cpu().tolist()
    count = len(names)
    measured, fastest_of, slowest_of = (dict(zip(names, values[j * count:(j + 1) * count])) for j in range(3))
    finite = {name: s for name, s in measured.items() if math.isfinite(s)}
    if not finite:  # no step measured on some rank (a run resumed at the trial's end): the model's choice stands
        chosen = MODEL if MODEL in names else names[0]
    else:
        chosen = min(finite, key=finite.get)  # the first of equals, in the shortlist's order
        plain = all_plain(trial)  # "model" where the model's own choice is plain for every bucket
        if plain in finite and (finite[plain] <= (1 + PLAIN_PREFERENCE) * finite[chosen]
                                or slowest_of[chosen] >= fastest_of[plain]):
            chosen = plain
    return {**trial, "measured_step_s": {k: (v if math.isfinite(v) else None) for k, v in measured.items()},
            "step_range_s": {k: [fastest_of[k], slowest_of[k]] for k in names
                             if math.isfinite(fastest_of[k]) and math.isfinite(slowest_of[k])},
            "chosen": chosen}


def describe(trial: dict | None) -> list[str]:
    """explain()'s lines for the trial."""
    if trial is None:
        return []
    names = ", ".join(f"{name} ({'/'.join(sorted(set(trial['choices'][name])))})" for name in trial["names"])
    lines = [f"trial from step {trial['start']}, {trial['rounds']} rounds of {trial['block']} steps per candidate "
             f"(the first of each uncounted): {names}"]
    if trial["chosen"] is None:
        lines.append("trial under way: each bucket's choice above is that of this step's candidate")
    else:
        measured = ", ".join(f"{name} {'-' if s is None else f'{s * 1e3:.1f}'}"
                             for name, s in trial["measured_step_s"].items())
        lines.append(f"measured step (ms, median, slowest rank): {measured}; chosen: {trial['chosen']}")
        ranges = ", ".join(f"{name} {low * 1e3:.1f}-{high * 1e3:.1f}"
                           for name, (low, high) in (trial.get("step_range_s") or {}).items())
        if ranges:
            lines.append(f"fastest-slowest step (ms): {ranges}; compression is taken over plain only beyond that "
                         f"scatter")
    return lines
