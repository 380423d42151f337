"""The committed runs' close calls that ran to their last round with plain standing: what the quicker-in-the-mean
rule (25fe062) would have chosen there, and how that option's timed steps compared with plain DDP's in the same round.

    python benchmarks/results/policy_close_call_mean/last_round_rule.py

Reads every benchmarks/results/**/policy.json (policy.py --trial-timings keeps each round's trial in its decision)
but warmup_pinning's interleaved_warmup/, whose trial steps took turns with other configurations' (20-500 ms steps).
A round counts where its trial ran to max_rounds, the challenger against plain, and plain stood; the mean is that of
the challenger's step over plain's, round by round, over every trial round that measured both. Where the challenger
sends one option for every bucket, the same round timed that option fixed: its median step and plain DDP's are taken
as multiples of the best of the codec's fixed options and plain DDP in that round (the figure the targets compare).
"""

import glob
import json
import os
import statistics

from gradcomp.trial import all_plain

RESULTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEFT_OUT = "interleaved_warmup"


def capped_rounds(path: str):
    with open(path) as file:
        data = json.load(file)
    step = {(r["world"], r["link"], r["model"], r["round"], r["config"]): statistics.median(r["step_s"])
            for r in data["runs"]}
    for run in data["runs"]:
        decision = run.get("decision")
        trial = decision.get("trial") if isinstance(decision, dict) else None
        if not trial or trial.get("chosen") is None or trial["rounds"] < trial.get("max_rounds", trial["rounds"] + 1):
            continue
        plain, challenger = all_plain(trial), trial["challenger"]
        if plain is None or challenger in (None, plain) or trial["chosen"] != plain:
            continue
        seconds = trial["round_step_s"]
        ratios = [c / p for c, p in zip(seconds[challenger], seconds[plain]) if c and p]
        codec = run["config"].removesuffix(" policy")
        key = (run["world"], run["link"], run["model"], run["round"])
        options = set(trial["choices"][challenger])
        fixed = step.get(key + (f"{codec} {options.pop()}",)) if len(options) == 1 else None
        plain_ddp = step[key + ("plain DDP",)]
        best = min([plain_ddp] + [s for k, s in step.items() if k[:4] == key and k[4].startswith(codec + " ")
                                  and not k[4].endswith(" policy")])
        yield {"run": os.path.relpath(os.path.dirname(path), RESULTS), "world": key[0], "link": key[1],
               "model": key[2], "round": key[3], "codec": codec, "challenger": challenger,
               "rounds": trial["rounds"], "mean_ratio": statistics.fmean(ratios),
               "plain_vs_best": plain_ddp / best, "option_vs_best": None if fixed is None else fixed / best}


def main() -> None:
    rows = [row for path in sorted(glob.glob(os.path.join(RESULTS, "**", "policy.json"), recursive=True))
            if LEFT_OUT not in path for row in capped_rounds(path)]
    taken = [r for r in rows if r["mean_ratio"] < 1]
    twins = [r for r in taken if r["option_vs_best"] is not None]
    print(f"{'run':58} {'W':>1} {'link':>8} {'model':>8} {'codec':16} {'r':>1} {'mean':>6} {'plain/best':>10} "
          f"{'option/best':>11}")
    for r in twins:
        print(f"{r['run'][:58]:58} {r['world']:1} {r['link']:>8} {r['model']:>8} {r['codec'][:16]:16} {r['round']:1} "
              f"{r['mean_ratio']:6.3f} {r['plain_vs_best']:10.3f} {r['option_vs_best']:11.3f}")
    print(f"\nclose calls that ran to the last round with plain standing: {len(rows)}; compression quicker in the mean: "
          f"{len(taken)}, {len(twins)} of them with one option for every bucket, timed fixed in the same round")
    print(f"of those {len(twins)}: the option's timed step quicker than plain DDP's in "
          f"{sum(r['option_vs_best'] < r['plain_vs_best'] for r in twins)}, slower in "
          f"{sum(r['option_vs_best'] > r['plain_vs_best'] for r in twins)}; over 1.05x the best: plain DDP in "
          f"{sum(r['plain_vs_best'] > 1.05 for r in twins)}, the option in "
          f"{sum(r['option_vs_best'] > 1.05 for r in twins)}")
    print(f"compression slower in the mean (plain stands either way): {len(rows) - len(taken)}")


if __name__ == "__main__":
    main()
