"""What a model family is to verify and ``bench --train``: one spec, read by both.

A family names upstream's entry point for the model, the example scripts its flags come from
(newest layout first) and a flag set for trees without any of them, the rule that says a tree has
the family, the sizes a shrunk run takes, the data it trains on and the flags that carry sizes
beyond GPT's. Adding a family adds a module beside this one and a line in :mod:`.registry`;
nothing in the runner branches on a family's name (TorchTitan's ``TrainSpec``, here for
Megatron's own entry points).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from megaport.train import example
from megaport.train.tree_files import first_file, tree_text


def _always(tree: str) -> bool:
    return True


@dataclass(frozen=True)
class Family:
    """One model family upstream ships, as verify trains it."""

    name: str
    #: upstream's script that trains it, at the tree's root
    entry_point: str
    #: one line for people: what upstream model it is
    summary: str
    #: example scripts its flags come from, newest layout first; the first the tree has is read
    scripts: tuple = ()
    #: the flags for a tree with none of ``scripts``, and where they come from
    fallback: tuple = ()
    fallback_source: str = ""
    #: whether the tree has the family (its entry point, the features its flags need)
    present: Callable[[str], bool] = _always
    #: a shrunk run's sizes on the CPU
    sizes: example.Sizes = field(default_factory=example.Sizes)
    #: "gpt": mock data where the era's mock documents are learnable, else the GPT-2 indexed
    #: dataset (:mod:`megaport.train.data`); "wordpiece": a WordPiece vocabulary and a dataset of
    #: multi-sentence documents (:mod:`megaport.train.wordpiece`), for BERT and T5
    data: str = "gpt"
    #: flags beyond GPT's that carry a size, and their shrunk values: (sizes, tree) -> {flag: [values]}
    size_flags: Callable[[example.Sizes, str], dict] = lambda sizes, tree: {}
    #: the script's flags a short run leaves out, each with why: {flag: why}
    dropped: dict = field(default_factory=dict)
    #: flags added after the script's, each group with why: ((flags...), why), ...
    added: tuple = ()
    #: environment variables both sides run with, each with why: {name: (value, why)}; only in the
    #: trees ``environment_needed`` says ask for them
    environment: dict = field(default_factory=dict)
    environment_needed: Callable[[str], bool] = _always
    #: what a ROCm user adds to run the family at all without TE, beside the fusions-off flags
    #: (those the era's parser has): ((flags...), why) or ((flags...), why, applies(tree) -> bool)
    fusions_off: tuple = ()
    #: loss parity's learning rate where the family's example trains slower: one a hundred
    #: iterations measurably learn at and stay stable at (a spiking run amplifies rounding apart)
    parity_learning_rate: float = example.PARITY_LEARNING_RATE
    #: iterations a layout is compared with one rank over (:mod:`megaport.train.checks.one_rank`):
    #: a window in which the family's loss falls measurably at its parity learning rate
    layout_steps: int = 30
    #: flags every side of a layout comparison leaves out on a tree: ``tree -> ((flag, why), ...)``
    layout_left_out: Callable[[str], tuple] = lambda tree: ()
    #: how far a layout comparison's runs of the family may part on a tree: ``tree ->
    #: parity.Tolerance``, or None for loss parity's default (loss 1 %, grad norm 5 %)
    layout_tolerance: Callable[[str], object] = lambda tree: None
    #: why the family's model cannot be split as a layout splits it on a tree, or None:
    #: ``(tree, layout) -> str | None`` (the layout is then listed as absent for it, with why)
    layout_refused: Callable = lambda tree, layout: None
    #: baseline shims the unported side starts with (beyond those a failure asks for)
    baseline_shims: tuple = ()
    #: whether flags the era's parser lacks are left out (and said in the notes) and multi-line
    #: quoted ARGS strings read to their end; GPT keeps its script's flags as it always read them
    #: (its rows predate families)
    drop_unknown_flags: bool = True
    #: third-party packages the family's model comes from that upstream imports as optional
    #: (Stanford's MoE layers are MegaBlocks'): where one is not installed, the family's tests skip
    #: with the suite's one line for a missing upstream dependency (``--strict`` counts it)
    needs: tuple = ()
    #: how a script's text becomes flags where :func:`example.script_flags` alone cannot read it
    #: (flags assembled in shell variables and ``if`` blocks): (text) -> [flags]
    script_reader: Callable[[str], list] | None = None
    #: a DeepSpeed family's config for the run, written to the run's folder: (tree, workdir, run,
    #: notes) -> the flags that pass it; None: no DeepSpeed config of its own
    deepspeed_config: Callable | None = None
    #: whether a Megatron-DeepSpeed tree takes this family's flags from the fork's own DeepSpeed
    #: example (:mod:`megaport.train.deepspeed_example`) rather than from :attr:`scripts`
    fork_example: bool = False
    #: whether a tree without :attr:`entry_point` (PyPI's megatron-core) trains it through megaport's
    #: harness on upstream's builders (:mod:`megaport.train.harness`)
    harness: bool = False
    #: whether its facts also go under the report's top-level keys (``training``, ``loss_parity``),
    #: which predate families
    headline: bool = False

    def flags(self, tree: str) -> tuple[list, str]:
        """The family's flags for ``tree`` and where they came from: the tree's script, else the
        fallback set."""
        for rel in self.scripts:
            text = tree_text(tree, rel)
            if text is not None:
                if self.script_reader is not None:
                    return self.script_reader(text), f"{rel} of the tree"
                return example.script_flags(text, quoted_strings=self.drop_unknown_flags), f"{rel} of the tree"
        return list(self.fallback), self.fallback_source

    def fusions_off_for(self, tree: str) -> list:
        """(flags, why) of :attr:`fusions_off` that ``tree``'s parser has and whose rule, if any, holds there."""
        return [(added, why) for added, why, *rule in self.fusions_off
                if example.parser_has(tree, added[0]) and all(holds(tree) for holds in rule)]

    def environment_for(self, tree: str) -> dict:
        """:attr:`environment` where the tree asks for it, else nothing: {name: (value, why)}."""
        return dict(self.environment) if self.environment and self.environment_needed(tree) else {}

    def missing_packages(self, python: str | None = None) -> list:
        """Those of :attr:`needs` that ``python`` (default: this one) cannot import: a run with
        another interpreter (``bench --train --python``) is asked in that interpreter."""
        import importlib.util
        import subprocess
        import sys

        if not self.needs:
            return []
        if python is None or os.path.realpath(python) == os.path.realpath(sys.executable):
            return [package for package in self.needs if importlib.util.find_spec(package) is None]
        probe = "import importlib.util, sys; print(*(p for p in sys.argv[1:] if importlib.util.find_spec(p) is None))"
        answer = subprocess.run([python, "-c", probe, *self.needs], capture_output=True, text=True, check=True)
        return answer.stdout.split()

    def has_entry_point(self, tree: str) -> bool:
        return first_file(tree, self.entry_point) is not None


