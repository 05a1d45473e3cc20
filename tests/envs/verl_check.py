"""verl's own check of ``python3 -m verl.trainer.main_ppo OVERRIDES...`` command lines, run
in verl's environment (``tests/envs/frameworks.sh verl``).

``verl.trainer.main_ppo.main`` is a ``hydra.main`` of its package's ``config/ppo_trainer.yaml``
that validates the composed configuration before it starts Ray:
``validate_config(config, use_reference_policy=need_reference_policy(config),
use_critic=need_critic(config))``. This does the same with the same functions, imported from
the installed ``verl.trainer.main_ppo``: Hydra composes the installed package's
``ppo_trainer`` with the overrides (an unknown key or a bad value is Hydra's error), then verl
validates it (the critic's model config loads the critic's ``config.json`` and tokenizer from
its path). Nothing starts: no Ray, no engine.

Reads a JSON list of command lines (each the list of arguments after ``python3``) on stdin;
writes a JSON list, one object a command line: ``{"error": "..."}`` where verl or Hydra refused
it, else ``use_reference_policy``, ``use_critic``, ``use_reward_model`` (what verl decided to
load) and ``config``, the composed configuration resolved. verl's own messages go to stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

MODULE = "verl.trainer.main_ppo"


def check(argv: list[str]) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer import main_ppo
    from verl.trainer.ppo.utils import need_reward_model

    if argv[:2] != ["-m", MODULE]:
        return {"error": f"not a {MODULE} command line: {argv[:2]}"}
    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            config = compose(config_name="ppo_trainer", overrides=argv[2:])
        main_ppo.auto_set_device(config)
        use_reference_policy = bool(main_ppo.need_reference_policy(config))
        use_critic = bool(main_ppo.need_critic(config))
        main_ppo.validate_config(
            config=config, use_reference_policy=use_reference_policy, use_critic=use_critic
        )
    except Exception as refused:  # Hydra's and verl's refusals: what the user would see
        return {"error": f"{type(refused).__name__}: {refused}"}
    return {
        "use_reference_policy": use_reference_policy,
        "use_critic": use_critic,
        "use_reward_model": bool(need_reward_model(config)),
        "config": OmegaConf.to_container(config, resolve=True),
    }


def main() -> int:
    commands = json.load(sys.stdin)
    with contextlib.redirect_stdout(sys.stderr):
        results = [check(argv) for argv in commands]
    json.dump(results, sys.stdout, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
