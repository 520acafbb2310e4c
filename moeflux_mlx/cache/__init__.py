"""Where routed experts live in MLX memory. One protocol (``protocol``: "slots and pool for these
indices"), slot pools (``pool``), pluggable eviction policies (``policy``), and the caches: no
residency (``staging``) and slots under a byte budget with a host sync per call (``budget``, on
``synced``). The CUDA device-side table is a cache of its own, in ``cuda/``."""
