"""What a parallel layout is to verify and ``bench --train``: one spec, read by the run planner.

A layout says how many ranks a run takes and on how many "nodes", the upstream flags that split
the model that way, the era features it needs (flags of the tree's parser), what of a model it
needs (experts), and how the run's sizes must change for it to split at all (layers for pipeline
stages, micro-batches for data parallelism or an interleaved schedule). Adding a layout adds a row
in :mod:`.registry`; nothing in the runner branches on a layout's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megaport.train import example
from megaport.train.tree_files import tree_text
from megaport.train.torchrun import Ranks


@dataclass(frozen=True)
class Layout:
    """One way of spreading a training run over ranks."""

    name: str
    #: one line for people: what it splits and how
    summary: str
    ranks: Ranks = Ranks()
    #: upstream's flags for it, given after the family's (argparse: the last value wins); the era's
    #: parser must have each for the layout to exist in it
    flags: tuple = ()
    #: flags that go with it where the era's parser has them (overlapped communication came after
    #: the distributed optimizer): ((flags...), ...)
    optional: tuple = ()
    #: the micro-batch size a run needs so that each rank (data parallelism) or stage (an
    #: interleaved schedule) gets whole micro-batches of the same global batch; None: the family's
    micro_batch: int | None = None
    #: the fewest layers the split needs (pipeline stages times virtual stages)
    layers: int | None = None
    #: whether it splits experts (a family without ``--num-experts`` has none to split)
    experts: bool = False
    #: the families a default verify trains it with (those the tree has); others on request
    families: tuple = ("llama",)
    #: what the port serves for it where upstream needs TransformerEngine or apex (report)
    served: str = ""
    #: whether unported upstream with its fusions off trains it without TE (loss parity in the
    #: layout); where it refuses (its torch norm under SP, its attention under CP), the comparison
    #: with one rank is the layout's yardstick
    upstream_runs: bool = True
    #: what the era's argument checks say where they refuse the layout: ((text in the parser's
    #: module, why in words), ...)
    refused_where: tuple = ()
    #: environment variables the layout's runs need, each with why: ((name, value, why), ...)
    environment: tuple = ()
    #: why the layout cannot train on the CPU (megaport's CPU placement serves upstream's CUDA calls,
    #: not everything of torch's that a layout builds on); "": it can
    gpu_only: str = ""
    #: the family's flags the layout cannot take, each with why: ((flag, why), ...)
    leaves_out: tuple = ()
    #: optional flags an era's upstream gets wrong, left out there: ((flag, file, text the era's file
    #: holds, text it lacks, why), ...)
    optional_wrong_where: tuple = ()

    def size(self, flag: str) -> int:
        """The layout's size of one parallel dimension (``--tensor-model-parallel-size`` …), else 1."""
        value = example.flag_value(list(self.flags), flag)
        return int(value) if value else 1

    @property
    def tensor_parallel(self) -> int:
        """How many ranks split each layer's weights (``--tensor-model-parallel-size``, else 1)."""
        return self.size("--tensor-model-parallel-size")

    @property
    def sequence_parallel(self) -> bool:
        """Whether its tensor-parallel ranks each run the norms on their own part of the sequence,
        so the weights they share get partial gradients until the ranks all-reduce them."""
        return "--sequence-parallel" in self.flags

    def present(self, tree: str, family_flags: list) -> str | None:
        """Why the layout cannot run on ``tree`` with a family of ``family_flags``; None where it can."""
        if self.experts and "--num-experts" not in family_flags:
            return "the model has no experts to split"
        missing = [f for f in self.flags if f.startswith("--") and not example.parser_has(tree, f)]
        if missing:
            return f"the era's parser has no {', '.join(missing)}"
        return next((why for text, why in self.refused_where if text in example.parser_text(tree)), None)

    def flags_for(self, tree: str) -> list:
        """The layout's flags, and those of :attr:`optional` the era's parser has and its code gets right."""
        wrong = {flag for flag, _ in self.optional_left_out(tree)}
        return list(self.flags) + [t for group in self.optional
                                   if example.parser_has(tree, group[0]) and group[0] not in wrong for t in group]

    def optional_left_out(self, tree: str) -> list:
        """The optional flags the era's parser has and its code gets wrong (:attr:`optional_wrong_where`),
        each with why: [(flag, why), ...]."""
        out = []
        for flag, rel, holds, lacks, why in self.optional_wrong_where:
            text = tree_text(tree, rel) or ""
            if example.parser_has(tree, flag) and holds in text and lacks not in text:
                out.append((flag, why))
        return out

    def sizes(self, sizes: example.Sizes) -> example.Sizes:
        """``sizes`` with at least the layers the split needs (the one-rank run it is compared with
        takes the same sizes)."""
        if self.layers and sizes.layers < self.layers:
            return dataclasses.replace(sizes, layers=self.layers)
        return sizes
