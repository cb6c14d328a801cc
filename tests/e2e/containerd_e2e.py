"""Harness of the end-to-end tests against a real containerd (test_containerd.py,
test_preregistered.py).

Owns: the private containerd configuration (NRI on, CRI with a locally imported sandbox
image, runc from the fetched packages, every path under one temporary directory), the
containerd process (started, stopped alone and started again as a service restart would,
its JSON log read from a mark), `nri-accel run` as an external plugin subprocess
(Plugin) or as a pre-registered plugin containerd launches itself (LaunchedPlugin: a
launcher script in plugin_path), their logs, the OCI image archive built in Python
around a static pause binary compiled from pause.c, the CRI client compiled at test time
from cri_api.proto and the calls kubelet makes with it (CriClient), the cleanup that
leaves nothing behind (shims, runc containers, mounts, cgroups, plugin processes) even
when a test fails half way, and the placeholder inventory for containers that start.
Imports the standard library, grpc and grpc_tools; no nri_accel module (it reads the
inventory's JSON form).

The binaries come from tests/e2e/fetch-containerd.sh: NRI_ACCEL_E2E_BIN names a
directory of containerd-* directories (what the script prints), each holding containerd,
ctr, containerd-shim-runc-v2 and runc, or one such directory; find_runtimes lists them
with their versions, and the containerd configuration is written for each version: config
version 2 (the CRI plugin's one table) for 1.x, version 3 (CRI split in runtime, images
and server plugins) for 2.x.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import itertools
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

E2E_DIR = Path(__file__).resolve().parent
REPO = E2E_DIR.parents[1]
BIN_ENV = "NRI_ACCEL_E2E_BIN"
TOOLS = ("containerd", "ctr", "containerd-shim-runc-v2", "runc")
NAMESPACE = "k8s.io"  # containerd's CRI namespace
IMAGE = "e2e.nri-accel.local/pause:1"
PLUGIN_NAME, PLUGIN_IDX = "nri-accel", "40"
FULL_NAME = f"{PLUGIN_IDX}-{PLUGIN_NAME}"
DEMO_INVENTORY = REPO / "nri_accel" / "demo" / "inventory.json"  # an 8-GPU node
START_TIMEOUT = 20.0  # seconds for containerd to serve, or the plugin to register
RPC_TIMEOUT = 30.0  # seconds for one CRI call
# The image's platform: the host's, in OCI (Go) architecture names.
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


class E2EError(RuntimeError):
    """A step of the harness failed; the message says which and carries the output."""


@dataclass(frozen=True)
class Runtime:
    """One containerd to test: the directory holding TOOLS and the version that
    `containerd --version` reports ((0, 0, 0) with `error` set when it does not run)."""

    bin_dir: Path
    version: tuple[int, int, int]
    error: str = ""

    @property
    def id(self) -> str:
        """The test id: containerd-1.7.24, or the directory's name when it did not run."""
        if self.error:
            return self.bin_dir.name
        return "containerd-" + ".".join(map(str, self.version))


POD_ANNOTATION = "devices.nri-accel.io/pod"
GRANTED = "nri-accel.io/granted"


def runtimes_or_skip() -> list[Runtime]:
    """The containerds NRI_ACCEL_E2E_BIN names (find_runtimes); called at a test module's
    import, it skips the whole module when the variable is unset."""
    if not os.environ.get(BIN_ENV):
        pytest.skip(f"{BIN_ENV} is not set: export {BIN_ENV}=\"$(tests/e2e/fetch-containerd.sh "
                    "CACHE_DIR)\" to run the end-to-end test against a real containerd",
                    allow_module_level=True)
    return find_runtimes(Path(os.environ[BIN_ENV]))


def find_runtimes(path: Path) -> list[Runtime]:
    """The containerds under `path`: `path` itself when it holds a containerd, else each
    subdirectory that does, by name. A `path` with neither gives one Runtime for `path`
    whose error says so (the test fails on it, never skips)."""
    path = path.resolve()
    if (path / "containerd").exists():
        dirs = [path]
    else:
        dirs = sorted(d for d in path.iterdir() if (d / "containerd").exists()) \
            if path.is_dir() else []
    if not dirs:
        return [Runtime(path, (0, 0, 0), f"{path} holds no containerd, nor any directory "
                                         "that does: run tests/e2e/fetch-containerd.sh")]
    return [_runtime(d) for d in dirs]


