"""``dcp-write-item``: the asynchronous checkpoint writer calls torch's ``_write_item`` as torch does today.

Core 0.5 … 0.12's ``filesystem_async.py`` (upstream main 2024-02 … 2025-05) imports torch's private
``torch.distributed.checkpoint.filesystem._write_item`` and calls it as torch 2.3 had it,
``(stream, data, write_item, storage_key)``, or from 0.11 with the stream transforms first. torch 2.6
put the transforms first and 2.7 added ``serialization_format``: every writer process dies of a
TypeError and the save of ``RuntimeError: Worker failure: _write_item() missing … positional
argument``. So an unported tree of those eras cannot write a ``torch_dist`` checkpoint on today's
torch, which the cross-load check asks of it (core-0.10-0.12 c45e651854, DP2 + distributed
optimizer). Here the module's ``_write_item`` binds what the call leaves out: a transforms object
without extensions and ``torch.save``'s format, the values core 0.13's own call passes. The port
serves the same in its own way.
"""

from __future__ import annotations

import inspect

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "dcp-write-item"
DESCRIPTION = ("core 0.5 … 0.12's asynchronous checkpoint writer calls torch's _write_item without the stream "
               "transforms (torch >= 2.6) or the serialization format (torch >= 2.7): the missing ones bound as "
               "core 0.13's call passes them")
ERAS = "core 0.5 … 0.12 (main 2024-02 … 2025-05) writing a torch_dist checkpoint, on torch >= 2.6"
REPRODUCES = "torch < 2.6's _write_item, or upstream core 0.13's call"
PATTERN = (Match(("RuntimeError", "TypeError"), message=r"_write_item\(\) missing \d+ required positional argument",
                 file=r"filesystem_async\.py"),)
WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def bound_to_todays_torch(module) -> None:
    """``module._write_item`` (the writer's import of torch's) given the arguments its calls lack."""
    from torch.distributed.checkpoint import filesystem

    todays = getattr(filesystem, "_write_item", None)
    if todays is None or getattr(module, "_write_item", None) is not todays:
        return
    signature = inspect.signature(todays)
    names = tuple(signature.parameters)
    no_transforms = getattr(filesystem, "_StorageWriterTransforms", None)
    torch_save = getattr(getattr(filesystem, "SerializationFormat", None), "TORCH_SAVE", None)

    def _write_item(*args, **kwargs):
        leading = ()
        if names[:1] == ("transforms",) and no_transforms is not None and "transforms" not in kwargs \
                and not (args and isinstance(args[0], no_transforms)):
            leading = (no_transforms(),)
        call = (*leading, *args)
        if "serialization_format" in names and torch_save is not None:
            bound = signature.bind_partial(*call, **kwargs)
            bound.arguments.setdefault("serialization_format", torch_save)
            return todays(*bound.args, **bound.kwargs)
        return todays(*call, **kwargs)

    module._write_item = _write_item


def install() -> None:
    after_import(WRITER, bound_to_todays_torch)
