"""GPT: upstream's ``pretrain_gpt.py`` with the gpt3 example's flags (the family every era has)."""

from megaport.train import example
from megaport.train.families.spec import Family

FAMILY = Family(
    name="gpt",
    entry_point="pretrain_gpt.py",
    summary="GPT-3 style decoder (learned positions, LayerNorm, GeLU)",
    scripts=example.EXAMPLE_SCRIPTS,
    fallback=tuple(example.EXAMPLE_FLAGS),
    fallback_source=f"{example.EXAMPLE_SCRIPT} as of 2024-2026 (the tree has no example script)",
    # trees from PyPI's megatron-core have no pretrain_gpt.py: they train through the harness
    present=lambda tree: True,
    drop_unknown_flags=False,
    fork_example=True,
    harness=True,
    headline=True,
)