def runtime_problem(runtime: Runtime) -> str:
    """Why the tests cannot run on `runtime` ("" when they can): it did not run, a tool
    is missing, or this is not root. The tests fail on it, never skip."""
    if runtime.error:
        return f"{BIN_ENV}: {runtime.error}"
    missing = [t for t in TOOLS if not os.access(runtime.bin_dir / t, os.X_OK)]
    if missing:
        return (f"{BIN_ENV}: {runtime.bin_dir} lacks {', '.join(missing)}: "
                "run tests/e2e/fetch-containerd.sh")
    if os.geteuid() != 0:
        return "the containerd end-to-end test needs root (containerd, runc, mounts)"
    return ""


def parse_version(text: str) -> tuple[int, int, int] | None:
    """The leading MAJOR.MINOR.PATCH of a containerd version, as `containerd --version`
    prints it and NRI's Configure carries it: v1.7.24, 1.7.24~ds1 (Debian's 1.7),
    2.1.9+unknown (Debian's 2.x)."""
    found = re.match(r"v?(\d+)\.(\d+)\.(\d+)", text)
    if found is None:
        return None
    major, minor, patch = map(int, found.groups())
    return major, minor, patch


def _runtime(bin_dir: Path) -> Runtime:
    """The Runtime of `bin_dir`, from `containerd --version`, which prints
    'containerd <module> <version> <revision>'."""
    argv = [str(bin_dir / "containerd"), "--version"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return Runtime(bin_dir, (0, 0, 0), f"{argv[0]}: {exc}")
    fields = out.stdout.split()
    version = parse_version(fields[2]) if len(fields) > 2 else None
    if out.returncode != 0 or version is None:
        return Runtime(bin_dir, (0, 0, 0), f"{' '.join(argv)} exited {out.returncode}: "
                                           f"{out.stdout}{out.stderr}")
    return Runtime(bin_dir, version)


def tail(path: Path, lines: int = 60) -> str:
    """The last `lines` lines of a log file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_for(what: str, check: Callable[[], Any], timeout: float = START_TIMEOUT,
             diagnose: Callable[[], str] = lambda: "") -> Any:
    """Poll `check` until it returns something truthy; E2EError naming `what` if it
    does not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise E2EError(f"timed out after {timeout:.0f} s waiting for {what}\n{diagnose()}")
        time.sleep(0.05)


def run_checked(argv: list[str], **kwargs: Any) -> str:
    """Run a command, return its stdout; E2EError with its output if it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kwargs)
    if proc.returncode != 0:
        raise E2EError(f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout}{proc.stderr}")
    return proc.stdout


# ---- the CRI client -------------------------------------------------------------------

def compile_cri(out: Path) -> tuple[ModuleType, ModuleType]:
    """Compile cri_api.proto into `out` with grpcio-tools; return (pb2, pb2_grpc)."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(["grpc_tools.protoc", f"-I{E2E_DIR}", f"--python_out={out}",
                      f"--grpc_python_out={out}", str(E2E_DIR / "cri_api.proto")])
    if rc != 0:
        raise E2EError(f"protoc failed on {E2E_DIR / 'cri_api.proto'} (exit {rc})")
    sys.path.insert(0, str(out))
    try:
        pb2 = importlib.import_module("cri_api_pb2")
        pb2_grpc = importlib.import_module("cri_api_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    return pb2, pb2_grpc


@dataclass(kw_only=True)
class CriClient:
    """CRI calls as kubelet makes them, on a containerd's socket: pods with host
    networking in `cgroup_parent`, one container each running IMAGE's /pause. Every pod
    it runs is listed in `sandboxes` until removed (remove_pods removes what is left)."""

    pb2: Any  # the compiled cri_api_pb2
    cri: Any  # its RuntimeServiceStub
    cgroup_parent: str
    sandboxes: list[str] = field(default_factory=list)

    def run_pod(self, name: str, annotations: dict[str, str]) -> tuple[str, Any]:
        """Run a pod sandbox; its id and the config to create its containers with."""
        pb = self.pb2
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, uid=str(uuid.uuid4()),
                                           namespace="default"),
            annotations=annotations,
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=self.cgroup_parent,
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER,
                                                         ipc=pb.POD))))
        reply = self.cri.RunPodSandbox(pb.RunPodSandboxRequest(config=config),
                                       timeout=RPC_TIMEOUT)
        self.sandboxes.append(reply.pod_sandbox_id)
        return reply.pod_sandbox_id, config

    def create_container(self, sandbox_id: str, sandbox_config: Any, name: str,
                         annotations: dict[str, str] | None = None) -> str:
        """`annotations`: the container config's, as kubelet writes a device plugin's
        Allocate answer there."""
        pb = self.pb2
        config = pb.ContainerConfig(metadata=pb.ContainerMetadata(name=name),
                                    image=pb.ImageSpec(image=IMAGE), command=["/pause"],
                                    annotations=annotations or {})
        reply = self.cri.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config,
                                      sandbox_config=sandbox_config), timeout=RPC_TIMEOUT)
        return reply.container_id

    def start_container(self, container_id: str) -> None:
        self.cri.StartContainer(self.pb2.StartContainerRequest(container_id=container_id),
                                timeout=RPC_TIMEOUT)

    def remove_pod(self, sandbox_id: str) -> None:
        pb = self.pb2
        self.cri.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id),
                                timeout=RPC_TIMEOUT)
        self.cri.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
                                  timeout=RPC_TIMEOUT)
        self.sandboxes.remove(sandbox_id)

    def remove_pods(self) -> None:
        """Remove every pod still listed, ignoring failures (cleanup)."""
        import grpc

        for sandbox_id in list(self.sandboxes):
            with contextlib.suppress(grpc.RpcError):
                self.remove_pod(sandbox_id)


