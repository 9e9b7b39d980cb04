"""tools/deploy_policy.py on small manifests: each rule passes what it must and names what it refuses.

The shipped manifests themselves go through the same checks in tools/validate-deploy (tools/test).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tools import deploy_policy

RESTRICTED_CONTAINER_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
RESTRICTED_POD_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def deployment(
    name: str, containers: list[dict[str, Any]], labels: dict[str, str] | None = None
) -> dict[str, Any]:
    labels = labels or {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "kv"},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"securityContext": dict(RESTRICTED_POD_CONTEXT), "containers": containers},
            },
        },
    }


def container(name: str, image: str, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "securityContext": copy.deepcopy(RESTRICTED_CONTAINER_CONTEXT),
        **fields,
    }


def engine(name: str, role: str) -> dict[str, Any]:
    return deployment(
        name,
        [
            container(
                "vllm", "ghcr.io/kvferry/vllm-kvferry:0.1.0", ports=[{"name": "http", "containerPort": 8000}]
            )
        ],
        {"app": name, deploy_policy.ENGINE_ROLE_LABEL: role},
    )


def nixl_policy(name: str, role: str, peer_role: str, ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "kv"},
        "spec": {
            "podSelector": {"matchLabels": {deploy_policy.ENGINE_ROLE_LABEL: role}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {deploy_policy.ENGINE_ROLE_LABEL: peer_role}}}],
                    "ports": ports,
                }
            ],
        },
    }


NIXL_PORTS = [{"port": 5600, "endPort": 5699}]


def messages(problems: list[deploy_policy.Problem]) -> str:
    return "\n".join(f"{where}: {message}" for where, message in problems)


def test_a_restricted_pod_passes() -> None:
    docs = [deployment("router", [container("router", "ghcr.io/kvferry/kvferry:0.1.0")])]
    assert deploy_policy.check_all(docs) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda pod, c: c["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
        (lambda pod, c: c["securityContext"]["capabilities"].update(drop=[]), "drop must include ALL"),
        (lambda pod, c: c["securityContext"]["capabilities"].update(add=["IPC_LOCK"]), "IPC_LOCK"),
        (lambda pod, c: pod["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
        (lambda pod, c: pod["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (lambda pod, c: c["securityContext"].update(privileged=True), "privileged"),
        (lambda pod, c: pod.update(hostNetwork=True), "hostNetwork"),
        (lambda pod, c: pod.update(volumes=[{"name": "h", "hostPath": {"path": "/"}}]), "hostPath"),
        (lambda pod, c: c.update(ports=[{"containerPort": 80, "hostPort": 80}]), "hostPort"),
    ],
)
def test_restricted_names_each_broken_control(change: Any, expected: str) -> None:
    doc = deployment("router", [container("router", "ghcr.io/kvferry/kvferry:0.1.0")])
    pod = doc["spec"]["template"]["spec"]
    change(pod, pod["containers"][0])
    found = messages(deploy_policy.check_all([doc]))
    assert "Pod Security restricted" in found
    assert expected in found


def test_init_containers_are_held_to_restricted_too() -> None:
    doc = deployment("engine", [container("vllm", "vllm")])
    doc["spec"]["template"]["spec"]["initContainers"] = [
        {"name": "sidecar", "image": "kvferry", "restartPolicy": "Always"}
    ]
    assert "container sidecar" in messages(deploy_policy.check_all([doc]))


def test_liveness_through_the_routers_health_is_refused() -> None:
    """The HTTPS proxy's old probe: the router's /health answers 503 until engines register."""
    proxy = container(
        "tls-https",
        "ghostunnel/ghostunnel:v1.8.4",
        ports=[{"name": "https", "containerPort": 8443}],
        livenessProbe={"httpGet": {"path": "/health", "port": "https", "scheme": "HTTPS"}},
    )
    found = messages(deploy_policy.check_all([deployment("router", [proxy])]))
    assert "liveness GET /health" in found


@pytest.mark.parametrize(
    "probe",
    [
        {"tcpSocket": {"port": "https"}},
        {"exec": {"command": ["kvferry", "health", "127.0.0.1:50062", "--any-status"]}},
        {"exec": {"command": ["kvferry", "health", "unix:/run/kvferry/sidecar.sock", "--any-status"]}},
        {"exec": {"command": ["kvferry", "health", "http://127.0.0.1:8080/health", "--any-status"]}},
    ],
)
def test_local_liveness_checks_pass(probe: dict[str, Any]) -> None:
    proxy = container(
        "c",
        "ghcr.io/kvferry/kvferry:0.1.0",
        ports=[{"name": "https", "containerPort": 8443}],
        livenessProbe=probe,
    )
    assert deploy_policy.check_all([deployment("router", [proxy])]) == []


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        ({"exec": {"command": ["kvferry", "health", "127.0.0.1:50061"]}}, "without --any-status"),
        (
            {"exec": {"command": ["kvferry", "health", "kvferry-registry:50051", "--any-status"]}},
            "loopback or unix",
        ),
        ({"exec": {"command": ["curl", "http://kvferry-registry"]}}, "not a known local check"),
        (
            {"exec": {"command": ["kvferry", "health", "http://kvferry-router:8080/health", "--any-status"]}},
            "loopback or unix",
        ),
        ({"tcpSocket": {"port": 2379}}, "does not declare"),
    ],
)
def test_liveness_that_may_depend_on_another_service_is_refused(probe: dict[str, Any], expected: str) -> None:
    doc = deployment(
        "registry", [container("registry", "ghcr.io/kvferry/kvferry:0.1.0", livenessProbe=probe)]
    )
    assert expected in messages(deploy_policy.check_all([doc]))


def test_vllm_and_etcd_health_paths_are_local() -> None:
    vllm = container(
        "vllm",
        "vllm/vllm-openai:v0.32.0",
        ports=[{"name": "http", "containerPort": 8000}],
        livenessProbe={"httpGet": {"path": "/health", "port": "http"}},
    )
    etcd = container(
        "etcd",
        "quay.io/coreos/etcd:v3.5.17",
        ports=[{"name": "metrics", "containerPort": 2381}],
        livenessProbe={"httpGet": {"path": "/livez", "port": "metrics"}},
    )
    assert deploy_policy.check_all([deployment("engine", [vllm]), deployment("etcd", [etcd])]) == []
    etcd["livenessProbe"]["httpGet"]["path"] = "/health"  # fails when the cluster loses quorum
    assert "liveness GET /health" in messages(deploy_policy.check_all([deployment("etcd", [etcd])]))


def test_allow_all_is_refused() -> None:
    proxy = container("tls", "ghostunnel/ghostunnel:v1.8.4", args=["server", "--allow-all"])
    assert "--allow-all" in messages(deploy_policy.check_all([deployment("registry", [proxy])]))


def test_engines_fenced_to_nixl_ports_between_roles_pass() -> None:
    docs = [
        engine("prefill", "prefill"),
        engine("decode", "decode"),
        nixl_policy("prefill-nixl", "prefill", "decode", NIXL_PORTS),
        nixl_policy("decode-nixl", "decode", "prefill", NIXL_PORTS),
    ]
    assert deploy_policy.check_all(docs) == []


def test_unfenced_engines_are_refused() -> None:
    found = messages(deploy_policy.check_all([engine("prefill", "prefill"), engine("decode", "decode")]))
    assert "no NetworkPolicy selects this engine" in found


@pytest.mark.parametrize(
    ("ports", "expected"),
    [
        ([], "every port"),
        ([{"port": "nixl"}], "named one"),
        ([{"port": 8000}], "8000-8000"),
        ([{"port": 5600, "endPort": 5800}], "5600-5800"),
    ],
)
def test_engine_to_engine_beyond_the_nixl_ports_is_refused(
    ports: list[dict[str, Any]], expected: str
) -> None:
    docs = [
        engine("prefill", "prefill"),
        engine("decode", "decode"),
        nixl_policy("prefill-nixl", "prefill", "decode", ports),
        nixl_policy("decode-nixl", "decode", "prefill", NIXL_PORTS),
    ]
    assert expected in messages(deploy_policy.check_all(docs))


def test_a_rule_open_to_every_namespace_reaches_engines_too() -> None:
    metrics = nixl_policy("metrics", "prefill", "decode", [{"port": 9091}])
    metrics["spec"]["ingress"][0]["from"] = [{"namespaceSelector": {}}]
    docs = [
        engine("prefill", "prefill"),
        engine("decode", "decode"),
        metrics,
        nixl_policy("prefill-nixl", "prefill", "decode", NIXL_PORTS),
        nixl_policy("decode-nixl", "decode", "prefill", NIXL_PORTS),
    ]
    assert "9091-9091" in messages(deploy_policy.check_all(docs))


def test_engines_of_one_role_may_not_reach_each_other() -> None:
    docs = [
        engine("prefill", "prefill"),
        engine("decode", "decode"),
        nixl_policy("prefill-nixl", "prefill", "prefill", NIXL_PORTS),
        nixl_policy("decode-nixl", "decode", "prefill", NIXL_PORTS),
    ]
    found = messages(deploy_policy.check_all(docs))
    assert "its own role" in found
    assert "no NetworkPolicy lets the engines of the other role reach its NIXL ports" in found
