"""One rank of a probe of an RL iteration (``ProbeSpec.rlhf``): real models, an emulated engine.

The trained models (the policy, the probe's model, and PPO's critic) are built by the
probe's engine as any trainee; the frozen ones (reference, reward) are built beside them on
the device in the compute dtype, without gradients. Each step of the probe is one iteration
on the synthetic batch:

- **rollout**: the rollout engine's share of the device is taken as one allocated block
  (``share`` times the device's memory: the emulated cap, or the GPU's). This is an
  **emulated reservation**: vLLM does not run in a probe, nothing is generated (the batch's
  token ids stand for the responses), but the memory it would claim is really held, so the
  phases after it run out of memory where they would beside a real engine.
- **scoring**: without gradients, each model's forward over the batch at the micro-batch: the
  policy's and the reference's log-probabilities (bf16 logits, their fp32 copy, the fp32
  log-softmax), the critic's and reward model's value from the final norm's output (a value
  head's one output, the mean over the hidden size, standing for a trained head; the model
  runs whole, with logits for the last token alone).
- **training**: the policy's optimizer step over the batch (its language-model loss: the same
  logits and log-softmax a PPO or GRPO loss takes, not its arithmetic), then the critic's.

A sleeping engine's block is freed after the rollout and taken again at the next one. Each
phase's peak is read apart (``SizeResult.extra["rlhf"]``); the size's peak is the largest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from autotune.config import TrainConfig
from autotune.models import ModelSpec, resolve_model
from autotune.probe.engines import EngineContext, Trainee, build_trainee
from autotune.probe.engines.base import autocast_context, torch_dtype
from autotune.probe.memory import MemoryMeter
from autotune.probe.metrics import now, synchronize
from autotune.probe.modeling import build_model, decoder_blocks, materialize
from autotune.probe.outcome import Stage
from autotune.tuned.rlhf import Placement, RLHFProbe, sharded

__all__ = ["Iteration", "build_iteration", "reservation_bytes"]

PHASES = ("rollout", "scoring", "training")


def reservation_bytes(rlhf: RLHFProbe, device: torch.device, cap: int | None) -> int:
    """The engine's share in bytes: of the emulated cap where there is one, else of the GPU's
    memory (vLLM's ``gpu_memory_utilization`` is a fraction of the whole memory)."""
    if cap is not None:
        total = cap
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        raise ValueError("an RL iteration's probe on the CPU needs --device-memory")
    return int(rlhf.share * total)


@dataclass(kw_only=True)
class Iteration:
    """The models and the engine's reservation of one rank's RL iteration."""

    rlhf: RLHFProbe
    config: TrainConfig
    device: torch.device
    policy: Trainee
    critic: Trainee | None
    frozen: dict[str, nn.Module]
    reserve_bytes: int
    stage: Stage = Stage.ROLLOUT
    _block: torch.Tensor | None = field(default=None, repr=False)

    def hold(self) -> None:
        """The engine takes its share (again, after a sleep)."""
        if self._block is None:
            self._block = torch.empty(self.reserve_bytes, dtype=torch.uint8, device=self.device)

    def release(self) -> None:
        """The engine sleeps: its share is freed."""
        self._block = None

    def discard(self) -> None:
        """After a failed size: the engine's block and the critic's gradients freed (the
        policy's are the probe's to free)."""
        self.release()
        if self.critic is not None:
            self.critic.discard_gradients()

    def scorers(self) -> list[tuple[str, nn.Module, bool]]:
        """Each model that scores the batch: (role, module, whether it gives log-probabilities
        over a vocabulary rather than a value)."""
        found: list[tuple[str, nn.Module, bool]] = [("policy", self.policy.model, True)]
        if "reference" in self.frozen:
            found.append(("reference", self.frozen["reference"], True))
        if self.critic is not None:
            found.append(("critic", self.critic.model, False))
        if "reward" in self.frozen:
            found.append(("reward", self.frozen["reward"], False))
        return found

    def score(self, input_ids: torch.Tensor) -> float:
        """The scoring forwards of one micro-batch; a checksum of what they gave."""
        total = 0.0
        autocast = (
            autocast_context(self.config, self.device)
            if self.config.precision.is_mixed
            else contextlib.nullcontext()
        )
        with torch.no_grad(), autocast:
            for role, module, logprobs in self.scorers():
                loading = (
                    _on_device(module, self.device)
                    if role in self.frozen and self.rlhf.frozen is Placement.OFFLOAD
                    else contextlib.nullcontext()
                )
                with loading:
                    total += _score(module, input_ids, logprobs)
        return total

    def train(self, batches: list[torch.Tensor], timed: bool, times: dict[str, list]) -> float:
        """One optimizer step of each trained model over the micro-batches; the policy's last
        loss. The policy's micro-steps and step are timed into ``times``."""
        loss_value = 0.0
        for role, trainee in (("policy", self.policy), ("critic", self.critic)):
            if trainee is None:
                continue
            for index, batch in enumerate(batches):
                sync = index == len(batches) - 1
                synchronize(self.device)
                began = now()
                self.stage = Stage.FORWARD
                loss = trainee.forward(batch, sync=sync)
                self.stage = Stage.BACKWARD
                trainee.backward(loss, sync=sync)
                synchronize(self.device)
                if role == "policy":
                    loss_value = float(loss.detach().float().item())
                    if timed:
                        times["micro"].append(now() - began)
                del loss
            self.stage = Stage.OPTIMIZER
            began = now()
            trainee.optimizer_step()
            synchronize(self.device)
            if role == "policy" and timed:
                times["optimizer"].append(now() - began)
        return loss_value

    def run(
        self, batches: list[torch.Tensor], steps: int, warmup: int, meter: MemoryMeter
    ) -> dict[str, Any]:
        """``warmup + steps`` iterations; the step loop's record (the policy's training times
        and losses) with each phase's peak bytes and median seconds under ``rlhf``."""
        peaks = dict.fromkeys(PHASES, 0)
        reserved = dict.fromkeys(PHASES, 0)
        seconds: dict[str, list[float]] = {p: [] for p in PHASES}
        times: dict[str, list] = {"micro": [], "optimizer": []}
        losses: list[float] = []
        start = window = now()
        for step in range(warmup + steps):
            timed = step >= warmup
            if step == warmup:
                synchronize(self.device)
                window = now()
            for phase in PHASES:
                meter.reset()
                began = now()
                if phase == "rollout":
                    self.stage = Stage.ROLLOUT
                    self.hold()
                elif phase == "scoring":
                    self.stage = Stage.SCORING
                    for batch in batches:
                        self.score(batch)
                else:
                    losses.append(self.train(batches, timed, times))
                synchronize(self.device)
                if timed:
                    seconds[phase].append(now() - began)
                reading = meter.read()
                for into, key in (
                    (peaks, "peak_allocated_bytes"),
                    (reserved, "peak_reserved_bytes"),
                ):
                    into[phase] = max(into[phase], int(reading.get(key) or 0))
                if phase == "rollout" and self.rlhf.sleep:
                    self.release()  # the engine sleeps once its rollout is done
        end = now()
        self.release()
        return {
            "losses": losses,
            "micro_times": times["micro"],
            "optimizer_times": times["optimizer"],
            "warmup_s": window - start,
            "timed_s": end - window,
            "step_times": [sum(phases) for phases in zip(*seconds.values(), strict=True)],
            "rlhf": {
                "phase_peak_bytes": peaks,
                "phase_reserved_bytes": reserved,
                "phase_s": {p: sorted(v)[len(v) // 2] for p, v in seconds.items() if v},
                "reservation_bytes": self.reserve_bytes,
                **self.rlhf.to_dict(),
            },
        }


def _score(module: nn.Module, input_ids: torch.Tensor, logprobs: bool) -> float:
    """One model's scoring forward: the log-probabilities of the tokens from its logits, or a
    value from its final norm's output; a checksum of what it gave."""
    if logprobs:
        logits = module(input_ids=input_ids).logits
        logp = logits.float().log_softmax(-1)
        del logits
        return float(logp.gather(-1, input_ids.unsqueeze(-1)).sum())
    # A value head reads the final norm's output: the model runs whole (so an engine's hooks,
    # FSDP2's root gather among them, see the call) with logits for the last token alone.
    captured: list[torch.Tensor] = []
    handle = _final_norm(module).register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        module(input_ids=input_ids, logits_to_keep=1)
    finally:
        handle.remove()
    return float(captured[0].float().mean(-1).sum())


@contextlib.contextmanager
def _on_device(model: nn.Module, device: torch.device) -> Iterator[None]:
    """A frozen model waiting on the host, on the device for one forward. On a GPU its
    weights move there and back; on the CPU's emulated device they are copied into counted
    tensors for the forward (the host copies stay uncounted)."""
    params = list(model.parameters())
    if device.type == "cuda":
        model.to(device)
        try:
            yield
        finally:
            model.to("cpu")
        return
    # The host copies are touched only with the counters stepped aside: an op on them inside
    # the counters (even a view) would count their storage as the device's.
    with _disable_current_modes():
        kept = [p.data for p in params]
    for param, host in zip(params, kept, strict=True):
        param.data = host.clone()  # counted: now on the emulated device
    try:
        yield
    finally:
        with _disable_current_modes():
            for param, host in zip(params, kept, strict=True):
                param.data = host


def _to_host(model: nn.Module, device: torch.device) -> None:
    """Send a frozen model's weights to the host: to CPU memory off a GPU; on the CPU's
    emulated device, into copies the counters do not see."""
    if device.type == "cuda":
        model.to("cpu")
        return
    with _disable_current_modes():
        for param in model.parameters():
            param.data = param.data.clone()


def _final_norm(module: nn.Module) -> nn.Module:
    """The norm before a causal LM's head (through DDP's or DeepSpeed's wrapper)."""
    base = getattr(module, "module", module).base_model
    norm = getattr(base, "norm", None) or getattr(base, "ln_f", None)
    assert isinstance(norm, nn.Module), type(base).__name__
    return norm


def _frozen(
    spec: ModelSpec, config: TrainConfig, device: torch.device, seed: int, *, shard: bool
) -> nn.Module:
    """A frozen model on ``device`` in the compute dtype, without gradients; ``shard``: its
    weights sharded over the ranks with FSDP2 (each block a unit, the root another, gathered
    for the forward and freed after it), as a trainer that shards its own parameters keeps its
    reference (verl's FSDP workers; OpenRLHF's ZeRO-3 engine holds the same bytes)."""
    model = build_model(spec, config, checkpointing=False)
    dtype = torch_dtype(config.precision)
    if shard:
        from torch.distributed.fsdp import fully_shard

        model.to(dtype)  # on meta: no memory yet
        for block in decoder_blocks(model):
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        materialize(model, device, seed=seed)
    else:
        materialize(model, device, seed=seed)
        model.to(dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def build_iteration(
    ctx: EngineContext, rlhf: RLHFProbe, policy: Trainee, cap: int | None
) -> Iteration:
    """The critic (built by the probe's engine), the frozen models and the reservation's
    size, beside the policy the probe built."""
    critic = None
    if rlhf.critic is not None:
        critic_spec = resolve_model(rlhf.critic)
        critic = build_trainee(
            EngineContext(
                model=critic_spec,
                config=ctx.config,
                device=ctx.device,
                rank=ctx.rank,
                world_size=ctx.world_size,
                micro_batch_size=ctx.micro_batch_size,
                grad_accum=ctx.grad_accum,
                lr=ctx.lr,
                seed=ctx.seed + 1,
            )
        )
    frozen_config = TrainConfig(precision=ctx.config.precision, attention=ctx.config.attention)
    frozen = {
        role: _frozen(
            resolve_model(name),
            frozen_config,
            ctx.device,
            ctx.seed + 2 + i,
            shard=ctx.world_size > 1 and sharded(ctx.config),
        )
        for i, (role, name) in enumerate((("reference", rlhf.reference), ("reward", rlhf.reward)))
        if name is not None
    }
    if rlhf.frozen is Placement.OFFLOAD:
        for model in frozen.values():
            _to_host(model, ctx.device)
    return Iteration(
        rlhf=rlhf,
        config=ctx.config,
        device=ctx.device,
        policy=policy,
        critic=critic,
        frozen=frozen,
        reserve_bytes=reservation_bytes(rlhf, ctx.device, cap),
    )
