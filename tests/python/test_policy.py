"""policy="time": the cost model's arithmetic against hand-worked cases, the choice (never predicted slower than
plain DDP, plain where communication hides behind backward), one decision on every rank even when their measurements
differ, resume repeating the decision and the run bit for bit, error feedback across switches between plain and
compressed (nothing lost), the refusals, and the trial that measures the model's shortlist (gradcomp.trial)."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
import torch

import gradcomp
import gradcomp.measure as measure
import gradcomp.policy as time_policy
import gradcomp.schemes
import gradcomp.trial as policy_trial
import policy_scenarios as scenarios
from ddp_harness import run_ranks, unwrap
from gradcomp.policy import Cost, CostModel, Curve, Line

# -- the model's arithmetic ----------------------------------------------------------------------------------------


def test_a_line_is_fitted_through_exact_points_and_never_below_zero():
    line = Line.fit([(1e3, 2e-4 + 1e3 * 3e-9), (1e5, 2e-4 + 1e5 * 3e-9), (1e7, 2e-4 + 1e7 * 3e-9)])
    assert line.fixed == pytest.approx(2e-4, rel=1e-6) and line.per_unit == pytest.approx(3e-9, rel=1e-6)
    falling = Line.fit([(1e3, 5e-3), (1e6, 1e-3)])  # noise can make larger messages look faster
    assert falling.per_unit == 0 and falling.fixed > 0
    through_zero = Line.fit([(1e3, 1e-6), (1e6, 1e-2)])  # a negative intercept is clamped to zero
    assert through_zero.fixed == 0 and through_zero.per_unit > 0
    assert Line.fit([(4096, 1e-3)]) == Line(0.0, 1e-3 / 4096)


def test_a_curve_runs_straight_between_measured_sizes_and_never_falls_with_size():
    curve = Curve.through([(1e4, 5e-4), (1e3, 1e-4), (1e5, 2e-3), (1e6, 1.5e-3), (2e6, 3e-3), (1e4, 7e-4)])
    # 1e5's 2 ms exceeds 1e6's 1.5 ms, so noise is taken to have added it; of 1e4's two, the quicker stands
    assert curve.sizes == (1e3, 1e4, 1e5, 1e6, 2e6)
    assert curve.seconds == pytest.approx((1e-4, 5e-4, 1.5e-3, 1.5e-3, 3e-3))
    assert curve(5.5e3) == pytest.approx(3e-4)  # halfway from 1e3 to 1e4
    assert curve(10) == pytest.approx(1e-4)  # below the smallest: the smallest's time
    assert curve(3e6) == pytest.approx(4.5e-3)  # beyond the largest: the last segment's 1.5 ms per 1e6
    flat_end = Curve((1e3, 2e3), (1e-3, 1e-3))
    assert flat_end(4e3) == pytest.approx(1e-3 + 2e3 * 1e-3 / 2e3)  # no slope at the end: the largest's mean rate
    assert Curve.through([])(1e3) == 0.0
    for link in (curve, Line(2e-4, 3e-9)):
        assert time_policy.link_from_json(json.loads(json.dumps(link.to_json()))) == link
        assert link.with_params(link.params()) == link


def test_a_curve_follows_a_token_bucket_link_that_one_line_misses():
    """A shaped link: the first 128 KiB pass at 1 GB/s (the bucket's burst), the rest at 12.5 MB/s, after 0.2 ms.
    Measured at the probes' sizes, the curve predicts a 5 MiB bucket and a 600 KiB payload within 10% (straight
    lines between sizes 4x apart cut the corner at the burst's end); the line fitted to the same points misses at
    least one of them by more than 25%."""
    def shaped(n):
        return 2e-4 + min(n, 131072) / 1e9 + max(n - 131072, 0) / 12.5e6

    probes = [(n, shaped(n)) for n in measure.PROBE_BYTES]
    curve, line = Curve.through(probes), Line.fit(probes)
    for n in (5 << 20, 600 << 10):
        assert curve(n) == pytest.approx(shaped(n), rel=0.10)
    assert max(abs(line(n) / shaped(n) - 1) for n in (5 << 20, 600 << 10)) > 0.25


def test_the_load_makes_the_plain_queue_end_where_the_warm_ups_plain_steps_did():
    # Two plain buckets ready at 0 and 10 ms, 6 ms on the wire each: the first hides, the second is exposed whole.
    plain = [Cost(0.0, 0.006, 0.0)] * 2
    assert time_policy.link_load([0.0, 0.010], plain, None) == 1.0  # no window measured
    # A 9 ms window: 1.5x the wire (the first's 9 ms still end before 10 ms).
    assert time_policy.link_load([0.0, 0.010], plain, 0.009) == pytest.approx(1.5, rel=1e-6)
    # A 22 ms window: at 2x, 12 ms each: the first ends at 12, the second 12-24: 14 ms; at 2.5x, 15 + 15 = 30 - 10:
    # 20 ms; at 8/3 x, 16 + 16 - 10 = 22 ms (the queue, not the ratio 22 / 6).
    assert time_policy.link_load([0.0, 0.010], plain, 0.022) == pytest.approx(8 / 3, rel=1e-6)
    low, high = time_policy.LOAD_BOUNDS
    assert time_policy.link_load([0.0, 0.010], plain, 1.0) == high
    assert time_policy.link_load([0.0, 0.010], plain, 1e-6) == low
    assert time_policy.link_load([0.0, 0.010], plain, 0.004) == pytest.approx(2 / 3, rel=1e-6)  # under the probes
    assert time_policy.link_load([0.0], [Cost(0.0, 0.0, 0.0)], 0.004) == 1.0  # no collective (one rank) to scale
    # The load scales the collectives only, not the kernels' dry-run times.
    assert Cost(1.0, 2.0, 3.0, 4.0, 5.0, 6.0).loaded(2.0) == Cost(1.0, 4.0, 3.0, 4.0, 10.0, 12.0)


def test_the_plain_window_runs_from_backwards_end_without_the_hook_to_the_last_allreduce():
    timings = measure.WarmupTimings()
    timings.clock = measure.Clock(torch.device("cpu"))
    # step 1: buckets called at 0 and 5, their calls returning at 1 and 5.5; allreduces end at 4 and 12: 7 after the
    # last call, and 1 more inside the first call, which held backward up (without it, the last call came at 4).
    # step 2: one allreduce never ended. step 3: one call never returned (it raised).
    timings.steps = {1: [(0, 0.0), (1, 5.0)], 2: [(0, 20.0), (1, 26.0)], 3: [(0, 40.0), (1, 45.0)]}
    timings.returns = {1: {0: 1.0, 1: 5.5}, 2: {0: 21.0, 1: 26.5}, 3: {1: 45.5}}
    timings.allreduces = {1: [[12.0], [4.0]], 2: [[30.0], []], 3: [[50.0], [51.0]]}
    assert timings.plain_windows() == {1: 8.0}
    # Step 2's compute: from step 1's last allreduce's end (12) to its own last bucket's hook call (26).
    assert timings.computes() == {2: 14.0}


def test_backwards_offsets_leave_out_the_time_inside_the_hook_calls_before_and_give_plain_its_calls_time():
    """A bucket's offset is its hook call after the first, less the time inside the calls between (backward's own
    pace); plain's own time per bucket is its call's; each the median over the steps whose calls all returned."""
    timings = measure.WarmupTimings()
    timings.clock = measure.Clock(torch.device("cpu"))
    timings.steps = {1: [(0, 0.0), (1, 5.0), (2, 9.0)], 2: [(0, 20.0), (1, 24.0), (2, 30.0)],
                     3: [(0, 40.0), (1, 41.0), (2, 42.0)]}
    timings.returns = {1: {0: 1.0, 1: 5.5, 2: 9.2}, 2: {0: 20.5, 1: 25.5, 2: 30.4}, 3: {0: 40.1, 2: 42.1}}
    offsets, held = timings.ready_offsets([0, 1, 2])
    # step 1: 0, 5 - 1, 9 - 1.5; step 2: 0, 4 - 0.5, 10 - 2; step 3 left out (bucket 1's call never returned)
    assert offsets == pytest.approx([0.0, (4.0 + 3.5) / 2, (7.5 + 8.0) / 2])
    assert held == pytest.approx([(1.0 + 0.5) / 2, (0.5 + 1.5) / 2, (0.2 + 0.4) / 2])
    assert timings.ready_offsets([2, 0]) == (pytest.approx([7.75, 0.0]), pytest.approx([0.3, 0.75]))
    assert timings.ready_offsets([0, 3]) is None  # no step called bucket 3


def test_the_ranks_windows_give_the_last_ranks_window_and_the_wait_for_it_through_backward():
    # Per step and rank, (plain window, compute before it) in ms. Every rank leaves a step together, so the least
    # window is the last rank's through backward: the median over the steps with a window on every rank (step 2 has
    # none on rank 0) of each one's least (4, 12, 28): 12. The wait, from the steps measured whole on every rank
    # (step 0 has no compute: the step before it was not timed): the ranks' spread of the compute, at most the
    # windows' spread (step 1: 3; step 3: 2, the rest of the compute's spread made up in the collectives): 2.5.
    steps = {0: [(10, None), (20, 50), (None, 40), (30, 60)],
             1: [(4, None), (12, 53), (1, 41), (29, 70)],
             2: [(6, None), (15, 52), (1, 50), (28, 65)]}
    combined = unwrap(run_ranks(scenarios.combined_windows, 3, (in_seconds(steps),)))
    assert combined == [pytest.approx((0.012, 0.0025))] * 3
    # Ranks far apart through backward: rank 1, the last, sees 2 and 1 ms beyond its backward where rank 0 waited
    # 28 and 24 ms for it. The window is the last rank's (median of 5, 2, 1); the wait may exceed it.
    apart = {0: [(5, None), (30, 60), (25, 70)], 1: [(5.5, None), (2, 90), (1, 95)]}
    assert unwrap(run_ranks(scenarios.combined_windows, 2, (in_seconds(apart),))) == [pytest.approx((0.002, 0.026))] * 2
    only_windows = {0: [(4, None)], 1: [(6, None)]}  # start_iter=2: one timed step, no compute
    assert unwrap(run_ranks(scenarios.combined_windows, 2, (in_seconds(only_windows),))) == [(0.004, None)] * 2
    unmeasured = [[(None, None)], [(0.003, 0.010)]]
    assert unwrap(run_ranks(scenarios.combined_windows, 2, (unmeasured,))) == [(None, None)] * 2


def test_a_probe_reads_the_link_and_not_a_peer_that_starts_each_run_late():
    """Rank 1 returns from every all-gather 50 ms after it completed, as a gloo rank that finished a run last starts
    the next one last. Each timed run starts together (a one-element allreduce first), so rank 0 reads its small
    all-gathers on the loopback in well under the 50 ms it would otherwise wait for rank 1 in every run."""
    rank0, _ = unwrap(run_ranks(scenarios.probed_with_a_late_peer, 2, (0.05,)))
    assert len(rank0) >= 2 and max(rank0) < 0.025


def in_seconds(steps: dict) -> list:
    """Per rank, its (window, compute) pairs in ms as seconds."""
    return [[tuple(None if x is None else x / 1e3 for x in pair) for pair in steps[rank]] for rank in sorted(steps)]


def test_the_load_comes_from_the_last_ranks_window_and_the_wait_for_it_is_in_no_options_time():
    per_byte = Line(0.0, 1e-9)  # 1 ms per MB; kernels free
    model = CostModel({f"world/{kind}": per_byte for kind in time_policy.KINDS}, {})
    codec = gradcomp.codec("topk:ratio=0.01")
    buckets = [{"index": 0, "shapes": [(1_000_000,)], "dtype": torch.float32}]  # plain: 4 ms at the probes' pace
    gather = codec.payload_nbytes(1_000_000) * 1e-9
    waited = time_policy.decide(model, [0.0], buckets, codec, "auto", 2, None, 4, None, 0.010, 0.004)
    assert waited["link_load"] == pytest.approx(2.5) and waited["backward_skew_s"] == 0.004  # 10 / 4
    assert waited["predicted_exposed_s"]["plain"] == pytest.approx(0.010)
    assert waited["predicted_exposed_s"]["allgather"] == pytest.approx(2.5 * gather)
    assert waited["predicted_exposed_alone_s"]["allgather"] == pytest.approx(gather)
    assert "waited 4.00 ms for the last" in time_policy.explain(waited, "topk:ratio=0.01")
    unwaited = time_policy.decide(model, [0.0], buckets, codec, "auto", 2, None, 4, None, 0.010)
    assert unwaited["backward_skew_s"] == 0.0
    assert {k: v for k, v in unwaited.items() if k != "backward_skew_s"} == \
        {k: v for k, v in waited.items() if k != "backward_skew_s"}


def test_the_exposed_time_is_the_queue_of_collectives_after_backward():
    # Three buckets ready at 0, 10 and 20 ms; each sends for 8 ms: the first two hide behind backward, the last
    # is exposed whole.
    costs = [Cost(0.0, 0.008, 0.0)] * 3
    assert time_policy.exposed([0.0, 0.010, 0.020], costs) == pytest.approx(0.008)
    # 15 ms each: they queue; the last ends at 45 ms, 25 ms after backward.
    assert time_policy.exposed([0.0, 0.010, 0.020], [Cost(0.0, 0.015, 0.0)] * 3) == pytest.approx(0.025)
    # An encode on the hook's thread delays the buckets after it: 2 ms each, before its collective.
    with_encode = [Cost(0.002, 0.004, 0.001)] * 3
    # ready 0 -> starts 2, ends 7; ready 10+2 -> starts 14, ends 19; ready 20+4 -> starts 26, ends 31: 11 after 20.
    assert time_policy.exposed([0.0, 0.010, 0.020], with_encode) == pytest.approx(0.011)
    # So does a collective waited for there (the hierarchical scheme's reduce-scatter inside the node).
    with_held = [Cost(0.0, 0.004, 0.001, held=0.002)] * 3
    assert time_policy.exposed([0.0, 0.010, 0.020], with_held) == pytest.approx(0.011)


def test_second_round_collectives_wait_for_the_last_bucket_and_queue_behind_the_first_round():
    # Bucket 0 is two-round (a 1 ms P, 1 ms between, a 1 ms Q, 1 ms decode), bucket 1 plain (8 ms), ready at 0 and
    # 5 ms. The first round: P 0-1, its middle 1-2; the plain allreduce 5-13. The sequencer issues Q once bucket 1
    # is launched (5 ms), but the link is busy until 13: Q 13-14, decode 14-15; 10 ms after backward.
    two_round = Cost(0.0, 0.001, 0.001, middle=0.001, second=0.001)
    plain = Cost(0.0, 0.008, 0.0)
    assert time_policy.exposed([0.0, 0.005], [two_round, plain]) == pytest.approx(0.010)
    # Alone, its Q waits only for its own first round, and the bucket's time is its total.
    assert time_policy.exposed([0.0], [two_round]) == pytest.approx(two_round.total)
    # An encode on the hook's thread delays the second round too: launched at 0 + 3 ms.
    assert time_policy.exposed([0.0], [Cost(0.003, 0.0, 0.0, second=0.001)]) == pytest.approx(0.004)


def test_a_decode_beside_the_link_lets_the_next_collective_start_and_ends_the_step_no_sooner_than_itself():
    # Two buckets ready at 0 and 1 ms, each a 4 ms collective and a 3 ms decode. On the link: 0-4, decode 4-7,
    # the second 7-11, decode 11-14: 13 ms after backward. Beside it: the second 4-8, its decode 8-11: 10 ms.
    costs = [Cost(0.0, 0.004, 0.003)] * 2
    assert time_policy.exposed([0.0, 0.001], costs) == pytest.approx(0.013)
    assert time_policy.exposed([0.0, 0.001], costs, [True, True]) == pytest.approx(0.010)
    # A long decode beside the link still ends the step: the first's 20 ms decode ends at 24 ms, after the second.
    long_first = [Cost(0.0, 0.004, 0.020), Cost(0.0, 0.004, 0.003)]
    assert time_policy.exposed([0.0, 0.001], long_first, [True, True]) == pytest.approx(0.023)
    # Per bucket: the first's beside, the second's on the link (nothing after it to wait): 4-8, decode 8-11.
    assert time_policy.exposed([0.0, 0.001], costs, [True, False]) == pytest.approx(0.010)
    # Second rounds too. Two two-round buckets, ready at 0: P0 0-1, its middle 1-2, P1 2-3, its middle 3-4; Q0 4-5.
    # On the link, Q0's 5 ms decode 5-10, Q1 10-11, its decode 11-16. Beside it: Q1 5-6, the decodes end at 10 and 11.
    two_round = Cost(0.0, 0.001, 0.005, middle=0.001, second=0.001)
    assert time_policy.exposed([0.0, 0.0], [two_round] * 2) == pytest.approx(0.016)
    assert time_policy.exposed([0.0, 0.0], [two_round] * 2, [True, True]) == pytest.approx(0.011)


def test_the_options_costs_follow_the_bytes_each_scheme_sends():
    """With every collective costing 1 s per byte and free kernels, an option's time is the bytes it sends, counted
    here from the codec's payload sizes (not from the schemes' own byte formulas)."""
    per_byte = Line(0.0, 1.0)
    model = CostModel({f"{level}/{kind}": per_byte for level in ("world", "inside", "across")
                       for kind in time_policy.KINDS}, {})
    codec = gradcomp.codec("topk:ratio=0.01")
    n, world = 100_000, 4
    assert model.flat("plain", codec, None, n, torch.float32, world, "world").wire == 4 * n
    assert model.flat("allgather", codec, None, n, torch.float32, world, "world").wire == codec.payload_nbytes(n)
    chunks = [codec.payload_nbytes(n // world) for _ in range(world)]  # n divisible by world: equal chunks
    two_phase = model.flat("two-phase", codec, None, n, torch.float32, world, "world")
    assert (two_phase.wire, two_phase.second) == (sum(chunks), max(chunks))  # all-to-all, then the all-gather
    hierarchical = model.hierarchical(codec, None, n, torch.float32, world, 2)  # 2 nodes of 2: shards of n / 2
    # reduce-scatter of the bucket inside the node, then the shard between 2 nodes (allgather), then its all-gather
    assert (hierarchical.held, hierarchical.wire, hierarchical.second) == (4 * n, codec.payload_nbytes(n // 2),
                                                                           4 * (n // 2))
    assert hierarchical.encode == 0.0  # free kernels: all the hook's thread waits for is the reduce-scatter
    loaded = hierarchical.loaded(1.5)  # every collective at the load, the one waited for on the hook's thread too
    assert (loaded.held, loaded.wire, loaded.second) == (1.5 * 4 * n, 1.5 * hierarchical.wire, 1.5 * 4 * (n // 2))
    powersgd = gradcomp.codec("powersgd:rank=4")
    cost = model.flat("powersgd", powersgd, [(256, 512), (512,)], 256 * 512 + 512, torch.float32, world, "world")
    assert (cost.wire, cost.second) == (4 * (256 * 4 + 512), 4 * (512 * 4))  # P with the whole bias, then Q


def test_the_hooks_own_time_per_call_is_added_to_each_compressed_options_encode_not_to_plains():
    """The warm-up's plain hook calls held backward's thread for the hook's own work too (their time is plain's
    encode), a plan's dry run does not: the model's "hook" seconds go on each compressed option's encode, once per
    bucket, measured kernels or not, and never on plain's."""
    links = {f"world/{kind}": Line(0.0, 1e-9) for kind in time_policy.KINDS}
    codec, shapes, options = gradcomp.codec("signsgd"), [(1000,)], ["plain", "allgather", "two-phase"]
    for measured in ({"allgather": (1e-3, 0.0, 2e-3), "two-phase": (1e-3, 5e-4, 2e-3)}, None):
        kernels = {} if measured else {"encode": Line(1e-4, 1e-9), "decode": Line(2e-4, 1e-9)}
        alone = time_policy.option_costs(CostModel(links, kernels), options, codec, shapes, torch.float32, 2, None,
                                         measured)
        hooked = time_policy.option_costs(CostModel(links, {**kernels, "hook": Line(4e-4, 0.0)}), options, codec,
                                          shapes, torch.float32, 2, None, measured)
        assert hooked["plain"] == alone["plain"]
        for option in ("allgather", "two-phase"):
            assert hooked[option].encode == pytest.approx(alone[option].encode + 4e-4)
            assert hooked[option].parts()[1:] == alone[option].parts()[1:]


