"""The Engine's bounds: Engine.plan refuses, before any work, an env with more than
request.MAX_ENV_ENTRIES entries of the variables it looks at (ENV_SCOPE: those the
request parser reads and those the edits rewrite); a grant annotation of more than
_MAX_RESTORED_KEYS items is skipped unread; restore_slices() hands grants_in() a
bounded number of containers and grant keys at a time."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from engine_testing import container, demo_inventory, standalone

from nri_accel import edits as edits_module
from nri_accel import engine as engine_module
from nri_accel.engine import RESTORE_KEYS, Engine, restore_slices
from nri_accel.errors import RequestError
from nri_accel.request import ANNOTATION_GRANTED, ANNOTATION_SHARED, MAX_ENV_ENTRIES
from nri_accel.syntax import MAX_NAME_CHARS

GPU = {"devices.nri-accel.io": "nvidia.com/gpu=0"}


@pytest.fixture
def engine() -> Engine:
    return Engine(demo_inventory(), standalone())


def library_paths(n: int) -> tuple[str, ...]:
    return tuple(f"LD_LIBRARY_PATH=/opt/lib{i}" for i in range(n))


def test_env_the_edits_read_at_the_limit_is_served(engine: Engine) -> None:
    requirements = (f"NVIDIA_REQUIRE_T{i}=cuda>=1.0" for i in range(MAX_ENV_ENTRIES - 1))
    plan = engine.plan(container(annotations=GPU,
                                 env=("LD_LIBRARY_PATH=/opt/lib", *requirements)))
    (path,) = (kv for kv in plan.edits.env if kv.startswith("LD_LIBRARY_PATH="))
    assert path.startswith("LD_LIBRARY_PATH=/opt/lib:")


def test_env_at_the_limit_defining_a_variable_the_edits_rewrite_twice_is_refused(
        engine: Engine) -> None:
    # read, then refused: the runtime would apply the rewrite to the first definition only
    with pytest.raises(RequestError) as err:
        engine.plan(container(annotations=GPU, env=library_paths(MAX_ENV_ENTRIES)))
    assert err.value.source == "env LD_LIBRARY_PATH"
    assert "defined more than once" in err.value.message


def test_env_the_edits_read_past_the_limit_is_refused_before_they_read_it(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(edits_module, "_own_env", lambda *a: calls.append(a) or {})
    env = ("PATH=/bin", *library_paths(MAX_ENV_ENTRIES + 1))
    with pytest.raises(RequestError) as err:
        engine.plan(container(annotations=GPU, env=env))
    assert type(err.value) is RequestError
    assert err.value.source == "env LD_LIBRARY_PATH"
    assert f"{MAX_ENV_ENTRIES + 2} env entries, more than {MAX_ENV_ENTRIES}" in err.value.message
    assert calls == []


# ---- grant annotations read back ---------------------------------------------------------

def grant_of(engine: Engine, value: str) -> frozenset[str] | None:
    (grant,) = engine.grants_in([container(cid="x", annotations={ANNOTATION_GRANTED: value})]) \
        or (None,)
    return None if grant is None else grant.exclusive | grant.shared


def test_a_grant_of_the_most_keys_is_read(engine: Engine) -> None:
    keys = [f"x.io/y={i}" for i in range(engine_module._MAX_RESTORED_KEYS)]
    assert grant_of(engine, ",".join(keys)) == frozenset(keys)


def test_a_grant_of_more_keys_is_skipped_before_any_is_read(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    matched: list[str] = []

    class Counting:
        def fullmatch(self, text: str) -> Any:
            matched.append(text)
            return None

    monkeypatch.setattr(engine_module, "_WRITTEN_KEYS_RE", Counting())
    monkeypatch.setattr(engine_module, "KIND_RE", Counting())
    value = ",".join(f"x.io/y={i}" for i in range(engine_module._MAX_RESTORED_KEYS + 1))
    assert grant_of(engine, value) is None
    assert matched == []


@pytest.mark.parametrize(("value", "expected"), [
    ("a.io/b=1,c.io/d=GPU-x", {"a.io/b=1", "c.io/d=GPU-x"}),  # as written
    (" a.io/b=1 , ,c.io/d=2,", {"a.io/b=1", "c.io/d=2"}),  # blanks and empty items
    ("a.io/b=x y", {"a.io/b=x y"}),
    ("a.io/b=1,garbage", None),
    ("a.io/b=", None),
    ("=1", None),
])
def test_grant_annotation_forms(engine: Engine, value: str, expected: set[str] | None) -> None:
    assert grant_of(engine, value) == (None if expected is None else frozenset(expected))


def test_the_written_form_is_what_grant_annotations_write() -> None:
    pattern = engine_module._WRITTEN_KEYS_RE
    assert isinstance(pattern, re.Pattern)
    assert pattern.fullmatch("nvidia.com/gpu=GPU-4f1c2a3e,nvidia.com/mig=MIG-5b2d7e9a")
    assert not pattern.fullmatch("nvidia.com/gpu=0, nvidia.com/gpu=1")


# ---- restore slices ----------------------------------------------------------------------

def granted(cid: str, n: int, shared: int = 0) -> Any:
    keys = [f"x.io/y={i}" for i in range(n)]
    annotations = {ANNOTATION_GRANTED: ",".join(keys)}
    if shared:
        annotations[ANNOTATION_SHARED] = ",".join(keys[:shared])
    return container(cid=cid, annotations=annotations)


def ids(slices: list[list[Any]]) -> list[list[str]]:
    return [[c.container_id for c in part] for part in slices]


def test_restore_slices_bound_the_containers_and_the_keys() -> None:
    few = [granted(f"c{i}", 2) for i in range(5)]
    assert ids(list(restore_slices(few, 2))) == [["c0", "c1"], ["c2", "c3"], ["c4"]]
    # Keys of nri-accel.io/shared count too.
    heavy = [granted("a", RESTORE_KEYS // 2), granted("b", RESTORE_KEYS // 2),
             granted("c", 1000, shared=1000), granted("d", RESTORE_KEYS - 1999)]
    assert ids(list(restore_slices(heavy, 100))) == [["a", "b"], ["c"], ["d"]]
    # One container over the budget alone still gets a slice; one with no grant weighs nothing.
    alone = [granted("big", 5000), container(cid="none"), granted("e", 3)]
    assert ids(list(restore_slices(alone, 100, keys=16))) == [["big"], ["none", "e"]]
    assert list(restore_slices([], 100)) == []


@pytest.mark.parametrize("field", ["namespace", "pod_name", "pod_uid", "pod_id",
                                   "container_name", "container_id"])
def test_a_grant_is_refused_to_a_container_whose_names_it_could_not_record(
        engine: Engine, field: str) -> None:
    """A grant records the container's names and ids (annotations, checkpoint): one of
    megabytes, which only a CRI client outside Kubernetes can send, is refused when the
    container would be granted; asking for nothing, it is simply served."""
    asks = container(annotations={"devices.nri-accel.io": "nvidia.com/gpu=0"})
    long = msgspec.structs.replace(asks, **{field: "x" * (MAX_NAME_CHARS + 1)})
    with pytest.raises(RequestError, match=f"more than the {MAX_NAME_CHARS} a grant") as err:
        engine.plan(long)
    assert err.value.source == field.replace("_", " ")
    at_limit = msgspec.structs.replace(asks, **{field: "x" * MAX_NAME_CHARS})
    assert [d.qualified_name for d in engine.plan(at_limit).devices] == ["nvidia.com/gpu=0"]
    nothing = msgspec.structs.replace(container(), **{field: "x" * 1_000_000})
    assert engine.plan(nothing).devices == ()


def test_a_grant_is_refused_to_a_container_without_an_id(engine: Engine) -> None:
    """The holdings record a grant by the container's id: answered with its devices, a
    container without one would hold them unrecorded, free for the next container.
    Asking for nothing, it is served."""
    asks = container(annotations={"devices.nri-accel.io": "nvidia.com/gpu=0"}, cid="")
    with pytest.raises(RequestError, match="granted nothing") as err:
        engine.plan(asks)
    assert err.value.source == "container id"
    assert engine.plan(container(cid="")).devices == ()
    assert engine.holdings.container_ids() == frozenset()
