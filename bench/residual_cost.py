"""How long the search's residual model takes to fit as a study grows.

The search refits the residual model (autotune.search.residuals) before every proposal, on
every point the study measured. Its fit is a few dozen evaluations of the marginal likelihood
and its gradient, each a Cholesky factorization and an inverse of the n x n covariance of the
n measured points: O(n^3). This prints the fit's and a prediction's wall time at growing n on
one BLAS thread (the tuner's process shares its node's cores with the probes), with the goal
beside them: a fit under 1 s at 440 points, the largest study the search benchmark grew (it
took 1.4 s on a busy 2-core node, and 0.66 s on a quiet one, before the inverse was taken
once instead of through two general solves per column).

The observations are synthetic: configurations of llama-7b's space on 8 GPUs, micro-batches
1-1024, log-normal ratios (sd 0.15) from a fixed seed; the fit's cost depends on their number,
not their values.

    OPENBLAS_NUM_THREADS=1 python bench/residual_cost.py
"""

from __future__ import annotations

import math
import os
import random
import time

from autotune.search.residuals import Observation, ResidualModel
from autotune.space import configurations

SIZES = (50, 100, 200, 440)
GOAL_S = 1.0
"""A fit at the largest size, in seconds."""


def main() -> None:
    if os.environ.get("OPENBLAS_NUM_THREADS") != "1":
        print("note: run with OPENBLAS_NUM_THREADS=1 for the one-thread figure")
    configs = configurations(world_size=8, num_layers=32)
    rng = random.Random(0)
    print(f"{'points':>7} {'fit':>9} {'predict':>9}  (one prediction per configuration)")
    fit_s = 0.0
    for n in SIZES:
        observations = [
            Observation(
                config=configs[i % len(configs)],
                micro_batch_size=2 ** (i // len(configs)),
                ratio=math.exp(rng.gauss(0.0, 0.15)),
            )
            for i in range(n)
        ]
        began = time.perf_counter()
        model = ResidualModel(observations)
        fit_s = time.perf_counter() - began
        began = time.perf_counter()
        model.predict([(config, 4) for config in configs])
        predict_s = time.perf_counter() - began
        print(f"{n:>7} {fit_s:>8.3f}s {predict_s:>8.3f}s")
    verdict = "met" if fit_s < GOAL_S else "NOT met"
    print(f"goal: a fit at {SIZES[-1]} points under {GOAL_S:.1f} s: {fit_s:.3f} s, {verdict}")


if __name__ == "__main__":
    main()
