"""deploy/kubernetes rendered by kustomize, validated against the Kubernetes schemas, and checked for what
the schemas cannot see: commands the CLI parses, probes on the ports those commands open, NetworkPolicies
that let exactly the intended pods in, and every Secret, ConfigMap, volume and metric that is referred to.
No cluster, no network.
"""

from __future__ import annotations

import argparse
import copy
import re
from typing import Any

import kubernetes_validate
import pytest

from pdserve.cli import build_parser
from pdserve.service_common.server import LIVENESS_SERVICE
from tests.deploy.manifests import VARIANTS, Rendered, prepare_tree, render, selector_matches

# The oldest Kubernetes the manifests claim (gRPC probes are GA from 1.27; 1.29 is the oldest
# minor still maintained by the major clouds) and the newest schema the package ships.
SCHEMA_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
POD_IP, POD_NAME = "10.244.1.7", "pdserve-pod-0"
FIELD_VALUES = {"status.podIP": POD_IP, "metadata.name": POD_NAME}
PDSERVE_COMPONENTS = ("gateway", "prefill", "decode")
# Files the commands read, by flag: each must be a key of a Secret mounted where the path points.
FILE_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "tls_ca", "tls_client_cert", "tls_client_key", "auth_token_file")


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Rendered]:
    root = prepare_tree(tmp_path_factory.mktemp("k8s"))
    return {name: Rendered(name, render(root / "variants" / name)) for name in VARIANTS}


def _all(variants: dict[str, Rendered]) -> list[Rendered]:
    return list(variants.values())


# ---- the schemas -------------------------------------------------------------------------


