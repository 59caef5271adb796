"""An elastic job: it goes on when a worker dies, and takes the worker's replacement back when it is ready.

Run it with a failure on purpose::

    paratrain launch -n 3 --min-workers 2 --max-restarts 1 --no-spare --kill 1@checkpoint=2 \\
        -- python -m paratrain.examples.elastic --until-joined

Member 1 dies during its second checkpoint. With no warm spare ready the launcher drops it; members 0 and 2
re-form as ranks 0 and 1 of 2 and go on, each now covering more of every step's work. The replacement, started
cold, registers when it is ready and is admitted at the next checkpoint, where it receives that checkpoint;
then the job is 3 again. Every step sums one vector per *launched* worker (shard), whoever holds the shard, so
the result does not depend on the job's size, and every rank checks its final state against the exact sum.
Only numpy is needed; ``paratrain train --min-workers`` does the same with a model's gradients.
"""

from __future__ import annotations

import argparse

import numpy as np
import numpy.typing as npt

import paratrain as pt
from paratrain.recovery import RegroupedError, Reliable


def shard_value(step: int, shard: int) -> npt.NDArray[np.float64]:
    """Shard ``shard``'s contribution to step ``step``: small integers, so every sum is exact in float64."""
    return np.array([step + 1, shard + 1, (7 * step + 3 * shard) % 11, 1], dtype=np.float64)


def main() -> None:
    """Runs the steps, checkpointing every ``--every``; prints this rank's view and whether its state is exact."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps to run at least (default 40)")
    parser.add_argument("--every", type=int, default=5, help="steps between in-memory checkpoints (default 5)")
    parser.add_argument(
        "--until-joined",
        action="store_true",
        help="after --steps, go on until every launched worker is back (at most 50000 x --steps: a bound in steps, "
        "which every rank counts alike, long enough for a cold start on a loaded machine)",
    )
    args = parser.parse_args()
    ctx = pt.init()
    rel = Reliable(ctx)  # first, before any other collective: a replacement catches up here
    shards = ctx.settings.job_workers
    ckpt = rel.load_checkpoint()
    state = np.array(ckpt.arrays["state"]) if ckpt is not None else np.zeros(4)
    step = int(ckpt.meta["step"]) if ckpt is not None else 0
    sizes = {rel.ctx.world_size}
    # every rank decides alike: the members and the step are the same everywhere
    while step < args.steps or (args.until_joined and len(rel.members) < shards and step < 50_000 * args.steps):
        while True:  # more than once only when the job changes size during the step
            rank, world = rel.ctx.rank, rel.ctx.world_size
            mine = sum((shard_value(step, v) for v in range(rank, shards, world)), np.zeros(4))
            try:
                total = rel.allreduce(mine)
                break
            except RegroupedError:
                continue
        sizes.add(rel.ctx.world_size)
        state += total
        step += 1
        if step % args.every == 0:
            rel.checkpoint({"state": state}, {"step": step})
            sizes.add(rel.ctx.world_size)
    expected = sum((shard_value(t, v) for t in range(step) for v in range(shards)), np.zeros(4))
    verdict = "exact" if np.array_equal(state, expected) else f"WRONG (expected {expected.tolist()})"
    print(
        f"member {ctx.settings.member_id}: rank {rel.ctx.rank} of {rel.ctx.world_size}, {step} steps, "
        f"sizes {sorted(sizes)}, members {rel.members}, state {state.tolist()} {verdict}",
        flush=True,
    )
    pt.shutdown()


if __name__ == "__main__":
    main()
