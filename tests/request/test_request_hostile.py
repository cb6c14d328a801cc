"""Hostile input: paths in ids, oversized values, control characters, LD_PRELOAD, an
unprivileged namespace asking for everything, ids that do not exist."""

from __future__ import annotations

import pytest
from request_testing import CUDA_IMAGE_ENV, KUBERNETES, STANDALONE, info, parse

from nri_accel.errors import PolicyError, RequestError
from nri_accel.syntax import MAX_VALUE_BYTES

POD = "devices.nri-accel.io/pod"

PATHS = ["../../../dev/mem", "/proc/self/root", "/dev/nvidia0", "..", ".", "a/../b",
         "/host/etc/shadow", "0/../../proc", "GPU-x/../../..", "~root", "$(id)", "0;rm",
         "nvidia0\\..\\x", "%2e%2e%2f"]


@pytest.mark.parametrize("ident", PATHS)
@pytest.mark.parametrize("where", ["annotation", "env", "neuron", "cdi", "nv_gpu"])
def test_paths_are_never_ids(ident: str, where: str) -> None:
    kwargs: dict[str, object]
    if where == "annotation":
        kwargs, source = {"pod": {POD: f"nvidia.com/gpu={ident}"}}, f"annotation {POD}"
    elif where == "env":
        kwargs, source = ({"env": [f"NVIDIA_VISIBLE_DEVICES={ident}"]},
                          "env NVIDIA_VISIBLE_DEVICES")
    elif where == "nv_gpu":
        kwargs, source = {"env": [f"NV_GPU={ident}"]}, "env NV_GPU"
    elif where == "neuron":
        kwargs, source = ({"env": [f"AWS_NEURON_VISIBLE_DEVICES={ident}"]},
                          "env AWS_NEURON_VISIBLE_DEVICES")
    else:
        kwargs, source = ({"ctr": {"cdi.k8s.io/x": f"vendor.com/dev={ident}"}},
                          "container annotation cdi.k8s.io/x")
    with pytest.raises(RequestError) as err:
        parse(STANDALONE, **kwargs)
    assert err.value.source == source
    assert not isinstance(err.value, PolicyError)


@pytest.mark.parametrize("kind", ["../nvidia.com/gpu", "/dev/gpu", "nvidia.com/../gpu",
                                  "nvidia.com/gpu/..", "nvidia.com/", "/gpu"])
def test_paths_are_never_kinds(kind: str) -> None:
    with pytest.raises(RequestError, match="invalid device kind"):
        parse(pod={POD: f"{kind}=0"})


def test_ld_preload_and_friends_have_no_effect() -> None:
    clean = STANDALONE.request_for(info(env=CUDA_IMAGE_ENV))
    hostile = STANDALONE.request_for(info(env=(
        *CUDA_IMAGE_ENV,
        "LD_PRELOAD=/tmp/evil.so",
        "LD_LIBRARY_PATH=/tmp",
        "LD_AUDIT=/tmp/audit.so",
        "NVIDIA_CTK_DEBUG=true",
        "PATH=/tmp:/usr/bin",
        "NVIDIA_VISIBLE_DEVICESX=/proc",  # a different variable: never read
    )))
    assert hostile == clean


def test_oversized_values_rejected() -> None:
    big = "nvidia.com/gpu=" + "0," * MAX_VALUE_BYTES
    with pytest.raises(RequestError, match=f"longer than {MAX_VALUE_BYTES} bytes") as err:
        parse(pod={POD: big})
    assert err.value.source == f"annotation {POD}"
    for var in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_REQUIRE_CUDA", "NVIDIA_DRIVER_CAPABILITIES",
                "AWS_NEURON_VISIBLE_DEVICES", "NV_GPU", "CUDA_VERSION"):
        with pytest.raises(RequestError, match="longer than") as err:
            parse(KUBERNETES, env=[f"{var}=" + "1" * (MAX_VALUE_BYTES + 1)])
        assert err.value.source == f"env {var}"


