"""Key sharding against exact tables: stable hashes, home servers, row chunks, sparse row grouping, load."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import pytest

from paratrain.ps.sharding import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    as_rows,
    home_server,
    key_hash,
    plan_chunks,
    server_load,
    split_rows,
)

# -- hashing ----------------------------------------------------------------------------------------------------


def test_key_hash_is_stable_across_runs_and_versions() -> None:
    # Hard-coded: a change here moves every key of every existing job to another server.
    assert key_hash("layer1.weight") == 2892967348787316195
    assert key_hash(0) == 13422977840323848547
    assert key_hash("0") == 14459109577856274064
    assert key_hash("") == 5181969411558131176
    assert key_hash(-1) == 8756726163853913225


def test_key_hash_is_blake2b_of_the_typed_encoding() -> None:
    def expected(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")

    assert key_hash("emb") == expected(b"str:emb")
    assert key_hash("é") == expected("str:é".encode())
    assert key_hash(12345678901234567890123) == expected(b"int:12345678901234567890123")


def test_str_and_int_keys_with_the_same_text_differ() -> None:
    for i in [0, 1, 7, 42, 10**20, -3]:
        assert key_hash(i) != key_hash(str(i))


def test_numpy_integer_keys_hash_like_ints_and_other_types_are_refused() -> None:
    assert key_hash(np.int64(5)) == key_hash(5) == key_hash(np.uint8(5))  # type: ignore[arg-type]
    for bad in [True, 1.0, b"emb", None, (1,)]:
        with pytest.raises(TypeError):
            key_hash(bad)  # type: ignore[arg-type]


def test_key_hash_is_64_bit_unsigned() -> None:
    hashes = [key_hash(f"k{i}") for i in range(1000)]
    assert all(0 <= h < 2**64 for h in hashes)
    assert len(set(hashes)) == 1000
    assert max(hashes) >= 2**63  # the top bit is used


# -- home servers -----------------------------------------------------------------------------------------------


def test_home_server_table() -> None:
    assert [home_server("emb", s) for s in (1, 2, 3, 4)] == [0, 1, 2, 3]
    assert [home_server(0, s) for s in (1, 2, 3, 4)] == [0, 1, 2, 2]
    assert home_server("layer1.weight", 7) == 2892967348787316195 * 7 // 2**64


@pytest.mark.parametrize("num_servers", [1, 2, 3, 4, 7, 16])
def test_home_server_covers_all_servers_roughly_uniformly(num_servers: int) -> None:
    for keys in ([f"layer{i}.weight" for i in range(8000)], list(range(8000))):
        counts = Counter(home_server(k, num_servers) for k in keys)
        assert sorted(counts) == list(range(num_servers))
        expected = len(keys) / num_servers
        assert all(abs(c - expected) < 0.15 * expected for c in counts.values()), counts


def test_home_server_is_range_partitioning_so_servers_own_contiguous_hash_ranges() -> None:
    keys = sorted((f"k{i}" for i in range(2000)), key=key_hash)
    homes = [home_server(k, 5) for k in keys]
    assert homes == sorted(homes)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_home_server_rejects_bad_server_counts(bad: object) -> None:
    with pytest.raises(ValueError, match="num_servers"):
        home_server("k", bad)  # type: ignore[arg-type]


# -- chunk plans ------------------------------------------------------------------------------------------------


def test_as_rows_table() -> None:
    assert as_rows(()) == (1, 1)
    assert as_rows((0,)) == (0, 1)
    assert as_rows((5,)) == (5, 1)
    assert as_rows((10, 4)) == (10, 4)
    assert as_rows((3, 2, 5)) == (3, 10)
    assert as_rows((5, 0)) == (5, 0)
    for bad in [(-1,), (2.0,), [3]]:
        with pytest.raises(ValueError):
            as_rows(bad)  # type: ignore[arg-type]


# (key, shape, itemsize, S, chunk_bytes) -> [(index, row_start, row_stop, server)]. Homes: "emb" is on server
# S - 1 for S = 1..4; key 0 on servers 0, 1, 2, 2.
CHUNK_TABLE = [
    ("emb", (10, 4), 4, 1, 1000, [(0, 0, 10, 0)]),
    ("emb", (10, 4), 4, 3, 64, [(0, 0, 4, 2), (1, 4, 8, 0), (2, 8, 10, 1)]),
    ("emb", (10, 4), 4, 4, 48, [(0, 0, 3, 3), (1, 3, 6, 0), (2, 6, 9, 1), (3, 9, 10, 2)]),
    ("emb", (10, 4), 4, 4, 64, [(0, 0, 4, 3), (1, 4, 8, 0), (2, 8, 10, 1)]),
    ("emb", (10, 4), 4, 2, 160, [(0, 0, 10, 1)]),
    ("emb", (10, 4), 4, 2, 159, [(0, 0, 9, 1), (1, 9, 10, 0)]),
    ("emb", (4, 4), 4, 2, 8, [(0, 0, 1, 1), (1, 1, 2, 0), (2, 2, 3, 1), (3, 3, 4, 0)]),  # rows never split
    ("emb", (4, 4), 4, 1, 16, [(0, 0, 1, 0), (1, 1, 2, 0), (2, 2, 3, 0), (3, 3, 4, 0)]),
    (0, (7,), 8, 4, 16, [(0, 0, 2, 2), (1, 2, 4, 3), (2, 4, 6, 0), (3, 6, 7, 1)]),
    (0, (7,), 8, 3, 56, [(0, 0, 7, 2)]),
    (0, (7,), 8, 2, 55, [(0, 0, 6, 1), (1, 6, 7, 0)]),
    (0, (3, 2, 5), 2, 2, 40, [(0, 0, 2, 1), (1, 2, 3, 0)]),
    (0, (), 4, 3, DEFAULT_CHUNK_BYTES, [(0, 0, 1, 2)]),  # a scalar: one row of one element
    (0, (), 4, 3, 1, [(0, 0, 1, 2)]),
    ("emb", (0, 4), 4, 4, 64, [(0, 0, 0, 3)]),  # no rows: one empty chunk on the home server
    ("emb", (0,), 4, 2, 64, [(0, 0, 0, 1)]),
    ("emb", (5, 0), 4, 2, 64, [(0, 0, 5, 1)]),  # rows of no bytes: one chunk of all of them
]


@pytest.mark.parametrize("case", CHUNK_TABLE, ids=str)
def test_plan_chunks_table(
    case: tuple[str | int, tuple[int, ...], int, int, int, list[tuple[int, int, int, int]]],
) -> None:
    key, shape, itemsize, num_servers, chunk_bytes, expected = case
    chunks = plan_chunks(key, shape, itemsize, num_servers, chunk_bytes=chunk_bytes)
    assert chunks == [Chunk(index=i, row_start=a, row_stop=b, server=s) for i, a, b, s in expected]


SHAPES = [(), (1,), (2,), (17,), (1000,), (3, 5), (10, 4), (33, 7), (6, 2, 3), (0, 3), (4, 0)]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 16, 100, 4096, DEFAULT_CHUNK_BYTES])
@pytest.mark.parametrize("num_servers", [1, 2, 3, 4])
def test_chunks_tile_the_rows_exactly_and_go_round_robin_from_home(num_servers: int, chunk_bytes: int) -> None:
    keys: list[str | int] = ["a", "layer.bias", 3, 99]
    for key in keys:
        for shape in SHAPES:
            for itemsize in [1, 2, 4, 8]:
                chunks = plan_chunks(key, shape, itemsize, num_servers, chunk_bytes=chunk_bytes)
                rows, width = as_rows(shape)
                assert chunks[0].row_start == 0 and chunks[-1].row_stop == rows
                home = home_server(key, num_servers)
                per_chunk = chunks[0].num_rows
                for j, c in enumerate(chunks):
                    assert c.index == j
                    assert c.server == (home + j) % num_servers
                    assert j == 0 or c.row_start == chunks[j - 1].row_stop  # no gap, no overlap
                    assert c.num_rows >= 1 or rows == 0
                    assert c.num_rows * width * itemsize <= max(chunk_bytes, width * itemsize)  # one row at least
                    assert c.num_rows == per_chunk or j == len(chunks) - 1  # only the last is short
                if rows and width:
                    assert per_chunk == min(rows, max(1, chunk_bytes // (width * itemsize)))


def test_a_64_mib_layer_spreads_evenly_over_4_servers() -> None:
    mib = 1 << 20
    for shape in [(4096, 4096), (16 * mib,), (4099, 4096), (16 * mib + 12345,)]:
        chunks = plan_chunks("fc1.weight", shape, 4, 4, chunk_bytes=mib)
        rows, width = as_rows(shape)
        load = server_load(chunks, width * 4, 4)
        assert sum(load) == rows * width * 4
        assert max(load) - min(load) <= mib
        assert all(abs(x - sum(load) / 4) <= mib for x in load)
    assert server_load(plan_chunks("fc1.weight", (4096, 4096), 4, 4, chunk_bytes=mib), 4096 * 4, 4) == [16 * mib] * 4


def test_many_small_keys_spread_by_hash() -> None:
    load = [0] * 4
    for i in range(400):
        for s, b in enumerate(server_load(plan_chunks(f"bias{i}", (100,), 4, 4), 4, 4)):
            load[s] += b
    assert sum(load) == 400 * 400
    assert all(abs(x - 40_000) < 6_000 for x in load), load


def test_server_load_table_and_validation() -> None:
    chunks = plan_chunks("emb", (10, 4), 4, 3, chunk_bytes=64)
    assert server_load(chunks, 16, 3) == [64, 32, 64]
    assert server_load(plan_chunks("emb", (0, 4), 4, 3), 16, 3) == [0, 0, 0]
    with pytest.raises(ValueError, match="server 2"):
        server_load(chunks, 16, 2)
    with pytest.raises(ValueError, match="row_bytes"):
        server_load(chunks, -1, 3)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("k", (3,), 0, 2), {}, "itemsize"),
        (("k", (3,), 4, 0), {}, "num_servers"),
        (("k", (3,), 4, 2), {"chunk_bytes": 0}, "chunk_bytes"),
        (("k", (-3,), 4, 2), {}, "shape"),
    ],
)
def test_plan_chunks_validation(args: tuple[object, ...], kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_chunks(*args, **kwargs)  # type: ignore[arg-type]


# -- sparse rows ------------------------------------------------------------------------------------------------


def _table(groups: list[tuple[Chunk, np.ndarray, np.ndarray]]) -> list[tuple[int, list[int], list[int]]]:
    return [(c.index, p.tolist(), r.tolist()) for c, p, r in groups]


def test_split_rows_table() -> None:
    chunks = plan_chunks("emb", (10, 4), 4, 3, chunk_bytes=64)  # rows [0, 4), [4, 8), [8, 10)
    assert _table(split_rows(chunks, np.array([9, 0, 5, 9]))) == [(0, [1], [0]), (1, [2], [1]), (2, [0, 3], [1, 1])]
    assert _table(split_rows(chunks, np.array([3, 4, 7, 8]))) == [(0, [0], [3]), (1, [1, 2], [0, 3]), (2, [3], [0])]
    assert _table(split_rows(chunks, [6, 6, 6])) == [(1, [0, 1, 2], [2, 2, 2])]  # a list is fine too


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint64, np.uint8])
@pytest.mark.parametrize("chunk_bytes", [16, 40, 64, 1 << 20])
def test_split_rows_round_trips_with_duplicates_in_any_order(dtype: type[np.integer], chunk_bytes: int) -> None:
    rng = np.random.default_rng(7)
    chunks = plan_chunks("emb", (200, 4), 4, 3, chunk_bytes=chunk_bytes)
    for n in [1, 5, 50, 1000]:
        ids = rng.integers(0, 200, size=n).astype(dtype)
        groups = split_rows(chunks, ids)
        rebuilt = np.full(n, -1, dtype=np.int64)
        seen = []
        for c, positions, local in groups:
            assert positions.tolist() == sorted(positions.tolist())
            assert local.dtype == np.int64
            assert ((local >= 0) & (local < c.num_rows)).all()
            rebuilt[positions] = local + c.row_start
            seen.extend(positions.tolist())
        assert sorted(seen) == list(range(n))  # every occurrence once, duplicates kept
        assert rebuilt.tolist() == ids.astype(np.int64).tolist()
        assert [c.index for c, _, _ in groups] == sorted({c.index for c, _, _ in groups})


def test_split_rows_of_no_ids_is_empty() -> None:
    chunks = plan_chunks("emb", (10, 4), 4, 3, chunk_bytes=64)
    assert split_rows(chunks, np.array([], dtype=np.int64)) == []
    assert split_rows(plan_chunks("emb", (0, 4), 4, 3), np.array([], dtype=np.int64)) == []


def test_split_rows_refuses_out_of_range_ids() -> None:
    chunks = plan_chunks("emb", (10, 4), 4, 3, chunk_bytes=64)
    with pytest.raises(IndexError, match=r"row id 10 is outside \[0, 10\)"):
        split_rows(chunks, np.array([0, 10]))
    with pytest.raises(IndexError, match="row id -1"):
        split_rows(chunks, np.array([-1, 3]))  # negative ids are not wrapped round
    with pytest.raises(IndexError):
        split_rows(chunks, np.array([2**64 - 1], dtype=np.uint64))
    with pytest.raises(IndexError):
        split_rows(plan_chunks("emb", (0, 4), 4, 3), np.array([0]))


def test_split_rows_refuses_non_integer_ids_and_bad_shapes() -> None:
    chunks = plan_chunks("emb", (10, 4), 4, 3, chunk_bytes=64)
    for bad in [np.array([1.0, 2.0]), np.array([True]), np.array(["1"])]:
        with pytest.raises(TypeError, match="integers"):
            split_rows(chunks, bad)
    with pytest.raises(ValueError, match="1-D"):
        split_rows(chunks, np.array([[1, 2]]))
    with pytest.raises(ValueError, match="tile"):
        split_rows([chunks[0], chunks[2]], np.array([1]))
    with pytest.raises(ValueError, match="tile"):
        split_rows(chunks[1:], np.array([5]))
    with pytest.raises(ValueError, match="no chunks"):
        split_rows([], np.array([1]))
