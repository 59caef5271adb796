"""FlexFlow's SOAP dimensions for single operators: a layer split over workers, and the moves between layers.

Pure plans (no torch): :mod:`.layout` says how an activation lies over a tensor-parallel group and which collective
turns one layout into another, forward and backward; :mod:`.mesh` places workers on a tensor x data grid and
checks a configuration against a model's layers; :mod:`.config` is a configuration as a job carries it
(``tp:N``, ``soap:FILE``). The torch front end (:mod:`paratrain.torch.soap`) executes them.
"""

from paratrain.soap.config import SoapConfig, megatron_splits
from paratrain.soap.layout import SPLITS, ChainPlan, Layout, Move, OpSpec, move, plan_chain
from paratrain.soap.mesh import (
    BLOCK_SPLIT,
    KIND_SPLITS,
    SEQUENCE_SPLIT,
    VOCAB_SPLIT,
    LayerShape,
    Mesh,
    SoapConfigError,
    check_splits,
)

__all__ = [
    "BLOCK_SPLIT",
    "KIND_SPLITS",
    "SEQUENCE_SPLIT",
    "SPLITS",
    "VOCAB_SPLIT",
    "ChainPlan",
    "LayerShape",
    "Layout",
    "Mesh",
    "Move",
    "OpSpec",
    "SoapConfig",
    "SoapConfigError",
    "check_splits",
    "megatron_splits",
    "move",
    "plan_chain",
]
