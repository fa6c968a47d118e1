"""megaport: port upstream NVIDIA Megatron-LM to AMD ROCm with versioned patch series."""

__version__ = "0.1.0"
