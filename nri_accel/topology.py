"""Topology-aware choice of devices: the one policy behind every count of devices.

Owns: which `count` devices to take from a free set, given each device's NUMA node and
direct links (NVLink, NeuronLink), and the bound on the work that choice may cost. The
Engine's count allocator (nri_accel.select) and the device plugin's
GetPreferredAllocation (nri_accel.deviceplugin.resources) both call choose(), so a
container gets the same devices whichever of the two decides. Imports only the
standard library and msgspec. Pure functions over integers: devices are positions (0..n-1, the
caller's inventory order), sets of devices and links are bit masks.

How (n devices, k = the devices still needed once `must` is counted, m = the free
devices of one NUMA node; see choose() for the order of preference):
- NUMA nodes too small are taken whole in one sorted pass, O(n log n).
- In a node that can hold k, the set is grown greedily from seed devices, each step
  adding the device with the most links into the set so far. Every device's count of
  links into the set is kept incrementally as a bit-sliced counter (one n-bit mask per
  binary digit), so a step costs O(log n) operations on n-bit integers whatever the link
  density, where a scan of the node cost O(m); the links broken come from per-device
  counts summed along the way, not from rescoring each set.
- Answered directly in O(m log m), without growing sets, where every seed provably
  leads to one of m known sets: k = 1, k = m, a node with no link inside it, and a node
  whose devices are all linked to each other (an NVSwitch fabric).
- Otherwise the greedy runs from every seed while m * (k - 1) steps fit in the budget
  (`budget`, BUDGET by default, split evenly between the nodes evaluated): the
  exhaustive search, identical results. Beyond it, from max(1, share // (k - 1)) seeds
  only, in this order: the lowest device of each class of devices alike (as many links
  inside the node, to `must` and nodes taken whole, and to the free devices), then the
  other devices not yet in a set grown, then the rest, each by position. On the regular
  fabrics checked (NVLink pairs, NVSwitch islands, NeuronLink rings, with holes) that
  still finds the exhaustive search's score; on irregular link graphs the set may have
  fewer links inside or more broken than the exhaustive search's, never an invalid one.
A call costs O(n log n), O(n) operations on n-bit integers, and at most budget + n
greedy steps; tests/bench/bench_topology.py prints the figures (a few milliseconds for
512 devices, any count).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from msgspec import Struct

# Greedy steps (one device added to a set grown from a seed) a choose() call may spend
# beyond one seed per node: exhaustive for every 8-GPU node and NeuronLink ring of 32,
# about 1 ms of CPython on 512 devices.
BUDGET = 1024


class Topology(Struct, frozen=True):
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
           must: Iterable[int] = (), *, budget: int = BUDGET) -> tuple[int, ...]:
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
    Sets are built greedily from seed devices of a node: each step adds the device with
    the most links into the set so far (the lowest position among equals). Every device
    of the node is a seed while the work fits in `budget` greedy steps; beyond it, a
    subset of seeds (see the module docstring), so the set may be a less linked one.

    When no single NUMA node has enough free devices the set spans nodes, as few as
    possible: whole nodes are taken, one at a time (a node `must` already uses first,
    then the node with the most free devices, then the lowest node number, unknown
    last), until the devices still needed fit in one node; those are then chosen as
    above, counting links to the devices already taken. Deterministic: the result does
    not depend on the order of `free` or `must`.
    """
    links = topology.links
    numa = topology.numa
    base = sorted(set(must))  # the set so far
    pool = sorted(set(free).difference(base))
    need = count - len(base)
    if need <= 0:
        return tuple(base)
    if need >= len(pool):
        return tuple(sorted(base + pool))
    taken = _mask(base)
    left = _mask(pool)  # the free devices not taken whole
    groups: dict[int | None, list[int]] = {}
    for p in pool:
        groups.setdefault(numa[p], []).append(p)
    spanned = set(map(numa.__getitem__, base))
    if max(map(len, groups.values())) < need:
        # Whole nodes go in this order; taking one changes no other's place in it.
        order = sorted(groups, key=lambda n: (n not in spanned, -len(groups[n]), n is None,
                                              n or 0))
        largest = [len(groups[n]) for n in order]  # then: the largest from there on
        for i in range(len(order) - 2, -1, -1):
            largest[i] = max(largest[i], largest[i + 1])
        for n, most in zip(order, largest, strict=True):
            if most >= need:
                break
            members = groups.pop(n)
            base += members
            mask = _mask(members)
            taken |= mask
            left ^= mask
            need -= len(members)
    fits = [n for n, members in groups.items() if len(members) >= need]
    if not spanned.isdisjoint(fits):  # a node `must` uses comes first (criterion 1)
        fits = [n for n in fits if n in spanned]
    share = budget // len(fits)  # the nodes evaluated share the budget
    best_key: tuple[int, ...] = ()
    best = 0
    for n in fits:
        members = groups[n]
        inside, broken, chosen = _best_in_node(links, members, _mask(members), need, taken,
                                               left, share)
        key = (n not in spanned, -inside, broken, len(members))
        if not best_key or key < best_key or (key == best_key and _lower(chosen, best)):
            best_key, best = key, chosen
    while best:
        low = best & -best
        base.append(low.bit_length() - 1)
        best ^= low
    return tuple(sorted(base))


