"""Reading experts from disk into host memory: the store (``store``: pread thread pool or mmap,
chosen by the RAM gate, or pread bypassing the page cache: ``uncached``)."""
