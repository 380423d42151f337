"""gradcomp.every_rank: every rank's state in one checkpoint object (for frameworks that write rank 0's file),
and register on the wrappers frameworks hand out."""

from __future__ import annotations

import os
import pickle
import re

import pytest
import torch

import checkpoint_scenarios as scenarios
import gradcomp
from ddp_harness import run_ranks, unwrap


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _residuals(state_dict):
    return [t for bucket in state_dict["buckets"] for t in bucket["tensors"].values() if t is not None]


@pytest.mark.parametrize("spec", ["topk", "powersgd:rank=2"])
def test_every_rank_state_holds_each_ranks_own_and_each_rank_loads_its_entry(spec, tmp_path):
    for directory in (None, str(tmp_path)):
        results = unwrap(run_ranks(scenarios.every_rank_round_trip, 2, (spec, 6, directory)))
        for rank, result in enumerate(results):
            assert _same(result["after"], result["before"]), f"rank {rank} did not get its own state back"
        saved = results[0]["saved"]
        assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
        assert _same(saved, results[1]["saved"]), "every rank must hold the same every-rank object"
        if directory is None:  # the entries are the ranks' own states, which differ (their residuals do)
            assert [entry["rank"] for entry in saved["ranks"]] == [0, 1]
            assert not _same(_residuals(saved["ranks"][0]), _residuals(saved["ranks"][1]))
        else:
            files = [entry["file"] for entry in saved["ranks"]]
            for rank, file in enumerate(files):  # a new name at every save, so that saves never share a file
                prefix = os.path.join(directory, f"gradcomp-step6-rank{rank}-")
                assert re.fullmatch(re.escape(prefix) + "[0-9a-f]{12}\\.pt", file), file
            assert all(os.path.exists(f) for f in files)


def test_every_rank_state_on_another_world_size_or_codec_is_refused_with_what_to_do():
    saved = unwrap(run_ranks(scenarios.every_rank_round_trip, 2, ("topk", 4, None)))[0]["saved"]
    errors = unwrap(run_ranks(scenarios.load_every_rank, 3, ("topk", saved)))
    for error in errors:
        assert error and "world_size: saved 2, now 3" in error and "fresh CompressionState" in error
        assert "elastic=True" in error  # the other way: spread the saved residuals over the new ranks
    errors = unwrap(run_ranks(scenarios.load_every_rank, 2, ("qsgd", saved)))
    for error in errors:
        assert error and "codec: saved 'topk" in error and "now 'qsgd" in error


def test_one_ranks_state_on_another_rank_points_to_every_rank():
    errors = unwrap(run_ranks(scenarios.this_ranks_state_elsewhere, 2, ("topk", 4)))
    assert errors[0] is None
    assert "holds rank 0's residuals; this is rank 1" in errors[1] and "gradcomp.every_rank(state)" in errors[1]


def test_every_rank_files_of_another_save_at_the_same_step_are_kept_apart_and_changed_files_refused(tmp_path):
    """Two runs save every_rank(state, DIR) at the same step into one folder: each checkpoint loads its own
    residuals. A file written over since its checkpoint was taken is refused, saying what to do."""
    first = unwrap(run_ranks(scenarios.every_rank_round_trip, 2, ("topk", 6, str(tmp_path))))
    second = unwrap(run_ranks(scenarios.every_rank_round_trip, 2, ("topk:ratio=0.02", 6, str(tmp_path))))
    again = unwrap(run_ranks(scenarios.load_every_rank_state, 2, ("topk", first[0]["saved"])))
    for rank in range(2):
        assert _same(again[rank], first[rank]["before"]), f"rank {rank} loaded another save's residuals"
    assert len(list(tmp_path.iterdir())) == 4
    victim, other = first[0]["saved"]["ranks"][1]["file"], second[0]["saved"]["ranks"][1]["file"]
    with open(other, "rb") as source, open(victim, "wb") as target:
        target.write(source.read())
    errors = unwrap(run_ranks(scenarios.load_every_rank, 2, ("topk", first[0]["saved"])))
    assert errors[0] is None
    assert "rank 1's state file" in errors[1] and "is not what this checkpoint saved there" in errors[1], errors[1]


