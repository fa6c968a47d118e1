"""A hub tokenizer's vocabulary reaches upstream in one order, by id, in every run process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

from megaport.train import vocab_order

_SHUFFLED = {"[SEP]": 3, "the": 5, "[PAD]": 0, "##s": 4, "[UNK]": 1, "[CLS]": 2}

_BACKEND = f'''
class TokenizersBackend:
    def get_vocab(self):
        return dict({_SHUFFLED!r})
'''

_SCRIPT = '''
import json
from transformers.tokenization_utils_tokenizers import TokenizersBackend
print("VOCAB", json.dumps(list(TokenizersBackend().get_vocab())))
'''


def _backend_module():
    module = types.ModuleType("transformers.tokenization_utils_tokenizers")
    exec(_BACKEND, module.__dict__)
    return module


def test_the_vocabulary_comes_sorted_by_id_with_the_same_entries():
    module = _backend_module()
    vocab_order.vocab_by_id(module)
    vocab_order.vocab_by_id(module)  # a second step for the module wraps nothing twice
    vocab = module.TokenizersBackend().get_vocab()
    assert vocab == _SHUFFLED
    assert list(vocab.values()) == [0, 1, 2, 3, 4, 5]
    assert module.TokenizersBackend.get_vocab.__wrapped__.__name__ == "get_vocab"


def _launch_and_read_vocab(tmp_path, env: dict) -> list:
    """What a script run by the launcher in environment ``env`` reads from a stand-in transformers."""
    package = tmp_path / "site" / "transformers"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "tokenization_utils_tokenizers.py").write_text(_BACKEND)
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    run_env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *filter(None, [env.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "megaport.train.launch", str(script)], env=run_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("VOCAB "))
    return json.loads(line[len("VOCAB "):])


def test_a_run_whose_environment_asks_for_it_sees_the_vocabulary_by_id(tmp_path):
    """Through the run launcher, as both sides of a parity pair start: sorted where the run's
    environment names it (a hub tokenizer's run), upstream's order untouched elsewhere."""
    env = {k: v for k, v in os.environ.items() if k != vocab_order.ENV}
    assert _launch_and_read_vocab(tmp_path, {**env, vocab_order.ENV: "1"}) == \
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "##s", "the"]
    assert _launch_and_read_vocab(tmp_path, env) == list(_SHUFFLED)