def test_the_hooks_own_time_is_the_median_of_the_warm_ups_calls():
    timings = measure.WarmupTimings()
    assert timings.hook_seconds() == 0.0  # none timed: a GPU's, or no warm-up step
    for seconds in (3e-4, 1e-4, 9e-4):
        timings.hook_called(seconds)
    assert timings.hook_seconds() == 3e-4


def test_the_trials_collectives_give_each_option_and_kind_the_load_of_the_links_busy_periods_after_backward():
    """Collectives in launch order make one busy period while each is launched before the last completion so far
    (gloo runs two at once: they share the link). A period's seconds run from the step's last hook call (backward's
    end), or its first launch where later, to its last completion; its load is those seconds over the sum of its
    collectives' probes, and per option and kind the median over its collectives. Periods that ended before
    backward's end, periods with a kind that has no probes, and steps with a collective that never completed count
    for nothing."""
    timings = measure.WarmupTimings()
    timings.clock = measure.Clock(torch.device("cpu"))
    timings.steps = {step: [(0, base - 1.0), (1, base)] for step, base in
                     ((7, 10.0), (8, 20.0), (9, 30.0), (10, 40.0), (11, 50.0), (12, 60.0))}  # hook calls
    timings.collectives = {
        # launched during backward, the second before the first ended: one period, from backward's end, 4 ms
        7: [["allgather", "all-gather", 100, 9.5, 10.003], ["allgather", "all-gather", 100, 10.001, 10.004]],
        # the all-gather launched after the all-to-all ended: two periods, 4 ms and 1.5 ms
        8: [["two-phase", "all-to-all", 1000, 20.0, 20.004], ["two-phase", "all-gather", 100, 20.005, 20.0065]],
        9: [["two-phase", "all-to-all", 1000, 30.0, 30.1], ["two-phase", "all-gather", 100, 30.0, None]],  # failed
        # ended during backward: hidden; then one with no probes
        10: [["allgather", "all-gather", 100, 39.2, 39.5], ["allgather", "allreduce", 8, 40.001, 40.002]],
        11: [["two-phase", "all-to-all", 1000, 50.0, 50.002], ["two-phase", "all-gather", 100, 50.001, 50.0025]],
        # launched all-gather first, all-to-all second, ended the other way round: one period of 5 ms
        12: [["two-phase", "all-gather", 100, 60.0, 60.005], ["two-phase", "all-to-all", 1000, 60.001, 60.003]]}
    assert [(members, pytest.approx(seconds)) for members, seconds in timings.busy_periods(7)] == \
        [([("allgather", "all-gather", 100, pytest.approx(3e-3)), ("allgather", "all-gather", 100, math.inf)],
          pytest.approx(4e-3))]  # the first launched during backward: 3 ms of it in flight after
    assert [seconds for _, seconds in timings.busy_periods(8)] == [pytest.approx(4e-3), pytest.approx(1.5e-3)]
    assert timings.busy_periods(9) == []
    assert [(members, pytest.approx(seconds)) for members, seconds in timings.busy_periods(10)] == \
        [([("allgather", "allreduce", 8, math.inf)], pytest.approx(1e-3))]
    curves = {"all-to-all": Curve((1000.0,), (1e-3,)), "all-gather": Curve((100.0,), (5e-4,))}
    loads = timings.collective_loads(curves)
    assert set(loads) == {"two-phase", "allgather"} and set(loads["two-phase"]) == {"all-to-all", "all-gather"}
    assert loads["allgather"] == {"all-gather": pytest.approx(4.0)}  # 4 ms over 2 x 0.5 ms; no allreduce curve
    # all-to-all: 4 ms / 1 ms (step 8), 2.5 ms / 1.5 ms (11), 5 ms / 1.5 ms (12); all-gather: 1.5 ms / 0.5 ms (8), and
    # the same two periods
    assert loads["two-phase"]["all-to-all"] == pytest.approx(5 / 1.5)
    assert loads["two-phase"]["all-gather"] == pytest.approx(3.0)
    for step in (7, 10, 11, 12):
        del timings.steps[step]
    assert timings.trial_windows([7, 8, 9]) == {}  # no call marked as returned
    timings.returns = {8: {0: 19.001, 1: 20.0005}, 9: {0: 29.001, 1: 30.0005}}
    # the last call to the last completion, and the 1 ms inside the call before it
    assert timings.trial_windows([7, 8, 9]) == {8: pytest.approx(0.0075)}


