"""The trust policy: who may grant, who may only narrow, refusals and notes, in kubernetes
mode (default), with trusted namespaces, and in standalone mode."""

from __future__ import annotations

import pytest
from request_testing import (
    CUDA_IMAGE_ENV,
    KUBERNETES,
    STANDALONE,
    TRUSTING_GPU_OPERATOR,
    UUID0,
    claims,
    nv,
    nvidia_none,
    parse,
)

from nri_accel.config import parse_config
from nri_accel.errors import PolicyError
from nri_accel.policy import Policy, Verdict
from nri_accel.request import Origin

GPU, NEURON = "nvidia.com/gpu", "aws.amazon.com/neuron"
PLUGIN = {"devices.nri-accel.io": f"nvidia.com/gpu={UUID0}"}  # kubelet, from Allocate
PLUGIN_SRC = "container annotation devices.nri-accel.io"
POD = "devices.nri-accel.io/pod"
VIS = "env NVIDIA_VISIBLE_DEVICES"


# ---- Policy itself --------------------------------------------------------------------------

def test_policy_from_config() -> None:
    config = parse_config({"policy": {"mode": "standalone", "trusted_namespaces": ["a"]}})
    assert Policy.from_config(config) == Policy("standalone", frozenset({"a"}))
    assert Policy.from_config(parse_config({})) == Policy("kubernetes", frozenset())


@pytest.mark.parametrize(("policy", "origin", "namespace", "granted", "verdict"), [
    (KUBERNETES, Origin.CONTAINER, "default", False, Verdict.GRANT),
    (KUBERNETES, Origin.POD, "default", False, Verdict.REFUSE),
    (KUBERNETES, Origin.ENV, "default", False, Verdict.IGNORE),
    (KUBERNETES, Origin.POD, "default", True, Verdict.LIMIT),
    (KUBERNETES, Origin.ENV, "default", True, Verdict.LIMIT),
    (KUBERNETES, Origin.ENV, "", False, Verdict.IGNORE),
    (TRUSTING_GPU_OPERATOR, Origin.POD, "gpu-operator", False, Verdict.GRANT),
    (TRUSTING_GPU_OPERATOR, Origin.ENV, "gpu-operator", False, Verdict.GRANT),
    (TRUSTING_GPU_OPERATOR, Origin.ENV, "gpu-operator", True, Verdict.LIMIT),
    (TRUSTING_GPU_OPERATOR, Origin.POD, "default", False, Verdict.REFUSE),
    (STANDALONE, Origin.POD, "", False, Verdict.GRANT),
    (STANDALONE, Origin.ENV, "default", False, Verdict.GRANT),
    (STANDALONE, Origin.ENV, "default", True, Verdict.LIMIT),
])
def test_decide(policy: Policy, origin: Origin, namespace: str, granted: bool,
                verdict: Verdict) -> None:
    assert policy.decide(origin, namespace, vendor_granted=granted) is verdict


# ---- kubernetes mode, untrusted namespace -------------------------------------------------

def test_cuda_image_env_alone_is_ignored_with_a_note() -> None:
    req = parse(KUBERNETES, env=CUDA_IMAGE_ENV)
    assert req.grants == () and req.limits == ()
    assert req.notes == (
        "env NVIDIA_VISIBLE_DEVICES=all not granted: env requests may not grant devices in "
        "namespace 'default'; allocate through the device plugin or add the namespace to "
        "policy.trusted_namespaces",)
    # capabilities and requirements come from any source
    assert nv(req).capabilities == {"compute", "utility"}
    assert nv(req).requirements is not None


def test_pod_annotation_without_allocation_is_refused() -> None:
    with pytest.raises(PolicyError) as err:
        parse(KUBERNETES, pod={POD: "nvidia.com/gpu=all"})
    assert str(err.value) == (
        "annotation devices.nri-accel.io/pod: pod annotations may not grant devices in "
        "namespace 'default'; allocate through the device plugin or add the namespace to "
        "policy.trusted_namespaces")


