"""CUDA only, optional: the device-side slot table. Decode looks expert slots up on the GPU
(``table_kernels``), and only the GPU waits, only on misses, for the miss server process
(``miss_server``, talked to through ``miss_client``) that reads them; ``table_cache.TableCache``
is the cache it adds. Below it: CUDA's runtime through ctypes (``runtime``: pinned, mapped
memory), memory shared with the server (``shared_memory``) and the words they share
(``control_block``). Beside it, for a prefill's whole layers: their copy out of host staging on
a few blocks (``layer_copy``) or on the copy engines (``copy_engine``). Nothing outside this
package imports it but the cache factory (``model.runtime.make_cache``)."""
