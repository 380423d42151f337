"""The hierarchical scheme (full precision inside a node, the codec between nodes) on emulated nodes: ranks on one
machine grouped by node_size=. (N, L) = (2, 2) and (3, 2): lossless settings equal plain DDP up to the order of
the fp32 additions; per element, what error feedback keeps at both levels accounts for everything not yet applied;
the ranks agree bit for bit; a NaN on one rank leaves every level's residual as it was; a bucket smaller than L;
resume bit for bit; the node layout, its fallbacks and its refusals."""

from __future__ import annotations

import pytest
import torch

import checkpoint_scenarios
import gradcomp
import hierarchical_scenarios as scenarios
from ddp_harness import run_ranks, unwrap
from gradcomp.nodes import find_node_size

HIERARCHICAL = {"scheme": "hierarchical"}
CONFIGS = {"plain": ("mlp", None, {}), "tiny plain": ("tiny", None, {}),
           **{spec: ("mlp", spec, HIERARCHICAL)
              for spec in ("none", "fp16", "topk:ratio=1", "signsgd", "topk:ratio=0.2", "topk:ratio=0.2,compact=true",
                           "qsgd", "terngrad", "randomk:ratio=0.3", "signsgd:error_feedback=false", "powersgd:rank=2",
                           "powersgd:rank=2,batch_same_shape=true")},
           "auto topk": ("mlp", "topk:ratio=0.2", {}),
           # One bucket: shards large enough for the two-phase exchange between 3 nodes (its chunk headers
           # outweigh the saving on the small buckets above, which go by allgather there).
           **{f"{spec} one bucket": ("mlp", spec, {**HIERARCHICAL, "bucket_cap_mb": 25})
              for spec in ("signsgd:block=32", "topk:ratio=0.2")},
           "tiny topk 1": ("tiny", "topk:ratio=1", HIERARCHICAL), "tiny signsgd": ("tiny", "signsgd", HIERARCHICAL)}
LOSSLESS = {"none": "plain", "topk:ratio=1": "plain", "tiny topk 1": "tiny plain"}
STEPS = 5


@pytest.fixture(scope="module", params=[(2, 2), (3, 2)], ids=["2 nodes x 2", "3 nodes x 2"])
def runs(request):
    nodes, size = request.param
    world = nodes * size
    return nodes, size, unwrap(run_ranks(scenarios.recorded, world, (CONFIGS, STEPS, size), timeout=600))


def test_every_compressed_bucket_goes_hierarchically_and_the_ranks_agree(runs):
    _, _, results = runs
    for name, (_, spec, _) in CONFIGS.items():
        if spec is None:
            continue
        stats = results[0][name]["stats"]
        assert set(stats["schemes"]) == {"hierarchical"} and stats["total"]["compressed_buckets"] > 0, (name, stats)
        for other in results[1:]:
            for a, b in zip(other[name]["applied"], results[0][name]["applied"]):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), name


def test_lossless_settings_equal_plain_ddp(runs):
    """Each node sums its ranks' gradients divided by L, the nodes average those: plain DDP divides by W and sums
    in a ring. The same sum, up to the order of the fp32 additions."""
    _, _, results = runs
    for result in results:
        for name, reference in LOSSLESS.items():
            for step, (got, want) in enumerate(zip(result[name]["applied"], result[reference]["applied"])):
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}, step {step}: {m}")


def test_error_feedback_keeps_at_both_levels_what_was_not_applied(runs):
    """Per element: the sum over the steps of every rank's mean gradient = the sum of what was applied + the mean
    over the nodes of the residuals of the shards (each held by one rank per node) + the owners' residuals of the
    exchange between nodes (two-phase, from 3 nodes on)."""
    nodes, size, results = runs
    world = nodes * size
    for name, (kind, spec, _) in CONFIGS.items():
        if spec is None or not gradcomp.codec(spec).error_feedback:
            continue
        for position in range(len(results[0][name]["applied"][0])):
            averaged = sum(sum(r[name]["sent"][t][position] for r in results) / world for t in range(STEPS))
            applied = sum(results[0][name]["applied"][t][position] for t in range(STEPS))
            kept = sum(r[name]["residual"][position] for r in results if r[name]["residual"][position] is not None)
            kept = kept / nodes  # powersgd: only the ranks whose group holds the parameter, and only its matrices
            kept = kept + sum(r[name]["owner"][position] for r in results if r[name]["owner"][position] is not None)
            gap = float((averaged.reshape(-1) - applied.reshape(-1) - torch.as_tensor(kept).reshape(-1)).abs().max())
            assert gap <= 2e-6 * max(1.0, float(averaged.abs().max())), (name, position, gap)
        if nodes >= 3 and name.endswith("one bucket"):  # two-phase between the nodes: its owners keep residuals
            assert any(x is not None for r in results for x in r[name]["owner"]), f"{name}: no owner residual"


