"""Silent corruption and lost state, on real processes (gloo): each test is a case that once went wrong
without a word, and backs a promise in docs/guarantees.md."""

from __future__ import annotations

import re

import pytest
import torch

import corruption_scenarios as scenarios
import gradcomp
from ddp_harness import run_ranks, unwrap

FP32_MAX, FP16_MAX = torch.finfo(torch.float32).max, torch.finfo(torch.float16).max


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


# -- PowerSGD's Q ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["powersgd:rank=1", "powersgd:rank=2,error_feedback=false"])
def test_powersgd_redraws_a_q_column_that_a_zero_gradient_emptied(spec):
    steps = 9
    results = unwrap(run_ranks(scenarios.collapsed_q, 2, (spec, steps)))
    for result in results:
        # Step 2, the first compressed one, leaves the odd head zero on every rank: Q = M^T P = 0. The odd
        # head is used at every odd step after it, and must not be stuck at a zero average from then on.
        assert torch.count_nonzero(result["odd"][2]) == 0
        for step in range(3, steps, 2):
            assert torch.count_nonzero(result["odd"][step]) > 0, f"step {step}: the odd head's average is zero"
        assert len(result["q"]) == 3  # the trunk's and both heads' weights
        for q in result["q"].values():  # [cols, rank] per matrix: no column all zero or non-finite
            assert torch.isfinite(q).all() and (q != 0).any(dim=0).all(), q
    for key, q in results[0]["q"].items():  # redrawn the same on every rank
        assert torch.equal(q, results[1]["q"][key])


def test_powersgd_redraws_a_loaded_q_column_that_holds_nan():
    results = unwrap(run_ranks(scenarios.nan_column_in_loaded_q, 2, (5,)))
    for result in results:
        for step_qs in result["q"]:
            assert len(step_qs) == 3  # one per weight matrix
            for q in step_qs.values():
                assert torch.isfinite(q).all() and (q != 0).any(dim=0).all(), q
        assert all(_all_finite(grads) for grads in result["grads"])
        last = torch.cat([g.reshape(-1) for g in result["grads"][-1]])
        assert torch.count_nonzero(last) > 0
    for key, q in results[0]["q"][-1].items():
        assert torch.equal(q, results[1]["q"][-1][key])


# -- finite gradients stay finite ------------------------------------------------------------------------------------

W = (1, 1)  # an element of the middle layer's weight
LARGE_FINITE = {
    # an fp16 model, one element of 30000 every step: its fp16 residual would pass 65504 by step 4
    "signsgd fp16 30000": ("signsgd", torch.float16, {W: (30000.0, 30000.0)}),
    # the bucket sums to about 0 but the sum of |m| passes fp32's range
    "signsgd +3e38 -3e38": ("signsgd", torch.float32, {W: (3e38, 3e38), (1, 2): (-3e38, -3e38)}),
    # a block's sum of squares passes fp32's range from |m| of about 1.8e19
    "qsgd error feedback 1e20": ("qsgd:error_feedback=true", torch.float32, {W: (1e20, 1e20)}),
    # plain DDP divides by the world size before it sums: 2e38 on both ranks averages to 2e38
    "topk 2e38 on both ranks": ("topk:ratio=0.1", torch.float32, {W: (2e38, 2e38)}),
    "terngrad 2e38 on both ranks": ("terngrad", torch.float32, {W: (2e38, 2e38)}),
    "fp16 codec of 1e5": ("fp16:error_feedback=true", torch.float32, {W: (1e5, 1e5)}),
    "topk fp16 40000": ("topk:ratio=0.1", torch.float16, {W: (40000.0, 40000.0)}),
    # compact sends fp32 values as bf16, whose largest finite value is below 3.4e38
    "topk compact 3.4e38": ("topk:ratio=0.1,compact=true", torch.float32, {W: (3.4e38, 3.4e38)}),
    "randomk bf16 3e38": ("randomk:ratio=0.1", torch.bfloat16, {W: (3e38, 3e38)}),
    "powersgd 1e30": ("powersgd:rank=2", torch.float32, {W: (1e30, -1e30)}),
}


