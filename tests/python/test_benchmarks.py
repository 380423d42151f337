"""Smoke tests: each benchmark runs in its quick or tiny mode and writes what it promises."""

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import gradcomp.trial as policy_trial
import ddp_scenarios
from benchmark_modules import BENCHMARKS, load_benchmark
from ddp_harness import run_ranks, unwrap

SCRIPT = BENCHMARKS / "kernels.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Why the benchmarks cannot give each rank a shaped link of its own here (not root; a container's root without
# the capabilities; no iproute2), or None.
SHAPING_PROBLEM = (load_benchmark("bench_common.py").shaping_problem() if BENCHMARKS.exists()
                   else "benchmarks/ is not part of this checkout")
needs_shaping = pytest.mark.skipif(SHAPING_PROBLEM is not None, reason=f"shaped links: {SHAPING_PROBLEM}")


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ is not part of this checkout")
def test_kernel_benchmark_quick_mode(tmp_path):
    command = [sys.executable, str(SCRIPT), "--quick", "--sizes", "1", "--out-dir", str(tmp_path), "--tag", "smoke",
               "--codecs", "signsgd", "topk:ratio=0.01", "powersgd:rank=2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "smoke.json").read_text())
    rows = {row["codec"]: row for row in document["results"]}
    assert set(rows) == {"signsgd", "topk:ratio=0.01", "powersgd:rank=2"}
    for row in rows.values():
        assert row["encode_gbps"] > 0 and row["copy_gbps"] > 0
    assert rows["topk:ratio=0.01"]["wire_bytes"] < rows["signsgd"]["wire_bytes"]
    assert document["machine"]["gradcomp_cpu_variant"] in ("base", "avx2", "avx512")
    assert (tmp_path / "smoke.csv").read_text().count("\n") == 4  # header + 3 rows
    assert (tmp_path / "smoke.png").stat().st_size > 1000
    assert "signsgd" in result.stdout


def run_script(*args, timeout=900):
    result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.needs("mnist1d")
def test_accuracy_vs_ratio_quick_mode_writes_and_merges(tmp_path):
    script = BENCHMARKS / "accuracy_vs_ratio.py"
    run_script(script, "--quick", "--epochs", "1", "--codecs", "none", "topk:ratio=0.1", "--out", tmp_path)
    # A second invocation with another codec keeps the first one's runs.
    out = run_script(script, "--quick", "--epochs", "1", "--codecs", "signsgd:error_feedback=false", "--out", tmp_path)
    report = json.loads((tmp_path / "accuracy_vs_ratio_quick.json").read_text())
    rows = {row["spec"]: row for row in report["summary"]}
    assert set(rows) == {"none", "topk:ratio=0.1", "signsgd:error_feedback=false"}
    assert rows["none"]["ratio"] == 1.0 and rows["none"]["family"] == "none"
    assert rows["topk:ratio=0.1"]["ratio"] > 3 and rows["signsgd:error_feedback=false"]["family"] == "signsgd, no EF"
    for row in rows.values():
        assert row["dataset"] == "mnist1d" and row["seeds"] == 1
        assert 10 < row["acc_mean"] <= 100 and row["acc_min"] <= row["acc_mean"] <= row["acc_max"]
    assert len(report["runs"]) == 3 and report["machine"]["cores"] >= 1
    assert report["machine"]["cpu_variant"] in ("base", "avx2", "avx512")
    assert (tmp_path / "accuracy_vs_ratio_quick.csv").read_text().count("\n") == 4
    assert (tmp_path / "accuracy_vs_ratio_quick.png").read_bytes()[:8] == PNG_MAGIC
    assert "signsgd:error_feedback=false" in out


def test_network_tiny_mode(tmp_path):
    out = run_script(BENCHMARKS / "network.py", "--tiny", "--hooks", "allreduce (plain DDP)",
                     "no communication (limit)", "torch-powersgd", "topk:ratio=0.01", "powersgd:rank=2",
                     "--out", tmp_path)
    report = json.loads((tmp_path / "network_tiny.json").read_text())
    links = {row["link"] for row in report["rows"]}
    assert links == ({"1gbit"} if SHAPING_PROBLEM is None else {"unshaped loopback"}), out
    rows = {row["hook"]: row for row in report["rows"]}
    assert set(rows) == {"allreduce (plain DDP)", "no communication (limit)", "torch powerSGD_hook rank 2, one bucket",
                         "gradcomp topk:ratio=0.01", "gradcomp powersgd:rank=2", "gradcomp powersgd:rank=2, one bucket"}
    assert rows["no communication (limit)"]["vs_limit"] == 1.0
    for row in rows.values():
        assert row["median_ms"] > 0 and row["min_ms"] <= row["median_ms"] <= row["max_ms"]
    assert 0 < rows["gradcomp topk:ratio=0.01"]["wire_mb_per_step"] < report["gradient_bytes"] / 1e6 / 10
    assert (tmp_path / "network_tiny.csv").read_text().count("\n") == 7
    assert (tmp_path / "network_tiny.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("script", ["network.py", "scaling.py", "hierarchical.py", "policy.py", "fsdp_bytes.py",
                                    "probe_start.py"])
def test_network_benchmarks_without_root_explain_and_exit_cleanly(script, tmp_path, monkeypatch, capsys):
    benchmark = load_benchmark(script)
    monkeypatch.setattr(benchmark.os, "geteuid", lambda: 1000)
    assert benchmark.main(["--out", str(tmp_path)]) == 0
    assert "needs root" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


