"""BERT's and T5's data, written for the run: a WordPiece vocabulary and documents of sentences.

Their datasets build samples from sentence spans inside a document (BERT's sentence-order head
needs two segments of one document), so the indexed dataset holds one sequence per sentence and
documents of several sentences, as upstream's ``preprocess_data.py --split-sentences`` writes them.
The text is learnable in a short run: each document counts through the word list with its own
start and stride, across its sentences, so a masked word (BERT) or span (T5) follows from its
neighbours and the loss falls.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

from megaport.train import vocab_order
from megaport.train.data import write_indexed_dataset
from megaport.train.tree_files import tree_text

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


#: the hub's tokenizer_config.json of the models upstream's new tokenizer system names for
#: BertWordPiece* (megatron/core/tokenizers/text/libraries/megatron_hf_tokenizer.py)
_HUB_TOKENIZERS = {"bert-large-uncased": {"do_lower_case": True, "model_max_length": 512},
                   "bert-large-cased": {"do_lower_case": False, "model_max_length": 512}}
_HF_TOKENIZER_MAP = "megatron/core/tokenizers/text/libraries/megatron_hf_tokenizer.py"
_SNAPSHOT = "megaport-run"


def hub_tokenizer_name(tree: str, tokenizer: str) -> str | None:
    """The Hugging Face hub model the tree's tokenizer system loads for ``tokenizer`` (core 0.14's
    new system: BertWordPieceLowerCase is ``bert-large-uncased``, a download even with
    ``--vocab-file``), or None where the tree reads the vocabulary file alone."""
    text = tree_text(tree, _HF_TOKENIZER_MAP)
    if text is None:
        return None
    entry = re.search(r'"%s":\s*\{[^}]*"tokenizer_name":\s*"([^"]+)"' % re.escape(tokenizer), text)
    return entry.group(1) if entry and entry.group(1) in _HUB_TOKENIZERS else None


def offline_hub_tokenizer(workdir: str, name: str, vocab: str) -> dict:
    """A Hugging Face cache in ``workdir`` holding hub model ``name``'s tokenizer files with the run's
    vocabulary, laid out as ``huggingface_hub`` caches a download; the environment that makes
    ``AutoTokenizer.from_pretrained(name)`` read it offline (verify's runs have no network, and
    both sides of a parity pair get the same files), its vocabulary in one order
    (:mod:`megaport.train.vocab_order`)."""
    hub = os.path.join(workdir, "hf-home", "hub")
    model = os.path.join(hub, "models--" + name.replace("/", "--"))
    snapshot = os.path.join(model, "snapshots", _SNAPSHOT)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(model, "refs"), exist_ok=True)
    with open(os.path.join(model, "refs", "main"), "w", encoding="utf-8") as f:
        f.write(_SNAPSHOT)
    files = {"tokenizer_config.json": {**_HUB_TOKENIZERS[name], "tokenizer_class": "BertTokenizer"},
             "config.json": {"model_type": "bert"}}
    for filename, content in files.items():
        with open(os.path.join(snapshot, filename), "w", encoding="utf-8") as f:
            json.dump(content, f)
    shutil.copyfile(vocab, os.path.join(snapshot, "vocab.txt"))
    return {"HF_HOME": os.path.join(workdir, "hf-home"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            vocab_order.ENV: "1"}