# ---- the image ------------------------------------------------------------------------

def build_pause(out_dir: Path) -> Path:
    """pause.c compiled with `cc -static`: an image needing no libc."""
    binary = out_dir / "pause"
    run_checked(["cc", "-static", "-Os", "-s", "-o", str(binary), str(E2E_DIR / "pause.c")])
    return binary


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    info.uid = info.gid = 0
    tar.addfile(info, io.BytesIO(data))


def _blob(blobs: dict[str, bytes], data: bytes, media_type: str) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def write_image_archive(path: Path, binary: Path, name: str) -> None:
    """An OCI image layout archive (what `ctr images import` reads) of one image `name`:
    one uncompressed layer holding `binary` as /pause, the entrypoint."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
        _tar_member(layer, "pause", binary.read_bytes(), 0o755)
    layer_bytes = layer_buf.getvalue()
    blobs: dict[str, bytes] = {}
    config = {
        "architecture": ARCH, "os": "linux",
        "config": {"Entrypoint": ["/pause"], "WorkingDir": "/"},
        "rootfs": {"type": "layers",
                   "diff_ids": ["sha256:" + hashlib.sha256(layer_bytes).hexdigest()]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": _blob(blobs, json.dumps(config).encode(),
                        "application/vnd.oci.image.config.v1+json"),
        "layers": [_blob(blobs, layer_bytes, "application/vnd.oci.image.layer.v1.tar")],
    }
    manifest_desc = _blob(blobs, json.dumps(manifest).encode(), manifest["mediaType"])
    manifest_desc["annotations"] = {"io.containerd.image.name": name,
                                    "org.opencontainers.image.ref.name": name.rpartition(":")[2]}
    manifest_desc["platform"] = {"architecture": ARCH, "os": "linux"}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [manifest_desc]}
    with tarfile.open(path, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _tar_member(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _tar_member(tar, "index.json", json.dumps(index).encode())
        for digest, data in sorted(blobs.items()):
            _tar_member(tar, "blobs/sha256/" + digest.partition(":")[2], data)


@dataclass(frozen=True)
class Assets:
    """What every containerd's run shares: the CRI modules, the image archive, the
    snapshotter that works here and nri-accel's configuration."""

    pb2: Any
    pb2_grpc: Any
    image: Path
    snapshotter: str
    config: Path


