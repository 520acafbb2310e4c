"""The decode benchmark's library (``moeflux-mlx bench``, ``benchmarks/decode.py``): cold reads
(``pagecache``), the runs side by side with stock mlx-lm (``decode``) and their report
(``report``)."""
