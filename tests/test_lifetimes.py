"""Activation memory from value lifetimes (fxsplit.memory.lifetimes), on hand-made profiles (no torch).

The rules of the module docstring, one at a time, with the bytes worked out by hand. The bound of
planning_loads over random chains and the lifetime of copies are in test_memory.py.
"""

from __future__ import annotations

from fxsplit.memory.lifetimes import ActivationProfile, Simulated, ValueMemory, simulate
from fxsplit.memory.planloads import planning_loads


def test_a_view_shares_its_base_storage() -> None:
    profile = ActivationProfile(
        op_names=("a", "v", "b"),
        reads=(("x",), ("a",), ("v",)),
        values={
            "x": ValueMemory(8, (0,)),
            "a": ValueMemory(16, (1,)),
            "v": ValueMemory(16, (1,)),  # a view of a: the same storage
            "b": ValueMemory(16, (2,)),
        },
        storage_bytes={0: 8, 1: 16, 2: 16},
        inputs=("x",),
        outputs=("b",),
    )
    # x (8) while a runs: 24; a's storage lives through b (read through its view): 16 + 16 = 32, not 48
    assert simulate(profile, ["d"] * 3, {"x": "d"}, "d").forward == {"d": 32}
    assert planning_loads(profile) == ((0, 0, 0), (24, 16, 32))


def weight_profile(input_bytes: int = 8) -> ActivationProfile:
    return ActivationProfile(
        op_names=("a", "b"),
        reads=(("x", "w"), ("a", "w")),
        values={
            "x": ValueMemory(input_bytes, (0,)),
            "w": ValueMemory(100, (5,)),
            "a": ValueMemory(16, (1,)),
            "b": ValueMemory(16, (2,)),
        },
        storage_bytes={0: input_bytes, 1: 16, 2: 16, 5: 100},
        inputs=("x",),
        outputs=("b",),
        weights=frozenset({"w"}),
    )


def test_a_weight_costs_nothing_at_home_and_its_copy_is_an_activation_elsewhere() -> None:
    profile = weight_profile()
    at_home = simulate(profile, ["d0", "d0"], {"x": "d0"}, "d0", {"w": "d0"})
    assert at_home.forward == {"d0": 16 + 16}  # a and b (x is gone by then): the weight counts as a weight
    split = simulate(profile, ["d0", "d1"], {"x": "d0"}, "d1", {"w": "d0"})
    # d1: the copies of w (100) and a (16) and b (16) while b runs
    assert split.forward == {"d0": 8 + 16, "d1": 100 + 16 + 16}
    assert split.backward == {} and split.peak == split.forward  # inference: no backward


def test_an_input_is_copied_from_its_home_to_where_it_is_read() -> None:
    profile = weight_profile(input_bytes=200)
    sim = simulate(profile, ["d0", "d1"], {"x": "d1"}, "d1", {"w": "d0"})
    # x arrives on d1 (200) and is copied to d0 for a (200 + a's 16); d1 later holds w, a and b (132)
    assert sim.forward == {"d0": 200 + 16, "d1": 200}
    assert simulate(profile, ["d0", "d1"], {"x": "d0"}, "d1", {"w": "d0"}).forward == {"d0": 216, "d1": 132}


def test_an_output_is_held_by_the_caller_to_the_end() -> None:
    chain = {
        "x": ValueMemory(8, (0,)),
        "a": ValueMemory(16, (1,)),
        "b": ValueMemory(16, (2,)),
        "c": ValueMemory(16, (3,)),
    }
    reads = (("x",), ("a",), ("b",))

    def profile(outputs: tuple[str, ...]) -> ActivationProfile:
        return ActivationProfile(("a", "b", "c"), reads, chain, {0: 8, 1: 16, 2: 16, 3: 16}, ("x",), outputs)

    assert simulate(profile(("c",)), ["d"] * 3, {"x": "d"}, "d").forward == {"d": 32}
    assert simulate(profile(("a", "c")), ["d"] * 3, {"x": "d"}, "d").forward == {"d": 48}  # a, b and c at c
    # an output made on another device is copied to the output device and held there
    assert simulate(profile(("c",)), ["d", "d", "e"], {"x": "d"}, "o").forward == {"d": 32, "e": 32, "o": 16}


def test_internal_bytes_count_while_the_op_runs() -> None:
    profile = ActivationProfile(
        ("a", "b"),
        (("x",), ("a",)),
        {"x": ValueMemory(8, (0,)), "a": ValueMemory(16, (1,)), "b": ValueMemory(16, (2,))},
        {0: 8, 1: 16, 2: 16},
        ("x",),
        ("b",),
        internal=(0, 100),  # b allocates 100 bytes of intermediates inside
    )
    assert simulate(profile, ["d", "d"], {"x": "d"}, "d").forward == {"d": 16 + 16 + 100}
    assert planning_loads(profile)[1] == (24, 132)


def test_training_keeps_saved_storages_to_their_backward_and_adds_gradients() -> None:
    profile = ActivationProfile(
        op_names=("a", "b"),
        reads=(("x",), ("a",)),
        values={
            "x": ValueMemory(8, (0,)),
            "a": ValueMemory(16, (1,), requires_grad=True),
            "b": ValueMemory(16, (2,), requires_grad=True),
        },
        storage_bytes={0: 8, 1: 16, 2: 16},
        inputs=("x",),
        outputs=("b",),
        saved=((0,), (1,)),  # a saves x, b saves a
        training=True,
    )
    sim = simulate(profile, ["d", "d"], {"x": "d"}, "d")
    assert isinstance(sim, Simulated)
    assert sim.saved == {"d": 8 + 16}
    assert sim.forward == {"d": 8 + 16 + 16}  # x and a stay for backward while b is made
    # backward: b (held by the caller) and its gradient (the caller's loss gives it), x and a (saved), and a's
    # gradient from b back to a
    assert sim.backward == {"d": 16 + 16 + 8 + 16 + 16}
    assert sim.peak == {"d": 72}
    extra, transient = planning_loads(profile)
    assert extra == (8, 16 + 16)  # what each op is first to save, or returns
    assert sum(extra) + max(transient) >= sim.peak["d"]
