"""Smoke test: the kernel benchmark runs in its quick mode and writes what it promises."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


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
