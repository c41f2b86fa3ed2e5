"""What the tests share besides fixtures: helpers that start services, wait, generate and compare; not tests."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
