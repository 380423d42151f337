"""The user-facing API: names, specs, parameters and the errors for bad input."""

import math
import pickle

import pytest
import torch

import gradcomp

ALL_CODECS = ["none", "fp16", "bf16", "signsgd", "terngrad", "qsgd", "topk", "randomk", "powersgd"]


def test_available_lists_every_codec_with_defaults():
    listed = gradcomp.available()
    assert sorted(listed) == sorted(ALL_CODECS)
    assert listed["topk"] == {"ratio": 0.01, "error_feedback": True, "compact": False}
    assert listed["qsgd"]["levels"] == 15 and listed["qsgd"]["block"] == 512
    assert listed["powersgd"]["rank"] == 2
    assert listed["signsgd"]["error_feedback"] is True and listed["terngrad"]["error_feedback"] is False
    for name in ALL_CODECS:
        assert name in gradcomp.describe()


@pytest.mark.parametrize("name", ALL_CODECS)
def test_every_name_builds_with_its_defaults(name):
    c = gradcomp.codec(name)
    assert c.name == name
    # Every parameter is in params, but for an option added later whose default changes nothing: it is named
    # only when on, so that the spec, and the configuration a checkpoint holds, stay what they were.
    added_later = {"topk": {"compact"}}.get(name, set())
    assert c.params == {k: v for k, v in gradcomp.available()[name].items() if k not in added_later}
    assert c.collective in ("allreduce", "allgather")


def test_spec_string_and_keyword_parameters():
    c = gradcomp.codec("qsgd:levels=16,block=256")
    assert (c.levels, c.block) == (16, 256)
    c = gradcomp.codec("qsgd:levels=16", block=64)
    assert (c.levels, c.block) == (16, 64)
    c = gradcomp.codec(" TopK : ratio = 0.001 , error_feedback = false ")
    assert c.ratio == 0.001 and c.error_feedback is False
    assert gradcomp.codec("signsgd:vote=true").vote is True
    assert gradcomp.codec("powersgd:rank=4").rank == 4
    assert gradcomp.parse_spec("randomk:ratio=0.1,seed=7") == ("randomk", {"ratio": 0.1, "seed": 7})


def test_topk_compact_is_named_only_when_on():
    assert gradcomp.codec("topk").spec() == "topk:error_feedback=True,ratio=0.01"  # as before the option
    assert gradcomp.codec("topk:compact=false").spec() == "topk:error_feedback=True,ratio=0.01"
    compact = gradcomp.codec("topk:compact=true")
    assert compact.spec() == "topk:compact=True,error_feedback=True,ratio=0.01"
    assert gradcomp.codec(compact.spec()).compact is True
    with pytest.raises(ValueError, match="compact must be True or False, got 1"):
        gradcomp.codec("topk", compact=1)


def test_spec_round_trips():
    for name in ALL_CODECS:
        c = gradcomp.codec(name)
        again = gradcomp.codec(c.spec())
        assert again.params == c.params


@pytest.mark.parametrize(
    "spec, params, message",
    [
        ("zip", {}, "unknown codec 'zip'; valid codecs: none, fp16"),
        ("", {}, "non-empty string"),
        ("topk:ratio", {}, "expected key=value"),
        ("topk:k=5", {}, "unknown parameter 'k'; valid parameters: ratio, error_feedback"),
        ("topk", {"levels": 3}, "unknown parameter(s) levels"),
        ("topk:ratio=abc", {}, "cannot read ratio='abc' as float"),
        ("topk:ratio=0", {}, "ratio=0.0 is outside (0, 1]"),
        ("topk:ratio=1.5", {}, "ratio=1.5 is outside (0, 1]"),
        ("topk:ratio=nan", {}, "ratio=nan is outside (0, 1]"),
        ("randomk:ratio=-0.1", {}, "ratio=-0.1 is outside (0, 1]"),
        ("powersgd:rank=0", {}, "rank=0 must be an integer >= 1"),
        ("qsgd:levels=0", {}, "levels=0 is outside [1, 32767]"),
        ("qsgd:levels=40000", {}, "levels=40000 is outside [1, 32767]"),
        ("qsgd:block=0", {}, "block=0 is outside [1,"),
        ("signsgd:block=0", {}, "signsgd: block=0 is outside [1,"),
        ("signsgd", {"block": 2.5}, "signsgd: block must be an integer"),
        ("terngrad:seed=-1", {}, "seed=-1 must be an integer in [0, 2^63)"),
        ("signsgd:vote=maybe", {}, "cannot read vote='maybe' as bool"),
        ("fp16", {"error_feedback": "yes"}, "error_feedback must be True or False"),
    ],
)
def test_bad_specs_name_the_problem(spec, params, message):
    with pytest.raises(ValueError) as error:
        gradcomp.codec(spec, **params)
    assert message in str(error.value)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.complex64, torch.float64, torch.bool])