def test_device_plugin_annotation_grants() -> None:
    req = parse(KUBERNETES, ctr=PLUGIN, env=CUDA_IMAGE_ENV)
    assert claims(req) == [(GPU, (UUID0,), None, False, PLUGIN_SRC)]
    assert req.limits == ()  # NVIDIA_VISIBLE_DEVICES=all narrows nothing
    assert req.notes == ()


def test_env_narrows_an_allocation() -> None:
    ctr = {"devices.nri-accel.io": "nvidia.com/gpu=0,1"}
    req = parse(KUBERNETES, ctr=ctr, env=["NVIDIA_VISIBLE_DEVICES=1"])
    assert claims(req) == [(GPU, ("0", "1"), None, False, PLUGIN_SRC)]
    assert claims(req, "limits") == [(GPU, ("1",), None, False, VIS)]


def test_pod_annotation_narrows_an_allocation() -> None:
    ctr = {"devices.nri-accel.io": "nvidia.com/gpu: 2"}
    req = parse(KUBERNETES, ctr=ctr, pod={POD: "nvidia.com/gpu: 1"})
    assert claims(req) == [(GPU, (), 2, False, PLUGIN_SRC)]
    assert claims(req, "limits") == [(GPU, (), 1, False, f"annotation {POD}")]


def test_narrowing_is_per_vendor_gpu_and_mig_together() -> None:
    req = parse(KUBERNETES, ctr={"devices.nri-accel.io": "nvidia.com/mig=0:1"},
                env=["NVIDIA_VISIBLE_DEVICES=all"])
    assert req.limits == () and req.notes == ()  # all over a MIG grant: nothing to do
    req = parse(KUBERNETES, ctr={"devices.nri-accel.io": "nvidia.com/mig=0:1"},
                env=["NVIDIA_VISIBLE_DEVICES=0:1"])
    assert claims(req, "limits") == [(GPU, ("0:1",), None, False, VIS)]


def test_pod_annotation_for_another_vendor_is_refused() -> None:
    with pytest.raises(PolicyError) as err:
        parse(KUBERNETES, ctr=PLUGIN, pod={POD: "aws.amazon.com/neuron=0"})
    assert err.value.source == f"annotation {POD}"


def test_env_for_another_vendor_is_ignored() -> None:
    req = parse(KUBERNETES, ctr=PLUGIN, env=["AWS_NEURON_VISIBLE_DEVICES=ALL"])
    assert claims(req) == [(GPU, (UUID0,), None, False, PLUGIN_SRC)]
    assert req.limits == ()
    assert req.notes == ("env AWS_NEURON_VISIBLE_DEVICES=ALL not granted: env requests may "
                         "not grant devices in namespace 'default'; allocate through the "
                         "device plugin or add the namespace to policy.trusted_namespaces",)


def test_none_over_an_allocation_narrows_to_the_driver_only() -> None:
    req = parse(KUBERNETES, ctr=PLUGIN, env=["NVIDIA_VISIBLE_DEVICES=none"])
    assert nvidia_none(req) is True
    assert len(req.grants) == 1  # select drops every nvidia.com device under nvidia_none


def test_none_without_allocation_is_ignored() -> None:
    req = parse(KUBERNETES, env=["NVIDIA_VISIBLE_DEVICES=none"])
    assert nvidia_none(req) is False
    assert req.notes[0].startswith("env NVIDIA_VISIBLE_DEVICES=none not granted: ")


def test_mig_caps_refused_where_env_may_not_grant() -> None:
    with pytest.raises(PolicyError) as err:
        parse(KUBERNETES, ctr=PLUGIN, env=["NVIDIA_MIG_CONFIG_DEVICES=all"])
    assert err.value.source == "env NVIDIA_MIG_CONFIG_DEVICES"
    req = parse(TRUSTING_GPU_OPERATOR, namespace="gpu-operator",
                env=["NVIDIA_MIG_MONITOR_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=all"])
    assert nv(req).mig_monitor is True


