"""policy="time"'s trial: the cost model shortlists, the job's own steps decide.

The cost model (gradcomp.policy) errs most where its choice mixes plain and compressed buckets, or where compute
shares the link's cores, and an error there can make the policy slower than the option a user would have fixed.
So after the model has decided, the run tries its shortlist for a few steps each and keeps the one whose steps
measured fastest:
    the shortlist: the model's choice and each option applied to every bucket (plain included), without those whose
        predicted step (the warm-up's measured plain step, less plain's predicted exposed communication, plus the
        candidate's) is over PRUNE x the best predicted one, both at the load the warm-up showed and at the probes'
        own pace (a load from one warm-up step can be far off): plain at 100 Mbit/s is not worth a trial (a shortlist
        of one still runs, for the steps' timings: gradcomp.policy.in_step);
    the schedule: trial_steps rounds; each runs every candidate for one block of BLOCK steps, in an order shuffled
        per round (the same on every rank; the first round starts with the model's choice, which the decision's own
        step sends); the first step of a block (the switch, new plans laid out) is not counted. A core's speed
        drifts by tens of percent within seconds on a shared machine, so candidates are compared round by round,
        each with the others' steps a few steps away, never one candidate's block of steps against another's taken
        seconds later; the shuffle keeps a candidate from always following the same other;
    a step's time: from its first bucket's hook call to the next step's (forward, backward, communication and the
        optimizer all in it), host seconds on the CPU, CUDA events on a GPU (read at each verdict: one sync);
    the verdict, at the first step after the trial: every rank's time per candidate and round, combined by one
        allreduce (MAX: the slowest rank sets the pace); each candidate's time as a ratio to plain's in the same
        round, and the candidate with the smallest median ratio, the challenger. Plain stands unless the challenger
        was quicker by more than PLAIN_PREFERENCE in the median, and its gain is clear: it was quicker in every
        round, or the upper end of a 95% one-sided confidence interval of its mean ratio (Student's t) is under 1
        (where several candidates are so, the challenger is the smallest median ratio among them).
        The rule takes only sums, products, quotients and a square root (exactly rounded by IEEE 754), so every rank
        reaches it alike from the same combined times. Plain is whichever candidate sends every bucket plain: the
        model's choice itself, where that is plain for every bucket (where the shortlist has no plain, the ratios
        are to the model's choice, and the challenger is taken). A policy that promises never to be slower than
        plain DDP takes compression only where its gain is clear of the steps' scatter (or, after the longest close
        call, where the mean of all its rounds says so: see below).
        Where compression is taken, the runner-up (the next smallest median ratio) replaces the challenger by the
        same rule on its ratios to the challenger: compressed candidates often lie within a step's scatter of each
        other, and the smallest median of four noisy rounds is then a coin's toss (it once took two-phase where
        allgather was 1.2x quicker in the steps after the trial).
        A step counts only where its block's switch was measured in the same process (a resumed run's first step,
        its plans laid out anew, does not);
    close calls: where no candidate's gain over plain is clear, but a gain over PLAIN_PREFERENCE is still possible
        for some (the lower end of the mean ratio's interval is under 1 - PLAIN_PREFERENCE, or fewer than 3 rounds),
        the trial goes on with rounds of plain and each of those still in the running (in a shuffled order, one
        allreduce per round), the verdict taken again after each, up to EXTEND x trial_steps rounds in all. A
        candidate whose gain is ruled out runs no more; the challenger is picked again at each verdict, from all the
        rounds of those still running. Picked once, from the first rounds' medians, it was a coin's toss between
        candidates a few percent apart, and the others were never tried again: signsgd at 4 ranks kept two-phase
        against plain, and then plain, where allgather was 6% quicker than both. Simulated so (9% scatter per step,
        allgather 7% quicker than plain, two-phase 2%), an option over 1.05x the best was kept in 15% of the trials,
        and in 4% with every contender running (benchmarks/results/policy_contenders/simulate_trial.py).
        At the last round, the quicker in the mean ratio stands: the one of the contenders with the smallest mean
        ratio to plain, where it is under 1. A close call that ran that long lies within a few percent either way (a
        gain or a loss of 5% shows clearly or is ruled out long before), where a promise of 5% allows either.
        Keeping plain there, whatever the rounds said, kept it where it was slower than 1.05x the best option: in
        the committed runs, 65 rounds ended so with compression quicker in the mean; in the 36 whose challenger sent
        one option throughout, the steps timed after them had plain over 1.05x the best in 18, that option in 9
        (benchmarks/results/policy_close_call_mean/).
        Once compression is taken, the same holds between the challenger and the runner-up (of those still in the
        running): rounds of the two alone while the runner-up's gain is neither clear nor ruled out and the
        challenger's gain over it is not clear either; at the last round, the one quicker in the mean ratio stands.
        Both last-round rules need rounds that a close call added (they know more than the first rounds' medians);
        where none was added (a verdict taken late), plain stands against the challenger, and the challenger against
        the runner-up. Those rounds cost at most the candidates' difference, which a wrong pick would cost for the
        rest of the run.
        On a shared CPU one step scatters by about 20%, and four pairs cannot show a 10% gain; on a GPU they mostly
        can, and fewer rounds are added.
        Why EXTEND is 12 (48 rounds at the default 4): a close call's rounds cost at most the two candidates'
        difference, but stopping short costs that difference for the rest of the run. Simulated with this rule at
        12% scatter per ratio (4 ranks of the MLP on 2 cores), a true gain of 5% over plain is taken 95% of the time
        within 48 rounds (90% where plain stood at the last round; 60% within 16), at 15 rounds on average; a true 5%
        loss is taken 2% of the time, as where plain stood. At 20% scatter: a 5% gain 89% (69%), a 5% loss 8% (5%),
        a 10% loss 1.6% (1.4%) (benchmarks/results/policy_close_call_mean/simulate_close_calls.py).
Every step of the trial is a real training step: a switch hands the error-feedback residuals over as any decision
does (nothing lost). The schedule is fixed at the decision (and at each round a close call adds), so a run resumed
during the trial sends each step as the uninterrupted one did until its next verdict; that verdict counts the rounds
an earlier verdict combined (saved with the decision) and those it measured whole itself (not the one it resumed in),
and may differ from the uninterrupted run's, or add another round.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics

import torch
import torch.distributed as dist

MIN_ROUNDS = 2
BLOCK = 2  # steps per candidate and round: the switch, then one measured step
DEFAULT_STEPS = 4  # measured steps (rounds) per candidate under policy="time" unless trial_steps says otherwise
PRUNE = 1.5
PLAIN_PREFERENCE = 0.02
# Student's t, one-sided 95%, by degrees of freedom 1-20 (more: the last): the mean ratio's interval in clear_gain
T_95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753, 1.746,
        1.740, 1.734, 1.729, 1.725)
EXTEND = 12  # a close call may run up to EXTEND x trial_steps rounds in all (see the docstring: why 12)
MODEL = "model"  # the candidate that is the cost model's own choice


def check_trial_steps(trial_steps, policy: str) -> int:
    if isinstance(trial_steps, bool) or not isinstance(trial_steps, int) or trial_steps < 0 or \
            0 < trial_steps < MIN_ROUNDS:
        raise ValueError(f"gradcomp: trial_steps={trial_steps!r} must be 0 (the cost model's choice stands) or an "
                         f"integer of at least {MIN_ROUNDS} (the measured steps per candidate, one per round: the "
                         f"verdict compares candidates round by round)")
    if trial_steps and policy != "time":
        raise ValueError(f"gradcomp: trial_steps={trial_steps} tries policy='time''s shortlist; this state has "
                         f"policy={policy!r}")
    return trial_steps


def plan(decision: dict, trial_steps: int, plain_step_s: float | None) -> dict | None:
    """The trial for a decision, JSON-able (kept in the decision); None where trial_steps is 0. A shortlist of one
    still runs its rounds: there is nothing to compare, but its steps show what the model could not measure alone
    (gradcomp.policy.in_step), at no cost (the run sends what it would have sent)."""
    if not trial_steps:
        return None
    model_choice = [bucket["choice"] for bucket in decision["buckets"]]
    candidates = {MODEL: model_choice}
    for option in decision["options"]:
        uniform = [option] * len(model_choice)
        if uniform not in candidates.values():
            candidates[option] = uniform
    if plain_step_s is not None:
        kept = set()
        for predicted in (decision["predicted_exposed_s"], decision.get("predicted_exposed_alone_s")):
            if predicted is not None:
                compute = max(plain_step_s - predicted["plain"], 0.0)  # the rest of a warm-up step
                step = {name: compute + predicted["policy" if name == MODEL else name] for name in candidates}
                kept |= {name for name in candidates if step[name] <= PRUNE * min(step.values())}
        candidates = {name: c for name, c in candidates.items() if name in kept}
    names = list(candidates)
    order = []
    for round_ in range(trial_steps):
        shuffled = list(names[1:] if round_ == 0 else names)
        random.Random(f"gradcomp trial {decision['step']} {round_}").shuffle(shuffled)  # alike on every rank
        order.append(names[:1] + shuffled if round_ == 0 else shuffled)  # the decision's own step sends the model's
    return {"start": decision["step"], "block": BLOCK, "rounds": trial_steps, "first_rounds": trial_steps,
            "max_rounds": EXTEND * trial_steps,
            "names": names, "order": order, "challenger": None, "runner_up": None, "choices": candidates,
            "plain_step_s": plain_step_s,
            "measured_step_s": None, "round_step_s": None, "chosen": None}


def orders(trial: dict) -> list[list[str]]:
    """Each round's candidates in the order they run."""
    return trial["order"] if "order" in trial else [trial["names"]] * trial["rounds"]  # planned before the shuffle


