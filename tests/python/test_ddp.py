"""The DDP hook on 2 and 4 real processes (gloo): lossless settings equal plain DDP, every codec
trains, error feedback keeps its invariant, no_sync, DDP's options, resume, mismatched ranks."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn as nn

import ddp_scenarios as scenarios
import gradcomp
from ddp_harness import RankError, run_ranks, unwrap

EVERY_STEP = {"start_iter": 0, "min_bucket_ratio": 0}  # compress from step 0 (through DDP's rebuild), every bucket
LOSSLESS = {
    "plain": None,
    "none": ("none", EVERY_STEP),
    "topk ratio 1": ("topk:ratio=1", EVERY_STEP),
    "randomk ratio 1": ("randomk:ratio=1", EVERY_STEP),
    # A fresh Q each step: a warm-started Q squares the singular values of M (a power step), and the
    # smallest directions of a nearly rank-deficient M then fall below fp32 (they stay in the residual).
    "powersgd full rank": ("powersgd:rank=64,min_compression_rate=0,warm_start=false", EVERY_STEP),
    "powersgd full rank batched": ("powersgd:rank=64,min_compression_rate=0,warm_start=false,"
                                   "batch_same_shape=true", {}),
    "fp16": ("fp16", EVERY_STEP),
}
TOLERANCE = {"fp16": {"rtol": 2e-3, "atol": 2e-4}, "powersgd full rank": {"rtol": 1e-4, "atol": 1e-6},
             "powersgd full rank batched": {"rtol": 1e-4, "atol": 1e-6}}
COMPRESSED = ["fp16", "bf16", "signsgd", "signsgd:vote=true", "terngrad", "qsgd", "qsgd:levels=3,block=64",
              "topk:ratio=0.05", "topk:ratio=0.05,compact=true", "randomk:ratio=0.1", "powersgd:rank=2", "powersgd:rank=2,warm_start=false"]


def assert_lossless(results, reference="plain"):
    for rank_result in results:
        for name in LOSSLESS:
            for step, (got, want) in enumerate(zip(rank_result[name], rank_result[reference])):
                for param, (g, w) in enumerate(zip(got, want)):
                    torch.testing.assert_close(g, w, **TOLERANCE.get(name, {}),
                                               msg=lambda m: f"{name}, step {step}, parameter {param}: {m}")


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def lossless_runs(request):
    return unwrap(run_ranks(scenarios.lossless, request.param, (LOSSLESS, 4, {})))


def test_lossless_settings_equal_plain_ddp(lossless_runs):
    assert_lossless(lossless_runs)


@pytest.mark.parametrize("ddp_kwargs", [{"gradient_as_bucket_view": True}, {"static_graph": True}],
                         ids=["gradient_as_bucket_view", "static_graph"])
def test_ddp_options(ddp_kwargs):
    assert_lossless(unwrap(run_ranks(scenarios.lossless, 2, (LOSSLESS, 4, ddp_kwargs))))


def test_no_sync_accumulation_equals_one_process_on_the_whole_batch():
    results = unwrap(run_ranks(scenarios.lossless, 2, (LOSSLESS, 3, {}, 3)))
    assert_lossless(results)
    for name in LOSSLESS:
        for got, want in zip(results[0][name], results[0]["single"]):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, **TOLERANCE.get(name, {"rtol": 1e-5, "atol": 1e-6}))


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def training_runs(request):
    return unwrap(run_ranks(scenarios.training, request.param, (COMPRESSED, 30)))


@pytest.mark.parametrize("spec", COMPRESSED)
def test_every_codec_lowers_the_loss(training_runs, spec):
    for rank_result in training_runs:
        losses = rank_result[spec]["losses"]
        assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
        stats = rank_result[spec]["stats"]
        assert stats["step"] == 30
        assert stats["total"]["compressed_buckets"] > 0
        if not spec.startswith("fp16") and not spec.startswith("bf16"):
            assert stats["total"]["wire_bytes"] < stats["total"]["raw_bytes"] / 2, stats


def _flat_by_keys(pieces, keys, shapes):
    return torch.cat([pieces[k].reshape(-1) if k in pieces else torch.zeros(s.numel()) for k, s in zip(keys, shapes)])


@pytest.mark.parametrize("spec", [s for s in COMPRESSED if gradcomp.codec(s).error_feedback])
def test_error_feedback_invariant_on_every_rank(training_runs, spec):
    """Per rank and bucket: grad + old residual == what this rank's payload decodes to + new residual."""
    codec = gradcomp.codec(spec)
    checked = 0
    for rank_result in training_runs:
        for record in rank_result[spec]["records"]:
            keys, shapes = record["keys"], record["shapes"]
            if isinstance(codec, gradcomp.PowerSGD):  # its decoded value is the averaged output itself
                offsets = torch.tensor([0] + [s.numel() for s in shapes]).cumsum(0)
                for i, key in enumerate(keys):
                    if key not in record["new"]:
                        continue
                    part = lambda flat: flat[offsets[i]:offsets[i + 1]].reshape(record["new"][key].shape)  # noqa
                    old = record["old"].get(key, torch.zeros_like(record["new"][key]))
                    torch.testing.assert_close(part(record["grad"]) + old, part(record["out"]) + record["new"][key])
                    checked += 1
                continue
            m = record["grad"] + _flat_by_keys(record["old"], keys, shapes)
            payload = codec.encode(m, None, step=record["step"], bucket=record["bucket"], rank=record["rank"])
            local = codec.decode_sum(payload, torch.empty_like(m))
            torch.testing.assert_close(_flat_by_keys(record["new"], keys, shapes), m - local, rtol=1e-6, atol=1e-7)
            checked += 1
    assert checked > 0