def test_shaping_is_tried_not_assumed_from_root(monkeypatch):
    """A container's root can lack the capabilities for network namespaces: shaping_problem makes a shaped namespace
    to see, names the step the machine refused and what it said, and removes what it made."""
    common = load_benchmark("bench_common.py")
    monkeypatch.setattr(common.os, "geteuid", lambda: 0)
    monkeypatch.setattr(common.shutil, "which", lambda tool: f"/sbin/{tool}")
    calls, refuse = [], ["ip", "link", "add"]

    def run(command, check=False, **_):
        command = list(command)
        calls.append(command)
        if command[:3] == refuse and check:
            raise subprocess.CalledProcessError(2, command, "", "RTNETLINK answers: Operation not permitted")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(common.subprocess, "run", run)
    problem = common.shaping_problem()
    assert "refused `ip link add" in problem and "Operation not permitted" in problem, problem
    refused_at = next(i for i, c in enumerate(calls) if c[:3] == refuse)
    assert {tuple(c[:3]) for c in calls[refused_at + 1:]} == {("ip", "link", "del"), ("ip", "netns", "del")}
    calls.clear()
    refuse = None
    assert common.shaping_problem() is None
    assert any(c[:3] == ["ip", "netns", "exec"] and "tbf" in c for c in calls)  # the rate limit was tried too


def test_the_token_buckets_depth_reaches_both_ends_of_every_shaped_link(monkeypatch):
    """--burst sets tc tbf's burst on what a namespace sends and on what it receives; without it, the 128 KB that
    every committed run used."""
    common = load_benchmark("bench_common.py")
    calls = []
    monkeypatch.setattr(common.subprocess, "run",
                        lambda command, **_: calls.append(list(command)) or subprocess.CompletedProcess(command, 0))
    monkeypatch.setattr(common, "exit_on_sigterm", lambda: None)
    for burst, expected in ((None, "128kb"), ("16kb", "16kb")):
        calls.clear()
        chosen = {} if burst is None else {"burst": burst}
        with common.Namespaces("gct", 2, "10.1.2", "100mbit", **chosen):
            pass
        shaped = [c for c in calls if "tbf" in c]
        assert len(shaped) == 4, shaped  # 2 namespaces x (eth0 inside, the veth's host end)
        assert all(c[c.index("burst") + 1] == expected and c[c.index("rate") + 1] == "100mbit" for c in shaped)
    policy = load_benchmark("policy.py")
    assert policy.parse_args([]).burst == "128kb" and policy.parse_args(["--burst", "16kb"]).burst == "16kb"
    for bad in ("lots", "0", "16 kb"):
        with pytest.raises(SystemExit):
            policy.parse_args(["--burst", bad])


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers are the main thread's")
def test_a_terminated_benchmark_removes_its_namespaces(monkeypatch):
    """A kill (SIGTERM: a job's time limit, a user stopping a run) used to end the process on the spot, its
    namespaces and bridge left behind; inside Namespaces it raises SystemExit, the with-block removes what it made,
    and the handler before it is back after."""
    common = load_benchmark("bench_common.py")
    calls = []

    def run(command, check=False, **_):
        calls.append(list(command))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(common.subprocess, "run", run)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended:
        with common.Namespaces("gct", 2, "10.254.253", "1gbit") as links:
            made = len(calls)
            assert signal.getsignal(signal.SIGTERM) is not before  # else the kill below ends pytest itself
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode: never reached
    assert ended.value.code == 128 + signal.SIGTERM
    removed = calls[made:]
    for made_there in (["ip", "netns", "del", links.namespace(0)], ["ip", "netns", "del", links.namespace(1)],
                       ["ip", "link", "del", links.bridge]):
        assert made_there in removed
    assert signal.getsignal(signal.SIGTERM) == before


@needs_shaping
def test_scaling_quick_mode_counts_the_bytes_each_rank_sends(tmp_path):
    out = run_script(BENCHMARKS / "scaling.py", "--quick", "--out", tmp_path)
    report = json.loads((tmp_path / "scaling_quick.json").read_text())
    rows = {(row["link"], row["world"], row["config"]): row for row in report["rows"]}
    assert {key[:2] for key in rows} == {("unshaped", 2), ("unshaped", 3), ("1gbit", 2), ("1gbit", 3)}, out
    for world in (2, 3):
        plain = rows[("unshaped", world, "plain DDP")]
        ring = 2 * (world - 1) * report["gradient_bytes"] / world
        assert ring < plain["tx_bytes_per_step"] < 1.15 * ring  # the ring allreduce, plus TCP/IP headers
        for config in ("signsgd two-phase", "signsgd allgather", "topk:ratio=0.01 auto"):
            row = rows[("unshaped", world, config)]
            assert 0.9 < row["tx_vs_stats"] < 1.1, row  # the kernel's counters agree with gradcomp's stats
        assert rows[("1gbit", world, "no communication (limit)")]["vs_limit"] == 1.0
    # From 3 ranks on, two-phase sends less than allgather, and auto picked it.
    assert rows[("unshaped", 3, "signsgd two-phase")]["tx_bytes_per_step"] < \
        0.8 * rows[("unshaped", 3, "signsgd allgather")]["tx_bytes_per_step"]
    assert rows[("unshaped", 3, "topk:ratio=0.01 auto")]["schemes"] == {"two-phase": len(report["bucket_numels"])}
    assert {m["world"] for m in report["model"]} == {64, 128, 256, 512, 1024}
    assert (tmp_path / "scaling_quick.png").read_bytes()[:8] == PNG_MAGIC



@needs_shaping
def test_hierarchical_quick_mode_counts_the_bytes_each_node_sends(tmp_path):
    out = run_script(BENCHMARKS / "hierarchical.py", "--quick", "--out", tmp_path)
    report = json.loads((tmp_path / "hierarchical_quick.json").read_text())
    rows = {(row["link"], row["config"]): row for row in report["rows"]}
    assert {(row["nodes"], row["node_size"]) for row in report["rows"]} == {(2, 2)}, out
    plain = rows[("unshaped", "plain DDP")]
    ring = 2 * 3 * report["gradient_bytes"] / 4  # plain DDP's ring crosses each node's link once per ring step
    assert ring < plain["node_tx_bytes_per_step"] < 1.15 * ring
    for spec in ("signsgd", "topk:ratio=0.01"):
        flat, hierarchical = rows[("unshaped", f"{spec} flat")], rows[("unshaped", f"{spec} hierarchical")]
        for row in (flat, hierarchical):
            assert 0.9 < row["tx_vs_stats"] < 1.1, row  # the kernel's counters agree with the stats
        assert hierarchical["schemes"] == {"hierarchical": 2} and "hierarchical" not in flat["schemes"]
        assert hierarchical["saving_vs_plain_measured"] > 1.5 * flat["saving_vs_plain_measured"], (flat, hierarchical)
        assert rows[("1gbit", f"{spec} hierarchical")]["vs_limit"] > 1
    assert (tmp_path / "hierarchical_quick.png").read_bytes()[:8] == PNG_MAGIC


