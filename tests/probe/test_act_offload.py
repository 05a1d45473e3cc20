"""Activation offload (``--act-offload``): the same gradients as without it, real probes under
the plain engines and FSDP2, and the device and host memory it moves against the estimator.

The estimator's terms were written on the tiny preset (a 2-block llama of hidden 64: every
block's saved tensors leave the device, a checkpointed block keeps its input on the host, and
each backward node brings its own back); the checks here use a 4-block llama of hidden 384 and
6 heads, at sizes and engines those terms were not written on. On the CPU the host side is the
probe's emulated host pool (``autotune.probe.offload``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import RunProbe, probe_failure_text
from test_cli import autotune

from autotune.config import ConfigError, TrainConfig
from autotune.estimator.host import PINNED_ACTIVATION_BOUND, estimate_host
from autotune.estimator.memory import estimate_memory
from autotune.estimator.timing import predict_step_time
from autotune.hardware import gpu_spec
from autotune.models import resolve_model
from autotune.probe.data import synthetic_batch
from autotune.probe.modeling import build_model, decoder_blocks, materialize
from autotune.probe.offload import OffloadedBlock
from autotune.probe.outcome import Outcome

BLOCKY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
SEQ = 256


@pytest.fixture(scope="module")
def blocky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("blocky") / "config.json"
    path.write_text(json.dumps(BLOCKY))
    return path


@pytest.mark.parametrize("ac_every", [0, 2])
def test_offload_gives_the_same_loss_and_gradients(ac_every: int) -> None:
    """Every block wrapped, and the loss and every gradient of a step bit for bit as without
    offload (fp32: the copies are exact)."""
    spec = resolve_model("tiny")
    batch = synthetic_batch(spec, 2, 64, seed=5)
    results = []
    for offload in (False, True):
        config = TrainConfig(precision="fp32", ac_every=ac_every, act_offload=offload)
        module = build_model(spec, config)
        materialize(module, torch.device("cpu"), seed=0)
        wrapped = [isinstance(b, OffloadedBlock) for b in decoder_blocks(module)]
        assert all(wrapped) is offload
        loss = module(input_ids=batch, labels=batch).loss
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in module.parameters()]))
    (plain, plain_grads), (moved, grads) = results
    assert moved == plain
    for mine, theirs in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("knobs", "ranks", "within"),
    # FSDP2 measured once (docs/estimator.md): its peaks on this shape vary by a few percent
    # from run to run with the ranks' timing, and its estimate is 3-9 % over without offload.
    [({}, 1, 0.03), ({"engine": "ddp"}, 2, 0.03)],
    ids=["single", "ddp"],
)
def test_probe_moves_what_the_estimator_predicts(
    run_probe: RunProbe, blocky: Path, knobs: dict, ranks: int, within: float
) -> None:
    """The probe's counter of live tensor bytes with and without offload, and its host pool, at
    2 and 4 sequences (8 measured once: single 146.6 MB with offload, 145.8 predicted, host
    pool 256.2 MB, 243.5 predicted; DDP 173.4 MB, 172.6 predicted): each device peak with
    offload within ``within`` of its estimate, the device saving predicted within ``within``
    of the peak without offload, and the host pool within 10 % of the offloaded bytes
    predicted. In fp32: the bytes moved are what is checked, and bf16's matmuls take 41x
    fp32's on a CPU without AVX-512."""
    spec = resolve_model(str(blocky))
    sizes = (2, 4)
    measured, host = {}, {}
    for offload in (False, True):
        config = TrainConfig(**knobs, precision="fp32", act_offload=offload)
        result = run_probe(
            config,
            name=f"offload-{offload}",
            model=str(blocky),
            seq_len=SEQ,
            micro_batch_sizes=sizes,
            num_processes=ranks,
            timed_steps=1,  # a peak: the second step holds the optimizer states
        )
        assert result.outcome is Outcome.OK, probe_failure_text(result)
        measured[offload] = {s.micro_batch_size: s.peak_allocated_bytes for s in result.sizes}
        host[offload] = {
            s.micro_batch_size: s.offloaded_activation_peak_bytes for s in result.sizes
        }
    for mbs in sizes:
        predicted = {
            offload: estimate_memory(
                spec,
                TrainConfig(**knobs, precision="fp32", act_offload=offload),
                micro_batch_size=mbs,
                seq_len=SEQ,
                world_size=ranks,
                cuda_allocator=False,
            )
            for offload in (False, True)
        }
        saved = measured[False][mbs] - measured[True][mbs]
        print(
            f"{knobs} mbs {mbs}: without {measured[False][mbs]:,} B (predicted "
            f"{predicted[False].peak_bytes:,}), with {measured[True][mbs]:,} B (predicted "
            f"{predicted[True].peak_bytes:,}); host pool {host[True][mbs]:,} B (predicted "
            f"{predicted[True].offloaded_activation_bytes:,})"
        )
        assert host[False][mbs] == 0
        assert predicted[True].peak_bytes == pytest.approx(measured[True][mbs], rel=within)
        assert saved > 0
        predicted_saving = predicted[False].peak_bytes - predicted[True].peak_bytes
        assert abs(predicted_saving - saved) <= within * measured[False][mbs]
        assert predicted[True].offloaded_activation_bytes == pytest.approx(
            host[True][mbs], rel=0.10
        )


