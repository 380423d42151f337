"""What each rank runs in test_policy.py (and test_cuda.py's policy tests): policy="time" on the small MLP, with what
each rank sent and what DDP applied per step, and every decision taken. Where a test needs given decisions,
gradcomp.policy.choose is replaced by a schedule: one list of option names per decision, cycled over the buckets."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
import gradcomp.measure as measure
import gradcomp.policy as time_policy
import gradcomp.trial as policy_trial
from ddp_scenarios import BUCKET_CAP_MB, batch, make_model, train, wrap
from reliability_scenarios import hook_recording_sent, residuals_per_parameter


def scheduled(schedule):
    """A stand-in for time_policy.choose that returns schedule's next entry (the last one from then on)."""
    taken = []

    def choose(ready, options):
        names = schedule[min(len(taken), len(schedule) - 1)]
        taken.append(names)
        return [names[i % len(names)] for i in range(len(options))]

    return choose


def skewed(rank: int, skew: float, seen: list):
    """A stand-in for the links' measurement that makes each rank's differ (x 1 + skew x rank), recording it."""
    measure_links = measure.measure_links

    def scaled(*args):
        lines = {k: v.with_params([x * (1 + skew * rank) for x in v.params()])
                 for k, v in measure_links(*args).items()}
        seen.append({k: v.to_json() for k, v in lines.items()})
        return lines

    return scaled


def scripted_trial(rank: int, seconds: dict):
    """Makes the trial's measured steps what seconds says: {candidate: [this rank's seconds per rank]}, each either one
    number (every step of the candidate alike) or a list per round (its last for later rounds), recording nothing
    else; and keeps the whole shortlist (no pruning)."""
    policy_trial.PRUNE = float("inf")
    verdict = policy_trial.verdict

    def at(step, trial):
        value = seconds[policy_trial.candidate_at(trial, step)][rank]
        return value[min(policy_trial.round_at(trial, step), len(value) - 1)] if isinstance(value, list) else value

    def scripted(trial, step_seconds, group, device, now=None):
        fake = {step: at(step, trial) for step in step_seconds if policy_trial.candidate_at(trial, step) is not None}
        return verdict(trial, fake, group, device, now)

    policy_trial.verdict = scripted


def recorded(rank, world, spec, options, steps, schedule=None, skew=None, trial_seconds=None, kind="mlp"):
    """Trains steps under policy="time" (options: more of the state's; trial_steps=0 and start_iter=2 unless given,
    start_iter=None for the default; trial_seconds: see scripted_trial; kind: ddp_scenarios' model). Returns this
    rank's gradient into the hook, DDP's applied gradient and the buckets' schemes per step and parameter, its
    residuals at the end (reliability_scenarios'), every decision, the plain windows each read (their number), the
    measurements before they were combined (skew: each rank's scaled, see skewed), the final parameters, and the
    dtype of the first bucket DDP handed the hook in each step."""
    if schedule is not None:
        time_policy.choose = scheduled(schedule)
    seen: list = []
    if skew is not None:
        measure.measure_links = skewed(rank, skew, seen)
    if trial_seconds is not None:
        scripted_trial(rank, trial_seconds)
    options = {"trial_steps": 0, "start_iter": 2, **options}
    decisions, windows_read = [], []
    plain_windows = measure.WarmupTimings.plain_windows
    measure.WarmupTimings.plain_windows = lambda self: windows_read.append(plain_windows(self)) or windows_read[-1]
    decide = time_policy.decide
    time_policy.decide = lambda *args: decisions.append(decide(*args)) or decisions[-1]
    model = make_model(kind)
    ddp = wrap(model)
    state = gradcomp.CompressionState(spec, model=model, policy="time", **options)
    sent: list[dict] = []
    recording, first_dtypes = hook_recording_sent(sent), []

    def hook(state, bucket):
        if bucket.index() == 0:  # DDP calls the hook bucket by bucket in index order: the step's first call
            first_dtypes.append(bucket.buffer().dtype)
        return recording(state, bucket)

    ddp.register_comm_hook(state, hook)
    applied, schemes = [], []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    original_zero = optimizer.zero_grad

    def record(step):
        applied.append([p.grad.detach().clone().reshape(-1) for p in model.parameters()])
        schemes.append({p.index: p.scheme for p in state._plans.values()})

    def zero_grad(*args, **kwargs):
        sent.append({})
        return original_zero(*args, **kwargs)

    sent.append({})
    optimizer.zero_grad = zero_grad
    train(ddp, optimizer, steps, rank, record=record)
    residual, owner = residuals_per_parameter(state)
    count = len(list(model.parameters()))
    return {"sent": [[s[k] for k in range(count)] for s in sent[:steps]], "applied": applied,
            "residual": [residual.get(k) for k in range(count)], "owner": [owner.get(k) for k in range(count)],
            "schemes_at_end": {p.index: p.scheme for p in state._plans.values()}, "schemes_per_step": schemes,
            "plain_residuals_held": [p.residual is not None for p in state._plans.values() if p.scheme == "plain"],
            "decisions": decisions, "windows_read": [len(w) for w in windows_read],
            "measured": seen, "explain": state.explain(), "stats": state.stats(),
            "params": [p.detach().clone() for p in model.parameters()], "first_bucket_dtypes": first_dtypes}


