"""How far the estimator is off, learnt from what a study measured: a residual model.

The search plans with the estimator's predictions and corrects them by what it measures. How a
correction learnt on one configuration carries to another is the question: on the first H100
run the error was shared by engine and offload, but another node, model or software stack may
share it by checkpointing, by ZeRO stage, or not at all. So the model does not assume which
knobs share an error; it learns it from the measurements.

The residual of a measured point is ``log(measured / predicted)``. It is modelled as a sum of
independent zero-mean effects, one per *term*: a shift of the whole study; one effect per value
of each knob (engine, ZeRO stage, offload, checkpointing); one per value of each pair of knobs;
one per configuration; and a smooth curve over log2(micro-batch) within a configuration (so a
configuration's error may change with its size: a kernel or allocator cliff). That is a
Gaussian process whose kernel is the sum of the terms' kernels (a term's kernel is 1 where two
points share the term's value, scaled by the term's variance): a hierarchical model with
crossed random effects [Rasmussen & Williams, *Gaussian Processes for Machine Learning*, 2006,
ch. 2 and 5; Gelman & Hill, *Data Analysis Using Regression and Multilevel/Hierarchical
Models*, 2007, ch. 13]. Each term's variance starts at a prior (``TERMS``) and is set by the
data: the maximum a posteriori of the marginal likelihood, under a log-normal prior around the
term's prior variance (``SPREAD``). A term whose groups measured alike shrinks; one whose
groups differ grows, and predictions for unmeasured configurations follow the grouping the
data supports, with an uncertainty that says how well it does.

Two things are learnt beside the terms' variances, because real clusters break the Gaussian
picture in two ways:

- **Outlying configurations.** Most configurations sit near their prediction, but one that hits
  a fast kernel or a slow path can be 1.5-3x off. A Gaussian configuration term cannot say
  both: the agreeing majority shrinks it, and the outlier then sits many standard deviations
  out (pulling its siblings along through the shared terms). So each configuration's own
  effect is drawn from a two-component scale mixture: with probability ``1 - share`` the
  term's fitted spread, with ``share`` a wide outlier spread, both learnt by expectation-
  maximisation [Dempster, Laird & Rubin, JRSS B 39, 1977; the scale-mixture form of robust
  regression in Gelman et al., *Bayesian Data Analysis*, 3rd ed., 2013, ch. 17]. A measured
  outlier's own effect takes its residual (its variance grows) instead of its siblings'; an
  unmeasured configuration's upper bound (:meth:`Residual.up`) is the mixture's quantile, so
  it widens only as far as the outliers measured so far say (``OUTLIER_PRIOR``: a share of
  2.5 % before any).
- **Measurement noise** (a short probe's timing scatter) is learnt from the repeats of points:
  the scaled inverse-chi-squared posterior of a normal variance with ``NOISE`` as its prior
  worth ``NOISE_DF`` degrees of freedom (Gelman et al., ch. 3.3). A shared node or a
  throttling GPU scatters its measurements by 5-10 % where the H100 run scattered by 2 %; the
  model then trusts one measurement less, and the search re-measures by it
  (:mod:`autotune.search.ladder`). A point pooling ``repeats`` measurements has the noise
  divided by them.

The model is pure numpy: the search runs in the tuner, whose core imports no
torch, so Optuna's GP sampler (torch and scipy) and BoTorch (torch) are not at hand; what is
here is the textbook algebra (a Cholesky solve and the marginal likelihood's gradient) on the
few dozen points a study holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
from threadpoolctl import ThreadpoolController

from autotune.config import Offload, TrainConfig

__all__ = ["NOISE", "TERMS", "Observation", "Residual", "ResidualModel", "Term", "noise_of"]


@dataclass(frozen=True, slots=True)
class Term:
    """One effect of the residual: shared by the points that agree on ``fields`` (``()``: every
    point; ``None``: each configuration its own)."""

    name: str
    fields: tuple[str, ...] | None
    prior_sd: float
    """Prior standard deviation of the effect, in log units (0.1: about 10 %)."""
    offload_only: bool = False
    """The effect exists only for configurations that offload (the others have none of it)."""

    def applies(self, config: TrainConfig) -> bool:
        return not self.offload_only or config.offload is not Offload.NONE


TERMS: tuple[Term, ...] = (
    # The whole study's shift: the estimator against this node and software, which the time
    # model's agreement with published runs puts within 9-15 % and the first GPU run 15-20 %.
    Term("study", (), 0.20),
    Term("engine", ("engine",), 0.08),
    Term("zero_stage", ("zero_stage",), 0.08),
    Term("offload", ("offload",), 0.08),
    # Offload runs at the speed of the host's CPUs and links, which vary from node to node far
    # more than GPUs do (the H100 run measured optimizer offload at 0.44-0.76 of its prediction):
    # an effect of the host, for offloading configurations only, wide (two standard deviations
    # span that run's log ratios) and in either direction.
    Term("host", ("offload",), 0.30, offload_only=True),
    Term("ac_every", ("ac_every",), 0.08),
    Term("engine x offload", ("engine", "offload"), 0.08),
    Term("engine x zero_stage", ("engine", "zero_stage"), 0.06),
    Term("engine x ac_every", ("engine", "ac_every"), 0.06),
    Term("zero_stage x offload", ("zero_stage", "offload"), 0.06),
    Term("offload x ac_every", ("offload", "ac_every"), 0.06),
    # Each configuration's own error: the memory model's rows of the H100 run were within
    # 0.1-1.5 %, its time model's about 5 % (docs/time-model.md); 8 % was chosen on the
    # search benchmark's tuning set, where 5 % left configurations with a large error of
    # their own hidden under the bound (bench/search-sets.json, per-configuration).
    Term("configuration", None, 0.08),
)
"""The terms of the residual and their prior sizes. The prior spread of two configurations that
share nothing but the study is about 20 % (offload about 30 %), and the data moves each term."""
UNSEEN, NOT_APPLICABLE = -1, -2
CONFIGURATION = next(i for i, t in enumerate(TERMS) if t.fields is None)
SIZE_SD = 0.05
"""Prior standard deviation of a configuration's curve over its micro-batch sizes."""
SIZE_SCALE = 1.0
"""Length scale of that curve, in doublings of the micro-batch."""
NOISE = 0.02
"""Prior of the relative timing scatter of one short probe (a few per cent on the H100 run);
the repeats of a study move it (:func:`noise_of`)."""
NOISE_DF = 2.0
"""Degrees of freedom the noise's prior is worth: two repeats' worth of evidence, so a study
whose repeats scatter by 10 % learns it after a few of them."""
NOISE_FLOOR = 0.005
"""The least noise the model assumes (a device whose repeats measure alike still differs by a
probe's rounding and step count)."""
OUTLIER_SD = 0.5
"""Prior standard deviation of an outlying configuration's own effect, in log units (1.65x off
at one standard deviation: a kernel path the estimator does not know); the outliers measured
move it."""
OUTLIER_PRIOR = (0.5, 19.5)
"""Beta pseudo-counts (outliers, others) of the outlying share: 2.5 % before any measurement,
about 10 % once two of twenty measured configurations are far off."""
MIXTURE_ROUNDS = 4
"""Rounds of expectation-maximisation of the configurations' mixture at most (each refits the
variances from where the last ended; a study with no outlier stops after the first)."""
SPREAD = 1.5
"""Standard deviation of the log-normal prior on each term's variance, in log units of the
variance (a term may end about 2x larger or smaller in standard deviation than its prior, and
further where the data insists)."""
STEPS = 30
"""Gradient steps of the variances' fit (the marginal likelihood is smooth; 30 steps settle it
on the tens of points of a study)."""


