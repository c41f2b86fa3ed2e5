"""The Kubernetes manifests (docker/kubernetes): each overlay rendered by kubectl's kustomize, every object
validated strictly against Kubernetes' own schemas (kubernetes-validate, offline), and the rendered cluster checked
for the shape the services need: gRPC health probes, drains that are not cut short, headless Services the
coordinators resolve, GPUs, security, resources, metrics, traces and model caches."""

import math
import pathlib
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "docker" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "shared-gpu", "cpu-no-auth")
KUBERNETES_VERSION = "1.32.0"  # the oldest Kubernetes the manifests are meant for (gRPC probes, preStop sleep)
NAMESPACE = "specdec"
ROLES = ("target", "draft", "coordinator")
PORTS = {"coordinator": 50051, "target": 50052, "draft": 50053, "http": 8000}  # common.config.DEFAULT_PORTS
WORKERS = ("target", "draft")
METRICS_PORT = 9464
USER_ID = 10001
# The roles that run on a GPU in each overlay.
GPU_ROLES = {"cpu": set(), "gpu": {"target"}, "shared-gpu": {"target", "draft"}, "cpu-no-auth": set()}
TIME_SLICING = KUBERNETES / "overlays" / "shared-gpu" / "nvidia-time-slicing.yaml"


def render(folder: pathlib.Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render docker/kubernetes (kubectl kustomize): install kubectl 1.27 or newer"
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"kubectl kustomize {folder.relative_to(ROOT)} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def selects(selector: dict | None, labels: dict) -> bool:
    """Whether a label selector (a Service's plain map, or matchLabels/matchExpressions) selects these labels."""
    if not selector:
        return False
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def parse_quantity(value) -> float:
    """A Kubernetes quantity as a number: "500m" -> 0.5, "4Gi" -> 4 * 2**30, 2 -> 2."""
    text = str(value)
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * suffixes[suffix]
    return float(text)


def flag(args: list[str], name: str) -> str | None:
    """The value after a flag in a container's args, or None."""
    return args[args.index(name) + 1] if name in args else None


def addresses(value) -> list[str]:
    """--target/--draft as parsed: one string, a list, or comma-separated addresses."""
    values = value if isinstance(value, list) else [value]
    return [part for v in values if v for part in str(v).split(",")]


class Cluster:
    """One rendered overlay."""

    def __init__(self, name: str, objects: list[dict]):
        self.name = name
        self.objects = objects

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        (found,) = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name] or [None]
        assert found is not None, f"{self.name}: no {kind} {name}"
        return found

    def workloads(self) -> list[dict]:
        return self.of_kind("Deployment") + self.of_kind("StatefulSet")

    def containers(self):
        """(workload, pod spec, container) for every container of every workload."""
        for workload in self.workloads():
            pod = workload["spec"]["template"]["spec"]
            for container in pod.get("initContainers", []) + pod["containers"]:
                yield workload, pod, container

    def specdec(self):
        """{role: (workload, pod spec, container)} of the specdec services (the specdec image, `serve ROLE`)."""
        found = {}
        for workload, pod, container in self.containers():
            if container["image"].split(":")[0].endswith("specdec"):
                assert container["args"][0] == "serve", container["args"]
                role = container["args"][1]
                assert role not in found, f"{self.name}: two {role} containers"
                found[role] = (workload, pod, container)
        assert set(found) == set(ROLES), f"{self.name}: specdec services {sorted(found)}"
        return found

    def services_selecting(self, labels: dict) -> list[dict]:
        return [s for s in self.of_kind("Service") if selects(s["spec"].get("selector"), labels)]

    def workload_selected_by(self, selector: dict) -> list[dict]:
        return [w for w in self.workloads() if selects(selector, w["spec"]["template"]["metadata"]["labels"])]


@pytest.fixture(scope="module")
def rendered() -> dict[str, Cluster]:
    clusters = {name: Cluster(name, render(KUBERNETES / "overlays" / name)) for name in OVERLAYS}
    clusters["base"] = Cluster("base", render(KUBERNETES / "base"))
    return clusters


@pytest.fixture(params=OVERLAYS)
def cluster(request, rendered) -> Cluster:
    return rendered[request.param]


def parsed_args(container: dict):
    """The container's args as `specdec` parses them (imported here: the manifests' own tests need no service code)."""
    from specdec.cli.main import build_parser

    return build_parser().parse_args(container["args"])


@pytest.mark.parametrize("name", [*OVERLAYS, "base"])
def test_every_rendered_object_is_valid_in_kubernetes_1_32_strictly(rendered, name):
    errors = []
    for obj in rendered[name].objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{where}: {'.'.join(map(str, error.path))}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"{where}: {error.message}")
    assert not errors, "\n".join(errors)


