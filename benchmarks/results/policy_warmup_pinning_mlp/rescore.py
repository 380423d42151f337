"""Re-scores the cost model's predictions in policy.json files under other queue models, offline.

Every decision in a policy.json keeps, per bucket, each option's predicted parts (encode, wire, decode, middle,
second, held; the collectives already at the link load) and backward's offsets. This recomputes each option's
exposed time from them under:
    current         gradcomp.policy.exposed, the model that decided;
    hook +0.35 ms   the same, each hook call 0.35 ms longer on backward's thread (what an in-step timeline showed
                    beyond the encodes; a constant, not measured per job);
    shared core s   the hook's thread (backward, then the encodes) and the collectives' thread (the wire, then its
                    callback's middle or decode) share one processor per rank: while both compute, each runs at s
                    of its speed (0.5: one core between them).
and counts, per file, the rows (a fixed option or plain DDP, one world size, link and model) whose predicted
exposed time is within 25% of the measured one; medians over the rounds, as benchmarks/policy.py counts them (the
policy's own rows are left out: what they sent varies by round).

    python rescore.py FILE.json [FILE.json ...]
"""

import collections
import json
import math
import statistics
import sys

from gradcomp.policy import Cost, exposed


def shared_core(ready: list[float], costs: list[Cost], share: float) -> float:
    """Exposed seconds when the hook's thread and the collectives' thread share one processor (see above)."""
    n = len(costs)
    hook = []  # [work left, what it is] in order: bucket 0's encode, backward to bucket 1, its encode, ...
    for i, cost in enumerate(costs):
        if i:
            hook.append([max(ready[i] - ready[i - 1], 0.0), ("backward", i)])
        hook.append([cost.on_hook_thread, ("encode", i)])
    link = []  # [kind: "wire" or "compute", work left, bucket, round]
    first_done, second_issued, launched, t = [False] * n, [False] * n, False, 0.0

    def issue_second_round():  # in bucket order, each once its first round (and middle) is done
        for i, cost in enumerate(costs):
            if second_issued[i]:
                continue
            if cost.second and not first_done[i]:
                return
            second_issued[i] = True
            if cost.second:
                link.extend([["wire", cost.second, i, 2], ["compute", cost.decode, i, 2]])

    while True:
        while hook and hook[0][0] <= 1e-15:
            _, (what, i) = hook.pop(0)
            if what == "encode":
                cost = costs[i]
                after = cost.middle + (0.0 if cost.second else cost.decode)
                link.extend([["wire", cost.wire, i, 1], ["compute", after, i, 1]])
                launched = launched or i == n - 1
        while link and link[0][1] <= 1e-15:
            kind, _, i, round_ = link.pop(0)
            if kind == "compute" and round_ == 1:
                first_done[i] = True
        if launched:
            issue_second_round()
        if hook and hook[0][0] <= 1e-15 or link and link[0][1] <= 1e-15:
            continue
        if not hook and not link:
            return max(t - ready[-1], 0.0)
        both = bool(hook) and bool(link) and link[0][0] == "compute"
        hook_rate = share if both else 1.0
        link_rate = share if both else 1.0  # a wire runs at its own pace beside the hook's thread
        step = min(hook[0][0] / hook_rate if hook else math.inf, link[0][1] / link_rate if link else math.inf)
        t += step
        if hook:
            hook[0][0] -= step * hook_rate
        if link:
            link[0][1] -= step * link_rate


def hook_overhead(ready, costs, seconds=0.35e-3):
    return exposed(ready, [Cost(c.encode + seconds, *c.parts()[1:]) for c in costs])


MODELS = {"current": exposed, "hook +0.35 ms": hook_overhead,
          **{f"shared core {s}": (lambda s: lambda r, c: shared_core(r, c, s))(s) for s in (0.5, 0.7)}}


def option(config: str) -> str | None:
    return "plain" if config == "plain DDP" else None if config.endswith(("policy", "(limit)")) else \
        config.rsplit(" ", 1)[1]


def rescore(path: str) -> dict[str, tuple[int, int]]:
    runs = json.load(open(path))["runs"]
    rounds = collections.defaultdict(list)
    for run in runs:
        rounds[(run["world"], run["link"], run["model"], run["round"])].append(run)
    pairs = {name: collections.defaultdict(list) for name in MODELS}  # row -> [(predicted, measured)] per round
    for (world, link, model, _), entries in rounds.items():
        measured = {(e["spec"] if option(e["config"]) != "plain" else None, option(e["config"])):
                    statistics.median(e["exposed_s"]) for e in entries if option(e["config"])}
        for entry in entries:
            if not entry["config"].endswith("policy") or not entry["decision"]:
                continue
            decision = entry["decision"]
            ready = [b["ready_s"] for b in decision["buckets"]]
            for name in decision["options"]:
                seen = measured.get((None if name == "plain" else entry["spec"], name))
                if not seen:
                    continue
                costs = [Cost(*b["predicted_s"][name]) for b in decision["buckets"]]
                for model_name, predict in MODELS.items():
                    pairs[model_name][(world, link, model, entry["spec"], name)].append((predict(ready, costs), seen))
    scores = {}
    for model_name, rows in pairs.items():
        ratios = [statistics.median(p for p, _ in v) / statistics.median(m for _, m in v) for v in rows.values()]
        scores[model_name] = (sum(abs(r - 1) <= 0.25 for r in ratios), len(ratios))
    return scores


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(path, ", ".join(f"{name} {ok}/{total}" for name, (ok, total) in rescore(path).items()))