def test_policy_times_steps_one_of_each_in_turn_or_in_blocks_of_a_configurations_own():
    policy = load_benchmark("policy.py")
    assert policy.turns(6, 1) == [1] * 6  # the default: one timed step of each configuration in turn
    assert policy.turns(7, 3) == [3, 3, 1]  # --block 3: 7 timed steps each, 3 in a row (after one untimed) per turn
    assert policy.parse_args(["--block", "4"]).block == 4
    with pytest.raises(SystemExit):
        policy.parse_args(["--block", "0"])
    assert policy.parse_args(["--block", "4", "--no-barrier"]).no_barrier  # a barrier per block, none per step
    with pytest.raises(SystemExit):
        policy.parse_args(["--no-barrier"])  # one timed step per turn: nothing to run back to back


@needs_shaping
def test_policy_quick_mode_times_every_option_and_the_policy(tmp_path):
    out = run_script(BENCHMARKS / "policy.py", "--quick", "--trial-timings", "--out", tmp_path)
    report = json.loads((tmp_path / "policy_quick.json").read_text())
    rows = {(row["link"], row["codec"], row["config"]): row for row in report["rows"]}
    for link in ("1gbit", "unshaped"):
        for spec in ("signsgd", "topk:ratio=0.01"):
            configs = {key[2] for key in rows if key[:2] == (link, spec)}
            assert configs == {"plain DDP", f"{spec} allgather", f"{spec} two-phase", f"{spec} policy"}, out
            policy = rows[(link, spec, f"{spec} policy")]
            assert len(policy["choices"]) == report["rounds"]  # the schemes it chose, each round
            assert all(set(c) <= {"plain", "allgather", "two-phase"} for c in policy["choices"])
            # timed after its trial: the candidate that stood each round (None where none ran)
            assert len(policy["trial"]) == len(policy["trial_rounds"]) == report["rounds"]
            # the rounds its trial ran (close calls add some), None where there was no trial
            assert [r is None for r in policy["trial_rounds"]] == [t is None for t in policy["trial"]]
            assert all(r is None or r >= 2 for r in policy["trial_rounds"])
            assert set(policy["trial"]) <= {None, "model", "plain", "allgather", "two-phase"}
            assert policy["predicted_exposed_ms"] is not None and policy["measured_exposed_ms"] >= 0
            # after its trial, and as decided (the same where no trial ran)
            assert policy["predicted_as_decided_ms"] is not None
            if policy["trial"] == [None] * report["rounds"]:
                assert policy["predicted_as_decided_ms"] == policy["predicted_exposed_ms"]
            assert 0 <= policy["spread"] and policy["vs_limit"] > 0
            assert policy["spread_vs_fastest_fixed"] >= 0 and policy["spread_vs_plain"] >= 0
    # 1 Gbit/s: plain DDP's 9.5 MB per step cannot hide behind the MLP's little backward
    assert rows[("1gbit", "signsgd", "plain DDP")]["measured_exposed_ms"] > 10
    assert report["summary"]["cells"] == 4
    for run in report["runs"]:  # --trial-timings: every rank's counted trial steps, as the verdict read them
        trial = (run.get("decision") or {}).get("trial")
        if trial is None:
            assert "trial_timings" not in run and "trial_launches" not in run
            continue
        assert len(run["trial_timings"]) == run["world"] == 2
        trial_steps = set(range(trial["start"], trial["start"] + policy_trial.length(trial)))  # close calls' too
        for steps in run["trial_timings"]:
            assert steps and {s["step"] for s in steps} <= trial_steps
            for step in steps:
                assert step["calls"][0][1] == 0 and all(call[2] >= call[1] for call in step["calls"])
                for option, kind, nbytes, launched, completed in step["collectives"]:
                    assert option in run["decision"]["options"] and kind in ("allreduce", "all-gather", "all-to-all")
                    assert nbytes > 0 and completed >= launched
        assert len(run["trial_launches"]) == 2  # per rank, each plan's launch (the encodes' loads)
        indices = {bucket["index"] for bucket in run["decision"]["buckets"]}
        for launches in run["trial_launches"]:
            assert set(launches) <= set(run["decision"]["options"]) - {"plain"}
            assert all(index in indices and seconds > 0 for seconds_of in launches.values()
                       for index, seconds in seconds_of)
    # --replot takes the predictions after the trial again from those timings: what the verdict took on the ranks
    run_script(BENCHMARKS / "policy.py", "--quick", "--replot", "--out", tmp_path)
    again = json.loads((tmp_path / "policy_quick.json").read_text())
    assert [row["predicted_exposed_ms"] for row in again["rows"]] == \
        [row["predicted_exposed_ms"] and pytest.approx(row["predicted_exposed_ms"], rel=1e-9) for row in report["rows"]]
    assert [{k: v for k, v in row.items() if k != "predicted_exposed_ms"} for row in again["rows"]] == \
        [{k: v for k, v in row.items() if k != "predicted_exposed_ms"} for row in report["rows"]]
    assert report["summary"]["predictions"] == report["summary"]["predictions_as_decided"] > 0
    assert (tmp_path / "policy_quick.png").read_bytes()[:8] == PNG_MAGIC