#: upstream's legacy transformer views the query slice of its split QKV in one go, which only works
#: with one query group per tensor-parallel rank (Llama-2 70B at TP 8 has one; at TP 1 two groups
#: fail with "view size is not compatible", on any device); upstream never changed the line before
#: it removed the legacy transformer (8de8238844)
_LEGACY_GQA_VIEW = ("query_layer = query_layer.view(query_layer.size(0), query_layer.size(1), -1, "
                    "self.hidden_size_per_attention_head)")
_LEGACY_TRANSFORMERS = ("megatron/model/transformer.py", "megatron/legacy/model/transformer.py")


def legacy_gqa_view(tree: str) -> bool:
    """Whether ``pretrain_gpt.py`` builds upstream's legacy transformer by default (no
    ``--use-legacy-models`` to opt out of it) and its GQA view takes one group per TP rank at most
    (:data:`_LEGACY_GQA_VIEW`)."""
    return not example.parser_has(tree, "--use-legacy-models") and _LEGACY_GQA_VIEW in (
        tree_text(tree, *_LEGACY_TRANSFORMERS) or "")


def query_groups(sizes: example.Sizes, tree: str) -> int:
    """Grouped-query attention's groups for a shrunk run: half the heads, or one where the legacy
    GQA view refuses more (:func:`legacy_gqa_view`)."""
    return 1 if legacy_gqa_view(tree) else max(1, sizes.heads // 2)


def entry_point_and(*flags: str, entry_point: str = "pretrain_gpt.py") -> Callable[[str], bool]:
    """A presence rule: the tree has ``entry_point`` and its parser every one of ``flags``."""
    def present(tree: str) -> bool:
        return (first_file(tree, entry_point) is not None
                and all(example.parser_has(tree, flag) for flag in flags))
    present.__doc__ = f"{entry_point} and the parser's {', '.join(flags) or 'any flags'}"
    return present
