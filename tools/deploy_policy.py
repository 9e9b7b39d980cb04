"""The policy tools/validate-deploy holds every rendered Kubernetes manifest to (chart and kustomize alike).

- Pod Security Standards, level "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards),
  for every pod template.
- Liveness probes never depend on another service: a failing dependency must make a pod unready, not
  restart it. Allowed: a TCP check of the container's own port, `kvferry health ... --any-status` on a
  loopback or unix address, and an HTTP GET of the container's own port on a path known to answer for
  that process alone.
- No TLS proxy admits every client certificate (`--allow-all`).
- Engines (pods labelled kvferry.io/engine-role) are fenced by NetworkPolicies: traffic between engines
  reaches only the NIXL ports, and only from an engine of the other role (prefill <-> decode), and each
  role can reach the other's NIXL ports.

Pure functions over parsed manifests; each returns the problems it found as (where, message).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Doc = Mapping[str, Any]
Problem = tuple[str, str]

ENGINE_ROLE_LABEL = "kvferry.io/engine-role"
ENGINE_ROLES = ("prefill", "decode")
# NIXL's side channel (5600 + data-parallel rank) and UCX's TCP transfers (UCX_TCP_PORT_RANGE 5610-5699).
NIXL_PORTS = range(5600, 5700)

# Volume types Pod Security "restricted" admits.
RESTRICTED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
# HTTP paths that answer for the serving process alone, by the image that serves them.
LOCAL_LIVENESS_PATHS = {"vllm": frozenset({"/health"}), "etcd": frozenset({"/livez"})}


@dataclass(frozen=True)
class Workload:
    """A pod template and where it comes from."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    pod: Mapping[str, Any]

    @property
    def engine_role(self) -> str | None:
        return self.labels.get(ENGINE_ROLE_LABEL)


def name_of(doc: Doc) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def workloads(docs: Iterable[Doc], default_namespace: str = "default") -> list[Workload]:
    found = []
    for doc in docs:
        kind = doc.get("kind")
        spec = doc.get("spec") or {}
        if kind == "Pod":
            template: Mapping[str, Any] = {"metadata": doc.get("metadata") or {}, "spec": spec}
        elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
            template = spec.get("template") or {}
        elif kind == "CronJob":
            template = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
        else:
            continue
        found.append(
            Workload(
                name=name_of(doc),
                namespace=namespace_of(doc, default_namespace),
                labels=dict((template.get("metadata") or {}).get("labels") or {}),
                pod=template.get("spec") or {},
            )
        )
    return found


def namespace_of(doc: Doc, default_namespace: str) -> str:
    return str((doc.get("metadata") or {}).get("namespace") or default_namespace)


def containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [
        *(pod.get("initContainers") or []),
        *(pod.get("containers") or []),
        *(pod.get("ephemeralContainers") or []),
    ]