def build_assets(base: Path) -> Assets:
    """The Assets, built under `base`: the CRI client compiled, the pause image built,
    overlay probed, and nri-accel's configuration (the standalone trust policy, so that
    pod annotations grant; debug logs)."""
    pb2, pb2_grpc = compile_cri(base / "cri")
    image = base / "pause.oci.tar"
    write_image_archive(image, build_pause(base), IMAGE)
    snapshotter = "overlayfs" if overlay_works(base / "overlay-probe") else "native"
    config = base / "nri-accel.toml"
    # debug: the stub logs each non-final chunk of a split Synchronize (sync_chunk)
    config.write_text('[policy]\nmode = "standalone"\n\n[log]\nlevel = "debug"\n')
    return Assets(pb2, pb2_grpc, image, snapshotter, config)


# ---- containerd ---------------------------------------------------------------------

def overlay_works(scratch: Path) -> bool:
    """Whether an overlay mount works here (inside some containers it does not): the
    test containerd mounts done by containerd's overlayfs snapshotter."""
    dirs = {n: scratch / n for n in ("lower", "upper", "work", "merged")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={dirs['lower']},upperdir={dirs['upper']},workdir={dirs['work']}"
    mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts,
                              str(dirs["merged"])], capture_output=True).returncode == 0
    if mounted:
        subprocess.run(["umount", str(dirs["merged"])], check=True)
    return mounted