def test_a_collective_launched_during_backward_counts_at_most_for_its_time_in_flight_after_it():
    """The period's seconds start at backward's end; a collective launched before it did the rest of its work
    before, so its probe is counted for no more than its seconds in flight after backward's end."""
    timings = measure.WarmupTimings()
    timings.clock = measure.Clock(torch.device("cpu"))
    timings.steps = {1: [(0, 0.0), (1, 0.1)]}  # backward ends at 0.1 s
    # a 9 ms all-gather launched at 0.095 (5 ms of it in flight after backward), then a 3 ms one launched after
    timings.collectives = {1: [["allgather", "all-gather", 900, 0.095, 0.105], ["allgather", "all-gather", 300,
                                                                                 0.1001, 0.109]]}
    curves = {"all-gather": Curve((300.0, 900.0), (3e-3, 9e-3))}
    # 9 ms after backward over 5 ms + 3 ms (the whole 9 + 3 ms would read the link at 0.75)
    assert timings.collective_loads(curves) == {"allgather": {"all-gather": pytest.approx(9 / 8)}}


def test_after_the_trial_each_compressed_options_collectives_are_taken_at_their_own_loads():
    """The decision's collectives, at its one load (2x), are taken at the trial's load of their option and kind where
    it timed them (plain's, fitted to the warm-up's plain steps, and the rest as decided); the kernels as decided; the
    model's choice is the trial's "model" candidate, not the buckets' choice (which follows the trial's candidates)."""
    decision = {"link_load": 2.0, "options": ["plain", "allgather", "two-phase"], "model": {"kernels": {}},
                "buckets": [{"ready_s": 0.0, "choice": "plain",
                             "predicted_s": {"plain": [0.0, 4e-3, 0.0, 0.0, 0.0, 0.0],
                                             "allgather": [1e-3, 2e-3, 1e-3, 0.0, 0.0, 0.0],
                                             "two-phase": [1e-3, 2e-3, 1e-3, 5e-4, 4e-3, 0.0]}}],
                "trial": {"choices": {"model": ["allgather"], "plain": ["plain"]}}}
    loads = {"allgather": {"all-gather": 6.0}, "two-phase": {"all-gather": 1.0}}
    after = time_policy.in_step(decision, loads)
    predicted = after["predicted_exposed_s"]
    assert after["loads"] == loads
    assert predicted["plain"] == pytest.approx(4e-3)  # as decided
    assert predicted["allgather"] == pytest.approx(1e-3 + 6e-3 + 1e-3)  # its wire at 6x, not 2x
    assert predicted["policy"] == pytest.approx(predicted["allgather"])
    # two-phase: its all-to-all as decided, its all-gather (second round, after encode, wire and middle) at 1x
    assert predicted["two-phase"] == pytest.approx(1e-3 + 2e-3 + 5e-4 + 2e-3 + 1e-3)
    # the trial's plain steps spent 3 ms beyond backward: plain's allreduce (2 ms alone) at 1.5x, the rest as before
    refitted = time_policy.in_step(decision, loads, plain_window=3e-3)
    assert refitted["plain_load"] == pytest.approx(1.5)
    assert refitted["predicted_exposed_s"] == pytest.approx({**predicted, "plain": 3e-3})
    # the plans' launches 3x their dry runs: the encode less the hook's own time (0.4 ms), 0.6 ms, to 1.8 ms
    hooked = {**decision, "model": {"kernels": {"hook": [4e-4, 0.0]}}}
    slower = time_policy.in_step(hooked, {"allgather": {"encode": 3.0}})["predicted_exposed_s"]
    assert slower["allgather"] == pytest.approx(4e-4 + 1.8e-3 + 2e-3 + 1e-3)
    # Two buckets: allgather's decodes run beside the link where the trial timed its collectives (their times hold
    # them), on it where only its launches were timed. Each bucket: 1 ms encode, 2 ms all-gather (at 2x: 4 ms as
    # decided), 3 ms decode, ready at 0 and 1 ms.
    two = {**decision, "buckets": [{"ready_s": ready, "choice": "plain",
                                    "predicted_s": {"plain": [0.0, 4e-3, 0.0, 0.0, 0.0, 0.0],
                                                    "allgather": [1e-3, 4e-3, 3e-3, 0.0, 0.0, 0.0],
                                                    "two-phase": [1e-3, 2e-3, 1e-3, 5e-4, 4e-3, 0.0]}}
                                   for ready in (0.0, 1e-3)],
           "trial": {"choices": {"model": ["allgather"] * 2, "plain": ["plain"] * 2}}}
    # timed at 2x, as decided: encode 0-1, wire 1-5; the second's encode 2-3, its wire 5-9, its decode 9-12
    beside = time_policy.in_step(two, {"allgather": {"all-gather": 2.0}})["predicted_exposed_s"]
    assert beside["allgather"] == pytest.approx(12e-3 - 1e-3) and beside["policy"] == beside["allgather"]
    # launches timed alone (at 1x): the decode holds the link, the second's wire 8-12, its decode 12-15
    on_link = time_policy.in_step(two, {"allgather": {"encode": 1.0}})["predicted_exposed_s"]
    assert on_link["allgather"] == pytest.approx(15e-3 - 1e-3)


def test_the_trials_plan_launches_give_each_bucket_its_encode_load_over_its_dry_run():
    """Per option and bucket, the median over that bucket's launches of each one's seconds over its decided encode
    less the hook's own time (its dry run); trial_loads puts them beside the collectives' loads, in the decision's
    bucket order, None for a bucket not launched."""
    decision = {"model": {"kernels": {"hook": [1e-4, 0.0]}},
                "buckets": [{"index": 2, "predicted_s": {"allgather": [1.1e-3, 0, 0, 0, 0, 0]}},
                            {"index": 0, "predicted_s": {"allgather": [2.1e-3, 0, 0, 0, 0, 0]}},
                            {"index": 1, "predicted_s": {"allgather": [5.1e-3, 0, 0, 0, 0, 0]}}]}
    timings = measure.WarmupTimings()
    for index, seconds in ((2, 1.5e-3), (0, 2.4e-3), (2, 1.2e-3), (0, 4e-3), (2, 3e-3)):
        timings.plan_launched("allgather", index, seconds)
    # bucket 2: 1.5, 1.2, 3.0 (median 1.5); bucket 0: 1.2, 2.0 (median 1.6); bucket 1 never launched
    assert timings.launch_loads(decision) == {"allgather": {0: pytest.approx(1.6), 2: pytest.approx(1.5)}}
    loads = timings.trial_loads({}, decision)  # no curves: no collective's load
    assert loads == {"allgather": {"encode": [pytest.approx(1.5), pytest.approx(1.6), None]}}
    flat = measure.flat_loads(loads)
    assert flat == {("allgather", "encode", 0): pytest.approx(1.5), ("allgather", "encode", 1): pytest.approx(1.6)}
    assert measure.nested_loads(flat, 3) == loads


