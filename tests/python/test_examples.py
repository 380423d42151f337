"""The main job (examples/train_ddp.py) end to end: 2 local ranks train, report, checkpoint and resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"


def run_main_job(*args):
    result = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


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


def test_main_job_refuses_an_unknown_compressor():
    result = subprocess.run([sys.executable, str(SCRIPT), "--epochs", "1", "--compressor", "zip"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "unknown codec 'zip'" in result.stderr