@pytest.mark.parametrize("case", list(LARGE_FINITE))
def test_finite_gradients_never_give_a_nonfinite_average_residual_or_q(case):
    spec, dtype, values = LARGE_FINITE[case]
    results = unwrap(run_ranks(scenarios.large_finite_gradients, 2, ((spec, dtype, values), 10)))
    for result in results:
        assert result["stats"]["compressed_buckets"] > 0 and result["stats"]["nonfinite_buckets"] == 0
        for step, (averaged, held) in enumerate(zip(result["averaged"], result["held"])):
            assert _all_finite(averaged), f"{case}: a non-finite averaged gradient at step {step}"
            assert _all_finite(held.values()), f"{case}: a non-finite residual or Q at step {step}"
        middle = [avg[2][W] for avg in result["averaged"]]
        mean = sum(values[W]) / 2
        if "topk" in spec or "terngrad" in spec:  # the element is sent as it is: its average arrives
            assert all(abs(float(m) - mean) <= abs(mean) * 1e-2 for m in middle), middle
    for a, b in zip(results[0]["averaged"], results[1]["averaged"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- state that follows its model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "signsgd", "powersgd:rank=2",
                                  ("topk:ratio=0.1", {"start_iter": 8, "start_codec": "qsgd:levels=127"})],
                         ids=["topk", "signsgd", "powersgd", "topk pickled during its start codec"])
def test_a_pickled_state_continues_the_run_bit_for_bit(spec, tmp_path):
    split, total = 5, 12
    path = str(tmp_path / "state.pkl")
    full = unwrap(run_ranks(scenarios.pickled_state, 2, (spec, split, total, "full", path)))
    for how in ("by hand", "register"):
        for phase in ("same process", "spawned"):
            resumed = unwrap(run_ranks(scenarios.pickled_state, 2, (spec, split, total, phase, path, how)))
            for rank in range(2):
                assert len(resumed[rank]) == len(full[rank]) == total - split
                for step, (got, want) in enumerate(zip(resumed[rank], full[rank])):
                    for g, w in zip(got, want):
                        assert torch.equal(g, w), f"{spec}, {how}, {phase}, rank {rank}: step {split + step} differs"