def test_after_the_trial_each_buckets_encode_is_taken_at_its_own_load():
    """in_step scales each bucket's encode (less the hook's time) by its own launches' load; a bucket with none takes
    the median of the option's others; a decision saved with one number for the option takes it for every bucket."""
    decision = {"link_load": 1.0, "options": ["plain", "allgather"], "model": {"kernels": {"hook": [1e-4, 0.0]}},
                "buckets": [{"ready_s": 0.0, "choice": "allgather",
                             "predicted_s": {"plain": [0.0, 1e-3, 0.0, 0.0, 0.0, 0.0],
                                             "allgather": [encode, 0.0, 0.0, 0.0, 0.0, 0.0]}}
                            for encode in (1.1e-3, 2.1e-3, 4.1e-3)],
                "trial": {"choices": {"model": ["allgather"] * 3, "plain": ["plain"] * 3}}}

    def encodes(load):  # one after another on backward's thread, nothing on the link: the encodes' sum
        return time_policy.in_step(decision, {"allgather": {"encode": load}})["predicted_exposed_s"]["allgather"]

    assert encodes([0.5, 2.0, None]) == pytest.approx(3e-4 + 0.5 * 1e-3 + 2.0 * 2e-3 + 1.25 * 4e-3)  # the third: 1.25
    assert encodes(1.5) == pytest.approx(3e-4 + 1.5 * 7e-3)
    assert encodes([None, None, None]) == pytest.approx(7.3e-3)  # none launched: as decided


def test_a_dry_runs_parts_are_each_the_least_over_the_runs_not_the_rest_of_the_least_whole_run():
    """(encode, middle, decode) of a plan's dry runs, each part the least of its own over the runs: one run's
    middle held up (the core taken away) must not move into the decode of the run whose middle was the least."""
    clock = measure.Clock(torch.device("cpu"))  # host seconds: marks are plain floats
    runs = [(0.0, 3e-3, 10e-3, 14e-3),  # encode 3, middle 7 (held up), decode 4: the least whole run, 14
            (0.0, 3.5e-3, 6.5e-3, 15.5e-3)]  # encode 3.5, middle 3, decode 9
    assert measure.plan_seconds(runs, clock) == pytest.approx((3e-3, 3e-3, 4e-3))  # not 14 - 3 - 3 = 8 for decode


def test_a_plans_dry_runs_leave_out_the_first_launch_and_time_each_later_one_from_start_to_end():
    """time_plan launches the plan once untimed (its first run pays for allocations), then `repeats` timed runs,
    each marked at its start, first and last collective and end, in that order."""
    class CountingPlan:  # one local allreduce per launch
        numel, shapes = 6, [torch.Size([2, 3])]

        def __init__(self):
            self.launches, self.first_ended = 0, None

        def launch(self, step, data, views):
            self.launches += 1
            done = step.allreduce(data)
            if self.launches == 1:
                self.first_ended = time.perf_counter()  # the CPU clock's own marks
            return done

    plan, clock = CountingPlan(), measure.Clock(torch.device("cpu"))
    runs = measure.time_plan(plan, torch.ones(4), world=2, rank=0, nodes=None, clock=clock, repeats=3)
    assert plan.launches == 4 and len(runs) == 3
    assert all(plan.first_ended <= start <= first <= last <= end for start, first, last, end in runs)


def test_the_choice_is_never_predicted_slower_than_plain_and_leaves_hidden_buckets_plain():
    ready = [0.0, 0.050, 0.100]
    cheap = {"plain": Cost(0.0, 0.010, 0.0), "allgather": Cost(0.001, 0.001, 0.001)}
    # Communication of the first two buckets hides behind backward: compressing them gains nothing.
    assert time_policy.choose(ready, [cheap] * 3) == ["plain", "plain", "allgather"]
    # A codec that saves a tenth of the wire time and adds more in its kernels: nothing to gain, even pipelined (an
    # encode can run while an earlier bucket is on the wire, so a codec slower than plain alone may still pay).
    little_saved = {"plain": Cost(0.0, 0.010, 0.0), "allgather": Cost(0.003, 0.009, 0.002)}
    assert time_policy.choose([0.0] * 3, [little_saved] * 3) == ["plain"] * 3
    rng = random.Random(0)
    for _ in range(300):
        count = rng.randint(1, 8)
        ready = sorted(rng.uniform(0, 0.05) for _ in range(count))
        options = [{"plain": Cost(0.0, rng.uniform(0, 0.02), 0.0),
                    "allgather": Cost(*(rng.uniform(0, 0.01) for _ in range(3))),
                    "two-phase": Cost(*(rng.uniform(0, 0.01) for _ in range(5)))} for _ in range(count)]
        choice = time_policy.choose(ready, options)
        predicted = time_policy.exposed(ready, [o[c] for o, c in zip(options, choice)])
        assert predicted <= time_policy.exposed(ready, [o["plain"] for o in options]) + 1e-12
        for fixed in ("allgather", "two-phase"):  # plain where an option would gain less than MARGIN
            bound = time_policy.exposed(ready, [o[fixed] for o in options]) / (1 - time_policy.MARGIN)
            assert predicted <= bound + 1e-12, fixed
    # One slow link for all: each bucket's codec alone gains nothing while the others queue behind plain buckets,
    # yet every bucket compressed is 4x faster; single-bucket moves from all-plain would never find it.
    bottleneck = {"plain": Cost(0.0, 0.010, 0.0), "allgather": Cost(0.0, 0.0025, 0.0)}
    assert time_policy.choose([0.0] * 8, [bottleneck] * 8) == ["allgather"] * 8


def test_the_candidates_follow_the_codec_and_the_scheme_option():
    assert time_policy.candidates(gradcomp.codec("signsgd"), "auto", False) == ["plain", "allgather", "two-phase"]
    assert time_policy.candidates(gradcomp.codec("signsgd"), "auto", True) == ["plain", "allgather", "two-phase",
                                                                                "hierarchical"]
    assert time_policy.candidates(gradcomp.codec("signsgd"), "flat", True) == ["plain", "allgather", "two-phase"]
    assert time_policy.candidates(gradcomp.codec("qsgd"), "two-phase", True) == ["plain", "two-phase"]
    assert time_policy.candidates(gradcomp.codec("powersgd"), "hierarchical", True) == ["plain", "hierarchical"]
    assert time_policy.candidates(gradcomp.codec("fp16"), "auto", False) == ["plain", "allreduce"]


def test_bad_options_are_refused_by_name():
    refusals = [({"policy": "fast"}, "policy='fast'; valid: 'codec', 'time'"),
                ({"policy": "time", "start_iter": 1}, "start_iter=1"),
                ({"policy": "time", "start_codec": "qsgd"}, "start_codec"),
                ({"policy": "time", "min_bucket_ratio": 2.0}, "min_bucket_ratio=2.0"),
                ({"policy": "time", "remeasure_every": -1}, "remeasure_every=-1"),
                ({"remeasure_every": 5}, "remeasure_every=5"),
                ({"policy": "time", "trial_steps": 1}, "trial_steps=1"),
                ({"policy": "time", "trial_steps": -2}, "trial_steps=-2"),
                ({"policy": "time", "trial_steps": True}, "trial_steps=True"),
                ({"trial_steps": 4}, "trial_steps=4")]
    for options, named in refusals:
        with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
            gradcomp.CompressionState("topk", **options)
    assert "no decision yet" in gradcomp.CompressionState("topk", policy="time").explain()
    assert gradcomp.CompressionState("topk", policy="time").start_iter == time_policy.WARMUP_STEPS == 5
    assert gradcomp.CompressionState("topk").start_iter == 2


# -- on ranks ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world, spec, options", [(3, "topk:ratio=0.2", {}), (6, "signsgd", {"node_size": 3}),
                                                  (2, "powersgd:rank=2", {}), (3, "randomk:ratio=0.3", {})])
def test_every_rank_takes_the_same_decision_when_their_measurements_differ(world, spec, options):
    """Each rank's measured links scaled by 1 + rank / 2 (and its plans' timings its own): one allreduce gives every
    rank the largest of each, and so one decision (compared whole, predictions included). At the default start_iter,
    taken after the plain windows of the warm-up's steps after DDP's first."""
    steps = time_policy.WARMUP_STEPS + 2
    results = unwrap(run_ranks(scenarios.recorded, world, (spec, {"start_iter": None, **options}, steps, None, 0.5),
                               timeout=300))
    decisions = [json.dumps(r["decisions"], sort_keys=True) for r in results]
    assert len(results[0]["decisions"]) == 1 and len(set(decisions)) == 1
    assert results[0]["decisions"][0]["step"] == time_policy.WARMUP_STEPS
    assert all(r["windows_read"] == [time_policy.WARMUP_STEPS - 1] for r in results)
    links = results[0]["decisions"][0]["model"]["links"]
    for key, combined in links.items():
        measured = [r["measured"][0][key] for r in results]
        assert measured[0] != measured[-1] and all(m["sizes"] == combined["sizes"] for m in measured)
        assert combined["seconds"] == [max(at_size) for at_size in zip(*(m["seconds"] for m in measured))]
    assert len({r["explain"] for r in results}) == 1
    assert results[0]["stats"]["decision"]["buckets"][0]["choice"] in results[0]["decisions"][0]["options"]
    decision, (low, high) = results[0]["decisions"][0], time_policy.LOAD_BOUNDS
    assert decision["plain_window_s"] > 0 and low <= decision["link_load"] <= high  # the warm-up's plain window
    assert decision["backward_skew_s"] >= 0
    hook = decision["model"]["kernels"]["hook"]  # the warm-up's plain calls timed on these CPU ranks
    assert hook[0] > 0 and hook[1] == 0 and "hook call takes" in results[0]["explain"]


SCHEDULE = [["two-phase", "plain"], ["plain"], ["allgather"], ["two-phase"], ["plain", "allgather"]]


@pytest.mark.parametrize("spec", ["signsgd", "topk:ratio=0.2", "powersgd:rank=2", "randomk:ratio=0.3"])
def test_switches_between_plain_and_compressed_lose_nothing(spec):
    """Decisions taken anew every 2 steps, switching each bucket between plain and the codec's schemes: per element,
    the sum over the steps of every rank's mean gradient = what DDP applied + the mean of the residuals left (and
    the two-phase owners'), and each switch took place."""
    world, steps = 2, 12
    fixed = gradcomp.schemes.fixed_scheme(gradcomp.codec(spec))  # allreduce or powersgd; None: the gathered codecs
    schedule = SCHEDULE if fixed is None else [[fixed, "plain"], ["plain"], [fixed], ["plain", fixed]]
    results = unwrap(run_ranks(scenarios.recorded, world, (spec, {"remeasure_every": 2}, steps, schedule),
                               timeout=300))
    assert len(results[0]["decisions"]) == 5  # at steps 2, 4, 6, 8 and 10
    taken = {b["choice"] for d in results[0]["decisions"] for b in d["buckets"]}
    assert taken == {name for names in schedule for name in names}
    assert_nothing_lost(results, steps, replicas=world)
    # a plain bucket drops the residual it took over once it is spent: it then costs what plain DDP's does
    assert results[0]["plain_residuals_held"] == [False] and "plain" in results[0]["schemes_at_end"].values()


