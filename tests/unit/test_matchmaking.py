"""Group decisions: splitting a round's registrants under the size cap, and validating decision records."""

import pytest

from atoll.protocols.matchmaking import MAX_GROUP, parse_group_record, split_groups


def registrants(n):
    return {f"peer{i:03d}": 100.0 + i for i in range(n)}


@pytest.mark.parametrize("n,cap", [(1, 1), (1, 16), (5, 16), (16, 16), (17, 16), (10, 3), (40, 7), (9, 1)])
def test_split_groups_partitions_under_the_cap(n, cap):
    reg = registrants(n)
    groups = split_groups(reg, cap)
    flat = [p for g in groups for p in g]
    assert sorted(flat) == sorted(reg)  # everyone, once
    assert len(groups) == -(-n // cap)  # the fewest groups
    sizes = [len(g) for g in groups]
    assert max(sizes) <= cap and max(sizes) - min(sizes) <= 1
    assert all(g == sorted(g) for g in groups)


def test_split_groups_deals_the_earliest_registrants_to_different_groups():
    reg = {"d": 1.0, "c": 2.0, "b": 3.0, "a": 4.0}
    assert split_groups(reg, 2) == [["b", "d"], ["a", "c"]]
    # The same registrations in any dict order give the same groups (every daemon must agree).
    assert split_groups(dict(reversed(list(reg.items()))), 2) == [["b", "d"], ["a", "c"]]


def test_split_groups_rejects_a_non_positive_cap():
    with pytest.raises(ValueError):
        split_groups(registrants(3), 0)


def test_parse_group_record_accepts_disjoint_sorted_groups():
    assert parse_group_record({"groups": [["a", "b"], ["c"]], "time": 1.0}) == [["a", "b"], ["c"]]


@pytest.mark.parametrize("value", [
    None, [], {"members": ["a"], "time": 1.0}, {"groups": [], "time": 1.0}, {"groups": [["b", "a"]], "time": 1.0},
    {"groups": [["a"], ["a"]], "time": 1.0}, {"groups": [["a", "a"]], "time": 1.0}, {"groups": [[]], "time": 1.0},
    {"groups": [[1]], "time": 1.0}, {"groups": [["a" * 200]], "time": 1.0}, {"groups": "a", "time": 1.0},
    {"groups": [["a"]], "time": 1.0, "extra": 1},
    {"groups": [[f"p{i:05d}"] for i in range(MAX_GROUP + 1)], "time": 1.0},
])
def test_parse_group_record_rejects_malformed_decisions(value):
    assert parse_group_record(value) is None
