"""Builds the NRI messages nri-accel answers with: THE place a ContainerAdjustment is made.

Owns: ContainerEdits (+ annotations, CDI device names) -> nri_pb2.ContainerAdjustment,
as wire bytes (encode_adjustment: what the daemon answers with) or as a message
(build_adjustment), and the protobuf JSON rendering (`explain --json`). Imports
nri_accel.inventory, nri_accel.memo and this package's nri_pb2; no I/O (a memo of
encodings, bounded in bytes, the only state).

What the runtime does with an adjustment (containerd/nri pkg/adaptation and
pkg/runtime-tools/generate, used by containerd and CRI-O alike), and so what this
module does and does not emit:
- A device in linux.devices gets its cgroup allow rule from the runtime itself
  (pkg/api LinuxDevice.AccessString: type, major, minor, access "rw", plus "m" for
  block devices), so no explicit LinuxDeviceCgroup rule is added here and no wildcard
  rule can ever appear. LinuxDevice has no permissions field and the runtime does not
  collect linux.resources.devices from a plugin, so DeviceNode.permissions cannot narrow
  that rule: nri_accel.edits refuses a node whose permissions lack r or w (CDI "r",
  "none", ...) before it gets here.
- LinuxDevice carries the container path and the major/minor numbers; the node is
  created from those, so DeviceNode.host_path has no counterpart on the wire.
- The runtime refuses an adjustment in which two plugins, or one plugin twice, set
  the same device path, mount destination, environment variable, annotation or CDI
  device: every such key appears here once (first occurrence wins, as in
  merge_edits).
- A Mount is passed as it is: type, source, destination, options. A bind mount has
  type "bind" and its host path as source; a tmpfs has type "tmpfs" and a name as
  source ("tmpfs"), the kernel ignores it and so does the runtime (nri_accel.edits
  never lets bind, rbind or shared propagation into a tmpfs's options, the options
  that would make the runtime read the source as a host path).
- NRI has no adjustment for additional GIDs: ContainerEdits.additional_gids is not
  representable and is left out.
Order is deterministic: devices by path in natural order (nvidia2 before nvidia10),
mounts parents-first then by destination (the order the runtime sorts them into), env
and hooks as given, CDI names sorted; the stub serialises maps with sorted keys.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from nri_accel.inventory import (
    ContainerEdits,
    DeviceNode,
    Hook,
    Mount,
    merge_edits,
    natural_key,
)
from nri_accel.memo import Memo
from nri_accel.nri import nri_pb2 as pb

# encode_adjustment()'s memo of encodings: a node hands out few distinct edits (one per
# device set and capability set, and the LD_LIBRARY_PATH of the images that set one), so
# each is built once and its bytes sent again (building the message field by field is
# what costs: a grant of 256 GPUs, 1.5 ms). Each is charged its bytes and its env's
# characters (the key's own text, which the container's LD_LIBRARY_PATH can make large):
# 8 MiB in all, an entry of 128 KiB at most (a grant of all 512 GPUs of a node: 118 KiB;
# one extending a 120 KiB LD_LIBRARY_PATH is built each time).
MEMO_ENTRIES = 1024
MEMO_BYTES = 8 << 20
MEMO_LARGEST = 128 << 10
_ENCODED: Memo[tuple[object, ...], bytes] = Memo(MEMO_ENTRIES, MEMO_BYTES, MEMO_LARGEST)

# CDI/OCI hook names (Hook.hook_name) -> fields of nri Hooks.
HOOK_FIELDS = {
    "prestart": "prestart",
    "createRuntime": "create_runtime",
    "createContainer": "create_container",
    "startContainer": "start_container",
    "poststart": "poststart",
    "poststop": "poststop",
}


def encode_adjustment(
    edits: ContainerEdits,
    annotations: Mapping[str, str] | None = None,
    cdi_devices: Iterable[str] = (),
) -> bytes:
    """The ContainerAdjustment applying `edits` and adding `annotations` and
    `cdi_devices`, as its wire bytes: what the daemon answers with (the stub frames them into the
    CreateContainerResponse; nothing is decoded and encoded again).

    Raises ValueError for a hook whose name is not an OCI hook point.
    """
    key = (edits, tuple(sorted(annotations.items())) if annotations else (),
           tuple(sorted(set(cdi_devices))))
    found: bytes | None = _ENCODED.get(key)
    if found is None:
        found = _encode(*key)
        _ENCODED.put(key, found, len(found) + sum(map(len, edits.env)))
    return found


def build_adjustment(
    edits: ContainerEdits,
    annotations: Mapping[str, str] | None = None,
    cdi_devices: Iterable[str] = (),
) -> pb.ContainerAdjustment:
    """encode_adjustment()'s adjustment as a message (explain, and whoever reads it)."""
    return pb.ContainerAdjustment.FromString(
        encode_adjustment(edits, annotations, cdi_devices))


def _encode(edits: ContainerEdits, annotations: tuple[tuple[str, str], ...],
            cdi_devices: tuple[str, ...]) -> bytes:
    """The adjustment's wire bytes."""
    edits = merge_edits((edits,))
    adj = pb.ContainerAdjustment()
    adj.annotations.update(annotations)
    if edits.device_nodes:
        adj.linux.devices.extend(
            linux_device(n) for n in sorted(edits.device_nodes, key=lambda n: natural_key(n.path)))
    if edits.mounts:
        adj.mounts.extend(nri_mount(m) for m in sorted(edits.mounts, key=_mount_order))
    if edits.env:
        adj.env.extend(pb.KeyValue(key=k, value=v)
                       for k, _, v in (kv.partition("=") for kv in edits.env))
    for hook in edits.hooks:
        field = HOOK_FIELDS.get(hook.hook_name)
        if field is None:
            raise ValueError(f"hook {hook.path}: unknown hook point {hook.hook_name!r} "
                             f"(known: {', '.join(HOOK_FIELDS)})")
        getattr(adj.hooks, field).append(nri_hook(hook))
    adj.CDI_devices.extend(pb.CDIDevice(name=n) for n in cdi_devices)
    return adj.SerializeToString(deterministic=True)


def linux_device(node: DeviceNode) -> pb.LinuxDevice:
    dev = pb.LinuxDevice(path=node.path, type=node.type, major=node.major, minor=node.minor)
    if node.file_mode is not None:
        dev.file_mode.value = node.file_mode
    if node.uid is not None:
        dev.uid.value = node.uid
    if node.gid is not None:
        dev.gid.value = node.gid
    return dev


def nri_mount(mount: Mount) -> pb.Mount:
    return pb.Mount(destination=mount.container_path, type=mount.type, source=mount.host_path,
                    options=mount.options)


def nri_hook(hook: Hook) -> pb.Hook:
    h = pb.Hook(path=hook.path, args=hook.args, env=hook.env)
    if hook.timeout is not None:
        h.timeout.value = hook.timeout
    return h


def _mount_order(m: Mount) -> tuple[int, str]:
    path = m.container_path.rstrip("/") or "/"
    return path.count("/"), path


def to_dict(message: object) -> dict[str, object]:
    """The protobuf JSON mapping (protojson field names, int64 as strings, defaults omitted)."""
    from google.protobuf import json_format  # here: only explain and the demo render JSON

    return json_format.MessageToDict(message)  # type: ignore[arg-type]


def to_json(message: object) -> str:
    """to_dict() as indented JSON with sorted keys: the `explain --json` form."""
    return json.dumps(to_dict(message), indent=2, sort_keys=True) + "\n"
