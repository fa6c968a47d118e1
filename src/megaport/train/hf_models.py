"""``python -m megaport.train.hf_models FAMILY OUT``: a tiny random Hugging Face model of a family,
made and saved by ``transformers`` as a user's download would be (weights, config, tokenizer), and
what ``transformers`` computes on one fixed sequence, for the Hugging Face round trip
(:mod:`megaport.train.hf_in`). Runs in the interpreter that trains, so the ``transformers`` it
imports is the user's (4.x or 5.x); it prints one JSON document on its last line.

The sequence is what upstream's GPT dataset makes of a single 64-token document repeated: input
``d0 … d63``, targets ``d1 … d63, d0`` (the next epoch's first token). The loss is the mean
cross-entropy over those 64 positions in fp32, as Megatron's first logged ``lm loss`` is.
"""

from __future__ import annotations

import json
import sys

#: the tiny models' sizes: GQA (4 heads, 2 groups), a RoPE base other than Megatron's default, untied
VOCAB, HIDDEN, LAYERS, HEADS, GROUPS, SEQ = 1024, 64, 2, 4, 2, 64
#: upstream's Llama loader fixes --seq-length at 4096: the position table must reach it
POSITIONS = 8192
#: weights drawn wide enough that the loss is the weights' own (8.13 here), far from a near-uniform
#: model's ln(VOCAB) = 6.93 (transformers' default 0.02 gives 6.9278): weights that did not load, or
#: loaded into the wrong places, cannot land within the round trip's tolerance by chance
INIT_STD = 0.2


def _tokenizer(out: str) -> None:
    """A word-level tokenizer of ``VOCAB`` entries (t0 … t1023), saved beside the weights."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(out)


def _llama():
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=176, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=POSITIONS,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        initializer_range=INIT_STD))


#: family -> the transformers model it makes
MODELS = {"llama": _llama}


def make(family: str, out: str) -> dict:
    """Save the family's tiny model and tokenizer in ``out``; the document and the loss on it."""
    import torch

    torch.manual_seed(0)
    model = MODELS[family]().float()
    model.save_pretrained(out)
    _tokenizer(out)
    document = torch.randint(3, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([document[1:], document[:1]])
    with torch.no_grad():
        logits = model(document[None]).logits[0].float()
    import transformers

    return {"document": document.tolist(), "loss": torch.nn.functional.cross_entropy(logits, targets).item(),
            "transformers": transformers.__version__, "folder": out}


def main(argv=None) -> int:
    family, out = (argv or sys.argv[1:])[:2]
    print(json.dumps(make(family, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
