"""Leave-one-out figures for the time model's constants fitted on the first H100 run.

Eight constants of ``autotune/estimator/timing.py`` were fitted to the probes of
``measurements/h100-2026-11-23`` (docs/time-model.md, "Constants and their sources"). Checking
the model on those same probes shows how well the fit went, not how well it predicts. This
script refits each constant the way its comment says it was fitted (the same rows, the same
measured quantity, least squares on the log), then, for every ok size of the run:

- **in-sample**: the error of the shipped model at that size;
- **leave-one-out**: every constant whose fit used that size refitted without that size's
  probe (all its sizes: they share one optimizer step and one process, so leaving out one
  size alone would leave its twin in), and the size predicted with the refitted constants.
  Where a constant was fitted on that probe alone, no fit is left: the row says so and is
  left out of the leave-one-out summary.

The constants, their rows and their measured quantity (``GROUPS``):

- Hopper's sustained factor ``s`` and the host/GPU overlap norm ``p``, jointly: the single
  rows' tokens/s;
- fused Adam's share of HBM bandwidth: the single rows' optimizer step;
- FSDP2's host step cost per block: ``c1-fsdp-0``'s optimizer step;
- host Adam's parameters per second per core: the fsdp off:params rows' optimizer step;
- ZeRO-3's host step beyond Adam: the deepspeed z3 off:optimizer rows' optimizer step;
- DeepSpeed's offload copy efficiency: the deepspeed off:optimizer rows' micro-step;
- FSDP2's offload copy efficiency: ``llama-7b-run-2``'s micro-step.

Each fit is a search over a grid of the constant's values (log-spaced, or a product grid for
``s`` and ``p``) with every other constant at its shipped value. Errors are predicted /
measured - 1 of tokens/s at the probe's accumulation (one micro-step per step).

The memory model's allocator shares (``autotune.estimator.memory.fragmentation``: free bytes
the caching allocator cannot hand out, per activation byte, one share per family) decide fit
verdicts. They were chosen from the run's OOM readings so that every verdict of the run is
right. Here each size of the run (ok and OOM alike) is left out with its probe, and the share
of its family is taken anywhere in the interval the other probes' verdicts allow: the
left-out size's verdict is *decided* when every share of that interval gives the measured
outcome, *wrong* when none does, and *open* otherwise (the other probes do not pin it).

The host model's two fitted constants: each engine's process baseline (the peak RSS of the
probes that offload nothing: single alone, FSDP2 for every distributed engine, rounded to
0.1 GiB) is refitted without the probe and the probe's peak RSS predicted; the node's reserve
(``HOST_RESERVE_BYTES``, chosen so the 118 GiB probe fits the 125 GiB node) is judged like the
shares: each offloading probe's verdict (ran, or killed by the OOM killer) with the reserve
anywhere 0-16 GiB the other probes' verdicts allow.

    python bench/leave_one_out.py [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.config import Engine, Offload, TrainConfig
from autotune.estimator import host, memory, timing
from autotune.estimator.plan import usable_bytes
from autotune.estimator.timing import StepTime, predict_step_time
from autotune.hardware import gpu_spec
from autotune.hardware.lookup import driver_spec
from autotune.models import resolve_model
from autotune.probe.outcome import Outcome
from autotune.probe.result import ProbeResult

FOLDER = Path(__file__).parents[1] / "measurements" / "h100-2026-11-23"
H100 = gpu_spec("h100-80gb")
HOST_CORES = 16
"""The node's CPU cores (measurements/h100-2026-11-23/README.md)."""


@dataclass(frozen=True)
class Point:
    """One ok size of one probe of the run."""

    probe: str
    model: str
    config: TrainConfig
    micro_batch_size: int
    seq_len: int
    micro_step_s: float
    optimizer_step_s: float

    @property
    def label(self) -> str:
        return f"{self.probe} {self.config.label()} mbs {self.micro_batch_size}"

    @property
    def tokens_per_second(self) -> float:
        return self.micro_batch_size * self.seq_len / (self.micro_step_s + self.optimizer_step_s)

    def predict(self) -> StepTime:
        return predict_step_time(
            resolve_model(self.model), self.config, H100, micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len, grad_accum=1, world_size=1, host_cores=HOST_CORES,
        )  # fmt: skip

    def predicted_tokens_per_second(self) -> float:
        step = self.predict()
        return self.micro_batch_size * self.seq_len / (step.micro_step_s + step.optimizer_step_s)


