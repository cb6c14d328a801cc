"""The `nri-accel` command line: argument parsing and dispatch, nothing else.

Owns: the verbs, their flags and help texts (a stable interface: see DESIGN.md).
Imports argparse, the demo's node names (nri_accel.demo imports only the standard
library at module level) and, lazily, the module that implements each verb, so that
`nri-accel run` starts fast and `--help` works even where a vendor library is missing.
The process enters through nri_accel.__main__ (the `nri-accel` command).

Run with no arguments by the container runtime (NRI_PLUGIN_SOCKET set: a
pre-registered plugin), it behaves as `run`.

Exit status: 0 success, 1 refused/failed (the reason on stderr), 2 usage or
configuration error (a flag, the configuration, a saved inventory or a Pod manifest).
Output that cannot be written (a reader that left the pipe, a full disk) ends any verb
the same way: main() tells it from the verb's own errors, exit 1 without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

from nri_accel import __version__
from nri_accel.config import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_SOCKET,
    DEFAULT_STATE_DIR,
    NOT_ABSOLUTE,
    UNIX_PATH_MAX,
    absolute_without_dotdot,
    unix_socket_path_problem,
)
from nri_accel.demo import DEFAULT_NODE, NODES

KUBELET_SOCKET = "kubelet.sock"  # deviceplugin.server's (which imports grpc: not here)

_EPILOG = """\
examples:
  nri-accel demo                                   built-in 8-GPU node and demo pods
  nri-accel demo --node mixed                      the same with Gaudi and AMD devices
  nri-accel discover                               what this node has (table)
  nri-accel discover --json > node.json            capture the node for dry runs
  nri-accel explain --inventory node.json --pod pod.yaml
  nri-accel run                                    serve containerd/CRI-O over NRI

exit status: 0 success; 1 refused or failed (the reason on stderr); 2 usage or
configuration error (a flag, the configuration, a saved inventory, a Pod manifest)

docs: README.md (annotation and env syntax, configuration), deploy/ (install)
"""


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def _path(text: str) -> str:
    """A path flag's value: an empty one would name no file (or quietly mean the default)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return text


def _socket_path(text: str) -> str:
    """--socket: an absolute path a unix socket can have (connect() would fail on it
    forever; a relative one would depend on the working directory), as nri.socket."""
    why = unix_socket_path_problem(text)
    if why is None and not text.startswith("/"):
        why = "must be an absolute path"
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {why}" if text else why)
    return text


def _state_dir(text: str) -> str:
    """--state-dir: as state_dir, absolute without '..' (`run` and `device-plugin` must
    name the same directory whatever their working directories)."""
    _path(text)
    if not absolute_without_dotdot(text):
        raise argparse.ArgumentTypeError(f"{text!r} {NOT_ABSOLUTE}")
    return text


def _kubelet_dir(text: str) -> str:
    """--kubelet-dir: a directory where kubelet's socket (the shortest of those the
    device plugin uses there) can have a unix socket path."""
    _path(text)
    why = unix_socket_path_problem(os.path.join(os.path.abspath(text), KUBELET_SOCKET))
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: its {KUBELET_SOCKET} path {why}")
    return text


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", type=_path,
                   help=f"TOML configuration (default {DEFAULT_CONFIG_PATH} if it exists)")


def _add_daemon(p: argparse.ArgumentParser) -> None:
    """The flags `run` and `device-plugin` share."""
    p.add_argument("--state-dir", metavar="DIR", type=_state_dir,
                   help="grant checkpoint and the state `run` shares with `device-plugin` "
                   f"(default: config state_dir, else {DEFAULT_STATE_DIR})")
    p.add_argument("--metrics-address", metavar="HOST:PORT",
                   help="serve /metrics, /healthz and /readyz there (default: config "
                   "metrics.address, else off)")


