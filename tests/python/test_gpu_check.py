"""tools/gpu_check.py's report: each stage's outcome, the test counts and every speed target met, missed or
not measured, from the records the stages leave (kernels.py's own JSON among them). The script itself runs
in CI through tools/cuda_build_check.sh, without a GPU."""

import json
import subprocess
import sys
from pathlib import Path

from benchmark_modules import load_benchmark

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"


def kernel_row(kernels, codec, size_mb, encode, copy, torch_topk=None):
    return kernels.Row(codec=codec, full_spec=codec, size_mb=size_mb, numel=1, wire_bytes=1, encode_gbps=encode,
                       decode_gbps=None, decode4_gbps=None, copy_gbps=copy, torch_topk_gbps=torch_topk)


def write_records(work: Path):
    kernels = load_benchmark("kernels.py")
    rows = [kernel_row(kernels, "signsgd", 25.0, 800.0, 1000.0),  # 0.8 of copy_: met
            kernel_row(kernels, "terngrad", 25.0, 500.0, 1000.0),  # 0.5: missed
            kernel_row(kernels, "topk:ratio=0.01", 25.0, 100.0, 1000.0),  # topk's own share: 0.1
            kernel_row(kernels, "topk:ratio=0.01", 256.0, 120.0, 1000.0, torch_topk=20.0)]  # 6x: met
    hook = {"gradcomp_over_torch": 0.7}  # missed
    kernels.write_json(work / "kernels_cuda.json", {"device": "cuda"}, {}, rows, hook)
    two_phase = [{"codec": "qsgd", "world": 8, "phase": "owner", "fused_vs_copy": 0.75},
                 {"codec": "topk:ratio=0.01", "world": 8, "phase": "decode", "fused_vs_copy": 0.05}]
    (work / "two_phase_ops_cuda.json").write_text(json.dumps({"rows": two_phase}))
    (work / "pytest-gpu.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="python.test_cuda" name="test_a_ddp_step_of_every_codec_makes_no_host_sync"/>'
        '<testcase classname="python.test_cuda" name="test_policy_time_on_nccl_makes_no_host_sync_once_decided">'
        '<failure message="synced"/></testcase>'
        '<testcase classname="python.test_cuda" name="test_x"><failure message="boom"/></testcase>'
        '<testcase classname="python.test_cuda" name="test_y"><skipped message="no"/></testcase>'
        '</testsuite></testsuites>')
    (work / "stages.tsv").write_text("build\tpassed\t50\t\ngtest\tfailed\t3\texit 1\nsanitizer\tskipped\t0\tno GPU\n")
    (work / "machine.json").write_text(json.dumps({"torch": "2.11.0", "gpu": {"name": "Some GPU",
                                                   "compute_capability": "90", "memory_gib": 80}}))


def test_the_report_gives_each_stage_test_count_and_target(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    write_records(work)
    result = subprocess.run([sys.executable, str(TOOL), "report", str(work), str(out)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["verdict"].startswith("FAILED: gtest") and "skipped: sanitizer" in summary["verdict"]
    assert [(s["stage"], s["outcome"]) for s in summary["stages"]] == [
        ("build", "passed"), ("gtest", "failed"), ("sanitizer", "skipped"), ("gpu-tests", "not run"),
        ("suite", "not run"), ("kernels", "not run")]
    gpu_tests = summary["tests"]["pytest-gpu"]
    assert (gpu_tests["passed"], gpu_tests["failed"], gpu_tests["skipped"]) == (1, 2, 1)
    assert gpu_tests["failed_tests"] == ["python.test_cuda.test_policy_time_on_nccl_makes_no_host_sync_once_decided",
                                         "python.test_cuda.test_x"]
    met = {t["target"].split(",")[0]: t["met"] for t in summary["targets"]}
    assert met["signsgd encode / copy_"] is True and met["terngrad encode / copy_"] is False
    assert met["qsgd encode / copy_"] is None  # not measured
    assert met["topk:ratio=0.01 encode / torch.topk(x.abs()"] is True
    assert met["gradcomp powersgd hook step / torch powerSGD_hook"] is False
    assert met["two-phase owner of qsgd"] is True  # 0.75 against the encodes' 0.7
    assert met["two-phase decode of topk:ratio=0.01"] is False  # 0.05 against topk's own encode share, 0.1
    assert met["no host-device sync in a DDP step of any codec (NCCL"] is True
    assert met['no host-device sync in a DDP step once policy="time" has decided (NCCL'] is False
    text = (out / "gpu_check.md").read_text()
    assert "# gpu_check: Some GPU" in text and "MISSED" in text and "not measured" in text
    assert result.stdout == text