@needs_shaping
def test_probe_start_quick_mode_times_each_kind_as_they_come_and_together(tmp_path):
    stdout = run_script(BENCHMARKS / "probe_start.py", "--quick", "--out", tmp_path)
    report = json.loads((tmp_path / "probe_start_quick.json").read_text())
    rows = {(r["kind"], r["bytes"], r["start"]): r for r in report["rows"]}
    assert set(rows) == {(kind, size, start) for kind in ("all-gather", "all-to-all", "allreduce")
                         for size in (64 << 10, 1 << 20) for start in ("as they come", "together")}, stdout
    for (kind, size, _), row in rows.items():
        assert len(row["runs_ms"]) == 3 and min(row["runs_ms"]) == row["least_ms"] <= row["median_ms"]
        sent = {"all-gather": 1, "all-to-all": 0.5, "allreduce": 1}[kind] * size  # per rank, at 2 ranks
        assert row["link_ms"] == pytest.approx(1e3 * sent / 125e6)  # 1 Gbit/s
        if size == 1 << 20:  # past the token bucket's 128 KB burst, the link's rate holds every run back
            assert row["least_vs_link"] > 0.5
    assert (tmp_path / "probe_start_quick.csv").read_text().count("\n") == 13  # header + 12 rows
    assert (tmp_path / "probe_start_quick.png").read_bytes()[:8] == PNG_MAGIC


def test_hook_overhead_quick_mode_times_each_hooks_own_time_with_every_bucket_plain(tmp_path):
    stdout = run_script(BENCHMARKS / "hook_overhead.py", "--quick", "--out", tmp_path)
    report = json.loads((tmp_path / "hook_overhead_quick.json").read_text())
    assert report["gradcomp_schemes"] == {"plain": 2}, stdout  # the MLP's two buckets, both sent plain
    rows = {row["configuration"]: row for row in report["rows"]}
    torch_hook, gradcomp_hook, limit = (rows[name] for name in ("torch's allreduce hook",
                                                                "gradcomp, every bucket plain",
                                                                "no communication (limit)"))
    assert torch_hook["calls_per_step"] == gradcomp_hook["calls_per_step"] == 2 and limit["calls_per_step"] == 0
    assert torch_hook["own_us_per_call"] > 0 and gradcomp_hook["own_us_per_call"] > 0
    assert limit["vs_limit"] == 1 and torch_hook["vs_torch_paired"] == 1
    assert report["copy_us"] > 0 and report["bucket_numel"] > 0
    assert (tmp_path / "hook_overhead_quick.csv").read_text().count("\n") == 4  # header + 3 rows
    assert (tmp_path / "hook_overhead_quick.png").read_bytes()[:8] == PNG_MAGIC


def test_two_phase_ops_quick_mode(tmp_path):
    stdout = run_script(BENCHMARKS / "two_phase_ops.py", "--quick", "--out", tmp_path)
    report = json.loads((tmp_path / "two_phase_ops_quick.json").read_text())
    assert {(r["codec"], r["phase"]) for r in report["rows"]} == {
        (spec, phase) for spec in ("signsgd", "terngrad", "qsgd", "topk:ratio=0.01")
        for phase in ("encode", "owner", "decode")}
    for row in report["rows"]:
        assert row["world"] == 4 and row["fused_gbps"] > 0 and row["per_chunk_gbps"] > 0 and row["copy_gbps"] > 0
    assert (tmp_path / "two_phase_ops_quick.csv").read_text().count("\n") == 13  # header + 12 rows
    assert (tmp_path / "two_phase_ops_quick.png").read_bytes()[:8] == PNG_MAGIC
    assert "copy_" in stdout


@pytest.mark.needs("bible", "tokenizers")
def test_lm_quick_mode_learns_and_writes(tmp_path):
    out = run_script(BENCHMARKS / "lm.py", "--quick", "--codecs", "none", "topk:ratio=0.01", "--out", tmp_path)
    report = json.loads((tmp_path / "lm_quick.json").read_text())
    rows = {row["spec"]: row for row in report["summary"]}
    assert set(rows) == {"none", "topk:ratio=0.01"}
    assert rows["none"]["ratio"] == 1.0 and rows["topk:ratio=0.01"]["ratio"] > 3
    vocab = report["model"]["vocab"]
    for row in rows.values():  # 30 steps of a tiny model already beat guessing uniformly over the vocabulary
        assert row["diverged"] == 0 and 1 < row["ppl_mean"] < vocab / 2
    baselines = report["baselines"]
    assert 1 < baselines["bigram_ppl"] < baselines["unigram_ppl"] < vocab
    assert report["corpus"]["val_chars"] < report["corpus"]["train_chars"] / 10
    assert (tmp_path / "lm_quick.csv").read_text().count("\n") == 3
    assert (tmp_path / "lm_quick.png").read_bytes()[:8] == PNG_MAGIC
    assert "bigram" in out


@pytest.mark.needs("bible", "tokenizers")
def test_lm_quick_mode_under_fsdp2(tmp_path):
    out = run_script(BENCHMARKS / "lm.py", "--quick", "--fsdp", "--codecs", "none", "topk:ratio=0.01", "powersgd:rank=2",
                     "--out", tmp_path)
    report = json.loads((tmp_path / "lm_fsdp_quick.json").read_text())
    rows = {row["spec"]: row for row in report["summary"]}
    assert set(rows) == {"none", "topk:ratio=0.01"}, out  # powersgd left out: FSDP's reduce-scatter has no matrices
    assert all(run["fsdp"] for run in report["runs"])
    assert 0.99 < rows["none"]["ratio"] <= 1.0 and rows["topk:ratio=0.01"]["ratio"] > 10  # none: headers only
    for row in rows.values():  # better than guessing uniformly (topk under AdamW is slow to start: a short run)
        assert row["diverged"] == 0 and 1 < row["ppl_mean"] < report["model"]["vocab"]
    assert rows["none"]["ppl_mean"] < report["model"]["vocab"] / 2


