"""A Hugging Face tokenizer's vocabulary in one order, by id, for both sides of a parity pair.

A tokenizers-backed tokenizer hands out its vocabulary from a Rust hash map, whose order is drawn
anew in every process. Upstream's tokenizer system (core 0.17 on) loads BERT's WordPiece tokenizer
from the hub, and its BERT and T5 datasets draw masking's random replacement tokens by index from
``list(tokenizer.inv_vocab)``, so one commit with one seed trains on different batches from its
second iteration on: main 2026-02's unported BERT, run twice, logged grad norms 5.932 and 5.974 at
iteration 2. No flag or environment variable fixes that order, so the run (ported and unported
alike, :mod:`megaport.train.launch`) gets the same vocabulary dict sorted by id: same entries, one
order, the order a vocabulary file lists them in.
"""

from __future__ import annotations

import functools

from megaport.train.hooks import after_import

#: set in a run's environment (:func:`megaport.train.wordpiece.offline_hub_tokenizer`) to install it
ENV = "MEGAPORT_VOCAB_BY_ID"

#: the class whose ``get_vocab`` reads the Rust map, per transformers release line
_VOCAB_CLASSES = {
    "transformers.tokenization_utils_tokenizers": "TokenizersBackend",  # transformers 5
    "transformers.tokenization_utils_fast": "PreTrainedTokenizerFast",  # transformers 4
}

NOTE = ("the Hugging Face tokenizer's vocabulary sorted by id in both runs (its Rust hash map's order is "
        "random per process, and BERT's and T5's masking draw replacement tokens from it by index)")


def vocab_by_id(module) -> None:
    """Make the module's tokenizer class return its vocabulary sorted by token id."""
    cls = getattr(module, _VOCAB_CLASSES[module.__name__], None)
    if cls is None or getattr(cls.get_vocab, "_megaport_by_id", False):
        return
    unordered = cls.get_vocab

    @functools.wraps(unordered)
    def get_vocab(self):
        return dict(sorted(unordered(self).items(), key=lambda item: item[1]))

    get_vocab._megaport_by_id = True
    cls.get_vocab = get_vocab


def install() -> None:
    """Sort the vocabulary once transformers' tokenizer module loads (whichever release has it)."""
    for module in _VOCAB_CLASSES:
        after_import(module, vocab_by_id)
