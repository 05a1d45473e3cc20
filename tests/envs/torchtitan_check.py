"""torchtitan's own reading of ``autotune export --format torchtitan`` modules, run in
torchtitan's environment (``tests/envs/frameworks.sh torchtitan``).

``torchtitan.train`` reads its configuration with ``ConfigManager().parse_args(argv)``: it
imports the ``--module``, calls its ``--config`` function for a ``Trainer.Config``, lets tyro
apply the command line's options to it (an unknown option or an ill-typed value is tyro's
``SystemExit(2)``) and builds it again, so ``Trainer.Config.__post_init__`` checks it
(microbatches under a pipeline, CUDA graphs). Then, with no GPU, this does what the trainer
does before it needs one, with torchtitan's own code:

- ``ParallelDims.from_config(parallelism, world_size)``: the degrees against the world;
- the model built on the meta device from ``config.model_spec`` (after
  ``update_from_config``), its parameters counted by torchtitan's ``get_nparams_and_flops``;
- under a pipeline, the schedule's class from torchtitan's ``get_schedule_class`` (single- or
  multi-stage), and each chunk's module names looked up in the built model.

Reads a JSON list on stdin, one object a module: ``{"path": ..., "world_size": N,
"config": "autotune", "argv": [...]}``; writes a JSON list, one object a module: ``{"error":
"..."}`` where torchtitan refused it, else what it read (see :func:`_read`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any


def _read(path: str, world_size: int, function: str, argv: list[str]) -> dict[str, Any]:
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    module = Path(path)
    sys.path.insert(0, str(module.parent))
    try:
        try:
            config = ConfigManager().parse_args(
                ["--module", module.stem, "--config", function, *argv]
            )
        except SystemExit as exit_:  # tyro's refusal of an option
            return {"error": f"torchtitan's parser exited {exit_.code}"}
    finally:
        sys.path.remove(str(module.parent))
        sys.modules.pop(module.stem, None)
    dims = ParallelDims.from_config(config.parallelism, world_size)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    params, _ = model_config.get_nparams_and_flops(model, config.training.seq_len)
    attention = model_config.layers[0].attention
    read: dict[str, Any] = {
        "flavor": config.model_spec.flavor,
        "params": params,
        "shape": {
            "hidden": model_config.dim,
            "layers": len(model_config.layers),
            "heads": attention.n_heads,
            "kv_heads": attention.n_kv_heads,
            "mlp": model_config.layers[0].feed_forward.w1.out_features,
            "vocab": model_config.vocab_size,
        },
        "training": {
            name: getattr(config.training, name)
            for name in (
                "local_batch_size",
                "global_batch_size",
                "seq_len",
                "dtype",
                "mixed_precision_param",
                "enable_cpu_offload",
                "disable_cuda_graphs",
            )
        },
        "parallelism": {
            name: getattr(config.parallelism, name)
            for name in (
                "data_parallel_shard_degree",
                "data_parallel_replicate_degree",
                "tensor_parallel_degree",
                "enable_sequence_parallel",
                "pipeline_parallel_degree",
                "context_parallel_degree",
                "fsdp_reshard_after_forward",
                "pipeline_parallel_schedule",
                "pipeline_parallel_microbatch_size",
                "module_fqns_per_model_part",
            )
        },
        "dims": {
            name: getattr(dims, name) for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
        },
        "activation_checkpoint": type(config.activation_checkpoint).__qualname__
        if config.activation_checkpoint is not None
        else None,
        "compile": {"enable": config.compile.enable, "components": config.compile.components},
        "loss": type(config.loss).__qualname__,
        "converters": len(getattr(config.model_spec, "converters", None) or []),
    }
    if dims.pp > 1:
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle
        from torchtitan.distributed.pipeline_parallel import get_schedule_class

        schedule = get_schedule_class(config.parallelism.pipeline_parallel_schedule)
        parts = config.parallelism.module_fqns_per_model_part or []
        names = {name for name, _ in model.named_modules()}
        read["pipeline"] = {
            "single_stage": issubclass(schedule, PipelineScheduleSingle),
            "stages_per_rank": len(parts) / dims.pp,
            "unknown_modules": [m for part in parts for m in part if m not in names],
            "blocks": [sum(m.startswith("layers.") for m in part) for part in parts],
        }
    return read


def main() -> None:
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    results = []
    for item in json.load(sys.stdin):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                results.append(
                    _read(
                        item["path"],
                        item["world_size"],
                        item.get("config", "autotune"),
                        item.get("argv", []),
                    )
                )
        except Exception as error:  # torchtitan's refusal: its message
            results.append({"error": f"{type(error).__name__}: {error}"})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
