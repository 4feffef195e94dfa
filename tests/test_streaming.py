"""choose_streamed against brute force over every subset of a device's weights (pure: no torch).

A device keeps some weights resident and streams the others; with prefetch
``p`` the copies of ``p + 1`` consecutive ops' streamed groups (a group: the
streamed weights one op reads) are alive at once. Brute force tries every
subset: it fits when resident + the largest such window <= capacity, and
costs the streamed bytes times the number of ops that read each.

What holds for every instance: a returned choice fits, its numbers are its
own, and None is returned whenever nothing fits. What does not: the
heuristic can miss a choice that fits (it then refuses a device that
streaming could serve) and can stream more than the optimum; the seeded
corpus below measures how often, and the two known counterexamples are
strict xfails, so that a better heuristic turns them into failures to
update.
"""

from __future__ import annotations

import itertools
import random
from typing import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from fxsplit.partition.streaming import MAX_CANDIDATES, StreamChoice, choose_streamed

Instance = tuple[dict[str, int], list[list[str]], int, int]


def groups_of(weights: dict[str, int], op_reads: Sequence[Sequence[str]]) -> list[set[str]]:
    """Each op's streamable weights, each once (names that are not weights are ignored)."""
    return [{w for w in op if w in weights} for op in op_reads]


def largest_group(weights: dict[str, int], groups: list[set[str]], streamed: set[str] | frozenset[str]) -> int:
    return max((sum(weights[w] for w in g & streamed) for g in groups), default=0)


def per_forward(weights: dict[str, int], groups: list[set[str]], streamed: set[str] | frozenset[str]) -> int:
    return sum(weights[w] * sum(w in g for g in groups) for w in streamed)


def window_peak(
    weights: dict[str, int], groups: list[set[str]], streamed: set[str] | frozenset[str], prefetch: int
) -> int:
    """The most streamed bytes alive at once: over every run of ``prefetch + 1`` consecutive ops."""
    sizes = [sum(weights[w] for w in g & streamed) for g in groups]
    return max((sum(sizes[max(0, i - prefetch) : i + 1]) for i in range(len(sizes))), default=0)


def fits(weights: dict[str, int], groups: list[set[str]], streamed: set[str], capacity: int, prefetch: int) -> bool:
    resident = sum(n for w, n in weights.items() if w not in streamed)
    return resident + window_peak(weights, groups, streamed, prefetch) <= capacity


def brute_force(weights: dict[str, int], op_reads: Sequence[Sequence[str]], capacity: int, prefetch: int) -> int | None:
    """The fewest bytes streamed per forward over every subset that fits, or None when none fits."""
    groups = groups_of(weights, op_reads)
    names = sorted(weights)
    best: int | None = None
    for size in range(len(names) + 1):
        for subset in itertools.combinations(names, size):
            streamed = set(subset)
            if fits(weights, groups, streamed, capacity, prefetch):
                cost = per_forward(weights, groups, streamed)
                best = cost if best is None else min(best, cost)
    return best


def assert_consistent(choice: StreamChoice, instance: Instance) -> None:
    """The choice fits ``capacity`` and its numbers are recomputed from its streamed set alone."""
    weights, op_reads, capacity, prefetch = instance
    groups = groups_of(weights, op_reads)
    assert choice.streamed <= set(weights)
    assert choice.resident_bytes == sum(n for w, n in weights.items() if w not in choice.streamed)
    assert choice.buffer_bytes == window_peak(weights, groups, choice.streamed, prefetch)
    assert choice.buffer_bytes <= (prefetch + 1) * largest_group(weights, groups, choice.streamed)
    assert choice.streamed_per_forward == per_forward(weights, groups, choice.streamed)
    assert choice.resident_bytes + choice.buffer_bytes <= capacity, choice