def argv_of(container: Mapping[str, Any]) -> list[str]:
    return [str(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]


# ---------------------------------------------------------------------------------------------------
# Pod Security "restricted"
# ---------------------------------------------------------------------------------------------------


def check_restricted(workload: Workload) -> list[Problem]:
    """The controls of the baseline and restricted levels that a pod template can break."""
    problems: list[Problem] = []
    pod = workload.pod
    pod_context = pod.get("securityContext") or {}

    def fail(where: str, message: str) -> None:
        problems.append((where, f"Pod Security restricted: {message}"))

    for field in ("hostNetwork", "hostPID", "hostIPC", "hostUsers"):
        value = pod.get(field)
        if (field == "hostUsers" and value is True) or (field != "hostUsers" and value):
            fail(workload.name, f"{field} must not be set")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            fail(workload.name, f"volume {volume.get('name')!r} of type {sorted(kinds)} is not allowed")
    for sysctl in pod_context.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            fail(workload.name, f"sysctl {sysctl.get('name')} is not a safe sysctl")
    if pod_context.get("runAsUser") == 0:
        fail(workload.name, "securityContext.runAsUser must not be 0")

    for container in containers(pod):
        where = f"{workload.name} container {container.get('name')}"
        context = container.get("securityContext") or {}
        if context.get("privileged"):
            fail(where, "privileged containers are not allowed")
        if context.get("allowPrivilegeEscalation") is not False:
            fail(where, "securityContext.allowPrivilegeEscalation must be false")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            fail(where, "securityContext.capabilities.drop must include ALL")
        added = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            fail(where, f"capabilities {sorted(added)} may not be added (only NET_BIND_SERVICE)")
        run_as_non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
        if run_as_non_root is not True:
            fail(where, "runAsNonRoot must be true (pod or container securityContext)")
        if context.get("runAsUser") == 0:
            fail(where, "securityContext.runAsUser must not be 0")
        seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            fail(where, "seccompProfile.type must be RuntimeDefault or Localhost (pod or container)")
        if context.get("procMount") not in (None, "Default"):
            fail(where, "procMount must be Default")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                fail(where, f"hostPort {port['hostPort']} is not allowed")
    return problems


# ---------------------------------------------------------------------------------------------------
# Liveness
# ---------------------------------------------------------------------------------------------------


def image_family(image: str) -> str:
    """`vllm`, `etcd`, `kvferry` or the image's last path segment, without registry or tag."""
    name = image.rsplit("/", 1)[-1].split("@", 1)[0].split(":", 1)[0]
    if "vllm" in name:
        return "vllm"
    return name


def container_port(container: Mapping[str, Any], port: Any) -> bool:
    declared = container.get("ports") or []
    if isinstance(port, str):
        return any(p.get("name") == port for p in declared)
    return any(p.get("containerPort") == port for p in declared)


def is_local_address(address: str) -> bool:
    """A unix socket, a loopback host:port, or a loopback http(s) URL (`kvferry health` takes all three)."""
    loopback = r"(127\.0\.0\.1|localhost|\[::1\])"
    return (
        address.startswith("unix:")
        or bool(re.match(rf"^{loopback}:\d+$", address))
        or bool(re.match(rf"^https?://{loopback}(:\d+)?(/|$)", address))
    )


def check_liveness(workload: Workload) -> list[Problem]:
    """A liveness probe that another service's failure can fail would restart a healthy process."""
    problems: list[Problem] = []
    for container in containers(workload.pod):
        probe = container.get("livenessProbe")
        if not probe:
            continue
        where = f"{workload.name} container {container.get('name')}"
        family = image_family(str(container.get("image", "")))
        if "tcpSocket" in probe:
            if not container_port(container, probe["tcpSocket"].get("port")):
                problems.append((where, "liveness checks a TCP port the container does not declare"))
        elif "httpGet" in probe:
            get = probe["httpGet"]
            path = str(get.get("path", "/"))
            if not container_port(container, get.get("port")):
                problems.append((where, "liveness calls a port the container does not declare"))
            elif path not in LOCAL_LIVENESS_PATHS.get(family, frozenset()):
                problems.append(
                    (
                        where,
                        f"liveness GET {path} on a {family!r} container is not known to answer for that "
                        "process alone (it may depend on another service); use a TCP check or a local "
                        "health path",
                    )
                )
        elif "exec" in probe:
            command = [str(c) for c in probe["exec"].get("command") or []]
            if command[:2] != ["kvferry", "health"]:
                problems.append((where, f"liveness runs {command[:2]}, not a known local check"))
            elif "--any-status" not in command:
                problems.append(
                    (
                        where,
                        "liveness `kvferry health` without --any-status fails while a dependency is "
                        "away (NOT_SERVING) and would restart a healthy process",
                    )
                )
            elif len(command) < 3 or not is_local_address(command[2]):
                problems.append((where, "liveness `kvferry health` must check a loopback or unix address"))
        else:
            problems.append((where, f"liveness probe {sorted(probe)} is not a known local check"))
    return problems


# ---------------------------------------------------------------------------------------------------
# TLS proxies
# ---------------------------------------------------------------------------------------------------


def check_no_allow_all(workload: Workload) -> list[Problem]:
    return [
        (f"{workload.name} container {c.get('name')}", "--allow-all admits every client certificate")
        for c in containers(workload.pod)
        if "--allow-all" in argv_of(c)
    ]


# ---------------------------------------------------------------------------------------------------
# NetworkPolicies around the engines
# ---------------------------------------------------------------------------------------------------


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions); an empty selector matches all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
    return True


