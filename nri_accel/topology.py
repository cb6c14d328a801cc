"""Topology-aware choice of devices: the one policy behind every count of devices.

Owns: which `count` devices to take from a free set, given each device's NUMA node and
direct links (NVLink, NeuronLink). The Engine's count allocator (nri_accel.select) and
the device plugin's GetPreferredAllocation (nri_accel.deviceplugin.resources) both call
choose(), so a container gets the same devices whichever of the two decides. Imports
only the standard library. Pure functions over integers: devices are positions
(0..n-1, the caller's inventory order), sets of devices and links are bit masks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Topology:
    """The facts choose() weighs, per position: `numa`, the device's NUMA node (None:
    unknown; those devices form one group of their own), and `links`, the bit mask of
    the positions it is directly linked to (symmetric, never itself)."""

    numa: tuple[int | None, ...]
    links: tuple[int, ...]

    @classmethod
    def build(cls, numa: Sequence[int | None],
              peers: Sequence[Iterable[int]]) -> Topology:
        """A Topology from each position's NUMA node and linked positions. A link named
        by either end counts for both; a link to itself is dropped."""
        masks = [0] * len(numa)
        for i, linked in enumerate(peers):
            for j in linked:
                if j != i:
                    masks[i] |= 1 << j
                    masks[j] |= 1 << i
        return cls(tuple(numa), tuple(masks))


def choose(topology: Topology, free: Iterable[int], count: int,
           must: Iterable[int] = ()) -> tuple[int, ...]:
    """The positions, ascending, of the best `count` devices: all of `must` (taken
    whatever else holds) plus the best of `free`. With fewer devices free than needed,
    every free one; with `must` alone reaching `count`, `must` (even if larger).

    The order of preference, each criterion breaking the ties of the one before:
    1. the fewest NUMA nodes: the devices added come from one node, a node `must`
       already uses before any other;
    2. the most direct links inside the whole set (`must` included);
    3. the fewest links broken between the set and the free devices left out (linked
       groups stay whole for later requests: one device comes from an unlinked GPU
       rather than from an NVLink pair);
    4. the node with the fewest free devices (best fit, keeping larger nodes whole);
    5. the lowest positions.
    Sets are built greedily from every seed device of a node: each step adds the device
    with the most links into the set so far (the lowest position among equals).

    When no single NUMA node has enough free devices the set spans nodes, as few as
    possible: whole nodes are taken, one at a time (a node `must` already uses first,
    then the node with the most free devices, then the lowest node number, unknown
    last), until the devices still needed fit in one node; those are then chosen as
    above, counting links to the devices already taken. Deterministic: the result does
    not depend on the order of `free` or `must`.
    """
    links = topology.links
    numa = topology.numa
    base = sorted(set(must)) if must else []  # the set so far, ascending
    pool = sorted(set(free).difference(base) if base else set(free))
    need = count - len(base)
    if need <= 0:
        return tuple(base)
    if need >= len(pool):
        return tuple(sorted(base + pool))
    taken = 0
    for p in base:
        taken |= 1 << p
    free_mask = taken
    groups: dict[int | None, list[int]] = {}
    for p in pool:
        free_mask |= 1 << p
        groups.setdefault(numa[p], []).append(p)
    spanned = {numa[p] for p in base}
    while True:
        best: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        for node, members in groups.items():
            if len(members) < need:
                continue
            (fewer_links, broken), picked = _best_linked(links, members, need, base, taken,
                                                         free_mask)
            key = (node not in spanned, fewer_links, broken, len(members), *picked)
            if best is None or key < best[0]:
                best = (key, picked)
        if best is not None:
            return tuple(sorted(base + list(best[1]))) if base else best[1]
        node = min(groups, key=lambda n: (n not in spanned, -len(groups[n]), n is None, n or 0))
        members = groups.pop(node)
        for p in members:
            taken |= 1 << p
        base = sorted(base + members)
        need -= len(members)
        spanned.add(node)


def _best_linked(links: tuple[int, ...], members: list[int], need: int, base: list[int],
                 taken: int, free_mask: int) -> tuple[tuple[int, int], tuple[int, ...]]:
    """The best `need` of `members` (ascending) to add to the set `base` (its mask:
    `taken`): greedy from every seed, each step adding the member with the most links
    into the set so far, the lowest position among equals. Returns ((-links inside, free
    links broken), positions ascending) of the best, the lowest positions among equals.
    Links among `base` alone are the same for every candidate and left out of the count;
    links from `base` to free devices left out count as broken."""
    best: tuple[tuple[int, ...], tuple[int, int], tuple[int, ...]] | None = None
    for seed in members:
        chosen = [seed]
        mask = taken | 1 << seed
        inside = (links[seed] & taken).bit_count() if taken else 0
        while len(chosen) < need:
            pick, most = -1, -1
            for p in members:
                if not mask >> p & 1:
                    n = (links[p] & mask).bit_count()
                    if n > most:
                        pick, most = p, n
            chosen.append(pick)
            mask |= 1 << pick
            inside += most
        outside = free_mask & ~mask
        broken = 0
        for p in chosen:
            broken += (links[p] & outside).bit_count()
        if base:
            for p in base:
                broken += (links[p] & outside).bit_count()
        chosen.sort()
        key = (-inside, broken, *chosen)
        if best is None or key < best[0]:
            best = (key, (-inside, broken), tuple(chosen))
    assert best is not None
    return best[1], best[2]

