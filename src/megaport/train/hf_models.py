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
#: the Llama's FFN width
FFN = 176
#: the Mixtral's experts: as many as the docs' --num-experts, each routed to two at a time, each
#: expert's FFN narrower than the Llama's (8 x 48 x 64 x 3 weights a layer)
EXPERTS, TOPK, MOE_FFN = 8, 2, 48
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
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=POSITIONS,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        initializer_range=INIT_STD))


def _mixtral():
    """Mixtral as upstream's examples/mixtral runs it: 8 experts, top-2 (the docs' --num-experts 8
    --moe-router-topk 2), RoPE base 1e6 (the docs' --rotary-base 1000000), untied; no router jitter;
    its weights rounded to bf16's, which upstream's loader stores (it sets bf16)."""
    import torch
    import transformers

    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MOE_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=POSITIONS,
        num_local_experts=EXPERTS, num_experts_per_tok=TOPK, rope_theta=1000000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=INIT_STD, router_jitter_noise=0.0))
    # upstream's loader converts to bf16 (it sets --bf16): weights bf16 holds exactly convert losslessly,
    # so Megatron's fp32 run has the weights transformers' has
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    return model


#: family -> the transformers model it makes
MODELS = {"llama": _llama, "mixtral": _mixtral}

#: family -> the tiny model's sizes as Megatron's flags name them, for the flags a Source row's docs
#: give with their own model's values (hf_in.Source.size_flags)
SIZES = {
    "llama": {"--num-layers": LAYERS, "--hidden-size": HIDDEN, "--ffn-hidden-size": FFN,
              "--num-attention-heads": HEADS, "--num-query-groups": GROUPS},
    "mixtral": {"--num-layers": LAYERS, "--hidden-size": HIDDEN, "--ffn-hidden-size": MOE_FFN,
                "--num-attention-heads": HEADS, "--num-query-groups": GROUPS,
                "--num-experts": EXPERTS, "--moe-router-topk": TOPK},
}


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