def test_each_overlay_runs_the_three_services_and_the_telemetry_stack(cluster):
    kinds = {(w["kind"], w["metadata"]["name"]) for w in cluster.workloads()}
    assert kinds == {
        ("StatefulSet", "specdec-target"),
        ("StatefulSet", "specdec-draft"),
        ("Deployment", "specdec-coordinator"),
        ("Deployment", "otel-collector"),
        ("Deployment", "jaeger"),
    }
    for role, (workload, _, _) in cluster.specdec().items():
        assert workload["metadata"]["name"] == f"specdec-{role}"


def test_the_base_names_no_namespace_and_the_overlays_put_everything_in_one(rendered):
    base = rendered["base"].objects
    assert not [o for o in base if o["kind"] == "Namespace" or "namespace" in o["metadata"]]
    for name in OVERLAYS:
        objects = rendered[name].objects
        namespace = rendered[name].get("Namespace", NAMESPACE)
        # Every pod meets Pod Security "restricted", and the namespace enforces it.
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        others = [o for o in objects if o["kind"] != "Namespace"]
        assert len(others) == len(base)
        assert {o["metadata"].get("namespace") for o in others} == {NAMESPACE}, name


def test_every_service_has_grpc_readiness_and_liveness_probes_on_the_health_service(cluster):
    for role, (_, _, container) in cluster.specdec().items():
        port = int(flag(container["args"], "--port"))
        assert port == PORTS[role]
        assert port in [p["containerPort"] for p in container["ports"]], role
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # grpc.health.v1.Health on the service's own port; no service name: the server's overall status, which
            # is SERVING once the model is loaded and NOT_SERVING from SIGTERM on.
            grpc = container[probe]["grpc"]
            assert grpc["port"] == port and not grpc.get("service"), (role, probe)


def test_loading_a_model_gets_minutes_before_liveness_can_restart_the_pod(cluster):
    for role, (_, _, container) in cluster.specdec().items():
        startup = container["startupProbe"]
        window = startup["periodSeconds"] * startup["failureThreshold"]
        if role == "coordinator":
            # The coordinator starts once a target worker is SERVING, waiting up to --startup-timeout for it.
            assert window >= parsed_args(container).startup_timeout
        else:
            assert window >= 10 * 60, role  # a download of a few GB


def test_termination_grace_outlasts_the_drain_period(cluster):
    for role, (_, pod, container) in cluster.specdec().items():
        assert flag(container["args"], "--grace-period") is not None, role  # said where it is compared
        drain = parsed_args(container).grace_period
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        # SIGTERM comes after the preStop sleep; the pod is killed terminationGracePeriodSeconds after deletion.
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5, role


