"""Key sharding against exact tables: stable hashes, balanced consistent placement with replica lists (against
a plain reference and the issue's movement bound), home servers, row chunks, sparse row grouping, load."""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from paratrain.ps import sharding
from paratrain.ps.sharding import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    as_rows,
    home_server,
    key_hash,
    plan_chunks,
    replica_servers,
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


# -- the placement hash ---------------------------------------------------------------------------------------

_MASK = 2**64 - 1


def _splitmix(seed: int, k: int) -> int:
    """Output k (from 1) of splitmix64 seeded with ``seed``, written out from the paper, for the reference."""
    z = (seed + k * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def test_the_placement_hash_is_splitmix64_in_numpy_and_in_python() -> None:
    # Hard-coded: splitmix64's first outputs from seed 0, as every implementation of it prints them.
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC]
    assert sharding._stream(0, 4).tolist() == expected
    assert [_splitmix(0, k) for k in range(1, 5)] == expected
    for seed in [1, 2**63, _MASK, key_hash("emb")]:
        assert sharding._stream_ints(seed, 40) == sharding._stream(seed, 40).tolist()


def _reference(key: str | int, num_chunks: int, num_servers: int, replicas: int) -> list[tuple[int, ...]]:
    """The placement as the module docstring describes it, one chunk at a time in plain Python: slow and
    obviously right, to check the vectorised one against."""
    h = key_hash(key)
    seeds = [_splitmix(h, j + 1) for j in range(num_chunks)]
    take_salts = [_splitmix(0xD1B54A32D192ED03, s + 1) for s in range(num_servers)]
    backup_salts = [_splitmix(0xA0761D6478BD642F, s + 1) for s in range(num_servers)]

    def weight(j: int, s: int, salts: list[int]) -> int:
        return _splitmix(seeds[j] ^ salts[s], 0)  # the finaliser alone: k = 0 adds nothing

    owner = [0] * num_chunks
    for t in range(1, num_servers):
        u = _splitmix(h ^ 0x8CB92BA72F3D8DD7, t + 1)
        share = Fraction(num_chunks, t + 1) + Fraction(u, 2**64)
        for _ in range(share.numerator // share.denominator):  # floor
            load = Counter(owner)
            fullest = max(load[s] for s in range(t))
            j = max(
                (j for j in range(num_chunks) if owner[j] < t and load[owner[j]] == fullest),
                key=lambda j: weight(j, t, take_salts),
            )
            owner[j] = t
    lists = []
    for j, primary in enumerate(owner):
        backups = sorted(
            (s for s in range(num_servers) if s != primary), key=lambda s: weight(j, s, backup_salts), reverse=True
        )
        lists.append((primary, *backups[: replicas - 1]))
    return lists


@pytest.mark.parametrize("num_servers", [1, 2, 3, 4, 5, 8, 9, 16])
def test_replica_servers_match_the_one_chunk_at_a_time_reference(num_servers: int) -> None:
    # 41 and 60 chunks take the vectorised path, the others the plain-Python one
    for key in ["emb", "layer1.weight", 0, 12345]:
        for num_chunks in [1, 2, 3, 5, 8, 17, 41, 60]:
            for replicas in sorted({1, min(3, num_servers), num_servers}):
                got = replica_servers(key, num_chunks, num_servers, replicas)
                assert got == _reference(key, num_chunks, num_servers, replicas), (key, num_chunks, replicas)


def test_the_plain_python_and_the_vectorised_placements_agree() -> None:
    for i in range(200):
        h = key_hash(f"k{i}")
        num_chunks, num_servers = 1 + i % 97, 2 + i % 19
        weights = sharding._weights(h, num_chunks, num_servers, sharding._TAKE_SALT)
        shares = sharding._stream_ints(h ^ sharding._SHARE_SALT, num_servers)
        assert sharding._primaries_small(weights, shares) == sharding._primaries_large(weights, shares)


# (key, chunks, S, R) -> replica lists. From S = 2 to 5 the primaries go [1, 0, 0, 1, 0] -> [1, 2, 0, 1, 0] ->
# [1, 2, 0, 3, 0] -> [1, 2, 0, 3, 4]: each new server takes one chunk, nothing else moves.
REPLICA_TABLE = [
    ("emb", 5, 1, 1, [(0,), (0,), (0,), (0,), (0,)]),
    ("emb", 5, 2, 2, [(1, 0), (0, 1), (0, 1), (1, 0), (0, 1)]),
    ("emb", 5, 3, 3, [(1, 0, 2), (2, 0, 1), (0, 2, 1), (1, 2, 0), (0, 1, 2)]),
    ("emb", 5, 4, 4, [(1, 0, 2, 3), (2, 0, 3, 1), (0, 2, 1, 3), (3, 2, 1, 0), (0, 1, 2, 3)]),
    ("emb", 5, 5, 5, [(1, 0, 2, 3, 4), (2, 0, 3, 1, 4), (0, 2, 1, 3, 4), (3, 2, 1, 0, 4), (4, 1, 2, 3, 0)]),
    ("emb", 5, 5, 2, [(1, 0), (2, 0), (0, 2), (3, 2), (4, 1)]),
    ("emb", 3, 3, 2, [(1, 0), (2, 0), (0, 2)]),
]


@pytest.mark.parametrize("case", REPLICA_TABLE, ids=str)
def test_replica_servers_table(case: tuple[str, int, int, int, list[tuple[int, ...]]]) -> None:
    key, num_chunks, num_servers, replicas, expected = case
    assert replica_servers(key, num_chunks, num_servers, replicas) == expected


def test_replica_lists_are_distinct_servers_of_the_asked_length_with_the_primary_first() -> None:
    for num_servers in [1, 2, 3, 7, 16]:
        for num_chunks in [1, 4, 50]:
            primaries = replica_servers("w", num_chunks, num_servers)
            for replicas in range(1, num_servers + 1):
                lists = replica_servers("w", num_chunks, num_servers, replicas)
                assert len(lists) == num_chunks
                for primary, servers in zip(primaries, lists, strict=True):
                    assert len(servers) == replicas == len(set(servers))
                    assert all(0 <= s < num_servers for s in servers)
                    assert servers[0] == primary[0]
                # a longer list extends a shorter one: the failover order does not depend on R
                assert [s[:1] for s in lists] == primaries
                if replicas > 1:
                    shorter = replica_servers("w", num_chunks, num_servers, replicas - 1)
                    assert [s[:-1] for s in lists] == shorter


@pytest.mark.parametrize("num_servers", [1, 2, 3, 4, 5, 7, 8, 16])
def test_every_server_holds_the_floor_or_the_ceiling_of_a_keys_chunks(num_servers: int) -> None:
    for num_chunks in [*range(1, 50), 100, 257, 1000]:
        counts = Counter(servers[0] for servers in replica_servers("layer", num_chunks, num_servers))
        low = num_chunks // num_servers
        assert all(low <= counts[s] <= low + 1 for s in range(num_servers)), (num_chunks, counts)


def _moved(before: list[tuple[int, ...]], after: list[tuple[int, ...]], new_server: int) -> int:
    moved = [(a[0], b[0]) for a, b in zip(before, after, strict=True) if a[0] != b[0]]
    assert all(b == new_server for _, b in moved), "a chunk moved between old servers"
    return len(moved)


@pytest.mark.parametrize(
    ("chunk_counts", "num_keys"),
    [([1], 10_000), ([2, 3, 4, 5], 1_000), ([16], 200), ([100], 20)],
    ids=["10000 keys of 1 chunk", "1000 keys of 2-5 chunks", "200 keys of 16 chunks", "20 keys of 100 chunks"],
)
def test_adding_a_server_moves_at_most_1_2_over_s_plus_1_of_the_chunks_and_only_to_it(
    chunk_counts: list[int], num_keys: int
) -> None:
    """The issue's bound, for S = 1..16. Read backwards, the same tables show that removing the last server
    moves exactly its own chunks (back to where they were), and no other."""
    keys = [(f"key{i}", chunk_counts[i % len(chunk_counts)]) for i in range(num_keys)]
    total = sum(n for _, n in keys)
    before = [replica_servers(key, n, 1) for key, n in keys]
    for num_servers in range(1, 17):
        after = [replica_servers(key, n, num_servers + 1) for key, n in keys]
        moved = sum(_moved(b, a, num_servers) for b, a in zip(before, after, strict=True))
        assert moved / total <= 1.2 / (num_servers + 1), (num_servers, moved / total * (num_servers + 1))
        assert moved / total >= 0.8 / (num_servers + 1), "the new server took too little"
        before = after


def test_a_failed_server_moves_only_its_chunks_to_their_first_backups_and_they_spread_over_the_survivors() -> None:
    """Failover: each chunk goes to the first live server of its list; the others stay where they are. The
    orphans spread evenly (a regression: when backups were ranked by the weights that chose the primaries,
    server 0's orphans went to server 1 half as often as to the others, because server 1 had taken the chunks
    that weigh most for it)."""
    num_servers = 8
    keys = [(f"k{i}", 1 + i % 4) for i in range(4000)]
    lists = [servers for key, n in keys for servers in replica_servers(key, n, num_servers, num_servers)]
    for failed in range(num_servers):
        live = [s for s in range(num_servers) if s != failed]
        placed = [next(s for s in servers if s in live) for servers in lists]
        orphans = [servers[1] for servers in lists if servers[0] == failed]
        assert [p for p, servers in zip(placed, lists, strict=True) if servers[0] != failed] == [
            servers[0] for servers in lists if servers[0] != failed
        ]
        assert [p for p, servers in zip(placed, lists, strict=True) if servers[0] == failed] == orphans
        spread = Counter(orphans)
        expected = len(orphans) / (num_servers - 1)
        assert sorted(spread) == live
        assert all(abs(c - expected) < 0.25 * expected for c in spread.values()), (failed, spread)


def test_placement_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from paratrain.ps.sharding import plan_chunks, replica_servers;"
        "print([replica_servers(k, n, 7, 3) for k in ('emb', 0, 'layer.bias') for n in (1, 5, 60)],"
        " plan_chunks('emb', (100, 3), 4, 5, chunk_bytes=48, replicas=2))"
    )
    here = [replica_servers(k, n, 7, 3) for k in ("emb", 0, "layer.bias") for n in (1, 5, 60)]
    expected = f"{here} {plan_chunks('emb', (100, 3), 4, 5, chunk_bytes=48, replicas=2)}"
    for seed in ["0", "12345"]:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("k", 0, 2, 1), "num_chunks"),
        (("k", 3, 0, 1), "num_servers"),
        (("k", 3, 2, 0), "replicas"),
        (("k", 3, 2, 3), "replicas=3 needs as many distinct servers"),
        (("k", 3, True, 1), "num_servers"),
    ],
)
def test_replica_servers_validation(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replica_servers(*args)  # type: ignore[arg-type]


# -- home servers -----------------------------------------------------------------------------------------------


def test_home_server_table() -> None:
    assert [home_server("emb", s) for s in range(1, 9)] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert [home_server("layer1.weight", s) for s in range(1, 9)] == [0, 0, 0, 3, 3, 3, 3, 3]
    assert [home_server(0, s) for s in range(1, 9)] == [0] * 8


@pytest.mark.parametrize("num_servers", [1, 2, 3, 4, 7, 16])
def test_home_server_covers_all_servers_roughly_uniformly(num_servers: int) -> None:
    for keys in ([f"layer{i}.weight" for i in range(8000)], list(range(8000))):
        counts = Counter(home_server(k, num_servers) for k in keys)
        assert sorted(counts) == list(range(num_servers))
        expected = len(keys) / num_servers
        assert all(abs(c - expected) < 0.15 * expected for c in counts.values()), counts


def test_a_home_server_changes_only_to_a_new_server() -> None:
    for i in range(2000):
        homes = [home_server(f"k{i}", s) for s in range(1, 17)]
        assert all(b in (a, s) for s, (a, b) in enumerate(itertools.pairwise(homes), start=1)), homes


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


# (key, shape, itemsize, S, chunk_bytes) -> [(index, row_start, row_stop, server)]. A key of one chunk is on its
# home server: "emb" and 0 are on server 0 for S = 1..4.
CHUNK_TABLE = [
    ("emb", (10, 4), 4, 1, 1000, [(0, 0, 10, 0)]),
    ("emb", (10, 4), 4, 3, 64, [(0, 0, 4, 1), (1, 4, 8, 2), (2, 8, 10, 0)]),
    ("emb", (10, 4), 4, 4, 48, [(0, 0, 3, 1), (1, 3, 6, 2), (2, 6, 9, 0), (3, 9, 10, 3)]),
    ("emb", (10, 4), 4, 4, 64, [(0, 0, 4, 1), (1, 4, 8, 2), (2, 8, 10, 0)]),
    ("emb", (10, 4), 4, 2, 160, [(0, 0, 10, 0)]),
    ("emb", (10, 4), 4, 2, 159, [(0, 0, 9, 1), (1, 9, 10, 0)]),
    ("emb", (4, 4), 4, 2, 8, [(0, 0, 1, 1), (1, 1, 2, 0), (2, 2, 3, 0), (3, 3, 4, 1)]),  # rows never split
    ("emb", (4, 4), 4, 1, 16, [(0, 0, 1, 0), (1, 1, 2, 0), (2, 2, 3, 0), (3, 3, 4, 0)]),
    (0, (7,), 8, 4, 16, [(0, 0, 2, 3), (1, 2, 4, 2), (2, 4, 6, 1), (3, 6, 7, 0)]),
    (0, (7,), 8, 3, 56, [(0, 0, 7, 0)]),
    (0, (7,), 8, 2, 55, [(0, 0, 6, 1), (1, 6, 7, 0)]),
    (0, (3, 2, 5), 2, 2, 40, [(0, 0, 2, 1), (1, 2, 3, 0)]),
    (0, (), 4, 3, DEFAULT_CHUNK_BYTES, [(0, 0, 1, 0)]),  # a scalar: one row of one element
    (0, (), 4, 3, 1, [(0, 0, 1, 0)]),
    ("emb", (0, 4), 4, 4, 64, [(0, 0, 0, 0)]),  # no rows: one empty chunk on the home server
    ("emb", (0,), 4, 2, 64, [(0, 0, 0, 0)]),
    ("emb", (5, 0), 4, 2, 64, [(0, 0, 5, 0)]),  # rows of no bytes: one chunk of all of them
]


@pytest.mark.parametrize("case", CHUNK_TABLE, ids=str)
def test_plan_chunks_table(
    case: tuple[str | int, tuple[int, ...], int, int, int, list[tuple[int, int, int, int]]],
) -> None:
    key, shape, itemsize, num_servers, chunk_bytes, expected = case
    chunks = plan_chunks(key, shape, itemsize, num_servers, chunk_bytes=chunk_bytes)
    assert chunks == [Chunk(index=i, row_start=a, row_stop=b, server=s) for i, a, b, s in expected]


def test_plan_chunks_with_replicas_table() -> None:
    chunks = plan_chunks("emb", (10, 4), 4, 3, chunk_bytes=64, replicas=2)
    assert chunks == [
        Chunk(index=0, row_start=0, row_stop=4, server=1, backups=(0,)),
        Chunk(index=1, row_start=4, row_stop=8, server=2, backups=(0,)),
        Chunk(index=2, row_start=8, row_stop=10, server=0, backups=(2,)),
    ]
    assert [c.replicas for c in chunks] == replica_servers("emb", 3, 3, 2)
    assert Chunk(0, 0, 2, server=1).replicas == (1,)  # made by hand, without backups


SHAPES = [(), (1,), (2,), (17,), (1000,), (3, 5), (10, 4), (33, 7), (6, 2, 3), (0, 3), (4, 0)]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 16, 100, 4096, DEFAULT_CHUNK_BYTES])
@pytest.mark.parametrize("num_servers", [1, 2, 3, 4])
def test_chunks_tile_the_rows_exactly_and_sit_where_replica_servers_says(num_servers: int, chunk_bytes: int) -> None:
    keys: list[str | int] = ["a", "layer.bias", 3, 99]
    replicas = min(2, num_servers)
    for key in keys:
        for shape in SHAPES:
            for itemsize in [1, 2, 4, 8]:
                chunks = plan_chunks(key, shape, itemsize, num_servers, chunk_bytes=chunk_bytes, replicas=replicas)
                rows, width = as_rows(shape)
                assert chunks[0].row_start == 0 and chunks[-1].row_stop == rows
                assert [c.replicas for c in chunks] == replica_servers(key, len(chunks), num_servers, replicas)
                per_chunk = chunks[0].num_rows
                for j, c in enumerate(chunks):
                    assert c.index == j
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
    assert server_load(chunks, 16, 3) == [32, 64, 64]
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
        (("k", (3,), 4, 2), {"replicas": 3}, "replicas"),
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
