"""``fork-train-step``: Megatron-DeepSpeed's train_step steps the merged optimizers.

From its merge of upstream main (9e72d571, 2023-07-04) until 636540a9 (2023-07-12) the fork's
train_step calls ``optimizer.step()`` with none of the ``(args, timers)`` the merged optimizers
take, and leaves the parameter gather after it commented out: every run without ``--deepspeed``
(BERT's and T5's examples) dies on its first step. Called that way, ``step`` takes Megatron's own
args and timers and gathers the parameters after a step that applied, as 636540a9's train_step
does. (636540a9 also moved the gradient reduction into the optimizer's ``reduce_model_grads``;
the fork's own reduction left in place differs from it only for sequence parallelism across
tensor-parallel ranks, which a one-rank baseline never has.)
"""

from __future__ import annotations

import functools

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "fork-train-step"
DESCRIPTION = ("Megatron-DeepSpeed 2023-07-04..2023-07-12 (9e72d571 to before 636540a9): train_step calls the merged "
               "optimizers' step() without (args, timers); called so, step takes Megatron's own and gathers the "
               "parameters after an applied step, as 636540a9's train_step does")
ERAS = "Megatron-DeepSpeed 9e72d571 … 636540a9^ (2023-07-04 … 2023-07-12), runs without --deepspeed"
REPRODUCES = "Megatron-DeepSpeed 636540a9 (train_step's step(args, timers) and gather_model_params)"
PATTERN = (Match(("TypeError",), message=r"step\(\) missing 2 required positional arguments: 'args' and 'timers'"),)
OPTIMIZERS = ("MixedPrecisionOptimizer", "FP32Optimizer")


def stepping_with_megatrons_args(step):
    @functools.wraps(step)
    def step_as_636540a9(self, args=None, timers=None):
        if args is not None:
            return step(self, args, timers)
        from megatron import get_args, get_timers

        args, timers = get_args(), get_timers()
        outcome = step(self, args, timers)
        if outcome[0]:
            self.gather_model_params(args, timers)
        return outcome

    return step_as_636540a9


def optimizers_step_without_arguments(module) -> None:
    for name in OPTIMIZERS:
        cls = getattr(module, name, None)
        if cls is not None and "step" in vars(cls):
            cls.step = stepping_with_megatrons_args(cls.step)


def install() -> None:
    after_import("megatron.optimizer.optimizer", optimizers_step_without_arguments)
