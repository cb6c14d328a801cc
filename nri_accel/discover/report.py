"""What `nri-accel discover` and `nri-accel cdi generate` print and write.

Owns: render_table(inventory) (the human report), main_discover(args) and
main_cdi_generate(args). Imports the standard library, nri_accel.app, nri_accel.errors,
nri_accel.inventory and nri_accel.vendors (each family's partition column, CDI writing).

The table has three sections: DEVICES (kind, name, UUID, PCI bus id, NUMA node,
health, MIG, and a short INFO column from the attributes), DRIVERS (each vendor, its
version, and for each capability what files it brings, or that none were found), and
PROBLEMS (what is missing and why). It holds only host paths and facts found on the
node: the same node gives byte-identical output. `--json` prints Inventory.to_json(),
which `--inventory FILE` reads back.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Sequence

from nri_accel.app import REPORT, App
from nri_accel.errors import ConfigError, NriAccelError
from nri_accel.files import file_kind
from nri_accel.inventory import ContainerEdits, Device, Inventory
from nri_accel.vendors import family_of
from nri_accel.vendors.cdi.spec import ALL_DEVICE, generate_specs, render_spec, spec_file_name

_COLUMNS = ("KIND", "NAME", "UUID", "PCI", "NUMA", "HEALTH", "MIG", "INFO")


def render_table(inventory: Inventory) -> str:
    """The human-readable report of an Inventory."""
    out: list[str] = [f"DEVICES ({len(inventory.devices)})"]
    if inventory.devices:
        rows = [_device_row(inventory, d) for d in inventory.devices]
        out += _table(_COLUMNS, rows)
    else:
        out.append("  none found")

    out += ["", f"DRIVERS ({len(inventory.drivers)})"]
    if not inventory.drivers:
        out.append("  none found")
    for driver in inventory.drivers.values():
        head = f"  {driver.vendor}"
        if driver.version:
            head += f"  version {driver.version}"
        if driver.cuda_version:
            head += f"  cuda {driver.cuda_version}"
        out.append(head)
        if not driver.capabilities:
            out.append("    no shared files")
        width = max((len(_cap_name(c)) for c in driver.capabilities), default=0)
        for cap, edits in driver.capabilities.items():
            out.append(f"    {_cap_name(cap):<{width}}  {_summary(edits)}")

    out += ["", f"PROBLEMS ({len(inventory.problems)})"]
    if not inventory.problems:
        out.append("  none")
    out += [f"  {p.source}: {p.message}" for p in inventory.problems]
    return "\n".join(out) + "\n"


def _device_row(inventory: Inventory, d: Device) -> tuple[str, ...]:
    return (
        d.kind,
        d.name,
        d.uuid or "-",
        d.pci_bus_id or "-",
        "-" if d.numa_node is None else str(d.numa_node),
        "ok" if d.healthy else "UNHEALTHY",
        _mig(inventory, d),
        _info(d) or "-",
    )


def _mig(inventory: Inventory, d: Device) -> str:
    return family_of(d.kind).partition(d, inventory) or "-"


def _info(d: Device) -> str:
    a = d.attributes
    parts = []
    if a.get("name"):
        parts.append(a["name"])
    if a.get("memory_mib"):
        parts.append(f"{a['memory_mib']} MiB")
    if a.get("compute_capability"):
        parts.append(f"cc {a['compute_capability']}")
    if a.get("cores"):
        parts.append(f"{a['cores']} cores")
    if d.links:
        parts.append("links " + ",".join(d.links))
    if a.get("origin"):
        parts.append(f"from {a['origin']}")
    if not d.healthy and a.get("health"):
        parts.append(f"unhealthy: {a['health']}")
    return ", ".join(parts)


def _cap_name(cap: str) -> str:
    return cap or "shared"


def _summary(edits: ContainerEdits) -> str:
    counts = [(len(edits.device_nodes), "device node"), (len(edits.mounts), "mount"),
              (len(edits.env), "env var"), (len(edits.hooks), "hook"),
              (len(edits.additional_gids), "group")]
    parts = [f"{n} {what}{'s' if n != 1 else ''}" for n, what in counts if n]
    return ", ".join(parts) if parts else "nothing found"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(header), *(line(r) for r in rows)]


# ---- CLI verbs -------------------------------------------------------------------------


def main_discover(args: argparse.Namespace) -> int:
    """`nri-accel discover [--root DIR] [--config FILE] [--json]`. Logs errors only (all
    of it if the config asks for debug): stdout is the report, and what discovery warns
    about is in its PROBLEMS already."""
    inventory = App.from_args(args, mode=REPORT).load_inventory()
    sys.stdout.write(inventory.to_json() if args.json else render_table(inventory))
    return 0


def main_cdi_generate(args: argparse.Namespace) -> int:
    """`nri-accel cdi generate [--inventory FILE | --root DIR] [--output FILE|DIR]`.

    Without --output, every spec goes to stdout as YAML documents. With a directory
    (e.g. /var/run/cdi, which outranks /etc/cdi), one file per device kind named as
    CDI's own tools name them (vendor-class.yaml). With a file, the inventory must hold
    a single kind. Files are replaced atomically (a temporary file in the same directory,
    renamed over it); a symlink is followed and its target replaced, and anything but a
    regular file (a FIFO, a device node, a socket) is refused before any spec is written.
    """
    inventory = App.from_args(args, mode=REPORT).load_inventory()
    specs = generate_specs(inventory)
    if not specs:
        raise NriAccelError("no devices of a native family (NVIDIA, Neuron, ...): no CDI "
                            "spec to write",
                            source=args.inventory or f"node {args.root or '/'}")
    if args.output is None:
        sys.stdout.write("---\n".join(render_spec(s) for s in specs))
        return 0
    output = _target(args.output)
    found = _stat(output, args.output)
    if found is not None and stat.S_ISDIR(found.st_mode):
        targets = [(_target(os.path.join(output, spec_file_name(s["kind"]))), s)
                   for s in specs]
        expected = "a regular file"
    elif len(specs) == 1:
        targets = [(output, specs[0])]
        expected = "a regular file or a directory"
    else:
        kinds = ", ".join(s["kind"] for s in specs)
        raise ConfigError(f"the inventory has {len(specs)} device kinds ({kinds}) and a CDI "
                          "spec holds one: give a directory to write one spec per kind",
                          source="--output")
    for path, _ in targets:
        found = _stat(path, args.output)
        if found is not None and not stat.S_ISREG(found.st_mode):
            what = "" if path == args.output else f"{path} "  # a symlink's target
            raise ConfigError(f"{what}is {file_kind(found.st_mode)}, not {expected}: "
                              "not replaced", source=f"--output {args.output}")
    for path, spec in targets:
        _write_atomically(path, render_spec(spec))
        devices = sum(d["name"] != ALL_DEVICE for d in spec["devices"])  # not the composite
        print(f"wrote {path} ({spec['kind']}, {devices} devices, "
              f"cdiVersion {spec['cdiVersion']})")
    return 0


def _target(path: str) -> str:
    """The file that writing `path` replaces: the target of a symlink (through every
    link), else `path` itself."""
    return os.path.realpath(path) if os.path.islink(path) else path


def _stat(path: str, output: str) -> os.stat_result | None:
    """What is at `path` (None: nothing); an error names --output."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP, EACCES on a directory above, ENOTDIR, ...
        raise ConfigError(f"{path}: {e.strerror or e}", source=f"--output {output}") from e


def _write_atomically(path: str, text: str) -> None:
    """Replace `path` by a file holding `text`: written to a new temporary file in the
    same directory (O_EXCL: never a file someone else prepared), synced, renamed."""
    directory, name = os.path.split(path)
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory or ".")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise NriAccelError(f"cannot write: {e.strerror or e}", source=path) from e
