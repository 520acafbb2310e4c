"""Where routed experts live in MLX memory. ``expert_cache.ExpertCache`` answers every layer call
on one of four paths, visible there: all resident, the device-side table (the optional CUDA wing,
``protocol.SlotTable``, in ``cuda/``), a prefill's whole layers (``whole_layer``), or one host
sync into the slots under the budget (``slots``), whose bookkeeping is the eviction policy's
(``policy``) or the table's (``protocol.Book``). Slot pools and their typed views: ``pool``."""
