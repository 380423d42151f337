"""Resuming on another number of ranks (elastic=True): each new rank takes the saved ranks' residual average, so
the average, what error feedback still owes the model, is kept. The expected averages are computed here from the
saved tensors themselves: a bucket's residual is its parameters' residuals in order; a two-phase owner's residual
of its chunk (the chunks are the ranks' owner residuals laid end to end) counts W times; PowerSGD lays its
residuals out by matrix shape, so its average is compared as a multiset."""

from __future__ import annotations

import pytest
import torch

import checkpoint_scenarios as scenarios
from ddp_harness import run_ranks, unwrap


def _flat_average(saved) -> dict[int, torch.Tensor]:
    """Per bucket index, the average over the saved ranks of its residual in a flat scheme's units."""
    world, total = saved["world_size"], {}
    for entry in saved["ranks"]:
        for bucket in entry["buckets"]:
            tensors = bucket["tensors"]
            if bucket["scheme"] == "hierarchical":  # a residual of this rank's shard of the node's average: L times
                flat = _shard_in_place(bucket, entry["rank"])
                total[bucket["index"]] = total.get(bucket["index"], 0) + flat
                continue
            flat = tensors["residual"].double().clone()
            owner = tensors.get("owner_residual")
            if owner is not None:
                sizes = [e_bucket["tensors"]["owner_residual"].numel() for e in saved["ranks"]
                         for e_bucket in e["buckets"] if e_bucket["index"] == bucket["index"]]
                start = sum(sizes[: entry["rank"]])
                flat[start: start + owner.numel()] += world * owner.double()
            total[bucket["index"]] = total.get(bucket["index"], 0) + flat
    return {index: summed / world for index, summed in total.items()}


def _shard_in_place(bucket, rank) -> torch.Tensor:
    """A hierarchical bucket's shard residual as a whole bucket's. Local rank l of L holds elements [l*s, (l+1)*s)
    of the bucket, s = ceil(n / L), the last shard padded. The residual is in units of the node's average, which
    counts 1/N in the average of N nodes, where a rank's residual counts 1/W = 1/(N*L): so it counts L times."""
    size = sum(torch.Size(shape).numel() for shape in bucket["shapes"])
    node_size = bucket["node_size"]
    shard = -(-size // node_size)
    start = (rank % node_size) * shard
    end = min(start + shard, size)
    flat = torch.zeros(size, dtype=torch.float64)
    flat[start:end] = node_size * bucket["tensors"]["residual"].double()[: end - start]
    return flat


def _loaded_average(results, buckets) -> dict[int, torch.Tensor]:
    """Per bucket (of the saved layout), the new ranks' average of the residuals each holds for its parameters (those
    that have one: PowerSGD sends vectors uncompressed, without)."""
    averages = {}
    for bucket in buckets:
        per_rank = [torch.cat([r["loaded"]["pool"][key]["residual"].reshape(-1).double() for key in bucket["keys"]
                               if "residual" in r["loaded"]["pool"].get(key, {})]) for r in results]
        averages[bucket["index"]] = torch.stack(per_rank).mean(0)
    return averages


@pytest.mark.parametrize("spec, options, saved_world, world", [
    ("topk:ratio=0.1", {"scheme": "allgather"}, 2, 4),
    ("topk:ratio=0.1", {"scheme": "two-phase"}, 2, 3),
    ("signsgd", {"scheme": "two-phase"}, 4, 2),
    ("powersgd:rank=2", {}, 4, 2),
    ("signsgd", {"scheme": "hierarchical", "node_size": 2}, 4, 6),  # 2 nodes of 2, then 3 nodes of 2
])
def test_an_elastic_resume_keeps_the_residual_average(spec, options, saved_world, world):
    saved = unwrap(run_ranks(scenarios.trained_every_rank_state, saved_world, (spec, options, 5)))[0]
    results = unwrap(run_ranks(scenarios.elastic_resume, world, (spec, options, saved, 2)))
    buckets = saved["ranks"][0]["buckets"]
    assert buckets and all(b["tensors"]["residual"] is not None for b in buckets)
    expected = _flat_average(saved)
    loaded = _loaded_average(results, buckets)
    for index, average in expected.items():
        assert average.abs().max() > 0, f"bucket {index}: nothing held back, nothing to check"
        if spec.startswith("powersgd"):  # laid out by matrix shape: the same values, in another order
            assert torch.allclose(average.sort().values, loaded[index].sort().values, rtol=1e-6, atol=1e-7)
        else:
            assert torch.allclose(average, loaded[index], rtol=1e-6, atol=1e-7), index
    for r, result in enumerate(results):
        assert result["loaded"]["rank"] == r and result["loaded"]["config"]["world_size"] == world
        assert result["loaded"]["iter"] == 5 and result["after"]["iter"] == 7
        assert not result["after"]["pool"], "the first steps after the resume take the residuals over"
        assert len(result["after"]["buckets"]) == len(buckets)  # laid out as the saved run's buckets were
        if spec.startswith("powersgd"):  # Q, the same on every saved rank, goes to every new rank
            saved_q = sorted(torch.cat([b["tensors"]["q"] for b in buckets]).tolist())
            loaded_q = sorted(torch.cat([p["q"].reshape(-1) for p in result["loaded"]["pool"].values()
                                         if "q" in p]).tolist())
            assert loaded_q == pytest.approx(saved_q)


def test_torch_distributed_checkpoint_saves_and_loads_every_ranks_state_also_elastically(tmp_path):
    path = str(tmp_path / "dcp")
    saved = unwrap(run_ranks(scenarios.dcp_save, 2, ("topk:ratio=0.1", 4, path)))
    loaded = unwrap(run_ranks(scenarios.dcp_load, 2, ("topk:ratio=0.1", path, False)))
    for rank in (0, 1):  # each rank its own residuals back
        before, after = saved[rank]["state"], loaded[rank]["loaded"]
        assert after["iter"] == before["iter"] == 4 and after["rank"] == rank
        for b, a in zip(before["buckets"], after["buckets"], strict=True):
            assert torch.equal(b["tensors"]["residual"], a["tensors"]["residual"])
    spread = unwrap(run_ranks(scenarios.dcp_load, 3, ("topk:ratio=0.1", path, True)))
    every_rank = saved[0]["saved"]
    expected, got = _flat_average(every_rank), _loaded_average(spread, every_rank["ranks"][0]["buckets"])
    for index, average in expected.items():
        assert torch.allclose(average, got[index], rtol=1e-6, atol=1e-7), index


def test_an_elastic_resume_of_hierarchical_powersgd_lands_in_its_flat_layout():
    """Hierarchical PowerSGD's shards hold whole parameters' residuals as flat vectors, its vectors' too; on 2 ranks
    (one node: the flat scheme) they go back to PowerSGD's matrices, the vectors' dropped (sent whole there)."""
    options = {"scheme": "hierarchical", "node_size": 2}
    saved = unwrap(run_ranks(scenarios.trained_every_rank_state, 4, ("powersgd:rank=2", options, 5)))[0]
    results = unwrap(run_ranks(scenarios.elastic_resume, 2, ("powersgd:rank=2", options, saved, 2)))
    for result in results:
        pool = result["loaded"]["pool"]
        assert pool and all(piece["residual"].dim() == 2 for piece in pool.values() if "residual" in piece)
        assert result["after"]["iter"] == 7 and not result["after"]["pool"]
