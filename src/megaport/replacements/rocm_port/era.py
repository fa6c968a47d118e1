"""The port's era constants: what megaport renders differently for each upstream era.

They live here alone, each defined once in the package, so rendering a series' copy changes this one
file; every other module reads them from here."""

from __future__ import annotations

# Era constant, rendered per upstream era by megaport.  Since upstream commit
# 76db958327 (2022-07-28) the masked-softmax kernel writes zeros for a row whose
# maximum after masking and scaling is exactly -10000.0 (a fully masked row); before
# it, such a row came out uniform (the softmax of a row of -10000.0).
FULLY_MASKED_ROWS_ARE_ZERO = True

# Era constant: False for the eras (2023-07 to 2024-06) whose megatron/core imports
# TransformerEngine layers at module level with no guard; see .te_absent.
TRANSFORMER_ENGINE_IMPORTS_GUARDED = True
