"""tools/timing: every round runs every candidate once, and over a full cycle of rounds each candidate directly
follows every other candidate equally often (the balance the side-by-side medians rely on)."""
import itertools
import time
from collections import Counter

import pytest

from npu_graph.tools.timing import balanced_orders, time_side_by_side


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_orders_are_permutations_with_balanced_predecessors(n):
    orders = balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    follows = Counter((a, b) for order in orders for a, b in itertools.pairwise(order))
    if n > 1:
        assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(follows.values())) == 1


def test_each_candidate_runs_once_per_round_in_whole_cycles():
    calls = []
    medians = time_side_by_side({name: (lambda name=name: calls.append(name)) for name in "abcd"}, repeat=7,
                                warmup=1)
    assert set(medians) == set("abcd") and all(m >= 0 for m in medians.values())
    assert Counter(calls) == dict.fromkeys("abcd", 9)
    assert [calls[4 + 4 * r: 8 + 4 * r] for r in range(2)] == [list("abdc"), list("bcad")]


def test_a_candidate_slower_than_slow_s_is_timed_by_its_warmup_call_alone():
    calls = []

    def slow():
        calls.append("slow")
        time.sleep(0.05)

    candidates = {"slow": slow, **{name: (lambda name=name: calls.append(name)) for name in "ab"}}
    medians = time_side_by_side(candidates, repeat=2, warmup=1, slow_s=0.04)
    assert Counter(calls) == {"slow": 1, "a": 3, "b": 3}
    assert medians["slow"] >= 0.05 and set(medians) == {"slow", "a", "b"}
