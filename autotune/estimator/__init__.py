"""Predict the memory and step time of a configuration without running it.

- ``memory``: analytic peak device memory per rank (model states, activations, temporaries).
- ``timing``: analytic step time (compute, communication, offload, optimizer).

The ground truth the memory model is checked against, one real training step under fake
tensors, lives on the torch side: :mod:`autotune.probe.trace`.
"""