def test_register_takes_the_process_group_ddp_was_built_with():
    specs = [None, "none", "topk:ratio=0.1", "powersgd:rank=1"]
    results = unwrap(run_ranks(scenarios.subgroup, 3, (specs, 4), timeout=120, pg_timeout_s=20))
    plain = [results[rank][None] for rank in range(2)]
    for rank in range(2):
        for got, want in zip(results[rank]["none"], plain[rank]):
            for g, w in zip(got, want):  # averaged over the 2 ranks of the group, not the world of 3
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    for spec in specs[2:]:
        for a, b in zip(results[0][spec], results[1][spec]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert results[2] == {}


def _first_holding(saved, name):
    return next(b["tensors"] for b in saved["buckets"] if b["tensors"].get(name) is not None
                and b["tensors"][name].numel() > 7)


def _residual_short(saved):
    tensors = _first_holding(saved, "residual")
    tensors["residual"] = tensors["residual"][:-7]


def _residual_float64(saved):
    tensors = _first_holding(saved, "residual")
    tensors["residual"] = tensors["residual"].double()


def _q_short(saved):
    tensors = _first_holding(saved, "q")
    tensors["q"] = tensors["q"][:-1]


def _other_keys(saved):
    for bucket in saved["buckets"]:
        bucket["keys"] = [key + 100 for key in bucket["keys"]]


def _other_shapes(saved):  # a weight saved transposed: the same element count, another shape
    for bucket in saved["buckets"]:
        for shape in bucket["shapes"]:
            if len(shape) == 2 and shape[0] != shape[1]:
                shape.reverse()
                return


TAMPERINGS = {
    "topk:ratio=0.1": {"residual 7 short": (_residual_short, r"residual of bucket \d+ is \[\d+\] torch.float32; "
                                                            r"this configuration expects \[\d+\] torch.float32"),
                       "float64 residual": (_residual_float64, r"is \[\d+\] torch.float64; this configuration "
                                                               r"expects \[\d+\] torch.float32"),
                       "other keys": (_other_keys, r"parameter 10\d, but the model has 6 parameters"),
                       "other shapes": (_other_shapes, r"state of parameter \d is for shape \[\d+(, \d+)?\] "
                                                       r"torch.float32; the model's parameter \d is")},
    "powersgd:rank=2": {"q short": (_q_short, r"q of bucket \d+ is \[\d+\] torch.float32; this configuration "
                                              r"expects \[\d+\] torch.float32"),
                        "residual 7 short": (_residual_short, r"residual of bucket \d+ is \[\d+\]")},
}


@pytest.mark.parametrize("spec", list(TAMPERINGS))
def test_load_state_dict_refuses_state_that_does_not_fit(spec):
    tamperings = {name: tamper for name, (tamper, _) in TAMPERINGS[spec].items()}
    errors = unwrap(run_ranks(scenarios.tampered_checkpoints, 1, (spec, tamperings)))[0]
    for name, (_, pattern) in TAMPERINGS[spec].items():
        for when in ("after register", "before register"):
            error = errors[name, when]
            assert error is not None, f"{spec}: {name} ({when}) loaded without a word"
            assert re.search(pattern, error), (name, when, error)


# -- the compressed path's collectives --------------------------------------------------------------------------------


def test_a_compressed_bucket_issues_only_its_codecs_collectives():
    specs = {"topk:ratio=0.1": 1, "signsgd": 1, "qsgd": 1, "randomk:ratio=0.1": 1, "fp16": 1, "powersgd:rank=2": 2}
    for rank_result in unwrap(run_ranks(scenarios.counted_collectives, 2, (list(specs), 6))):
        for spec, per_bucket in specs.items():
            for step, record in enumerate(rank_result[spec][2:], start=2):  # past the warm-up
                assert record["compressed"] > 0, (spec, record)
                plain = record["buckets"] - record["compressed"]  # too small to gain: one allreduce each
                total = sum(record["collectives"].values())
                assert total == per_bucket * record["compressed"] + plain, (spec, step, record)


# -- argument checks -----------------------------------------------------------------------------------------------


def test_codec_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"ratio=1000000000.* is outside \(0, 1\]"):
        gradcomp.codec("topk", ratio=10**400)
    codec = gradcomp.codec("topk")
    grad = torch.randn(100)
    with pytest.raises(ValueError, match=r"bucket=9223372036854775808 must be an integer in \[0, 2\^32\)"):
        codec.encode(grad, bucket=2**63)
    with pytest.raises(ValueError, match=r"rank=1.5 must be an integer"):
        codec.encode(grad, rank=1.5)
    with pytest.raises(ValueError, match=r"step=-1 must be an integer"):
        codec.encode(grad, step=-1)
    with pytest.raises(ValueError, match=r"parameter 'ratio' is given twice in the spec 'topk:ratio=0.1,ratio=0.2'"):
        gradcomp.codec("topk:ratio=0.1,ratio=0.2")


def test_a_pickled_state_registered_on_another_rank_or_world_size_is_refused_on_every_rank(tmp_path):
    """The allgather scheme's plans need no rank to run, so only a check can tell: rank r would train on with
    rank r+1's residuals, or 3 ranks with 2 ranks' states. Every rank raises, saying what to do."""
    path = str(tmp_path / "state.pkl")
    unwrap(run_ranks(scenarios.pickled_elsewhere, 2, (path, None)))
    assert unwrap(run_ranks(scenarios.pickled_elsewhere, 2, (path, [0, 1]))) == [None, None]  # its own: fine
    for world, mapping in ((2, [1, 0]), (3, [0, 1, 1])):
        for error in unwrap(run_ranks(scenarios.pickled_elsewhere, world, (path, mapping))):
            assert error and "residuals belong to the rank that built them" in error, error
            assert "each rank registers the state it pickled itself" in error and "fresh CompressionState" in error
    error = unwrap(run_ranks(scenarios.pickled_elsewhere, 2, (path, [1, 0])))[0]
    assert "rank 0 holds residuals of rank 1 of 2" in error and "rank 1 holds residuals of rank 0 of 2" in error


def test_an_owner_whose_re_encode_fails_is_named_by_the_other_ranks():
    errors = unwrap(run_ranks(scenarios.owner_fails, 3, (1, 3)))
    assert "bad magic" in errors[1], errors[1]  # the owner's own error
    for rank in (0, 2):
        assert "rank 1, which owns chunk 1 of bucket" in errors[rank] and "could not re-encode it in step 2" in \
            errors[rank] and "bad magic" in errors[rank], errors[rank]
