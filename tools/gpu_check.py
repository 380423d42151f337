"""tools/gpu_check.sh's Python half.

    python tools/gpu_check.py probe WORK_DIR          # one line: torch, its CUDA, GPUs, compute capability, name
    python tools/gpu_check.py report WORK_DIR OUT_DIR  # gpu_check.md and gpu_check.json from WORK_DIR's records

probe also writes WORK_DIR/machine.json. report reads what the stages left in WORK_DIR (stages.tsv, the
GoogleTest and pytest XML reports, kernels_cuda.json, two_phase_ops_cuda.json) and checks the speed
targets, each a ratio within one run:
  - signsgd, terngrad, qsgd and randomk encode at 70% or more of the device-to-device copy_ bandwidth
    (the 25 MB bucket, DDP's default);
  - topk(0.01) on 64M elements (256 MB) at least 5x the throughput of torch.topk(x.abs(), k);
  - the PowerSGD hook step at most 0.5x torch's powerSGD_hook's (ResNet-18's buckets);
  - the two-phase ops (encode_chunks, reencode_sum, decode_chunks) at the same share of copy_ as the
    encodes: 70% for signsgd, terngrad and qsgd; topk's own encode share for topk;
  - no host-device sync in a DDP step of any codec, nor in one after policy="time" has decided (the two tests in
    NO_SYNC_TESTS).
A target whose measurement is missing is reported as not measured. It prints the summary and exits 0;
gpu_check.sh decides its exit from the stages.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ENCODE_SHARE = 0.70
ENCODE_SIZE_MB = 25.0
ENCODE_CODECS = ("signsgd", "terngrad", "qsgd", "randomk:ratio=0.01")
TOPK_SPEC, TOPK_SIZE_MB, TOPK_SPEEDUP = "topk:ratio=0.01", 256.0, 5.0
POWERSGD_HOOK_RATIO = 0.5
NO_SYNC_TESTS = {  # test -> the target it shows
    "test_a_ddp_step_of_every_codec_makes_no_host_sync":
        "no host-device sync in a DDP step of any codec (NCCL, sync debug mode 'error')",
    "test_policy_time_on_nccl_makes_no_host_sync_once_decided":
        "no host-device sync in a DDP step once policy=\"time\" has decided (NCCL, sync debug mode 'error')",
}
STAGES = ("build", "gtest", "sanitizer", "gpu-tests", "suite", "kernels")


def probe(work: Path) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = None
    if count:
        properties = torch.cuda.get_device_properties(0)
        gpu = {"name": properties.name, "compute_capability": f"{properties.major}{properties.minor}",
               "memory_gib": round(properties.total_memory / 2**30, 1),
               "multiprocessors": properties.multi_processor_count}
    machine = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
               "gpus": count, "gpu": gpu, "nvcc": os.environ.get("CUDACXX") or None,
               "compute_sanitizer": os.environ.get("SANITIZER") or None, "cpu_cores": os.cpu_count(),
               "platform": platform.platform()}
    work.mkdir(parents=True, exist_ok=True)
    (work / "machine.json").write_text(json.dumps(machine, indent=1) + "\n")
    print(torch.__version__, torch.version.cuda or "none", count, gpu["compute_capability"] if gpu else "-",
          gpu["name"] if gpu else "-")


# ------------------------------------------------------------------------------------------ report

def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_stages(work: Path) -> list[dict]:
    stages = {}
    try:
        lines = (work / "stages.tsv").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        name, outcome, seconds, note = (line.split("\t") + [""] * 4)[:4]
        stages[name] = {"stage": name, "outcome": outcome, "seconds": int(seconds or 0), "note": note}
    missing = {"outcome": "not run", "seconds": 0, "note": "the script stopped before it"}
    return [stages.get(name, {"stage": name, **missing}) for name in STAGES]


def read_junit(path: Path) -> dict | None:
    """Counts of a GoogleTest or pytest XML report, the failed tests' names, and each test's outcome."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    outcomes = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}.{case.get('name', '')}".strip(".")
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[name] = "failed"
        elif case.find("skipped") is not None or case.get("result") == "skipped" or case.get("status") == "notrun":
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    counts = {kind: sum(1 for o in outcomes.values() if o == kind) for kind in ("passed", "failed", "skipped")}
    return {**counts, "failed_tests": sorted(n for n, o in outcomes.items() if o == "failed"), "outcomes": outcomes}


def target(name: str, measured: float | None, threshold: float, higher_is_better: bool, unit: str) -> dict:
    met = None if measured is None else (measured >= threshold if higher_is_better else measured <= threshold)
    return {"target": name, "measured": None if measured is None else round(measured, 3),
            "threshold": f"{'>=' if higher_is_better else '<='} {threshold:g}{unit}", "met": met}


def kernel_row(kernels: dict | None, codec: str, size_mb: float) -> dict | None:
    rows = (kernels or {}).get("results", [])
    return next((row for row in rows if row["codec"] == codec and row["size_mb"] == size_mb), None)