def test_remeasures_where_a_steps_first_bucket_cannot_be_compressed():
    """A float64 layer's bucket, which goes plain (no codec takes float64), is the first that DDP hands the hook in
    every step: the decision is re-taken every remeasure_every steps all the same, over the other buckets, and
    nothing is lost across its switches."""
    world, steps, schedule = 2, 10, [["allgather"], ["plain"], ["two-phase"], ["plain"]]
    results = unwrap(run_ranks(scenarios.recorded, world, ("signsgd", {"remeasure_every": 2}, steps, schedule, None,
                                                           None, "double_head"), timeout=300))
    assert results[0]["first_bucket_dtypes"] == [torch.float64] * steps
    assert [d["step"] for d in results[0]["decisions"]] == [2, 4, 6, 8]
    assert all(len(d["buckets"]) == len(results[0]["schemes_at_end"]) for d in results[0]["decisions"])
    assert set(results[0]["schemes_at_end"].values()) == {"plain"}  # the last decision's choice
    assert_nothing_lost(results, steps, replicas=world)


class _OneRankStep:
    """What a plain bucket's launch asks of a step, on one rank: the allreduce of one rank is the tensor itself."""
    world = 1

    @staticmethod
    def allreduce(tensor):
        done = torch.futures.Future()
        done.set_result([tensor])
        return done


def _unread(tensor):
    """tensor, made to fail the test if release_if_spent reads it (a pass over the bucket per step)."""
    def read():
        raise AssertionError("the spent residual was read")
    tensor.any = read
    return tensor


def test_a_plain_bucket_drops_the_residual_it_sent_without_reading_it_unless_an_idle_parameter_kept_some():
    """After a switch to plain: the residual taken over is sent once with the gradient; the bucket then knows it is
    spent (no pass over it in the next step), except where set_idle_aside put an idle parameter's share back, which
    is kept until sent."""
    codec = gradcomp.codec("signsgd")
    left = {"a": {"residual": torch.tensor([1.0, 2.0])}, "b": {"residual": torch.tensor([3.0])}}
    for idle in (None, torch.tensor([True, False])):
        plan = gradcomp.schemes.PlainBucket(codec, 0, ["a", "b"], [(2,), (1,)], torch.float32, "cpu")
        plan.take({key: {"residual": piece["residual"].clone()} for key, piece in left.items()})
        plan.release_if_spent()  # not yet sent: kept
        assert torch.equal(plan.residual, torch.tensor([1.0, 2.0, 3.0]))
        flat = torch.tensor([10.0, 20.0, 30.0])
        sent = plan.launch(_OneRankStep(), flat, None).wait()
        assert torch.equal(sent, torch.tensor([11.0, 22.0, 33.0]))
        if idle is None:
            _unread(plan.residual)
            plan.release_if_spent()
            assert plan.residual is None
        else:
            plan.set_idle_aside(idle, flat)  # parameter a unused on every rank: its gradient 0, its residual back
            assert torch.equal(flat, torch.tensor([0.0, 0.0, 33.0]))
            plan.release_if_spent()
            assert torch.equal(plan.residual, torch.tensor([1.0, 2.0, 0.0]))
            assert torch.equal(plan.launch(_OneRankStep(), torch.zeros(3), None).wait(), torch.tensor([1.0, 2.0, 0.0]))
            _unread(plan.residual)
            plan.release_if_spent()
            assert plan.residual is None
    not_finite = gradcomp.schemes.PlainBucket(codec, 0, ["a", "b"], [(2,), (1,)], torch.float32, "cpu")
    not_finite.take({key: {"residual": piece["residual"].clone()} for key, piece in left.items()})
    not_finite.launch(_OneRankStep(), torch.tensor([float("nan"), 1.0, 1.0]), None).wait()
    not_finite.release_if_spent()  # the step's data was not finite: the residual stays as it was, to be sent
    assert torch.equal(not_finite.residual, torch.tensor([1.0, 2.0, 3.0]))


def test_switches_to_and_from_the_hierarchical_scheme_lose_nothing():
    world, steps = 4, 10
    schedule = [["hierarchical"], ["plain"], ["two-phase", "hierarchical"], ["hierarchical"]]
    results = unwrap(run_ranks(scenarios.recorded, world, ("signsgd", {"remeasure_every": 2, "node_size": 2}, steps,
                                                           schedule), timeout=300))
    assert set(results[0]["schemes_at_end"].values()) == {"hierarchical"}
    assert_nothing_lost(results, steps, replicas=2)  # the hierarchical scheme's residuals: one per node


def assert_nothing_lost(results, steps, replicas):
    world = len(results)
    for position in range(len(results[0]["applied"][0])):
        averaged = sum(sum(r["sent"][t][position] for r in results) / world for t in range(steps))
        applied = sum(results[0]["applied"][t][position] for t in range(steps))
        kept = sum(r["residual"][position] for r in results if r["residual"][position] is not None)
        kept = kept / replicas + sum(r["owner"][position] for r in results if r["owner"][position] is not None)
        gap = float((averaged - applied - torch.as_tensor(kept).reshape(-1)).abs().max())
        assert gap <= 2e-6 * max(1.0, float(averaged.abs().max())), (position, gap)


@pytest.mark.parametrize("split", [2, 5], ids=["before the decision", "after it"])
def test_a_resumed_run_repeats_the_decision_and_the_run_bit_for_bit(tmp_path, split):
    """Saved after the decision, a resumed run takes it from the state (it never decides again); saved at start_iter,
    before it, the resumed run decides as the uninterrupted one did (here by the same schedule)."""
    world, total, spec = 2, 8, "signsgd"
    schedule = [["two-phase", "plain", "allgather"]]
    whole = unwrap(run_ranks(scenarios.resume, world, (spec, {}, total, split, str(tmp_path), "whole", schedule)))
    unwrap(run_ranks(scenarios.resume, world, (spec, {}, total, split, str(tmp_path), "first", schedule)))
    rest = unwrap(run_ranks(scenarios.resume, world, (spec, {}, total, split, str(tmp_path), "rest", [["plain"]])))
    if split > 2:
        assert all(r["choose_calls"] == 0 for r in rest)
    else:
        assert all(r["choose_calls"] == 1 for r in rest)
        rest = unwrap(run_ranks(scenarios.resume, world, (spec, {}, total, split, str(tmp_path), "rest", schedule)))
    assert len(set(whole[0]["schemes"].values())) >= 2
    assert rest[0]["schemes"] == whole[0]["schemes"]
    for r_whole, r_rest in zip(whole, rest):
        for a, b in zip(r_whole["params"], r_rest["params"]):
            assert torch.equal(a, b)


# -- the trial -----------------------------------------------------------------------------------------------------

# Scripted step times per candidate, [rank 0's, rank 1's]: rank 0 alone would keep plain; the slowest rank's medians
# make allgather the fastest.
TRIAL_SECONDS = {"model": [2.5, 2.5], "plain": [1.0, 3.0], "allgather": [2.0, 2.0], "two-phase": [2.2, 2.4]}


def test_the_trial_shortlist_drops_what_is_predicted_far_slower_and_schedules_the_rest_in_shuffled_rounds():
    decision = {"step": 5, "options": ["plain", "allgather", "two-phase"],
                "buckets": [{"choice": "allgather"}, {"choice": "plain"}],
                "predicted_exposed_s": {"policy": 0.1, "plain": 2.0, "allgather": 0.12, "two-phase": 0.3}}
    trial = policy_trial.plan(decision, 4, plain_step_s=2.5)  # compute 0.5 s: plain's 2.5 s is over 1.5 x 0.6 s
    assert trial["names"] == ["model", "allgather", "two-phase"] and trial["block"] == 2 and trial["rounds"] == 4
    assert trial["choices"]["model"] == ["allgather", "plain"] and trial["choices"]["two-phase"] == ["two-phase"] * 2
    assert policy_trial.length(trial) == 24  # 3 candidates x 4 rounds x 2 steps
    schedule = [policy_trial.candidate_at(trial, s) for s in range(4, 30)]
    assert schedule[0] is None and schedule[-1] is None
    blocks = [schedule[1 + 2 * b:3 + 2 * b] for b in range(12)]
    assert all(a == b for a, b in blocks)  # two steps per block: the switch and one measured step
    rounds = [[a for a, _ in blocks[3 * r:3 * r + 3]] for r in range(4)]
    assert all(sorted(r) == sorted(trial["names"]) for r in rounds)  # every candidate once per round
    assert len({tuple(r) for r in rounds}) > 1  # in an order shuffled per round
    assert policy_trial.plan(decision, 4, plain_step_s=2.5) == trial  # alike on every rank (and on resume)
    assert [policy_trial.round_at(trial, s) for s in (4, 5, 10, 11, 28, 29)] == [None, 0, 0, 1, 3, None]
    assert [s for s in range(5, 29) if policy_trial.counted(trial, s)] == list(range(6, 29, 2))
    assert len(policy_trial.plan(decision, 4, plain_step_s=None)["names"]) == 4  # nothing measured: nothing pruned
    # At the probes' own pace plain's exposed time is 0.4 s, its step 2.5 - 0.4 + 0.4: 2.5 s against the model's
    # 2.1 + 0.08 s: within 1.5x, so plain stays, though the load makes it 2.0 s (a load can be far off)
    alone = {"policy": 0.08, "plain": 0.4, "allgather": 0.1, "two-phase": 0.25}
    assert policy_trial.plan({**decision, "predicted_exposed_alone_s": alone}, 4, 2.5)["names"] == \
        ["model", "plain", "allgather", "two-phase"]
    slow_alone_too = {**alone, "plain": 1.8}  # 2.5 s against 0.7 + 0.08 s: over 1.5x at both paces
    assert policy_trial.plan({**decision, "predicted_exposed_alone_s": slow_alone_too}, 4, 2.5) == trial
    assert policy_trial.plan(decision, 0, plain_step_s=2.5) is None
    plain_chosen = {**decision, "buckets": [{"choice": "plain"}] * 2,
                    "predicted_exposed_s": {"policy": 0.2, "plain": 0.2, "allgather": 3.0, "two-phase": 3.0}}
    # only plain is left: nothing to compare, but its rounds still run, for the steps' timings (in_step)
    alone = policy_trial.plan(plain_chosen, 4, plain_step_s=0.5)
    assert alone["names"] == ["model"] and policy_trial.all_plain(alone) == "model" and policy_trial.length(alone) == 8


SWITCH_SECONDS = 100.0  # each block's first step (the switch): far slower than any scripted step, and never counted


