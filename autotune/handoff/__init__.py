"""What autotune hands to a trainer: a measured configuration in the trainer's own terms.

- :mod:`~autotune.handoff.launch`: a :class:`~autotune.handoff.launch.Launch` (model,
  configuration, micro-batch, accumulation, GPUs, nodes) rendered as a DeepSpeed JSON, an
  accelerate YAML, ``TrainingArguments`` fields, a ``torchrun`` line or an FSDP2 snippet
  (``autotune export --format ...``);
- :mod:`~autotune.handoff.script`: the user's own training script's command, one adapter per
  framework, which the probes run and ``export --format command`` writes, and
  ``autotune.job_config()``, what a plain ``torchrun`` script reads;
- :mod:`~autotune.handoff.rlhf`: an RL layout as TRL's, OpenRLHF's or verl's configuration.

Pure functions over plain data: nothing here imports torch.
"""