def test_the_stats_count_what_crosses_each_nodes_link(runs):
    """Every rank of a node reports what the node sends across its link, next to plain DDP's ring (which crosses it
    once per ring step): under the codecs, a fraction of plain DDP's."""
    nodes, size, results = runs
    for name in ("signsgd", "topk:ratio=0.2", "qsgd"):
        per_node = [results[n * size][name]["stats"]["total"] for n in range(nodes)]
        for n in range(nodes):
            for r in range(n * size, (n + 1) * size):
                assert results[r][name]["stats"]["total"]["node_link_bytes"] == per_node[n]["node_link_bytes"]
        assert 0 < per_node[0]["node_link_bytes"] < per_node[0]["node_link_raw_bytes"] / 2, (name, per_node[0])
        for result in results:  # what a rank sends stays in its node, but for its shard's exchange between nodes
            total = result[name]["stats"]["total"]
            assert 0 < total["inside_node_bytes"] < total["wire_bytes"], (name, total)


def test_a_nan_on_one_rank_arrives_everywhere_and_spares_every_level():
    configs = {spec: ("mlp", spec, HIERARCHICAL) for spec in ("signsgd", "topk:ratio=0.2", "randomk:ratio=0.3",
                                                             "powersgd:rank=2")}
    results = unwrap(run_ranks(scenarios.recorded, 6, (configs, 4, 2, 2), timeout=600))
    for name in configs:
        for result in results:
            assert not torch.isfinite(result[name]["applied"][2][0]).all(), name
            before, after = result[name]["around_poison"][2], result[name]["around_poison"][3]
            assert result[name]["poisoned_bucket"], name
            for level in (0, 1):  # the poisoned bucket's residuals, at both levels (the other buckets go on)
                for key in result[name]["poisoned_bucket"]:
                    if key in before[level]:
                        assert torch.equal(before[level][key], after[level][key]), (name, level, key)
            assert result[name]["stats"]["total"]["nonfinite_buckets"] >= 1


def test_a_resumed_run_repeats_the_uninterrupted_one(tmp_path):
    configs = [("topk:ratio=0.2", {"start_iter": 3, "node_size": 2}), ("powersgd:rank=2", {"start_iter": 3,
                                                                                          "node_size": 2}),
               ("signsgd", {"start_iter": 3, "node_size": 2, "scheme": "hierarchical"}),
               ("qsgd", {"start_iter": 3, "node_size": 2, "start_codec": "qsgd:levels=127"})]
    full = unwrap(run_ranks(checkpoint_scenarios.resume_around_start, 4, (configs, 6, str(tmp_path), "full")))
    resumed = unwrap(run_ranks(checkpoint_scenarios.resume_around_start, 4, (configs, 6, str(tmp_path), "second")))
    for rank in range(4):
        for (index, split), (params, warned) in resumed[rank].items():
            for a, b in zip(params, full[rank][(index, "full")]):
                assert torch.equal(a, b), (configs[index], split, rank, float((a - b).abs().max()))
            assert not warned, warned


@pytest.mark.parametrize("kind", ["die", "stall"])
def test_a_rank_that_dies_or_stalls_ends_the_others_step_with_a_clear_error(kind):
    """Its node-mate waits in the reduce-scatter inside the node, the others in the exchange between nodes: every
    group inside and across the nodes has DDP's timeout, so no rank hangs."""
    import reliability_scenarios

    pg_timeout_s = 6
    options = {"node_size": 2, "scheme": "hierarchical"}
    results = run_ranks(reliability_scenarios.fault, 4, ("topk:ratio=0.1", options, kind, 4), timeout=180,
                        pg_timeout_s=pg_timeout_s, wait_for=[0, 1, 2])
    assert results[3] is None  # the faulty rank never reported
    for result in unwrap(results[:3]):
        assert result["step"] == 4 and result["error"] is not None, result
        assert "gradcomp: the" in result["error"] and "step 4 failed" in result["error"], result["error"]
        assert result["after_s"] < 2 * pg_timeout_s + 10, result


