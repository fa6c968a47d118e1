"""``overlap-gather-save``: a checkpoint written with ``--overlap-param-gather`` holds the weights
of the step it was written after.

From 3b417268a2 (2023-11-17) until ac08742c96 (2024-05-04, "Add a deterministic mode") the
distributed optimizer gathers the weights the other data-parallel ranks updated in the next
forward's pre-hook, and ``save_checkpoint_and_time`` wrote the checkpoint before that: the model's
weights one step old but each rank's own shard. Nothing fails: the run that resumes it leaves the
uninterrupted one at its first iteration (core 0.5 Llama, DP2, the ported tree resuming unported
upstream's checkpoint: 20 % in grad norm there). Listed up front by the checks that resume
unported upstream's checkpoint with that flag. Here, as ac08742c96 does, the gather is finished
before the save (``disable_pre_hook``) and the hook put back after. The port fixes the same window
in its own way, around ``save_checkpoint`` (``rocm_port.upstream_fixes``).
"""

from __future__ import annotations

import functools

from megaport.train.hooks import after_import
from megaport.train.tree_files import tree_text

NAME = "overlap-gather-save"
DESCRIPTION = ("main 2023-11-17 (3b417268a2) … 2024-05-04 (ac08742c96): with --overlap-param-gather the checkpoint "
               "held the other ranks' weights one step old; the gather finishes before the save, as ac08742c96 does")
ERAS = "main 2023-11-17 (3b417268a2) … 2024-05-04 (ac08742c96), --use-distributed-optimizer --overlap-param-gather"
REPRODUCES = "upstream's ac08742c96 (disable_pre_hook around save_checkpoint in save_checkpoint_and_time)"
#: listed up front where a check resumes unported upstream's checkpoint, not asked for by a failure
PATTERN = ()
#: the training loop's module, newest first (megatron/training.py until 2024-03-26)
_MODULES = (("megatron/training/training.py", "megatron.training.training"), ("megatron/training.py", "megatron.training"))
#: the distributed optimizer's own switch for its forward pre-hook (the window's start)
_HOOKED = ("megatron/core/optimizer/distrib_optimizer.py", "megatron/optimizer/distrib_optimizer.py")


def applies(tree: str) -> bool:
    """Whether the unported ``tree`` gathers in the forward pre-hook and saves without finishing it."""
    hooked = any("def disable_pre_hook" in (tree_text(tree, path) or "") for path in _HOOKED)
    for path, _ in _MODULES:
        text = tree_text(tree, path) or ""
        if "def save_checkpoint_and_time" in text:  # the training loop disables the hook elsewhere too (evaluation)
            body = text.split("def save_checkpoint_and_time", 1)[1].split("\ndef ", 1)[0]
            return hooked and "disable_pre_hook" not in body
    return False


def _gathered_first(module) -> None:
    save = getattr(module, "save_checkpoint_and_time", None)
    get_args = getattr(module, "get_args", None)
    if save is None or get_args is None:
        return

    @functools.wraps(save)
    def save_checkpoint_and_time(iteration, model, optimizer, *rest, **kwargs):
        args = get_args()
        pending = args.use_distributed_optimizer and args.overlap_param_gather
        if pending:
            optimizer.disable_pre_hook()
        try:
            return save(iteration, model, optimizer, *rest, **kwargs)
        finally:
            if pending:
                optimizer.enable_pre_hook()

    module.save_checkpoint_and_time = save_checkpoint_and_time


def install() -> None:
    for _, name in _MODULES:
        after_import(name, _gathered_first)