def test_long_values_are_shortened_in_notes() -> None:
    ids = ",".join(f"GPU-{i:04d}" for i in range(40))
    [note] = parse(KUBERNETES, env=[f"NVIDIA_VISIBLE_DEVICES={ids}"]).notes
    assert note.startswith(f"env NVIDIA_VISIBLE_DEVICES={ids[:61]}... not granted")


def test_empty_namespace_is_named_in_the_reason() -> None:
    with pytest.raises(PolicyError, match="a container with no namespace"):
        parse(KUBERNETES, namespace="", pod={POD: "nvidia.com/gpu=0"})


# ---- CDI requests ---------------------------------------------------------------------------

def test_cdi_container_annotation_grants_in_kubernetes() -> None:
    req = parse(KUBERNETES, ctr={"cdi.k8s.io/nvidia.com_gpu-0": "nvidia.com/gpu=0"},
                env=["NVIDIA_VISIBLE_DEVICES=all"])
    assert req.cdi_names == ("nvidia.com/gpu=0",)
    assert req.notes == ()


@pytest.mark.parametrize("key", ["cdi.k8s.io/x", "nvidia.cdi.k8s.io/x",
                                 "cdi-devices.noderesource.dev/pod"])
def test_cdi_pod_annotations_are_untrusted(key: str) -> None:
    value = "- nvidia.com/gpu=0" if key.startswith("cdi-devices") else "nvidia.com/gpu=0"
    with pytest.raises(PolicyError) as err:
        parse(KUBERNETES, pod={key: value})
    assert err.value.source == f"annotation {key}"
    granted = parse(TRUSTING_GPU_OPERATOR, namespace="gpu-operator", pod={key: value})
    assert granted.cdi_names == ("nvidia.com/gpu=0",)


def test_cdi_pod_annotation_narrows_an_allocation() -> None:
    req = parse(KUBERNETES, ctr={"devices.nri-accel.io": "nvidia.com/gpu=0,1"},
                pod={"cdi.k8s.io/x": "nvidia.com/gpu=1"})
    assert [(c.ids, c.cdi) for c in req.limits] == [(("1",), True)]
    assert req.cdi_names == ()  # only granted CDI requests are handed on


# ---- a container annotation copied from the pod is a pod annotation -----------------------

@pytest.mark.parametrize("key", ["devices.nri-accel.io", "cdi.k8s.io/gpu"])
def test_copied_container_annotation_is_not_trusted(key: str) -> None:
    value = "nvidia.com/gpu=0"
    with pytest.raises(PolicyError) as err:  # CRI-O copies pod annotations to the container
        parse(KUBERNETES, pod={key: value}, ctr={key: value})
    assert err.value.source == f"annotation {key}"


def test_container_annotation_differing_from_the_pods_is_not_trusted() -> None:
    key = "devices.nri-accel.io"
    with pytest.raises(PolicyError) as err:
        parse(KUBERNETES, pod={key: "nvidia.com/gpu=all"}, ctr={key: "nvidia.com/gpu=0"})
    # the pod's own value is refused first; without it the container copy is named
    assert err.value.source == f"annotation {key}"
    with pytest.raises(PolicyError) as err:
        parse(KUBERNETES, pod={key: ""}, ctr={key: "nvidia.com/gpu=0"})
    assert err.value.source == f"container annotation {key} (also set on the pod)"


def test_pod_key_with_another_suffix_does_not_taint_kubelets_annotation() -> None:
    req = parse(KUBERNETES, pod={POD: "nvidia.com/gpu=0"}, ctr=PLUGIN)
    assert claims(req) == [(GPU, (UUID0,), None, False, PLUGIN_SRC)]
    assert claims(req, "limits") == [(GPU, ("0",), None, False, f"annotation {POD}")]


def test_copy_in_standalone_is_granted_once() -> None:
    key = "devices.nri-accel.io"
    req = parse(STANDALONE, pod={key: "nvidia.com/gpu=0"}, ctr={key: "nvidia.com/gpu=0"})
    assert claims(req) == [(GPU, ("0",), None, False, f"annotation {key}")]


# ---- trusted namespaces ---------------------------------------------------------------------

