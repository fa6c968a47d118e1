"""``wgrad-contiguous``: the linear layers' backward gets a contiguous gradient before its 2-D view.

From 2022-02 upstream views the gradient in 2-D in ``LinearWithGradAccumulationAndAsyncAllreduce``'s
backward, which fails where autograd hands it a non-contiguous one (2022-02 and 2022-05 trees on
today's torch). Upstream made it contiguous itself in 2023-03 (09c2f6e4); the same values.
"""

from __future__ import annotations

from megaport.train.hooks import after_import
from megaport.train.shims._pattern import Match

NAME = "wgrad-contiguous"
DESCRIPTION = ("the linear layers' backward gets a contiguous gradient before its 2-D view (upstream's own 2023-03 "
               "fix 09c2f6e4; the same values)")
ERAS = "E2 (main 2022-02 … 2022-06)"
REPRODUCES = "upstream's 09c2f6e4 (2023-03)"
PATTERN = (Match(("RuntimeError",), message=r"view size is not compatible", code=r"grad_output = grad_output\.view\("),)


def contiguous_gradient(module) -> None:
    function = module.LinearWithGradAccumulationAndAsyncAllreduce
    backward = function.backward

    def contiguous_backward(ctx, grad_output, *args):
        return backward(ctx, grad_output.contiguous(), *args)

    function.backward = staticmethod(contiguous_backward)


def install() -> None:
    after_import("megatron.mpu.layers", contiguous_gradient)
