"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys'21), the reduction behind
Horovod's ``op=hvd.Adasum``: pure tensor arithmetic, used by the engine on the tensors gathered from every rank.

The rule, in one place: two gradients combine as ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b`` (orthogonal
ones add up, equal ones give themselves, so the result neither double-counts agreeing directions nor loses
independent ones); N ranks combine pairwise in a binary tree, ranks (0, 1), (2, 3)... then their results, the
order of Horovod's vector-halving distance-doubling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["adasum_pair", "adasum_tree"]


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors, the dot product and norms in float64; a side whose squared norm is below 1e-8 keeps
    coefficient 1 (as Horovod guards it). Orthogonal tensors add up; equal ones give themselves."""
    a64, b64 = a.double().flatten(), b.double().flatten()
    dot, aa, bb = float(a64 @ b64), float(a64 @ a64), float(b64 @ b64)
    ca = 1.0 - dot / (2 * aa) if aa >= 1e-8 else 1.0
    cb = 1.0 - dot / (2 * bb) if bb >= 1e-8 else 1.0
    return (ca * a64 + cb * b64).reshape(a.shape).to(a.dtype)


def adasum_tree(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ranks' tensors combined pairwise in a binary tree (see the module docstring); an unpaired tensor moves
    up a level unchanged.

    Example:
        >>> import torch
        >>> adasum_tree([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])]).tolist()
        [1.0, 2.0]
    """
    level = list(parts)
    while len(level) > 1:
        level = [
            adasum_pair(level[i], level[i + 1]) if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)
        ]
    return level[0]