def resume(rank, world, spec, options, total, split, workdir, phase, schedule, trial_seconds=None):
    """phase "whole": total steps; phase "first": split steps, then the model and this rank's state saved in workdir;
    phase "rest": a fresh model and state loaded from there, the remaining steps. choose follows schedule (a resumed
    run after the decision must not call it); trial_steps=0 unless options give it, the trial's times then scripted
    (scripted_trial). Returns the final parameters, the choices taken in this process and the state's decision."""
    if trial_seconds is not None:
        scripted_trial(rank, trial_seconds)
    options = {"trial_steps": 0, "start_iter": 2, **options}
    schedule_taken = scheduled(schedule)
    calls = []
    time_policy.choose = lambda ready, options_: calls.append(1) or schedule_taken(ready, options_)
    model = make_model("mlp")
    path = os.path.join(workdir, f"rank{rank}.pt")
    first = 0
    if phase == "rest":
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        first = saved["step"]
    ddp = wrap(model)
    state = gradcomp.register(ddp, spec, policy="time", **options)
    if phase == "rest":
        state.load_state_dict(saved["state"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = {"whole": total, "first": split, "rest": total - split}[phase]
    train(ddp, optimizer, steps, rank, first_step=first)
    if phase == "first":
        torch.save({"model": model.state_dict(), "state": state.state_dict(), "step": split}, path)
    return {"params": [p.detach().clone() for p in model.parameters()], "choose_calls": len(calls),
            "schemes": {p.index: p.scheme for p in state._plans.values()}, "decision": state.stats()["decision"]}


def combined_windows(rank, world, windows):
    """gradcomp.measure.combine of this rank's (plain window, compute) per warm-up step (windows[rank]) alone:
    (window, skew)."""
    *_, window, skew = measure.combine(time_policy.CostModel({}, {}), None, 0, dist.group.WORLD, torch.device("cpu"),
                                       None, windows[rank])
    return window, skew


def on_gpu(rank, world, configs, steps_after):
    """policy="time" on cuda:0: over gloo with every rank on cuda:0, or at world size 1 over NCCL, where every step
    after the decision stands runs its backward under torch.cuda.set_sync_debug_mode("error") (which raises at any
    host-device sync). configs: {name: (spec, options, schedule)}, schedule as in recorded (None: the policy's own
    choice). Per config: trains until the decision stands (its trial over), then steps_after steps; returns the
    decision, the step it stood at, the error (or None), the held-out loss before and after, the schemes at the end,
    the stats and the final parameters (on the CPU)."""
    nccl = dist.get_world_size() == 1
    group = dist.new_group([0], backend="nccl") if nccl else None
    device = torch.device("cuda", 0)
    x_held, y_held = (t.to(device) for t in batch(10_000, 0, rank))
    choose = time_policy.choose
    out = {}
    for name, (spec, options, schedule) in configs.items():
        time_policy.choose = choose if schedule is None else scheduled(schedule)
        model = make_model("mlp").to(device)
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=BUCKET_CAP_MB, process_group=group)
        state = gradcomp.register(ddp, spec, policy="time", **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            before = float(nn.functional.cross_entropy(model(x_held), y_held))
        error, stood, step = None, None, 0
        while error is None and (stood is None or step < stood + steps_after) and step < 400:
            x, y = (t.to(device) for t in batch(step, 0, rank))
            loss = nn.functional.cross_entropy(ddp(x), y)
            try:
                torch.cuda.set_sync_debug_mode("error" if nccl and stood is not None else "default")
                loss.backward()
            except RuntimeError as failure:
                error = f"step {step}: {failure}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if stood is None and state.iter > 0 and not state.deciding:
                stood = step
        torch.cuda.synchronize()
        with torch.no_grad():
            after = float(nn.functional.cross_entropy(model(x_held), y_held))
        out[name] = {"decision": state.stats()["decision"], "stood": stood, "error": error,
                     "held_out": (before, after), "schemes": {p.index: p.scheme for p in state._plans.values()},
                     "stats": state.stats()["total"], "params": [p.detach().cpu() for p in model.parameters()]}
    time_policy.choose = choose
    return out


class _LateWork:
    """A collective's work whose wait returns `late` seconds after the collective completed."""

    def __init__(self, work, late: float):
        self.work, self.late = work, late

    def wait(self, *args):
        done = self.work.wait(*args)
        time.sleep(self.late)
        return done


def probed_with_a_late_peer(rank, world, late):
    """measure_links' all-gather curve (small sizes) on this rank, rank 1 returning from every all-gather `late`
    seconds after it completed: a peer that starts every next run late (on gloo, the rank that finished a run last
    starts the next one last)."""
    if rank == 1:
        for name in ("all_gather_single", "all_gather_into_tensor"):
            gather = getattr(dist, name, None)
            if gather is not None:
                setattr(dist, name, lambda *a, _gather=gather, **k: _LateWork(_gather(*a, **k), late))
    curves = measure.measure_links({"world": ["all-gather"]}, {"world": None}, 4096, torch.device("cpu"),
                                   measure.Clock(torch.device("cpu")))
    return curves["world/all-gather"].seconds
