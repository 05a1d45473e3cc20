"""What timing noise leaves any search: the probes it takes to tell the two fastest
configurations apart, even for a search told which two they are.

Under a structure's timing noise (``noise-5``: 5 % between repeats of a point, ``noise-10``:
10 %; ``bench/search-sets.json``) a search must end on a configuration within 2 % of the
fastest by what it measured. This bench gives a search more than any real one has: the two
fastest configurations of each run (each at its best micro-batch, by the simulated GPU's
noise-free truth) and every error term they share (the engine's and the offload's factors),
so only each one's own error (uniform within 5 %) and the noise are unknown. It measures the
two alternately, each a probe drawing the structure's noise, until their posterior means
(the measurements' mean combined with the known shared terms, a normal prior of each one's
own error) differ by ``z`` standard errors or the probes reach a cap, and picks the larger.
Per cap and ``z``: the runs within 2 % of the fastest (scaled to 24) and the probes a run it
spent on the two alone. What it spends is a floor for any search, which must also find the
two (the exploration: 13.3 probes a run when issue 43 was filed, ``docs/search.md``); the
goal beside: 23 of 24 within 2 % at no more than 1.5 x 13.3 probes a run in all.

The runs are the scenarios of the sets ``robust``, ``robust-2`` and ``robust-3`` under the
structure (the seeds of those sets); nothing here was tuned: the Monte Carlo's seed is fixed
and its 400 draws a run put each figure within about 0.1 of 24.

    python bench/noise_bound.py [--structures noise-5,noise-10] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import search_efficiency as efficiency

from autotune.space import micro_batch_options

SETS = ("robust", "robust-2", "robust-3")
CAPS = (10, 20, 40, 80)
ZS = (1.5, 2.5)
DRAWS = 400
OWN_SD = 0.10 / math.sqrt(12)
"""Standard deviation of a configuration's own error, uniform in 0.95-1.05 (log units)."""
BASELINE_PROBES = 13.3
"""Mean probes a run when issue 43 was filed (docs/search.md): the goal allows 1.5x it."""


def fastest_two(structure: str) -> list[list[tuple[float, float]]]:
    """Per run: the two fastest configurations' (true value, value without their own error),
    each at its best micro-batch size; runs where nothing fits are left out."""
    runs = []
    for name in SETS:
        for _, s in efficiency._set_scenarios(name, 99, 3, [structure]):
            found = []
            for config in efficiency._space(s):
                value, mbs = max(
                    (efficiency.true_value(s, config, m), m)
                    for m in micro_batch_options(s.workload)
                )
                if value > 0:
                    own = s.device.errors[0]
                    assert own.by == ("config",), "the structure's first term is each its own"
                    _, time = own.factors(s.device.seed, 0, s.model_name, config, mbs)
                    found.append((value, value * time))
            if found:
                runs.append(sorted(found, reverse=True)[:2])
    return runs


def tell_apart(
    runs: list[list[tuple[float, float]]], noise: float, cap: int, z: float, seed: int = 0
) -> tuple[float, float]:
    """(runs within 2 % out of 24, probes a run) of the sequential test described above."""
    rng = random.Random(seed)
    within = spent = 0.0
    for top in runs:
        if len(top) < 2:  # one configuration fits: nothing to tell apart
            within += DRAWS
            continue
        prior = [math.log(center) for _, center in top]
        for _ in range(DRAWS):
            sums, counts = [0.0, 0.0], [0, 0]
            while True:
                i = 0 if counts[0] <= counts[1] else 1
                sums[i] += math.log(top[i][0] * max(0.5, rng.gauss(1.0, noise)))
                counts[i] += 1
                if not all(counts):
                    continue
                precision = [n / noise**2 + 1 / OWN_SD**2 for n in counts]
                means = [(sums[k] / noise**2 + prior[k] / OWN_SD**2) / precision[k] for k in (0, 1)]
                error = math.sqrt(sum(1 / p for p in precision))
                if abs(means[0] - means[1]) > z * error or sum(counts) >= cap:
                    break
            pick = 0 if means[0] >= means[1] else 1
            within += top[pick][0] >= (1 - efficiency.WITHIN) * top[0][0]
            spent += sum(counts)
    return 24 * within / DRAWS / len(runs), spent / DRAWS / len(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--structures", default="noise-5,noise-10")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for structure in args.structures.split(","):
        noise = efficiency.NOISES[structure]
        runs = fastest_two(structure)
        for cap in CAPS:
            for z in ZS:
                within, probes = tell_apart(runs, noise, cap, z)
                rows.append(
                    {
                        "structure": structure,
                        "noise": noise,
                        "runs": len(runs),
                        "cap": cap,
                        "z": z,
                        "within_of_24": round(within, 1),
                        "probes_on_the_two": round(probes, 1),
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    allowed = 1.5 * BASELINE_PROBES
    print(
        f"goal: >= 23 of 24 within 2 %, <= {allowed:.1f} probes a run in all "
        f"(exploration included: {BASELINE_PROBES} probes a run when the goal was set)"
    )
    print(f"{'structure':<10} {'cap':>4} {'z':>4}  {'within 2 %':>12}  probes a run on the two")
    for r in rows:
        print(
            f"{r['structure']:<10} {r['cap']:>4} {r['z']:>4}  "
            f"{r['within_of_24']:>6.1f} of 24  {r['probes_on_the_two']:>6.1f}"
        )


if __name__ == "__main__":
    main()
