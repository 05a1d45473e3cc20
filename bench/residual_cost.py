"""How long the search's residual model takes to fit as a study grows.

The search refits the residual model (autotune.search.residuals) before every proposal, on
every point the study measured. Its fit is a few dozen evaluations of the marginal likelihood
and its gradient, each a Cholesky factorization and an inverse of the n x n covariance of the
n measured points: O(n^3); where some configurations are far off, up to three more rounds of
the configurations' mixture, each a third of the evaluations. This prints the fit's and a
prediction's wall time at growing n, on the one BLAS thread the model holds itself to (the
tuner's process shares its node's cores with the probes), with the goal beside them: a fit
under 1 s at 440 points, the largest study the search benchmark grew (it took 1.4 s on a busy
2-core node, and 0.66 s on a quiet one, before the inverse was taken once instead of through
two general solves per column).

The observations are synthetic: configurations of llama-7b's space on 8 GPUs, micro-batches
1-1024, log-normal ratios (sd 0.15) from a fixed seed, and the same with one configuration in
ten 2.5x off (the mixture's rounds run).

    python bench/residual_cost.py
"""

from __future__ import annotations

import math
import random
import time

from autotune.search.residuals import Observation, ResidualModel
from autotune.space import configurations

SIZES = (50, 100, 200, 440)
GOAL_S = 1.0
"""A fit at the largest size, in seconds."""


def main() -> None:
    configs = configurations(world_size=8, num_layers=32)
    print(f"{'points':>7} {'fit':>9} {'with outliers':>14} {'predict':>9}  (one per configuration)")
    worst = 0.0
    for n in SIZES:
        fits = []
        for far in (False, True):
            rng = random.Random(0)
            observations = [
                Observation(
                    config=configs[i % len(configs)],
                    micro_batch_size=2 ** (i // len(configs)),
                    ratio=math.exp(rng.gauss(0.0, 0.15))
                    * (2.5 if far and (i % len(configs)) % 10 == 3 else 1.0),
                )
                for i in range(n)
            ]
            began = time.perf_counter()
            model = ResidualModel(observations)
            fits.append(time.perf_counter() - began)
        began = time.perf_counter()
        model.predict([(config, 4) for config in configs])
        predict_s = time.perf_counter() - began
        worst = max(fits)
        print(f"{n:>7} {fits[0]:>8.3f}s {fits[1]:>13.3f}s {predict_s:>8.3f}s")
    verdict = "met" if worst < GOAL_S else "NOT met"
    print(f"goal: a fit at {SIZES[-1]} points under {GOAL_S:.1f} s: {worst:.3f} s, {verdict}")


if __name__ == "__main__":
    main()
