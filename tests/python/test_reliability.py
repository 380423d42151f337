"""Reliability on real processes (gloo): non-finite gradients, ranks that die or stall, DDP's less common
settings, memory over many steps, checkpoints from another world size. Each test backs a promise in
docs/guarantees.md."""

from __future__ import annotations

import math
import re

import pytest
import torch

import gradcomp

import reliability_scenarios as scenarios
from ddp_harness import run_ranks, unwrap
from test_ddp import LOSSLESS, TOLERANCE

# Every codec family, error feedback on wherever the codec has it.
NONFINITE_SPECS = ["topk:ratio=0.1", "randomk:ratio=0.1", "signsgd", "terngrad:error_feedback=true",
                   "qsgd:error_feedback=true", "fp16:error_feedback=true", "powersgd:rank=2"]
BAD_STEP, STEPS = 4, 12


def _poisoned(bucket_records):
    """The buckets whose gradient holds a NaN or Inf on some rank (the same indices on every rank)."""
    return {i for ranks in zip(*bucket_records) for i in [ranks[0][0]] if
            any(not torch.isfinite(r[1]["grad"]).all() for r in ranks)}


@pytest.fixture(scope="module")
def nonfinite_runs():
    return unwrap(run_ranks(scenarios.nonfinite, 2, (NONFINITE_SPECS, BAD_STEP, STEPS)))


@pytest.mark.parametrize("spec", NONFINITE_SPECS)
def test_nonfinite_gradient_makes_the_bucket_nonfinite_everywhere_and_spares_the_state(nonfinite_runs, spec):
    _check_nonfinite([r[spec] for r in nonfinite_runs], spec)


# At 3 ranks the gathered codecs' larger buckets take the two-phase scheme: a NaN or Inf must survive the
# owners' re-encoding, and the owners' residuals be spared too.
TWO_PHASE_NONFINITE_SPECS = ["topk:ratio=0.1", "signsgd", "terngrad:error_feedback=true", "qsgd:error_feedback=true"]


@pytest.fixture(scope="module")
def two_phase_nonfinite_runs():
    return unwrap(run_ranks(scenarios.nonfinite, 3, (TWO_PHASE_NONFINITE_SPECS, BAD_STEP, STEPS)))


@pytest.mark.parametrize("spec", TWO_PHASE_NONFINITE_SPECS)
def test_nonfinite_gradient_under_the_two_phase_scheme(two_phase_nonfinite_runs, spec):
    runs = [r[spec] for r in two_phase_nonfinite_runs]
    poisoned = _poisoned([sorted(run["buckets"].items()) for run in runs])
    assert all("owner_residual" in run["buckets"][i]["before"] for run in runs for i in poisoned)  # two-phase
    _check_nonfinite(runs, spec)


def _check_nonfinite(runs, spec):
    records = [sorted(run["buckets"].items()) for run in runs]
    poisoned = _poisoned(records)
    assert len(poisoned) == 1, poisoned  # the middle layer's weight lies in one bucket
    for index, _ in records[0]:
        for rank_records in records:
            record = dict(rank_records)[index]
            # Only the poisoned bucket arrives non-finite (on every rank, the NaN rank's and the Inf rank's
            # and the rank with neither alike); the step's other buckets are compressed as usual.
            assert bool(torch.isfinite(record["out"]).all()) == (index not in poisoned), (index, record["out"])
            if index not in poisoned:
                continue
            # Residuals and Q exactly as before the step, on every rank.
            assert record["before"].keys() == record["after"].keys()
            for name, tensor in record["before"].items():
                assert torch.equal(tensor, record["after"][name]), f"{spec}: {name} changed"
                assert torch.isfinite(record["after"][name]).all()
    for run in runs:
        # GradScaler saw the Inf/NaN: it skipped that step (parameters unchanged) and halved its scale once.
        assert run["scale"] == 512.0
        for before, after in zip(run["params"][BAD_STEP - 1], run["params"][BAD_STEP]):
            assert torch.equal(before, after)
        assert all(math.isfinite(loss) for loss in run["losses"])
        assert all(torch.isfinite(p).all() for p in run["params"][-1])
        assert sum(run["losses"][-3:]) < sum(run["losses"][:3])
        assert run["stats"]["nonfinite_buckets"] == 1
        assert run["stats"]["compressed_buckets"] > 0
    # Every rank got the same averaged gradient, NaN for NaN.
    for first, *others in zip(*records):
        for other in others:
            torch.testing.assert_close(first[1]["out"], other[1]["out"], rtol=0, atol=0, equal_nan=True)


