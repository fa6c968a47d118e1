"""``t5-decoder-output-pads``: T5's dataset zeroes its decoder output's pads, as upstream's 9ddbce3aa2 does.

On main from 75c07217d1 (2025-10-29) until 9ddbce3aa2 (2026-02-09; the core 0.16 releases carry the fix)
``T5MaskedWordPieceDataset.__getitem__`` ends with ``labels[labels == self._pad_token_id] = 0``,
``labels`` being its masked spans' loop variable: a sample without masked spans raises
``UnboundLocalError`` and the run stops (on a 2025-11 commit at iteration 17). Here the method's
source line is replaced by upstream's fixed one and the method compiled again in its module.
The port fixes the same window in its own way (``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

import inspect
import textwrap

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match
from megaport.train.tree_files import tree_says

NAME = "t5-decoder-output-pads"
DESCRIPTION = ("main 2025-10-29 (75c07217d1) … 2026-02-09 (9ddbce3aa2): T5's dataset zeroed the pads of "
               "its masked spans' loop variable, not of its decoder output, and failed on a sample without masked "
               "spans; the decoder output's, as upstream's 9ddbce3aa2")
ERAS = "main 2025-10-29 (75c07217d1) … 2026-02-09 (9ddbce3aa2)"
REPRODUCES = "upstream's 9ddbce3aa2 (fix: T5 dataset)"
BROKEN = "labels[labels == self._pad_token_id] = 0"
FIXED = "decoder_output[decoder_output == self._pad_token_id] = 0"
PATTERN = (Match(("UnboundLocalError",), message=r"'labels'", file=r"t5_dataset\.py"),
           # raised in a DataLoader worker: the main process re-raises it with the worker's traceback as text
           Match(("UnboundLocalError",), message=r"t5_dataset\.py[\s\S]*local variable 'labels'"))


def applies(tree: str) -> bool:
    """Whether the unported ``tree``'s T5 dataset has the window's statement."""
    return tree_says(tree, "megatron/core/datasets/t5_dataset.py", BROKEN)


def decoder_output_pads(module) -> None:
    dataset = module.T5MaskedWordPieceDataset
    source = textwrap.dedent(inspect.getsource(dataset.__getitem__))
    if BROKEN not in source:
        return
    scope: dict = {}
    exec(compile(source.replace(BROKEN, FIXED), inspect.getsourcefile(dataset.__getitem__), "exec"),
         module.__dict__, scope)
    dataset.__getitem__ = scope["__getitem__"]


def install() -> None:
    after_import("megatron.core.datasets.t5_dataset", decoder_output_pads)