def test_ranks_agree_on_the_averaged_gradient(training_runs):
    for spec in COMPRESSED:
        outs = [{(r["step"], r["bucket"]): r["out"] for r in rank_result[spec]["records"]}
                for rank_result in training_runs]
        assert outs[0], spec
        for other in outs[1:]:
            assert other.keys() == outs[0].keys()
            for key, out in other.items():
                assert torch.equal(outs[0][key], out), (spec, key)


RESUMED = ["none", "fp16", "bf16", "signsgd", "terngrad", "qsgd", "topk", "topk:compact=true", "randomk", "powersgd",
           "powersgd:batch_same_shape=true",
           ("topk", {"start_iter": 5, "start_codec": "qsgd:levels=127"}),  # saved under the start codec
           ("powersgd", {"start_iter": 3, "start_codec": "signsgd:error_feedback=false"})]  # saved after it


def test_resume_in_fresh_processes_is_bit_identical(tmp_path):
    full = unwrap(run_ranks(scenarios.resume, 2, (RESUMED, 7, 4, str(tmp_path), "full")))
    resumed = unwrap(run_ranks(scenarios.resume, 2, (RESUMED, 7, 4, str(tmp_path), "second")))
    for rank in range(2):
        for index, spec in enumerate(RESUMED):
            for a, b in zip(full[rank][index], resumed[rank][index]):
                assert torch.equal(a, b), (spec, rank, (a - b).abs().max())
        during_start = torch.load(tmp_path / f"ckpt.{len(RESUMED) - 2}.rank{rank}.pt", weights_only=False)
        assert during_start["gradcomp"]["start_buckets"], "saved at step 4 of 5 start steps, it holds their layout"


