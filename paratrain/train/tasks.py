"""The loss and the accuracy of every training loop, for image classes and next-token text alike.

A model's output holds scores on its last axis: ``[N, classes]`` against labels ``[N]`` for images,
``[N, T, vocab]`` against next tokens ``[N, T]`` for text. Both are one cross entropy over all targets, so the
data-parallel worker, the pipeline worker and the tests all call these functions and cannot disagree on what
"loss" means (mean per target: per example for images, per token for text).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["evaluate", "loss", "score"]


def loss(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of scores ``output`` (classes on the last axis) against integer ``target``.

    ``[N, T, V]`` scores are flattened to ``[N*T, V]`` against ``[N*T]`` targets: ``"mean"`` is per token.

    Example:
        >>> import torch
        >>> float(loss(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)))  # uniform over 4: ln 4
        1.3862943649291992
    """
    from torch.nn import functional

    if output.dim() > 2:
        output = output.reshape(-1, output.shape[-1])
        target = target.reshape(-1)
    return functional.cross_entropy(output, target, reduction=reduction)


def score(output: torch.Tensor, target: torch.Tensor) -> tuple[int, float, int]:
    """Correct predictions (arg-max), summed loss and number of targets of one batch (one per image or token)."""
    correct = int((output.argmax(-1) == target).sum())
    return correct, float(loss(output, target, reduction="sum")), int(target.numel())


def evaluate(model: Any, x: np.ndarray, y: np.ndarray, batch: int = 1024) -> tuple[float, float]:
    """Accuracy and mean loss per target of ``model`` (a module or any callable) on ``(x, y)``, without gradients.

    A module is put in eval mode for the pass and back in train mode afterwards. For text, accuracy is the share
    of next tokens predicted exactly, and the loss is per token (its exp is the per-character perplexity).
    """
    import torch

    is_module = isinstance(model, torch.nn.Module)
    device = torch.device("cpu")
    if is_module:
        model.eval()
        device = next((p.device for p in model.parameters()), device)  # the examples go where the model is
    correct, loss_sum, count = 0, 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, len(y), batch):
                xb = torch.from_numpy(x[start : start + batch]).to(device)
                c, s, n = score(model(xb), torch.from_numpy(y[start : start + batch]).to(device))
                correct, loss_sum, count = correct + c, loss_sum + s, count + n
    finally:
        if is_module:
            model.train()
    return correct / count, loss_sum / count
