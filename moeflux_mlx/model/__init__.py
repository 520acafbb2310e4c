"""The mlx-lm side: the drop-in for ``SwitchGLU`` / ``SwitchMLP`` (``switch``), the runtime
shared by a model's streaming modules and the cache factory (``runtime``), and ``load`` /
``patch_model`` (``load``)."""
