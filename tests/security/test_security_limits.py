"""Resource exhaustion and log injection: what a pod author sends is bounded in what the
daemon keeps and parses, and what it logs or sends back is printable and short."""

from __future__ import annotations

import asyncio
import gc
import re
import tracemalloc

import pytest
from demo_node import demo_inventory
from grants import held, key
from security_testing import DEVICE_PLUGIN_KEY, container, engine
from structlog.testing import capture_logs

from nri_accel.engine import ANNOTATION_GRANTED
from nri_accel.errors import RequestError
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.adjust import build_adjustment
from nri_accel.nri.simulator import make_container, make_pod
from nri_accel.plugin import AccelPlugin
from nri_accel.request import MAX_ENV_READ_CHARS
from nri_accel.syntax import MAX_NAME_CHARS

MIB = 1 << 20
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _retained(fn: object, rounds: int) -> int:
    """Bytes still allocated after calling fn(i) for each round (caches included)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(rounds):
            fn(i)  # type: ignore[operator]
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_memos_do_not_keep_large_container_env() -> None:
    # Each container has its own 1 MiB of env that nri-accel does not read, and its own
    # 120 KiB LD_LIBRARY_PATH (which it extends; the longest the kernel would pass on is
    # 128 KiB): none of it may stay behind in a memo.
    eng = engine("standalone")

    def plan(i: int) -> None:
        info = container(cid=f"c{i}", env=[
            "NVIDIA_VISIBLE_DEVICES=0", f"LD_LIBRARY_PATH=/lib{i}:" + "x" * (120 << 10),
            f"JUNK{i}=" + "y" * MIB])
        p = eng.plan(info)
        build_adjustment(p.edits, p.annotations, p.cdi_devices)
        eng.release(info.container_id)

    assert _retained(plan, 16) < 4 * MIB  # 32 MiB would stay if the memos kept them


def test_memos_are_bounded_by_the_text_they_keep_not_only_their_entries() -> None:
    # A pod author in an untrusted namespace, granted nothing, creates containers of
    # distinct values under the bounds on one request: 6.4 KiB of NVIDIA_REQUIRE_* (500
    # constraints: some 150 KiB of parsed objects, which the request, edits and
    # requirement memos kept, thousands of entries each: 700 MiB after 4,200 creates),
    # a 250 KiB annotation under nri-accel's prefix that this container does not read
    # (the request memo's key), and a 250 KiB device-injector value refused for its size
    # (the injector memo kept failures).
    eng = engine()

    def require(i: int) -> None:
        env = [f"NVIDIA_REQUIRE_V{v}=" + " ".join(f"cuda>={i}.{v}{j}" for j in range(25))
               for v in range(20)]
        assert eng.plan(container(env=env, cid=f"c{i}", pod_name=f"p{i}")).devices == ()

    def unread(i: int) -> None:
        big = f"{i:06d}" + "x" * (250 << 10)
        eng.plan(container(pod={"devices.nri-accel.io/container.other": big},
                           cid=f"d{i}", pod_name=f"q{i}"))

    def refused(i: int) -> None:
        big = f"{i:06d}" + "b" * (250 << 10)
        with pytest.raises(RequestError):
            eng.plan(container(pod={"cdi-devices.noderesource.dev/pod": big},
                               cid=f"e{i}", pod_name=f"r{i}"))

    assert _retained(require, 300) < 8 * MIB  # was 45 MiB
    assert _retained(unread, 100) < 4 * MIB  # was 25 MiB
    assert _retained(refused, 100) < 4 * MIB  # was 25 MiB


def test_a_short_range_is_charged_for_the_ids_it_makes() -> None:
    # "nvidia.com/gpu=0-255" is 20 characters and 256 ids: charged for its text alone,
    # 3,900 distinct ones fit the devices memo and kept 58.8 MiB.
    from nri_accel import request as request_module

    parse_devices = request_module._parse_devices
    parse_devices.memo.clear()

    def ranges(i: int) -> None:
        first = i % 200
        parse_devices(f"nvidia.com/gpu={first}-{first + 255}",
                      f"annotation devices.nri-accel.io/container.c{i // 200}")

    assert _retained(ranges, 3900) < 4 * MIB


def test_the_grants_of_one_image_share_its_requirements_in_the_memo() -> None:
    # Every grant of a CUDA image holds the same parsed NVIDIA_REQUIRE_CUDA (a CUDA 12
    # image's: some 1,200 characters): charged once, 254 distinct grants stay remembered
    # (charged each, the grant memo held some 200 and started over: 19 -> 73 us a plan).
    from itertools import combinations, product

    require = "cuda>=12.4 " + " ".join(f"brand=tesla,driver>={d},driver<{d + 1}"
                                         for d in range(470, 560, 3))
    eng = engine("standalone")
    n = 0
    for caps, r in product(("compute,utility", "compute,utility,video"), range(1, 8)):
        env = (f"NVIDIA_REQUIRE_CUDA={require}", f"NVIDIA_DRIVER_CAPABILITIES={caps}")
        for subset in combinations(range(7), r):  # the demo's GPU 7 is in MIG mode
            ids = ",".join(map(str, subset))
            plan = eng.plan(container(pod={"devices.nri-accel.io/pod": f"nvidia.com/gpu={ids}"},
                                      env=env, cid=f"c{n}", pod_name=f"p{n}"))
            assert len(plan.devices) == len(subset)
            n += 1
    memo = eng._tables.catalog.memo
    assert (n, len(memo)) == (254, 254)
    assert memo.held_chars < 64 * 1024


def test_variables_nri_accel_reads_are_bounded_in_total() -> None:
    many = [f"NVIDIA_REQUIRE_X{i}=" + ",".join(["cuda>=1.0"] * 300) for i in range(500)]
    with pytest.raises(RequestError, match=f"more than {MAX_ENV_READ_CHARS}") as err:
        engine().plan(container(ctr={DEVICE_PLUGIN_KEY: "nvidia.com/gpu=0"}, env=many))
    assert err.value.source.startswith("env NVIDIA_REQUIRE_X")
    dup = ["NVIDIA_VISIBLE_DEVICES=" + "0," * 2000 + "0"] * 10
    with pytest.raises(RequestError, match="more than"):
        engine().plan(container(env=dup))
    # Variables it does not read are not counted.
    ok = engine().plan(container(ctr={DEVICE_PLUGIN_KEY: "nvidia.com/gpu=0"},
                                 env=[f"OTHER{i}=" + "z" * 4000 for i in range(100)]))
    assert ok.qualified_names == ("nvidia.com/gpu=0",)


HOSTILE_NAME = "\x1b]2;pwned\x07\n{\"level\":\"error\"}" + "k" * 5000


@pytest.mark.parametrize("where", [
    {"pod": {"devices.nri-accel.io/" + HOSTILE_NAME: "x"}},
    {"pod": {"cdi.k8s.io/" + HOSTILE_NAME: "not a name"}},
    {"ctr": {"cdi.k8s.io/" + HOSTILE_NAME: "not a name"}},
    {"env": [f"NVIDIA_REQUIRE_{HOSTILE_NAME}=cuda>=1"]},
])
def test_errors_name_hostile_keys_printably_and_briefly(where: dict[str, object]) -> None:
    with pytest.raises(RequestError) as err:
        engine("standalone").plan(container(**where))  # type: ignore[arg-type]
    text = str(err.value)
    assert not CONTROL.search(text) and len(err.value.source) < MAX_NAME_CHARS
    assert len(text) < 1024


@pytest.mark.usefixtures("all_logs")
def test_log_lines_escape_control_characters_in_names() -> None:
    pod = make_pod({"name": "p\n{\"event\":\"forged\"}", "namespace": "ns\x1b[2J"})
    accel = AccelPlugin(engine("standalone"))
    # (a grant records a name of at most 253 characters: the long one is refused's)
    ok = make_container(pod, {"name": "c\x1b[31m" + "n" * 200, "annotations": {
        "devices.nri-accel.io": "nvidia.com/gpu=0"}})
    bad = make_container(pod, {"name": "d\r\x00" + "n" * 1000, "annotations": {
        "devices.nri-accel.io": "nvidia.com/gpu=" + "9" * 100 + "\x1b"}})
    with capture_logs() as logs:
        accel.create_container(pod, ok)
        with pytest.raises(RequestError):
            accel.create_container(pod, bad)
    assert [e["event"] for e in logs] == ["container_created", "container_refused"]
    for line in logs:
        for field in ("namespace", "pod", "container", "error", "source"):
            value = line.get(field, "")
            assert not CONTROL.search(value) and len(value) < 1100, (field, value)


def test_synchronize_with_many_containers_and_junk_records() -> None:
    eng = engine("standalone")
    pod = make_pod({"name": "p"})
    junk = ["x" * 65536, ",".join(["a/b=c"] * 5000), "nvidia.com/gpu=", "\x00\n", "=,=,="]
    containers = [pb.Container(id=f"c{i}", pod_sandbox_id=pod.id,
                               state=pb.CONTAINER_RUNNING,
                               annotations={ANNOTATION_GRANTED: junk[i % len(junk)]})
                  for i in range(2000)]
    gpu2 = key(demo_inventory(), "nvidia.com/gpu=2")
    real = make_container(pod, {"name": "real", "state": "CONTAINER_RUNNING",
                                "annotations": {ANNOTATION_GRANTED: gpu2}})
    asyncio.run(AccelPlugin(eng).synchronize([pod], [*containers, real]))
    assert held(eng) == {real.id: ("nvidia.com/gpu=2",)}