@dataclass
class Containerd:
    """A containerd with NRI and CRI, everything under `base`, run from `runtime`."""

    runtime: Runtime
    base: Path
    snapshotter: str
    cgroup_parent: str
    proc: subprocess.Popen[bytes] | None = None
    _log_file: Any = field(default=None, repr=False)

    @property
    def bin_dir(self) -> Path:
        return self.runtime.bin_dir

    @property
    def address(self) -> Path:
        return self.base / "containerd.sock"

    @property
    def nri_socket(self) -> Path:
        return self.base / "nri" / "nri.sock"

    @property
    def log_path(self) -> Path:
        return self.base / "containerd.log"

    @property
    def runc_root(self) -> Path:
        return self.base / "runc"

    def config_text(self) -> str:
        """The whole configuration: the common part, then the CRI part of the version."""
        b = self.base
        cri = self._cri_v3() if self.runtime.version >= (2, 0, 0) else self._cri_v2()
        return f"""\
version = {3 if self.runtime.version >= (2, 0, 0) else 2}
root = "{b}/root"
state = "{b}/state"

[grpc]
  address = "{self.address}"

[debug]
  level = "info"
  format = "json"

[plugins."io.containerd.internal.v1.opt"]
  path = "{b}/opt"

[plugins."io.containerd.nri.v1.nri"]
  disable = false
  disable_connections = false
  socket_path = "{self.nri_socket}"
  plugin_path = "{b}/nri/plugins"
  plugin_config_path = "{b}/nri/conf.d"
  plugin_registration_timeout = "5s"
  plugin_request_timeout = "2s"
{cri}"""

    # Both CRI parts say the same: sandbox image = the imported IMAGE; no AppArmor; CRI
    # asks runc for oom_score_adj -998 for a sandbox and lowering it needs
    # CAP_SYS_RESOURCE, which containers (CI) often lack, so it is clamped to containerd's
    # own (restrict_oom_score_adj); no TCP, streaming on loopback; no CDI; runc from
    # bin_dir with its state under base, cgroupfs driver; CNI directories under base (pods
    # use the host network, so no CNI plugin runs).

    def _runc(self, table: str) -> str:
        """The runc runtime, the same in both config versions, under `table` (the CRI
        plugin holding the runtimes): default_runtime_name ends the [table.containerd]
        section it follows."""
        return f"""  default_runtime_name = "runc"

[{table}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{table}.containerd.runtimes.runc.options]
  BinaryName = "{self.bin_dir / 'runc'}"
  Root = "{self.runc_root}"
  SystemdCgroup = false
"""

    def _cri_v2(self) -> str:
        """containerd 1.x: every CRI setting in the plugin io.containerd.grpc.v1.cri."""
        b, cri = self.base, 'plugins."io.containerd.grpc.v1.cri"'
        return f"""
[{cri}]
  sandbox_image = "{IMAGE}"
  disable_apparmor = true
  restrict_oom_score_adj = true
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_cdi = false

[{cri}.containerd]
  snapshotter = "{self.snapshotter}"
{self._runc(cri)}
[{cri}.cni]
  bin_dir = "{b}/cni/bin"
  conf_dir = "{b}/cni/net.d"
"""

    def _cri_v3(self) -> str:
        """containerd 2.x (config version 3, docs/cri/config.md): runtime, CNI and CDI
        settings in io.containerd.cri.v1.runtime, the snapshotter and the pinned sandbox
        image in io.containerd.cri.v1.images, the CRI server in io.containerd.grpc.v1.cri.
        CNI's bin_dir is deprecated in 2.1 for the list bin_dirs."""
        b = self.base
        runtime, images = "plugins.'io.containerd.cri.v1.runtime'", \
            "plugins.'io.containerd.cri.v1.images'"
        return f"""
[{images}]
  snapshotter = "{self.snapshotter}"

[{images}.pinned_images]
  sandbox = "{IMAGE}"

[{runtime}]
  disable_apparmor = true
  restrict_oom_score_adj = true
  enable_cdi = false

[{runtime}.containerd]
{self._runc(runtime)}
[{runtime}.cni]
  bin_dirs = ["{b}/cni/bin"]
  conf_dir = "{b}/cni/net.d"

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    @property
    def plugin_dir(self) -> Path:
        """plugin_path: the pre-registered plugins containerd launches when it starts."""
        return self.base / "nri" / "plugins"

    def start(self) -> None:
        """Start containerd (again, after stop_daemon: its log is appended to) and return
        once it serves."""
        for d in ("nri/plugins", "nri/conf.d", "cni/bin", "cni/net.d", "opt"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        config = self.base / "config.toml"
        config.write_text(self.config_text())
        env = dict(os.environ, PATH=f"{self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop_daemon)
        self.proc = subprocess.Popen([str(self.bin_dir / "containerd"), "--config", str(config)],
                                     stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        wait_for("containerd to serve", self._serving, diagnose=self.diagnose)

    def _serving(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise E2EError(f"containerd exited {self.proc.returncode}\n{self.diagnose()}")
        if not (self.address.exists() and self.nri_socket.exists()):
            return False
        return subprocess.run(self._ctr_argv("version"), capture_output=True).returncode == 0

    def _ctr_argv(self, *args: str) -> list[str]:
        return [str(self.bin_dir / "ctr"), "--address", str(self.address),
                "--namespace", NAMESPACE, *args]

    def ctr(self, *args: str) -> str:
        return run_checked(self._ctr_argv(*args))

    def import_image(self, archive: Path) -> None:
        self.ctr("images", "import", "--snapshotter", self.snapshotter, str(archive))

    def container_spec(self, container_id: str) -> dict[str, Any]:
        """The OCI runtime spec containerd stored for a container."""
        return json.loads(self.ctr("containers", "info", "--spec", container_id))

    def task_state(self, container_id: str) -> dict[str, Any]:
        """runc's state of a started container: its "status" (running, stopped, ...),
        the host "pid" of its process, ..."""
        state = run_checked([str(self.bin_dir / "runc"), "--root",
                             str(self.runc_root / NAMESPACE), "state", container_id])
        return dict(json.loads(state))

    def task_pid(self, container_id: str) -> int:
        """The host pid of a started container's process (from runc's state)."""
        return int(self.task_state(container_id)["pid"])

    def log_entries(self, since: int = 0) -> list[dict[str, Any]]:
        """containerd's log, one dict per JSON line (other lines are skipped), from byte
        offset `since` (a mark())."""
        entries = []
        with open(self.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                entries.append(json.loads(line))
        return entries

    def messages(self, since: int = 0) -> list[str]:
        return [str(e.get("msg", "")) for e in self.log_entries(since)]

    def mark(self) -> int:
        """Where the log ends now: messages(since=mark()) is what containerd logs next."""
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def diagnose(self) -> str:
        """The end of containerd's log, minus the plugin loading chatter."""
        lines = [f"{e.get('level', '?')}: {e.get('msg', '')}"
                 + (f" (error: {e['error']})" if "error" in e else "")
                 for e in self.log_entries() if not str(e.get("msg", "")).startswith(
                     ("loading plugin", "skip loading plugin", "Start cri plugin with config"))]
        return f"--- containerd log ({self.log_path}):\n" + "\n".join(lines[-40:])

    def stop_daemon(self) -> int | None:
        """Stop the containerd process alone (SIGTERM, SIGKILL after 10 s), as a service
        manager restarting it would: shims and containers keep running. Returns its exit
        status (None if it never started)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return None if self.proc is None else self.proc.returncode

    def stop(self) -> None:
        """Stop containerd and remove what it left: shims, runc containers, mounts,
        cgroups, shim sockets. Safe to call after a partial start."""
        shims = self._our_shims()
        self.stop_daemon()
        for pid in shims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._delete_runc_containers()
        self._remove_shim_sockets()
        unmount_under(self.base)
        remove_cgroup(self.cgroup_parent)

    def _our_shims(self) -> list[int]:
        """Pids of the shims serving this containerd: our shim binary (containerd runs
        it by its resolved path), with our socket as its -address."""
        shim = os.path.realpath(self.bin_dir / "containerd-shim-runc-v2")
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                exe = os.readlink(entry / "exe")
                args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            pairs = set(itertools.pairwise(args))
            if exe == shim and ("-address", str(self.address)) in pairs:
                pids.append(int(entry.name))
        return pids

    def _delete_runc_containers(self) -> None:
        root = self.runc_root / NAMESPACE
        if not root.is_dir():
            return
        runc = str(self.bin_dir / "runc")
        for state in root.iterdir():
            subprocess.run([runc, "--root", str(root), "delete", "--force", state.name],
                           capture_output=True)

    def _remove_shim_sockets(self) -> None:
        """containerd puts shim sockets in /run/containerd/s/ whatever its state dir, and
        writes each one's address in the bundle: file `address` (1.7), `bootstrap.json`
        (2.x). A shim removes its own socket on exit, a killed one cannot."""
        bundles = self.base / "state" / "io.containerd.runtime.v2.task" / NAMESPACE
        if not bundles.is_dir():
            return
        addresses = [a.read_text().strip() for a in bundles.glob("*/address")]
        for bootstrap in bundles.glob("*/bootstrap.json"):
            with contextlib.suppress(ValueError, AttributeError):
                addresses.append(str(json.loads(bootstrap.read_text()).get("address", "")))
        for address in addresses:
            sock = address.removeprefix("unix://")
            if sock.startswith("/run/containerd/s/"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(sock)


def unmount_under(base: Path) -> None:
    """Detach every mount at or below `base`, deepest first."""
    prefix = str(base.resolve())
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    for point in sorted(set(points), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def remove_cgroup(parent: str) -> None:
    """Remove the (empty) cgroup `parent` and what runc left below it, in every
    mounted hierarchy (cgroup v1 controllers, or the v2 unified one)."""
    root = Path("/sys/fs/cgroup")
    rel = parent.strip("/")
    if not rel:
        return
    candidates = [root / rel, *(h / rel for h in root.iterdir() if h.is_dir())]
    for top in candidates:
        if not top.is_dir():
            continue
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


# ---- nri-accel ---------------------------------------------------------------------

# The demo inventory's only mount of a directory (the MPS pipe directory); every other
# mount binds a file (library, binary, firmware, socket).
_DIRECTORY_MOUNTS = frozenset({"/tmp/nvidia-mps"})


def placeholder_inventory(source: Path, dest: Path) -> Path:
    """A copy of inventory `source` whose mounts' host paths exist: each is moved under
    dest/host and created there, an empty file (or a directory, see _DIRECTORY_MOUNTS).
    It stands for a node with its driver's files installed, so that runc can bind them
    when the container starts. Device nodes stay as they are: runc creates them in the
    container from their major/minor, without a host node."""
    data = json.loads(source.read_text())
    host = dest / "host"
    edits = [e for d in data["drivers"] for e in d["capabilities"].values()]
    edits += [d["edits"] for d in data["devices"] if "edits" in d]
    for e in edits:
        for m in e.get("mounts", []):
            moved = host / m["host_path"].lstrip("/")
            if m["host_path"] in _DIRECTORY_MOUNTS:
                moved.mkdir(parents=True, exist_ok=True)
            else:
                moved.parent.mkdir(parents=True, exist_ok=True)
                moved.touch()
            m["host_path"] = str(moved)
    out = dest / "inventory.json"
    out.write_text(json.dumps(data, indent=1))
    return out


class PluginLog:
    """What reads an nri-accel's structured log (`log_path`, JSON lines; its stderr
    beside it, `.stderr`)."""

    log_path: Path

    def events(self) -> list[dict[str, Any]]:
        """The plugin's structured log, one dict per line."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.log_path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def event(self, name: str) -> dict[str, Any] | None:
        """The last logged event called `name`, if any."""
        found = [e for e in self.events() if e.get("event") == name]
        return found[-1] if found else None

    def diagnose(self) -> str:
        stderr = self.log_path.with_suffix(".stderr")
        return (f"--- nri-accel log ({self.log_path}):\n{tail(self.log_path)}\n"
                f"--- nri-accel stderr:\n{tail(stderr)}")