@dataclass(frozen=True, slots=True)
class Observation:
    """A measured point: its measured/predicted objective, pooled over ``repeats``."""

    config: TrainConfig
    micro_batch_size: int
    ratio: float
    repeats: int = 1
    scatter: float = 0.0
    """The sum of squared deviations of the repeats' log values about their mean (0 with one
    measurement): what the repeats say of the noise."""


@dataclass(frozen=True, slots=True)
class Residual:
    """The model's belief about a point: its log(measured / predicted) is about ``mean``, with
    standard deviation ``sd``. For a configuration not measured, its own effect may be an
    outlier's: with probability ``outlier_share``, of spread ``outlier_sd`` instead of
    ``own_sd`` (the part of ``sd`` that is its own)."""

    mean: float
    sd: float
    own_sd: float = 0.0
    outlier_sd: float = 0.0
    outlier_share: float = 0.0

    @property
    def ratio(self) -> float:
        """The calibration factor of the point's prediction."""
        return math.exp(self.mean)

    def up(self, z: float) -> float:
        """The factor ``z`` standard deviations above (as if the point were Gaussian)."""
        return math.exp(self.mean + z * self.sd)

    def tail(self, z: float) -> float:
        """The factor at the upper quantile a standard normal has ``z`` standard deviations
        above its mean: :meth:`up` where the point is Gaussian, the mixture's quantile where
        its configuration, not measured, may be an outlier."""
        return math.exp(self.mean + self.spread(z))

    def spread(self, z: float) -> float:
        """How far above the mean the quantile of :meth:`tail` lies, in log units."""
        if not self.outlier_share or self.outlier_sd <= self.own_sd or z <= 0:
            return z * self.sd
        shared = max(self.sd**2 - self.own_sd**2, 0.0)
        narrow, wide = self.sd, math.sqrt(shared + self.outlier_sd**2)
        share, target = self.outlier_share, _upper_tail(z)
        low, high = z * narrow, z * wide  # the mixture's quantile lies between its parts'
        for _ in range(40):  # bisection: the tail falls monotonically
            middle = (low + high) / 2
            tail = (1 - share) * _upper_tail(middle / narrow) + share * _upper_tail(middle / wide)
            low, high = (middle, high) if tail > target else (low, middle)
        return high