def _probes(folder: Path = FOLDER) -> dict[str, ProbeResult]:
    """Every probe of the run by file stem (the plan file aside)."""
    return {
        path.stem: ProbeResult.from_dict(json.loads(path.read_text()))
        for path in sorted(folder.glob("*.json"))
        if not path.stem.endswith("-plan")
    }


def points(folder: Path = FOLDER) -> list[Point]:
    """Every ok size of the run's probes (one rank, one micro-step per step)."""
    found = []
    for stem, result in _probes(folder).items():
        spec = result.spec
        assert spec.grad_accum == 1 and spec.num_processes == 1, stem
        for size in result.ok_sizes():
            if size.micro_step_s is None or size.optimizer_step_s is None:
                continue
            found.append(
                Point(
                    stem, spec.model, spec.config, size.micro_batch_size, spec.seq_len,
                    size.micro_step_s, size.optimizer_step_s,
                )
            )  # fmt: skip
    return found


Quantity = Callable[[Point, StepTime | None], float]
"""A measured quantity of a point (the step time None) or its prediction."""


def _tokens(p: Point, step: StepTime | None) -> float:
    if step is None:
        return p.tokens_per_second
    return p.micro_batch_size * p.seq_len / (step.micro_step_s + step.optimizer_step_s)


def _micro(p: Point, step: StepTime | None) -> float:
    return p.micro_step_s if step is None else step.micro_step_s


def _optimizer(p: Point, step: StepTime | None) -> float:
    return p.optimizer_step_s if step is None else step.optimizer_step_s


@dataclass(frozen=True)
class Constant:
    """A module constant of the time model (``key``: an entry of a dict constant)."""

    name: str
    low: float
    high: float
    key: str | None = None

    def get(self) -> float:
        value = getattr(timing, self.name)
        return float(value[self.key] if self.key else value)

    def set(self, value: float) -> None:
        if self.key:
            getattr(timing, self.name)[self.key] = value
        else:
            setattr(timing, self.name, value)

    def grid(self, n: int) -> list[float]:
        step = math.log(self.high / self.low) / (n - 1)
        return [self.low * math.exp(i * step) for i in range(n)]


@dataclass(frozen=True)
class Group:
    """Constants fitted together, on the points ``rows`` selects, to ``quantity``."""

    about: str
    constants: tuple[Constant, ...]
    rows: Callable[[Point], bool]
    quantity: Quantity

    def fit(self, chosen: list[Point]) -> tuple[float, ...]:
        """The values minimizing the squared log error over ``chosen``."""
        grids = [c.grid(61 if len(self.constants) == 1 else 41) for c in self.constants]
        best, best_loss = None, math.inf
        for values in itertools.product(*grids):
            with assigned(dict(zip(self.constants, values, strict=True))):
                loss = sum(
                    math.log(self.quantity(p, p.predict()) / self.quantity(p, None)) ** 2
                    for p in chosen
                )
            if loss < best_loss:
                best, best_loss = values, loss
        assert best is not None
        return best


@contextmanager
def assigned(values: dict[Constant, float]) -> Iterator[None]:
    """The time model with ``values``, restored after."""
    before = {c: c.get() for c in values}
    try:
        for c, v in values.items():
            c.set(v)
        yield
    finally:
        for c, v in before.items():
            c.set(v)


def _single(p: Point) -> bool:
    return p.config.engine.value == "single"


def _engine_offload(engine: str, offload: Offload, stage: int | None = None) -> Callable:
    def rows(p: Point) -> bool:
        c = p.config
        return (
            c.engine.value == engine
            and c.offload is offload
            and (stage is None or c.zero_stage == stage)
        )

    return rows


