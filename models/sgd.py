"""SGD with momentum: the update ``torch.optim.SGD`` makes, without importing ``torch.optim``'s compiler hooks.

``torch.optim``'s optimizers import ``torch._dynamo`` at their first call (``Optimizer.__init__`` and ``step`` are
marked not to be compiled, and marking needs the compiler loaded): 0.85 CPU-s and 149 MB of peak memory in a
training child that needs 2.5 CPU-s in all for a 5-round digits run (2-core Xeon), paid by every agent at its first
round, for models that are never compiled. ``MomentumSGD`` makes PyTorch's documented update for dampening 0, no
Nesterov and no weight decay (https://pytorch.org/docs/stable/generated/torch.optim.SGD.html): ``b ← μ·b + g`` (the
first ``b`` is ``g``), ``w ← w − lr·b``, in the tensor operations of ``torch.optim.SGD``'s single-tensor path, its
default on the CPU, where a trained model is bit-identical to it (``tests/test_sgd.py``). On CUDA ``torch.optim.SGD``
defaults to multi-tensor kernels: the same operations per element (not tested here: no GPU in CI), in fewer kernel
launches than this loop's three per parameter, which a small classifier's step on a GPU may notice. Its momentum
buffers are kept where ``torch.optim.SGD`` keeps them (``state[param]["momentum_buffer"]``), so ``models.training``'s
restore and collect read either. DP-SGD keeps ``torch.optim.SGD``: Opacus wraps a ``torch.optim.Optimizer``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch


class MomentumSGD:
    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, momentum: float) -> None:
        self.params = list(params)
        self.lr = lr
        self.momentum = momentum
        self.state: defaultdict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)  # as torch.optim's

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none or param.grad is None:
                param.grad = None
            else:
                param.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient (one without is left as it is, with no buffer)."""
        for param in self.params:
            if param.grad is None:
                continue
            update = param.grad
            if self.momentum != 0:
                state = self.state[param]
                buffer = state.get("momentum_buffer")
                if buffer is None:
                    buffer = state["momentum_buffer"] = update.detach().clone()
                else:
                    buffer.mul_(self.momentum).add_(update)
                update = buffer
            param.add_(update, alpha=-self.lr)
