"""The CUDA codecs through torch.ops.gradcomp: bit for bit the CPU codecs' payloads, residuals and
sums, and the two-phase ops'; device-side payload checks; device errors; the DDP hook with two ranks on
one GPU (gloo); no host-device sync in a DDP step on NCCL; policy="time" deciding from CUDA events. Every test
here needs a CUDA GPU and skips cleanly without one."""

import pytest
import torch

import gradcomp
import ddp_scenarios as scenarios
from ddp_harness import run_ranks, unwrap
from gradcomp.codecs import chunk_bounds

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
needs_cuda_build = pytest.mark.skipif(not gradcomp.cuda_built, reason="gradcomp was built without CUDA codecs")

SPECS = ["none", "fp16", "bf16", "signsgd", "signsgd:error_feedback=false", "terngrad", "qsgd",
         "qsgd:levels=3,block=5000", "qsgd:levels=255,block=64", "topk:ratio=0.01", "topk:ratio=0.3",
         "randomk:ratio=0.05", "terngrad:seed=7,error_feedback=true"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 37, 4097, 300_001]


def gradient(n, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator) * torch.exp2(torch.randint(-4, 5, (n,), generator=generator).float())
    x[torch.randint(0, n, (n // 17 + 1,), generator=generator)] = 0.0  # zeros
    x[torch.randint(0, n, (n // 23 + 1,), generator=generator)] = 0.5  # ties
    return x.to(dtype)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@needs_cuda_build
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_payloads_residuals_and_sums_are_the_cpu_bits(spec, dtype, n):
    codec = gradcomp.codec(spec)
    cpu_payloads, cuda_payloads = [], []
    for rank in range(3):
        grad = gradient(n, dtype, rank)
        residual = gradient(n, dtype, 10 + rank) if codec.error_feedback else None
        cuda_residual = residual.cuda() if residual is not None else None
        cpu_payloads.append(codec.encode(grad, residual, step=5, bucket=2, rank=rank))
        cuda_payloads.append(codec.encode(grad.cuda(), cuda_residual, step=5, bucket=2, rank=rank))
        assert cuda_payloads[-1].is_cuda
        assert same_bits(cuda_payloads[-1], cpu_payloads[-1]), f"payload of rank {rank}"
        if residual is not None:
            assert same_bits(cuda_residual, residual), f"residual of rank {rank}"
    for count in (1, 3):
        stacked = torch.stack(cpu_payloads[:count])
        want = codec.decode_sum(stacked, torch.empty(n, dtype=dtype), 1 / count)
        got = codec.decode_sum(stacked.cuda(), torch.empty(n, dtype=dtype, device="cuda"), 1 / count)
        assert same_bits(got, want), f"sum of {count} payloads"


CHUNK_SPECS = ["signsgd", "signsgd:vote=true", "signsgd:block=100", "terngrad", "terngrad:error_feedback=true",
               "qsgd:levels=7,block=16", "topk:ratio=0.1", "topk:ratio=0.01,compact=true"]


@needs_cuda_build
@pytest.mark.parametrize("numel, world", [(5, 8), (1003, 3), (300_001, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CHUNK_SPECS)
def test_the_two_phase_ops_on_cuda_give_the_cpu_bits(spec, dtype, numel, world):
    """encode_chunks (payloads and residual), reencode_sum (payload, average and owner residual) and
    decode_chunks, each on CUDA against the same op on the CPU."""
    codec = gradcomp.codec(spec)
    keys = {"step": 3, "bucket": 1}
    grad = gradient(numel, dtype, 1)
    residual = gradient(numel, dtype, 2) if codec.error_feedback else None
    cuda_residual = None if residual is None else residual.cuda()
    want = codec.encode_chunks(grad, residual, world, first_rank=5, **keys)
    got = codec.encode_chunks(grad.cuda(), cuda_residual, world, first_rank=5, **keys)
    assert same_bits(got, want), "encode_chunks' payloads"
    if residual is not None:
        assert same_bits(cuda_residual, residual), "encode_chunks' residual"

    bounds = chunk_bounds(numel, world)
    owned = bounds[0][1] - bounds[0][0]
    payloads = torch.stack([codec.encode(gradient(owned, dtype, 10 + r), rank=r, **keys) for r in range(world)])
    owner = gradient(owned, dtype, 30) if codec.error_feedback else None
    cuda_owner = None if owner is None else owner.cuda()
    average, cuda_average = torch.empty(owned, dtype=dtype), torch.empty(owned, dtype=dtype, device="cuda")
    want = codec.reencode_sum(payloads, average, owner, 1 / world, rank=99, **keys)
    got = codec.reencode_sum(payloads.cuda(), cuda_average, cuda_owner, 1 / world, rank=99, **keys)
    assert same_bits(got, want), "reencode_sum's payload"
    assert same_bits(cuda_average, average), "reencode_sum's average"
    if owner is not None:
        assert same_bits(cuda_owner, owner), "reencode_sum's owner residual"

    chunk_payloads = [codec.encode(grad[a:b].clone(), rank=j, **keys) for j, (a, b) in enumerate(bounds)]
    rows = torch.zeros(world, max(p.numel() for p in chunk_payloads), dtype=torch.uint8)
    for j, payload in enumerate(chunk_payloads):
        rows[j, : payload.numel()] = payload
    want, got = torch.full((numel,), 7.0, dtype=dtype), torch.full((numel,), 7.0, dtype=dtype, device="cuda")
    codec.decode_chunks(rows, want)
    codec.decode_chunks(rows.cuda(), got)
    assert same_bits(got, want), "decode_chunks"


@needs_cuda_build
def test_signsgd_vote_matches_the_cpu():
    codec = gradcomp.codec("signsgd:vote=true")
    payloads = torch.stack([codec.encode(gradient(5000, torch.float32, r), rank=r) for r in range(4)])
    want = codec.decode_sum(payloads, torch.empty(5000), 0.25)
    got = codec.decode_sum(payloads.cuda(), torch.empty(5000, device="cuda"), 0.25)
    assert same_bits(got, want)


@needs_cuda_build
def test_topk_on_64m_elements_is_exact():
    """Many tiles and three digit passes: the selection is the exact top k, lowest indices on ties."""
    n, codec = 1 << 26, gradcomp.codec("topk:ratio=0.01")
    grad = torch.randn(n, device="cuda")
    grad[::1000] = 3.0  # a block of ties at the top
    payload = codec.encode(grad)
    k = gradcomp.count_for_ratio(0.01, n)
    indices = payload[48:48 + 4 * k].view(torch.int32).long()
    keys = grad.abs()
    threshold = keys[indices].min()
    assert torch.all(indices[1:] > indices[:-1])
    assert int((keys > threshold).sum()) <= k <= int((keys >= threshold).sum())
    assert same_bits(payload, codec.encode(grad.cpu()))


@needs_cuda_build
def test_a_malformed_payload_raises_and_poisons_the_output():
    codec = gradcomp.codec("topk:ratio=0.1")
    payloads = torch.stack([codec.encode(gradient(1000, torch.float32, r), rank=r) for r in range(2)]).cuda()
    payloads[1, 48 + 4 * 3: 48 + 4 * 4] = torch.tensor([255, 255, 255, 127], dtype=torch.uint8)  # index 2^31 - 1
    out = torch.empty(1000, device="cuda")
    with pytest.raises(ValueError, match="topk index is out of range"):
        codec.decode_sum(payloads, out)
    assert torch.isnan(out).all()
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    codec.decode_sum(payloads, out, status=status)  # no sync, no raise: the caller reads status later
    assert "topk index" in gradcomp._ops._C.describe_decode_problems(int(status.item()))
    good = torch.stack([codec.encode(gradient(1000, torch.float32, r), rank=r) for r in range(2)]).cuda()
    codec.decode_sum(good, out, status=status)  # the word keeps the earlier problem; this output is sound
    assert torch.isfinite(out).all() and status.item() != 0
    with pytest.raises(ValueError, match="payloads of .* bytes"):
        codec.decode_sum(payloads[:, :-16], out)


@needs_cuda_build
def test_mixed_devices_are_refused_by_name():
    codec = gradcomp.codec("qsgd")
    grad = torch.randn(100, device="cuda")
    with pytest.raises(ValueError, match="residual on cpu but the gradient on cuda:0"):
        codec.encode(grad, torch.zeros(100))
    payload = codec.encode(grad)
    with pytest.raises(ValueError, match="payloads on cuda:0 but out on cpu"):
        codec.decode_sum(payload, torch.empty(100))
    with pytest.raises(ValueError, match="status must be one int32 element on cuda:0"):
        codec.decode_sum(payload, torch.empty(100, device="cuda"), status=torch.zeros(1, dtype=torch.int32))


@pytest.mark.skipif(gradcomp.cuda_built, reason="this build has the CUDA codecs")
def test_a_build_without_cuda_says_so():
    with pytest.raises(ValueError, match="this build has no CUDA codecs, and the tensor is on cuda:0"):
        gradcomp.codec("topk").encode(torch.randn(100, device="cuda"))


@needs_cuda_build
def test_orthogonalize_on_cuda_matches_the_cpu():
    p = torch.randn(3, 500, 4)
    p[:, :, 3] = p[:, :, 0] * 2  # a dependent column becomes zero
    on_gpu = p.cuda()
    torch.ops.gradcomp.orthogonalize_(p, 0.0)
    torch.ops.gradcomp.orthogonalize_(on_gpu, 0.0)
    torch.testing.assert_close(on_gpu.cpu(), p, rtol=1e-4, atol=1e-5)
    assert torch.all(on_gpu[:, :, 3] == 0)


@needs_cuda_build
def test_ddp_hook_with_two_ranks_on_one_gpu():
    """Every codec as DDP's hook, both ranks on cuda:0 over gloo: lossless settings equal plain DDP,
    compressed training lowers the loss on a held-out batch, and the ranks agree on every averaged gradient."""
    results = unwrap(run_ranks(scenarios.on_gpu, 2, (scenarios.GPU_SPECS, 12), timeout=600))
    for rank_result in results:
        plain = rank_result["plain"]["grads"]
        for spec, run in rank_result.items():
            if spec in scenarios.GPU_LOSSLESS:
                for got, want in zip(run["grads"], plain):
                    torch.testing.assert_close(got, want, rtol=2e-3 if spec == "fp16" else 1e-5, atol=1e-5)
            elif spec != "plain":
                before, after = run["held_out"]
                assert after < before, (spec, run["held_out"])
                assert run["stats"]["total"]["compressed_buckets"] > 0, spec
    for spec in results[0]:
        for got, want in zip(results[1][spec]["grads"], results[0][spec]["grads"]):
            assert torch.equal(got, want), spec


@needs_cuda_build
def test_the_two_phase_scheme_on_the_gpu_gives_the_cpu_bits():
    """Two ranks on cuda:0, every gathered codec in the two-phase scheme: each bucket's output and both
    residuals equal the CPU reference built from the rank's recorded gradients."""
    import two_phase_scenarios
    from test_two_phase import SPECS, TWO_PHASE, check_against_reference

    configs = {spec: ("mlp", spec, TWO_PHASE) for spec in SPECS}
    results = unwrap(run_ranks(two_phase_scenarios.recorded_steps, 2, (configs, 4, "cuda"), timeout=600))
    for spec in SPECS:
        check_against_reference(2, results, spec, spec)


def test_the_hook_reads_device_status_words_back_without_waiting():
    """A problem a CUDA decode OR-ed into a step's word raises at a later step's poll, once its copy landed."""
    from gradcomp.step import DecodeChecks

    checks = DecodeChecks()
    assert checks.word(0, torch.device("cpu")) is None  # the CPU path raises at once
    checks.word(3, torch.device("cuda", 0)).fill_(4)  # step 3: a bad topk index
    checks.word(4, torch.device("cuda", 0))  # step 4: nothing wrong
    checks.poll(3)  # step 3's decodes may still be running: nothing is read yet
    with pytest.raises(RuntimeError, match="malformed payloads in step 3: a topk index"):
        checks.poll(5)  # starts the read-back of steps 3 and 4 (raises here if the copy landed at once)
        torch.cuda.synchronize()
        checks.poll(6)
    checks.poll(7)  # reported once


@needs_cuda_build
def test_the_hierarchical_scheme_on_the_gpu_gives_the_cpu_bits():
    """4 ranks on cuda:0 as 2 emulated nodes of 2 (gloo): every step's applied gradients and both levels' residuals
    equal, bit for bit, a run on the CPU whose hooks are handed the GPU run's gradients (the backward passes
    themselves round differently on the two devices)."""
    import hierarchical_scenarios

    configs = {spec: ("mlp", spec, {"scheme": "hierarchical"}) for spec in ("signsgd", "topk:ratio=0.2",
                                                                           "randomk:ratio=0.3", "qsgd")}
    on_gpu = unwrap(run_ranks(hierarchical_scenarios.recorded, 4, (configs, 4, 2, None, "cuda"), timeout=600))
    sent = [{spec: result[spec]["sent"] for spec in configs} for result in on_gpu]
    on_cpu = unwrap(run_ranks(hierarchical_scenarios.recorded, 4, (configs, 4, 2, None, "cpu", sent), timeout=600))
    for gpu, cpu in zip(on_gpu, on_cpu):
        for spec in configs:
            for step, (got, want) in enumerate(zip(gpu[spec]["applied"], cpu[spec]["applied"])):
                assert all(same_bits(g, w) for g, w in zip(got, want)), (spec, step)
            for level in ("residual", "owner"):
                for g, w in zip(gpu[spec][level], cpu[spec][level]):
                    assert (g is None) == (w is None) and (g is None or same_bits(g, w)), (spec, level)


@needs_cuda_build
def test_a_ddp_step_of_every_codec_makes_no_host_sync():
    import corruption_scenarios

    specs = ["none", "fp16", "bf16", "signsgd", "terngrad", "qsgd", "topk:ratio=0.1", "randomk:ratio=0.1",
             "powersgd:rank=2", "signsgd two-phase", "qsgd two-phase", "topk:ratio=0.1 two-phase"]
    result = unwrap(run_ranks(corruption_scenarios.no_host_sync, 1, (specs, 4)))[0]
    for spec in specs:
        assert result[spec]["error"] is None, (spec, result[spec]["error"])
        assert (result[spec]["stats"]["compressed_buckets"] > 0) == (spec != "none"), spec  # none goes plain


POLICY_ON_GPU = {
    "signsgd": ("signsgd", {}, None),
    "qsgd": ("qsgd", {}, None),
    "powersgd": ("powersgd:rank=2", {}, None),
    "topk mixed": ("topk:ratio=0.1", {"trial_steps": 0}, [["two-phase", "plain"]]),
    "powersgd mixed": ("powersgd:rank=2", {"trial_steps": 0}, [["powersgd", "plain"]]),
}


def check_policy_run(name, run, world):
    """A policy="time" run on the GPU: its decision stood (trial over), timed with CUDA events (finite, non-negative
    figures and a plain window from the warm-up), the scheduled choices where given, and it trained."""
    decision = run["decision"]
    assert run["error"] is None, (name, run["error"])
    assert run["stood"] is not None and decision is not None, name
    assert decision["world_size"] == world and decision["plain_window_s"] is not None, (name, decision)
    assert decision["plain_window_s"] >= 0 and decision["backward_skew_s"] >= 0, (name, decision)
    for bucket in decision["buckets"]:
        for option, parts in bucket["predicted_s"].items():
            assert all(0 <= part < 10 for part in parts), (name, option, parts)
    schedule = POLICY_ON_GPU[name][2]
    if schedule is not None:
        names = schedule[0]
        assert [b["choice"] for b in sorted(decision["buckets"], key=lambda b: b["index"])] == \
            [names[i % len(names)] for i in range(len(decision["buckets"]))], (name, decision["buckets"])
        assert run["stats"]["compressed_buckets"] > 0, name
    before, after = run["held_out"]
    assert after < before, (name, run["held_out"])


@needs_cuda_build
def test_policy_time_on_the_gpu_with_two_ranks_takes_one_decision():
    """Two ranks on cuda:0 over gloo under policy="time" (the default warm-up and trial): both take the same decision
    from CUDA-event timings, follow it, and end with the same parameters."""
    import policy_scenarios

    results = unwrap(run_ranks(policy_scenarios.on_gpu, 2, (POLICY_ON_GPU, 4), timeout=600))
    for name in POLICY_ON_GPU:
        for result in results:
            check_policy_run(name, result[name], 2)
        first, second = results[0][name], results[1][name]
        assert [b["choice"] for b in first["decision"]["buckets"]] == \
            [b["choice"] for b in second["decision"]["buckets"]], name
        assert first["decision"]["trial"] == second["decision"]["trial"], name
        assert first["schemes"] == second["schemes"] and first["stood"] == second["stood"], name
        assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"])), name


@needs_cuda_build
def test_policy_time_on_nccl_makes_no_host_sync_once_decided():
    """World size 1 on NCCL under policy="time": the decision and the trial's verdicts read the CUDA events (their
    one sync each); every step after the decision stands makes no host-device sync."""
    import policy_scenarios

    result = unwrap(run_ranks(policy_scenarios.on_gpu, 1, (POLICY_ON_GPU, 4), timeout=600))[0]
    for name, run in result.items():
        check_policy_run(name, run, 1)
