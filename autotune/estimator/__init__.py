"""Predict the memory and step time of a configuration without running it.

- ``memory``: analytic peak device memory per rank (model states, activations, temporaries).
- ``timing``: analytic step time (compute, communication, offload, optimizer).
- ``trace``: one real training step under fake tensors, the ground truth the memory model is
  checked against.
"""