def test_a_parameter_no_rank_used_loses_nothing_at_either_level():
    """find_unused_parameters=True on 2 nodes of 2: test_reliability's checks, with the residuals of the shards
    (held once per node) and of the owners between nodes."""
    import reliability_scenarios
    from test_reliability import IDLE_SETTINGS, assert_nothing_lost_for_unused_heads

    configs = {f"{spec}{setting}": (spec, "hierarchical", options, set_to_none, {"node_size": 2})
               for spec in ("signsgd", "topk:ratio=0.2", "powersgd:rank=1", "qsgd")
               for setting, (options, set_to_none) in IDLE_SETTINGS.items()}
    results = unwrap(run_ranks(reliability_scenarios.unused_error_feedback, 4, (configs, 6), timeout=600))
    assert_nothing_lost_for_unused_heads(results, configs, 6, replicas=2)


def test_node_layouts_fallbacks_and_refusals():
    results = unwrap(run_ranks(scenarios.refusals, 4, ({
        "node_size 3": {"node_size": 3},
        "one rank per node": {"node_size": 1, "scheme": "hierarchical"},
        "one node": {"node_size": 4},
        "auto on one machine": {},
        "flat": {"node_size": 2, "scheme": "flat"},
    },), timeout=300))
    for result in results:
        assert "node_size=3 does not divide the world size 4" in result["node_size 3"]["error"]
        fallback = result["one rank per node"]
        assert fallback["error"] is None and "hierarchical" not in fallback["schemes"], fallback
        assert any("falls back to the flat schemes: 4 nodes of 1 ranks (node_size=1)" in w
                   for w in fallback["warnings"]), fallback["warnings"]
        assert any("falls back" in w and "1 nodes of 4 ranks" in w for w in result["one node"]["warnings"])
        quiet = result["auto on one machine"]  # one host: nothing to say, and the flat schemes
        assert quiet["error"] is None and not quiet["warnings"] and "hierarchical" not in quiet["schemes"]
        flat = result["flat"]  # two nodes, and the flat schemes, as asked
        assert flat["error"] is None and not flat["warnings"] and "hierarchical" not in flat["schemes"], flat
    with pytest.raises(ValueError, match="powersgd travels by powersgd; scheme='two-phase'"):
        gradcomp.CompressionState("powersgd", scheme="two-phase")
    with pytest.raises(ValueError, match="node_size=0 must be an integer >= 1"):
        gradcomp.CompressionState("topk", node_size=0)


def test_the_layout_comes_from_local_world_size_or_host_names():
    def facts(hosts, local=None):
        return [{"host": h, "local_world_size": local} for h in hosts]

    assert find_node_size(4, None, facts("aabb", 2)) == (2, "LOCAL_WORLD_SIZE=2")
    assert find_node_size(4, None, facts("aabb")) == (2, "2 host names")
    assert find_node_size(6, None, facts("aabbcc")) == (2, "3 host names")
    assert find_node_size(4, None, facts("aaab"))[0] is None  # unequal nodes
    assert "not numbered together" in find_node_size(4, None, facts("abab"))[1]
    mixed = facts("aabb", 2)
    mixed[3]["local_world_size"] = 3
    assert "unequal" in find_node_size(4, None, mixed)[1]
    assert find_node_size(4, 2, facts("abcd")) == (2, "node_size=2")  # the option wins: emulated nodes
    with pytest.raises(ValueError, match="node_size=3 does not divide the world size 4"):
        find_node_size(4, 3, facts("aaaa"))


def test_powersgd_shards_are_contiguous_groups_of_whole_parameters_balanced_by_size():
    from gradcomp.schemes.hierarchical import parameter_groups

    shapes = [(10, 10), (10,), (5, 5), (5,)]  # 100, 10, 25, 5 elements
    assert parameter_groups(shapes, 2) == [(0, 1), (1, 4)]  # 100 | 40: the big matrix mostly below the cut
    assert parameter_groups(shapes, 1) == [(0, 4)]
    assert parameter_groups([(3,)], 2) == [(0, 0), (0, 1)]  # fewer parameters than ranks: an empty group
    sizes = [(64, 32)] * 8 + [(32,)] * 8
    groups = parameter_groups(sizes, 4)
    assert [a for a, _ in groups] == [0] + [b for _, b in groups[:-1]] and groups[-1][1] == len(sizes)
    totals = [sum(torch.Size(s).numel() for s in sizes[a:b]) for a, b in groups]
    assert max(totals) <= sum(totals) / 4 + 64 * 32, totals  # within one parameter of an even share