GROUPS = (
    Group(
        "Hopper sustained factor s and overlap norm p (single rows, tokens/s)",
        (Constant("_SUSTAINED", 0.7, 1.1, key="hopper"), Constant("_OVERLAP_NORM", 1.2, 8.0)),
        _single,
        _tokens,
    ),
    Group(
        "fused Adam's share of HBM bandwidth (single rows, optimizer step)",
        (Constant("_ADAM_HBM_EFFICIENCY", 0.2, 1.2),),
        _single,
        _optimizer,
    ),
    Group(
        "FSDP2 host step per block (c1-fsdp-0, optimizer step)",
        (Constant("_FSDP_STEP_HOST_PER_LAYER_S", 0.05e-3, 3e-3),),
        _engine_offload("fsdp", Offload.NONE),
        _optimizer,
    ),
    Group(
        "host Adam per core (fsdp off:params rows, optimizer step)",
        (Constant("_HOST_ADAM_PARAMS_PER_CORE_S", 5e7, 2e9),),
        _engine_offload("fsdp", Offload.PARAMS),
        _optimizer,
    ),
    Group(
        "ZeRO-3 host step beyond Adam (deepspeed z3 off:optimizer, optimizer step)",
        (Constant("_ZERO3_HOST_STEP_PARAMS_PER_CORE_S", 2e7, 2e9),),
        _engine_offload("deepspeed", Offload.OPTIMIZER, stage=3),
        _optimizer,
    ),
    Group(
        "DeepSpeed offload copy efficiency (deepspeed off:optimizer, micro-step)",
        (Constant("_DEEPSPEED_COPY_EFFICIENCY", 0.1, 1.5),),
        _engine_offload("deepspeed", Offload.OPTIMIZER),
        _micro,
    ),
    Group(
        "FSDP2 offload copy efficiency (llama-7b-run-2, micro-step)",
        (Constant("_FSDP_COPY_EFFICIENCY", 0.2, 2.0),),
        lambda p: p.probe == "llama-7b-run-2",
        _micro,
    ),
)


def leave_one_out(every: list[Point]) -> list[dict[str, Any]]:
    """Per point: its in-sample error and its leave-one-probe-out error (None where a constant
    it needs was fitted on its probe alone)."""
    rows = []
    for p in every:
        in_sample = p.predicted_tokens_per_second() / p.tokens_per_second - 1
        refitted: dict[Constant, float] = {}
        alone: list[str] = []
        for group in GROUPS:
            if not group.rows(p):
                continue
            others = [q for q in every if group.rows(q) and q.probe != p.probe]
            if not others:
                alone.append(group.about.split(" (")[0])
                continue
            refitted.update(zip(group.constants, group.fit(others), strict=True))
        loo = None
        if not alone:
            with assigned(refitted):
                loo = p.predicted_tokens_per_second() / p.tokens_per_second - 1
        rows.append(
            {
                "point": p.label,
                "measured_tokens_per_second": p.tokens_per_second,
                "in_sample_error": in_sample,
                "leave_one_out_error": loo,
                "fitted_on_it_alone": alone,
                "refitted": {c.name + (f"[{c.key}]" if c.key else ""): v
                             for c, v in refitted.items()},
            }
        )  # fmt: skip
    return rows


def constants_refit(every: list[Point]) -> list[dict[str, Any]]:
    """Each constant as shipped, and refitted on all its rows by this script."""
    found = []
    for group in GROUPS:
        chosen = [p for p in every if group.rows(p)]
        for c, v in zip(group.constants, group.fit(chosen), strict=True):
            found.append(
                {"constant": c.name + (f"[{c.key}]" if c.key else ""), "shipped": c.get(),
                 "refit_on_all": v, "rows": len(chosen), "group": group.about}
            )  # fmt: skip
    return found


SHARES = [i / 400 for i in range(0, 121)]
"""Allocator shares tried, 0-30 % of the activations in steps of 0.25 %."""


def share_family(config: TrainConfig) -> str:
    """Which share of ``memory.fragmentation`` a configuration takes."""
    if config.offload is Offload.PARAMS:
        return "parameter offload"
    if config.engine is Engine.FSDP:
        return "FSDP2"
    return "single, DDP, DeepSpeed"


@dataclass(frozen=True)
class Size:
    """One micro-batch size of a probe that ran one (ok or out of memory)."""

    probe: str
    result: ProbeResult
    micro_batch_size: int
    ok: bool

    @property
    def label(self) -> str:
        outcome = "ok" if self.ok else "oom"
        return (
            f"{self.probe} {self.result.spec.config.label()} mbs {self.micro_batch_size} {outcome}"
        )

    def fits(self, share: float) -> bool:
        """The verdict with ``share`` for its family."""
        spec = self.result.spec
        original = memory.fragmentation
        memory.fragmentation = lambda config: share  # type: ignore[assignment]
        try:
            estimate = memory.estimate_memory(
                resolve_model(spec.model), spec.config, micro_batch_size=self.micro_batch_size,
                seq_len=spec.seq_len, world_size=spec.num_processes, cuda_allocator=True,
            )  # fmt: skip
        finally:
            memory.fragmentation = original
        gpu = driver_spec(self.result.gpu_name or "")
        assert gpu is not None
        cap = spec.device_memory_bytes or usable_bytes(gpu)
        return estimate.device_bytes <= cap