def test_every_workload_has_a_pod_disruption_budget(cluster):
    budgets = cluster.of_kind("PodDisruptionBudget")
    autoscalers = {h["spec"]["scaleTargetRef"]["name"]: h for h in cluster.of_kind("HorizontalPodAutoscaler")}
    for workload in cluster.workloads():
        name = workload["metadata"]["name"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        (budget,) = [b for b in budgets if selects(b["spec"]["selector"], labels)] or [None]
        assert budget is not None, f"{cluster.name}: no (or several) PodDisruptionBudget for {name}"
        assert budget["spec"].get("maxUnavailable") == 1, name
        assert cluster.workload_selected_by(budget["spec"]["selector"]) == [workload], name
    # A drain takes one pod of each service at a time: the others keep serving.
    for role, (workload, _, _) in cluster.specdec().items():
        name = workload["metadata"]["name"]
        replicas = autoscalers[name]["spec"]["minReplicas"] if name in autoscalers else workload["spec"]["replicas"]
        assert replicas >= 2, (cluster.name, role)


def test_the_coordinator_scales_with_a_horizontal_pod_autoscaler(cluster):
    workload, _, container = cluster.specdec()["coordinator"]
    (autoscaler,) = cluster.of_kind("HorizontalPodAutoscaler")
    assert autoscaler["apiVersion"] == "autoscaling/v2"
    reference = autoscaler["spec"]["scaleTargetRef"]
    assert (reference["kind"], reference["name"]) == (workload["kind"], workload["metadata"]["name"])
    assert workload["metadata"]["name"] == "specdec-coordinator"
    assert "replicas" not in workload["spec"]  # the autoscaler owns the count; kubectl apply does not reset it
    assert 2 <= autoscaler["spec"]["minReplicas"] < autoscaler["spec"]["maxReplicas"]
    (metric,) = autoscaler["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    assert parse_quantity(container["resources"]["requests"]["cpu"]) > 0  # utilisation is measured against it


def test_workers_sit_behind_headless_services_the_coordinator_resolves(cluster):
    services = cluster.specdec()
    coordinator = parsed_args(services["coordinator"][2])
    for role in WORKERS:
        workload, _, container = services[role]
        (address,) = addresses(getattr(coordinator, role))
        match = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", address)
        assert match, f"--{role} {address}: want dns:///SERVICE:PORT (re-resolved; no namespace written down)"
        name, port = match[1], int(match[2])
        service = cluster.get("Service", name)
        assert service["spec"].get("clusterIP") == "None", f"{name} must be headless: its DNS names every pod"
        assert not service["spec"].get("publishNotReadyAddresses"), "a draining (NOT_SERVING) pod must leave DNS"
        assert cluster.workload_selected_by(service["spec"]["selector"]) == [workload], name
        assert port == int(flag(container["args"], "--port")) in [p["port"] for p in service["spec"]["ports"]]
        assert workload["spec"]["serviceName"] == name
    # The client API: a ClusterIP Service over the coordinators, and a headless one for clients that balance
    # requests themselves (gRPC round_robin over dns:///specdec-coordinator-headless:50051).
    workload, _, container = services["coordinator"]
    selecting = cluster.services_selecting(workload["spec"]["template"]["metadata"]["labels"])
    by_name = {service["metadata"]["name"]: service for service in selecting}
    assert set(by_name) == {"specdec-coordinator", "specdec-coordinator-headless"}
    assert by_name["specdec-coordinator"]["spec"].get("clusterIP") != "None"
    assert by_name["specdec-coordinator-headless"]["spec"].get("clusterIP") == "None"
    api_ports = [int(flag(container["args"], "--port")), int(flag(container["args"], "--http-port"))]
    assert api_ports == [PORTS["coordinator"], PORTS["http"]]
    for service in selecting:  # GenerationService and the OpenAI-compatible HTTP API
        assert [p["port"] for p in service["spec"]["ports"]] == api_ports
        assert all(p["port"] in [c["containerPort"] for c in container["ports"]] for p in service["spec"]["ports"])


def test_only_coordinators_reach_the_workers(cluster):
    coordinator_labels = cluster.specdec()["coordinator"][0]["spec"]["template"]["metadata"]["labels"]
    for role in WORKERS:
        workload, _, container = cluster.specdec()[role]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        (policy,) = [p for p in cluster.of_kind("NetworkPolicy") if selects(p["spec"]["podSelector"], labels)]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            opened = {ports.get(p["port"], p["port"]) for p in rule["ports"]}
            if opened != {METRICS_PORT}:
                assert opened == {PORTS[role]}, (role, opened)
                assert [selects(peer["podSelector"], coordinator_labels) for peer in rule["from"]] == [True], role
                assert rule["from"][0]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "specdec-coordinator"}}


def test_gpu_workers_get_one_gpu_each_and_run_the_cuda_image(cluster):
    for role, (_, pod, container) in cluster.specdec().items():
        resources = container["resources"]
        device = flag(container["args"], "--device")
        if role in GPU_ROLES[cluster.name]:
            assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1, role
            assert device == "cuda", role  # the one GPU the device plugin gives the container
            assert container["image"].endswith("-cuda"), role
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
        else:
            assert "nvidia.com/gpu" not in resources["requests"] and "nvidia.com/gpu" not in resources["limits"], role
            assert device in (None, "cpu") and not container["image"].endswith("-cuda"), role
            assert not pod.get("tolerations") and not pod.get("nodeSelector"), role


