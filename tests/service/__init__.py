"""Service tests: the worker engines, the coordinator and the three gRPC services (or the OpenAI HTTP app) in this
process, on loopback."""