def _add_source(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--inventory", metavar="FILE", type=_path,
                   help="use a saved inventory (from `discover --json`) instead of discovery")
    where = "/host in a DaemonSet" if required else "default /; /host in a DaemonSet"
    g.add_argument("--root", metavar="DIR", type=_path,
                   help=f"discover the host mounted at DIR ({where})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nri-accel",
        description="NRI plugin that gives containers their hardware AI accelerators "
        "(NVIDIA GPUs and MIG, AWS Neuron, Intel Gaudi, AMD Instinct, CDI devices).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nri-accel {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True

    p = sub.add_parser("run", help="serve the container runtime over NRI (the daemon)",
                       description="Register with the runtime's NRI socket and answer "
                       "CreateContainer with device adjustments. Reconnects when the "
                       "runtime restarts. When launched by the runtime from its plugin "
                       "directory (NRI_PLUGIN_SOCKET set), uses the inherited socket.")
    p.add_argument("--socket", metavar="PATH", type=_socket_path,
                   help=f"NRI socket, at most {UNIX_PATH_MAX} bytes (default: config "
                   f"nri.socket, else {DEFAULT_SOCKET})")
    p.add_argument("--name", help="plugin name (default: env NRI_PLUGIN_NAME, argv[0] "
                   "NN-name, config nri.name, else nri-accel)")
    p.add_argument("--idx", metavar="NN", help="two-digit plugin index (default: env "
                   "NRI_PLUGIN_IDX, argv[0] NN-name, config nri.idx, else 40)")
    p.add_argument("--log-file", metavar="FILE", type=_path,
                   help="append logs to FILE instead of stderr (rotated at 16 MiB)")
    _add_config(p)
    _add_daemon(p)
    _add_source(p)
    p.set_defaults(target="nri_accel.plugin:main_run")

    p = sub.add_parser("discover", help="show what accelerators and drivers this node has",
                       description="Discover devices and driver files once and print them: "
                       "a table, or the Inventory JSON that --inventory accepts.")
    p.add_argument("--root", metavar="DIR", type=_path, help="host root to read (default /)")
    p.add_argument("--json", action="store_true", help="print the Inventory as JSON")
    _add_config(p)
    p.set_defaults(target="nri_accel.discover.report:main_discover")

    p = sub.add_parser("explain", help="dry run: what a pod's container would get",
                       description="Run a Kubernetes Pod manifest through the same pipeline "
                       "as CreateContainer. Exit 0 and print the adjustment; exit 1 with "
                       "the reason on stderr when a container's request is refused; exit 2 "
                       "for a usage error or an unreadable manifest, inventory or "
                       "configuration.")
    _add_source(p, required=True)
    p.add_argument("--pod", metavar="POD.yaml", required=True, type=_path,
                   help="Pod manifest (YAML or JSON)")
    p.add_argument("--container", metavar="NAME", help="container name (default: every container)")
    p.add_argument("--json", action="store_true",
                   help="print the ContainerAdjustment in protobuf JSON mapping (of "
                   "several containers: an object keyed by namespace/pod/container)")
    _add_config(p)
    p.set_defaults(target="nri_accel.explain:main_explain")

    p = sub.add_parser("cdi", help="CDI spec tools",
                       description="Container Device Interface (CDI) spec tools: `generate` "
                       "writes the devices nri-accel discovers as CDI specs.")
    cdi = p.add_subparsers(dest="cdi_verb", metavar="VERB")
    cdi.required = True
    g = cdi.add_parser("generate", help="write a CDI spec for the discovered devices",
                       description="Write the devices nri-accel discovers itself (NVIDIA, "
                       "Neuron, Gaudi, AMD) as CDI specs, one per kind, for runtimes or "
                       "tools that consume CDI directly.")
    _add_source(g)
    g.add_argument("--output", metavar="FILE|DIR", type=_path,
                   help="write to FILE, or one <vendor>-<class>.yaml per kind into DIR "
                   "(default: stdout); a symlink is followed, anything but a regular "
                   "file or directory refused")
    _add_config(g)
    g.set_defaults(target="nri_accel.discover.report:main_cdi_generate")

    p = sub.add_parser("device-plugin", help="serve the kubelet device-plugin API",
                       description="Advertise the node's devices to kubelet and answer "
                       "Allocate with the trusted grant annotation that `run` honours. "
                       "Fails closed: while no `nri-accel run` on the node is registered "
                       "with the runtime (as its --state-dir records), every device is "
                       "Unhealthy and Allocate is refused.")
    p.add_argument("--kubelet-dir", metavar="DIR", default="/var/lib/kubelet/device-plugins",
                   type=_kubelet_dir,
                   help="kubelet device-plugin directory (default %(default)s)")
    _add_config(p)
    _add_daemon(p)
    _add_source(p)
    p.set_defaults(target="nri_accel.deviceplugin.server:main_device_plugin")

    p = sub.add_parser("check", help="validate the configuration and this node's setup",
                       description="Load the configuration, discover the node, register a "
                       "short-lived probe plugin (99-nri-accel-check) on the NRI socket and "
                       "read the runtime's NRI configuration (containerd, CRI-O) under the "
                       "host root; print what is wrong. Exit 0 only if `run` would work "
                       "(warnings allowed), 1 otherwise, 2 for a usage error or an invalid "
                       "configuration or saved inventory.")
    p.add_argument("--socket", metavar="PATH", type=_socket_path,
                   help=f"NRI socket to check, at most {UNIX_PATH_MAX} bytes (default: config "
                   f"nri.socket, else {DEFAULT_SOCKET})")
    p.add_argument("--timeout", metavar="SECONDS", type=_positive_seconds, default=None,
                   help="how long the probe waits for the runtime's Configure and first "
                   "Synchronize (default 10)")
    _add_config(p)
    _add_source(p)
    p.set_defaults(target="nri_accel.check:main_check")

    p = sub.add_parser("demo", help="built-in demo: a node and demo pods, no accelerator needed",
                       description="Start the real daemon against a built-in demo node's "
                       "inventory and a simulated container runtime, create the node's demo "
                       "pods and print what each container gets.")
    p.add_argument("--node", choices=tuple(NODES), default=DEFAULT_NODE,
                   help="a100: 8 NVIDIA A100 GPUs, one in MIG mode (the default); mixed: 7 "
                   "Intel Gaudi2 and 4 AMD Instinct MI300X devices, a made-up mix of two "
                   "real nodes so that both families' requests show side by side")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document: node, daemon, containers (each adjustment "
                   "in the protobuf JSON mapping, or the refusal) and the daemon log")
    p.set_defaults(target="nri_accel.demo:main_demo")

    p = sub.add_parser("version", help="print the version",
                       description="Print nri-accel's version (as `nri-accel --version`).")
    p.set_defaults(target=None)
    return parser


class _Output:
    """sys.stdout while main() runs: the same stream, remembering the first error in
    writing it, so that main() tells output that cannot be written (the reader left,
    the disk is full) from a verb's own OSErrors, whose traceback is a bug's."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.error: OSError | None = None

    def _failed(self, e: OSError) -> None:
        if self.error is None:
            self.error = e

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            self._failed(e)
            raise

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self._failed(e)
            raise

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self.stream, name)


def main(argv: Sequence[str] | None = None, *,
         imported: Callable[[], None] | None = None) -> int:
    """Run the verb `argv` names (default: sys.argv's); `imported` is called once the
    verb's module is imported, or the command line refused (see nri_accel.__main__).

    Whatever the verb, output that cannot be written ends it with exit status 1 and,
    unless the reader just left the pipe (EPIPE: quiet, as `cmd | head` expects), one
    line on stderr, never a traceback."""
    if sys.stdout is None:  # started with stdout closed: print() writes nothing
        return _main(argv, imported)
    out = _Output(sys.stdout)
    sys.stdout = out  # type: ignore[assignment]
    code, exiting = 1, None
    try:
        try:
            code = _main(argv, imported)
        except SystemExit as e:  # argparse's, after --help or a usage error (it ignores
            exiting = e          # an error in writing the help: out.error has it)
        if out.error is None:
            out.flush()
    except OSError:
        if out.error is None:
            raise
    finally:
        sys.stdout = out.stream
    if out.error is not None:
        return _cannot_write(out.error)
    if exiting is not None:
        raise exiting
    return code


def _cannot_write(e: OSError) -> int:
    """Python's recipe for a closed stdout (library/signal.html, "Note on SIGPIPE"):
    point it at /dev/null, so that the interpreter's last flush at exit fails no more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # ValueError: no file descriptor (an in-memory stream)
        pass
    if e.errno != errno.EPIPE:
        _say(f"cannot write output: {e.strerror or e}")
    return 1


def _say(message: str) -> None:
    """One line on stderr; quietly nothing where stderr cannot take it either."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: stderr closed
        print(f"nri-accel: {message}", file=sys.stderr, flush=True)


def _main(argv: Sequence[str] | None, imported: Callable[[], None] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv and os.environ.get("NRI_PLUGIN_SOCKET"):
        # Launched by the runtime from its plugin directory (/opt/nri/plugins/NN-name,
        # a link to this program): no arguments, the connection inherited as a fd.
        argv = ["run"]
    try:
        args = build_parser().parse_args(argv)
        if args.target is None:
            print(f"nri-accel {__version__}")
            return 0
        module, _, func = args.target.partition(":")
        handler = getattr(importlib.import_module(module), func)
    finally:
        if imported is not None:
            imported()
    from nri_accel.errors import ConfigError, InventoryError, NriAccelError

    try:
        return int(handler(args) or 0)
    except (ConfigError, InventoryError) as e:  # InventoryError: the --inventory file
        _say(str(e))
        return 2
    except NriAccelError as e:
        _say(str(e))
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # `python -m nri_accel.cli` (as earlier versions were run): the same command as
    # `python -m nri_accel`, without the start-up measures of nri_accel.__main__
    sys.exit(main())
