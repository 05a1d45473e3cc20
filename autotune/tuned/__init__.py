"""What a probe tunes, beside autotune's stand-in model (:mod:`autotune.models`, built and
trained by the probe's worker): the user's own training script (:mod:`~autotune.tuned.script`)
and an RL iteration's models and layout (:mod:`~autotune.tuned.rlhf`). Each is plain data the
search and the study treat alike: part of a study's fingerprint, and what a probe's spec
carries to its ranks. Nothing here imports torch.
"""
