"""Static checks of the Kubernetes examples (docker/k8s/): no cluster, the YAML is parsed and the fields
that must agree are compared: the container's arguments parse as `glimpse serve` flags, its ports and
probes match them, /dev/shm is a memory volume at least as large as the shm budget, GPUs match the
replicas, and the InferencePool selects the Deployment's pods and points at the picker's Service."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.cli import build_parser

K8S = Path(__file__).resolve().parent.parent / "docker" / "k8s"
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6, "G": 10**9}


def documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(kind: str, name_suffix: str = "") -> dict[str, Any]:
    [doc] = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    return doc


def quantity(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


@pytest.fixture(scope="module")
def server() -> dict[str, Any]:
    deployment = one("Deployment", "-7b")
    [container] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "glimpse"]
    return {"deployment": deployment, "container": container, "pod": deployment["spec"]["template"]}


@pytest.fixture(scope="module")
def flags(server: dict[str, Any]) -> argparse.Namespace:
    # The image's entrypoint is `glimpse serve --host 0.0.0.0`; the container's args follow it.
    args: argparse.Namespace = build_parser().parse_args(["serve", "--host", "0.0.0.0", *server["container"]["args"]])
    return args


def test_every_document_is_a_known_kind() -> None:
    kinds = sorted(d["kind"] for d in documents())
    assert {"Deployment", "Service", "InferencePool", "HTTPRoute"} <= set(kinds), kinds
    pool = one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"


def test_ports_match_the_serve_flags(server: dict[str, Any], flags: argparse.Namespace) -> None:
    ports = {p["name"]: p["containerPort"] for p in server["container"]["ports"]}
    assert ports["http"] == flags.port
    service = one("Service", "-7b")
    [http] = service["spec"]["ports"]
    assert http["targetPort"] in ("http", flags.port)
    assert service["spec"]["selector"].items() <= server["pod"]["metadata"]["labels"].items()
    # One KV-event port per replica: the flag's port plus the replica.
    base = int(flags.kv_events_endpoint.rsplit(":", 1)[1])
    assert sorted(v for k, v in ports.items() if k.startswith("kv-events")) == [base + r for r in range(flags.dp)]


def test_probes_ask_health_on_the_http_port(server: dict[str, Any]) -> None:
    container = server["container"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"]) == ("/health", "http"), probe
    # The start-up probe must outlast a model load (minutes), so liveness never kills a loading pod.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_shared_memory_is_a_memory_volume_above_the_budget(server: dict[str, Any], flags: argparse.Namespace) -> None:
    spec = server["pod"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in server["container"]["volumeMounts"]}
    [volume] = [v for v in spec["volumes"] if v["name"] == mounts["/dev/shm"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert quantity(volume["emptyDir"]["sizeLimit"]) >= flags.shm_budget_mb << 20


def test_gpus_match_the_replicas(server: dict[str, Any], flags: argparse.Namespace) -> None:
    assert int(server["container"]["resources"]["limits"]["nvidia.com/gpu"]) == flags.dp * flags.tp


def test_the_drain_fits_the_grace_period(server: dict[str, Any], flags: argparse.Namespace) -> None:
    assert server["pod"]["spec"]["terminationGracePeriodSeconds"] > flags.drain_timeout


def test_the_pool_selects_the_deployment_and_points_at_its_picker(server: dict[str, Any], flags: argparse.Namespace) -> None:
    pool = one("InferencePool")["spec"]
    assert pool["selector"]["matchLabels"].items() <= server["pod"]["metadata"]["labels"].items()
    assert [p["number"] for p in pool["targetPorts"]] == [flags.port]
    epp_service = one("Service", "-epp")
    assert pool["endpointPickerRef"]["name"] == epp_service["metadata"]["name"]
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp_service["spec"]["ports"]]
    epp = one("Deployment", "-epp")
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == one("InferencePool")["metadata"]["name"]
    assert epp_service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    [rule] = one("HTTPRoute")["spec"]["rules"]
    assert rule["backendRefs"][0]["kind"] == "InferencePool"
    assert rule["backendRefs"][0]["name"] == one("InferencePool")["metadata"]["name"]