def _mask(positions: Iterable[int]) -> int:
    """The bit mask of a set of positions."""
    mask = 0
    for p in positions:
        mask |= 1 << p
    return mask


def _lower(a: int, b: int) -> bool:
    """Whether the set `a` lists lower positions than `b` (as ascending tuples; both the
    same size): the lowest position in one and not the other is in `a`."""
    diff = a ^ b
    return bool(a & diff & -diff)


def _best_in_node(links: tuple[int, ...], members: list[int], mask: int, need: int,
                  taken: int, left: int, budget: int) -> tuple[int, int, int]:
    """The best `need` of `members` (ascending; `mask` theirs) to add to the set `taken`,
    as (links inside, links broken, bit mask of the devices), in at most max(budget,
    need - 1) greedy steps. Links among `taken` alone are the same for every candidate
    and left out; so are the links from `taken` to the free devices `left` (broken is
    that constant short of the true count, the same for every node of one call)."""
    # Per device: links to `taken` (they count inside whatever else is chosen) and the
    # weight that gives the links broken: broken = sum(weight) - 2 * inside + constant,
    # since broken = links(set, left - set) + links(taken, left - set).
    to_taken: dict[int, int] = {}
    weight: dict[int, int] = {}
    linked = 0  # the members linked to another member
    clique = True  # every member linked to every other
    for p in members:
        lp = links[p]
        g = (lp & taken).bit_count()
        to_taken[p] = g
        weight[p] = (lp & left).bit_count() + g
        inner = lp & mask
        linked |= inner
        if clique and inner | 1 << p != mask:
            clique = False
    if need == 1 or need == len(members) or not linked or clique:
        # Most links to `taken` first, then by position (sorted() is stable).
        ranked = sorted(members, key=to_taken.__getitem__, reverse=True) if taken else members
        return _direct_answer(links, ranked, need, to_taken, weight)
    planes: list[int] = []  # the links to `taken`, bit-sliced: bit i of each in planes[i]
    for p, g in to_taken.items() if taken else ():
        for i in range(g.bit_length()):
            if g >> i & 1:
                planes.extend([0] * (i + 1 - len(planes)))
                planes[i] |= 1 << p
    limit = max(budget // (need - 1), 1)
    firsts, others = (members, []) if limit >= len(members) else _alike(
        links, members, mask, to_taken, weight)
    return _search(links, firsts, others, need, mask, planes, to_taken, weight, limit)


def _direct_answer(links: tuple[int, ...], ranked: list[int], need: int,
                   to_taken: dict[int, int], weight: dict[int, int]) -> tuple[int, int, int]:
    """_best_in_node where every greedy run leads to one of a few known sets: one
    device, the whole node, no link inside the node, or every device linked to every
    other. The links inside a growing set are then the same for every candidate, so
    each step takes the device with the most links to `taken`, the lowest among equals
    (the order of `ranked`): from seed s the run takes {s} plus the first need-1 of the
    others. With A the first need-1 overall, that is A plus one device x outside A;
    the best x has the most links to `taken`, then the fewest to `left`, then the
    lowest position."""
    x = ranked[need - 1]
    for i in range(need, len(ranked)):
        p = ranked[i]
        if to_taken[p] < to_taken[x]:
            break
        if weight[p] < weight[x]:
            x = p
    picked = ranked[:need - 1]
    picked.append(x)
    chosen = 0
    for p in picked:
        chosen |= 1 << p
    twice = inside = total = 0
    for p in picked:
        twice += (links[p] & chosen).bit_count()
        inside += to_taken[p]
        total += weight[p]
    inside += twice // 2
    return inside, total - 2 * inside, chosen


def _alike(links: tuple[int, ...], members: list[int], mask: int,
           to_taken: dict[int, int], weight: dict[int, int]) -> tuple[list[int], list[int]]:
    """The members split into the lowest of each class of members alike (as many links
    inside the node, to `taken` and to `left`) and the others, each by position."""
    seen: set[tuple[int, int, int]] = set()
    firsts: list[int] = []
    others: list[int] = []
    for p in members:
        alike = ((links[p] & mask).bit_count(), to_taken[p], weight[p])
        if alike in seen:
            others.append(p)
        else:
            seen.add(alike)
            firsts.append(p)
    return firsts, others


def _search(links: tuple[int, ...], firsts: list[int], others: list[int], need: int,
            mask: int, planes: list[int], to_taken: dict[int, int], weight: dict[int, int],
            limit: int) -> tuple[int, int, int]:
    """The best of the sets grown greedily from up to `limit` seeds, as (links inside,
    links broken, mask): the seeds `firsts`, then those of `others` not in a set grown
    so far (a seed inside one tends to grow that set again), then the rest. A set is
    grown over the devices `mask`, each step adding the device with the most links into
    the set, the lowest among equals. `planes` holds every device's count of links into
    the set as a bit-sliced counter (bit i of each count in planes[i], starting from the
    links to `taken`): a step finds the highest count plane by plane, then adds one to
    the neighbours of the device added with a ripple carry, O(log n) big-integer
    operations whatever the link density."""
    most = broken = best = 0
    grown = 0  # the devices of every set grown so far
    later: list[int] = []
    for phase, seeds in enumerate((firsts, others, later)):
        for seed in seeds:
            if phase == 1 and grown >> seed & 1:
                later.append(seed)
                continue
            counts = planes.copy()
            chosen = 1 << seed
            avail = mask ^ chosen
            inside = to_taken[seed]
            total = weight[seed]
            p = seed
            for _ in range(need - 1):
                carry = links[p] & avail
                i = 0
                while carry:
                    if i == len(counts):
                        counts.append(carry)
                        break
                    plane = counts[i]
                    counts[i] = plane ^ carry
                    carry &= plane
                    i += 1
                cand = avail
                gain = 0
                for i in range(len(counts) - 1, -1, -1):
                    top = cand & counts[i]
                    if top:
                        cand = top
                        gain |= 1 << i
                low = cand & -cand
                p = low.bit_length() - 1
                chosen |= low
                avail ^= low
                inside += gain
                total += weight[p]
            grown |= chosen
            lost = total - 2 * inside
            if (not best or inside > most
                    or (inside == most and (lost < broken
                                            or (lost == broken and _lower(chosen, best))))):
                most, broken, best = inside, lost, chosen
            limit -= 1
            if not limit:
                return most, broken, best
    return most, broken, best
