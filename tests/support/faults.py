"""Faults planted in a ported tree, for tests that prove loss parity fails when training is wrong.

Each fault is one line of the tree changed: in the port's own module (its amp_C stand-ins, which
upstream's grad-norm and clipping call in every era from 2021 to today) or in upstream's
optimizer wrapper (the step the optimizer takes, whichever optimizer runs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Fault:
    files: tuple  # the first that exists in the tree is changed
    old: str
    new: str
    what: str


PORT_FILES = ("megatron/core/rocm_port/apex_substitutes.py", "megatron/rocm_port/apex_substitutes.py")
OPTIMIZER_FILES = ("megatron/core/optimizer/optimizer.py", "megatron/optimizer/optimizer.py")
NORM_FILES = ("megatron/core/rocm_port/te_features.py", "megatron/rocm_port/te_features.py")
CP_FILES = ("megatron/core/rocm_port/context_parallel.py",)
KEYS_FILES = ("megatron/core/rocm_port/checkpoint_keys.py",)
CHECKPOINTING_FILES = ("megatron/training/checkpointing.py",)
TRAINING_FILES = ("megatron/training/training.py",)
FAULTS = {
    "grad-norm": Fault(PORT_FILES, "    total = torch.linalg.vector_norm(norms).reshape(1)\n",
                       "    total = torch.linalg.vector_norm(norms).reshape(1) * 100\n",
                       "the port's amp_C.multi_tensor_l2norm gives 100x the gradient norm"),
    "clipping": Fault(PORT_FILES, "    srcs, dsts = list(tensor_lists[0]), list(tensor_lists[1])\n",
                      "    srcs, dsts = list(tensor_lists[0]), list(tensor_lists[1])\n    scale = max(scale, 1.0)\n",
                      "the port's amp_C.multi_tensor_scale ignores a clipping coefficient below 1"),
    "optimizer-step": Fault(OPTIMIZER_FILES, "self.optimizer.step()", "self.optimizer.step(); self.optimizer.step()",
                            "the optimizer's step is taken twice"),
}
#: faults in a parallel layout's path, which only a run in that layout meets: {name: (layout, fault)}
LAYOUT_FAULTS = {
    "sp-norm-grad": ("tp2-sp", Fault(NORM_FILES, 'setattr(p, "sequence_parallel", sequence_parallel)',
                                     'setattr(p, "sequence_parallel", False)',
                                     "the port's norm under SP is not marked sequence_parallel: its gradient is "
                                     "never all-reduced across the TP ranks")),
    "cp-merge-without-lse": ("cp2", Fault(CP_FILES, "out[i] = out[i] * keep_old + o * take_new",
                                          "out[i] = out[i] + o",
                                          "the port's context-parallel attention adds its blocks without their "
                                          "log-sum-exp")),
}

#: faults in the port's checkpoint loading, which a load of another spelling's checkpoint meets
CHECKPOINT_FAULTS = {
    "te-keys-dropped": Fault(KEYS_FILES, "    for row in SPELLINGS:\n", "    for row in ():\n",
                             "the port's table of TE's and the local spec's key spellings is dropped"),
}

#: faults in upstream main's resume, which only a run that saves and resumes meets (the resume check)
RESUME_FAULTS = {
    "optimizer-state-dropped": Fault(
        CHECKPOINTING_FILES, "                optimizer.load_state_dict(state_dict['optimizer'])\n",
        "                optimizer.load_state_dict(state_dict['optimizer']); [o.optimizer.state.clear() for o in "
        "getattr(optimizer, 'chained_optimizers', [optimizer])]\n",
        "the resumed optimizer's Adam state (moments and step) is dropped after the checkpoint loads"),
    "data-iterator-restarted": Fault(
        TRAINING_FILES, "build_pretraining_data_loader(train_ds, consumed_train_samples_in_current_phase)",
        "build_pretraining_data_loader(train_ds, 0)",
        "the resumed run's training data starts again from the first sample"),
}


def plant(tree: Path, name: str) -> Path:
    """Plant fault ``name`` in ``tree``; the file changed."""
    fault = {**FAULTS, **CHECKPOINT_FAULTS, **RESUME_FAULTS}.get(name) or LAYOUT_FAULTS[name][1]
    path = next(tree / f for f in fault.files if (tree / f).is_file())
    text = path.read_text(encoding="utf-8")
    assert fault.old in text, f"{path} no longer has {fault.old!r}: update tests/support/faults.py"
    path.write_text(text.replace(fault.old, fault.new), encoding="utf-8")
    return path
