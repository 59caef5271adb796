"""Where chunks live while servers join and leave (:mod:`paratrain.ps.membership`): exact tables, and the moves
consistent hashing promises (only to a new server, only from a removed one, about 1/(S + 1) of them)."""

from __future__ import annotations

import pytest

from paratrain.ps.membership import ServerSet, moved_chunks, owner_slots
from paratrain.ps.sharding import replica_servers


def test_owners_are_the_first_active_server_of_each_chunks_order() -> None:
    orders = replica_servers("emb", 6, 4, 4)
    assert orders == [(1, 0, 2, 3), (2, 0, 3, 1), (0, 2, 1, 3), (3, 2, 1, 0), (0, 1, 2, 3), (1, 3, 2, 0)]
    assert owner_slots("emb", 6, ServerSet.first(4)) == [1, 2, 0, 3, 0, 1]  # every slot active: the primaries
    assert owner_slots("emb", 6, ServerSet.first(4, 2)) == [1, 0, 0, 1, 0, 1]
    assert owner_slots("emb", 6, ServerSet(4, (1, 3))) == [1, 3, 1, 3, 1, 1]


def test_with_every_slot_active_the_placement_is_a_static_jobs() -> None:
    for key in ("a", "b", 7):
        assert owner_slots(key, 9, ServerSet.first(5)) == [o[0] for o in replica_servers(key, 9, 5)]


@pytest.mark.parametrize(("slots", "active"), [(3, 2), (4, 2), (4, 3), (5, 1)])
def test_adding_a_server_moves_chunks_only_to_it_and_about_one_in_s_plus_one(slots: int, active: int) -> None:
    before = ServerSet.first(slots, active)
    after = before.with_server(active)
    moved = total = 0
    for k in range(400):
        moves = moved_chunks(f"layer{k}", 32, before, after)
        assert all(new == active for _, new in moves.values())
        moved, total = moved + len(moves), total + 32
    assert abs(moved / total * (active + 1) - 1) < 0.05  # 12,800 chunks: the expectation is exactly 1/(S + 1)


def test_removing_a_server_moves_only_its_chunks_spread_over_the_others() -> None:
    before = ServerSet.first(4)
    after = before.without(1)
    landed = {0: 0, 2: 0, 3: 0}
    for k in range(300):
        old = owner_slots(f"k{k}", 16, before)
        moves = moved_chunks(f"k{k}", 16, before, after)
        assert sorted(moves) == [i for i, s in enumerate(old) if s == 1]
        for _, new in moves.values():
            landed[new] += 1
    assert min(landed.values()) > 0.8 * max(landed.values())


def test_removing_the_added_server_puts_every_chunk_back() -> None:
    s = ServerSet.first(4, 2)
    back = s.with_server(3).without(3)
    assert back.active == s.active and back.epoch == 2
    assert owner_slots("w", 20, back) == owner_slots("w", 20, s)


def test_server_sets_refuse_what_cannot_be() -> None:
    with pytest.raises(ValueError, match=r"outside 1\.\.3"):
        ServerSet.first(3, 4)
    with pytest.raises(ValueError, match="holds keys already"):
        ServerSet.first(3, 2).with_server(1)
    with pytest.raises(ValueError, match="start the job with more servers"):
        ServerSet.first(3, 2).with_server(3)
    with pytest.raises(ValueError, match="last one holding keys"):
        ServerSet.first(3, 1).without(0)
    with pytest.raises(ValueError, match="holds no keys"):
        ServerSet.first(3, 2).without(2)
