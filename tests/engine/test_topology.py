"""topology.choose: the one count policy the Engine and GetPreferredAllocation share."""

from __future__ import annotations

import random

import pytest

from nri_accel.topology import Topology, choose

# NUMA 0: 0-1 linked, 2 alone; NUMA 1: 3-4-5 all linked; 6 and 7: NUMA unknown, linked.
TOPO = Topology.build(
    [0, 0, 0, 1, 1, 1, None, None],
    [[1], [], [], [4, 5], [5], [], [7], []],
)
ALL = range(8)


def test_build_makes_links_symmetric_and_drops_self_links() -> None:
    topo = Topology.build([0, 0, 0], [[1, 0], [], [2]])
    assert topo.links == (0b010, 0b001, 0)


@pytest.mark.parametrize(("free", "count", "must", "want"), [
    # One device: the one that breaks no free link (2), not one of a pair.
    (ALL, 1, (), (2,)),
    # A linked pair on one node: 0-1 breaks no link, a pair of NUMA 1 breaks two.
    ((0, 1, 2, 3, 4, 5), 2, (), (0, 1)),
    # Devices of unknown NUMA node are a group like any other: 6-7 is the best fit.
    (ALL, 2, (), (6, 7)),
    # Links first: the triangle on NUMA 1 rather than 0-1 plus 2.
    (ALL, 3, (), (3, 4, 5)),
    # Must-include pulls the rest to its node.
    (ALL, 2, (4,), (3, 4)),
    # No node fits four: NUMA 0 taken whole (largest, lowest), one more from NUMA 1.
    ((0, 1, 2, 3, 4, 5), 4, (), (0, 1, 2, 3)),
    # The node must-include already uses is taken whole before larger ones (two nodes
    # spanned, not three), then the best of the rest: the triangle.
    (ALL, 5, (6,), (3, 4, 5, 6, 7)),
    # Unknown NUMA comes last among equal sizes.
    ((0, 1, 6, 7, 3, 4), 5, (), (0, 1, 3, 4, 6)),
    # Fewer free than asked: all of them; must alone enough: must, even if larger.
    ((2, 5), 3, (), (2, 5)),
    (ALL, 1, (7, 0), (0, 7)),
])
def test_choose(free, count, must, want) -> None:
    assert choose(TOPO, free, count, must) == want


def test_choose_ignores_input_order_and_duplicates() -> None:
    first = choose(TOPO, [7, 6, 5, 4, 3, 2, 1, 0], 3, [5])
    assert first == choose(TOPO, [0, 0, 1, 2, 3, 4, 5, 6, 7], 3, [5, 5])


# ---- properties over random topologies ---------------------------------------------


def exhaustive(topology: Topology, free, count, must=()) -> tuple[int, ...]:
    """The reference: choose() as it was before its work was bounded (issue #10), the
    greedy from every seed of every node, scanning the node at each step: O(m^2 k)."""
    links, numa = topology.links, topology.numa
    base = sorted(set(must))
    pool = sorted(set(free).difference(base))
    need = count - len(base)
    if need <= 0:
        return tuple(base)
    if need >= len(pool):
        return tuple(sorted(base + pool))
    taken = sum(1 << p for p in base)
    free_mask = taken | sum(1 << p for p in pool)
    groups: dict = {}
    for p in pool:
        groups.setdefault(numa[p], []).append(p)
    spanned = {numa[p] for p in base}
    while True:
        best = None
        for node, members in groups.items():
            if len(members) < need:
                continue
            for seed in members:
                chosen, mask = [seed], taken | 1 << seed
                inside = (links[seed] & taken).bit_count()
                while len(chosen) < need:
                    pick, most = -1, -1
                    for p in members:
                        if not mask >> p & 1 and (links[p] & mask).bit_count() > most:
                            pick, most = p, (links[p] & mask).bit_count()
                    chosen.append(pick)
                    mask |= 1 << pick
                    inside += most
                outside = free_mask & ~mask
                broken = sum((links[p] & outside).bit_count() for p in chosen + base)
                key = (node not in spanned, -inside, broken, len(members), *sorted(chosen))
                if best is None or key < best[0]:
                    best = (key, sorted(chosen))
        if best is not None:
            return tuple(sorted(base + best[1]))
        node = min(groups, key=lambda n: (n not in spanned, -len(groups[n]), n is None, n or 0))
        members = groups.pop(node)
        taken |= sum(1 << p for p in members)
        base = sorted(base + members)
        need -= len(members)
        spanned.add(node)