def _scripted_verdict(trial: dict, steps: dict[str, list[float]]) -> dict:
    """The verdict of one rank whose counted trial steps took, per candidate, the scripted seconds round by round
    (None: that step and its switch not measured, as in a run resumed after them), taken again after each round a
    close call adds, until it stands; every scripted time must be used."""
    queues = {name: list(seconds) for name, seconds in steps.items()}
    seconds, scripted_up_to = {}, 0
    while True:
        for step in range(scripted_up_to, policy_trial.length(trial)):
            if policy_trial.counted(trial, step):
                scripted = queues[policy_trial.candidate_at(trial, step)].pop(0)
                if scripted is not None:
                    seconds.update({step - 1: SWITCH_SECONDS, step: scripted})
        scripted_up_to = policy_trial.length(trial)
        trial = policy_trial.verdict(trial, seconds, None, torch.device("cpu"))
        if trial["chosen"] is not None:
            break
    assert not any(queues.values())  # every scripted time was used: one counted step per candidate and round
    return trial


def _one_bucket_trial(monkeypatch, trial_steps=4, options=("plain", "allgather")):
    """A trial of the model's choice (allgather for the one bucket) against the other options for it, on one rank."""
    monkeypatch.setattr(policy_trial.dist, "get_world_size", lambda group=None: 1)
    decision = {"step": 0, "options": list(options), "buckets": [{"choice": "allgather"}],
                "predicted_exposed_s": {"policy": 0.1, "plain": 0.2, "allgather": 0.1, "two-phase": 0.1}}
    trial = policy_trial.plan(decision, trial_steps, plain_step_s=None)
    assert trial["names"] == ["model", *(option for option in options if option != "allgather")]
    return trial


def test_the_verdict_keeps_plain_unless_the_candidates_gain_is_clear_of_the_rounds_scatter(monkeypatch):
    """Compression replaces plain only where it beat plain's step of the same round by over 2% in the median, and in
    every round or in the mean by a 95% interval: a machine whose speed drifts between rounds moves both alike."""
    trial = _one_bucket_trial(monkeypatch)

    def verdict(model_steps, plain_steps):
        return _scripted_verdict(trial, {"model": model_steps, "plain": plain_steps})

    drifting = verdict([2.0, 3.0, 4.0, 5.0], [2.2, 3.3, 4.4, 5.5])  # the machine slows down; the model's 10% holds
    assert drifting["chosen"] == "model" and drifting["measured_step_s"] == {"model": 3.5, "plain": 3.85}
    assert drifting["round_step_s"] == {"model": [2.0, 3.0, 4.0, 5.0], "plain": [2.2, 3.3, 4.4, 5.5]}
    assert drifting["rounds"] == 4 and drifting["challenger"] == "model"
    # ratios 0.80, 1.03, 0.81, 0.81: one round lost, but a 19% gain three times is clear (the mean ratio 0.864, its
    # interval's upper end 0.99)
    lost_a_round = verdict([2.0, 3.1, 2.1, 2.2], [2.5, 3.0, 2.6, 2.7])
    assert lost_a_round["chosen"] == "model" and lost_a_round["rounds"] == 4
    close = verdict([2.95, 2.95, 2.95, 2.95], [3.0, 3.0, 3.0, 3.0])  # quicker every round, by under 2%
    assert close["chosen"] == "plain" and close["rounds"] == 4  # no gain over 2% possible: no round added
    slower = verdict([3.3, 3.2, 3.4, 3.3], [3.0, 3.0, 3.0, 3.0])
    assert slower["chosen"] == "plain" and slower["rounds"] == 4
    lines = "\n".join(policy_trial.describe(drifting))
    assert "model 2000.0/3000.0/4000.0/5000.0; plain 2200.0/3300.0/4400.0/5500.0" in lines and \
        "chosen: model" in lines and "close call" not in lines


def test_a_close_call_adds_rounds_of_the_challenger_and_plain_until_its_gain_is_clear_or_gone(monkeypatch):
    """Four rounds whose ratios scatter (0.93, 1.06, 0.87, 0.88) neither show a gain clearly nor rule one out: the
    trial adds rounds of the challenger and plain alone, the verdict taken again after each, until the gain is clear,
    a gain over 2% lies outside the mean ratio's interval, or EXTEND x trial_steps rounds have run; then the quicker
    in the mean of all its rounds stands."""
    trial = _one_bucket_trial(monkeypatch)
    model, plain = [2.8, 3.4, 2.7, 2.9], [3.0, 3.2, 3.1, 3.3]
    ratios = [m / p for m, p in zip(model, plain)]
    assert not policy_trial.clear_gain(ratios) and policy_trial.gain_possible(ratios)
    cleared = _scripted_verdict(trial, {"model": model + [2.7, 2.7], "plain": plain + [3.0, 3.0]})
    assert cleared["chosen"] == "model" and cleared["rounds"] == 6 and cleared["challenger"] == "model"
    assert all(sorted(order) == ["model", "plain"] for order in cleared["order"][4:])
    assert cleared["round_step_s"]["model"] == model + [2.7, 2.7]
    gone = _scripted_verdict(trial, {"model": model + [3.3] * 7, "plain": plain + [3.0] * 7})
    assert gone["chosen"] == "plain" and gone["rounds"] == 11  # 10% slower seven times: no gain left to find
    # ratios scattering to the last round, neither clear nor ruled out: 1.2 and 0.83 in turn (the mean of all 48,
    # 1.01: plain stands), or 1.15 and 0.8 (0.97: the model's choice)
    for scatter, chosen in (([3.6, 2.5] * 22, "plain"), ([3.45, 2.4] * 22, "model")):
        capped = _scripted_verdict(trial, {"model": model + scatter, "plain": plain + [3.0] * 44})
        assert capped["chosen"] == chosen and capped["rounds"] == capped["max_rounds"] == 48
    lines = "\n".join(policy_trial.describe(capped))
    assert "a close call: 44 more rounds of model and plain (up to 48 in all)" in lines
    assert "model 2800.0/3400.0/2700.0/2900.0/3450.0/2400.0" in lines

    # the schedule: rounds added after the first four hold two blocks each, switch then measured step
    assert policy_trial.length(cleared) == 4 * 2 * 2 + 2 * 2 * 2
    assert [policy_trial.round_at(cleared, s) for s in (15, 16, 19, 20, 23, 24)] == [3, 4, 4, 5, 5, None]
    assert [s for s in range(16, 24) if policy_trial.counted(cleared, s)] == [17, 19, 21, 23]
    assert policy_trial.candidate_at(cleared, 24) is None

    # a verdict taken late (past the step where the added round would start) adds none: plain stands
    late = policy_trial.verdict(trial, {}, None, torch.device("cpu"), now=policy_trial.length(trial) + 1)
    assert late["chosen"] == "model" and late["rounds"] == 4  # nothing measured: the model's choice
    two_rounds = _one_bucket_trial(monkeypatch, trial_steps=2)  # with two rounds, only a gain in both is clear
    both = _scripted_verdict(two_rounds, {"model": [2.0, 2.0], "plain": [3.0, 3.0]})
    assert both["chosen"] == "model" and both["rounds"] == 2
    one = _scripted_verdict(two_rounds, {"model": [2.0, 3.1, 2.0, 2.0], "plain": [3.0] * 4})
    assert one["chosen"] == "model" and one["rounds"] == 4  # two rounds added: every round but one by 33%


TWO_CODECS = ("plain", "allgather", "two-phase")


def test_once_compression_is_taken_the_runner_up_replaces_the_challenger_only_where_clearly_quicker(monkeypatch):
    """Two compressed candidates often lie within a step's scatter of each other: the challenger (the smallest median
    ratio to plain) stands unless the runner-up is clearly quicker than it, by the rule that guards plain; a close
    call between them adds rounds of the two alone, after any rounds the challenger needed against plain (which hold
    the runner-up too, while its gain over plain is still possible)."""
    trial = _one_bucket_trial(monkeypatch, options=TWO_CODECS)
    assert trial["names"] == ["model", "plain", "two-phase"]
    plain = [3.0] * 4
    slower = _scripted_verdict(trial, {"model": [2.0, 2.1, 2.2, 2.0], "plain": plain,
                                       "two-phase": [2.5, 2.6, 2.4, 2.3]})
    assert (slower["challenger"], slower["runner_up"], slower["chosen"], slower["rounds"]) == \
        ("model", "two-phase", "model", 4)  # the runner-up slower in every round: no round added
    alike = _scripted_verdict(trial, {"model": [2.0] * 4, "plain": plain, "two-phase": [2.0] * 4})
    assert alike["chosen"] == "model" and alike["rounds"] == 4  # no gain over 2% possible: the challenger stands

    # ratios to plain 0.93, 1.06, 0.87, 0.88 (model) against 0.97, 1.03, 0.90, 0.88 (two-phase): neither gain is clear
    # nor ruled out: rounds of the three, until the model's choice is clearly quicker than plain after two (two-phase
    # not: 1.03 and 0.8 in them); then two-phase's ratios to it (1.04, 0.97, 1.04, 1.0, 1.15, 0.89) neither show nor
    # rule out a gain, until two-phase's 26% in four rounds of the two alone makes it clear
    model, plain = [2.8, 3.4, 2.7, 2.9], [3.0, 3.2, 3.1, 3.3]
    both = _scripted_verdict(trial, {"model": model + [2.7] * 6, "plain": plain + [3.0] * 2,
                                     "two-phase": [2.9, 3.3, 2.8, 2.9, 3.1, 2.4] + [2.0] * 4})
    assert (both["challenger"], both["runner_up"], both["chosen"], both["rounds"]) == ("model", "two-phase",
                                                                                       "two-phase", 10)
    assert [sorted(order) for order in both["order"][4:]] == [["model", "plain", "two-phase"]] * 2 + \
        [["model", "two-phase"]] * 4
    assert both["round_step_s"]["plain"] == plain + [3.0, 3.0] + [None] * 4
    assert "a close call: 6 more rounds: 2 of model, two-phase and plain, then 4 of model and two-phase alone " \
           "(up to 48 in all)" in "\n".join(policy_trial.describe(both))
    # two-phase's ratios to the model's choice scatter (1.3 and 0.75, or 0.65, in turn) to the last round: the
    # quicker in the mean of all 48 stands (1.02: the model's choice; 0.98: two-phase)
    for later, chosen in (([2.6, 1.5] * 22, "model"), ([2.6, 1.3] * 22, "two-phase")):
        capped = _scripted_verdict(trial, {"model": [2.0, 2.1, 2.2, 2.0] + [2.0] * 44, "plain": [3.0] * 4,
                                           "two-phase": [2.1, 2.0, 2.3, 1.9] + later})
        assert capped["chosen"] == chosen and capped["rounds"] == capped["max_rounds"] == 48
    # the same close call (two-phase's ratios to the model's choice 1.05, 0.95, 1.05, 0.95: a mean under 1), but a
    # verdict taken late adds no round: with no round of the two alone run, the challenger stands
    first = {"model": [2.0, 2.1, 2.2, 2.0], "plain": [3.0] * 4, "two-phase": [2.1, 2.0, 2.3, 1.9]}
    steps = {}
    for s in filter(lambda s: policy_trial.counted(trial, s), range(policy_trial.length(trial))):
        scripted = first[policy_trial.candidate_at(trial, s)][policy_trial.round_at(trial, s)]
        steps.update({s - 1: SWITCH_SECONDS, s: scripted})
    late = policy_trial.verdict(trial, steps, None, torch.device("cpu"), now=policy_trial.length(trial) + 1)
    assert (late["runner_up"], late["chosen"], late["rounds"]) == ("two-phase", "model", 4)
    # where plain stands, no runner-up is looked for
    kept_plain = _scripted_verdict(trial, {"model": [3.3] * 4, "plain": [3.0] * 4, "two-phase": [3.2] * 4})
    assert kept_plain["chosen"] == "plain" and kept_plain["runner_up"] is None and kept_plain["rounds"] == 4


