"""Traces and metrics as a user sees them: three real service processes export OTLP to a real OTLP receiver
(TraceService and MetricsService from opentelemetry-proto) started here."""

import concurrent.futures
import threading
import urllib.request
from collections import defaultdict

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, free_port
from tests.support.waiting import wait_until

TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"
DRAFT = f"{TARGET},noise=0.5"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
GENAI_ATTRIBUTES = [
    "gen_ai.operation.name",
    "gen_ai.provider.name",
    "gen_ai.request.model",
    "gen_ai.request.temperature",
    "gen_ai.request.top_p",
    "gen_ai.request.top_k",
    "gen_ai.request.max_tokens",
    "gen_ai.request.seed",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.response.finish_reasons",
    "server.address",
    "server.port",
]


def attribute_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [attribute_value(v) for v in value.array_value.values]
    return getattr(value, kind)


class Receiver:
    """Collects what the services export: spans (with their service name) and metric names."""

    def __init__(self):
        self.spans = []
        self.metric_names = set()
        self.lock = threading.Lock()

    def Export(self, request, context):
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            with self.lock:
                for resource_spans in request.resource_spans:
                    service = {a.key: attribute_value(a.value) for a in resource_spans.resource.attributes}["service.name"]
                    for scope in resource_spans.scope_spans:
                        self.spans.extend((service, span) for span in scope.spans)
            return trace_service_pb2.ExportTraceServiceResponse()
        with self.lock:
            for resource_metrics in request.resource_metrics:
                for scope in resource_metrics.scope_metrics:
                    self.metric_names.update(m.name for m in scope.metrics)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def trace(self, trace_id: str) -> list:
        with self.lock:
            return [(service, span) for service, span in self.spans if span.trace_id.hex() == trace_id]


class TraceHandler(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver):
        self.receiver = receiver

    def Export(self, request, context):
        return self.receiver.Export(request, context)


class MetricsHandler(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver):
        self.receiver = receiver

    def Export(self, request, context):
        return self.receiver.Export(request, context)


@pytest.fixture(scope="module")
def receiver():
    collected = Receiver()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceHandler(collected), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsHandler(collected), server)
    collected.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collected
    server.stop(0)


@pytest.fixture(scope="module")
def traced_cluster(receiver, tmp_path_factory):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
    }
    metrics_port = free_port()
    cluster = Cluster(
        # A fixed gamma: every round drafts, so every round has draft spans to check (auto may skip the draft).
        TARGET,
        DRAFT,
        free_port(),
        ["--metrics-port", str(metrics_port), "--gamma", "4"],
        env=env,
        log_dir=tmp_path_factory.mktemp("logs"),
        http_port=free_port(),
    )
    with cluster:
        cluster.metrics_port = metrics_port
        yield cluster


def wait_for_trace(receiver, trace_id: str, caller_span_id: str, verifies: int, proposals: int, timeout: float = 20) -> list:
    """The trace's spans once all have arrived: the span continuing the caller's (it ends last, and each service
    exports in batches of its own, in the order its spans end, so the coordinator's root can come in a later batch
    than the workers' spans), a verification per round, a proposal per round that drafted."""

    def arrived():
        spans = [span for _, span in receiver.trace(trace_id)]
        names = [span.name for span in spans]
        return (
            any(span.parent_span_id.hex() == caller_span_id for span in spans)
            and names.count("target.verify") >= verifies
            and names.count("draft.propose") >= proposals
        )

    wait_until(arrived, timeout, interval=0.1, message=f"the spans of trace {trace_id}'s {verifies} rounds")
    return receiver.trace(trace_id)


def test_one_trace_spans_all_three_services_with_a_span_per_round(traced_cluster, receiver):
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
    with GenerationClient(traced_cluster.address) as client:
        response = client.stub.Generate(
            client_request("Tracing every round of this request", seed=3), metadata=[("traceparent", traceparent)]
        )
    rounds = response.speculation.rounds
    assert rounds > 1
    spans = wait_for_trace(receiver, TRACE_ID, CLIENT_SPAN_ID, rounds, sum(r.drafted > 0 for r in response.rounds))
    services = {service for service, _ in spans}
    assert services == {"specdec-coordinator", "specdec-target", "specdec-draft"}

    by_id = {span.span_id: (service, span) for service, span in spans}
    children = defaultdict(list)
    for service, span in spans:
        children[span.parent_span_id].append((service, span))
    (root,) = [span for _, span in spans if span.parent_span_id.hex() == CLIENT_SPAN_ID]
    assert root.name == f"text_completion {TARGET}"

    def names_under(span_id):
        return sorted(span.name for _, span in children[span_id])

    def parent_name(span):
        return by_id[span.parent_span_id][1].name

    speculate = [span for _, span in children[root.span_id] if span.name == "speculate"]
    assert len(speculate) == rounds, "one speculate span per round"
    for round_span in speculate:
        assert names_under(round_span.span_id) in (["draft", "verify"], ["verify"])
    for service, span in spans:
        if span.name in ("draft.propose", "target.verify", "kv.rollback"):
            assert parent_name(span) in ("draft", "verify") and parent_name(by_id[span.parent_span_id][1]) == "speculate"
            assert service in ("specdec-target", "specdec-draft")
    worker_prefills = [span for service, span in spans if span.name == "prefill" and service != "specdec-coordinator"]
    assert len(worker_prefills) == 2 and all(parent_name(by_id[s.parent_span_id][1]) == root.name for s in worker_prefills)
    assert sum(span.name == "target.verify" for _, span in spans) == rounds

    attributes = {a.key: attribute_value(a.value) for a in root.attributes}
    assert set(GENAI_ATTRIBUTES) <= set(attributes)
    assert attributes["gen_ai.usage.output_tokens"] == response.usage.completion_tokens
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["gen_ai.request.seed"] == 3

    split = response.time_split
    parts = (
        split.prefill_us
        + split.draft_us
        + split.verify_us
        + split.sync_us
        + split.queue_us
        + split.handling_us
        + split.network_us
        + split.coordinator_us
    )
    root_us = (root.end_time_unix_nano - root.start_time_unix_nano) / 1000
    assert abs(parts - root_us) <= 0.1 * root_us, (parts, root_us)
    assert abs(split.total_us - root_us) <= 0.1 * root_us
    round_attributes = {a.key: attribute_value(a.value) for a in speculate[0].attributes}
    for key in (
        "specdec.gamma",
        "specdec.accepted",
        "specdec.rollback",
        "specdec.bytes_sent",
        "specdec.bytes_received",
        "specdec.time.draft_us",
        "specdec.time.verify_us",
        "specdec.time.sync_us",
        "specdec.time.network_us",
        "specdec.time.handling_us",
    ):
        assert key in round_attributes, key
    assert round_attributes["specdec.bytes_sent"] > 0 and round_attributes["specdec.bytes_received"] > 0