def length(trial: dict) -> int:
    return trial["block"] * sum(len(order) for order in orders(trial))


def _position(trial: dict, step: int) -> tuple[int, int] | None:
    """(round, block within the round) of step `step`, None outside the trial."""
    offset = step - trial["start"]
    if offset < 0:
        return None
    block = offset // trial["block"]
    for round_, order in enumerate(orders(trial)):
        if block < len(order):
            return round_, block
        block -= len(order)
    return None


def round_at(trial: dict, step: int) -> int | None:
    """The round that step `step` belongs to, None outside the trial."""
    position = _position(trial, step)
    return None if position is None else position[0]


def candidate_at(trial: dict, step: int) -> str | None:
    """The candidate that sends step `step`, None outside the trial."""
    position = _position(trial, step)
    return None if position is None else orders(trial)[position[0]][position[1]]


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


def _mean_and_margin(ratios: list[float]) -> tuple[float, float]:
    """The mean ratio and the half-width of its 95% one-sided interval (Student's t); from 3 rounds."""
    t = T_95[min(len(ratios) - 1, len(T_95)) - 1]
    return statistics.fmean(ratios), t * statistics.stdev(ratios) / math.sqrt(len(ratios))


def clear_gain(ratios: list[float]) -> bool:
    """Whether a candidate's step times as ratios to plain's, round by round, show a gain beyond the steps' scatter:
    quicker in every round, or (from 3 rounds) the upper end of a 95% one-sided interval of the mean ratio under 1.
    Added rounds look again, so a false gain is likelier than 5%; but one that is taken lies near plain's time (a
    candidate 5% slower than plain would need its mean measured 2-3 standard errors below plain's), and the median's
    PLAIN_PREFERENCE applies as well. Simulated at 20% scatter per ratio with the close calls' rounds (up to 48, the
    quicker in the mean at the last): a true 10% gain is taken 98% of the time; a true 5% loss 8%, a 10% loss 1.6%.
    No rounds: no gain shown."""
    if not ratios:
        return False
    if max(ratios) < 1:
        return True
    if len(ratios) < 3:
        return False
    mean, margin = _mean_and_margin(ratios)
    return mean + margin < 1