def test_added_rounds_hold_the_candidates_still_in_the_running(monkeypatch):
    """A close call's added rounds hold plain and every compressed candidate whose gain is neither clear nor ruled out,
    so a challenger picked from a few noisy rounds is not the only one tried further: with three candidates and two
    first rounds, the third holds all three (nothing can be ruled out from two rounds), the fourth only the model's
    choice and plain (two-phase, 17% slower in three rounds, is out): each step's round, candidate and count."""
    monkeypatch.setattr(policy_trial.dist, "get_world_size", lambda group=None: 1)
    decision = {"step": 10, "options": ["plain", "allgather", "two-phase"], "buckets": [{"choice": "allgather"}],
                "predicted_exposed_s": {"policy": 0.1, "plain": 0.2, "allgather": 0.1, "two-phase": 0.3}}
    trial = policy_trial.plan(decision, 2, plain_step_s=None)
    assert trial["names"] == ["model", "plain", "two-phase"] and policy_trial.length(trial) == 12
    seconds = {"model": 2.0, "plain": 3.0, "two-phase": 3.5}
    steps = {s: 100.0 for s in range(10, 22)}
    for s in range(10, 22):
        if policy_trial.counted(trial, s):
            steps[s] = seconds[policy_trial.candidate_at(trial, s)] + (1.2 if policy_trial.round_at(trial, s) == 1 and
                                                                       policy_trial.candidate_at(trial, s) == "model"
                                                                       else 0.0)
    close_call = policy_trial.verdict(trial, steps, None, torch.device("cpu"), now=22)
    assert close_call["chosen"] is None and close_call["rounds"] == 3 and close_call["challenger"] == "model"
    assert policy_trial.length(close_call) == 18 and sorted(close_call["order"][2]) == ["model", "plain", "two-phase"]
    assert [policy_trial.round_at(close_call, s) for s in (9, 10, 15, 16, 21, 22, 27, 28)] == \
        [None, 0, 0, 1, 1, 2, 2, None]
    assert [s for s in range(10, 28) if policy_trial.counted(close_call, s)] == list(range(11, 28, 2))
    added = [policy_trial.candidate_at(close_call, s) for s in range(22, 28)]
    assert added[0::2] == added[1::2] and sorted(added[0::2]) == ["model", "plain", "two-phase"]
    assert close_call["round_step_s"] == {"model": [2.0, 3.2], "plain": [3.0, 3.0], "two-phase": [3.5, 3.5]}
    steps.update({s: 100.0 for s in range(22, 28)})
    steps.update({s: seconds[policy_trial.candidate_at(close_call, s)] for s in (23, 25, 27)})
    again = policy_trial.verdict(close_call, steps, None, torch.device("cpu"), now=28)
    assert again["round_step_s"] == {"model": [2.0, 3.2, 2.0], "plain": [3.0, 3.0, 3.0],
                                     "two-phase": [3.5, 3.5, 3.5]}
    assert again["chosen"] is None and again["rounds"] == 4  # the model's ratios 0.67, 1.07, 0.67: not clear yet
    assert sorted(again["order"][3]) == ["model", "plain"] and policy_trial.length(again) == 22
    assert [policy_trial.candidate_at(again, s) for s in (28, 29, 30, 31)].count("model") == 2


def test_a_trial_planned_by_an_earlier_gradcomp_runs_its_blocks_in_the_shortlists_order_and_adds_no_round(monkeypatch):
    """A trial saved before the shuffle and the close calls (blocks of 3, no order, no round limit) still runs."""
    trial = _one_bucket_trial(monkeypatch)
    old = {key: value for key, value in trial.items() if key not in ("order", "first_rounds", "max_rounds",
                                                                     "challenger", "runner_up")}
    old.update(block=3, rounds=2)
    assert [policy_trial.candidate_at(old, s) for s in range(13)] == ["model"] * 3 + ["plain"] * 3 + \
        ["model"] * 3 + ["plain"] * 3 + [None]
    verdict = _scripted_verdict(old, {"model": [2.7, 2.7, 3.3, 3.3], "plain": [3.0, 3.0, 3.2, 3.2]})
    assert verdict["chosen"] == "plain" and verdict["rounds"] == 2  # a close call, but no room for more rounds
    assert "in the shortlist's order" in "\n".join(policy_trial.describe(verdict))


def test_the_verdict_counts_only_the_rounds_measured_whole(monkeypatch):
    """A run resumed during the trial measured only its later steps: the rounds it has whole decide; with none, the
    model's choice stands."""
    trial = _one_bucket_trial(monkeypatch)
    # rounds 0 and 1 lost the model its gain; only rounds 2 and 3 were measured whole
    resumed = _scripted_verdict(trial, {"model": [None, 9.0, 2.0, 2.1], "plain": [1.0, None, 3.0, 3.0]})
    assert resumed["chosen"] == "model" and resumed["round_step_s"]["model"] == [None, 9.0, 2.0, 2.1]
    nothing_whole = _scripted_verdict(trial, {"model": [None, 2.0, None, 2.0], "plain": [3.0, None, 3.0, None]})
    assert nothing_whole["chosen"] == "model"
    # a resumed run's first step, measured without its switch (its plans laid out anew in it), does not count
    first_counted = next(s for s in range(policy_trial.length(trial)) if policy_trial.counted(trial, s))
    alone = policy_trial.verdict(trial, {first_counted: 1.0}, None, torch.device("cpu"))
    assert alone["round_step_s"][policy_trial.candidate_at(trial, first_counted)][0] is None

    # a close call: its first verdict (in step 16, round 4's first switch) combined rounds 0-3 and added round 4; a run
    # resumed after step 16 sees steps 17-19, so round 4 is not whole there (step 17's switch was not seen), but the
    # saved rounds still count: the same close call, and one more round
    first_four = {s: seconds for s, seconds in zip(range(16), [100.0, 2.8, 100.0, 3.0, 100.0, 3.4, 100.0, 3.2,
                                                               100.0, 2.7, 100.0, 3.1, 100.0, 2.9, 100.0, 3.3])}
    trial["order"] = [["model", "plain"]] * 4  # unshuffled, to script the steps above
    close_call = policy_trial.verdict(trial, first_four, None, torch.device("cpu"))
    assert close_call["chosen"] is None and close_call["rounds"] == 5
    round_four = {17: 2.7, 18: 100.0, 19: 2.7 if policy_trial.candidate_at(close_call, 19) == "model" else 3.0}
    resumed_late = policy_trial.verdict(close_call, round_four, None, torch.device("cpu"), now=20)
    kept = resumed_late["round_step_s"]
    assert kept["model"][:4] == [2.8, 3.4, 2.7, 2.9] and kept["plain"][:4] == [3.0, 3.2, 3.1, 3.3]
    assert [kept["model"][4], kept["plain"][4]].count(None) == 1  # only step 19's candidate measured in round 4
    assert resumed_late["chosen"] is None and resumed_late["rounds"] == 6
    forgot = policy_trial.verdict({**close_call, "round_step_s": None}, round_four, None, torch.device("cpu"), now=20)
    assert forgot["round_step_s"]["model"][:4] == [None] * 4 and forgot["chosen"] == "model"  # nothing whole


def test_the_verdict_guards_plain_where_the_models_own_choice_is_plain_for_every_bucket(monkeypatch):
    """The shortlist lists all-plain once, as "model" where that is the model's choice; the rule still holds."""
    monkeypatch.setattr(policy_trial.dist, "get_world_size", lambda group=None: 1)
    decision = {"step": 0, "options": ["plain", "allgather"], "buckets": [{"choice": "plain"}] * 2,
                "predicted_exposed_s": {"policy": 0.2, "plain": 0.2, "allgather": 0.25}}
    trial = policy_trial.plan(decision, 4, plain_step_s=None)
    assert trial["names"] == ["model", "allgather"] and policy_trial.all_plain(trial) == "model"

    def verdict(allgather_steps, plain_steps=(3.0, 3.2, 3.1, 3.3)):
        return _scripted_verdict(trial, {"model": list(plain_steps), "allgather": allgather_steps})

    # median 2.85 against 3.15, one round lost: a close call; seven more rounds with allgather 10% slower end it
    assert verdict([2.8, 3.4, 2.7, 2.9] + [3.3] * 7, [3.0, 3.2, 3.1, 3.3] + [3.0] * 7)["chosen"] == "model"
    assert verdict([2.96, 3.15, 3.05, 3.25])["chosen"] == "model"  # quicker every round, under 2%
    assert verdict([2.0, 2.9, 2.1, 2.2])["chosen"] == "allgather"  # quicker every round, by 10-33%


def test_without_plain_on_the_shortlist_the_smallest_median_ratio_to_the_models_choice_is_the_challenger(monkeypatch):
    """With no plain to guard, the challenger is taken at once; only a runner-up clearly quicker replaces it."""
    monkeypatch.setattr(policy_trial.dist, "get_world_size", lambda group=None: 1)
    decision = {"step": 0, "options": ["allgather", "two-phase"], "buckets": [{"choice": "allgather"},
                                                                              {"choice": "two-phase"}],
                "predicted_exposed_s": {"policy": 0.1, "allgather": 0.2, "two-phase": 0.2}}
    trial = policy_trial.plan(decision, 4, plain_step_s=None)
    assert trial["names"] == ["model", "allgather", "two-phase"] and policy_trial.all_plain(trial) is None
    lost_a_round = _scripted_verdict(trial, {"model": [3.0] * 4, "allgather": [3.2, 3.5, 3.1, 3.3],
                                             "two-phase": [2.0, 3.1, 2.0, 2.0]})
    assert lost_a_round["chosen"] == "two-phase" and lost_a_round["rounds"] == 4  # the runner-up, model, lost 3 of 4
    # two-phase's ratios to the model's choice (0.93, 1.1, 0.9, 0.97) make it the challenger, but not clearly: rounds
    # of the two alone, until the model's choice, 17% quicker in each, is clearly the quicker
    close = _scripted_verdict(trial, {"model": [3.0] * 4 + [2.5] * 5, "allgather": [3.2, 3.5, 3.1, 3.3],
                                      "two-phase": [2.8, 3.3, 2.7, 2.9] + [3.0] * 5})
    assert close["challenger"] == "two-phase" and close["runner_up"] == "model"
    assert close["chosen"] == "model" and close["rounds"] == 9
    assert [sorted(order) for order in close["order"][4:]] == [["model", "two-phase"]] * 5


