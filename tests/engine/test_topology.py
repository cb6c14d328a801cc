"""topology.choose: the one count policy the Engine and GetPreferredAllocation share."""

from __future__ import annotations

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
