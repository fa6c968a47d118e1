"""The tensor-parallel ranks keep the same copy of every weight they share.

Under sequence parallelism each TP rank runs the norms (and a MoE router) on its own part of the
sequence, so those weights' gradients are partial sums until the TP ranks all-reduce them, which
Megatron does for the parameters marked ``sequence_parallel``. A norm left unmarked trains each
rank's copy on its own half of the tokens; over 30 iterations the loss hardly shows it (measured on
main, Llama: 8.8e-4 in loss and 3.1e-2 in grad norm from one rank, inside the one-rank
tolerances), but the copies part at the first step. So the layout trains a few iterations from its
own initialisation (every TP rank draws the shared weights from one seed) and saves one file per
rank, upstream's legacy ``torch`` format, which keeps every rank's copy (the distributed format
writes one, and upstream main cannot load the shared start in one format and save in the other),
and the copies are compared here, tensor by tensor. Where the Megatron-DeepSpeed fork trains
through DeepSpeed's engine, the engine writes the checkpoint, one file per model-parallel rank too
(``global_step<N>/mp_rank_<tp>_model_states.pt``).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pickle
import re
import types

from megaport.train import pretrain
from megaport.train.checks import legacy_reshard, one_rank
from megaport.train.checks.spec import Check, Context

#: what every TP rank holds whole, by the name upstream gives it: the norms (layer norms, RMSNorms,
#: MLA's q/kv norms, QK norms) and the MoE router
SHARED_WEIGHTS = re.compile(r"(norm|router)[^.]*\.(weight|bias)$|layer_norm_(weight|bias)$")
#: the copies are the same numbers: the all-reduced gradient is the same on every rank, and so is
#: the optimizer's step; the slack is for an all-reduce that sums in another order on each rank
TOLERANCE = 1e-6
#: a legacy checkpoint's per-rank folder: mp_rank_<tp>[_<pp>][_<ep>]
_RANK_FOLDER = re.compile(r"mp_rank_(\d{2})(.*)$")
#: a checkpoint's iteration folder: upstream's iter_<7 digits>, or global_step<N> where the
#: Megatron-DeepSpeed fork trains through DeepSpeed's engine (which writes the checkpoint)
_ITERATION = re.compile(r"(?:iter_|global_step)(\d+)$")
#: DeepSpeed's engine's file of one model-parallel rank: mp_rank_<tp>_model_states.pt, the model
#: under "module"
_ENGINE_FILE = re.compile(r"mp_rank_(\d{2})(.*)_model_states\.pt$")


#: iterations of the layout's own run: the copies part at the first step that does not all-reduce
STEPS = 3


def compare(context: Context, family: str, layout) -> dict:
    """The largest difference between two TP ranks' copies of a shared weight, relative to its size."""
    base = one_rank.base_run(context, family, layout)
    run = dataclasses.replace(base, layout=layout.name, sizes=dataclasses.replace(base.sizes, steps=STEPS),
                              save=os.path.join(context.workdir, f"per-rank-{family}-{layout.name}"),
                              save_per_rank=True)
    pretrain.run_pretrain(run, context.env)
    copies = _copies(run.save)
    problems, largest = [], {}
    for name, tensors in sorted(copies.items()):
        if len(tensors) < 2:
            continue
        scale = max(float(t.abs().max()) for t in tensors) or 1.0
        largest[name] = max(float((t - tensors[0]).abs().max()) for t in tensors[1:]) / scale
    if not largest:
        problems.append(f"no weight shared by the TP ranks found in {run.save} (names matching "
                        f"{SHARED_WEIGHTS.pattern!r})")
    parted = {n: d for n, d in largest.items() if d > TOLERANCE}
    if parted:
        name = max(parted, key=parted.get)
        problems.append(f"the TP ranks' copies of {len(parted)} shared weight(s) differ, most {name} "
                        f"({parted[name]:.1e} of its largest value; at most {TOLERANCE:.0e}): their gradients "
                        "were not all-reduced across the TP ranks")
    return {"against": "the other TP ranks' copies of the weights they share", "problems": problems,
            "shared_weights": len(largest), "max_rel_diff": max(largest.values(), default=None)}


def _copies(folder: str) -> dict:
    """Every shared weight of the newest checkpoint in ``folder``: (its model's key, the rest of
    its rank folder's name) -> the TP ranks' tensors."""
    iterations = sorted((int(m.group(1)), path) for path in glob.glob(os.path.join(folder, "*"))
                        if (m := _ITERATION.match(os.path.basename(path))) and os.path.isdir(path))
    if not iterations:
        raise RuntimeError(f"the layout's run wrote no checkpoint in {folder}")
    newest = iterations[-1][1]
    files = [(path, _RANK_FOLDER.match(os.path.basename(os.path.dirname(path))).group(2))
             for path in sorted(glob.glob(os.path.join(newest, "mp_rank_*", "*.pt")))]
    files += [(path, _ENGINE_FILE.match(os.path.basename(path)).group(2))
              for path in sorted(glob.glob(os.path.join(newest, "mp_rank_*_model_states.pt")))]
    copies: dict = {}
    for path, rest in files:
        for model, state in _models(path).items():
            for key, tensor in legacy_reshard.flattened(state).items():
                if SHARED_WEIGHTS.search(key) and hasattr(tensor, "shape"):
                    copies.setdefault((model, key, rest), []).append(tensor.float())
    return {" ".join(filter(None, (model if model != "model" else "", key, rest))): tensors
            for (model, key, rest), tensors in copies.items()}


def _models(path: str) -> dict:
    """The model state dicts (``model``, or ``model0``, ``model1`` … for virtual stages) of one
    rank's legacy checkpoint file, read without the tree: whatever else it pickled (the run's
    arguments, Megatron's enums) is read as a placeholder. DeepSpeed's engine keeps the model under
    ``module``: it is read as ``model``."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_TOLERANT)
    return {("model" if k == "module" else k): v for k, v in state.items()
            if re.fullmatch(r"model\d*|module", k) and isinstance(v, dict)}


class _Placeholder:
    """What a pickled object of a module this process cannot import becomes."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return _Placeholder


_TOLERANT = types.SimpleNamespace(Unpickler=_TolerantUnpickler, load=pickle.load, __name__="pickle")


def not_for(layout, tree: str) -> str | None:
    """Why the copies need no comparison, or cannot be kept, on ``tree``."""
    if not layout.sequence_parallel:
        return ("no sequence parallelism: every TP rank computes the shared weights' gradients from the whole "
                "sequence")
    return None


def figures(compared: dict) -> str:
    largest = compared.get("max_rel_diff")
    return (f"{compared['shared_weights']} shared weights, largest difference "
            + ("none" if largest is None else f"{largest:.1e}"))


CHECK = Check(name="tp-replicas", summary="the TP ranks' copies of the weights they share stay equal",
              compare=compare, not_for=not_for, figures=figures)