def _upper_tail(z: float) -> float:
    """P(N(0, 1) > z)."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def noise_of(observations: Sequence[Observation]) -> float:
    """The probes' timing scatter learnt from the repeats: the posterior of a normal variance
    under a scaled inverse-chi-squared prior at ``NOISE`` worth ``NOISE_DF`` degrees of
    freedom (its mean's estimate; Gelman et al., *Bayesian Data Analysis*, 3rd ed., 3.3)."""
    freedom = sum(max(0, o.repeats - 1) for o in observations)
    scatter = sum(o.scatter for o in observations)
    variance = (NOISE_DF * NOISE**2 + scatter) / (NOISE_DF + freedom)
    return max(NOISE_FLOOR, math.sqrt(variance))


_THREADS: list[object] = []


def _one_thread() -> AbstractContextManager[object]:
    """BLAS on one thread while the model computes: its matrices are small (tens to hundreds
    of points), where a multi-threaded BLAS spends more on waking its threads than on the
    sums, and on a node whose cores the probes' ranks keep busy it waits for them (a
    proposal up to 14x slower). Only this process's BLAS is limited, and only here: the
    ranks autotune launches inherit no setting."""
    if not _THREADS:  # made once: it looks for the loaded BLAS libraries
        _THREADS.append(ThreadpoolController())
    controller = _THREADS[0]
    assert isinstance(controller, ThreadpoolController)
    return controller.limit(limits=1, user_api="blas")


class ResidualModel:
    """The residual model fitted to a study's observations (see the module's docstring)."""

    def __init__(self, observations: Sequence[Observation]) -> None:
        self.observations = [o for o in observations if o.ratio > 0]
        self._codes: list[dict[tuple[object, ...], int]] = [{} for _ in TERMS]
        self._x = self._encode([(o.config, o.micro_batch_size) for o in self.observations])
        self._y = np.array([math.log(o.ratio) for o in self.observations])
        self.noise = noise_of(self.observations)
        """The probes' timing scatter, as the repeats have shown it (:func:`noise_of`)."""
        self._noise = np.array([self.noise**2 / max(1, o.repeats) for o in self.observations])
        self._prior = np.array([2 * math.log(t.prior_sd) for t in TERMS] + [2 * math.log(SIZE_SD)])
        # Every term's kernel between the observations, stacked: terms x n x n (the
        # covariance is one weighted sum of them, the gradient one matrix-vector product).
        self._unit_kernels = np.stack(self._kernels(self._x, self._x))
        self._kernels_xx = self._unit_kernels
        self._own = self._x[0][:, CONFIGURATION]
        self.scales = np.ones(len(self._codes[CONFIGURATION]))
        """Each measured configuration's own variance over the configuration term's: 1 for
        one like the rest, up to (outlier spread / term spread)^2 for an outlier."""
        self.outlier_share = OUTLIER_PRIOR[0] / sum(OUTLIER_PRIOR)
        self.outlier_sd = OUTLIER_SD
        # The mixture's first guess is made at the prior variances, before a Gaussian fit
        # lets the outliers widen the configuration term for every configuration (a local
        # optimum expectation-maximisation does not leave).
        self.log_variances = self._prior.copy()
        with _one_thread():
            if len(self.observations) >= 2:
                self._mixture_step()
            self.log_variances = self._fit(self.log_variances, STEPS)
            for _ in range(MIXTURE_ROUNDS - 1 if len(self.observations) >= 2 else 0):
                if not self._mixture_step():
                    break
                self.log_variances = self._fit(self.log_variances, STEPS // 3)
            if self.observations:
                covariance = self._covariance(np.exp(self.log_variances))
                self._cholesky = np.linalg.cholesky(covariance)
                self._alpha = np.linalg.solve(
                    self._cholesky.T, np.linalg.solve(self._cholesky, self._y)
                )

    @property
    def sds(self) -> dict[str, float]:
        """Each term's fitted standard deviation (what the data made of the prior)."""
        names = [t.name for t in TERMS] + ["micro-batch curve"]
        return {n: math.exp(v / 2) for n, v in zip(names, self.log_variances, strict=True)}

    def outliers(self) -> list[TrainConfig]:
        """The measured configurations the mixture takes for outliers (more likely than not)."""
        configs = {code: key[0] for key, code in self._codes[CONFIGURATION].items()}
        spread = math.exp(self.log_variances[CONFIGURATION])
        cut = (spread + self.outlier_sd**2) / (2 * spread)  # halfway between the parts
        return [configs[c] for c, scale in enumerate(self.scales) if scale > cut]  # type: ignore[misc]

    def predict(self, points: Sequence[tuple[TrainConfig, int]]) -> list[Residual]:
        """The residual at each (configuration, micro-batch) point."""
        if not points:
            return []
        x = self._encode(points, grow=False)
        variances = np.exp(self.log_variances)
        codes = x[0][:, CONFIGURATION]
        applies = np.hstack([x[0] != NOT_APPLICABLE, np.ones((len(points), 1), dtype=bool)])
        prior_var = applies.astype(float) @ variances
        measured = codes >= 0
        own = variances[CONFIGURATION]
        # A measured configuration's own effect has its own variance (an outlier's is wide).
        prior_var[measured] += own * (self.scales[codes[measured]] - 1)
        tail = {"own_sd": math.sqrt(own), "outlier_sd": self.outlier_sd}
        share = self.outlier_share
        if not self.observations:
            return [
                Residual(0.0, float(math.sqrt(v)), **tail, outlier_share=share) for v in prior_var
            ]
        with _one_thread():
            kernels = self._kernels(x, self._x)
            kernels[CONFIGURATION] = kernels[CONFIGURATION] * self.scales[self._own][None, :]
            cross = sum(v * k for v, k in zip(variances, kernels, strict=True))
            mean = cross @ self._alpha
            solved = np.linalg.solve(self._cholesky, cross.T)
            var = np.maximum(prior_var - (solved**2).sum(axis=0), 0.0)
        return [
            Residual(float(m), float(math.sqrt(s)), **tail, outlier_share=0.0 if seen else share)
            for m, s, seen in zip(mean, var, measured, strict=True)
        ]

    def _mixture_step(self) -> bool:
        """One round of expectation-maximisation of the configurations' mixture: each measured
        configuration's chance to be an outlier, from the marginal likelihood of the study with
        its own effect narrow or wide (the others as they stand); then the outlying share, the
        outliers' spread and each configuration's variance from those chances. A configuration
        alone in a group (the only one measured at a checkpointing level, say) is thereby
        weighed as an outlier of its own against a group effect far outside that group's
        prior. Whether any configuration's variance moved (by more than 10 %)."""
        variances = np.exp(self.log_variances)
        try:
            chol = np.linalg.cholesky(self._covariance(variances))
        except np.linalg.LinAlgError:
            return False
        spread = float(variances[CONFIGURATION])
        count = len(self.scales)
        # Each configuration's own effect is a rank-one part of the covariance (its points'
        # indicator b, times its variance): with b'K^-1 b and b'K^-1 y, the likelihood at any
        # other variance of that effect follows without a new factorisation (the matrix
        # determinant lemma and Sherman-Morrison).
        indicator = np.zeros((len(self._y), count))
        indicator[np.arange(len(self._y)), self._own] = 1.0
        solved = np.linalg.solve(chol, indicator)
        q = (solved**2).sum(axis=0)
        a = solved.T @ np.linalg.solve(chol, self._y)
        # The same without the effect's current variance: what the rest of the study says.
        rest = 1 - spread * self.scales * q
        q0, a0 = q / rest, a / rest

        def likelihood(variance: float) -> np.ndarray:
            return -0.5 * np.log1p(variance * q0) + 0.5 * variance * a0**2 / (1 + variance * q0)

        wide = max(self.outlier_sd**2, 4 * spread)
        share = self.outlier_share
        logit = math.log(share / (1 - share)) + likelihood(wide) - likelihood(spread)
        chance = 1 / (1 + np.exp(-np.clip(logit, -50, 50)))
        # The own effect's second moment were it an outlier: its posterior at the wide variance.
        second = (wide * a0 / (1 + wide * q0)) ** 2 + wide / (1 + wide * q0)
        outlying, others = OUTLIER_PRIOR
        self.outlier_share = float((outlying + chance.sum()) / (outlying + others + count))
        wide = (OUTLIER_SD**2 + float((chance * second).sum())) / (1 + float(chance.sum()))
        self.outlier_sd = math.sqrt(max(wide, 4 * spread))
        scales = 1 / ((1 - chance) + chance * spread / self.outlier_sd**2)
        moved = bool(np.any(np.abs(np.log(scales / self.scales)) > 0.1))
        self.scales = scales
        kernels = self._unit_kernels.copy()
        kernels[CONFIGURATION] *= self.scales[self._own][:, None]
        self._kernels_xx = kernels
        return moved

    def _encode(
        self, points: Sequence[tuple[TrainConfig, int]], grow: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each point's group code under every term (``UNSEEN``: a group no observation has;
        ``NOT_APPLICABLE``: the term has no effect on the point) and its log2 micro-batch."""
        codes = np.full((len(points), len(TERMS)), UNSEEN, dtype=np.int64)
        where: dict[TrainConfig, list[int]] = {}
        for i, (config, _) in enumerate(points):
            where.setdefault(config, []).append(i)
        for config, rows in where.items():  # a configuration's sizes share its codes
            values = config.to_dict()
            for j, term in enumerate(TERMS):
                if not term.applies(config):
                    codes[rows, j] = NOT_APPLICABLE
                    continue
                table = self._codes[j]
                key = (config,) if term.fields is None else tuple(values[n] for n in term.fields)
                if grow:
                    table.setdefault(key, len(table))
                codes[rows, j] = table.get(key, UNSEEN)
        sizes = np.array([math.log2(max(1, m)) for _, m in points], dtype=float)
        return codes, sizes

    @staticmethod
    def _kernels(
        a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
    ) -> list[np.ndarray]:
        """Each term's kernel between the points of ``a`` and ``b`` (unit variance)."""
        (codes_a, sizes_a), (codes_b, sizes_b) = a, b
        kernels = [
            ((codes_a[:, j, None] == codes_b[None, :, j]) & (codes_a[:, j, None] >= 0)).astype(
                float
            )
            for j in range(len(TERMS))
        ]
        same_config = kernels[CONFIGURATION]
        distance = (sizes_a[:, None] - sizes_b[None, :]) / SIZE_SCALE
        kernels.append(same_config * np.exp(-0.5 * distance**2))
        return kernels

    def _fit(self, theta: np.ndarray, steps: int) -> np.ndarray:
        """The terms' log variances: the maximum a posteriori of the marginal likelihood, by
        gradient ascent from ``theta`` with a step that shrinks where it overshoots."""
        if len(self.observations) < 2:
            return theta
        with _one_thread():
            return self._ascend(theta, steps)

    def _ascend(self, theta: np.ndarray, steps: int) -> np.ndarray:
        value, gradient = self._posterior(theta)
        step = 0.5
        for _ in range(steps):
            candidate = np.clip(
                theta + step * np.clip(gradient, -2.0, 2.0),
                self._prior - 4 * SPREAD,
                self._prior + 2 * SPREAD,
            )
            candidate_value, candidate_gradient = self._posterior(candidate)
            if candidate_value > value:
                theta, value, gradient = candidate, candidate_value, candidate_gradient
                step *= 1.2
            else:
                step /= 2
                if step < 1e-3:
                    break
        return theta

    def _covariance(self, variances: np.ndarray) -> np.ndarray:
        """The observations' covariance: each term's kernel at its variance, and the noise."""
        weighted = np.tensordot(variances, self._kernels_xx, axes=1)
        return weighted + np.diag(self._noise)

    def _posterior(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        """The log marginal likelihood plus the variances' log prior at ``theta``, and its
        gradient (-inf where the kernel is not positive definite)."""
        variances = np.exp(theta)
        covariance = self._covariance(variances)
        try:
            chol = np.linalg.cholesky(covariance)  # positive definite, and the determinant
        except np.linalg.LinAlgError:
            return -math.inf, np.zeros_like(theta)
        y = self._y
        # The gradient needs the whole inverse: one inversion, not two triangular systems
        # solved as general ones for every column (a third of the time at 440 points).
        inverse = np.linalg.inv(covariance)
        alpha = inverse @ y
        prior = (theta - self._prior) / SPREAD**2
        value = (
            -0.5 * float(y @ alpha)
            - float(np.log(np.diag(chol)).sum())
            - 0.5 * float((prior * (theta - self._prior)).sum())
        )
        inner = np.outer(alpha, alpha) - inverse
        kernels = self._kernels_xx.reshape(len(variances), -1)
        gradient = 0.5 * variances * (kernels @ inner.ravel())
        return value, gradient - prior
