"""The trial's verdict between a challenger and plain, simulated: how often compression is taken, by the true ratio
of its step to plain's and the scatter of one round's ratio, with plain standing at the last round (the rule before
25fe062) or the quicker in the mean of all rounds (since).

    python benchmarks/results/policy_close_call_mean/simulate_close_calls.py

Each trial: 4 rounds, then rounds added one at a time while gradcomp.trial's rules leave it a close call, up to 48
(EXTEND x the default trial_steps); one round's ratio is normal around the true ratio. 10000 trials per row.
"""

import random
import statistics

from gradcomp.trial import EXTEND, clearly_quicker, gain_possible

FIRST_ROUNDS = 4
TRIALS = 10000


def compression_taken(true_ratio: float, scatter: float, mean_at_last_round: bool, rng: random.Random) -> tuple:
    ratios = [rng.gauss(true_ratio, scatter) for _ in range(FIRST_ROUNDS)]
    while True:
        if clearly_quicker(ratios):
            return True, len(ratios)
        if not gain_possible(ratios):
            return False, len(ratios)
        if len(ratios) >= EXTEND * FIRST_ROUNDS:
            return mean_at_last_round and statistics.fmean(ratios) < 1, len(ratios)
        ratios.append(rng.gauss(true_ratio, scatter))


def main() -> None:
    rng = random.Random(7)
    print(f"{'scatter':>7} {'true ratio':>10} {'taken, plain at the last round':>31} {'the mean at the last round':>27} "
          f"{'rounds (mean)':>13}")
    for scatter, true_ratios in ((0.12, (0.93, 0.95, 1.00, 1.05, 1.08)), (0.20, (0.90, 0.95, 1.00, 1.05, 1.10))):
        for true_ratio in true_ratios:
            before = [compression_taken(true_ratio, scatter, False, rng) for _ in range(TRIALS)]
            after = [compression_taken(true_ratio, scatter, True, rng) for _ in range(TRIALS)]
            print(f"{scatter:7.0%} {true_ratio:10.2f} {sum(t for t, _ in before) / TRIALS:31.1%} "
                  f"{sum(t for t, _ in after) / TRIALS:27.1%} {statistics.fmean(n for _, n in after):13.1f}")


if __name__ == "__main__":
    main()
