"""The ``moeflux-mlx`` commands, one module each, each owning its parser (``add_args``), its
``run`` and a ``main`` of its own (``python -m moeflux_mlx.commands.NAME``); ``common`` holds what
they share. ``moeflux_mlx.cli`` only dispatches to them."""
