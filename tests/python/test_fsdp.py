"""gradcomp.fsdp: FSDP2's gradient reduce-scatter, compressed with error feedback, on 2 to 4 CPU ranks (gloo)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

import fsdp_scenarios as scenarios
import gradcomp
from ddp_harness import run_ranks, unwrap

CODECS = ["none", "fp16", "bf16", "signsgd", "terngrad", "qsgd", "topk:ratio=0.1", "randomk:ratio=0.1"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_none_gives_plain_fsdp2s_gradients_and_every_codec_reduces_close_to_plain(world):
    """none: bit for bit at 2 ranks (one addition, either order); at 3 and 4 up to the order of the fp32 additions.
    Every other codec (at 2 ranks): finite, close to plain, fewer bytes."""
    specs = CODECS if world == 2 else ["none"]
    for result in unwrap(run_ranks(scenarios.gradients, world, (specs,))):
        plain = result["plain"]
        for spec in specs:
            ours, total = result[spec]["grads"], result[spec]["stats"]["total"]
            assert total["reduce_scatters"] == 3  # the three Linear modules (the root holds no parameter)
            if spec == "none":
                for a, b in zip(plain, ours, strict=True):
                    assert torch.equal(a, b) if world == 2 else torch.allclose(a, b, rtol=1e-6, atol=1e-7)
                continue
            flat_plain, flat_ours = torch.cat([g.flatten() for g in plain]), torch.cat([g.flatten() for g in ours])
            assert torch.isfinite(flat_ours).all()
            cosine = torch.nn.functional.cosine_similarity(flat_plain, flat_ours, dim=0)
            assert cosine > (0.99 if spec in ("fp16", "bf16") else 0.2), (spec, cosine)
            assert total["ratio"] > (1.9 if spec in ("fp16", "bf16") else 3), (spec, total)
        if world == 2:  # start_iter=1: the first step is FSDP's own reduce-scatter, bit for bit; then compressed
            started = result["start_iter"]
            for a, b in zip(plain, started["grads"], strict=True):
                assert torch.equal(a, b)
            first, second = started["first"]["total"], started["second"]["total"]
            assert first["wire_bytes"] == first["raw_bytes"] > 0 and first["reduce_scatters"] == 3
            assert second["raw_bytes"] - first["raw_bytes"] > 3 * (second["wire_bytes"] - first["wire_bytes"])


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "signsgd", "randomk:ratio=0.1"])
def test_error_feedback_loses_nothing(spec):
    """Per step and row j: the ranks' inputs plus their residuals before = the owner's output plus the residuals
    after (what was not sent is kept, by every sender); a rank's own row, which never crosses the wire, goes into
    its output whole and leaves no residual."""
    world, steps = 3, 4
    results = unwrap(run_ranks(scenarios.error_feedback, world, (spec, steps)))
    for step in range(steps):
        sent = sum(r[step]["input"] + r[step]["before"] for r in results).view(world, -1)
        kept = sum(r[step]["after"] for r in results).view(world, -1)
        for owner in range(world):
            output = results[owner][step]["output"]
            assert torch.allclose(sent[owner], output + kept[owner], rtol=1e-5, atol=1e-5), (step, owner)
            assert not results[owner][step]["after"].view(world, -1)[owner].any()
        assert any(r[step]["after"].abs().sum() > 0 for r in results)


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "signsgd"])
def test_a_nan_reaches_its_owner_and_leaves_the_senders_residual_of_that_row_as_it_was(spec):
    world, shard = 3, 37
    results = unwrap(run_ranks(scenarios.error_feedback, world, (spec, 3, (1, 0, 2))))  # step 1, rank 0, row 2
    nan_step = [r[1] for r in results]
    assert not torch.isfinite(nan_step[2]["output"]).all()  # the owner of row 2 holds it: GradScaler sees it
    assert torch.isfinite(nan_step[1]["output"]).all()
    sender = nan_step[0]
    rows = slice(2 * shard, 3 * shard)
    assert torch.equal(sender["after"][rows], sender["before"][rows])  # that row's residual as it was
    assert not torch.equal(sender["after"][shard:2 * shard], sender["before"][shard:2 * shard])  # row 1 took it in
    assert not sender["after"][:shard].any()  # its own row, exact in its output, leaves no residual
    assert all(torch.isfinite(r[2]["after"]).all() for r in results)  # nothing non-finite carried on


def test_resume_repeats_the_uninterrupted_run_bit_for_bit():
    """6 steps straight, and 3 then a fresh model and state loaded from what the ranks saved: the same shards, bit
    for bit; and the state's residuals mattered (a resume without them differs)."""
    spec = "topk:ratio=0.1"
    straight = unwrap(run_ranks(scenarios.training, 2, (spec, 6, 3)))
    saved = [r["saved"] for r in straight]
    resumed = unwrap(run_ranks(scenarios.training, 2, (spec, 6, None, saved)))
    for a, b in zip(straight, resumed):
        for x, y in zip(a["shards"], b["shards"], strict=True):
            assert torch.equal(x, y)
        assert a["memory"] == b["memory"] > 0  # two residuals of each module's unsharded gradient
    stripped = []
    for blob in saved:
        shards, compression, step = torch.load(io.BytesIO(blob), weights_only=True)
        compression["residuals"] = {}
        buffer = io.BytesIO()
        torch.save((shards, compression, step), buffer)
        stripped.append(buffer.getvalue())
    fresh = unwrap(run_ranks(scenarios.training, 2, (spec, 6, None, stripped)))
    assert any(not torch.equal(x, y) for x, y in zip(straight[0]["shards"], fresh[0]["shards"]))