def gain_possible(ratios: list[float]) -> bool:
    """Whether more rounds could still show a gain over PLAIN_PREFERENCE: fewer than 3 rounds, or the lower end of the
    mean ratio's interval under 1 - PLAIN_PREFERENCE."""
    if len(ratios) < 3:
        return True
    mean, margin = _mean_and_margin(ratios)
    return mean - margin < 1 - PLAIN_PREFERENCE


def clearly_quicker(ratios: list[float]) -> bool:
    """Whether a candidate whose step times as ratios to another's are `ratios`, round by round, replaces the other:
    quicker by more than PLAIN_PREFERENCE in the median, and its gain clear of the steps' scatter. No rounds: no."""
    return bool(ratios) and statistics.median(ratios) < 1 - PLAIN_PREFERENCE and clear_gain(ratios)


def verdict(trial: dict, step_seconds: dict[int, float], group, device: torch.device, now: int | None = None) -> dict:
    """The trial with its measured step times and the chosen candidate, or, for a close call, with one more round of
    the two candidates it lies between (chosen None), starting at step `now` (the trial's end; None: wherever it
    ends): the same on every rank. step_seconds: this rank's measured steps (step -> seconds); one allreduce (MAX)
    combines the ranks' times per candidate and round.
    Two questions, each a close call until settled: does compression replace plain (a candidate clearly quicker
    than plain: the challenger, the smallest median ratio to plain among those clearly quicker, or among those still
    in the running while none is); and once it has, does the runner-up (the next smallest, compressed too) replace
    the challenger. Both are answered by clearly_quicker on the candidates' ratios in the rounds that ran both; the
    first question's added rounds hold plain and every compressed candidate whose gain over it is still possible, the
    second's the challenger and the runner-up. Where neither a clear gain nor its absence shows by EXTEND x
    trial_steps rounds, the quicker in the mean ratio stands, once a close call has added rounds; else plain against
    the challenger, and the challenger against the runner-up."""
    names, rounds, round_orders = trial["names"], trial["rounds"], orders(trial)
    steps: dict[tuple[str, int], list[float]] = {(name, r): [] for name in names for r in range(rounds)}
    for step, seconds in step_seconds.items():
        if counted(trial, step) and step - 1 in step_seconds:  # its switch seen here: not a resumed run's first step
            steps[candidate_at(trial, step), round_at(trial, step)].append(seconds)
    times = [statistics.median(steps[name, r]) if steps[name, r] else math.inf for name in names for r in range(rounds)]
    tensor = torch.tensor(times, dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)  # a round missing on any rank is missing
    values = tensor.cpu().tolist()
    per_round = {name: values[i * rounds:(i + 1) * rounds] for i, name in enumerate(names)}
    for name, combined in (trial.get("round_step_s") or {}).items():  # rounds an earlier verdict combined: as then
        per_round[name][:len(combined)] = [math.inf if s is None else s for s in combined]
    plain = all_plain(trial)  # "model" where the model's own choice is plain for every bucket
    reference = plain or (MODEL if MODEL in names else names[0])
    whole = [r for r in range(rounds) if all(math.isfinite(per_round[name][r]) and per_round[name][r] > 0
                                             for name in round_orders[r])]

    def ratios(name: str, to: str) -> list[float]:
        """name's step time over to's, in each round measured whole that ran both."""
        return [per_round[name][r] / per_round[to][r] for r in whole if name in round_orders[r] and
                to in round_orders[r]]

    def in_added_rounds(name: str) -> bool:
        """Whether rounds a close call added ran name."""
        return any(name in order for order in round_orders[trial.get("first_rounds", rounds):])

    def smallest_median_ratio(among: list[str]) -> str | None:  # the first of equals
        among = [name for name in among if ratios(name, reference)]
        return min(among, key=lambda name: statistics.median(ratios(name, reference))) if among else None

    challenger, runner_up, added_round, taken = trial.get("challenger"), trial.get("runner_up"), None, False
    field = [name for name in round_orders[-1] if name != plain]  # the compressed candidates still in the running
    if not whole:  # no round measured whole on every rank (a run resumed late in the trial): the model's choice
        chosen = MODEL if MODEL in names else names[0]
    elif plain is not None and plain in round_orders[-1]:  # does compression replace plain: still open
        clear = [name for name in field if clearly_quicker(ratios(name, plain))]
        challenger = smallest_median_ratio(clear or field) or plain  # picked again at each verdict, from all its rounds
        taken = bool(clear)
        chosen = challenger if taken else plain
        contenders = [] if taken else [name for name in field if gain_possible(ratios(name, plain))]
        if contenders:  # a close call: another round of those whose gain is neither clear nor ruled out, and plain
            added_round = [*contenders, plain]
            quickest = min(contenders, key=lambda name: statistics.fmean(ratios(name, plain)))
            if in_added_rounds(quickest) and statistics.fmean(ratios(quickest, plain)) < 1:
                chosen = quickest  # stands only where no round can be added
    else:  # compression taken at an earlier verdict, or no plain to guard
        challenger = chosen = challenger or smallest_median_ratio(names)
        taken = True
    if taken:  # the runner-up may still be quicker than the challenger
        runner_up = runner_up or smallest_median_ratio([name for name in field if name != challenger])
        if runner_up is not None:
            against = ratios(runner_up, challenger)
            if clearly_quicker(against):
                chosen = runner_up
            elif gain_possible(against) and not clear_gain([1 / ratio for ratio in against]):
                added_round = [challenger, runner_up]
                if in_added_rounds(runner_up) and statistics.fmean(against) < 1:  # only where no round can be added
                    chosen = runner_up
    more = added_round is not None and rounds < trial.get("max_rounds", rounds) and \
        now in (None, trial["start"] + length(trial))
    measured = {name: [s for s in per_round[name] if math.isfinite(s)] for name in names}
    result = {**trial, "measured_step_s": {name: statistics.median(s) if s else None for name, s in measured.items()},
              "round_step_s": {name: [s if math.isfinite(s) else None for s in per_round[name]] for name in names},
              "challenger": challenger, "runner_up": runner_up, "chosen": chosen}
    if more:
        random.Random(f"gradcomp trial {trial['start']} {rounds}").shuffle(added_round)  # alike on every rank
        result.update(rounds=rounds + 1, order=round_orders + [added_round], chosen=None)
    return result


