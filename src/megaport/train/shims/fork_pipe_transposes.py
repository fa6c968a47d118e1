"""``fork-pipe-transposes``: Megatron-DeepSpeed's GPTModelPipe built without its two transposes, as the fork's 53db2b14.

From the fork's merge of upstream main (9e72d571, 2023-07-04) until 53db2b14 ("fix pp", 2023-07-12)
the embedding gave [s, b, h] and GPTModelPipe transposed it again around its layers: with the
fusions off the attention mask's shape refused the layers' [b, s, h] at the first pipeline step.
Here the pipeline module is handed GPTModelPipe's layer list without its transposing lambdas, which
is the fork's fix; the port fixes the same window in its own way (``rocm_port.fork_fixes``).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fork-pipe-transposes"
DESCRIPTION = ("Megatron-DeepSpeed 2023-07-04 … 07-12: GPTModelPipe without the transposes around its layers, as the "
               "fork's 53db2b14 (the embedding already gave [s, b, h]; pipeline runs stopped at the attention mask)")
ERAS = "Megatron-DeepSpeed 9e72d571 (2023-07-04) … 53db2b14 (2023-07-12)"
REPRODUCES = "the fork's 53db2b14 (fix pp)"
PATTERN = (Match(("RuntimeError",), message=r"must match the size of tensor b .* at non-singleton dimension 3",
                 code=r"masked_fill_\(attention_mask"),)


def _transposes_hidden_states(layer) -> bool:
    code = getattr(layer, "__code__", None)
    return (code is not None and layer.__name__ == "<lambda>" and code.co_filename.endswith("gpt_model.py")
            and "transpose" in code.co_names)


def layers_without_transposes(module) -> None:
    build = module.PipelineModule.__init__

    def __init__(self, layers, *args, **kwargs):
        if type(self).__name__ == "GPTModelPipe":
            layers = [layer for layer in layers if not _transposes_hidden_states(layer)]
        build(self, layers, *args, **kwargs)

    module.PipelineModule.__init__ = __init__


def install() -> None:
    after_import("deepspeed.runtime.pipe.module", layers_without_transposes)
