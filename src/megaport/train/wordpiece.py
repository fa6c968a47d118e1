"""BERT's and T5's data, written for the run: a WordPiece vocabulary and documents of sentences.

Their datasets build samples from sentence spans inside a document (BERT's sentence-order head
needs two segments of one document), so the indexed dataset holds one sequence per sentence and
documents of several sentences, as upstream's ``preprocess_data.py --split-sentences`` writes them.
The text is learnable in a short run: each document counts through the word list with its own
start and stride, across its sentences, so a masked word (BERT) or span (T5) follows from its
neighbours and the loss falls.
"""

from __future__ import annotations

import os
import random

from megaport.train.data import write_indexed_dataset

#: BERT's special tokens, first in the vocabulary (upstream's tokenizer looks them up by name)
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
WORDS = 40


def write_wordpiece_vocabulary(directory: str, words: int = WORDS) -> str:
    """``vocab.txt``: the special tokens and ``words`` lower-case words, one a line (what
    upstream's BertWordPieceLowerCase/Case tokenizers load); its path."""
    path = os.path.join(directory, "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join([*SPECIALS, *(f"w{n}" for n in range(words))]) + "\n")
    return path


def sentence_documents(count: int, vocab_words: int, seed: int, first_id: int = len(SPECIALS)) -> list:
    """``count`` documents of 4-8 sentences of 6-14 word ids each, counting on from a random start
    by a random stride of 1-2 across the document."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        at, stride, doc = rng.randrange(vocab_words), rng.randrange(1, 3), []
        for _ in range(rng.randrange(4, 9)):
            length = rng.randrange(6, 15)
            doc.append([first_id + (at + stride * k) % vocab_words for k in range(length)])
            at += stride * length
        docs.append(doc)
    return docs


def wordpiece_data_flags(workdir: str, sizes, short_run: list, tokenizer: str) -> list:
    """Write the vocabulary and dataset for ``sizes`` (an example.Sizes) into ``workdir``; the flags
    that point upstream's parser at them."""
    vocab = write_wordpiece_vocabulary(workdir)
    prefix = os.path.join(workdir, "tiny_text_sentence")
    tokens_needed = (sizes.steps + 8) * sizes.batch * sizes.seq
    write_indexed_dataset(prefix, sentence_documents(max(64, 2 * tokens_needed // 60), WORDS, seed=1234),
                          sentences=True)
    return ["--data-path", prefix, "--vocab-file", vocab, "--tokenizer-type", tokenizer, *short_run]
