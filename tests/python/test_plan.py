"""gradcomp-plan: the cluster's collectives against hand-counted ring and all-to-all bytes, the buckets of a model,
the command's output (and the README's copy of it), and its refusals."""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import torch

import gradcomp
import gradcomp.policy
from gradcomp import plan


def test_the_clusters_links_are_the_bytes_each_collective_puts_on_a_nodes_link():
    nodes, per_node, inter, intra = 4, 8, 3e9, 300e9  # bytes/s
    links = plan.cluster_links(nodes, per_node, inter, intra, 0.0, 0.0)
    nbytes = 1e8  # a 32-rank world
    # A ring allreduce over 32 ranks: each node's link carries 2(W-1)/W of the buffer.
    assert links["world/allreduce"](nbytes) == pytest.approx(2 * 31 / 32 * nbytes / inter)
    # An all-gather of p per rank: the ring's edge out of a node carries (W-1) p.
    assert links["world/all-gather"](nbytes) == pytest.approx(31 * nbytes / inter)
    # An all-to-all of t per rank: each of a node's 8 ranks sends 24/32 of t to other nodes.
    assert links["world/all-to-all"](nbytes) == pytest.approx(8 * 24 / 32 * nbytes / inter)
    # Inside a node: a reduce-scatter of B over 8 ranks moves 7/8 of B through each GPU's link.
    assert links["inside/reduce-scatter"](nbytes) == pytest.approx(7 / 8 * nbytes / intra)
    # Across: the 8 local ranks' groups of 4 share the node's link at once.
    assert links["across/allreduce"](nbytes) == pytest.approx(8 * 2 * 3 / 4 * nbytes / inter)
    with_latency = plan.cluster_links(nodes, per_node, inter, intra, 1e-5, 1e-6)
    assert with_latency["world/allreduce"].fixed == pytest.approx(2 * 5 * 1e-5)  # 2 log2(32) steps


def test_a_models_buckets_hold_its_parameters_in_ddps_bucket_size():
    buckets = plan.buckets_of(60e6, 25, torch.bfloat16, (2048, 2048))
    sizes = [sum(torch.Size(s).numel() for s in b["shapes"]) for b in buckets]
    assert sum(sizes) == 60_000_000 and max(sizes) == 25 * 2**20 // 2
    assert all(torch.Size(s).numel() <= 2048 * 2048 for b in buckets for s in b["shapes"])
    square = plan.buckets_of(1e6, 25, torch.float32, None)
    assert square[0]["shapes"][0] == (1000, 1000)
    # A matrix larger than a bucket fills one of its own (DDP never splits a parameter); the rest, as its rows.
    large = plan.buckets_of(60e6, 25, torch.bfloat16, (4096, 11008))
    assert [b["shapes"] for b in large] == [[(4096, 11008)], [(1354, 11008), (6400,)]]
    assert sum(torch.Size(s).numel() for b in large for s in b["shapes"]) == 60_000_000