FAULTS = [("topk:ratio=0.1", {}, "die"), ("topk:ratio=0.1", {}, "stall"),
          ("topk:ratio=0.1", {"start_iter": 100}, "die"), ("topk:ratio=0.1", {"start_iter": 100}, "stall"),
          ("powersgd:rank=1", {}, "die in backward")]


@pytest.mark.parametrize("spec, register_kwargs, kind", FAULTS,
                         ids=["compressed-die", "compressed-stall", "plain allreduce-die", "plain allreduce-stall",
                              "powersgd-die in backward"])
def test_a_rank_that_dies_or_stalls_ends_the_others_step_with_a_clear_error(spec, register_kwargs, kind):
    pg_timeout_s = 6
    results = run_ranks(scenarios.fault, 3, (spec, register_kwargs, kind, 4), timeout=120,
                        pg_timeout_s=pg_timeout_s, wait_for=[0, 1])
    assert results[2] is None  # the faulty rank never reported
    for result in unwrap(results[:2]):
        assert result["step"] == 4, result
        assert result["error"] is not None, result
        assert "gradcomp: the" in result["error"] and "step 4 failed" in result["error"], result["error"]
        assert "Unable to cast" not in result["error"], result["error"]  # a failed future read as a tensor
        if kind == "stall":  # gloo words it as a timeout, or as a pair closed on the timeout
            assert re.search("(?i)timed out|timeout", result["error"]), result["error"]
            assert result["after_s"] < pg_timeout_s + 10, result
        else:  # a dead peer closes its connections: the others learn at once
            assert result["after_s"] < 5, result


def test_find_unused_parameters_and_a_parameter_of_zero_elements():
    configs = {name: config for name, config in LOSSLESS.items() if "batched" not in name}
    configs["topk compressed"] = ("topk:ratio=0.2", {})
    configs["powersgd compressed"] = ("powersgd:rank=1", {})
    results = unwrap(run_ranks(scenarios.unused_parameters, 2, (configs, 8)))
    for rank_result in results:
        plain = rank_result["plain"]
        for name in LOSSLESS:
            if name not in configs:
                continue
            for step, (got, want) in enumerate(zip(rank_result[name]["grads"], plain["grads"])):
                for param, (g, w) in enumerate(zip(got, want)):
                    assert (g is None) == (w is None), (name, step, param)
                    if g is not None:
                        torch.testing.assert_close(g, w, **TOLERANCE.get(name, {}),
                                                   msg=lambda m: f"{name}, step {step}, parameter {param}: {m}")
        for name in ("topk compressed", "powersgd compressed"):
            losses = rank_result[name]["losses"]
            assert all(math.isfinite(x) for x in losses) and sum(losses[-2:]) < sum(losses[:2]), (name, losses)
    for name in configs:  # every rank received the same averaged gradients, unused parameters included
        for a, b in zip(results[0][name]["grads"], results[1][name]["grads"]):
            for g, h in zip(a, b):
                assert (g is None and h is None) or torch.equal(g, h), name


def test_memory_is_bounded_and_does_not_grow():
    specs = ["topk:ratio=0.1", "qsgd", "powersgd:rank=2"]
    steps = 60
    for rank_result in unwrap(run_ranks(scenarios.memory, 2, (specs, steps))):
        topk, qsgd, powersgd = (rank_result[s] for s in specs)
        # The documented bound: twice a residual of the gradient's size with error feedback (the step writes
        # the new one beside the old), nothing without; powersgd: twice an fp32 residual of its matrices plus Q.
        assert set(topk["held"][2:]) == {2 * topk["param_bytes"]}
        assert set(qsgd["held"]) == {0}
        assert len(set(powersgd["held"][2:])) == 1
        assert 8 * powersgd["matrix_numel"] < powersgd["held"][-1] < 8 * powersgd["matrix_numel"] * 1.5
        for run in (topk, qsgd, powersgd):
            # No tensors kept per step: 50 more steps would leave 50 more. A couple come and go with the
            # moment of counting (the last bucket's future, the loss).
            assert run["live"][steps - 1] <= run["live"][10] + 2, run["live"]


