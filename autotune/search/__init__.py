"""The search: the ladder sampler (``ladder``) and the loop that runs probes (``controller``)."""