def run_plan(*args):
    return subprocess.run([sys.executable, "-m", "gradcomp.plan", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_the_command_predicts_plain_ddp_each_option_and_the_policy():
    result = run_plan("--nodes", 2, "--gpus-per-node", 4, "--inter-gbit", 10, "--params", 2e7, "--gpu", "h100",
                      "--codecs", "signsgd;powersgd:rank=4")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    native, hooked = [line for line in lines if line.startswith("plain DDP")]
    # Through a comm hook the buckets are divided in a pass of their own, which DDP alone fuses into its copy.
    assert "comm hook" in hooked and float(native.split()[-2]) < float(hooked.split()[-2])
    for spec, options in (("signsgd", ("allgather", "two-phase", "hierarchical")), ("powersgd:rank=4",
                                                                                     ("powersgd", "hierarchical"))):
        rows = [line for line in lines if line.startswith(spec + " ")]
        assert [row.split()[1] for row in rows[:-1]] == list(options) and "policy='time'" in rows[-1], rows
    # Measured kernels (no --gpu) on this machine's CPU work too, for a codec that travels by allreduce.
    assert run_plan("--nodes", 2, "--inter-gbit", 1, "--params", 1e5, "--codecs", "fp16").returncode == 0


def test_the_readmes_planner_output_is_what_the_command_prints():
    """The README's example clusters (stated GPU kernels: no measurement) print today what the README shows."""
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    examples = re.findall(r"^\$ (gradcomp-plan .*?(?:\\\n.*?)*)\n(.*?)(?=^\$ |^```)", readme, re.M | re.S)
    assert len(examples) == 2
    for command, shown in examples:
        args = shlex.split(command.replace("\\\n", " "))[1:]
        assert "--gpu" in args
        result = run_plan(*args)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == shown.split(), command


@pytest.mark.parametrize("args, named", [(("--nodes", 0), "--nodes=0"), (("--layer-shape", "big"), "--layer-shape"),
                                         (("--codecs", "zip"), "unknown codec 'zip'"),
                                         (("--inter-gbit", -1), "--inter-gbit=-1"),
                                         (("--layer-shape", "0x4"), "--layer-shape='0x4'"),
                                         (("--params", 0.5), "--params=0.5"),
                                         (("--inter-latency-us", -5), "--inter-latency-us=-5"),
                                         (("--backward-ms", "nan"), "--backward-ms=nan")])
def test_bad_arguments_are_refused_by_name(args, named):
    base = {"--nodes": 2, "--inter-gbit": 1, "--params": 1e6}
    base.update(dict(zip(args[::2], args[1::2])))
    result = run_plan(*[x for kv in base.items() for x in kv])
    assert result.returncode == 2 and named in result.stderr, result.stderr


def test_the_planners_prediction_is_the_policys_model():
    """The planner decides with gradcomp.policy's own functions: its policy row is the decision's prediction."""
    links = plan.cluster_links(2, 1, 1.25e8, 3e11, 1e-5, 1e-6)
    buckets = plan.buckets_of(2.4e6, 25, torch.float32, None)
    codec = gradcomp.codec("topk:ratio=0.01")
    result = plan.predict(codec, buckets, links, plan.gpu_kernels(codec, "a100", torch.float32), 2, 1, 0.0)
    plain = result["predicted_s"]["plain"]
    # One bucket, no overlap: its division by the world size (a read and a write of 4 bytes an element at 70% of the
    # A100's 2 TB/s, and one launch of 5 us), then its allreduce.
    division = 5e-6 + 2 * 4 * 2.4e6 / (0.7 * 2.0e12)
    assert plain == pytest.approx(division + links["world/allreduce"](4 * 2.4e6))
    assert result["predicted_s"]["plain DDP"] == pytest.approx(links["world/allreduce"](4 * 2.4e6))  # no hook
    best = min(seconds for option, seconds in result["predicted_s"].items() if option != "plain DDP")
    assert result["predicted_s"]["policy"] <= best / (1 - gradcomp.policy.MARGIN) + 1e-12
    assert result["choices"] == {"allgather": 1}  # 2 ranks on a 1 Gbit/s link: topk's allgather, far ahead


def test_plain_ddp_on_this_machine_divides_each_bucket_before_its_allreduce():
    """Measured kernels (no --gpu) time plain DDP's division of a bucket by the world size, and the planner's plain
    DDP spends it on the hook's thread before the allreduce."""
    links = plan.cluster_links(2, 1, 1.25e8, 3e11, 1e-5, 1e-6)
    numel = 1 << 20
    buckets = plan.buckets_of(numel, 25, torch.float32, None)
    codec = gradcomp.codec("signsgd")
    kernels = plan.measured_kernels(codec, numel, torch.float32)
    assert kernels["divide"](numel) > 0
    plain = plan.predict(codec, buckets, links, kernels, 2, 1, 0.0)["predicted_s"]["plain"]
    assert plain == pytest.approx(kernels["divide"](numel) + links["world/allreduce"](4 * numel))