def test_start_codec_runs_the_first_steps_then_hands_over_with_nothing_carried():
    """topk after 3 steps of signs without error feedback, on 2 ranks: each of the first 3 steps' buckets
    arrives as the signs' average of the two ranks' gradients, at the signs' bytes, and the state holds no
    memory; then topk starts from a zero residual, and the start codec's plans are gone."""
    world, start_iter, steps, start_spec = 2, 3, 6, "signsgd:error_feedback=false"
    results = unwrap(run_ranks(scenarios.started, world, ("topk:ratio=0.1", start_spec, start_iter, steps)))
    signs, topk = gradcomp.codec(start_spec), gradcomp.codec("topk:ratio=0.1")
    by_step_bucket = [{(b["step"], b["bucket"]): b for b in r["buckets"]} for r in results]
    assert by_step_bucket[0].keys() == by_step_bucket[1].keys()
    sent_in_step = [0] * steps
    for (step, index), first in by_step_bucket[0].items():
        both = [ranks[(step, index)] for ranks in by_step_bucket]
        assert torch.equal(both[0]["out"], both[1]["out"]), (step, index)  # every rank applies the same average
        nonzero = both[0]["out"].count_nonzero().item() / both[0]["out"].numel()
        if step < start_iter:
            payloads = [signs.encode(b["grad"], None, step=step, bucket=index, rank=r) for r, b in enumerate(both)]
            average = signs.decode_sum(torch.stack(payloads), torch.empty_like(first["grad"]), alpha=1 / world)
            torch.testing.assert_close(first["out"], average, rtol=1e-6, atol=1e-9)
            assert nonzero > 0.9, (step, index, nonzero)
            sent_in_step[step] += (world - 1) * payloads[0].numel() * payloads[0].element_size()  # allgather
        else:
            assert nonzero <= 2 * 0.1 + 0.05, (step, index, nonzero)  # topk's 10% from each rank
            if step == start_iter:  # from a zero residual, what topk leaves of the gradient alone stays
                for rank, b in enumerate(both):
                    payload = topk.encode(b["grad"], None, step=step, bucket=index, rank=rank)
                    unsent = b["grad"] - topk.decode_sum(payload, torch.empty_like(b["grad"]))
                    residual = torch.cat([b["new"][k].reshape(-1) for k in b["keys"]])
                    torch.testing.assert_close(residual, unsent, rtol=0, atol=0)
    for rank_result in results:
        for step, stats in enumerate(rank_result["steps"]):
            if step < start_iter:
                assert stats["wire_bytes"] == sent_in_step[step] and stats["raw_bytes"] > 20 * stats["wire_bytes"]
                assert stats["memory_bytes"] == 0, (step, stats)
            assert stats["compressed_buckets"] == stats["buckets"] > 0, (step, stats)
            assert stats["start_plans"] == (0 if step >= start_iter - 1 else stats["buckets"]), (step, stats)


def test_ranks_configured_differently_fail_on_every_rank():
    cases = [
        [("topk", {}), ("qsgd", {})],
        [("topk:ratio=0.01", {}), ("topk:ratio=0.02", {})],
        [("powersgd", {"start_iter": 2}), ("powersgd", {"start_iter": 3})],
        [("topk", {"start_codec": "fp16"}), ("topk", {})],
        [("signsgd", {}), ("signsgd", {})],  # and afterwards the group still works
    ]
    results = unwrap(run_ranks(scenarios.mismatch, 2, (cases,), timeout=180, pg_timeout_s=30))
    for rank, errors in enumerate(results):
        for case, error in zip(cases[:-1], errors):
            assert error is not None and "configured differently" in error, (rank, case, error)
            assert "rank 0" in error and "rank 1" in error
        assert errors[-1] is None


HALF_PRECISION = [f"torch.{d} {s}" for d in ("float16", "bfloat16") for s in ("qsgd", "powersgd", "topk:ratio=0.1")]


def test_edge_cases():
    results = unwrap(run_ranks(scenarios.edge_cases, 2))
    for rank_result in results:
        for spec in ("powersgd", "topk:ratio=0.5"):
            case = rank_result[f"vectors {spec}"]
            assert case["losses"][-1] < case["losses"][0]
        # Only 1-D tensors: powersgd has nothing to compress, so the buckets go whole.
        assert results[0]["vectors powersgd"]["stats"]["total"]["compressed_buckets"] == 0
        assert any("sparse gradients go through plain allreduce" in w for w in rank_result["sparse"]["warnings"])
        alone = rank_result["world of one"]
        assert alone["losses"][-1] < 0.7 * alone["losses"][0]
        assert alone["stats"]["total"]["compressed_buckets"] > 0
        assert "already registered" in rank_result["twice"]
        for key in HALF_PRECISION:
            assert rank_result[key]["compressed"] > 0, key
            assert rank_result[key]["losses"][-1] < rank_result[key]["losses"][0], key
    for key in ("vectors powersgd", "vectors topk:ratio=0.5", "sparse", *HALF_PRECISION):
        for a, b in zip(results[0][key]["params"], results[1][key]["params"]):
            assert torch.equal(a, b), key


