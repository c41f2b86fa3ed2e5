"""The names of GenerateResponse's finish reasons, as the engine's spans, the OpenAI API and the Python client
give them (this module imports no torch: the client reads it)."""

from specdec.v1 import generation_pb2

# OpenAI's and the GenAI conventions' names: an end-of-sequence token and a stop string both "stop".
FINISH_REASON_NAMES = {
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_EOS: "stop",
    generation_pb2.FINISH_REASON_STOP: "stop",
}
