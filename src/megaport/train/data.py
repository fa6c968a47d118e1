"""Data a shrunk run trains on, written for it: nothing is downloaded.

Eras whose parser has ``--mock-data`` use upstream's own mock dataset. Older ones read upstream's
indexed format (``.bin``/``.idx``, MMIDIDX version 1) through a GPT-2 BPE tokenizer; this module
writes a tiny dataset of learnable documents and a byte-level GPT-2 vocabulary (256 byte symbols
and the end-of-document token, no merges), which upstream's readers load as they are.
"""

from __future__ import annotations

import json
import os
import random
import struct

# The GPT-2 byte-level alphabet: printable bytes stand for themselves, the others are shifted past
# 255 (the same table as upstream's gpt2_tokenization.bytes_to_unicode).
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
EOD = "<|endoftext|>"
BYTE_VOCAB_SIZE = 257  # the 256 byte symbols and EOD, the last id


def write_gpt2_vocabulary(directory: str) -> tuple[str, str]:
    """A byte-level GPT-2 vocabulary (256 byte symbols and the end-of-document token) and an
    empty merges list: upstream's GPT2BPETokenizer loads them; paths of vocab.json, merges.txt."""
    shifted = [b for b in range(256) if b not in _PRINTABLE]
    symbols = [chr(b) for b in _PRINTABLE] + [chr(256 + n) for n in range(len(shifted))]
    vocab = {symbol: n for n, symbol in enumerate(symbols)}
    vocab[EOD] = len(vocab)
    assert len(vocab) == BYTE_VOCAB_SIZE
    vocab_file, merges_file = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merges_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    return vocab_file, merges_file


def write_indexed_dataset(prefix: str, documents: list, *, sentences: bool = False) -> None:
    """``prefix.bin``/``prefix.idx`` in upstream's mmap indexed format (MMIDIDX, version 1,
    uint16 tokens): one sequence per document, as upstream's preprocess_data.py writes them; with
    ``sentences``, each document a list of sentences, one sequence each, as its
    ``--split-sentences`` writes them (BERT's and T5's datasets sample sentence spans of a document)."""
    sequences = [s for doc in documents for s in doc] if sentences else documents
    boundaries = [0]
    for doc in documents:
        boundaries.append(boundaries[-1] + (len(doc) if sentences else 1))
    _write(prefix, sequences, boundaries)


def _write(prefix: str, sequences: list, boundaries: list) -> None:
    documents = sequences
    sizes = [len(doc) for doc in documents]
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            f.write(struct.pack(f"<{len(doc)}H", *doc))
    pointers, offset = [], 0
    for size in sizes:
        pointers.append(offset)
        offset += 2 * size
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", 8))  # uint16 in upstream's dtype codes
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(boundaries)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(boundaries)}q", *boundaries))


def learnable_documents(count: int, length: int, vocab: int, seed: int) -> list:
    """Runs of consecutive token ids with random starts and strides, ending with the
    end-of-document id ``vocab - 1``: a model learns them within a few steps, so the loss falls."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        start, stride = rng.randrange(vocab - 1), rng.randrange(1, 4)
        docs.append([(start + stride * k) % (vocab - 1) for k in range(length - 1)] + [vocab - 1])
    return docs


def indexed_data_flags(workdir: str, sizes, short_run: list) -> list:
    """Write the dataset and vocabulary for ``sizes`` (an example.Sizes) into ``workdir``; the flags
    that point upstream's parser at them."""
    vocab_file, merges_file = write_gpt2_vocabulary(workdir)
    prefix = os.path.join(workdir, "tiny_text_document")
    tokens_needed = (sizes.steps + 2) * sizes.batch * (sizes.seq + 1)
    count = max(64, 2 * tokens_needed // (4 * sizes.seq))
    write_indexed_dataset(prefix, learnable_documents(count, 4 * sizes.seq, BYTE_VOCAB_SIZE, seed=1234))
    return ["--data-path", prefix, "--vocab-file", vocab_file, "--merge-file", merges_file,
            "--tokenizer-type", "GPT2BPETokenizer", *short_run]
