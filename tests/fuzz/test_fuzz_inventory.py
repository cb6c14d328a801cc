"""Fuzz target: the saved-inventory loader (Inventory.from_json / from_dict), what
`--inventory FILE` and the demo read.

Inputs: arbitrary text; arbitrary JSON values; the demo node's inventory with one value
somewhere in it replaced by a value of any type, a key removed or an unknown key added;
and JSON documents deeply nested or holding huge numbers.

Properties:
- loading returns an Inventory or raises InventoryError, whose text starts with its
  source (the origin given); nothing else comes out;
- an inventory that loads writes out (to_json) to text that loads to the same inventory.
"""

from __future__ import annotations

import json
from typing import Any

from demo_node import demo_inventory
from fuzz_inputs import json_paths
from hypothesis import given
from hypothesis import strategies as st

from nri_accel.errors import InventoryError
from nri_accel.inventory import Inventory

ORIGIN = "fuzz.json"

scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                   st.floats(allow_nan=False), st.text(max_size=12),
                   st.sampled_from(("1" * 5000, "x" * 5000, "", "nvidia", "0")))
json_value = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12)


def load(text: str) -> Inventory | None:
    try:
        inv = Inventory.from_json(text, origin=ORIGIN)
    except InventoryError as err:
        assert err.source == ORIGIN or err.source.startswith(ORIGIN + ".")
        assert str(err).startswith(err.source + ": ")
        return None
    assert Inventory.from_json(inv.to_json()) == inv
    return inv


@given(st.text(max_size=200))
def test_arbitrary_text(text: str) -> None:
    load(text)


@given(json_value)
def test_arbitrary_json(value: Any) -> None:
    load(json.dumps(value))
    load(json.dumps({"schema_version": 1, "devices": value}))
    load(json.dumps({"schema_version": 1, "drivers": [{"vendor": "x", "capabilities": value}],
                     "devices": [{"kind": "a/b", "name": "0", "edits": value}]}))


DEMO = demo_inventory().to_dict()
DEMO_PATHS = json_paths(DEMO)


@st.composite
def mutated_demo(draw: st.DrawFn) -> dict[str, Any]:
    doc = json.loads(json.dumps(DEMO))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(DEMO_PATHS))
        parent: Any = doc
        try:
            for step in path[:-1]:
                parent = parent[step]
            if not path:
                return draw(json_value)
            how = draw(st.sampled_from(("replace", "replace", "delete", "add")))
            if how == "replace":
                parent[path[-1]] = draw(json_value)
            elif how == "delete":
                del parent[path[-1]]
            elif isinstance(parent[path[-1]], dict):
                parent[path[-1]][draw(st.text(max_size=8))] = draw(json_value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation removed or replaced the path
    return doc


@given(mutated_demo())
def test_mutated_demo(doc: Any) -> None:
    load(json.dumps(doc))


@given(st.integers(1, 200_000), st.sampled_from(("[", '{"a":', '{"schema_version": 1, '
                                                 '"devices": [')))
def test_deep_documents(depth: int, opener: str) -> None:
    load(opener * depth)
    load(opener * depth + "1" + ("]" if opener == "[" else "}") * depth)


@given(st.integers(4000, 20_000), st.sampled_from(("number", "name", "index")))
def test_huge_numbers(digits: int, where: str) -> None:
    n = "7" * digits
    doc = {"number": n, "name": f'{{"schema_version": 1, "devices": [{{"kind": "a/b", '
                                 f'"name": "{n}"}}]}}',
           "index": f'{{"schema_version": 1, "devices": [{{"kind": "a/b", "name": "0", '
                    f'"numa_node": {n}}}]}}'}[where]
    load(doc)
