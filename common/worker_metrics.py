"""A worker's OpenTelemetry metrics: open sessions, forward-pass time, KV rollback time (names in README)."""

from opentelemetry.metrics import CallbackOptions, Observation

from specdec.common.sessions import SessionRegistry
from specdec.common.telemetry import meter

SECONDS_BUCKETS = [0.00001, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]


class WorkerMetrics:
    def __init__(self, role: str, sessions: SessionRegistry):
        m = meter()
        self.attributes = {"specdec.worker": role}

        def observe_sessions(_: CallbackOptions):
            yield Observation(len(sessions), self.attributes)

        m.create_observable_gauge(
            "specdec.worker.sessions", callbacks=[observe_sessions], unit="{session}", description="Sessions (open streams) held"
        )
        self.forward = m.create_histogram(
            "specdec.worker.forward.duration",
            unit="s",
            description="Model work per message: prefill, propose or verify",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self.rollback = m.create_histogram(
            "specdec.worker.kv_rollback.duration",
            unit="s",
            description="KV-cache rollback (crop) per round",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )

    def record_forward(self, operation: str, seconds: float) -> None:
        self.forward.record(seconds, {**self.attributes, "specdec.operation": operation})

    def record_rollback(self, seconds: float) -> None:
        self.rollback.record(seconds, self.attributes)