def test_every_rank_checkpoints_resume_bit_for_bit_from_one_ranks_file():
    """gradcomp.every_rank(state): each rank's file holds every rank's state, so rank 0's file alone resumes both."""
    spec = "signsgd"
    straight = unwrap(run_ranks(scenarios.training, 2, (spec, 5, 3, None, True)))  # saved after a compressed step
    shards = [torch.load(io.BytesIO(r["saved"]), weights_only=True)[0] for r in straight]
    _, everyone, step = torch.load(io.BytesIO(straight[0]["saved"]), weights_only=True)
    assert everyone["world_size"] == 2 and [entry["rank"] for entry in everyone["ranks"]] == [0, 1]
    from_rank_0 = []
    for mine in shards:
        buffer = io.BytesIO()
        torch.save((mine, everyone, step), buffer)
        from_rank_0.append(buffer.getvalue())
    resumed = unwrap(run_ranks(scenarios.training, 2, (spec, 5, None, from_rank_0, True)))
    for a, b in zip(straight, resumed):
        for x, y in zip(a["shards"], b["shards"], strict=True):
            assert torch.equal(x, y)


def test_refusals_name_what_is_wrong_and_what_to_do(monkeypatch):
    with monkeypatch.context() as patched:
        patched.setattr(gradcomp.fsdp, "FSDPModule", None)  # a torch without FSDP2's seam
        with pytest.raises(RuntimeError, match="needs FSDP2's custom reduce-scatter .*set_custom_reduce_scatter"):
            gradcomp.fsdp.register(torch.nn.Linear(2, 2), "topk")
    with pytest.raises(TypeError, match="holds no FSDP module: call torch.distributed.fsdp.fully_shard"):
        gradcomp.fsdp.register(torch.nn.Linear(2, 2), "topk")
    with pytest.raises(ValueError, match="powersgd compresses each parameter as a matrix"):
        gradcomp.fsdp.FSDPCompression("powersgd")
    with pytest.raises(ValueError, match="ratio"):
        gradcomp.fsdp.FSDPCompression("topk", ratio=2)
    with pytest.raises(ValueError, match="start_iter=-1 must be an integer >= 0"):
        gradcomp.fsdp.FSDPCompression("topk", start_iter=-1)
    with pytest.raises(ValueError, match="not a state that gradcomp.fsdp saved"):
        gradcomp.fsdp.FSDPCompression("topk").load_state_dict({"format": 1})
    saved = gradcomp.fsdp.FSDPCompression("topk").state_dict()
    with pytest.raises(ValueError, match="codec: saved 'topk:error_feedback=True,ratio=0.01', now 'signsgd"):
        gradcomp.fsdp.FSDPCompression("signsgd").load_state_dict(saved)


