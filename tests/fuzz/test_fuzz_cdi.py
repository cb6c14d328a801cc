"""Fuzz target: CDI spec loading (vendors/cdi/spec.py discover_cdi) through a HostRoot.

Each example writes one to three generated spec files, as JSON, YAML or raw bytes, into
the two spec directories of a small host tree (a character and a block device node, a
symlink to a node, a library, /var/lib/kubelet and a symlink to it, a symlink loop) and
discovers them. The generated documents follow the CDI schema closely (versions, kinds,
device names, env, device nodes, mounts, hooks, gids) with any field, at any depth,
sometimes replaced by a value of another type; raw files are arbitrary bytes or deeply
nested text.

Properties:
- discover_cdi returns a Found; nothing comes out of it (a file it cannot use is a
  Problem naming that file);
- every Problem names a file of the spec directories;
- every device it keeps has a CDI kind and device name, is not the composite `all`, and
  has absolute, '..'-free device node and mount paths;
- what it keeps can be planned: a container asking for every kind gets a Plan and an
  adjustment, or a NriAccelError (never InternalError).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from types import MappingProxyType

import pytest
import yaml
from fuzz_inputs import json_paths
from hypothesis import event, given
from hypothesis import strategies as st

from nri_accel.config import Config, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.discover.base import Found
from nri_accel.discover.hostroot import HostRoot
from nri_accel.engine import Engine
from nri_accel.errors import InternalError, NriAccelError
from nri_accel.inventory import DEVICE_NAME_RE, KIND_RE, Inventory
from nri_accel.nri.adjust import build_adjustment
from nri_accel.vendors.cdi.spec import SPEC_VERSIONS, discover_cdi

SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")


@pytest.fixture(scope="module")
def host() -> Iterator[HostRoot]:
    """A small host tree; device nodes are real where this runs as root (as CI does),
    else regular files (the specs naming them are then refused, as on such a host)."""
    base = Path(tempfile.mkdtemp(prefix="nri-accel-fuzz-cdi-"))
    (base / "dev").mkdir()
    for name, kind, dev in (("fuzz0", stat.S_IFCHR, os.makedev(1, 3)),
                            ("blk0", stat.S_IFBLK, os.makedev(7, 0))):
        try:
            os.mknod(base / "dev" / name, kind | 0o600, dev)
        except PermissionError:
            (base / "dev" / name).write_text("")
    (base / "dev" / "link0").symlink_to("fuzz0")
    (base / "usr/lib").mkdir(parents=True)
    (base / "usr/lib/libacme.so.1").write_text("")
    (base / "var/lib/kubelet").mkdir(parents=True)
    (base / "lnk-kubelet").symlink_to("/var/lib/kubelet")
    (base / "loop").symlink_to("loop")
    for d in SPEC_DIRS:
        (base / d.lstrip("/")).mkdir(parents=True)
    yield HostRoot.at(base)
    shutil.rmtree(base)


# ---- generated documents ---------------------------------------------------------------

scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                   st.floats(allow_nan=True), st.text(max_size=20))
junk = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6)


def often(s: st.SearchStrategy[object], other: st.SearchStrategy[object],
          n: int = 3) -> st.SearchStrategy[object]:
    """`s` n times out of n + 1, else `other` (one_of would count `s` once)."""
    return st.sampled_from((True,) * n + (False,)).flatmap(lambda yes: s if yes else other)


GOOD_PATHS = ("/dev/fuzz0", "/dev/blk0", "/usr/lib/libacme.so.1", "/opt/acme/x")
PATHS = ("/dev/link0", "/dev/missing", "/lnk-kubelet", "/loop", "/loop/x", "/var/lib/kubelet",
         "/proc", "/sys/x", "/run/containerd/containerd.sock", "relative", "/a/../b",
         "/dev/fuzz0\x00", "", "/" + "a" * 300, "/\ud800", "/\udc80", "/dev/./fuzz0",
         "//dev//fuzz0", "/", "/dev/x\u00b2", "/dev/acme\u0663")
path = often(st.sampled_from(GOOD_PATHS), st.one_of(st.sampled_from(PATHS), st.text(max_size=12)))
uint = often(st.integers(0, 300), st.sampled_from((0, -1, 2**32 - 1, 2**32, 2**64)))
strings = st.lists(st.text(max_size=12), max_size=3)
env_entry = often(st.sampled_from(("A=1", "ACME_VISIBLE=0", "LD_PRELOAD=/x.so", "PATH=/bin")),
                  st.one_of(st.sampled_from(("=x", "NOEQ", "A=\x00")), st.text(max_size=12)), 7)
device_node = st.fixed_dictionaries({"path": path}, optional={
    "hostPath": path, "type": often(st.sampled_from(("c", "b", "u", "")),
                                    st.sampled_from(("p", "x"))),
    "major": uint, "minor": uint, "fileMode": uint, "uid": uint, "gid": uint,
    "permissions": st.sampled_from(("", "rwm", "rw", "r", "m", "none", "rwmx", "wr"))})
mount = st.fixed_dictionaries({"hostPath": path, "containerPath": path}, optional={
    "type": st.sampled_from(("", "bind", "rbind", "none", "tmpfs", "proc", "overlay")),
    "options": st.lists(st.sampled_from(("ro", "rw", "bind", "rbind", "nosuid", "nodev", "noexec",
                                         "shared", "rshared", "mode=1777", "")), max_size=5)})
hook = st.fixed_dictionaries({"hookName": st.sampled_from(
    ("createContainer", "prestart", "poststop", "startContainer", "bogus")), "path": path},
    optional={"args": strings, "env": st.lists(env_entry, max_size=2), "timeout": uint})
_EDITS = {"env": st.lists(env_entry, max_size=3), "mounts": st.lists(mount, max_size=2),
          "hooks": st.lists(hook, max_size=2), "additionalGids": st.lists(uint, max_size=2)}
edits = st.fixed_dictionaries({}, optional={"deviceNodes": st.lists(device_node, max_size=2),
                                            **_EDITS})
device_edits = st.fixed_dictionaries({"deviceNodes": st.lists(device_node, min_size=1,
                                                              max_size=2)}, optional=_EDITS)
annotations = st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2)
device = st.fixed_dictionaries({"name": often(
    st.sampled_from(("npu0", "npu1", "0", "all", "a:b")),
    st.sampled_from(("-x", "x-", "bad name", "\u00e9", "")), 7),
    "containerEdits": device_edits},
    optional={"annotations": annotations})
clean_spec = st.fixed_dictionaries({
    "cdiVersion": often(st.sampled_from(("1.0.0", "0.7.0", "v0.6.0")),
                        st.sampled_from((*SPEC_VERSIONS, "0.2.0", "9.9.9", ""))),
    "kind": often(st.sampled_from(("acme.example/npu", "acme/npu", "acme.example/npu.x")),
                  st.sampled_from(("nvidia.com/gpu", "acme.example", "/npu", "a/b/c", "\u00e9/x",
                                   "1a/b", "a-/b")), 7),
    "devices": often(st.lists(device, min_size=1, max_size=3), st.just([]), 15),
}, optional={"containerEdits": edits, "annotations": annotations})


@st.composite
def spec(draw: st.DrawFn) -> object:
    """A document in the CDI schema; half of them then damaged once or twice somewhere:
    a value of another type, a field removed, an unknown field, a field nri-accel
    refuses (intelRdt, netDevices)."""
    doc = draw(clean_spec)
    for _ in range(draw(st.sampled_from((0, 0, 0, 1, 2)))):
        if draw(st.sampled_from(range(20))) == 0:
            return draw(junk)
        at = draw(st.sampled_from(json_paths(doc)[1:]))
        parent: object = doc
        for step in at[:-1]:
            parent = parent[step]  # type: ignore[index]
        how = draw(st.sampled_from(("retype", "remove", "unknown", "refused")))
        target = parent[at[-1]]  # type: ignore[index]
        if how == "retype":
            parent[at[-1]] = draw(junk)  # type: ignore[index]
        elif how == "remove" and isinstance(parent, dict):
            del parent[at[-1]]
        elif how == "unknown" and isinstance(target, dict):
            target[draw(st.text(max_size=8))] = draw(junk)
        elif how == "refused" and isinstance(target, dict):
            target[draw(st.sampled_from(("intelRdt", "netDevices")))] = draw(junk)
    return doc


def _yaml(doc: object) -> bytes:
    return yaml.safe_dump(doc, allow_unicode=False).encode()


raw = st.one_of(
    st.binary(max_size=200),
    st.sampled_from((b"[" * 5000, b"- " * 5000, b"{a: " * 3000, b"&a [*a]", b"\xff\xfe",
                     b"cdiVersion: 2001-02-30", b"!!python/object:os.system {}",
                     b"a: !!binary '@@'", b"1" * 5000, b"[1e999999]")),
    st.builds(lambda depth, leaf: (b"[" * depth + leaf + b"]" * depth),
              st.integers(900, 200_000), st.sampled_from((b"1", b"", b"{}"))),
)


@st.composite
def spec_file(draw: st.DrawFn) -> tuple[str, bytes]:
    """(file name, content)."""
    fmt = draw(st.sampled_from(("json", "json", "yaml", "yaml", "raw")))
    if fmt == "raw":
        return draw(st.sampled_from(("r.json", "r.yaml"))), draw(raw)
    doc = draw(spec())
    if fmt == "json":
        return "s.json", json.dumps(doc).encode()
    return "s.yaml", _yaml(doc)


files = st.lists(st.tuples(st.sampled_from(SPEC_DIRS), st.integers(0, 2), spec_file()),
                 min_size=1, max_size=3)


def _write(host: HostRoot, files: list[tuple[str, int, tuple[str, bytes]]]) -> None:
    for d in SPEC_DIRS:
        local = Path(host.local(d))
        shutil.rmtree(local)
        local.mkdir()
    for d, n, (name, content) in files:
        (Path(host.local(d)) / f"{n}-{name}").write_bytes(content)


def _clean(p: str) -> bool:
    pp = PurePosixPath(p)
    return pp.is_absolute() and ".." not in pp.parts


@given(files)
def test_discover_cdi(host: HostRoot, files: list[tuple[str, int, tuple[str, bytes]]]) -> None:
    _write(host, files)
    found = discover_cdi(host, SPEC_DIRS)
    for problem in found.problems:
        assert problem.source.startswith(tuple(d + "/" for d in SPEC_DIRS)), problem
        assert problem.message
    for d in found.devices:
        assert KIND_RE.fullmatch(d.kind) and DEVICE_NAME_RE.fullmatch(d.name), d
        assert d.name != "all"
        assert all(_clean(n.path) and (not n.host_path or _clean(n.host_path))
                   for n in d.edits.device_nodes), d
        assert all(_clean(m.container_path) for m in d.edits.mounts), d
    event("some device kept" if found.devices else "no device kept")
    event(f"problems: {min(len(found.problems), 3)}")
    if found.devices:
        plan_every_kind(found)


STANDALONE = Config(policy=PolicyConfig(mode="standalone"))


def plan_every_kind(found: Found) -> None:
    """What the loader keeps can be granted: a container asking for all devices of each
    kind gets a Plan and an adjustment, or a NriAccelError."""
    inventory = Inventory(devices=found.devices,
                          drivers=MappingProxyType({d.vendor: d for d in found.drivers}))
    engine = Engine(inventory, STANDALONE)
    value = ";".join(f"{kind}=all" for kind in inventory.kinds())
    info = ContainerInfo(namespace="default", pod_name="p", pod_uid="u", container_name="main",
                         container_id="c1",
                         pod_annotations=MappingProxyType({"devices.nri-accel.io": value}),
                         container_annotations=MappingProxyType({}), env=())
    try:
        plan = engine.plan(info)
        build_adjustment(plan.edits, plan.annotations, plan.cdi_devices)
    except NriAccelError as err:
        assert not isinstance(err, InternalError)
        event(f"plan refused: {type(err).__name__}")
