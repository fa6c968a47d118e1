"""A layout matches one rank from the same checkpoint: upstream's own yardstick for a layout.

Two layouts with the same seed differ from their first iteration (TP2 and TP1 by 0.5 % even with
``--use-cpu-initialization`` on main: each initialises its shards its own way), so each side
starts from one checkpoint instead: one rank trains two iterations and saves its weights; a
one-rank reference and the layout both load them (``--finetune --no-load-optim --no-load-rng``;
upstream's distributed checkpoint reshards them to the layout) and train on the same data with
the same global batch. Their per-iteration loss and grad norm are then compared as loss parity
compares two trees (:func:`megaport.train.parity.parity_problems`): loss within 1 %, grad norm
within 5 %, over a window in which the model measurably learns (a family's runs in fp32 on both
sides, where rounding parts nothing: :data:`megaport.train.parity.FP32_DENSE_TOLERANCE`).

Eras before distributed checkpoints (before 2024-03) write one file per (tensor, pipeline) rank,
which another layout cannot load. Where they build Megatron Core's models (core 0.4-0.5), or a
gated MLP (SwiGLU, whose [gate; up] a split initialisation scrambles), one rank's checkpoint is
split for each TP/EP layout by megaport (:mod:`legacy_reshard`); older eras' other legacy models
draw one initialisation on both sides (``--use-cpu-initialization``: the full
weights drawn once on the CPU, then split). A layout with pipeline stages, which seed their own
weights, is compared with unported upstream in that layout rather than with one rank.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from megaport.train import example, parity, pretrain, tree_files
from megaport.train.checks import legacy_reshard
from megaport.train.checks.spec import Check, Context
from megaport.train.layouts import registry as layouts

#: iterations of the run that writes the shared checkpoint: two, so a family's warm-up (Mixtral's
#: ``--lr-warmup-iters`` of a tenth, at least one) stays shorter than its decay, as upstream asserts
INIT_STEPS = 2

_LOCK = threading.Lock()
#: what one session shares: (tree, device, family, sizes) -> the shared start; + (layout name,) ->
#: the ported run in that layout from it (one rank's reference included); a failure is kept too
_SHARED: dict = {}


@dataclasses.dataclass(frozen=True)
class Start:
    """Where every layout of a family and sizes starts: a checkpoint's weights, or the flags that
    draw one initialisation."""

    load: str | None = None
    extra: tuple = ()
    #: the family's flags every side leaves out: ((flag, why), ...)
    left_out: tuple = ()
    #: the tree whose one-rank legacy checkpoint megaport splits for each layout (:mod:`legacy_reshard`), or None
    split_for_layouts_of: str | None = None

    def of(self, run: pretrain.Run) -> pretrain.Run:
        """``run`` (either tree's, any layout) starting here."""
        return dataclasses.replace(run, load=self._load_for(run.layout), extra=run.extra + self.extra,
                                   left_out=run.left_out + self.left_out)

    def _load_for(self, layout_name: str) -> str | None:
        """The checkpoint ``layout_name``'s ranks load: one rank's, or its split for them, made once."""
        if not (self.load and self.split_for_layouts_of):
            return self.load
        layout = layouts.get(layout_name)
        if layout.size("--pipeline-model-parallel-size") > 1:
            return None  # not split into stages: compared with unported upstream, each from the same seeds
        split = legacy_reshard.Split(layout.tensor_parallel, layout.size("--expert-model-parallel-size"))
        if split == legacy_reshard.Split():
            return self.load
        target = f"{self.load}-tp{split.tensor}-ep{split.expert}"
        return once(("split", target),
                    lambda: legacy_reshard.reshard_beside(self.split_for_layouts_of, self.load, target, split))

    @property
    def described(self) -> str:
        return "checkpoint" if self.load else "initialisation"


def base_run(context: Context, family: str, layout, mode: str = "ported") -> pretrain.Run:
    from megaport.train.families import registry

    run = parity.parity_run(context.tree, mode, gpu=context.gpu, family=family)
    steps = registry.get(family).layout_steps
    sizes = layout.sizes(run.sizes)
    sizes = dataclasses.replace(sizes, steps=_depth_scaled_steps(steps, run.sizes.layers, sizes.layers),
                                vocab_multiple=layouts.VOCAB_MULTIPLE)
    return dataclasses.replace(run, sizes=sizes, lr=_depth_scaled(run.lr, run.sizes.layers, sizes.layers),
                               left_out=run.left_out + registry.get(family).layout_left_out(context.tree)
                               + layout.leaves_out)


def _depth_scaled(lr: float | None, family_layers: int, layers: int) -> float | None:
    """The parity learning rate for a model deepened for a layout's split (pp2-vpp's 4 layers),
    scaled by the family's depth over the model's: at 3e-3 main's 4-layer Llama spiked to 7x its
    first grad norm, and ported and unported drifted 7.3 % apart in grad norm, from rounding alone
    (the 2-layer model's layouts stay within 1.5 %)."""
    return lr * family_layers / layers if lr is not None and layers > family_layers else lr


def _depth_scaled_steps(steps: int, family_layers: int, layers: int) -> int:
    """The comparison window for a deepened model, longer by as much as its rate is lower
    (:func:`_depth_scaled`): core 0.9's 4-layer Llama at half the rate fell 8.3 % in 30 iterations of
    that era's indexed data, short of the 10 % a comparison needs to mean anything."""
    return steps * layers // family_layers if layers > family_layers else steps


def once(key, make):
    """``make()``, made once a session under ``key`` (a failure is kept too: what shares it fails of
    the first cause, not of a rerun's)."""
    with _LOCK:
        if key not in _SHARED:
            try:
                _SHARED[key] = make()
            except RuntimeError as exc:  # what shares it fails of the first cause, not of a rerun's
                _SHARED[key] = exc
        if isinstance(_SHARED[key], RuntimeError):
            raise _SHARED[key]
        return _SHARED[key]


def key(context: Context, run: pretrain.Run) -> tuple:
    """What a run shares under: its tree, device, family and sizes."""
    return (context.tree, run.device, run.family, dataclasses.astuple(run.sizes))


#: what core 0.5 … 0.7's GroupedMLP says for a distributed checkpoint, which it cannot write
_GROUPED_MLP_UNSAVED = "distributed checkpointing is not supported for GroupedMLP"


def _unsaved(tree: str) -> str | None:
    """Why one rank cannot write a checkpoint every layout loads on ``tree``; None where it can."""
    return None if reshards(tree) else "this era's checkpoints do not reshard"


def _unsaved_experts(tree: str, family: str) -> tuple:
    """What every side leaves out so that one rank of ``family`` writes a distributed checkpoint:
    core 0.5 … 0.7's grouped-GEMM experts (GroupedMLP) write none, so the comparison builds the
    sequential experts (the same experts, one GEMM each): ((flag, why),) or ()."""
    from megaport.train.families import registry

    if "--moe-grouped-gemm" in registry.get(family).flags(tree)[0] and tree_files.tree_says(
            tree, "megatron/core/transformer/moe/experts.py", _GROUPED_MLP_UNSAVED):
        return (("--moe-grouped-gemm", "this era's grouped-GEMM experts (GroupedMLP) write no distributed "
                                       "checkpoint: every side of the layout comparison builds the sequential "
                                       "experts"),)
    return ()


#: main 2024-03-19 … 03-27 drew every weight on the CPU by default (``--use-cpu-initialization``
#: default True; the GPU draw behind ``--use-gpu-initialization``), every other era on the device.
#: The shared start is drawn as every other era draws it: from the CPU draw, core 2024-03's
#: GPT trained another, spikier trajectory (grad norm 2.4 at iteration 4) in which fp16 rounding
#: grew to 7.4 % between TP2xPP2 and one rank, and main 2024-04's code from that same CPU-drawn
#: start gave the identical 7.4 % (3.5e-3 from its own start): the start, not the layout.
_DEVICE_DRAW = ("--use-gpu-initialization", "the shared start is drawn on the device, as every other era draws it "
                                            "(this era's default drew it on the CPU)")


def _drawn_as_every_era(tree: str) -> tuple:
    """The flags that make the writer of the shared start draw its weights the way every era's
    default does: ((flags, why),) or ()."""
    flag, why = _DEVICE_DRAW
    return (((flag,), why),) if example.parser_has(tree, flag) else ()


#: core 0.5-0.6 build the legacy model unless told ``--use-mcore-models``, which every layout run
#: is told (its parallel features are Megatron Core's): the one-rank side built the legacy model,
#: another model (core_v0.5.0 Llama dp2-distopt from one CPU draw: 2.6 % in loss, 61 % in grad norm)
_MCORE_EVERY_SIDE = ("--use-mcore-models", "every side builds Megatron Core's model, as the layouts do: the legacy "
                                           "model is another model")


def _one_kind_of_model(tree: str) -> tuple:
    """The flags that make one rank build the model every layout builds: ((flags, why),) or ()."""
    flag, why = _MCORE_EVERY_SIDE
    return (((flag,), why),) if pretrain.legacy_models_by_default(tree) else ()


def _gated(tree: str, family: str) -> bool:
    """Whether ``family``'s MLP is a gated unit (SwiGLU): one initialisation drawn whole and split by
    rows is then another model in a TP layout (its fc1 holds [gate; up], a row split gives TP rank 0
    the gates alone), so one rank's checkpoint is split by megaport instead (:mod:`legacy_reshard`)."""
    from megaport.train.families import registry

    return "--swiglu" in registry.get(family).flags(tree)[0]


def _split_knows_no_grouped_experts(tree: str, family: str) -> tuple:
    """Where megaport splits one rank's legacy checkpoint, every side builds the sequential experts
    (:mod:`legacy_reshard` splits their keys, not the grouped GEMM's packed weights): ((flag, why),) or ()."""
    from megaport.train.families import registry

    if "--moe-grouped-gemm" not in registry.get(family).flags(tree)[0]:
        return ()
    return (("--moe-grouped-gemm", "one rank's checkpoint is split for each layout by megaport, which splits the "
                                   "sequential experts: every side builds them (the same experts, one GEMM each)"),)


def shared_count() -> int:
    """How many shared runs this session made (names their folders apart)."""
    return len(_SHARED)


def shared_start(context: Context, run: pretrain.Run) -> Start:
    """Where every layout of ``run``'s family and sizes starts, made once a session: one rank's
    checkpoint (written here) where the era can write one every layout loads, else
    ``--use-cpu-initialization``'s weights."""
    def make() -> Start:
        unsaved = _unsaved(context.tree)
        folder = os.path.join(context.workdir, f"checkpoint-{run.family}-{shared_count()}")
        if unsaved and (_one_kind_of_model(context.tree) or _gated(context.tree, run.family)):
            start = Start(load=folder, extra=_one_kind_of_model(context.tree), split_for_layouts_of=context.tree,
                          left_out=_split_knows_no_grouped_experts(context.tree, run.family))
        elif unsaved:
            why = (f"every layout draws one initialisation: {unsaved}, and on the CPU the full weights are drawn "
                   "once, then split")
            return Start(extra=((("--use-cpu-initialization",), why),))
        else:
            start = Start(load=folder, left_out=_unsaved_experts(context.tree, run.family))
        writer = start.of(run)
        pretrain.run_pretrain(dataclasses.replace(writer, load=None, save=folder,
                                                  extra=writer.extra + _drawn_as_every_era(context.tree),
                                                  sizes=dataclasses.replace(run.sizes, steps=INIT_STEPS)),
                              context.env)
        return start
    return once(key(context, run), make)


def layout_run(context: Context, family: str, layout, sized_for=None) -> tuple:
    """The ported tree's run of ``family`` in ``layout`` from the shared start, in the sizes
    ``sized_for`` (a layout: one rank's reference takes the sizes of the layout it is compared
    with) or its own: (the run, its document), made once a session (a layout's checks share it)."""
    base = base_run(context, family, sized_for or layout)
    start = shared_start(context, base)
    run = start.of(dataclasses.replace(base, layout=layout.name))  # the layout's own split of the start
    return run, once(key(context, base) + (layout.name,), lambda: pretrain.run_pretrain(run, context.env))


def reshards(tree: str) -> bool:
    """Whether the era writes a checkpoint another layout loads (upstream's distributed format:
    ``--use-dist-ckpt`` from core 0.5, ``--ckpt-format`` later)."""
    return example.parser_has(tree, "--ckpt-format") or example.parser_has(tree, "--use-dist-ckpt")


#: eras whose one initialisation is not one model in a layout: (the era's file, text it holds while
#: so, the layout flag that splits it, why). Megatron-DeepSpeed's attention reads each rank's QKV
#: output as [all queries; all keys; all values], while ``--use-cpu-initialization`` splits one
#: rank's weight by rows (stride 1): at TP2 rank 0 takes all the queries and reads half of them as
#: keys, another model from the first step (2024-12: TP2 and one rank 5e-5 apart in fp32 at
#: iteration 1, 2.3 % by iteration 30; the same TP2 run and unported upstream's 5e-4)
UNSHARED_STARTS = (
    ("megatron/model/transformer.py", "each_hidden_size = mixed_x_layer.shape[-1] // 3", "--tensor-model-parallel-size",
     "this era's attention reads each TP rank's QKV rows as [queries; keys; values] blocks, which one "
     "initialisation split by rows does not give (another model from iteration 1)"),
)


def not_for(layout, tree: str) -> str | None:
    """Why a layout cannot be compared with one rank from one checkpoint on ``tree``: none is one
    rank itself; before distributed checkpoints each (tensor, pipeline) rank reads its own file, so
    only one initialisation can be shared (``--use-cpu-initialization``: the full weights drawn
    once, then split), and pipeline stages draw their layers' weights from their own seeds; nor
    where the era's split of one initialisation is another model (:data:`UNSHARED_STARTS`)."""
    if layout is layouts.ONE_RANK:
        return "one rank is the yardstick itself"
    if reshards(tree):
        return None
    if "--pipeline-model-parallel-size" in layout.flags:
        return ("this era's checkpoints do not reshard and its pipeline stages seed their own weights: "
                "compared with unported upstream in the same layout")
    for path, text, flag, why in UNSHARED_STARTS:
        size = example.flag_value(list(layout.flags), flag)
        if size and int(size) > 1 and tree_files.tree_says(tree, path, text):
            return f"{why}: compared with unported upstream in the same layout"
    return None


#: gradients upstream itself scales in a layout, in some eras, where one rank does not: (the era's
#: file, text it holds while it does, the layout flag whose size multiplies the grad norm, why).
#: Upstream's loss with context parallelism is multiplied by the CP size, and its DDP divided by the
#: data-parallel size without CP until 3bdcbbbe5d (2024-09-05, "Fix DDP scaling factor with Context
#: Parallel"): every CP run of those eras, TE's included, has CP times one rank's gradients
ERA_GRAD_SCALES = (
    ("megatron/core/distributed/distributed_data_parallel.py",
     "data_parallel_world_size = parallel_state.get_data_parallel_world_size()\n", "--context-parallel-size",
     "upstream's DDP divides by the data-parallel size without CP while its loss is multiplied by the CP size "
     "(fixed in 3bdcbbbe5d, 2024-09-05): the layout's grad norms are compared divided by"),
)


def era_grad_scale(tree: str, layout) -> tuple:
    """How much the era's own code multiplies the layout's grad norm over one rank's, and why: (factor, why or None)."""
    factor, reasons = 1, []
    for path, text, flag, why in ERA_GRAD_SCALES:
        size = example.flag_value(list(layout.flags), flag)
        if size and int(size) > 1 and tree_files.tree_says(tree, path, text):
            factor *= int(size)
            reasons.append(f"{why} {size}")
    return factor, "; ".join(reasons) or None


def compare(context: Context, family: str, layout) -> dict:
    """The layout's run against the one-rank run, both from the shared start."""
    run, mine = layout_run(context, family, layout)
    _, one = layout_run(context, family, layouts.ONE_RANK, sized_for=layout)
    factor, why = era_grad_scale(context.tree, layout)
    scaled = {**mine, "grad_norms": [None if g is None else g / factor
                                                for g in mine.get("grad_norms") or []]} if why else mine
    compared = parity.loss_parity(scaled, one)
    compared.update(against=f"one rank from the same {shared_start(context, run).described}", run=_kept(mine))
    if why:
        compared["grad_norm_scale"] = {"factor": factor, "why": why}
    within = tolerance(context.tree, family, compared)
    compared["problems"] = parity.parity_problems(compared, min(len(mine["losses"]), len(one["losses"])),
                                                  yardstick="one rank", tolerance=within)
    return compared


def tolerance(tree: str, family: str, compared: dict) -> parity.Tolerance:
    """How far ``family``'s runs in a layout may part on ``tree`` (its spec's, else parity's default);
    one other than the default is kept in ``compared`` for the report."""
    from megaport.train.families import registry

    within = registry.get(family).layout_tolerance(tree) or parity.DEFAULT_TOLERANCE
    if within.why:
        compared["tolerance"] = dataclasses.asdict(within)
    return within


def _kept(document: dict) -> dict:
    """What the report keeps of a run: its command, notes, speed and what the port said."""
    return {k: document[k] for k in ("command", "notes", "ms_per_iter", "port_log", "substitutions", "started", "losses",
                                     "grad_norms") if k in document}


CHECK = Check(name="one-rank", summary="matches one rank from the same checkpoint (loss 1 %, grad norm 5 %; "
                                         "fp32 runs of a dense model 1e-4 / 5e-3)",
              compare=compare, not_for=lambda layout, tree: not_for(layout, tree))