def test_gpu_overlay_gives_each_target_one_gpu(rendered):
    target_workload, _, target = rendered["gpu"].specdec()["target"]
    assert target_workload["spec"]["replicas"] >= 2  # one GPU per pod, several pods
    assert target["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert not (target_workload["spec"]["template"]["spec"].get("affinity"))  # whole GPUs: nothing to pair
    draft = rendered["gpu"].specdec()["draft"][2]
    assert flag(draft["args"], "--model").startswith("ngram")  # prompt lookup on CPU nodes: no GPU for the draft


def test_shared_gpu_overlay_pairs_each_draft_with_a_target_on_one_time_sliced_gpu(rendered):
    (config,) = [d for d in yaml.safe_load_all(TIME_SLICING.read_text()) if d]
    kubernetes_validate.validate(config, KUBERNETES_VERSION, strict=True)
    (sharing,) = [r for r in yaml.safe_load(config["data"]["any"])["sharing"]["timeSlicing"]["resources"]]
    assert sharing["name"] == "nvidia.com/gpu"
    slices = sharing["replicas"]
    services = rendered["shared-gpu"].specdec()
    for role in WORKERS:
        _, pod, container = services[role]
        # Nodes with one physical GPU cut into as many slices as a target and a draft take.
        assert pod["nodeSelector"]["nvidia.com/gpu.count"] == "1"
        assert pod["nodeSelector"]["nvidia.com/gpu.replicas"] == str(slices)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        # At most one pod of each role per node...
        (spread,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert spread["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": f"specdec-{role}"}
    assert slices == len(WORKERS)
    # ...and a draft only where a target runs: the two share that node's one GPU.
    (pair,) = services["draft"][1]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert pair["topologyKey"] == "kubernetes.io/hostname"
    assert selects(pair["labelSelector"], services["target"][0]["spec"]["template"]["metadata"]["labels"])
    assert not flag(services["draft"][2]["args"], "--model").startswith("ngram")  # a model draft, on the GPU


def test_no_container_runs_privileged_or_as_root_or_writes_its_root_filesystem(cluster):
    for workload, pod, container in cluster.containers():
        where = (cluster.name, workload["metadata"]["name"], container["name"])
        pod_context, context = pod.get("securityContext", {}), container.get("securityContext", {})
        effective = {**pod_context, **context}
        assert effective.get("runAsNonRoot") is True, where
        assert effective.get("runAsUser", 0) > 0, where
        assert context.get("allowPrivilegeEscalation") is False, where
        assert context.get("privileged") is False, where
        assert context.get("readOnlyRootFilesystem") is True, where
        assert context.get("capabilities") == {"drop": ["ALL"]}, where
        assert effective.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert not (pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC")), where
        assert not [v for v in pod.get("volumes", []) if "hostPath" in v], where
        assert pod.get("automountServiceAccountToken") is False, where  # no pod talks to the API server
        # Read-only root: whatever is written goes to a volume.
        assert "/tmp" in [m["mountPath"] for m in container.get("volumeMounts", [])], where
    for role, (_, _, container) in cluster.specdec().items():
        assert container["securityContext"]["runAsUser"] == USER_ID, role


def test_the_image_runs_as_the_user_the_manifests_ask_for():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(rf"^USER {USER_ID}$", dockerfile, re.MULTILINE)
    assert re.search(rf"useradd .*--uid {USER_ID}\b", dockerfile)


def test_every_container_has_resource_requests_and_limits(cluster):
    for workload, _, container in cluster.containers():
        where = (cluster.name, workload["metadata"]["name"], container["name"])
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        for resource in ("cpu", "memory"):
            assert 0 < parse_quantity(requests[resource]) <= parse_quantity(limits[resource]), (where, resource)


def test_workers_compute_on_as_many_threads_as_their_cpu_limit(cluster):
    for role in WORKERS:
        _, _, container = cluster.specdec()[role]
        resources = container["resources"]
        threads = int(flag(container["args"], "--threads"))
        assert threads == math.ceil(parse_quantity(resources["limits"]["cpu"])), role
        # Requests equal to limits: the Guaranteed QoS class, a worker's cores are not shared.
        assert resources["requests"] == resources["limits"], role


def test_pods_are_scraped_by_prometheus(cluster):
    for role, (workload, _, container) in cluster.specdec().items():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        port = int(flag(container["args"], "--metrics-port"))
        assert port == METRICS_PORT
        assert annotations == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }, role
        assert port in [p["containerPort"] for p in container["ports"]], role


def test_traces_flow_through_the_collector_to_jaeger(cluster):
    def serving(host_port: str) -> dict:
        """The one workload behind SERVICE:PORT whose container listens on that Service's target port."""
        host, port = host_port.rsplit(":", 1)
        service = cluster.get("Service", host)
        (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        (workload,) = cluster.workload_selected_by(service["spec"]["selector"])
        container_ports = [p for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
        assert [p for p in container_ports if service_port["targetPort"] in (p["containerPort"], p["name"])]
        return workload

    endpoints = set()
    for role, (_, _, container) in cluster.specdec().items():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_SERVICE_NAME"] == f"specdec-{role}"
        assert env["OTEL_EXPORTER_OTLP_INSECURE"] == "true"
        endpoints.add(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    (endpoint,) = endpoints
    collector = serving(endpoint.removeprefix("http://"))
    assert collector["metadata"]["name"] == "otel-collector"
    (container,) = collector["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"otel/opentelemetry-collector-contrib:\d+\.\d+\.\d+", container["image"])
    # Its pipeline, from the ConfigMap mounted where --config points.
    (config_path,) = [a.removeprefix("--config=") for a in container["args"] if a.startswith("--config=")]
    (mount,) = [m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in collector["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = cluster.get("ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][config_path.rsplit("/", 1)[1]])
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":" + endpoint.rsplit(":", 1)[1])
    assert "batch" in pipeline["processors"]
    (exporter,) = pipeline["exporters"]
    assert exporter.split("/")[0] in ("otlp", "otlp_grpc")
    jaeger = serving(config["exporters"][exporter]["endpoint"])
    (jaeger_container,) = jaeger["spec"]["template"]["spec"]["containers"]
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    assert jaeger_container["image"] == compose["services"]["jaeger"]["image"] == "jaegertracing/jaeger:2.13.0"
    # The UI has its own Service.
    assert 16686 in [
        p["port"]
        for s in cluster.services_selecting(jaeger["spec"]["template"]["metadata"]["labels"])
        for p in s["spec"]["ports"]
    ]


def test_models_are_cached_on_a_volume(cluster):
    for role, (workload, pod, container) in cluster.specdec().items():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HOME"] == "/models" and env["XDG_CACHE_HOME"].startswith("/models/"), role
        assert env["HOME"] == "/tmp", role
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/models"]
        if role in WORKERS:
            # Each worker pod keeps its own claim across restarts and rolling updates.
            (claim,) = [t for t in workload["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == mount["name"]]
            assert parse_quantity(claim["spec"]["resources"]["requests"]["storage"]) >= 10 * 2**30, role
            assert not [v for v in pod.get("volumes", []) if v["name"] == mount["name"]], role
        else:
            # The coordinator keeps tokenizers only.
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert "emptyDir" in volume
        assert pod["securityContext"]["fsGroup"] == USER_ID, role  # the volume is writable by the specdec user


def test_images_are_pinned(cluster):
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]
    for _, _, container in cluster.containers():
        image = container["image"]
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and "/" not in tag, image
        if name.endswith("specdec"):
            assert tag in (version, f"{version}-cuda"), image


def test_the_container_args_parse(cluster):
    from specdec.common.config import DEFAULT_PORTS

    assert PORTS == DEFAULT_PORTS
    for role, (_, _, container) in cluster.specdec().items():
        args = parsed_args(container)
        assert (args.command, args.role) == ("serve", role)
        assert args.port == PORTS[role] and args.metrics_port == METRICS_PORT
        if role == "coordinator":
            assert addresses(args.target) == [flag(container["args"], "--target")]
            assert addresses(args.draft) == [flag(container["args"], "--draft")]
        else:
            assert args.model == flag(container["args"], "--model") and args.device in ("cpu", "cuda")


def test_the_readme_names_objects_that_exist(rendered):
    readme = (KUBERNETES / "README.md").read_text()
    named = set(re.findall(r"\b(svc|service|statefulset|deployment|hpa|pdb)/([a-z0-9-]+)", readme))
    assert named, "the README names no objects"
    kinds = {
        "svc": "Service",
        "service": "Service",
        "statefulset": "StatefulSet",
        "deployment": "Deployment",
        "hpa": "HorizontalPodAutoscaler",
        "pdb": "PodDisruptionBudget",
    }
    for short, name in named:
        rendered["cpu"].get(kinds[short], name)
    for overlay in OVERLAYS:
        assert f"docker/kubernetes/overlays/{overlay}" in readme


def env_of(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def test_authentication_fails_closed_unless_an_overlay_opts_out(cluster):
    # Every specdec service reads its tokens from the Secret, which is required: no Secret, no pod (never "no
    # authentication" by omission). Only an overlay with the no-auth component runs without, and says so.
    services = cluster.specdec()
    for role, (_, _, container) in services.items():
        env = env_of(container)
        refs = [e["valueFrom"]["secretKeyRef"] for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})]
        assert all(not ref.get("optional", False) for ref in refs), (cluster.name, role, refs)
        if cluster.name.endswith("no-auth"):
            assert not refs, (cluster.name, role)
            continue
        assert env["SPECDEC_WORKER_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "specdec-auth", "key": "worker-token"}
        if role == "coordinator":
            assert env["SPECDEC_AUTH"]["value"] == "token"
            assert env["SPECDEC_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "specdec-auth", "key": "token"}
    coordinator_env = env_of(services["coordinator"][2])
    assert coordinator_env["SPECDEC_AUTH"]["value"] == ("none" if cluster.name.endswith("no-auth") else "token")