def peer_reaches(peer: Mapping[str, Any], policy_namespace: str, source: Workload) -> bool:
    """Whether a NetworkPolicy `from` peer admits traffic from the pods of ``source``."""
    if "ipBlock" in peer:
        return True  # pod IPs may fall in any block: count it as reaching
    if "namespaceSelector" in peer:
        namespace_labels = {"kubernetes.io/metadata.name": source.namespace}
        if not selector_matches(peer["namespaceSelector"], namespace_labels):
            return False
    elif source.namespace != policy_namespace:
        return False
    return selector_matches(peer.get("podSelector"), source.labels)


def port_range(entry: Mapping[str, Any]) -> range | None:
    """The numeric ports a NetworkPolicy port entry opens; None when it opens a named or every port."""
    port = entry.get("port")
    if not isinstance(port, int):
        return None
    return range(port, int(entry.get("endPort", port)) + 1)


def check_engine_network_policies(docs: Iterable[Doc], default_namespace: str = "default") -> list[Problem]:
    docs = list(docs)
    pods = workloads(docs, default_namespace)
    engines = [w for w in pods if w.engine_role is not None]
    policies = [
        d
        for d in docs
        if d.get("kind") == "NetworkPolicy"
        and "Ingress" in ((d.get("spec") or {}).get("policyTypes") or ["Ingress"])
    ]
    problems: list[Problem] = []
    for engine in engines:
        if engine.engine_role not in ENGINE_ROLES:
            problems.append((engine.name, f"{ENGINE_ROLE_LABEL}={engine.engine_role!r} is no engine role"))
            continue
        fencing = [
            p
            for p in policies
            if namespace_of(p, default_namespace) == engine.namespace
            and selector_matches((p.get("spec") or {}).get("podSelector"), engine.labels)
        ]
        if not fencing:
            problems.append((engine.name, "no NetworkPolicy selects this engine: every pod may reach it"))
            continue
        other_role_reaches = False
        for policy in fencing:
            policy_namespace = namespace_of(policy, default_namespace)
            for rule in (policy.get("spec") or {}).get("ingress") or []:
                peers = rule.get("from")
                sources = [
                    e
                    for e in engines
                    if not peers or any(peer_reaches(p, policy_namespace, e) for p in peers)
                ]
                if not sources:
                    continue
                where = f"{name_of(policy)} (selects {engine.name})"
                ranges = [port_range(p) for p in rule.get("ports") or []]
                if not ranges or any(r is None for r in ranges):
                    problems.append(
                        (where, "lets engines reach every port, or a named one, of another engine")
                    )
                    continue
                outside = [r for r in ranges if r is not None and not set(r) <= set(NIXL_PORTS)]
                if outside:
                    problems.append(
                        (
                            where,
                            f"lets engines reach ports {[f'{r.start}-{r.stop - 1}' for r in outside]} of "
                            f"another engine; only the NIXL ports {NIXL_PORTS.start}-{NIXL_PORTS.stop - 1}",
                        )
                    )
                same_role = sorted({s.name for s in sources if s.engine_role == engine.engine_role})
                if same_role:
                    problems.append(
                        (where, f"lets engines of its own role ({', '.join(same_role)}) reach it")
                    )
                if any(s.engine_role != engine.engine_role for s in sources):
                    other_role_reaches = True
        others = [e for e in engines if e.engine_role not in (engine.engine_role, None)]
        if others and not other_role_reaches:
            problems.append(
                (engine.name, "no NetworkPolicy lets the engines of the other role reach its NIXL ports")
            )
    return problems


def check_all(docs: Iterable[Doc], default_namespace: str = "default") -> list[Problem]:
    docs = list(docs)
    problems: list[Problem] = []
    for workload in workloads(docs, default_namespace):
        problems += check_restricted(workload)
        problems += check_liveness(workload)
        problems += check_no_allow_all(workload)
    problems += check_engine_network_policies(docs, default_namespace)
    return problems