def score(topology: Topology, chosen, free, must) -> tuple[int, int, int]:
    """(NUMA nodes spanned, -links inside, links broken to the free devices left out):
    lower is better, the first three criteria of choose()."""
    inside_mask = sum(1 << p for p in chosen)
    left = sum(1 << p for p in set(free) | set(must)) & ~inside_mask
    links = topology.links
    inside = sum((links[p] & inside_mask).bit_count() for p in chosen) // 2
    broken = sum((links[p] & left).bit_count() for p in chosen)
    return len({topology.numa[p] for p in chosen}), -inside, broken


SHAPES = ("none", "pairs", "ring", "mesh", "islands", "random")


def fabric(shape: str, n: int, nodes: int, rng: random.Random) -> Topology:
    """n devices in `nodes` NUMA nodes of consecutive positions (0: NUMA unknown, and a
    few devices of unknown NUMA with more nodes), linked as `shape` says."""
    numa = [i * nodes // n if nodes else None for i in range(n)]
    if nodes > 1:
        for i in rng.sample(range(n), n // 8):
            numa[i] = None
    if shape == "pairs":
        peers = [[i ^ 1] if i ^ 1 < n else [] for i in range(n)]
    elif shape == "ring":
        peers = [[(i + 1) % n] for i in range(n)]
    elif shape == "mesh":
        peers = [list(range(n))] * n
    elif shape == "islands":
        size = rng.choice((2, 4, 8))
        peers = [list(range(i - i % size, min(i - i % size + size, n))) for i in range(n)]
    elif shape == "random":
        density = rng.random()
        peers = [[j for j in range(i) if rng.random() < density] for i in range(n)]
    else:
        peers = [[] for _ in range(n)]
    return Topology.build(numa, peers)


def case(seed: int, low: int, high: int, shapes=SHAPES):
    """A random topology, free set (about 3/4 of the devices), must set and count."""
    rng = random.Random(seed)
    n = rng.randint(low, high)
    topology = fabric(rng.choice(shapes), n, rng.choice((0, 1, 1, 2, 3, 4)), rng)
    free = [p for p in range(n) if rng.random() < 0.75]
    must = [p for p in range(n) if p not in free and rng.random() < 0.2]
    return topology, free, rng.randint(0, n + 1), must, rng


def assert_valid(topology, free, count, must, got) -> None:
    wanted = set(free) | set(must)
    assert list(got) == sorted(set(got))
    assert set(must) <= set(got) <= wanted
    if len(set(must)) >= count:
        assert set(got) == set(must)
    else:
        assert len(got) == min(count, len(wanted))


@pytest.mark.parametrize("seed", range(300))
def test_small_inputs_choose_as_the_exhaustive_greedy(seed) -> None:
    topology, free, count, must, rng = case(seed, 1, 12)
    got = choose(topology, free, count, must)
    assert_valid(topology, free, count, must, got)
    assert got == exhaustive(topology, free, count, must)
    # Input order and duplicates change nothing.
    shuffled = free + free[:2]
    rng.shuffle(shuffled)
    assert choose(topology, shuffled, count, list(reversed(must))) == got


# NVLink of a DGX-1 (V100): two fully linked quads, each GPU linked to its twin.
CUBE_MESH = [[1, 2, 3, 4], [0, 2, 3, 5], [0, 1, 3, 6], [0, 1, 2, 7],
             [0, 5, 6, 7], [1, 4, 6, 7], [2, 4, 5, 7], [3, 4, 5, 6]]


@pytest.mark.parametrize("topology", [
    Topology.build([0] * 4 + [1] * 4, CUBE_MESH),
    Topology.build([0] * 4 + [1] * 4, [range(8)] * 8),  # NVSwitch
    Topology.build([0] * 4 + [1] * 4, [[i ^ 1] for i in range(8)]),  # NVLink bridges
    Topology.build([0] * 16, [[(i + 1) % 16] for i in range(16)]),  # trn1 NeuronLink
    Topology.build([0] * 32, [[(i + 1) % 32] for i in range(32)]),
], ids=["dgx1-cube-mesh", "nvswitch-8", "nvlink-pairs-8", "neuron-ring-16", "neuron-ring-32"])
def test_real_nodes_choose_as_the_exhaustive_greedy(topology) -> None:
    n = len(topology.numa)
    rng = random.Random(n)
    holes = sorted(rng.sample(range(n), n * 3 // 4))
    for free, must in ((range(n), ()), (holes, ()), (holes[1:], holes[:1])):
        for count in range(1, n + 1):
            assert choose(topology, free, count, must) == exhaustive(topology, free, count, must)


@pytest.mark.parametrize("seed", range(40))
def test_within_the_budget_larger_inputs_choose_as_the_exhaustive_greedy(seed) -> None:
    topology, free, count, must, _ = case(1000 + seed, 13, 40)
    assert choose(topology, free, count, must, budget=10**9) == exhaustive(
        topology, free, count, must)


@pytest.mark.parametrize("seed", range(30))
def test_over_the_budget_regular_fabrics_score_as_the_exhaustive_greedy(seed) -> None:
    # 48 to 80 devices, one or two NUMA nodes: m * (k - 1) is mostly beyond BUDGET.
    rng = random.Random(2000 + seed)
    n = rng.randint(48, 80)
    topology = fabric(rng.choice(("pairs", "ring", "islands")), n, rng.choice((1, 2)), rng)
    free = [p for p in range(n) if rng.random() < 0.85]
    must = [p for p in range(n) if p not in free and rng.random() < 0.2]
    count = rng.randint(n // 4, n - n // 4)
    got = choose(topology, free, count, must)
    assert_valid(topology, free, count, must, got)
    assert score(topology, got, free, must) == score(
        topology, exhaustive(topology, free, count, must), free, must)


@pytest.mark.parametrize("seed", range(30))
def test_any_budget_gives_a_valid_set(seed) -> None:
    topology, free, count, must, _ = case(3000 + seed, 20, 80)
    for budget in (0, 50):
        got = choose(topology, free, count, must, budget=budget)
        assert_valid(topology, free, count, must, got)
        assert score(topology, got, free, must)[0] == score(
            topology, exhaustive(topology, free, count, must), free, must)[0]


LARGE = 512


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("count", [1, 7, 64, 255, 256, 511])
def test_large_inventories(shape, count) -> None:
    rng = random.Random(count)
    topology = fabric(shape, LARGE, 1, rng)
    got = choose(topology, range(LARGE), count)
    assert_valid(topology, range(LARGE), count, (), got)
    _, inside, broken = score(topology, got, range(LARGE), ())
    if shape in ("none", "mesh"):  # every set alike: the lowest positions
        assert got == tuple(range(count))
    elif shape == "pairs":  # whole pairs, one broken when the count is odd
        assert (-inside, broken) == (count // 2, count % 2)
    elif shape == "ring":  # one arc of the ring
        assert (-inside, broken) == (count - 1, 2)
    # Split over NUMA nodes, the set stays in one node while one can hold it.
    split = fabric(shape, LARGE, 4, rng)
    got = choose(split, range(LARGE), count)
    assert_valid(split, range(LARGE), count, (), got)
    largest = max(split.numa.count(n) for n in set(split.numa))
    assert len({split.numa[p] for p in got}) == 1 or count > largest