def run_trial(trial_steps, steps, trial_seconds, world=2):
    """Every rank's results of `steps` signsgd steps under policy="time" whose trial's measured steps take
    trial_seconds (policy_scenarios.scripted_trial), and the trial that rank 0 decided."""
    results = unwrap(run_ranks(scenarios.recorded, world, ("signsgd", {"trial_steps": trial_steps}, steps,
                                                           [["two-phase", "plain"]], None, trial_seconds), timeout=300))
    return results, results[0]["stats"]["decision"]["trial"]


def assert_the_trial_was_followed(results, steps, world):
    """Every rank took the same decision; each step from it went under its trial candidate, then the chosen one; and
    the switches lost nothing."""
    decision = results[0]["stats"]["decision"]
    trial = decision["trial"]
    assert all(r["stats"]["decision"] == decision for r in results)
    indices = [b["index"] for b in decision["buckets"]]
    assert len(indices) >= 2
    for step in range(decision["step"], steps):
        name = policy_trial.candidate_at(trial, step) or trial["chosen"]
        assert results[0]["schemes_per_step"][step] == dict(zip(indices, trial["choices"][name])), step
    assert_nothing_lost(results, steps, replicas=world)


def test_the_trial_runs_each_candidate_in_turn_and_every_rank_keeps_the_fastest_for_the_slowest_rank():
    """Each step of the trial goes under its candidate; the verdict takes each candidate's time per round, the
    largest over the ranks, as a ratio to plain's: the same on every rank, though rank 0 alone would keep plain; after
    it, every step goes that way; and the switches lost nothing."""
    world, steps = 2, 22
    results, trial = run_trial(2, steps, TRIAL_SECONDS)
    assert trial["names"] == ["model", "plain", "allgather", "two-phase"] and trial["block"] == 2
    assert trial["measured_step_s"] == {"model": 2.5, "plain": 3.0, "allgather": 2.0, "two-phase": 2.4}
    assert all(None not in seconds for seconds in trial["round_step_s"].values())  # every round measured whole
    assert trial["chosen"] == "allgather"
    assert_the_trial_was_followed(results, steps, world)
    assert "chosen: allgather" in results[0]["explain"]
    loads = results[0]["stats"]["decision"]["in_step"]["loads"]  # the compressed candidates' collectives, timed
    assert loads.keys() == {"allgather", "two-phase"} and loads["allgather"].keys() == {"all-gather", "encode"}
    assert loads["two-phase"].keys() == {"all-to-all", "all-gather", "encode"}
    assert min(load for kinds in loads.values() for kind, load in kinds.items() if kind != "encode") > 0
    buckets = len(results[0]["stats"]["decision"]["buckets"])
    for kinds in loads.values():  # the plans' launches, timed on these CPU ranks, bucket by bucket
        assert len(kinds["encode"]) == buckets and all(load > 0 for load in kinds["encode"] if load is not None)
        assert any(load is not None for load in kinds["encode"])
    low, high = time_policy.LOAD_BOUNDS  # plain's load fitted to the trial's plain steps' window
    assert low <= results[0]["stats"]["decision"]["in_step"]["plain_load"] <= high
    assert "in the trial's steps, the collectives against their probes" in results[0]["explain"]


# Per rank, per round: allgather's gain over plain (3.0 s) is lost in round 1, so two rounds do not settle it; the
# rounds added for the close call make it clear after round 4: the first holds every candidate (none can be ruled out
# from two rounds), the next two allgather and plain alone (the others, 13% and 17% slower than plain in three
# rounds, are out). Rank 1 is the slower. Once allgather is taken, no runner-up is left in the running.
CLOSE_CALL_SECONDS = {"model": [3.4, 3.4], "plain": [3.0, 3.0], "two-phase": [3.5, 3.5],
                      "allgather": [[2.0, 3.2, 2.0, 2.1], [2.1, 3.3, 2.1, 2.2]]}


def test_a_close_call_runs_its_added_rounds_on_every_rank_alike_and_loses_nothing():
    world, steps = 2, 40
    results, trial = run_trial(2, steps, CLOSE_CALL_SECONDS)
    assert trial["names"] == ["model", "plain", "allgather", "two-phase"]
    assert trial["rounds"] == 5 and trial["first_rounds"] == 2 and trial["challenger"] == "allgather"
    assert trial["runner_up"] is None
    assert trial["round_step_s"]["allgather"] == [2.1, 3.3, 2.1, 2.2, 2.2]  # the slower rank's
    assert trial["round_step_s"]["two-phase"] == [3.5, 3.5, 3.5, None, None]  # out after the first added round
    assert trial["chosen"] == "allgather" and policy_trial.candidate_at(trial, steps - 1) is None  # the run went on
    assert_the_trial_was_followed(results, steps, world)
    assert "a close call: 3 more rounds: 1 of model, allgather, two-phase and plain, then 2 of allgather and plain " \
           "alone (up to 24 in all)" in results[0]["explain"]


# Per rank, per round, 3 rounds: allgather and two-phase each lose round 1 to plain, so neither gain over plain is
# clear; two rounds of the two and plain (the model's choice, 3% slower than plain in three rounds, is out) make both
# clear, and allgather, the smaller median ratio (0.67 against 0.7), the challenger; two-phase, the runner-up, lost
# rounds 0, 1, 3 and 4 to it and won round 2 (the largest of the ranks' times): rounds of the two alone, until
# two-phase's 30% makes it clearly the quicker. Each rank is the slower somewhere.
RUNNER_UP_SECONDS = {"model": [3.1, 3.1], "plain": [3.0, 3.0],
                     "allgather": [[1.9, 3.2, 2.1, 2.0], [2.0, 3.1, 2.0, 1.9]],
                     "two-phase": [[2.2, 3.2, 1.9, 2.1, 2.1, 1.4], [2.1, 3.3, 1.8, 2.0, 2.0, 1.3]]}


def test_a_close_call_between_the_challenger_and_the_runner_up_runs_on_every_rank_alike_and_loses_nothing():
    world, steps = 2, 60
    results, trial = run_trial(3, steps, RUNNER_UP_SECONDS)
    assert (trial["challenger"], trial["runner_up"], trial["chosen"]) == ("allgather", "two-phase", "two-phase")
    assert [sorted(order) for order in trial["order"][3:]] == [["allgather", "plain", "two-phase"]] * 2 + \
        [["allgather", "two-phase"]] * 4
    assert trial["round_step_s"]["two-phase"] == [2.2, 3.3, 1.9, 2.1, 2.1, 1.4, 1.4, 1.4, 1.4]  # the slower rank's
    assert trial["round_step_s"]["plain"] == [3.0] * 5 + [None] * 4
    assert policy_trial.candidate_at(trial, steps - 1) is None  # the run went past the trial
    assert_the_trial_was_followed(results, steps, world)
    assert "a close call: 6 more rounds: 2 of allgather, two-phase and plain alone, then 4 of allgather and " \
           "two-phase alone (up to 36 in all)" in results[0]["explain"]


def test_a_run_resumed_during_a_close_calls_added_rounds_keeps_the_rounds_combined_before_on_every_rank(tmp_path):
    """Resumed inside a close call, the run keeps the rounds that earlier verdicts combined (saved with the decision);
    the round it resumed in is not whole there, so it may add one more round than the uninterrupted run, every rank
    alike."""
    world, total, split, spec = 2, 44, 22, "signsgd"
    schedule, options = [["two-phase", "plain"]], {"trial_steps": 2}
    args = (spec, options, total, split, str(tmp_path))
    whole = unwrap(run_ranks(scenarios.resume, world, (*args, "whole", schedule, CLOSE_CALL_SECONDS)))
    first = unwrap(run_ranks(scenarios.resume, world, (*args, "first", schedule, CLOSE_CALL_SECONDS)))
    rest = unwrap(run_ranks(scenarios.resume, world, (*args, "rest", [["plain"]], CLOSE_CALL_SECONDS)))
    saved, uninterrupted = first[0]["decision"]["trial"], whole[0]["decision"]["trial"]
    assert saved["chosen"] is None and saved["rounds"] > saved["first_rounds"]  # saved inside an added round
    assert uninterrupted["chosen"] == "allgather" and uninterrupted["rounds"] == 5
    resumed = rest[0]["decision"]["trial"]
    assert rest[1]["decision"] == rest[0]["decision"] and all(r["choose_calls"] == 0 for r in rest)
    assert resumed["round_step_s"]["allgather"][:2] == [2.1, 3.3]  # combined before the run stopped
    assert resumed["chosen"] == "allgather" and resumed["rounds"] == 6  # the round it resumed in, lost and added
    for a, b in zip(rest[0]["params"], rest[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("split", [7, 8])
def test_a_run_resumed_during_the_trial_follows_its_schedule_bit_for_bit(tmp_path, split):
    """Resumed in a step that sends as the one before (7), or at a switch between the trial's candidates (8): the
    fresh DDP's first bucket holds every parameter, and goes as the saved buckets that make it up under each one's
    new option."""
    world, total, spec = 2, 22, "signsgd"
    schedule, options = [["two-phase", "plain"]], {"trial_steps": 2}
    args = (spec, options, total, split, str(tmp_path))
    whole = unwrap(run_ranks(scenarios.resume, world, (*args, "whole", schedule, TRIAL_SECONDS)))
    unwrap(run_ranks(scenarios.resume, world, (*args, "first", schedule, TRIAL_SECONDS)))
    rest = unwrap(run_ranks(scenarios.resume, world, (*args, "rest", [["plain"]], TRIAL_SECONDS)))
    assert all(r["choose_calls"] == 0 for r in rest)
    assert whole[0]["decision"]["trial"]["chosen"] == rest[0]["decision"]["trial"]["chosen"] == "allgather"
    for r_whole, r_rest in zip(whole, rest):
        for a, b in zip(r_whole["params"], r_rest["params"]):
            assert torch.equal(a, b)