def nri_accel_exe() -> Path:
    """This virtualenv's `nri-accel`."""
    exe = Path(sys.executable).parent / "nri-accel"
    if not exe.exists():
        raise E2EError(f"{exe} not found: install the package in this virtualenv "
                       "(make setup)")
    return exe


@dataclass
class Plugin(PluginLog):
    """`nri-accel run` as a subprocess (an external plugin: it connects to `socket`)
    logging JSON lines to `log_path`."""

    socket: Path
    inventory: Path
    config: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _stderr_file: Any = field(default=None, repr=False)

    def start(self) -> None:
        exe = nri_accel_exe()
        env = {k: v for k, v in os.environ.items() if not k.startswith("NRI_PLUGIN_")}
        self.proc = subprocess.Popen(
            [str(exe), "run", "--socket", str(self.socket), "--name", PLUGIN_NAME,
             "--idx", PLUGIN_IDX, "--inventory", str(self.inventory),
             "--config", str(self.config), "--log-file", str(self.log_path),
             "--state-dir", str(self.log_path.parent / "state")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr(),
            env=env)

    def _stderr(self) -> Any:
        self._stderr_file = open(self.log_path.with_suffix(".stderr"), "ab")  # noqa: SIM115
        return self._stderr_file

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 10 s; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._stderr_file is not None:
            self._stderr_file.close()
            self._stderr_file = None
        return self.proc.returncode


@dataclass
class LaunchedPlugin(PluginLog):
    """`nri-accel run` as a pre-registered plugin: containerd runs the file
    <plugin_path>/NN-name itself when it starts (NRI's startPlugins and
    newLaunchedPlugin), with no arguments, NRI_PLUGIN_NAME, NRI_PLUGIN_IDX and
    NRI_PLUGIN_SOCKET=3 as its whole environment, one end of a socketpair as fd 3 and
    stdio on /dev/null. No flag can be passed that way, and the test must not write the
    real /etc/nri-accel/config.toml nor use /run/nri-accel: the file is a shell script
    that execs this virtualenv's nri-accel with the test's --config, --inventory,
    --state-dir and --log-file (its stderr to a file beside the log, for tracebacks
    before logging starts). The name and index still come from containerd's
    environment. install() rewrites it before each containerd start, so that each launch
    logs to its own file."""

    plugin_dir: Path
    inventory: Path
    config: Path
    state_dir: Path
    log_path: Path = field(default=Path("/nonexistent"))

    @property
    def path(self) -> Path:
        return self.plugin_dir / f"{PLUGIN_IDX}-{PLUGIN_NAME}"

    def install(self, log_path: Path) -> None:
        """Write the launcher so that the next launch logs to `log_path`."""
        self.log_path = log_path
        argv = [str(nri_accel_exe()), "run", "--config", str(self.config),
                "--inventory", str(self.inventory), "--state-dir", str(self.state_dir),
                "--log-file", str(log_path)]
        stderr = shlex.quote(str(log_path.with_suffix(".stderr")))
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(".launcher.tmp")
        tmp.write_text("#!/bin/sh\n# written by tests/e2e/containerd_e2e.py (LaunchedPlugin)\n"
                       f"exec {shlex.join(argv)} 2>>{stderr}\n")
        tmp.chmod(0o755)
        tmp.rename(self.path)

    def pids(self) -> list[int]:
        """The live processes of this plugin: nri-accel run with our --state-dir."""
        wanted = ("--state-dir", str(self.state_dir))
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                zombie = (entry / "stat").read_text().rpartition(")")[2].split()[0] == "Z"
            except (OSError, IndexError):
                continue
            if not zombie and "run" in args and wanted in set(itertools.pairwise(args)):
                pids.append(int(entry.name))
        return pids

    def kill(self) -> None:
        """SIGKILL whatever process of this plugin is left (cleanup)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
