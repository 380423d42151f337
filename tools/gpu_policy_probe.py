"""policy="time" on a GPU: the decisions of tests/python/test_cuda.py's policy configurations (its scenario
policy_scenarios.on_gpu: 2 ranks on cuda:0 over gloo, then world size 1 on NCCL), as JSON on stdout and in OUT.

    PYTHONPATH=build/gpu-check/site python3 tools/gpu_policy_probe.py OUT.json   # after gpu_check.sh's build stage
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from ddp_harness import run_ranks, unwrap
import policy_scenarios
from test_cuda import POLICY_ON_GPU


def main():
    out = {}
    for world in (2, 1):
        start = time.perf_counter()
        results = unwrap(run_ranks(policy_scenarios.on_gpu, world, (POLICY_ON_GPU, 8), timeout=600))
        for name, run in results[0].items():
            decision = run["decision"]
            trial = decision.get("trial") or {}
            buckets = sorted(decision["buckets"], key=lambda b: b["index"])
            out[f"{name} world={world}"] = {
                "stood_at_step": run["stood"], "error": run["error"],
                "choices": [b["choice"] for b in buckets], "bucket_bytes": [b["bytes"] for b in buckets],
                "trial_chosen": trial.get("chosen"), "trial_measured_step_s": trial.get("measured_step_s"),
                "plain_step_s": trial.get("plain_step_s"),
                "plain_window_s": decision["plain_window_s"], "backward_skew_s": decision["backward_skew_s"],
                "link_load": decision["link_load"],
                "predicted_exposed_s": decision["predicted_exposed_s"], "held_out": run["held_out"]}
        print(f"world {world}: {time.perf_counter() - start:.1f} s", flush=True)
    text = json.dumps(out, indent=1, default=str)
    print(text)
    open(sys.argv[1], "w").write(text)


if __name__ == "__main__":
    main()