def sizes(folder: Path = FOLDER) -> list[Size]:
    """Every size of the run's probes that ran one, ok or out of memory."""
    return [
        Size(stem, result, size.micro_batch_size, size.ok)
        for stem, result in _probes(folder).items()
        for size in result.sizes
    ]


def share_verdicts(every: list[Size]) -> list[dict[str, Any]]:
    """Per size: the verdict in-sample (the shipped share) and left out with its probe."""
    right = {id(s): {share: s.fits(share) == s.ok for share in SHARES} for s in every}
    rows = []
    for s in every:
        family = share_family(s.result.spec.config)
        others = [
            o for o in every if share_family(o.result.spec.config) == family and o.probe != s.probe
        ]
        allowed = [share for share in SHARES if all(right[id(o)][share] for o in others)]
        mine = [right[id(s)][share] for share in allowed]
        verdict = "decided" if mine and all(mine) else "wrong" if not any(mine) else "open"
        rows.append(
            {
                "size": s.label,
                "family": family,
                "in_sample_right": s.fits(memory.fragmentation(s.result.spec.config)) == s.ok,
                "allowed_shares": [min(allowed), max(allowed)] if allowed else None,
                "leave_one_out": verdict,
            }
        )
    return rows


NODE_BYTES = 125 * 1024**3
"""The H100 node's host RAM (measurements/h100-2026-11-23/README.md)."""
RESERVES = [i * 0.25 * 1024**3 for i in range(0, 65)]
"""Host reserves tried, 0-16 GiB in steps of 0.25 GiB."""


def _baseline_group(config: TrainConfig) -> str:
    return "single" if config.engine is Engine.SINGLE else "distributed"


def _peak_rss(result: ProbeResult) -> int:
    return max((s.host_peak_rss_bytes or 0 for s in result.sizes), default=0)


def _host_bytes(result: ProbeResult, baselines: dict[str, float] | None = None) -> int:
    """The predicted node bytes, with the baselines given (else as shipped)."""
    shipped = dict(host.CUDA_RANK_BASELINE_BYTES)
    if baselines is not None:
        for engine in host.CUDA_RANK_BASELINE_BYTES:
            group = "single" if engine is Engine.SINGLE else "distributed"
            host.CUDA_RANK_BASELINE_BYTES[engine] = int(baselines[group])
    try:
        spec = result.spec
        return host.estimate_host(resolve_model(spec.model), spec.config).node_bytes
    finally:
        host.CUDA_RANK_BASELINE_BYTES.update(shipped)


def host_rows(probes: dict[str, ProbeResult] | None = None) -> list[dict[str, Any]]:
    """Per probe that reached its first step or was killed: its peak RSS predicted in-sample
    and with the baselines refitted without it, and (offloading probes) its host verdict with
    the reserve anywhere the other probes allow."""
    probes = probes if probes is not None else _probes()
    step = 0.1 * 1024**3

    def baselines(without: str) -> dict[str, float] | None:
        fitted = {}
        for group in ("single", "distributed"):
            plain = [
                _peak_rss(r) for name, r in probes.items()
                if name != without and _peak_rss(r) and r.spec.config.offload is Offload.NONE
                and _baseline_group(r.spec.config) == group
            ]  # fmt: skip
            if not plain:
                return None
            fitted[group] = round(max(plain) / step) * step
        return fitted

    judged = {
        name: r for name, r in probes.items()
        if r.spec.config.offload is not Offload.NONE
        and (_peak_rss(r) or r.outcome is Outcome.HOST_OOM)
    }  # fmt: skip

    def fits(name: str, reserve: float) -> bool:
        return _host_bytes(judged[name]) <= NODE_BYTES - reserve

    right = {
        name: {reserve: fits(name, reserve) == (r.outcome is not Outcome.HOST_OOM)
               for reserve in RESERVES}
        for name, r in judged.items()
    }  # fmt: skip
    rows = []
    for name, result in probes.items():
        measured = _peak_rss(result)
        killed = result.outcome is Outcome.HOST_OOM
        if not measured and not killed:
            continue
        row: dict[str, Any] = {"probe": name, "config": result.spec.config.label(),
                               "measured_bytes": measured or None, "killed": killed}  # fmt: skip
        if measured:
            refit = baselines(without=name)
            row["in_sample_error"] = _host_bytes(result) / measured - 1
            row["leave_one_out_error"] = (
                None if refit is None else _host_bytes(result, refit) / measured - 1
            )
        if name in judged:
            allowed = [r for r in RESERVES if all(right[o][r] for o in right if o != name)]
            mine = [right[name][r] for r in allowed]
            row["verdict_in_sample"] = right[name][min(RESERVES, key=lambda r: abs(
                r - host.HOST_RESERVE_BYTES))]  # fmt: skip
            row["verdict_left_out"] = (
                "decided" if mine and all(mine) else "wrong" if not any(mine) else "open"
            )
            row["allowed_reserve_gib"] = (
                [min(allowed) / 1024**3, max(allowed) / 1024**3] if allowed else None
            )
        rows.append(row)
    return rows


