"""``fork-legacy-mpu``: Megatron-DeepSpeed 9e72d571's transformer calls tensor_parallel's
checkpointing on its ``mpu``.

Before 4278c0a1 the transformer's DeepSpeed recompute calls
``reset_checkpointed_activations_memory_buffer`` and ``checkpoint`` on ``mpu``, which is
parallel_state there (lacking the one, and with DeepSpeed's ``checkpoint``, another signature):
it gets tensor_parallel's two, as 4278c0a1 calls them; every other mpu name stays parallel_state's.
Stepped in after ``megatron.model``, which imports the transformer.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fork-legacy-mpu"
DESCRIPTION = ("Megatron-DeepSpeed 2023-07-04 (before 4278c0a1): the transformer's DeepSpeed recompute calls "
               "reset_checkpointed_activations_memory_buffer and checkpoint on its mpu (parallel_state): "
               "tensor_parallel's two, as 4278c0a1 calls them; every other mpu name stays parallel_state's")
ERAS = "Megatron-DeepSpeed 9e72d571 … 4278c0a1^ (2023-07-04)"
REPRODUCES = "Megatron-DeepSpeed 4278c0a1"
PATTERN = (Match(("AttributeError",), message=r"^module 'megatron\.core\.parallel_state' has no attribute "
                                              r"'(reset_checkpointed_activations_memory_buffer|checkpoint)'"),)


def legacy_mpu_in_transformer(package) -> None:
    import importlib

    from megatron.core import parallel_state, tensor_parallel

    transformer = importlib.import_module("megatron.model.transformer")

    class LegacyMpu:
        reset_checkpointed_activations_memory_buffer = staticmethod(
            tensor_parallel.reset_checkpointed_activations_memory_buffer)
        checkpoint = staticmethod(tensor_parallel.checkpoint)

        def __getattr__(self, name):
            return getattr(parallel_state, name)

    transformer.mpu = LegacyMpu()


def install() -> None:
    after_import("megatron.model", legacy_mpu_in_transformer)
