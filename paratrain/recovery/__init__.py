"""Training that survives failures: reliable collectives with in-memory checkpoints (Rabit's model).

:class:`Reliable` (in :mod:`.reliable`) is the interface a training loop uses; :func:`plan_recovery` (in
:mod:`.plan`) is the pure function that decides who sends what when the job re-forms after a failure.
``paratrain launch --max-restarts R`` restarts the failed rank; ``paratrain train --max-restarts R`` does both.
With ``--min-workers M`` the job is elastic: it shrinks rather than waits, and a replacement joins later.
"""

from paratrain.recovery.plan import Ckpt, RankState, RecoveryError, RecoveryPlan, Transfer, plan_recovery
from paratrain.recovery.reliable import Checkpoint, Recovery, RegroupedError, Reliable

__all__ = [
    "Checkpoint",
    "Ckpt",
    "RankState",
    "Recovery",
    "RecoveryError",
    "RecoveryPlan",
    "RegroupedError",
    "Reliable",
    "Transfer",
    "plan_recovery",
]