# -- single process: the API's own checks ------------------------------------------------------------------------------


def test_register_refuses_a_model_that_is_not_ddp():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        gradcomp.register(nn.Linear(2, 2), "topk")


@pytest.mark.parametrize("kwargs, message", [
    ({"spec": "zip"}, "unknown codec 'zip'"),
    ({"spec": "topk:ratio=2"}, r"ratio=2.0 is outside"),
    ({"spec": "topk", "start_iter": -1}, "start_iter=-1"),
    ({"spec": "topk", "min_bucket_ratio": float("nan")}, "min_bucket_ratio"),
    ({"spec": "topk", "frobnicate": 1}, "unknown parameter"),
    ({"spec": "topk", "nonfinite": "ignore"}, "nonfinite='ignore': the option is gone"),
    ({"spec": "topk", "start_codec": "topk"}, "start_codec='topk' keeps an error-feedback residual.*qsgd"),
    ({"spec": "topk", "start_codec": "powersgd:error_feedback=false"}, "keeps PowerSGD's Q"),
    ({"spec": "topk", "start_codec": "qsgd", "start_iter": 0}, "start_iter=0 leaves it none"),
    ({"spec": "topk", "start_codec": "zip"}, "start_codec='zip': unknown codec 'zip'"),
    ({"spec": "topk", "start_codec": 3}, "start_codec=3 must be a codec spec"),
])
def test_state_refuses_bad_configuration(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gradcomp.CompressionState(**kwargs)


def test_state_pickles_without_its_process_group():
    state = gradcomp.CompressionState("qsgd:levels=7", process_group=object(), start_iter=3, start_codec="bf16")
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None
    assert copy.spec == state.spec and copy.start_iter == 3 and copy.iter == 0
    assert copy.config()["start_codec"] == state.config()["start_codec"] == gradcomp.codec("bf16").spec()


def test_state_checks_stats_and_logging():
    for rank_result in unwrap(run_ranks(scenarios.state_checks, 2)):
        stats = rank_result["stats"]
        assert stats["step"] == 5
        last, total = stats["last"], stats["total"]
        assert last["raw_bytes"] == rank_result["param_bytes"]  # one step: every gradient once
        assert total["raw_bytes"] == 5 * rank_result["param_bytes"]
        assert 0 < last["wire_bytes"] < last["raw_bytes"] and last["ratio"] == last["raw_bytes"] / last["wire_bytes"]
        assert total["compressed_buckets"] == 3 * last["compressed_buckets"] > 0  # steps 2, 3, 4 compressed
        assert total["encode_s"] > 0 and total["decode_s"] > 0
        assert len(rank_result["log"]) == 2 and "step 4" in rank_result["log"][-1]
        refusals = rank_result["refusals"]
        assert "codec: saved 'topk:error_feedback=True,ratio=0.1', now 'topk:error_feedback=True,ratio=0.2'" in \
            refusals["codec"]
        assert "start_iter: saved 2, now 5" in refusals["start_iter"]
        assert f"start_codec: saved None, now {gradcomp.codec('fp16').spec()!r}" in refusals["start_codec"]
        assert "holds rank" in refusals["rank"]
        assert "not a gradcomp state" in refusals["foreign"]
        saved, reloaded = rank_result["saved"], rank_result["reloaded"]
        assert reloaded["iter"] == saved["iter"] == 5
        for a, b in zip(saved["buckets"], reloaded["buckets"]):
            assert a["keys"] == b["keys"] and torch.equal(a["tensors"]["residual"], b["tensors"]["residual"])


def test_state_loads_before_the_process_group_exists():
    """A checkpoint can be read before init_process_group; the ranks compare steps at the first hook call."""
    state = gradcomp.CompressionState("signsgd")
    saved = {"format": 1, "config": {**state.config(), "world_size": 2}, "rank": 1, "iter": 7, "buckets": [],
             "pool": {}, "total": {"raw_bytes": 10}}
    state.load_state_dict(saved)
    assert state.iter == 7 and state.stats()["total"]["raw_bytes"] == 10
