"""``transformers-sentinels``: T5's sentinel tokens read back as transformers 4 gave them.

Core 0.14 … 2026-05's ``HuggingFaceTokenizer`` copies the special tokens back from the Hugging
Face tokenizer by the names in transformers' ``SPECIAL_TOKENS_ATTRIBUTES``; transformers 5 dropped
``additional_special_tokens`` from that list, so the wrapper never gets the attribute its
``additional_special_tokens_ids`` reads, and ``pretrain_t5.py`` dies of an AttributeError building
its dataset. Here the wrapper's ``add_special_tokens`` records the extra tokens it was asked to
add, as transformers 4 left them on it (upstream fixed the wrapper itself in e69a1ea43b).
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "transformers-sentinels"
DESCRIPTION = ("the tokenizer wrapper's additional_special_tokens (T5's sentinels) recorded as transformers 4 left "
               "them (transformers 5 no longer lists the name; upstream fixed the wrapper in 2026-05)")
ERAS = "core 0.14 … main 2026-05 (megatron/core/tokenizers), with transformers 5"
REPRODUCES = "transformers < 5's SPECIAL_TOKENS_ATTRIBUTES, or upstream's e69a1ea43b"
PATTERN = (Match(("AttributeError",), message=r"has no attribute 'additional_special_tokens'",
                 file=r"huggingface_tokenizer\.py$"),)
_WRAPPER = "megatron.core.tokenizers.text.libraries.huggingface_tokenizer"


def record_extra_tokens(module) -> None:
    cls = getattr(module, "HuggingFaceTokenizer", None)
    if cls is None or "add_special_tokens" not in cls.__dict__:
        return
    add = cls.add_special_tokens

    def add_special_tokens(self, special_tokens_dict):
        added = add(self, special_tokens_dict)
        if "additional_special_tokens" not in vars(self):
            self.additional_special_tokens = list(special_tokens_dict.get("additional_special_tokens") or [])
        return added

    cls.add_special_tokens = add_special_tokens


def install() -> None:
    after_import(_WRAPPER, record_extra_tokens)
