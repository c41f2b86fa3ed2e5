"""The Python client (coordinator.client) is for services that call specdec: it needs grpc and the generated
messages, never torch, transformers or numpy (nor the coordinator's own stack: OpenTelemetry, FastAPI)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "numpy", "opentelemetry", "fastapi")

USE_THE_CLIENT = f"""
import sys
from specdec.coordinator.client import GenerationClient, build_request, response_to_dict
from specdec.v1 import generation_pb2

request = build_request("hi", max_new_tokens=3, temperature=0, stop=["."], gamma_schedule="heuristic")
assert request.prompt == "hi" and request.max_new_tokens == 3
chat = build_request([{{"role": "user", "content": "hi"}}])
assert chat.messages.messages[0].content == "hi"
assert build_request([1, 2, 3]).prompt_token_ids.token_ids == [1, 2, 3]
response = generation_pb2.GenerateResponse(finish_reason=generation_pb2.FINISH_REASON_EOS)
assert response_to_dict(response)["finish_reason"] == "stop"
with GenerationClient(["127.0.0.1:1", "127.0.0.1:2"], timeout=1, token="t"):  # channels connect lazily
    pass
imported = [name for name in {HEAVY!r} if name in sys.modules]
assert not imported, f"the client imported {{imported}}"
"""


def test_the_client_imports_no_torch():
    result = subprocess.run([sys.executable, "-c", USE_THE_CLIENT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