@pytest.mark.needs("tokenizers")
def test_lm_split_holds_out_whole_chapters_and_fits_the_vocabulary_on_training_text():
    lm = load_benchmark("lm.py")

    # Chapter 10 of every 20 is held out; its word appears nowhere else, so no merge can come from it.
    chapters = [f"chapter {i} in the beginning was the word\n" for i in range(40)]
    chapters[10] = chapters[30] = "zyzzyva quixotic zyzzyva quixotic\n" * 50
    corpus = lm.split_corpus(chapters, 300)
    held_out = chapters[10] + chapters[30]
    assert corpus["val_chars"] == len(held_out)
    assert corpus["train_chars"] == sum(map(len, chapters)) - len(held_out)
    tokenizer = lm.fit_tokenizer("".join(c for i, c in enumerate(chapters) if i not in (10, 30)), 300)
    assert tokenizer.decode(corpus["val"].long().tolist()) == held_out  # lossless
    assert "zyzzyva" not in "".join(tokenizer.get_vocab())  # fitted without the held-out text
    assert len(corpus["val"]) > len(held_out) / 4  # the unseen words stay in small pieces


def test_lm_ngram_baselines_match_hand_counts():
    lm = load_benchmark("lm.py")

    train, val = torch.tensor([0, 1, 0, 1, 0, 2] * 10), torch.tensor([0, 1, 0, 2])
    baselines = lm.ngram_baselines(train, val, 3)
    unigram = {0: 31 / 63, 1: 21 / 63, 2: 11 / 63}  # counts 30, 20, 10, each + 1
    expected = -sum(math.log(unigram[t]) for t in val.tolist()) / 4
    assert math.isclose(baselines["unigram_loss"], expected, rel_tol=1e-9)
    # Every pair the validation split holds was seen; interpolation with the unigram can only cost.
    assert baselines["bigram_ppl"] < baselines["unigram_ppl"]


def test_lm_variants_block_sign_scales_each_block_by_its_mean_magnitude():
    variants = load_benchmark("lm_variants.py")
    m = torch.tensor([1.0, -3.0, 2.0, -2.0, 0.0, 5.0, -0.5])
    # blocks [1, -3], [2, -2], [0, 5], [-0.5]: means 2, 2, 2.5, 0.5; zero decodes to +scale
    expected = torch.tensor([2.0, -2.0, 2.0, -2.0, 2.5, 2.5, -0.5])
    assert torch.equal(variants.block_sign_decoded(m, 2), expected)
    whole = m.abs().mean()
    assert torch.allclose(variants.block_sign_decoded(m, 7), torch.where(m >= 0, whole, -whole))
    with pytest.raises(ValueError, match="unknown option.*blocks.*valid: block, error_feedback"):
        variants.check_spec("blocksign:blocks=4")


@pytest.mark.needs("bible", "tokenizers")
def test_lm_variants_block_sign_trains_as_signsgd_with_blocks_does(tmp_path):
    # The pure-PyTorch stand-in and gradcomp's signsgd with the same block size: both runs must agree.
    run_script(BENCHMARKS / "lm_variants.py", "--quick", "--codecs", "signsgd:block=64", "blocksign:block=64",
               "--out", tmp_path)
    report = json.loads((tmp_path / "lm_quick.json").read_text())
    assert report["variants"] == {"freeze_variance_after": 0, "spread": "", "plain_steps": 2}
    rows = {row["spec"]: row for row in report["summary"]}
    signsgd, stand_in = rows["signsgd:block=64"], rows["blocksign:block=64"]
    assert math.isclose(stand_in["ppl_mean"], signsgd["ppl_mean"], rel_tol=1e-3)
    assert math.isclose(stand_in["ratio"], signsgd["ratio"], rel_tol=1e-2)


def test_lm_variants_sparse_block_sign_signs_only_the_elements_sent_in_blocks_of_their_own():
    variants = load_benchmark("lm_variants.py")
    m = torch.tensor([1.0, -3.0, 2.0, -2.0, 0.0, 5.0, -0.5])
    sent = torch.tensor([True, False, True, True, False, False, True])
    # the elements sent are 1, 2, -2, -0.5: blocks [1, 2] and [-2, -0.5], means 1.5 and 1.25
    expected = torch.tensor([1.5, 0.0, 1.5, -1.25, 0.0, 0.0, -1.25])
    assert torch.equal(variants.sparse_block_sign_decoded(m, 2, sent), expected)
    assert torch.equal(variants.sparse_block_sign_decoded(m, 2, torch.zeros(7, dtype=torch.bool)), torch.zeros(7))
    for bad, message in (("fraction=0", r"fraction must be in \(0, 1\], got 0.0"),
                         ("fraction=1.5", r"fraction must be in \(0, 1\], got 1.5")):
        with pytest.raises(ValueError, match=message):
            variants.check_spec(f"blocksign:{bad}")
    for bad in ("hold=1", "fraction=0.5,hold=1"):  # with all elements sent, or with error feedback
        with pytest.raises(ValueError, match="hold=1 .* give a fraction below 1 and error_feedback=0"):
            variants.check_spec(f"blocksign:{bad}")


def test_lm_variants_block_sign_momentum_is_a_running_mean_of_the_rank_gradient():
    variants = load_benchmark("lm_variants.py")
    state = variants.BlockSignState("blocksign:momentum=0.75", 4, False, 1.0, False, 0.75, 2, 2)
    for grad in ([4.0, -8.0], [0.0, 8.0], [8.0, 0.0]):
        mean = variants.local_momentum(state, 0, torch.tensor(grad))
    # starts at the first gradient: 4, then 0.75 * 4 + 0.25 * 0 = 3, then 0.75 * 3 + 0.25 * 8 = 4.25; -8, -4, -3
    assert torch.equal(mean, torch.tensor([4.25, -3.0]))
    assert variants.local_momentum(state, 1, torch.tensor([1.0])).tolist() == [1.0]  # a bucket of its own
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\), got 1.0"):
        variants.check_spec("blocksign:momentum=1")