def print_host(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| probe | configuration | peak RSS | in-sample | baseline left out | host verdict "
        "left out (reserves allowed) |"
    )
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for r in rows:
        rss = f"{r['measured_bytes'] / 1024**3:.1f} GiB" if r["measured_bytes"] else "killed"
        inside = f"{r['in_sample_error']:+.1%}" if "in_sample_error" in r else "-"
        loo = r.get("leave_one_out_error")
        out = f"{loo:+.1%}" if loo is not None else ("-" if "in_sample_error" not in r else "—")
        verdict = "-"
        if "verdict_left_out" in r:
            allowed = r["allowed_reserve_gib"]
            span = f"{allowed[0]:.2f}-{allowed[1]:.2f} GiB" if allowed else "none"
            verdict = f"{r['verdict_left_out']} ({span})"
        print(f"| {r['probe']} | {r['config']} | {rss} | {inside} | {out} | {verdict} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    every = points()
    constants = constants_refit(every)
    rows = leave_one_out(every)
    verdicts = share_verdicts(sizes())
    hosts = host_rows()
    if args.json:
        print(json.dumps(
            {"constants": constants, "points": rows, "memory": verdicts, "host": hosts}, indent=2
        ))  # fmt: skip
        return
    print("| constant | shipped | refit on all its rows | rows |")
    print("| --- | ---: | ---: | ---: |")
    for c in constants:
        print(f"| `{c['constant']}` | {c['shipped']:.4g} | {c['refit_on_all']:.4g} | {c['rows']} |")
    print("\n| point | measured tokens/s | in-sample error | leave-one-out error |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        loo = (
            f"{r['leave_one_out_error']:+.1%}"
            if r["leave_one_out_error"] is not None
            else f"— (fitted on it alone: {', '.join(r['fitted_on_it_alone'])})"
        )
        print(
            f"| {r['point']} | {r['measured_tokens_per_second']:,.0f} "
            f"| {r['in_sample_error']:+.1%} | {loo} |"
        )
    both = [r for r in rows if r["leave_one_out_error"] is not None]
    inside = [abs(r["in_sample_error"]) for r in both]
    out = [abs(r["leave_one_out_error"]) for r in both]
    print(
        f"\nOn the {len(both)} of {len(rows)} points a leave-one-out fit can predict: |error| "
        f"in-sample median {statistics.median(inside):.1%}, worst {max(inside):.1%}; "
        f"leave-one-out median {statistics.median(out):.1%}, worst {max(out):.1%}."
    )
    print_verdicts(verdicts)
    print_host(hosts)


def print_verdicts(verdicts: list[dict[str, Any]]) -> None:
    print("\n| size | share family | shares the other probes allow | in-sample | left out |")
    print("| --- | --- | --- | --- | --- |")
    for v in verdicts:
        allowed = v["allowed_shares"]
        span = f"{allowed[0]:.2%}-{allowed[1]:.2%}" if allowed else "none"
        print(
            f"| {v['size']} | {v['family']} | {span} | "
            f"{'right' if v['in_sample_right'] else 'WRONG'} | {v['leave_one_out']} |"
        )
    count = {
        k: sum(v["leave_one_out"] == k for v in verdicts) for k in ("decided", "open", "wrong")
    }
    right = sum(v["in_sample_right"] for v in verdicts)
    print(
        f"\nFit verdicts of the {len(verdicts)} sizes: in-sample {right} right; left out with "
        f"their probe, {count['decided']} decided right, {count['open']} open, "
        f"{count['wrong']} wrong."
    )


if __name__ == "__main__":
    main()
