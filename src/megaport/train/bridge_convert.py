"""The Megatron-Bridge import upstream's docs give for Llama since upstream removed its own Llama
loader (39ec5ebeb4, 2026-05): ``python Megatron-Bridge/examples/conversion/convert_checkpoints.py
import --hf-model M --megatron-path D --torch-dtype T``. That script is Bridge's repository's, not its
wheel's (and left Bridge's main for ``scripts/conversion`` in c8344d0f4, 2026-07-15); its ``import``
is one call, ``AutoBridge.import_ckpt``, which this module makes with the same arguments, so a
``pip install megatron-bridge`` is all verify needs of Bridge.

Run it as the docs' script is run, in the ported tree's environment (on the CPU through megaport's
launcher): Bridge imports the ported ``megatron.core`` before its LoRA layers, and with it the port,
which serves what those ask of TransformerEngine (``rocm_port.upstream_fixes._SOURCE_FIXES``).
"""

from __future__ import annotations

import argparse

#: the docs' script's --torch-dtype choices
DTYPES = ("float32", "float16", "bfloat16")


def main(argv: list | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    imported = commands.add_parser("import", help="Hugging Face model -> Megatron checkpoint")
    imported.add_argument("--hf-model", required=True, help="Hugging Face model ID or folder")
    imported.add_argument("--megatron-path", required=True, help="folder to write the Megatron checkpoint to")
    imported.add_argument("--torch-dtype", choices=DTYPES, help="precision of the converted weights")
    imported.add_argument("--device-map", help='device placement ("auto", "cuda:0")')
    args = parser.parse_args(argv)

    import torch
    from megatron.bridge import AutoBridge

    kwargs = {"torch_dtype": getattr(torch, args.torch_dtype)} if args.torch_dtype else {}
    if args.device_map:
        kwargs["device_map"] = args.device_map
    AutoBridge.import_ckpt(hf_model_id=args.hf_model, megatron_path=args.megatron_path, **kwargs)
    print(f"imported {args.hf_model} into {args.megatron_path}")


if __name__ == "__main__":
    main()
