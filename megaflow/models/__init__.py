"""Model families trained by megaflow (megatron-core DiTs). See ``registry`` and ``provider``."""
