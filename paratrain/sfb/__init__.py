"""Sufficient-factor broadcasting (Xie et al. 2015; Poseidon, Zhang et al. 2017): its traffic and the per-layer choice.

For a fully-connected layer ``y = x Wᵀ + b`` with ``W`` of shape MxN (outxin) and a batch of K rows, the weight's
gradient is ``Uᵀ V`` with ``U = ∂L/∂y`` (KxM) and ``V = x`` (KxN), and the bias's is the column sum of ``U``. A
worker can send those K(M+N) numbers instead of the M·N of the gradient; every peer rebuilds the same sum. Which
is cheaper depends on K, M, N, the number of workers and servers: :mod:`.cost` says, per layer, with the exact
byte counts of paratrain's own messages. Torch-free: the capture of the factors lives in the torch front end
(:mod:`paratrain.torch.sfb`), which executes the plan made here.
"""

from paratrain.sfb.cost import (
    SCHEMES,
    HybridPlan,
    LayerChoice,
    LayerShape,
    Traffic,
    choose_schemes,
    scheme_traffic,
)

__all__ = ["SCHEMES", "HybridPlan", "LayerChoice", "LayerShape", "Traffic", "choose_schemes", "scheme_traffic"]