@st.composite
def instances(draw: st.DrawFn, *, singletons: bool = False) -> Instance:
    """Up to 7 weights (sizes often equal), up to 6 ops each reading up to 3 of them (or a name that
    is not a streamable weight, or one weight twice), a capacity around the total, prefetch 0-3."""
    n = draw(st.integers(1, 7))
    sizes = st.one_of(st.integers(1, 64), st.sampled_from([16, 32, 64]))
    weights = {f"w{i}": draw(sizes) for i in range(n)}
    names = st.sampled_from(sorted(weights))
    reads = st.lists(names, min_size=1, max_size=1) if singletons else st.lists(names | st.just("x"), max_size=3)
    op_reads = draw(st.lists(reads, min_size=1, max_size=6))
    total = sum(weights.values())
    capacity = draw(st.integers(0, total + 16))
    return weights, op_reads, capacity, draw(st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(instances())
def test_a_choice_fits_and_none_means_brute_force_finds_nothing_either(instance: Instance) -> None:
    choice = choose_streamed(*instance)
    optimum = brute_force(*instance)
    if choice is None:
        return  # sound; whether it is complete: test_complete_when_each_op_reads_one_weight and the corpus
    assert optimum is not None, "a choice that fits where brute force finds none"
    assert_consistent(choice, instance)
    assert choice.streamed_per_forward >= optimum


@settings(max_examples=150, deadline=None)
@given(instances())
def test_what_fits_whole_streams_nothing(instance: Instance) -> None:
    weights, op_reads, _, prefetch = instance
    total = sum(weights.values())
    assert choose_streamed(weights, op_reads, total, prefetch) == StreamChoice(frozenset(), total, 0, 0)


@settings(max_examples=300, deadline=None)
@given(instances(singletons=True))
def test_complete_when_each_op_reads_one_weight(instance: Instance) -> None:
    """With one weight per op the largest group is one weight's size, which is a candidate: then a
    choice is found whenever one exists."""
    choice = choose_streamed(*instance)
    optimum = brute_force(*instance)
    assert (choice is None) == (optimum is None), (choice, optimum)
    if choice is not None:
        assert_consistent(choice, instance)


def test_weights_no_op_reads_are_streamed_for_free_and_each_op_counts_a_weight_once() -> None:
    weights = {"read": 40, "idle": 40, "twice": 10}
    op_reads = [["read", "read"], ["twice", "x"], ["twice"]]
    choice = choose_streamed(weights, op_reads, capacity=85, prefetch=0)
    assert choice is not None
    assert_consistent(choice, (weights, op_reads, 85, 0))
    assert choice.streamed == {"idle"} and choice.streamed_per_forward == 0


def test_a_single_op_whose_weights_exceed_the_room_is_refused() -> None:
    assert choose_streamed({"a": 60, "b": 60}, [["a", "b"], ["a"]], capacity=100, prefetch=0) is None
    assert brute_force({"a": 60, "b": 60}, [["a", "b"], ["a"]], 100, 0) is None


def test_many_distinct_sizes_thin_the_candidates_but_the_choice_still_fits() -> None:
    rng = random.Random(3)
    weights = {f"w{i}": rng.randint(1, 10_000) for i in range(MAX_CANDIDATES * 2)}
    names = sorted(weights)
    op_reads = [rng.sample(names, rng.randint(1, 3)) for _ in range(600)]
    capacity = sum(weights.values()) // 3
    for prefetch in (0, 1, 2):
        choice = choose_streamed(weights, op_reads, capacity, prefetch)
        assert choice is not None
        assert_consistent(choice, (weights, op_reads, capacity, prefetch))


# ---- how good the heuristic is: measured on a seeded corpus, asserted as measured


def corpus(seed: int, count: int) -> list[Instance]:
    rng = random.Random(seed)
    found = []
    for _ in range(count):
        n = rng.randint(1, 7)
        weights = {f"w{i}": rng.randint(1, 50) for i in range(n)}
        op_reads = [rng.sample(sorted(weights), rng.randint(1, min(3, n))) for _ in range(rng.randint(1, 6))]
        found.append((weights, op_reads, rng.randint(0, sum(weights.values()) + 20), rng.randint(0, 2)))
    return found


def test_quality_on_a_seeded_corpus() -> None:
    """3000 random instances (1247 of which some choice fits): measured at the time of writing,
    1223 optimal (98.1%), the rest at worst 2.4 times the optimum's bytes, and none refused although a
    choice fits. The bounds below allow a little drift and fail on a real regression."""
    feasible = optimal = missed = 0
    worst = 1.0
    for instance in corpus(0, 3000):
        optimum = brute_force(*instance)
        choice = choose_streamed(*instance)
        if optimum is None:
            assert choice is None
            continue
        feasible += 1
        if choice is None:
            missed += 1
            continue
        assert_consistent(choice, instance)
        if choice.streamed_per_forward == optimum:
            optimal += 1
        else:
            worst = max(worst, choice.streamed_per_forward / max(1, optimum))
    assert feasible == 1247  # the corpus itself (brute force) has not changed
    assert optimal / feasible >= 0.975, (optimal, feasible)
    assert missed == 0, missed
    assert worst <= 2.5, worst


def test_a_once_missed_choice_is_found() -> None:
    """Streaming all but w6 fits (2 resident + the largest window); the first version of the heuristic
    kept w3 (46) resident for the op reading w3 and w6 (48 bytes) rather than w6 (2), and refused."""
    weights = {"w0": 7, "w1": 7, "w2": 45, "w3": 46, "w4": 17, "w5": 6, "w6": 2}
    op_reads = [["w5"], ["w3", "w6"], ["w4", "w6", "w5"], ["w0"], ["w6", "w2"]]
    assert fits(weights, groups_of(weights, op_reads), set(weights) - {"w6"}, 94, 1)
    assert choose_streamed(weights, op_reads, 94, 1) is not None


def test_a_once_wide_gap_to_the_optimum_is_closed() -> None:
    """Keeping w0 and w3 (read by four ops) resident and streaming w1, w2, w4 fits (32 + 35 = 67 <= 73)
    at 43 bytes per forward; the first version of the heuristic also streamed w3, 3.9 times as many bytes."""
    weights = {"w0": 1, "w1": 8, "w2": 15, "w3": 31, "w4": 35}
    op_reads = [["w4", "w0", "w3"], ["w0", "w3"], ["w0"], ["w1", "w3", "w0"], ["w3"]]
    assert brute_force(weights, op_reads, 73, 0) == 43
    choice = choose_streamed(weights, op_reads, 73, 0)
    assert choice is not None and choice.streamed_per_forward == 43, choice