def test_an_every_rank_state_missing_an_entry_is_refused():
    saved = {"format": 1, "gradcomp_every_rank": True, "world_size": 2, "ranks": [{}]}
    with pytest.raises(ValueError, match="holds 1 rank entries for world_size 2: it is incomplete or damaged"):
        gradcomp.CompressionState("topk").load_state_dict(saved)


def test_every_rank_needs_a_process_group_and_a_state():
    with pytest.raises(TypeError, match="takes a CompressionState"):
        gradcomp.every_rank("topk")
    state = gradcomp.CompressionState("topk")
    with pytest.raises(RuntimeError, match="after torch.distributed.init_process_group"):
        gradcomp.every_rank(state).state_dict()
    saved = {"format": 1, "gradcomp_every_rank": True, "world_size": 2, "ranks": [{}, {}]}
    with pytest.raises(RuntimeError, match="after torch.distributed.init_process_group"):
        state.load_state_dict(saved)


def test_register_takes_fabrics_module_and_ddp_logs_the_hook_by_name():
    for result in unwrap(run_ranks(scenarios.register_through_wrapper, 2, (5,))):
        assert result["registered"] and result["compressed"] > 0
        assert result["hook_name"] == "gradcomp_hook"
    assert pickle.loads(pickle.dumps(gradcomp.hook)) is gradcomp.hook  # spawned workers receive it by name


def test_register_says_where_to_call_it_for_each_framework():
    with pytest.raises(TypeError) as error:
        gradcomp.register(torch.nn.Linear(2, 2), "topk")
    for where in ("DistributedDataParallel(model)", "GradcompCallback", "fabric.setup", "gradcomp.accelerate.register"):
        assert where in str(error.value)


AROUND_START = [("topk", {"start_iter": 3}), ("signsgd", {"start_iter": 3}), ("powersgd", {"start_iter": 3}),
                ("topk", {"start_iter": 3, "start_codec": "qsgd:levels=127"}),
                ("signsgd", {"start_iter": 3, "start_codec": "terngrad"}),
                ("topk", {"start_iter": 1})]  # resumed at step 1: before DDP's final buckets, and compressed


@pytest.mark.parametrize("world", [2, 3])
def test_a_run_resumed_at_start_iter_or_one_step_either_side_repeats_the_uninterrupted_one(world, tmp_path):
    """A checkpoint after the last plain (or start-codec) step, before the first compressed one, holds the
    buckets as DDP laid them out for good: the resumed run's first steps, on a fresh DDP's first buckets, go as
    the uninterrupted run's did (the plain ones too: a ring allreduce sums in an order that follows the size).
    Also one step earlier and later. 3 ranks: the two-phase scheme. A checkpoint after step 0, before DDP's
    final buckets, cannot do this when step 1 is compressed: the resumed run says so."""
    total = 6
    full = unwrap(run_ranks(scenarios.resume_around_start, world, (AROUND_START, total, str(tmp_path), "full")))
    resumed = unwrap(run_ranks(scenarios.resume_around_start, world, (AROUND_START, total, str(tmp_path), "second")))
    differ = []
    for rank in range(world):
        for (index, split), (params, warned) in resumed[rank].items():
            gap = max(float((a - b).abs().max()) for a, b in zip(params, full[rank][(index, "full")]))
            unknowable = (index, split) == (len(AROUND_START) - 1, 1)
            if unknowable:
                assert any("resumed at step 1" in w and "not bit for bit" in w for w in warned), warned
            elif gap != 0 or warned:
                differ.append(f"{AROUND_START[index]} resumed at step {split}, rank {rank}: differs by {gap:.3g} "
                              f"{warned}")
    assert not differ, "\n".join(differ)
