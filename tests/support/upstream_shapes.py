"""Upstream code in the shapes tests replay, shared by the port's tests and the baseline shims' tests."""

#: core 0.17's HuggingFaceTokenizer (megatron/core/tokenizers/text/libraries) in part, over a hub
#: tokenizer that behaves as transformers 5's: SPECIAL_TOKENS_ATTRIBUTES without
#: additional_special_tokens
HF_WRAPPER_2025 = """
class _HubTokenizer:  # transformers 5: SPECIAL_TOKENS_ATTRIBUTES without additional_special_tokens
    SPECIAL_TOKENS_ATTRIBUTES = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                                 "mask_token"]

    def __init__(self):
        self.vocab = {"[PAD]": 0, "[CLS]": 1}

    def add_special_tokens(self, tokens):
        for token in tokens.get("additional_special_tokens", []):
            self.vocab.setdefault(token, len(self.vocab))
        return len(tokens.get("additional_special_tokens", []))

    def convert_tokens_to_ids(self, tokens):
        return [self.vocab[t] for t in tokens]


class HuggingFaceTokenizer:  # core 0.17's wrapper (megatron/core/tokenizers/text/libraries), in part
    def __init__(self, tokenizer_path, vocab_file=None, additional_special_tokens=[], **kwargs):
        self.tokenizer = _HubTokenizer()
        self.add_special_tokens({"additional_special_tokens": additional_special_tokens})

    def add_special_tokens(self, special_tokens_dict):
        added = self.tokenizer.add_special_tokens(special_tokens_dict)
        for k in self.tokenizer.SPECIAL_TOKENS_ATTRIBUTES:
            setattr(self, k, getattr(self.tokenizer, k, None))
        return added

    def token_to_id(self, token):
        return self.tokenizer.vocab[token]

    @property
    def additional_special_tokens_ids(self):
        \"\"\"T5's sentinels.\"\"\"
        return [self.token_to_id(token) for token in self.additional_special_tokens]


class MegatronHFTokenizer(HuggingFaceTokenizer):
    def __init__(self, tokenizer_path, vocab_file=None, **kwargs):
        super().__init__(tokenizer_path, vocab_file, **kwargs)
"""