def test_unsupported_gradient_dtypes_are_refused(dtype):
    grad = torch.zeros(10, dtype=dtype)
    with pytest.raises(ValueError, match=r"supported dtypes are float32, float16 and bfloat16"):
        gradcomp.codec("topk").encode(grad)


def test_mismatched_residual_is_refused():
    c = gradcomp.codec("signsgd")
    grad = torch.randn(100)
    with pytest.raises(ValueError, match="residual must match"):
        c.encode(grad, torch.zeros(99))
    with pytest.raises(ValueError, match="residual must match"):
        c.encode(grad, torch.zeros(100, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        c.encode(grad, torch.zeros(200)[::2])
    with pytest.raises(ValueError, match="different tensors"):
        c.encode(grad, grad)


def test_raw_op_names_bad_codec_and_parameters():
    grad = torch.randn(10)
    with pytest.raises(ValueError, match="unknown codec 'lz4'; valid codecs"):
        torch.ops.gradcomp.encode(grad, None, "lz4")
    with pytest.raises(ValueError, match=r"k outside \[1, numel\]"):
        torch.ops.gradcomp.encode(grad, None, "topk", 11)
    with pytest.raises(ValueError, match=r"qsgd levels outside"):
        torch.ops.gradcomp.encode(grad, None, "qsgd", 0, 4)
    with pytest.raises(ValueError, match=r"signsgd block outside \[1, 2\^40\]"):
        torch.ops.gradcomp.encode(grad, None, "signsgd", 0, 0)
    with pytest.raises(ValueError, match=r"step=-1 must lie in \[0, 2\^32\)"):
        torch.ops.gradcomp.encode(grad, None, "signsgd", 0, 256, 0, -1)


def test_decode_refuses_foreign_payloads_and_bad_outputs():
    c = gradcomp.codec("topk:ratio=0.1")
    payload = c.encode(torch.randn(100))
    with pytest.raises(ValueError, match="bad magic"):
        c.decode_sum(torch.zeros_like(payload), torch.empty(100))
    with pytest.raises(ValueError, match="payloads must be uint8"):
        c.decode_sum(payload.float(), torch.empty(100))
    with pytest.raises(ValueError, match="the output has 99 elements"):
        c.decode_sum(payload, torch.empty(99))
    with pytest.raises(ValueError, match="must be contiguous"):
        c.decode_sum(payload, torch.empty(200)[::2])
    with pytest.raises(ValueError, match="vote=True applies to signsgd payloads only"):
        torch.ops.gradcomp.decode_sum(payload, torch.empty(100), 1.0, True)
    with pytest.raises(ValueError, match="no payloads"):
        c.decode_sum(payload[None][:0], torch.empty(100))


@pytest.mark.parametrize("ratio, n, k", [(0.01, 100, 1), (0.07, 100, 7), (0.001, 10, 1), (1.0, 5, 5), (0.5, 3, 2),
                                         (0.01, 0, 0), (1e-9, 1000, 1), (0.3, 10, 3)])
def test_k_is_the_ceiling_of_the_decimal_ratio(ratio, n, k):
    assert gradcomp.count_for_ratio(ratio, n) == k


@pytest.mark.parametrize("name", [n for n in ALL_CODECS if n != "powersgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_payload_size_is_what_encode_produces(name, dtype):
    c = gradcomp.codec(name)
    for n in (0, 1, 7, 1000, 4099):
        assert c.encode(torch.randn(n).to(dtype)).numel() == c.payload_nbytes(n, dtype)


def test_a_signsgd_pickled_before_the_block_option_keeps_one_scale_per_bucket():
    old = gradcomp.codec("signsgd")
    del old.block  # what such a pickle restores: no block attribute
    restored = pickle.loads(pickle.dumps(old))
    assert restored.wire_params(1000) == (0, gradcomp._ops._C.max_block)
    assert restored.payload_nbytes(1000) == (48 + 4 + 125 + 15) // 16 * 16


def test_payload_sizes_follow_the_documented_formulas():
    n = 10_000
    pad = lambda b: (b + 15) // 16 * 16  # noqa: E731
    assert gradcomp.codec("none").payload_nbytes(n) == pad(48 + 4 * n)
    assert gradcomp.codec("fp16").payload_nbytes(n) == pad(48 + 2 * n)
    assert gradcomp.codec("bf16").payload_nbytes(n, torch.float16) == pad(48 + 2 * n)
    assert gradcomp.codec("signsgd").payload_nbytes(n) == pad(48 + 4 * math.ceil(n / 256) + math.ceil(n / 8))
    assert gradcomp.codec("signsgd:block=10000").payload_nbytes(n) == pad(48 + 4 + math.ceil(n / 8))
    assert gradcomp.codec("terngrad").payload_nbytes(n) == pad(48 + 4 + math.ceil(n / 4))
    bits = 1 + math.ceil(math.log2(16 + 1))
    assert gradcomp.codec("qsgd:levels=16,block=512").payload_nbytes(n) == pad(48 + 4 * math.ceil(n / 512) + math.ceil(n * bits / 8))
    assert gradcomp.codec("topk:ratio=0.01").payload_nbytes(n) == pad(48 + 100 * (4 + 4))
    assert gradcomp.codec("topk:ratio=0.01").payload_nbytes(n, torch.bfloat16) == pad(48 + 100 * (4 + 2))
    assert gradcomp.codec("randomk:ratio=0.01").payload_nbytes(n) == pad(48 + 100 * 4)
    p = gradcomp.codec("powersgd:rank=4")
    assert p.payload_nbytes((256, 128, 3, 3)) == (256 + 128 * 9) * 4 * 4
    assert p.payload_nbytes((256,)) == 256 * 4
    assert p.payload_nbytes((3, 3)) == 9 * 4  # too small to gain: travels whole


def test_summable_view_exposes_the_values_for_allreduce():
    grad = torch.randn(50)
    c = gradcomp.codec("fp16")
    payload = c.encode(grad)
    view = c.summable_view(payload, 50, grad.dtype)
    assert view.dtype == torch.float16 and torch.equal(view, grad.half())
    view.mul_(2)  # what an allreduce of two identical ranks does
    out = torch.empty(50)
    c.decode_sum(payload, out, alpha=0.5)
    assert torch.equal(out, grad.half().float())
    with pytest.raises(ValueError, match="gathered, not summed"):
        gradcomp.codec("topk").summable_view(payload, 50, grad.dtype)


def test_out_overlapping_the_payloads_is_refused():
    c = gradcomp.codec("topk:ratio=1.0")
    stacked = torch.stack([c.encode(torch.randn(4)), c.encode(torch.randn(4))])
    inside = stacked.view(-1)[128:144].view(torch.float32)  # lies over payload 1's indices
    before = stacked.clone()
    with pytest.raises(ValueError, match="must not share memory with the payloads"):
        c.decode_sum(stacked, inside)
    assert torch.equal(stacked, before)


def test_residual_overlapping_the_gradient_is_refused():
    storage = torch.randn(150)
    with pytest.raises(ValueError, match="share no memory"):
        gradcomp.codec("signsgd").encode(storage[:100], storage[50:])


def test_raw_op_refuses_blocks_whose_sizes_would_overflow():
    with pytest.raises(ValueError, match=r"qsgd block outside \[1, 2\^40\]"):
        torch.ops.gradcomp.encode(torch.ones(2), None, "qsgd", 1, 2**63 - 1)
    with pytest.raises(ValueError, match="dtype id 256"):
        gradcomp._ops._C.payload_nbytes("none", 256, 10)
    with pytest.raises(ValueError, match=r"levels='3' is outside"):
        gradcomp.codec("qsgd", levels="3")


def test_log_every_shows_its_lines_without_a_logging_setup_and_keeps_a_programs_own():
    """log_every=N asks for lines: with no logging set up they go to stderr (not nowhere); where the program set up
    logging, its handlers alone write them (no line twice)."""
    import subprocess
    import sys
    probe = ("import logging, gradcomp; {setup}gradcomp.CompressionState('topk', log_every=1); "
             "logging.getLogger('gradcomp').info('gradcomp probe line')")
    bare = subprocess.run([sys.executable, "-c", probe.format(setup="")], capture_output=True, text=True, check=True)
    assert bare.stderr.count("gradcomp probe line") == 1, bare.stderr
    configured = subprocess.run([sys.executable, "-c", probe.format(setup="logging.basicConfig(level='INFO', "
                                 "format='app: %(message)s'); ")], capture_output=True, text=True, check=True)
    assert configured.stderr.count("gradcomp probe line") == 1 and "app: gradcomp probe line" in configured.stderr
    quiet = subprocess.run([sys.executable, "-c", "import logging, gradcomp; gradcomp.CompressionState('topk'); "
                            "logging.getLogger('gradcomp').info('gradcomp probe line')"], capture_output=True,
                           text=True, check=True)
    assert "gradcomp probe line" not in quiet.stderr  # without log_every nothing changes