def client_request(prompt: str, seed: int):
    from specdec.coordinator.client import build_request

    return build_request(
        prompt, max_new_tokens=24, temperature=0.8, top_p=0.95, top_k=50, seed=seed, ignore_eos=True, include_rounds=True
    )


def test_metrics_are_exported_over_otlp_and_scrapeable(traced_cluster, receiver):
    with GenerationClient(traced_cluster.address) as client:
        messages = list(client.stream("metrics for a streamed request", max_new_tokens=16, temperature=0, ignore_eos=True))
    assert messages[-1].HasField("final")
    expected = {
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
        "gen_ai.client.token.usage",
        "specdec.speculation.drafted_tokens",
        "specdec.speculation.accepted_tokens",
        "specdec.speculation.accepted_tokens_by_position",
        "specdec.speculation.tokens_per_round",
        "specdec.speculation.rounds",
        "specdec.worker.forward.duration",
        "specdec.worker.kv_rollback.duration",
        "specdec.worker.sessions",
    }
    wait_until(lambda: expected <= receiver.metric_names, 15, interval=0.2, message="the metrics were not all exported")
    assert expected <= receiver.metric_names, expected - receiver.metric_names
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{traced_cluster.metrics_port}/metrics", timeout=5).read().decode()
    assert "gen_ai_server_request_duration_seconds_bucket" in scraped
    assert "specdec_speculation_rounds" in scraped


def prometheus_count(metrics_port: int, metric: str, operation: str) -> float:
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in scraped.splitlines()
        if line.startswith(metric + "{") and f'gen_ai_operation_name="{operation}"' in line
    )


def test_an_http_request_continues_the_callers_trace_with_the_genai_span_below_and_counts_in_the_gen_ai_metrics(
    traced_cluster, receiver
):
    import httpx2

    trace_id, parent = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"
    count = "gen_ai_server_request_duration_seconds_count"
    before = prometheus_count(traced_cluster.metrics_port, count, "chat")
    body = {"model": TARGET, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 12, "temperature": 0}
    response = httpx2.post(
        f"http://127.0.0.1:{traced_cluster.http_port}/v1/chat/completions",
        json={**body, "ignore_eos": True},
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        timeout=30,
    )
    assert response.status_code == 200
    rounds = response.json()["speculation"]["rounds"]
    # The HTTP server span, which continues the caller's trace, ends after the last byte.
    spans = wait_for_trace(receiver, trace_id, parent, rounds, 1)
    by_id = {span.span_id: span for _, span in spans}
    (http,) = [span for _, span in spans if span.parent_span_id.hex() == parent]
    assert http.name == "POST /v1/chat/completions", "the HTTP server span continues the caller's trace"
    (genai,) = [span for _, span in spans if span.name == f"chat {TARGET}"]
    ancestor = by_id[genai.parent_span_id]
    while ancestor.span_id != http.span_id:
        ancestor = by_id[ancestor.parent_span_id]
    assert sum(span.name == "speculate" and span.parent_span_id == genai.span_id for _, span in spans) == rounds
    assert {service for service, _ in spans} == {"specdec-coordinator", "specdec-target", "specdec-draft"}
    assert prometheus_count(traced_cluster.metrics_port, count, "chat") == before + 1


def test_explain_lists_every_round(traced_cluster):
    from specdec.coordinator.explain import explain_table

    with GenerationClient(traced_cluster.address) as client:
        response = client.generate("explain me", max_new_tokens=12, temperature=0, ignore_eos=True, include_rounds=True)
    table = explain_table(response)
    assert len(response.rounds) == response.speculation.rounds
    assert len(table.splitlines()) == response.speculation.rounds + 3
    assert "verify ms" in table and "network" in table


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"OTEL_SDK_DISABLED": "true"}, {}], ids=["sdk-disabled", "no-endpoint"])
def test_services_run_without_an_exporter_and_without_errors(env, tmp_path):
    with Cluster(TARGET, DRAFT, free_port(), env=env, log_dir=tmp_path) as cluster, GenerationClient(cluster.address) as client:
        response = client.generate("no tracing here", max_new_tokens=8, temperature=0)
        assert response.usage.completion_tokens >= 1
    logs = "\n".join(path.read_text() for path in tmp_path.glob("*.log"))
    assert "Traceback" not in logs and " ERROR " not in logs and "Failed to export" not in logs, logs