def test_trusted_namespace_env_grants() -> None:
    req = parse(TRUSTING_GPU_OPERATOR, namespace="gpu-operator", env=CUDA_IMAGE_ENV)
    assert claims(req) == [(GPU, (), None, True, VIS)]
    assert req.notes == ()


def test_trusted_namespace_pod_annotation_grants_and_env_narrows_it() -> None:
    req = parse(TRUSTING_GPU_OPERATOR, namespace="gpu-operator",
                pod={POD: "nvidia.com/gpu=0,1"}, env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert claims(req) == [(GPU, ("0", "1"), None, False, f"annotation {POD}")]
    assert claims(req, "limits") == [(GPU, ("0",), None, False, VIS)]


def test_trusted_namespace_env_cannot_widen_an_allocation() -> None:
    req = parse(TRUSTING_GPU_OPERATOR, namespace="gpu-operator", ctr=PLUGIN,
                env=CUDA_IMAGE_ENV)
    assert claims(req) == [(GPU, (UUID0,), None, False, PLUGIN_SRC)]
    assert req.limits == ()


def test_trusted_namespace_is_exact() -> None:
    with pytest.raises(PolicyError):
        parse(TRUSTING_GPU_OPERATOR, namespace="gpu-operator-x", pod={POD: "nvidia.com/gpu=0"})


# ---- standalone -----------------------------------------------------------------------------

def test_standalone_env_and_annotations_grant_each_vendor() -> None:
    req = parse(STANDALONE, pod={POD: "aws.amazon.com/neuron=0"},
                env=["NVIDIA_VISIBLE_DEVICES=1", "AWS_NEURON_VISIBLE_DEVICES=ALL"])
    assert claims(req) == [(NEURON, ("0",), None, False, f"annotation {POD}"),
                           (GPU, ("1",), None, False, VIS)]
    assert req.limits == ()  # AWS_NEURON_VISIBLE_DEVICES=ALL under a neuron grant: no-op


def test_standalone_none_grants_the_driver_only() -> None:
    req = parse(STANDALONE, env=["NVIDIA_VISIBLE_DEVICES=none"])
    assert nvidia_none(req) is True and req.grants == ()


def test_demoted_container_annotation_ranks_with_the_pods() -> None:
    key = "devices.nri-accel.io"
    req = parse(KUBERNETES, pod={key: ""},
                ctr={key: "nvidia.com/gpu=1", "cdi.k8s.io/a": "nvidia.com/gpu=0,nvidia.com/gpu=1"})
    assert req.cdi_names == ("nvidia.com/gpu=0", "nvidia.com/gpu=1")
    assert claims(req, "limits") == [
        (GPU, ("1",), None, False, f"container annotation {key} (also set on the pod)")]


# ---- the same request again (Policy.request_for remembers them) --------------------------

def test_a_request_asked_again_gets_the_same_answer_and_its_own_namespace_verdict() -> None:
    asked = {"devices.nri-accel.io/pod": "nvidia.com/gpu=0"}
    trusted = parse(TRUSTING_GPU_OPERATOR, pod=asked, namespace="gpu-operator")
    again = parse(TRUSTING_GPU_OPERATOR, pod={**asked, "unrelated": "x"},
                  namespace="gpu-operator", env=("PATH=/bin",))
    assert again == trusted and claims(again)[0][:2] == ("nvidia.com/gpu", ("0",))
    for _ in range(2):  # a refusal is refused every time, never remembered as an answer
        with pytest.raises(PolicyError):
            parse(TRUSTING_GPU_OPERATOR, pod=asked, namespace="default")
    other = parse(TRUSTING_GPU_OPERATOR, pod={"devices.nri-accel.io/pod": "nvidia.com/gpu=1"},
                  namespace="gpu-operator")
    assert claims(other)[0][1] == ("1",)
    named = parse(STANDALONE, pod={"devices.nri-accel.io/container.main": "nvidia.com/gpu=2"})
    assert claims(named)[0][1] == ("2",)
    assert parse(STANDALONE, pod={"devices.nri-accel.io/container.main": "nvidia.com/gpu=2"},
                 container="sidecar").grants == ()