def test_resuming_on_another_world_size_is_refused_with_what_to_do():
    import ddp_scenarios

    saved = unwrap(run_ranks(ddp_scenarios.state_checks, 2))[0]["saved"]
    error = unwrap(run_ranks(scenarios.load_elsewhere, 1, (saved,)))[0]
    assert error is not None and "world_size: saved 2, now 1" in error and "fresh CompressionState" in error


IDLE_SETTINGS = {"": ({}, True), ", bucket views": ({"gradient_as_bucket_view": True}, True),
                 ", bucket views, zeroed grads": ({"gradient_as_bucket_view": True}, False),
                 ", zeroed grads": ({}, False)}


def test_error_feedback_loses_nothing_for_a_parameter_no_rank_used():
    """find_unused_parameters=True, 3 ranks. A parameter no rank used at a step receives exactly 0 (its head
    alternates with the other one; a third head is never used). With error feedback, per element, the sum
    over the steps of the ranks' mean gradient equals the sum of the gradients DDP left in .grad, plus the
    ranks' mean residual, plus the two-phase owner's residual: what error feedback sent for a parameter no
    rank used is not lost, and the head no step uses keeps a residual of zero."""
    configs = {f"{spec} {scheme}{setting}": (spec, scheme, options, set_to_none)
               for spec in ("signsgd", "topk:ratio=0.2") for scheme in ("allgather", "two-phase")
               for setting, (options, set_to_none) in IDLE_SETTINGS.items()}
    configs.update({f"{spec}{setting}": (spec, "auto", options, set_to_none)
                    for spec in ("powersgd:rank=1", "randomk:ratio=0.3", "qsgd", "signsgd:error_feedback=false")
                    for setting, (options, set_to_none) in list(IDLE_SETTINGS.items())[:2]})
    steps, world = 6, 3
    results = unwrap(run_ranks(scenarios.unused_error_feedback, world, (configs, steps), timeout=600))
    assert_nothing_lost_for_unused_heads(results, configs, steps, replicas=world)


def assert_nothing_lost_for_unused_heads(results, configs, steps, replicas):
    """The checks of the test above on what scenarios.unused_error_feedback returned. replicas: how many ranks
    hold a residual of each element, to average over (the world; under the hierarchical scheme, the nodes)."""
    world = len(results)
    names = [name for name, _ in scenarios.IdleHead().named_parameters()]
    unused_at = {position: (lambda t: t % 2 == 1) if name.startswith("even.") else (lambda t: t % 2 == 0)
                 if name.startswith("odd.") else (lambda t: True) if name.startswith("idle.") else (lambda t: False)
                 for position, name in enumerate(names)}
    lost = []
    for name, (spec, *_) in configs.items():
        runs = [result[name] for result in results]
        assert runs[0]["compressed"] > 0, name
        for position, parameter in enumerate(names):
            applied = [runs[0]["applied"][t][position] for t in range(steps)]
            moved = [t for t in range(steps) if unused_at[position](t) and applied[t].any()]
            if moved:
                lost.append(f"{name}: {parameter}, unused on every rank, received a gradient at steps {moved}")
            if not gradcomp.codec(spec).error_feedback:
                continue
            averaged = sum(sum(run["sent"][t][position] for run in runs) / world for t in range(steps))
            kept = sum(run["residual"][position] for run in runs if run["residual"][position] is not None)
            kept = kept / replicas + sum(run["owner"][position] for run in runs if run["owner"][position] is not None)
            gap = (averaged - sum(applied) - kept).abs()
            scale = averaged.abs().max() if averaged.numel() else torch.tensor(0.0)
            if gap.numel() and float(gap.max()) > 1e-5 * max(float(scale), 1.0):
                lost.append(f"{name}: {parameter} lost {float(gap.max()):.3g} of {float(scale):.3g}")
            if parameter.startswith("idle.") and torch.as_tensor(kept).any():
                lost.append(f"{name}: {parameter}, never used, holds a residual")
    assert not lost, "\n".join(lost)