def test_the_host_counts_the_offloaded_activations_pinned_at_their_bound() -> None:
    spec = resolve_model("llama-7b")
    config = TrainConfig(engine="fsdp", zero_stage=3, ac_every=1, act_offload=True)
    memory = estimate_memory(spec, config, micro_batch_size=2, seq_len=4096, world_size=8)
    # Each block's input, bf16, for 2 x 4096 tokens: 32 blocks x 8192 x 4096 x 2 bytes.
    assert memory.offloaded_activation_bytes == 32 * 8192 * 4096 * 2
    plain = estimate_host(spec, dataclass_without_offload(config), world_size=8)
    moved = estimate_host(
        spec, config, world_size=8, activation_bytes=memory.offloaded_activation_bytes
    )
    extra = PINNED_ACTIVATION_BOUND * memory.offloaded_activation_bytes
    assert moved.per_rank_bytes - plain.per_rank_bytes == int(extra)
    on_cpu = estimate_host(
        spec, config, world_size=8, device="cpu", activation_bytes=memory.offloaded_activation_bytes
    )
    cpu_plain = estimate_host(spec, dataclass_without_offload(config), world_size=8, device="cpu")
    assert on_cpu.per_rank_bytes - cpu_plain.per_rank_bytes == memory.offloaded_activation_bytes


def dataclass_without_offload(config: TrainConfig) -> TrainConfig:
    return TrainConfig.from_dict({**config.to_dict(), "act_offload": False})


def test_the_time_model_charges_both_crossings_of_the_host_link() -> None:
    """On an H100 the checkpoints' copies cost a few percent, the full activations' a multiple
    of the step (they cross PCIe twice; checkpointing recomputes them at a fraction)."""
    spec, gpu = resolve_model("llama-7b"), gpu_spec("h100-80gb")

    def step(**knobs: object) -> float:
        config = TrainConfig(engine="fsdp", zero_stage=3, **knobs)  # type: ignore[arg-type]
        return predict_step_time(
            spec, config, gpu, micro_batch_size=2, seq_len=4096, grad_accum=1, world_size=8
        ).step_s

    every, every_moved = step(ac_every=1), step(ac_every=1, act_offload=True)
    off, off_moved = step(), step(act_offload=True)
    assert 1.0 < every_moved / every < 1.15
    assert off_moved / off > 2.0
    assert off_moved > every  # recomputing beats moving every activation


@pytest.mark.parametrize(
    ("knobs", "says"),
    [
        ({"engine": "deepspeed", "zero_stage": 2}, "not wired for DeepSpeed"),
        ({"ac_ops": True}, "cache of its own"),
        ({"lora_rank": 8}, "not modelled with LoRA"),
        ({"act_offload": "yes"}, "use true or false"),
    ],
)
def test_combinations_it_is_not_modelled_with_are_refused(knobs: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        TrainConfig(**{"act_offload": True, **knobs})


def test_a_cpu_run_searches_activation_offload_when_named(tmp_path: Path) -> None:
    """Real CPU probes of the tiny model under an emulated 4 MiB device: run --act-offload
    proposes the offloaded rows beside their twins (the first one probed is one: predicted the
    fastest that fits), and every offloaded trial measured fits the cap.

    One sequence a step (one micro-step a probe), and a budget for the first probes: the
    search's end is not checked here (on the CPU the offloaded row and its checkpointed twin
    run within each other's noise, and re-measuring them would take the whole budget)."""
    storage = f"sqlite:///{tmp_path}/at.db"
    done = autotune(
        "run", "--model", "tiny", "--device", "cpu", "--gpus", "1", "--device-memory", "4MiB",
        "--global-batch", "1", "--budget", "40s", "--act-offload", "--storage", storage,
        "--json", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["best"] is not None
    [study] = json.loads(autotune("trials", "--storage", storage, "--json", cwd=tmp_path).stdout)
    trials = sorted(study["trials"], key=lambda t: t["number"])
    assert trials[0]["config"]["act_offload"] is True, trials[0]
    assert "act:host" in trials[0]["label"]
    moved = [t for t in trials if t["config"]["act_offload"] and t["outcome"] == "ok"]
    assert moved and all(t["peak_bytes"] <= 4 << 20 for t in moved)
