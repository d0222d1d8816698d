"""A plan as another framework's configuration (``pipeloom plan --export``): :mod:`.torchtitan` (its settings, TOML
and schedule CSV) and :mod:`.megatron` (Megatron-LM's command-line arguments)."""
