"""CUDA only, optional: the device-side slot table. Decode looks expert slots up on the GPU
(``table_kernels``), and only the GPU waits, only on misses, for the miss server process
(``miss_server``, talked to through ``miss_client``) that reads them; ``table_cache.DeviceTable``
is the wing it adds to the cache (``cache.protocol.SlotTable``). Below it: CUDA's runtime through
ctypes (``runtime``: pinned, mapped memory), memory shared with the server (``shared_memory``)
and the words they share (``control_block``). Beside it, for a prefill's whole layers: their
copy out of host staging, or out of pinned expert files, on a few blocks (``layer_copy``).
Nothing outside this package imports it but the cache factory (``model.runtime.make_cache``)."""