def test_lm_variants_spread_hands_an_arrival_out_by_the_gap_it_closed():
    variants = load_benchmark("lm_variants.py")
    # element 0 arrives at step 3 (6, a gap of 3 steps) and step 5 (2, a gap of 2); element 1 at step 1 (4, a gap of 1)
    arrivals = [[0.0, 4.0], [0.0, 0.0], [6.0, 0.0], [0.0, 0.0], [2.0, 0.0]] + [[0.0, 0.0]] * 3
    decay, hold = variants.Spread(None, "decay"), variants.Spread(None, "hold")
    decayed = [decay.apply(0, torch.tensor(a)).clone() for a in arrivals]
    held = [hold.apply(0, torch.tensor(a)).clone() for a in arrivals]
    # decay: 1/gap of what is pending leaves each step (pending 6, 4, 8/3 + 2, 7/3, ...), and nothing is lost
    expected = [0.0, 0.0, 2.0, 4 / 3, 7 / 3, 7 / 6, 7 / 12, 7 / 24]
    assert all(math.isclose(float(d[0]), e, rel_tol=1e-6) for d, e in zip(decayed, expected))
    pending = decay.buffers[0][0]  # what decay still holds back
    assert math.isclose(sum(float(d[0]) for d in decayed) + float(pending[0]), 8.0, rel_tol=1e-6)
    assert [float(d[1]) for d in decayed] == [4.0] + [0.0] * 7  # a gap of 1: handed out at once
    # hold: the arrival over its gap, every step until the next arrival
    assert [float(h[0]) for h in held] == [0.0, 0.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    assert [float(h[1]) for h in held] == [4.0] * 8


@pytest.mark.needs("bible", "tokenizers")
def test_lm_variants_spread_and_fraction_train(tmp_path, monkeypatch):
    variants = load_benchmark("lm_variants.py")
    monkeypatch.setattr(variants, "SPREAD", "decay")
    for spec in ("blocksign:block=64", "scaledtopk:ratio=0.01"):
        with pytest.raises(ValueError, match="--spread applies to gradcomp's codecs, not to blocksign or scaledtopk"):
            variants.check_spec(spec)
    topk = "topk:ratio=0.01"
    run_script(BENCHMARKS / "lm_variants.py", "--quick", "--spread", "decay", "--codecs", topk,
               "--out", tmp_path / "spread")
    spread = json.loads((tmp_path / "spread" / "lm_quick.json").read_text())
    assert spread["variants"]["spread"] == "decay"
    fraction, whole = "blocksign:block=64,error_feedback=0,fraction=0.25", "blocksign:block=64,error_feedback=0"
    held, momentum = fraction + ",hold=1", whole + ",momentum=0.9"
    run_script(BENCHMARKS / "lm_variants.py", "--quick", "--codecs", topk, fraction, held, whole, momentum,
               "--out", tmp_path / "plain")
    report = json.loads((tmp_path / "plain" / "lm_quick.json").read_text())
    rows = {row["spec"]: row for row in report["summary"]}
    assert all(math.isfinite(row["ppl_mean"]) and row["ppl_mean"] < 512 for row in rows.values())  # vocab 512
    # the spread changes what AdamW sees, and holding changes what the unsent elements get
    assert spread["summary"][0]["ppl_mean"] != rows[topk]["ppl_mean"]
    assert rows[held]["ppl_mean"] != rows[fraction]["ppl_mean"]
    assert rows[held]["wire_bytes_per_step"] == rows[fraction]["wire_bytes_per_step"]
    assert rows[momentum]["ppl_mean"] != rows[whole]["ppl_mean"]  # the signs of the running mean are others
    steps, plain = report["model"]["steps"], report["variants"]["plain_steps"]

    def compressed_bytes(row):
        return row["wire_bytes_per_step"] * steps - plain * row["raw_bytes_per_step"]

    # about a quarter of the signs and scales (and a header per payload)
    assert 0.2 < compressed_bytes(rows[fraction]) / compressed_bytes(rows[whole]) < 0.35


def test_lm_variants_scaled_top_k_chooses_by_magnitude_over_the_running_rms():
    variants = load_benchmark("lm_variants.py")
    m = torch.tensor([3.0, -1.0, 0.5, 2.0])
    mean_square = torch.tensor([9.0, 0.01, 0.01, 16.0])  # scores |m| / rms: 1, 10, 5, 0.5
    assert torch.equal(variants.scaled_top_k_sent(m, mean_square, 2), torch.tensor([0.0, -1.0, 0.5, 0.0]))
    assert torch.equal(variants.scaled_top_k_sent(m, None, 2), torch.tensor([3.0, 0.0, 0.0, 2.0]))
    grad = torch.tensor([1.0, -3.0, 2.0, 0.0, 4.0])  # parameters of 2 and 3 elements: mean squares 5 and 20/3
    expected = torch.tensor([5.0, 5.0, 20 / 3, 20 / 3, 20 / 3])
    assert torch.allclose(variants.tensor_mean_squares(grad, [2, 3]), expected)
    # DGC's warm-up: 0.25 at first, the geometric mean of 0.25 and the ratio half-way, the ratio from then on
    assert variants.warmed_up_ratio(0.01, 100, 0) == 0.25
    assert math.isclose(variants.warmed_up_ratio(0.01, 100, 50), 0.05)
    assert [variants.warmed_up_ratio(0.01, 100, step) for step in (100, 500)] == [0.01, 0.01]
    assert variants.warmed_up_ratio(0.5, 100, 0) == 0.5 and variants.warmed_up_ratio(0.01, 0, 0) == 0.01
    for bad, message in (("ratio=0", r"ratio must be in \(0, 1\], got 0.0"), ("by=row", "by must be element, "
                         "tensor or none, got 'row'"), ("warmup=-1", "warmup must be >= 0 steps, got -1"),
                         ("keep=1.5", r"keep must be in \[0, 1\], got 1.5"),
                         ("k=3", r"unknown option\(s\) \['k'\]; valid: ratio, by, warmup, keep")):
        with pytest.raises(ValueError, match=message):
            variants.check_spec(f"scaledtopk:{bad}")


@pytest.mark.needs("bible", "tokenizers")
def test_lm_variants_scaled_top_k_trains_and_by_none_is_gradcomps_topk(tmp_path):
    specs = ["topk:ratio=0.01", "scaledtopk:ratio=0.01,by=none", "scaledtopk:ratio=0.01",
             "scaledtopk:ratio=0.01,by=tensor", "scaledtopk:ratio=0.01,by=none,warmup=10",
             "scaledtopk:ratio=0.01,by=none,keep=0.5"]
    script = BENCHMARKS / "lm_variants.py"
    run_script(script, "--quick", "--plain-steps", "3", "--codecs", *specs, "--out", tmp_path / "three")
    report = json.loads((tmp_path / "three" / "lm_quick.json").read_text())
    assert report["variants"]["plain_steps"] == 3
    rows = {row["spec"]: row for row in report["summary"]}
    topk, stand_in, by_element, by_tensor, warmed, leaky = (rows[spec] for spec in specs)
    assert math.isclose(stand_in["ppl_mean"], topk["ppl_mean"], rel_tol=1e-3)
    assert math.isclose(stand_in["ratio"], topk["ratio"], rel_tol=1e-2)
    assert all(math.isfinite(row["ppl_mean"]) and row["ppl_mean"] < 512 for row in rows.values())  # vocab 512
    for variant in (by_element, by_tensor, leaky):  # each changes what is sent
        assert variant["ppl_mean"] != stand_in["ppl_mean"]
    assert warmed["ratio"] < 0.8 * stand_in["ratio"]  # ten steps from a quarter of the elements down to 1% send more
    with pytest.raises(AssertionError, match="holds runs of the variant .* give another --out, or --fresh"):
        run_script(script, "--quick", "--codecs", specs[1], "--out", tmp_path / "three")
    # The ranks took 3 plain steps: one more than the default, so one step's plain bytes in place of a compressed one's.
    run_script(script, "--quick", "--codecs", specs[1], "--out", tmp_path / "two")
    two = json.loads((tmp_path / "two" / "lm_quick.json").read_text())["summary"][0]
    steps, raw = report["model"]["steps"], stand_in["raw_bytes_per_step"]
    compressed = (two["wire_bytes_per_step"] * steps - 2 * raw) / (steps - 2)
    assert compressed < raw / 4
    assert math.isclose((stand_in["wire_bytes_per_step"] - two["wire_bytes_per_step"]) * steps, raw - compressed,
                        rel_tol=1e-6)
    with pytest.raises(AssertionError, match="--plain-steps must be >= 2, got 1"):
        run_script(script, "--quick", "--plain-steps", "1", "--out", tmp_path)


@pytest.mark.needs("bible", "tokenizers")
def test_lm_variants_start_codec_replaces_the_plain_start(tmp_path):
    script, spec = BENCHMARKS / "lm_variants.py", "signsgd:error_feedback=false"
    run_script(script, "--quick", "--plain-steps", "10", "--codecs", spec, "--out", tmp_path / "plain")
    run_script(script, "--quick", "--plain-steps", "10", "--start-codec", "fp16", "--codecs", spec,
               "--out", tmp_path / "fp16")
    plain, staged = (json.loads((tmp_path / name / "lm_quick.json").read_text()) for name in ("plain", "fp16"))
    assert staged["variants"]["start_codec"] == "fp16" and "start_codec" not in plain["variants"]
    plain_row, staged_row = plain["summary"][0], staged["summary"][0]
    steps, raw = plain["model"]["steps"], plain_row["raw_bytes_per_step"]
    # fp16 sends half of plain allreduce's bytes on each of the 10 start steps
    saved = (plain_row["wire_bytes_per_step"] - staged_row["wire_bytes_per_step"]) * steps
    assert math.isclose(saved, 10 * raw / 2, rel_tol=0.01)
    assert staged_row["ppl_mean"] != plain_row["ppl_mean"] and math.isfinite(staged_row["ppl_mean"])
    for args, message in ((["--plain-steps", "10", "--spread", "decay"], "goes with neither --spread"),
                          (["--plain-steps", "10", "--codecs", "blocksign"], "--start-codec applies to gradcomp's")):
        with pytest.raises(AssertionError, match=message):
            run_script(script, "--quick", "--start-codec", "fp16", *args, "--out", tmp_path / "bad")
    for start, message in (("fp17", "fp17"), ("topk", "keeps an error-feedback residual")):
        with pytest.raises(AssertionError, match=message):
            run_script(script, "--quick", "--plain-steps", "10", "--start-codec", start, "--out", tmp_path / "bad")


def test_lm_variants_frozen_variance_adamw_is_adamw_until_it_freezes():
    variants = load_benchmark("lm_variants.py")
    torch.manual_seed(0)
    start = torch.randn(4, 3)
    ours, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
    frozen = variants.VariantAdamW([ours], lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, freeze_after=3)
    adamw = torch.optim.AdamW([theirs], lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(6):
        grad = torch.randn(4, 3)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        frozen.step()
        adamw.step()
        if step < 3:
            assert torch.allclose(ours, theirs, atol=1e-6)
            variance = frozen.state[ours]["v"].clone()
    assert not torch.allclose(ours, theirs, atol=1e-4)
    assert torch.equal(frozen.state[ours]["v"], variance)  # the second moment of step 3, kept


def test_lm_variants_local_variance_adamw_is_adamw_on_one_rank_and_averages_blocks(tmp_path):
    variants = load_benchmark("lm_variants.py")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        start = torch.randn(4, 3)
        ours, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
        squares = variants.LocalSquares(block=1)
        local = variants.VariantAdamW([ours], lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, squares=squares)
        adamw = torch.optim.AdamW([theirs], lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
        for _ in range(5):  # one rank: its own gradient is the averaged one, so this is AdamW
            grad = torch.randn(4, 3)
            ours.grad, theirs.grad = grad.clone(), grad.clone()
            squares.local[ours] = grad.square().flatten()  # what local_squares_hook keeps for blocks of 1
            local.step()
            adamw.step()
            assert torch.allclose(ours, theirs, atol=1e-6)
        assert squares.local == {} and squares.wire_bytes == 0  # taken each step; one rank sends nothing

        # blocks of 5 over the 12 elements: [0, 5), [5, 10), [10, 12); clipped to norm 1 on both moments
        blocked = torch.zeros(4, 3, requires_grad=True)
        grad = torch.arange(12.0).view(4, 3)
        blocked.grad = grad.clone()
        squares = variants.LocalSquares(block=5)
        squares.local[blocked] = variants.block_means(grad.square(), 5)
        optimizer = variants.VariantAdamW([blocked], lr=0.1, betas=(0.9, 0.95), squares=squares, clip_norm=1.0)
        optimizer.step()
        flat_squares = grad.flatten().square()
        means = [flat_squares[:5].mean(), flat_squares[5:10].mean(), flat_squares[10:].mean()]
        expected_v = torch.tensor([means[0]] * 5 + [means[1]] * 5 + [means[2]] * 2).view(4, 3)
        scale = 1.0 / float(grad.norm())  # the block means times their counts sum to the squares' sum
        state = optimizer.state[blocked]
        assert torch.allclose(state["v"], 0.05 * scale ** 2 * expected_v)
        assert torch.allclose(state["m"], 0.1 * scale * grad)
    finally:
        dist.destroy_process_group()


def test_lm_variants_local_variance_averages_the_ranks_own_squares_through_ddp():
    results = unwrap(run_ranks(ddp_scenarios.local_squares, world=2))
    for rank in results:
        # blocks of 4: a weight of 30 elements in 8 blocks, a bias of 5 in 2; 3 steps of 10 fp32 means each
        assert rank["wire_bytes"] == 3 * 40
        for name in ("v", "m"):
            for held, expected in zip(rank[name], rank["expected_" + name]):
                assert torch.allclose(held, expected, rtol=1e-5, atol=1e-9)
        assert any(scale < 1.0 for scale in rank["scales"])  # the clipping was tried, not only bypassed
    for held, other in zip(results[0]["v"], results[1]["v"]):
        assert torch.equal(held, other)  # the same second moment on every rank


def test_lm_variants_local_variance_reaches_spawned_ranks_by_the_environment(monkeypatch):
    monkeypatch.setenv("GRADCOMP_LM_LOCAL_SQUARES_BLOCK", "4")
    variants = load_benchmark("lm_variants.py")  # what a rank started by mp.spawn does
    assert variants.LOCAL_SQUARES_BLOCK == 4 and variants.lm.CLIP_IN_OPTIMIZER
    monkeypatch.delenv("GRADCOMP_LM_LOCAL_SQUARES_BLOCK")
    variants = load_benchmark("lm_variants.py")
    assert variants.LOCAL_SQUARES_BLOCK == 0 and not variants.lm.CLIP_IN_OPTIMIZER  # lm.py clips again


@pytest.mark.needs("bible", "tokenizers")
def test_lm_variants_local_variance_counts_its_statistic_and_trains(tmp_path):
    script = BENCHMARKS / "lm_variants.py"
    run_script(script, "--quick", "--local-variance", "1", "--codecs", "none", "topk:ratio=0.01",
               "--out", tmp_path / "element")
    report = json.loads((tmp_path / "element" / "lm_quick.json").read_text())
    assert report["variants"]["local_variance_block"] == 1
    rows = {row["spec"]: row for row in report["summary"]}
    # per element, the statistic is as large as the gradient: plain allreduce's bytes twice
    assert math.isclose(rows["none"]["ratio"], 0.5, rel_tol=1e-9)
    assert all(math.isfinite(row["ppl_mean"]) and row["ppl_mean"] < 512 for row in rows.values())  # vocab 512
    with pytest.raises(AssertionError, match="--local-variance applies to gradcomp's codecs"):
        run_script(script, "--quick", "--local-variance", "4", "--codecs", "blocksign", "--out", tmp_path / "bad")
    with pytest.raises(AssertionError, match="--local-variance takes a block size >= 1"):
        run_script(script, "--quick", "--local-variance", "-1", "--out", tmp_path / "bad")


@pytest.mark.needs("mnist1d")  # its quick mode's data
def test_elastic_quick_mode_resumes_on_another_world_size(tmp_path):
    out = run_script(BENCHMARKS / "elastic.py", "--quick", "--epochs", "2", "--out", tmp_path)
    report = json.loads((tmp_path / "elastic_quick.json").read_text())
    runs = {r["run"]: r for r in report["runs"]}
    assert set(runs) == {"2 ranks, never stopped", "2 ranks to epoch 1, then 4"}
    resumed = runs["2 ranks to epoch 1, then 4"]
    assert resumed["test_acc"] > 20 and resumed["ratio"] > 5  # it trained on, compressed, on 4 ranks
    assert resumed["vs_straight"] == pytest.approx(resumed["test_acc"] - runs["2 ranks, never stopped"]["test_acc"])
    assert "then 4" in out and (tmp_path / "elastic_quick.png").read_bytes()[:8] == PNG_MAGIC


@needs_shaping
def test_fsdp_bytes_quick_mode_reads_the_reduce_scatters_bytes_next_to_the_stats(tmp_path):
    out = run_script(BENCHMARKS / "fsdp_bytes.py", "--quick", "--width", "512", "--out", tmp_path)
    rows = {row["config"]: row for row in json.loads((tmp_path / "fsdp_bytes_quick.json").read_text())["rows"]}
    assert set(rows) == {"plain FSDP2", "signsgd", "topk:ratio=0.01"}, out
    plain = rows["plain FSDP2"]["measured_bytes_per_step"]
    assert plain > 4 * (256 * 512 + 2 * 512 * 512) / 2  # at least a ring's half of the fp32 gradient
    for spec in ("signsgd", "topk:ratio=0.01"):
        assert 0.8 < rows[spec]["stats_vs_measured"] < 1.25, rows[spec]
        assert rows[spec]["measured_bytes_per_step"] < plain / 10
    assert (tmp_path / "fsdp_bytes_quick.png").read_bytes()[:8] == PNG_MAGIC