def test_multibyte_values_are_measured_in_bytes() -> None:
    with pytest.raises(RequestError, match="longer than"):
        parse(pod={POD: "é" * (MAX_VALUE_BYTES // 2 + 1)})


@pytest.mark.parametrize("char", ["\x00", "\x1b", "\t", "\r", "\x7f", "\x85"])
def test_control_characters_rejected(char: str) -> None:
    with pytest.raises(RequestError, match="control characters") as err:
        parse(pod={POD: f"nvidia.com/gpu=0{char}"})
    assert err.value.source == f"annotation {POD}"
    with pytest.raises(RequestError, match="control characters") as err:
        parse(env=[f"NVIDIA_VISIBLE_DEVICES=0{char}"])
    assert err.value.source == "env NVIDIA_VISIBLE_DEVICES"


def test_newline_is_an_error_in_env_but_a_separator_in_annotations() -> None:
    with pytest.raises(RequestError, match="control characters"):
        parse(env=["NVIDIA_VISIBLE_DEVICES=0\n1"])
    assert parse(pod={POD: "nvidia.com/gpu=0\nnvidia.com/gpu=1"}).grants[0].ids == ("0", "1")


def test_malformed_env_fails_even_where_env_would_be_ignored() -> None:
    with pytest.raises(RequestError) as err:
        parse(KUBERNETES, env=["NVIDIA_VISIBLE_DEVICES=../../dev/mem"])
    assert err.value.source == "env NVIDIA_VISIBLE_DEVICES"


def test_unprivileged_namespace_asking_for_all_is_refused() -> None:
    for value in ("nvidia.com/gpu=all", "nvidia.com/gpu: 8", "aws.amazon.com/neuron=all"):
        with pytest.raises(PolicyError, match="namespace 'default'"):
            parse(KUBERNETES, pod={POD: value})
    req = parse(KUBERNETES, env=["NVIDIA_VISIBLE_DEVICES=all", "AWS_NEURON_VISIBLE_DEVICES=ALL",
                                 "NVIDIA_DRIVER_CAPABILITIES=all"])
    assert req.grants == () and len(req.notes) == 2


def test_unknown_ids_keep_their_source_for_the_selector() -> None:
    req = parse(pod={POD: "nvidia.com/gpu=99,GPU-does-not-exist"})
    assert [(c.ids, c.source) for c in req.grants] == [
        (("99", "GPU-does-not-exist"), f"annotation {POD}")]


def test_yaml_alias_bomb_is_refused() -> None:
    # "Billion laughs": nested aliases; PyYAML shares the nodes, the shape check refuses it.
    lines = ["- &l0 [vendor.com/dev=a, vendor.com/dev=a, vendor.com/dev=a]"]
    lines += [f"- &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 12)]
    with pytest.raises(RequestError, match="expected a YAML list of CDI device names"):
        parse(pod={"cdi-devices.noderesource.dev/pod": "\n".join(lines)})


def test_yaml_tags_are_not_constructed() -> None:
    with pytest.raises(RequestError, match="not a YAML list"):
        parse(pod={"cdi-devices.noderesource.dev/pod": "!!python/object/apply:os.system [id]"})


def test_overlong_id_rejected() -> None:
    with pytest.raises(RequestError, match="invalid device id"):
        parse(pod={POD: "nvidia.com/gpu=" + "a" * 129})


# Characters a name is never shown with raw (in refusals, logs and the runtime's error):
# bidi controls (they reorder what follows: "cdi.k8s.io/\u202egpj.x" reads as x.jpg),
# zero-width and other format characters, line and paragraph separators.
UNPRINTABLE = ["\u202e", "\u202a", "\u200e", "\u200f", "\u2066", "\u2069", "\u200b",
               "\ufeff", "\u00ad", "\u2028", "\u2029"]


@pytest.mark.parametrize("char", UNPRINTABLE)
def test_keys_with_format_characters_are_shown_escaped(char: str) -> None:
    key = f"cdi.k8s.io/a{char}b"
    with pytest.raises(RequestError) as err:
        parse(ctr={key: "not-a-cdi-name"})
    assert err.value.source == f"container annotation {key!r}..."
    assert char not in str(err.value)


@pytest.mark.parametrize("char", UNPRINTABLE)
def test_variable_names_with_format_characters_are_refused_escaped(char: str) -> None:
    var = f"NVIDIA_REQUIRE_{char}X"
    with pytest.raises(RequestError) as err:
        parse(env=[f"{var}=cuda>=12", "NVIDIA_VISIBLE_DEVICES=all"])
    assert err.value.source == f"env {var!r}..."
    assert err.value.message == ("variable name with unprintable characters (control, "
                                 "format or bidi) or longer than the limit")
    assert char not in str(err.value)


def test_format_characters_in_values_are_refused_by_the_grammar_not_as_control() -> None:
    # check_text refuses control characters only: values are ids and names, which refuse
    # the rest themselves (and quote it escaped).
    with pytest.raises(RequestError) as err:
        parse(pod={POD: "nvidia.com/gpu=0\u202e1"})
    assert err.value.message == ("invalid device id '0\\u202e1': ids are names such as 0, "
                                 "GPU-<uuid>, 0:1 or 0000:3b:00.0, never paths")