def test_every_object_of_every_variant_validates_against_the_kubernetes_schemas(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        kinds = sorted({o["kind"] for o in rendered.objects})
        assert {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget", "Secret", "ConfigMap",
                "PersistentVolumeClaim", "Namespace", "ServiceAccount"} <= set(kinds), rendered.name
        for version in SCHEMA_VERSIONS:
            for obj in rendered.objects:
                kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_check_refuses_a_misspelt_field(variants: dict[str, Rendered]) -> None:
    deployment = copy.deepcopy(variants["cpu"].component("prefill"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, SCHEMA_VERSIONS[-1], strict=True)


def test_every_variant_has_one_deployment_per_role_and_every_object_in_the_namespace(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        roles = sorted(d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] for d in rendered.workloads())
        assert roles == ["decode", "gateway", "prefill", "redis"]
        for obj in rendered.objects:
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == "pdserve", (rendered.name, obj["kind"], obj["metadata"]["name"])


# ---- commands ----------------------------------------------------------------------------


def _environment(rendered: Rendered, container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it; a missing ConfigMap or key fails here."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        assert "configMapRef" in source, f"{rendered.name}: only ConfigMaps are expected in envFrom"
        env.update(rendered.named("ConfigMap", source["configMapRef"]["name"])["data"])
    for variable in container.get("env") or []:
        if "value" in variable:
            env[variable["name"]] = variable["value"]
            continue
        value_from = variable["valueFrom"]
        if "fieldRef" in value_from:
            env[variable["name"]] = FIELD_VALUES[value_from["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in value_from:
            ref = value_from["configMapKeyRef"]
            env[variable["name"]] = rendered.named("ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            raise AssertionError(f"{rendered.name}: unexpected env source {value_from}")
    return env


def _expand(value: str, env: dict[str, str], where: str) -> str:
    """Kubernetes' $(VAR) expansion; a reference to an undefined variable would stay literal: a bug here."""
    def lookup(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"{where}: $({match.group(1)}) is not in the container's environment"
        return env[match.group(1)]

    return re.sub(r"\$\((\w+)\)", lookup, value)


def _parsed(rendered: Rendered, deployment: dict[str, Any]) -> tuple[dict[str, Any], argparse.Namespace]:
    """The pdserve container and its command line as the CLI parses it."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    where = f"{rendered.name}: {deployment['metadata']['name']}"
    env = _environment(rendered, container)
    argv = [_expand(part, env, where) for part in [*container["command"], *container.get("args", [])]]
    assert argv[0] == "pdserve", where
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as error:
        raise AssertionError(f"{where}: the CLI refuses {argv}") from error
    return container, args


def test_every_pdserve_command_parses_with_the_cli_and_serves_from_the_pod_address(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        for component in PDSERVE_COMPONENTS:
            _, args = _parsed(rendered, rendered.component(component))
            assert args.command == component
            assert args.host == "0.0.0.0"
            assert args.redis_url == "redis://pdserve-redis:6379/0"
            assert args.tls_cert and args.tls_key
            if component != "gateway":
                # Registered in Redis under the pod's own IP and name (the downward API).
                assert (args.advertise_host, args.worker_id) == (POD_IP, POD_NAME)
                assert args.tls_client_ca, "workers accept only callers with a certificate"
            if component != "prefill":
                assert args.tls_ca and args.tls_client_cert and args.tls_server_name == "pdserve-worker"
        gpu = rendered.name.startswith("nvidia-gpu")
        for component in ("prefill", "decode"):
            _, args = _parsed(rendered, rendered.component(component))
            assert (args.device, args.dtype) == (("cuda", "bfloat16") if gpu else ("cpu", "auto"))
        _, gateway = _parsed(rendered, rendered.component("gateway"))
        assert gateway.kv_transport == ("torch_dist" if "nccl" in rendered.name else "grpc")
        assert gateway.auth_token_file
        assert gateway.http_port == 8000  # the overlays serve the OpenAI API by default


def test_the_grace_period_covers_the_drain_and_the_pre_stop_wait(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        for component in PDSERVE_COMPONENTS:
            deployment = rendered.component(component)
            container, args = _parsed(rendered, deployment)
            pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
            wait_s = float(pre_stop[1]) if pre_stop else 0.0
            grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            # 10 s beyond the drain to stop the engine, deregister and close channels.
            assert args.drain_seconds >= 10 and wait_s + args.drain_seconds + 10 <= grace_s, (rendered.name, component)
        # Clients reach the gateway through its Service: it waits out endpoint removal first.
        gateway = rendered.component("gateway")["spec"]["template"]["spec"]["containers"][0]
        assert gateway["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]


# ---- ports and probes --------------------------------------------------------------------


def test_probes_and_named_ports_point_at_the_ports_the_commands_open(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        for component in PDSERVE_COMPONENTS:
            container, args = _parsed(rendered, rendered.component(component))
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            expected = {"grpc": args.port, "health": args.health_port, "metrics": args.metrics_port}
            if getattr(args, "http_port", None) is not None:
                expected["http"] = args.http_port
            assert ports == expected, (rendered.name, component)
            assert len(set(ports.values())) == len(ports)
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container[kind]["grpc"]
                # Kubernetes' gRPC probes cannot speak TLS: they call the plaintext health-only port.
                assert probe["port"] == args.health_port, (rendered.name, component, kind)
                # Readiness asks for the server as a whole (NOT_SERVING while draining or with a dead
                # engine); liveness and startup for LIVENESS_SERVICE, SERVING while draining.
                assert probe.get("service", "") == ("" if kind == "readinessProbe" else LIVENESS_SERVICE)
            annotations = rendered.component(component)["spec"]["template"]["metadata"]["annotations"]
            assert int(annotations["prometheus.io/port"]) == args.metrics_port


def _pods(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]
            for d in rendered.workloads()}


def test_every_service_selects_one_deployment_and_targets_ports_its_pods_open(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        pods = _pods(rendered)
        for service in rendered.of_kind("Service"):
            assert service["spec"]["type"] == "ClusterIP"
            selected = [c for c, pod in pods.items() if selector_matches({"matchLabels": service["spec"]["selector"]},
                                                                         pod["metadata"]["labels"])]
            assert len(selected) == 1, (rendered.name, service["metadata"]["name"], selected)
            container = pods[selected[0]]["spec"]["containers"][0]
            by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
            for port in service["spec"]["ports"]:
                target = port["targetPort"]
                assert target in by_name or target in by_name.values(), (rendered.name, service["metadata"]["name"], target)
        # The Redis URL every process gets names the Redis Service and its port.
        redis = rendered.named("Service", "pdserve-redis")
        assert redis["spec"]["ports"][0]["port"] == 6379
        gateway = rendered.named("Service", "pdserve-gateway")
        assert [p["name"] for p in gateway["spec"]["ports"]] == ["grpc", "http"]


def test_every_pod_runs_non_root_on_a_read_only_root_with_limits(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        for component, pod in _pods(rendered).items():
            spec = pod["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec["securityContext"]["runAsUser"] >= 10000
            assert spec["automountServiceAccountToken"] is False
            for container in spec["containers"]:
                assert container["securityContext"]["readOnlyRootFilesystem"] is True, (rendered.name, component)
                assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
                assert set(container["resources"]["limits"]) >= {"cpu", "memory"}
                assert set(container["resources"]["requests"]) >= {"cpu", "memory"}
                gpus = container["resources"]["limits"].get("nvidia.com/gpu")
                wants_gpu = rendered.name.startswith("nvidia-gpu") and component in ("prefill", "decode")
                assert gpus == (1 if wants_gpu else None), (rendered.name, component)
            mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
            if component != "redis":
                # What must be written lives on volumes: the model cache, /tmp and $HOME.
                assert {"/var/cache/pdserve", "/tmp", "/home/pdserve"} <= mounts


# ---- references --------------------------------------------------------------------------


def test_every_referenced_secret_configmap_claim_and_account_exists(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        for deployment in rendered.workloads():
            spec = deployment["spec"]["template"]["spec"]
            rendered.named("ServiceAccount", spec["serviceAccountName"])
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for volume in volumes.values():
                if "secret" in volume:
                    rendered.named("Secret", volume["secret"]["secretName"])
                if "configMap" in volume:
                    rendered.named("ConfigMap", volume["configMap"]["name"])
                if "persistentVolumeClaim" in volume:
                    rendered.named("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
            for container in spec["containers"]:
                _environment(rendered, container)  # asserts its ConfigMaps and keys exist
                for mount in container.get("volumeMounts", []):
                    assert mount["name"] in volumes, (rendered.name, mount)


def test_every_file_a_command_reads_is_a_key_of_a_mounted_secret(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        for component in PDSERVE_COMPONENTS:
            deployment = rendered.component(component)
            container, args = _parsed(rendered, deployment)
            volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
            for flag in FILE_FLAGS:
                path = getattr(args, flag, None)
                if path is None:
                    continue
                mount = next((m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")), None)
                assert mount is not None, f"{rendered.name} {component} --{flag} {path}: no volume mounted there"
                secret = rendered.named("Secret", volumes[mount["name"]]["secret"]["secretName"])
                key = path[len(mount["mountPath"]) + 1:]
                assert key in secret["data"], f"{rendered.name} {component} --{flag}: {secret['metadata']['name']} has no {key}"


def test_disruption_budgets_and_autoscalers_target_the_worker_deployments(variants: dict[str, Rendered]) -> None:
    from pdserve.service_common.metrics import WorkerMetrics

    exported = _worker_metric_names(WorkerMetrics)
    for rendered in _all(variants):
        pods = _pods(rendered)
        budgets = {}
        for budget in rendered.of_kind("PodDisruptionBudget"):
            selected = [c for c, pod in pods.items() if selector_matches(budget["spec"]["selector"], pod["metadata"]["labels"])]
            assert len(selected) == 1, (rendered.name, budget["metadata"]["name"])
            budgets[selected[0]] = budget["spec"]
        assert budgets == {c: {"maxUnavailable": 1, "selector": budgets[c]["selector"]} for c in PDSERVE_COMPONENTS}
        autoscalers = rendered.of_kind("HorizontalPodAutoscaler")
        assert len(autoscalers) == (2 if "autoscaling" in rendered.name else 0)
        for autoscaler in autoscalers:
            rendered.named("Deployment", autoscaler["spec"]["scaleTargetRef"]["name"])
            for metric in autoscaler["spec"]["metrics"]:
                assert metric["pods"]["metric"]["name"] in exported, (rendered.name, metric)
        if autoscalers:
            by_target = {a["spec"]["scaleTargetRef"]["name"]: [m["pods"]["metric"]["name"] for m in a["spec"]["metrics"]]
                         for a in autoscalers}
            assert by_target == {"pdserve-prefill": ["pdserve_engine_queued_tokens"],
                                 "pdserve-decode": ["pdserve_engine_requests_running", "pdserve_kv_cache_usage_ratio"]}


def _worker_metric_names(worker_metrics: type) -> set[str]:
    from pdserve.engine.types.outputs import EngineStats

    stats = EngineStats(num_running=0, num_waiting=0, num_queued_tokens=0, num_free_blocks=1, num_total_blocks=1,
                        num_held=0, num_preemptions=0)
    return {family.name for family in worker_metrics(lambda: stats).registry.collect()}


# ---- NetworkPolicies ---------------------------------------------------------------------

NAMESPACE_LABELS = {"kubernetes.io/metadata.name": "pdserve"}
# Pods that are not pdserve's: one in the namespace, one (Prometheus, say) in another.
STRANGER = ({"app": "something-else"}, NAMESPACE_LABELS)
OTHER_NAMESPACE = ({"app": "prometheus"}, {"kubernetes.io/metadata.name": "monitoring"})


def _ingress_allowed(rendered: Rendered, source: tuple[dict[str, str], dict[str, str]], destination: dict[str, str],
                     port: int) -> bool:
    """NetworkPolicy semantics for one TCP connection into the pdserve namespace."""
    source_labels, source_namespace = source
    isolating = [p for p in rendered.of_kind("NetworkPolicy")
                 if "Ingress" in p["spec"]["policyTypes"] and selector_matches(p["spec"]["podSelector"], destination)]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            port_ok = not ports or any(p.get("protocol", "TCP") == "TCP" and p.get("port") in (None, port) for p in ports)
            peers = rule.get("from")
            peer_ok = not peers or any(_peer_matches(peer, source_labels, source_namespace) for peer in peers)
            if port_ok and peer_ok:
                return True
    return False


def _peer_matches(peer: dict[str, Any], labels: dict[str, str], namespace: dict[str, str]) -> bool:
    assert "ipBlock" not in peer, "not modelled here"
    namespace_ok = (selector_matches(peer["namespaceSelector"], namespace) if "namespaceSelector" in peer
                    else namespace == NAMESPACE_LABELS)
    pod_ok = selector_matches(peer["podSelector"], labels) if "podSelector" in peer else True
    return namespace_ok and pod_ok


def test_network_policies_select_existing_pods(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        labels = [pod["metadata"]["labels"] for pod in _pods(rendered).values()]
        for policy in rendered.of_kind("NetworkPolicy"):
            assert any(selector_matches(policy["spec"]["podSelector"], pod) for pod in labels), policy["metadata"]["name"]
            for rule in policy["spec"].get("ingress") or []:
                for peer in rule.get("from") or []:
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        assert any(selector_matches(peer["podSelector"], pod) for pod in labels), policy["metadata"]["name"]


def test_only_the_gateway_reaches_the_workers_and_only_pdserve_reaches_redis(variants: dict[str, Rendered]) -> None:
    for rendered in _all(variants):
        pods = {c: (pod["metadata"]["labels"], NAMESPACE_LABELS) for c, pod in _pods(rendered).items()}
        sources = {**pods, "stranger": STRANGER, "other-namespace": OTHER_NAMESPACE}
        ports = {c: _parsed(rendered, rendered.component(c))[1] for c in PDSERVE_COMPONENTS}

        def callers(destination: str, port: int) -> set[str]:
            return {name for name, source in sources.items()
                    if _ingress_allowed(rendered, source, pods[destination][0], port)}

        everyone = set(sources)
        assert callers("gateway", ports["gateway"].port) == everyone
        if ports["gateway"].http_port is not None:
            assert callers("gateway", ports["gateway"].http_port) == everyone
        # Decode workers fetch KV from prefill workers. With NCCL, the two worker roles reach each
        # other on any port (NCCL picks its own), their gRPC ports included.
        nccl = "nccl" in rendered.name
        assert callers("decode", ports["decode"].port) == ({"gateway", "prefill", "decode"} if nccl else {"gateway"})
        assert callers("prefill", ports["prefill"].port) == ({"gateway", "prefill", "decode"} if nccl else {"gateway", "decode"})
        assert callers("redis", 6379) == {"gateway", "prefill", "decode"}
        for component in PDSERVE_COMPONENTS:
            # Prometheus, from its own namespace; health ports only from the node (kubelet probes).
            assert callers(component, ports[component].metrics_port) == everyone
            workers = {"prefill", "decode"} if nccl and component != "gateway" else set()
            assert callers(component, ports[component].health_port) == workers
        # NCCL and the torch.distributed store use ephemeral ports between the two worker roles only.
        ephemeral = 41234
        expected = ({"prefill", "decode"}, {"prefill", "decode"}) if nccl else (set(), set())
        assert (callers("prefill", ephemeral), callers("decode", ephemeral)) == expected
        assert callers("redis", ephemeral) == set()