def test_the_parameter_groups_are_read_in_either_torchs_layout():
    """torch 2.13 keeps a module's FSDP parameter groups in a list, torch 2.11 one group (or None): register's dtype and
    mesh checks read both (on torch 2.11 they had found no group and checked nothing), and a layout with neither is
    refused rather than let through unchecked."""
    class Module:
        def __init__(self, state):
            self.state = state

        def _get_fsdp_state(self):
            return self.state

    first, second = object(), object()
    both = Module(SimpleNamespace(_fsdp_param_groups=[first, second]))
    assert gradcomp.fsdp._param_groups(0, both) == [first, second]
    assert gradcomp.fsdp._param_groups(0, Module(SimpleNamespace(_fsdp_param_group=first))) == [first]
    assert gradcomp.fsdp._param_groups(0, Module(SimpleNamespace(_fsdp_param_group=None))) == []
    with pytest.raises(RuntimeError, match=r"cannot find the FSDP parameter groups of module 3 \(Module\) in torch"):
        gradcomp.fsdp._param_groups(3, Module(SimpleNamespace()))


def test_refusals_on_live_ranks():
    """register refuses gradients of several dtypes in one module and a reduce dtype the codecs do not take; an
    every-rank state of another world size is refused; ranks registered with different codecs raise on every rank
    at the first reduce-scatter, each rank's configuration listed."""
    for result in unwrap(run_ranks(scenarios.refusals, 2)):
        assert "has gradients of several dtypes (torch.float16, torch.float32)" in result["mixed"], result["mixed"]
        assert "reduces its gradients in torch.float64; gradcomp's codecs take" in result["float64"], result["float64"]
        assert "saved by 3 ranks, and this world has 2" in result["other_world"], result["other_world"]
        assert "the ranks are configured differently" in result["other_codec"], result["other_codec"]
        assert "rank 0: " in result["other_codec"] and "signsgd" in result["other_codec"]


def test_hsdp_with_2_replicas_of_2_shards():
    """gradcomp's exchange across replicas (the all-reduce hook on the 1-D shard mesh): none gives FSDP's own HSDP's
    gradients to rounding; with any codec the replicas of a shard stay identical, bit for bit, step after step."""
    specs = ["none", "topk:ratio=0.1", "signsgd", "qsgd"]
    results = unwrap(run_ranks(scenarios.hsdp, 4, (specs, 3)))
    for spec in specs:
        for result in results:
            for native, ours in zip(result["native"], result[spec]["grads"], strict=True):
                if spec == "none":
                    assert torch.allclose(native, ours, rtol=1e-5, atol=1e-6)
                else:
                    assert torch.isfinite(ours).all()
            total = result[spec]["stats"]["total"]
            assert total["replica_wire_bytes"] > 0
            if spec != "none":
                assert total["replica_ratio"] > 2
            assert (result[spec]["memory"] > 0) == (spec in ("topk:ratio=0.1", "signsgd"))  # error feedback's
        for shard in (0, 1):  # ranks 0 and 2 hold shard 0 on the two replicas, 1 and 3 shard 1
            for a, b in zip(results[shard][spec]["shards"], results[shard + 2][spec]["shards"], strict=True):
                assert torch.equal(a, b), spec
    # replicate_group with FSDP's own HSDP (the 2-D mesh), whose all-reduce runs before any hook: refused
    assert all("sharded on a 2-D mesh" in r["native_refused"] and "mesh['shard']" in r["native_refused"]
               for r in results)




def test_hsdp_resumes_bit_for_bit_with_one_rank_per_replica():
    """4 replicas of 1 rank, where FSDP runs no reduce-scatter: the exchange across replicas counts its own steps
    (its randomness and residuals move on), and the state saved on one world resumes on it."""
    spec, shards = "topk:ratio=0.1", 1
    straight = unwrap(run_ranks(scenarios.hsdp_resume, 4, (spec, shards, 4, 2)))
    resumed = unwrap(run_ranks(scenarios.hsdp_resume, 4, (spec, shards, 4, None, [r["saved"] for r in straight])))
    for a, b in zip(straight, resumed):
        assert a["replica_steps"] == b["replica_steps"] == {i: 4 for i in a["replica_steps"]} and a["replica_steps"]
        for x, y in zip(a["shards"], b["shards"], strict=True):
            assert torch.equal(x, y)
