"""The coordinator's OpenTelemetry metrics: GenAI server metrics and what speculation did (names in README)."""

from collections import Counter
from collections.abc import Callable

from opentelemetry.metrics import Observation

from specdec.common.telemetry import meter
from specdec.coordinator.pool import Health

# Bucket boundaries in seconds for latencies, as the GenAI semantic conventions advise.
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
PER_TOKEN_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28]
TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
ROUND_BUCKETS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17]  # tokens committed per round: up to gamma 16, plus one


def histogram(m, name: str, unit: str, description: str, buckets: list[float]):
    return m.create_histogram(name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets)


def counter(m, name: str, unit: str, description: str):
    return m.create_counter(name, unit=unit, description=description)


class CoordinatorMetrics:
    def __init__(self, pools: Callable[[], list] = list):
        """pools: the worker pools (coordinator.pool.WorkerPool) whose state is observed at each collection."""
        self.pools = pools
        m = meter()
        self.request_duration = histogram(
            m, "gen_ai.server.request.duration", "s", "Time from request to its last token", DURATION_BUCKETS
        )
        self.time_to_first_token = histogram(
            m, "gen_ai.server.time_to_first_token", "s", "Time from request to its first streamed token", DURATION_BUCKETS
        )
        self.time_per_output_token = histogram(
            m, "gen_ai.server.time_per_output_token", "s", "Time per token after the first", PER_TOKEN_BUCKETS
        )
        self.token_usage = histogram(
            m, "gen_ai.client.token.usage", "{token}", "Input and output tokens per request", TOKEN_BUCKETS
        )
        self.drafted = counter(m, "specdec.speculation.drafted_tokens", "{token}", "Tokens the draft proposed")
        self.accepted = counter(m, "specdec.speculation.accepted_tokens", "{token}", "Proposed tokens accepted")
        self.drafted_by_position = counter(
            m, "specdec.speculation.drafted_tokens_by_position", "{token}", "Tokens proposed at each draft position (1-based)"
        )
        self.accepted_by_position = counter(
            m, "specdec.speculation.accepted_tokens_by_position", "{token}", "Tokens accepted at each draft position (1-based)"
        )
        self.tokens_per_round = histogram(
            m, "specdec.speculation.tokens_per_round", "{token}", "Tokens committed per round (accepted + 1)", ROUND_BUCKETS
        )
        self.rounds = counter(m, "specdec.speculation.rounds", "{round}", "Speculation rounds (target forward passes)")
        self.fallbacks = counter(
            m, "specdec.speculation.fallbacks", "{request}", "Requests that asked for speculation but ran target-only"
        )
        self.reopened = counter(
            m,
            "specdec.target.reopened_sessions",
            "{session}",
            "Target sessions reopened (on another worker if one is healthy) after their worker failed",
        )
        self.observe_pools(m)

    def observe_pools(self, m) -> None:
        """Gauges read from the pools at each collection."""
        m.create_observable_gauge(
            "specdec.pool.members",
            [self.observe_members],
            unit="{worker}",
            description="Workers of each pool, by health (serving, not_serving, unreachable, refused, unknown)",
        )
        m.create_observable_gauge(
            "specdec.pool.sessions",
            [self.observe_sessions],
            unit="{session}",
            description="Open sessions on each pool member (its last report, corrected by this coordinator's since)",
        )

    def observe_members(self, options=None):
        for pool in self.pools():
            by_health = Counter(m.health.value for m in list(pool.members.values()))
            for health in Health:
                yield Observation(
                    by_health[health.value], {"specdec.worker.role": pool.role, "specdec.worker.health": health.value}
                )

    def observe_sessions(self, options=None):
        for pool in self.pools():
            for member in list(pool.members.values()):  # the event loop may add or drop members meanwhile
                yield Observation(member.sessions, {"specdec.worker.role": pool.role, "server.address": member.address})

    def record_fallback(self, reason: str) -> None:
        self.fallbacks.add(1, {"specdec.fallback.reason": reason})

    @staticmethod
    def attributes(operation: str, model: str) -> dict:
        return {"gen_ai.operation.name": operation, "gen_ai.request.model": model, "gen_ai.provider.name": "specdec"}

    def record_request(self, params, result, model: str, first_token_at: float | None, started: float, finished: float) -> None:
        """The request's latencies and token counts, and what each of its rounds did (its RoundStats records, which
        its spans and response carry too): recorded once the request ends, off the path of its rounds."""
        attributes = self.attributes(params.operation, model)
        duration = finished - started
        self.request_duration.record(duration, attributes)
        if first_token_at is not None:
            self.time_to_first_token.record(first_token_at - started, attributes)
            if len(result.token_ids) > 1:
                self.time_per_output_token.record((finished - first_token_at) / (len(result.token_ids) - 1), attributes)
        self.token_usage.record(result.prompt_tokens, {**attributes, "gen_ai.token.type": "input"})
        self.token_usage.record(len(result.token_ids), {**attributes, "gen_ai.token.type": "output"})
        self.rounds.add(len(result.rounds), attributes)
        self.drafted.add(result.drafted_tokens, attributes)
        self.accepted.add(result.accepted_tokens, attributes)
        for stats in result.rounds:
            self.tokens_per_round.record(stats.committed, attributes)
        for position, drafted, accepted in result.by_position():
            position_attributes = {**attributes, "specdec.position": position}
            self.drafted_by_position.add(drafted, position_attributes)
            self.accepted_by_position.add(accepted, position_attributes)
