"""The main job (examples/train_ddp.py) end to end: 2 local ranks train, report, checkpoint and resume."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.needs("mnist1d")  # the main job's data

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"


def run_main_job(*args, expect_ok=True, launcher=(sys.executable,)):
    result = subprocess.run([*launcher, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=600)
    if expect_ok:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        return result.stdout
    assert result.returncode != 0, "the job should have failed"
    return result.stderr


def test_main_job_trains_reports_and_resumes_exactly(tmp_path):
    checkpoints = tmp_path / "ckpt"
    stdout = run_main_job("--epochs", 2, "--compressor", "topk:ratio=0.05", "--json", tmp_path / "full.json",
                          "--checkpoint", checkpoints)
    full = json.loads((tmp_path / "full.json").read_text())
    assert [e["epoch"] for e in full["epochs"]] == [0, 1]
    assert full["epochs"][1]["test_acc"] > 25  # chance is 10%; 2 of 40 planned epochs, so far from converged
    assert full["wire_bytes"] * 3 < full["raw_bytes"] and full["ratio"] > 3
    assert "compressor topk:error_feedback=True,ratio=0.05" in stdout and "final test acc" in stdout

    # As if the run had been killed during epoch 1: every rank's latest checkpoint is epoch 0's.
    for rank in range(2):
        path = checkpoints / f"ckpt.rank{rank}.pt"
        os.replace(f"{path}.prev", path)
    run_main_job("--epochs", 2, "--compressor", "topk:ratio=0.05", "--json", tmp_path / "resumed.json",
                 "--checkpoint", checkpoints, "--resume")
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    for key in ("loss", "test_acc", "wire_bytes", "raw_bytes"):
        assert resumed["epochs"][1][key] == full["epochs"][1][key], key

    # A rank that finds no checkpoint of its own (say, on a node without the shared folder) stops every rank.
    for name in ("ckpt.rank1.pt", "ckpt.rank1.pt.prev"):
        (checkpoints / name).unlink()
    stderr = run_main_job("--epochs", 2, "--checkpoint", checkpoints, "--resume", expect_ok=False)
    assert "--resume: some ranks found no checkpoint" in stderr and "storage that every node shares" in stderr


def test_main_job_resume_without_a_checkpoint_fails_saying_so(tmp_path):
    stderr = run_main_job("--epochs", 1, "--checkpoint", tmp_path / "nothing-here", "--resume", expect_ok=False)
    assert "--resume: no rank found a checkpoint in" in stderr and "run without --resume" in stderr


def test_main_job_under_torchrun_on_two_simulated_nodes_exits_0(tmp_path):
    """Two torchrun agents on this host, 2 ranks each, meeting by c10d rendezvous as 2 nodes would."""
    port = 29400 + os.getpid() % 500
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                                "gradcomp-test", str(SCRIPT), "--epochs", "1", "--batch-size", "100"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-4000:]
    assert any("world size 4" in output and "final test acc" in output for output in outputs)


def test_main_job_prints_the_time_policys_decision_once():
    stdout = run_main_job("--epochs", 1, "--compressor", "signsgd", "--policy", "time")
    assert stdout.count("policy='time': decided at step 5 on 2 ranks") == 1, stdout  # the default start_iter
    assert "predicted communication per step beyond backward" in stdout and "final test acc" in stdout


def load_main_job_module():
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_the_main_job_takes_nccl_only_where_every_local_rank_has_a_gpu(monkeypatch, capsys, gpus):
    job = load_main_job_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for local_ranks in (1, 2, 8):
        enough = gpus >= local_ranks
        assert job.choose_backend(None, local_ranks, under_torchrun=True) == ("nccl" if enough else "gloo")
        assert job.choose_backend(None, local_ranks, under_torchrun=False) == "gloo"  # spawned ranks: the CPUs
        assert job.choose_backend("gloo", local_ranks, under_torchrun=True) == "gloo"
        if enough:
            assert job.choose_backend("nccl", local_ranks, under_torchrun=False) == "nccl"
        else:
            with pytest.raises(SystemExit, match=f"--backend nccl needs a GPU per local rank: {local_ranks} local "
                                                 f"ranks, {gpus} GPU"):
                job.choose_backend("nccl", local_ranks, under_torchrun=True)
    told = capsys.readouterr().err
    assert ("training on the CPUs over gloo" in told) == (gpus == 1 or gpus == 2), told  # too few GPUs, some


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has a GPU for each of the job's 2 ranks")
def test_main_job_refuses_nccl_without_a_gpu_per_rank():
    stderr = run_main_job("--epochs", 1, "--backend", "nccl", expect_ok=False)
    assert "--backend nccl needs a GPU per local rank: 2 local ranks" in stderr, stderr[-2000:]


def test_main_job_refuses_an_unknown_compressor():
    result = subprocess.run([sys.executable, str(SCRIPT), "--epochs", "1", "--compressor", "zip"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "unknown codec 'zip'" in result.stderr