def speed_targets(kernels: dict | None, two_phase: dict | None, gpu_tests: dict | None) -> list[dict]:
    targets = []
    for codec in ENCODE_CODECS:
        row = kernel_row(kernels, codec, ENCODE_SIZE_MB)
        targets.append(target(f"{codec} encode / copy_, {ENCODE_SIZE_MB:g} MB", row and row["enc_over_copy"],
                              ENCODE_SHARE, True, ""))
    row = kernel_row(kernels, TOPK_SPEC, TOPK_SIZE_MB)
    targets.append(target(f"{TOPK_SPEC} encode / torch.topk(x.abs(), k), {TOPK_SIZE_MB:g} MB (64M elements)",
                          row and row["enc_over_torch_topk"], TOPK_SPEEDUP, True, "x"))
    hook = (kernels or {}).get("powersgd_hook_step") or {}
    targets.append(target("gradcomp powersgd hook step / torch powerSGD_hook, ResNet-18 buckets",
                          hook.get("gradcomp_over_torch"), POWERSGD_HOOK_RATIO, False, "x"))
    topk_encode = kernel_row(kernels, TOPK_SPEC, ENCODE_SIZE_MB)
    for row in (two_phase or {}).get("rows", []):
        share = topk_encode and topk_encode["enc_over_copy"] if row["codec"].startswith("topk") else ENCODE_SHARE
        name = f"two-phase {row['phase']} of {row['codec']}, W={row['world']} / copy_"
        if share is None:
            targets.append(target(name, None, 0, True, " (topk's encode share, not measured)"))
        else:
            targets.append(target(name, row["fused_vs_copy"], round(share, 3), True, ""))
    outcomes = (gpu_tests or {}).get("outcomes") or {}
    for test, shown in NO_SYNC_TESTS.items():
        outcome = next((result for name, result in outcomes.items() if name.endswith(test)), None)
        targets.append({"target": shown, "measured": outcome, "threshold": "passed",
                        "met": None if outcome in (None, "skipped") else outcome == "passed"})
    return targets


def cell(value) -> str:
    if value is None:
        return "-"
    return str(value)


def verdict_cell(met: bool | None) -> str:
    return {True: "met", False: "MISSED", None: "not measured"}[met]


def markdown(summary: dict) -> str:
    machine = summary["machine"] or {}
    gpu = machine.get("gpu") or {}
    lines = [f"# gpu_check: {gpu.get('name', 'no GPU')}", "",
             f"torch {machine.get('torch')} (CUDA {machine.get('torch_cuda') or 'none'}), "
             f"python {machine.get('python')}, "
             f"{machine.get('cpu_cores')} CPU cores; nvcc {machine.get('nvcc') or 'none'}; compute-sanitizer "
             f"{machine.get('compute_sanitizer') or 'none'}" + (f"; compute capability {gpu['compute_capability']}, "
                                                      f"{gpu['memory_gib']} GiB" if gpu else ""),
             "", f"**{summary['verdict']}**", "", "| stage | outcome | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {s['stage']} | {s['outcome']} | {s['seconds']} | {s['note']} |" for s in summary["stages"]]
    lines += ["", "| tests | passed | failed | skipped |", "|---|---|---|---|"]
    for name, counts in summary["tests"].items():
        if counts:
            lines.append(f"| {name} | {counts['passed']} | {counts['failed']} | {counts['skipped']} |")
    failed = [f"{name}: {test}" for name, counts in summary["tests"].items() if counts
              for test in counts["failed_tests"]]
    if failed:
        lines += ["", "Failed tests:", *[f"- {test}" for test in failed[:40]]]
    lines += ["", "| speed target | measured | wanted | |", "|---|---|---|---|"]
    lines += [f"| {t['target']} | {cell(t['measured'])} | {t['threshold']} | {verdict_cell(t['met'])} |"
              for t in summary["targets"]]
    return "\n".join(lines) + "\n"


def report(work: Path, out: Path) -> None:
    tests = {name: read_junit(work / f"{name}.xml") for name in ("gtest", "pytest-gpu", "pytest-suite")}
    kernels = read_json(work / "kernels_cuda.json")
    two_phase = read_json(work / "two_phase_ops_cuda.json")
    stages = read_stages(work)
    targets = speed_targets(kernels, two_phase, tests["pytest-gpu"])
    failed = [s["stage"] for s in stages if s["outcome"] == "failed"]
    skipped = [s["stage"] for s in stages if s["outcome"] == "skipped"]
    missed = [t["target"] for t in targets if t["met"] is False]
    verdict = (f"FAILED: {', '.join(failed)}" if failed else "every stage that ran passed") + \
        (f"; skipped: {', '.join(skipped)}" if skipped else "") + \
        (f"; {len(missed)} speed target(s) missed" if missed else "")
    summary = {"verdict": verdict, "machine": read_json(work / "machine.json"), "stages": stages,
               "tests": {name: counts and {k: v for k, v in counts.items() if k != "outcomes"}
                         for name, counts in tests.items()},
               "targets": targets}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = markdown(summary)
    (out / "gpu_check.md").write_text(text)
    print(text, end="")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "probe":
        probe(Path(argv[1]))
    elif len(argv) == 3 and argv[0] == "report":
        report(Path(argv[1]), Path(argv[2]))
    else:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