def describe(trial: dict | None) -> list[str]:
    """explain()'s lines for the trial."""
    if trial is None:
        return []
    names = ", ".join(f"{name} ({'/'.join(sorted(set(trial['choices'][name])))})" for name in trial["names"])
    order = "a shuffled order" if "order" in trial else "the shortlist's order"  # the latter: planned by an earlier gradcomp
    first = trial.get("first_rounds", trial["rounds"])
    lines = [f"trial from step {trial['start']}, {first} rounds of {trial['block']} steps per candidate, "
             f"in {order} (the first of each block uncounted): {names}"]
    if trial["rounds"] > first:
        plain = all_plain(trial)
        labels = {plain: f"{plain} (plain)"} if plain not in (None, "plain") else {}

        def listed(group: tuple[str, ...]) -> str:  # "alone" where the others in the shortlist did not run
            shown = [labels.get(name, name) for name in group]
            return f"{', '.join(shown[:-1])} and {shown[-1]}" + (" alone" if len(group) < len(trial["names"]) else "")

        in_order = [tuple(sorted(added, key=lambda name: (name == plain, trial["names"].index(name))))  # plain last
                    for added in orders(trial)[first:]]
        runs = [(len(list(run)), listed(group)) for group, run in itertools.groupby(in_order)]
        added = f" of {runs[0][1]}" if len(runs) == 1 else ": " + ", then ".join(f"{n} of {r}" for n, r in runs)
        lines.append(f"a close call: {trial['rounds'] - first} more rounds{added} (up to {trial['max_rounds']} in all)")
    if trial["chosen"] is None:
        lines.append("trial under way: each bucket's choice above is that of this step's candidate")
        return lines
    measured = ", ".join(f"{name} {'-' if s is None else f'{s * 1e3:.1f}'}"
                         for name, s in trial["measured_step_s"].items())
    lines.append(f"measured step (ms, median over rounds, slowest rank): {measured}; chosen: {trial['chosen']}")
    rounds = "; ".join(f"{name} " + "/".join("-" if s is None else f"{s * 1e3:.1f}" for s in seconds)
                       for name, seconds in (trial.get("round_step_s") or {}).items())
    if rounds:
        lines.append(f"per round (ms): {rounds}; compression is taken over plain, and the runner-up over the "
                     f"challenger, where it was quicker by more than {PLAIN_PREFERENCE:.0%} in the median, and in "
                     f"every round or clearly in the mean (the upper end of a 95% interval); where the added rounds "
                     f"run out, the quickest of those they ran, in the mean")
    return lines
