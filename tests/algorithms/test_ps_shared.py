"""A parameter server on the workers' host: pulls read large values in place, requests travel in batches, and the
results are exactly those of the in-process transport (which has neither); a value that changes during a copy
is read again; malformed batches are refused; ``pull(out=...)`` fills the caller's array."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from paratrain import Context
from paratrain.ps import KVStore
from paratrain.ps.protocol import MAX_BATCH, REQUEST_TAG, pack, reply_tag, unpack
from paratrain.ps.server import ParameterServer, ServerStats
from paratrain.ps.shared import SharedValue, ValueReader, value_prefix
from paratrain.testing import rank_context, run_ranks
from paratrain.transport.lane import lanes_supported, segment_dir
from paratrain.transport.registry import zmq_transports
from paratrain.transport.wire import Message

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not lanes_supported(), reason="shared memory between ranks runs on x86-64 with /dev/shm"),
]

ROWS, COLS = 600, 100  # 240 KB of float32: three 80 KB chunks, shared; the second key stays below the threshold


def _same_host_job(workers: int, servers: int, fn: Callable[[Context], Any]) -> tuple[list[Any], list[ServerStats]]:
    """``fn`` on ``workers`` threads and parameter servers on ``servers`` more, over ZeroMQ on one host."""
    transports = zmq_transports(workers + servers)
    results: list[Any] = [None] * workers
    stats: list[ServerStats] = []
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        ctx = rank_context(transports[rank], workers=workers, servers=servers, timeout=30)
        try:
            if rank < workers:
                results[rank] = fn(ctx)
            else:
                stats.append(ParameterServer(transports[rank], num_workers=workers, timeout=30).serve())
        except BaseException as exc:
            errors.append(exc)
            for t in transports:
                t.abort(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(workers + servers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for t in transports:
        t.close()
    if errors:
        raise errors[0]
    return results, stats


def _train(ctx: Context) -> list[np.ndarray]:
    kv = KVStore("bsp", context=ctx, chunk_bytes=80_000)
    kv.init("w", np.zeros((ROWS, COLS), dtype=np.float32))
    kv.init("b", np.zeros(100, dtype=np.float32))
    rng = np.random.default_rng(ctx.rank)
    out = np.empty((ROWS, COLS), dtype=np.float32)
    seen = []
    for _ in range(3):
        kv.push("w", rng.integers(-8, 8, (ROWS, COLS)).astype(np.float32))
        kv.push("b", np.full(100, ctx.rank + 1, dtype=np.float32))
        kv.clock()
        assert kv.pull("w", out=out) is out
        seen += [out.copy(), kv.pull("b")]
        ctx.barrier()  # no worker pushes the next clock while another reads: the values compared are exact
    seen.append(kv.pull("w"))  # a second pull in the clock, into a new array
    kv.close()
    return seen


def test_same_host_pulls_read_in_place_and_equal_the_inprocess_transport() -> None:
    before = {n for n in os.listdir(segment_dir()) if "-psv-" in n}
    results, stats = _same_host_job(2, 2, _train)
    reference = run_ranks(2, _train, servers=2)  # in-process: no lanes, no shared values
    for got, want in zip(results, reference, strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(results[0][-1], results[1][-1])
    assert sum(s.pulls_in_place for s in stats) == 2 * 4 * 3  # 2 workers, 4 pulls of "w", 3 chunks each
    assert sum(s.batches for s in stats) > 0
    assert {n for n in os.listdir(segment_dir()) if "-psv-" in n} == before  # the servers removed theirs


def test_a_value_that_changed_during_the_copy_is_asked_for_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = ValueReader.read

    def changed_once(self: ValueReader, name: Any, prefix: str, seq: Any, out: np.ndarray) -> bool:
        calls.append(seq)
        return False if len(calls) == 1 else real(self, name, prefix, seq, out)

    monkeypatch.setattr(ValueReader, "read", changed_once)
    results, stats = _same_host_job(2, 1, _train)
    reference = run_ranks(2, _train, servers=1)
    for got, want in zip(results, reference, strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    assert stats[0].pulls_in_place == 2 * 4 * 3
    assert stats[0].pulls == stats[0].pulls_in_place + 1 + 2 * 3  # the retry, and the 'b' pulls with data


def test_the_sequence_word_catches_every_change() -> None:
    prefix = value_prefix("paratrain-unit-", 3)
    value = SharedValue(prefix, np.arange(20_000, dtype=np.float32))
    reader = ValueReader()
    try:
        out = np.empty(20_000, dtype=np.float32)
        seq = value.seq
        assert reader.read(value.name, prefix, seq, out)
        np.testing.assert_array_equal(out, np.arange(20_000, dtype=np.float32))
        value.changing()
        value.value += 1
        assert not reader.read(value.name, prefix, seq, out)  # the answer was about the value before
        assert reader.read(value.name, prefix, value.seq, out)
        assert out[0] == 1
        with pytest.raises(ValueError, match="not one of this server's"):
            reader.read(value.name, value_prefix("paratrain-unit-", 4), value.seq, out)
        with pytest.raises(ValueError, match="the chunk needs"):
            reader.read(value.name, prefix, value.seq, np.empty(20_001, dtype=np.float32))
        with pytest.raises(ValueError, match="malformed"):
            reader.read(value.name, prefix, "7", out)
    finally:
        value.unlink()
        reader.close()
        gc.collect()
    assert not os.path.exists(os.path.join(segment_dir(), value.name))


def test_batches_pack_and_unpack_and_refuse_what_does_not_add_up() -> None:
    items = [({"op": "push", "id": 1}, [np.ones(2)]), ({"op": "pull", "id": 2}, []), ({"id": 3}, [np.ones(1)] * 2)]
    ops, arrays = pack(items)
    msg = Message(src=1, tag=5, meta={"ops": ops}, arrays=tuple(arrays), dtypes=("float64",) * 3)
    parts = unpack(msg, "ops")
    assert [p.meta for p in parts] == [m for m, _ in items]
    assert [len(p.arrays) for p in parts] == [1, 0, 2] and all(p.src == 1 for p in parts)
    for bad in (
        [{"op": "push"}],  # no count
        [{"n": 4}],  # more arrays than came
        [{"n": 1}],  # arrays left over
        [{"n": 0}] * (MAX_BATCH + 1),
        [],
        "ops",
    ):
        with pytest.raises(ValueError):
            unpack(
                Message(src=1, tag=5, meta={"ops": bad}, arrays=(np.ones(3), np.ones(3)), dtypes=("float64",) * 2),
                "ops",
            )


def test_a_malformed_batch_is_refused_and_the_server_goes_on() -> None:
    def worker(ctx: Context) -> float:
        kv = KVStore("asp", context=ctx)
        kv.init("w", np.zeros(4, dtype=np.float32))
        t, server = ctx.transport, ctx.settings.num_workers
        for i, ops in enumerate(
            [
                [{"op": "push", "key": "w", "chunk": 0, "id": 90 + 10 * ctx.rank, "n": 2}],  # one array came
                [{"op": "batch", "id": 91 + 10 * ctx.rank, "n": 0}],  # nested
                [{"op": "pull", "key": "w", "chunk": 0, "n": 0}],  # no id
            ]
        ):
            rid = 1_000_000 * (ctx.rank + 1) + i
            t.send(
                server,
                REQUEST_TAG,
                [np.zeros(4, dtype=np.float32)] if i == 0 else [],
                {"op": "batch", "id": rid, "ops": ops},
            )
            assert "malformed batch" in str(t.recv(server, reply_tag(rid), timeout=20).meta.get("error")) or i > 0
        kv.push("w", np.ones(4, dtype=np.float32)).wait(20)
        ctx.barrier()
        value = float(kv.pull("w").sum())
        kv.close()
        return value

    assert run_ranks(2, worker, servers=1) == [8.0, 8.0]


def test_pull_out_must_fit_the_key() -> None:
    def worker(ctx: Context) -> None:
        kv = KVStore(context=ctx)
        kv.init("w", np.zeros((3, 4), dtype=np.float32))
        kv.clock()
        good = np.empty((3, 4), dtype=np.float32)
        assert kv.pull("w", out=good) is good
        readonly = np.empty((3, 4), dtype=np.float32)
        readonly.flags.writeable = False
        for bad in (np.empty(12, dtype=np.float32), np.empty((3, 4)), np.empty((4, 3), dtype=np.float32).T, readonly):
            with pytest.raises(ValueError, match="out= for key 'w'"):
                kv.pull("w", out=bad)
        kv.close()

    run_ranks(1, worker, servers=1)
