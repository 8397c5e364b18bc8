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
    # One KV-event port for the pod: every replica publishes on the flag's socket.
    assert ports["kv-events"] == int(flags.kv_events_endpoint.rsplit(":", 1)[1])
    assert not [k for k in ports if k.startswith("kv-events") and k != "kv-events"]


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


# ---- docker/k8s/llm-d/: llm-d's router with the precise prefix-cache scorer ------------------------------------

LLMD = K8S / "llm-d"


def llmd_documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(LLMD.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def llmd_one(kind: str, name_suffix: str = "") -> dict[str, Any]:
    [doc] = [d for d in llmd_documents() if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    return doc


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.fixture(scope="module")
def llmd() -> dict[str, Any]:
    deployment = llmd_one("Deployment", "-llmd")
    [container] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "glimpse"]
    # The picker's own configuration, as the EPP reads it from the ConfigMap.
    epp_config = yaml.safe_load(llmd_one("ConfigMap", "-epp")["data"]["config.yaml"])
    plugins = {p["type"]: p.get("parameters", {}) for p in epp_config["plugins"]}
    args = container["args"]
    parsed = build_parser().parse_args(["serve", "--host", "0.0.0.0", *args])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return {"deployment": deployment, "container": container, "flags": parsed, "args": args, "ports": ports,
            "config": epp_config, "plugins": plugins}


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_llmd_block_size_is_glimpses(llmd: dict[str, Any]) -> None:
    # The picker cuts tokens into blocks of its own size: unequal sizes would match no event's block.
    processor = llmd["plugins"]["precise-prefix-cache-producer"]["tokenProcessorConfig"]
    assert llmd["flags"].block_size is not None, "set --block-size: glimpse's default depends on the GPU"
    assert processor["blockSizeTokens"] == llmd["flags"].block_size
    assert "blockSize" not in processor  # deprecated in llm-d: one name, one value


def test_llmd_picker_subscribes_to_the_pods_event_ports(llmd: dict[str, Any]) -> None:
    events = llmd["plugins"]["precise-prefix-cache-producer"]["kvEventsConfig"]
    assert events["discoverPods"] is True and llmd["flags"].kv_events_endpoint.startswith("tcp://*:")
    discovery = events["podDiscoveryConfig"]
    assert discovery["socketPort"] == _port(llmd["flags"].kv_events_endpoint) == llmd["ports"]["kv-events"]
    assert _port(_arg(llmd["args"], "--kv-events-replay-endpoint")) == llmd["ports"]["kv-replay"]
    assert discovery.get("replaySocketPort", llmd["ports"]["kv-replay"]) == llmd["ports"]["kv-replay"]
    # llm-d reads the pod as "<pod-id>@<model>" from the topic; the pod id is the endpoint's address:port.
    topic = llmd["flags"].kv_events_topic
    assert topic.startswith(events["topicFilter"])
    assert topic == f"kv@$(POD_IP):{llmd['flags'].port}@{llmd['flags'].served_model_name}"
    # The producer gets its pods from the notification source (dataLayer), not from a fixed endpoint.
    [source] = [s for s in llmd["config"]["dataLayer"]["sources"] if s["pluginRef"] == "endpoint-notification-source"]
    assert {"pluginRef": "precise-prefix-cache-producer"} in source["extractors"]
    assert "zmqEndpoint" not in events


def test_llmd_picker_renders_through_glimpse(llmd: dict[str, Any]) -> None:
    producer = llmd["plugins"]["token-producer"]
    assert producer["modelName"] == llmd["flags"].served_model_name  # the render route refuses another model
    service = llmd_one("Service", "-llmd")
    [http] = service["spec"]["ports"]
    assert producer["vllm"]["url"] == f"http://{service['metadata']['name']}:{http['port']}"
    assert http["targetPort"] in ("http", llmd["flags"].port)
    assert service["spec"]["selector"].items() <= llmd["deployment"]["spec"]["template"]["metadata"]["labels"].items()
    scorer = llmd["plugins"]["prefix-cache-scorer"]
    assert scorer["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    profile_refs = {p["pluginRef"] for p in llmd["config"]["schedulingProfiles"][0]["plugins"]}
    assert "prefix-cache-scorer" in profile_refs and profile_refs <= set(llmd["plugins"])


def test_llmd_pool_and_picker_rbac(llmd: dict[str, Any]) -> None:
    pool = llmd_one("InferencePool")
    labels = llmd["deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [llmd["flags"].port]
    epp = llmd_one("Deployment", "-epp")
    spec = epp["spec"]["template"]["spec"]
    assert _arg(spec["containers"][0]["args"], "--pool-name") == pool["metadata"]["name"]
    assert pool["spec"]["endpointPickerRef"]["name"] == llmd_one("Service", "-epp")["metadata"]["name"]
    account = spec["serviceAccountName"]

    def rules(kind: str) -> set[tuple[str, str, str]]:
        [binding] = [b for b in llmd_documents() if b["kind"] == f"{kind}Binding"]
        assert binding["subjects"][0]["name"] == account and binding["roleRef"]["kind"] == kind
        [role] = [r for r in llmd_documents() if r["kind"] == kind and r["metadata"]["name"] == binding["roleRef"]["name"]]
        return {(g, res, v) for r in role["rules"] for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}

    namespaced = rules("Role")
    for verb in ("get", "list", "watch"):
        assert ("", "pods", verb) in namespaced  # pod discovery: a KV-event subscriber per pod
        assert ("inference.networking.k8s.io", "inferencepools", verb) in namespaced
    # The picker's /metrics authenticates its scrapers: TokenReview and SubjectAccessReview, cluster-wide.
    cluster = rules("ClusterRole")
    assert {("authentication.k8s.io", "tokenreviews", "create"),
            ("authorization.k8s.io", "subjectaccessreviews", "create")} <= cluster
    [route_rule] = llmd_one("HTTPRoute")["spec"]["rules"]
    assert route_rule["backendRefs"][0]["name"] == pool["metadata"]["name"]
