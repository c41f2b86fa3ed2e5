"""Worker pools: placement on the least-loaded healthy member, draining, refusal of another tokenizer, DNS members,
and the coordinator's status API. Real gRPC workers on loopback, in this process."""

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, replace

import grpc
import pytest

from specdec.common.config import ServerOptions
from specdec.common.models import load_model
from specdec.common.sampling import SamplingParams
from specdec.common.grpc_server import set_serving, start_serving
from specdec.coordinator import pool as pool_module
from specdec.coordinator.config import CoordinatorConfig, PoolSettings
from specdec.coordinator.pool import Health
from specdec.coordinator.server import build_engine, start_coordinator_server
from specdec.coordinator.types import GenerationParams
from specdec.coordinator.worker_clients import GrpcWorkers
from specdec.v1 import generation_pb2, generation_pb2_grpc
from specdec.target_worker.engine import TargetEngine
from specdec.target_worker.server import SERVICE as TARGET_SERVICE
from specdec.target_worker.server import TargetServicer
from tests.support.waiting import wait_until

FAST = PoolSettings(poll_interval=0.05, resolve_interval=0.05, retry_initial=0.2)
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def other_tokenizer_model():
    return load_model("tiny-random:seed=0,vocab=128,layers=2,hidden=64")


@contextlib.asynccontextmanager
async def target_servers(*models):
    """Target workers on loopback; yields (addresses, health servicers)."""
    started = [
        await start_serving(TARGET_SERVICE, TargetServicer(TargetEngine(m)), ServerOptions(host="127.0.0.1")) for m in models
    ]
    try:
        yield [f"127.0.0.1:{bound}" for _, _, bound in started], [h for _, h, _ in started], [s for s, _, _ in started]
    finally:
        await asyncio.gather(*(server.stop(0) for server, _, _ in started))


async def open_sessions(workers: GrpcWorkers, count: int) -> list:
    return [await workers.open_target([1, 2, 3], GREEDY, 0) for _ in range(count)]


def placed(workers: GrpcWorkers) -> dict[str, int]:
    return {m.address: m.placed for m in workers.target_pool.members.values()}


def test_sessions_go_to_the_member_with_the_fewest_ties_broken_at_random(target_model):
    async def run():
        async with target_servers(target_model, target_model, target_model) as (addresses, _, _):
            workers = GrpcWorkers(addresses, None, settings=FAST)
            try:
                await workers.target_info()
                sessions = await open_sessions(workers, 30)
                assert sorted(placed(workers).values()) == [10, 10, 10], "least-sessions placement spreads evenly"
                # Close the sessions of one member: the next ones all go there until it catches up.
                emptied = sessions[0].member.address
                for session in [s for s in sessions if s.member.address == emptied]:
                    await session.close()
                await open_sessions(workers, 10)
                assert placed(workers)[emptied] == 20
                # Ties are broken at random: with equal loads each member is picked first now and then.
                firsts = collections.Counter()
                for _ in range(60):
                    session = await workers.open_target([1], GREEDY, 0)
                    firsts[session.member.address] += 1
                    await session.close()
                assert set(firsts) == set(addresses)
            finally:
                await workers.close()

    asyncio.run(run())


def test_a_session_opened_while_a_poll_is_out_is_counted_once(target_model):
    """The worker's report may include a session this coordinator opened after the poll was sent: it must not count
    both as its own and as another coordinator's (it did, making a member look fuller than it was)."""

    async def run():
        async with target_servers(target_model) as (addresses, _, _):
            # No polls of the monitor's own: the test runs the one poll that races with an opening.
            workers = GrpcWorkers(addresses, None, settings=PoolSettings(poll_interval=3600, resolve_interval=3600))
            try:
                await workers.target_info()
                member = next(iter(workers.target_pool.members.values()))
                real_get_info, opened = member.stub.GetInfo, []

                async def get_info_answered_after_an_opening(request, timeout=None):
                    opened.append(await workers.open_target([1, 2, 3], GREEDY, 0))
                    return await real_get_info(request, timeout=timeout)

                member.stub.GetInfo = get_info_answered_after_an_opening
                await workers.target_pool.poll(member)
                assert len(opened) == 1 and member.reported == 1, "the report did not include the new session"
                assert member.sessions == 1
                member.stub.GetInfo = real_get_info
                await opened[0].close()
                await workers.target_pool.poll(member)
                assert member.sessions == 0
            finally:
                await workers.close()

    asyncio.run(run())


def test_a_draining_worker_gets_no_new_sessions_while_its_open_ones_finish(target_model):
    async def run():
        async with target_servers(target_model, target_model) as (addresses, healths, _):
            workers = GrpcWorkers(addresses, None, settings=FAST)
            try:
                await workers.target_info()
                sessions = await open_sessions(workers, 4)
                draining = sessions[0].member
                await set_serving(healths[addresses.index(draining.address)], [TARGET_SERVICE.full_name], False)
                await wait_until(lambda: draining.health is Health.NOT_SERVING, message="the poll did not see it drain")
                before = draining.placed
                await open_sessions(workers, 6)
                assert draining.placed == before, "a NOT_SERVING worker got a new session"
                for session in sessions:  # the open sessions on the draining worker still work
                    verdict = await session.verify([], [])
                    assert verdict.num_accepted == 0
                await set_serving(healths[addresses.index(draining.address)], [TARGET_SERVICE.full_name], True)
                await wait_until(lambda: draining.health is Health.SERVING, message="the poll did not see it serve again")
                await open_sessions(workers, 2)
                assert draining.placed > before, "a worker serving again gets sessions again"
            finally:
                await workers.close()

    asyncio.run(run())


def test_a_worker_with_another_tokenizer_is_refused_and_the_rest_keep_serving(target_model, other_tokenizer_model, caplog):
    async def run():
        async with target_servers(target_model, target_model, other_tokenizer_model) as (addresses, _, _):
            good, bad = addresses[:2], addresses[2]
            workers = GrpcWorkers(good, None, settings=FAST)
            engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
            server, port = await start_coordinator_server(engine)
            try:
                # The mismatching worker joins the pool later (a new replica of the deployment).
                workers.target_pool.add(bad)
                member = workers.target_pool.members[bad]
                await wait_until(lambda: member.health is Health.REFUSED, message="the poll did not refuse it")
                assert "different tokenizers" in member.detail
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = generation_pb2_grpc.GenerationServiceStub(channel)
                    for i in range(6):
                        response = await stub.Generate(
                            generation_pb2.GenerateRequest(prompt=f"request {i}", max_new_tokens=4, temperature=0)
                        )
                        assert len(response.token_ids) == 4
                    status = await stub.GetStatus(generation_pb2.GetStatusRequest())
                members = {m.address: m for m in status.pools[0].members}
                assert members[bad].health == generation_pb2.MEMBER_HEALTH_REFUSED and members[bad].sessions_placed == 0
                assert all(members[a].health == generation_pb2.MEMBER_HEALTH_SERVING for a in good)
                assert sum(members[a].sessions_placed for a in good) == 6
            finally:
                await server.stop(0)
                await workers.close()

    with caplog.at_level(logging.ERROR, logger="specdec.coordinator"):
        asyncio.run(run())
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, "the refusal is logged once, naming the worker"
    assert "127.0.0.1" in refusals[0] and "vocab=128" in refusals[0]


def test_a_dns_target_is_re_resolved_and_the_pool_follows_it(target_model, monkeypatch):
    async def run():
        async with target_servers(target_model, target_model) as (addresses, _, _):
            answers = [addresses[:1]]

            async def resolve(host, port):
                assert (host, port) == ("specdec-target", 50052)
                return answers[-1]

            monkeypatch.setattr(pool_module, "resolve", resolve)
            workers = GrpcWorkers("dns:///specdec-target:50052", None, settings=FAST)
            try:
                await workers.target_info()
                assert list(workers.target_pool.members) == addresses[:1]
                kept = await workers.open_target([1], GREEDY, 0)
                answers.append(addresses[1:])  # a rolling update: the first pod is replaced by the second
                await wait_until(lambda: list(workers.target_pool.members) == addresses[1:], message="not re-resolved")
                session = await workers.open_target([1], GREEDY, 0)
                assert session.member.address == addresses[1]
                assert (await kept.verify([], [])).num_accepted == 0, "a session on a departed member finishes there"
                await kept.close()
                await session.close()
            finally:
                await workers.close()

    asyncio.run(run())


@dataclass
class FailedMidRequest:
    result: object  # GenerationResult
    member: object  # the pool member that failed
    other: object  # the one that took over
    placed_before: int  # sessions placed on the other before the failure


async def failing_mid_request(engine, params, pool, server_at) -> FailedMidRequest:
    """Runs the request once alone, then again with the worker holding its session (of the pool) stopped after the
    first delta; checks that the streamed tokens and the result equal the first run's."""
    reference = (await engine.generate_all(params)).token_ids
    events = engine.generate(params)
    first = await anext(events)
    (member,) = [m for m in pool.members.values() if m.local]
    other = next(m for m in pool.members.values() if m is not member)
    placed_before = other.placed
    await server_at(member.address).stop(0)
    rest = [e async for e in events]
    result = rest[-1]
    assert first.token_ids + [t for e in rest[:-1] for t in e.token_ids] == result.token_ids == reference
    return FailedMidRequest(result, member, other, placed_before)


def test_a_session_that_fails_is_reopened_on_the_other_worker(target_model):
    async def run():
        async with target_servers(target_model, target_model) as (addresses, _, servers):
            workers = GrpcWorkers(addresses, None, settings=FAST)
            engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
            try:
                params = GenerationParams(
                    prompt_token_ids=[5, 6, 7], sampling=GREEDY, max_new_tokens=48, num_speculative_tokens=0, ignore_eos=True
                )
                run = await failing_mid_request(engine, params, workers.target_pool, lambda m: servers[addresses.index(m)])
                assert run.other.placed == run.placed_before + 1, "the session was reopened on the other worker"
                assert run.member.health is Health.UNREACHABLE
            finally:
                await workers.close()

    asyncio.run(run())


def test_pool_state_is_exported_as_metrics_and_shown_by_specdec_status(target_model, other_tokenizer_model, capsys):
    from specdec.cli.main import build_parser, run_status
    from specdec.coordinator.metrics import CoordinatorMetrics

    async def run():
        async with target_servers(target_model, other_tokenizer_model) as (addresses, _, _):
            workers = GrpcWorkers(addresses, None, settings=FAST)
            engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
            server, port = await start_coordinator_server(engine)
            try:
                sessions = await open_sessions(workers, 3)
                metrics = CoordinatorMetrics(workers.status)
                members = {o.attributes["specdec.worker.health"]: o.value for o in metrics.observe_members()}
                assert members["serving"] == 1 and members["refused"] == 1 and members["unreachable"] == 0
                by_member = {o.attributes["server.address"]: o.value for o in metrics.observe_sessions()}
                assert by_member == {addresses[0]: 3, addresses[1]: 0}
                code = await asyncio.to_thread(run_status, build_parser().parse_args(["status", f"127.0.0.1:{port}"]))
                assert code == 0
                for session in sessions:
                    await session.close()
            finally:
                await server.stop(0)
                await workers.close()

    asyncio.run(run())
    table = capsys.readouterr().out
    good, refused = [line for line in table.splitlines() if line.startswith("target ") and "127.0.0.1:" in line]
    assert good.split()[2:5] == ["serving", "3", "3"] and "refused" in refused and "different tokenizers" in refused


@contextlib.asynccontextmanager
async def draft_servers(draft_models, count: int):
    """Model draft workers on loopback; yields (addresses, engines, servers)."""
    from specdec.draft_worker.server import SERVICE as DRAFT_SERVICE
    from specdec.draft_worker.server import DraftServicer
    from tests.support.services import draft_engine_for

    engines = [draft_engine_for(draft_models, 0.1) for _ in range(count)]
    started = [await start_serving(DRAFT_SERVICE, DraftServicer(e), ServerOptions(host="127.0.0.1")) for e in engines]
    try:
        yield [f"127.0.0.1:{bound}" for _, _, bound in started], engines, [s for s, _, _ in started]
    finally:
        await asyncio.gather(*(server.stop(0) for server, _, _ in started))


def test_a_failed_draft_session_is_reopened_on_the_other_draft_worker(target_model, draft_models):
    async def run():
        async with (
            draft_servers(draft_models, 2) as (draft_addresses, _, drafts),
            target_servers(target_model) as (addresses, _, _),
        ):
            workers = GrpcWorkers(addresses, draft_addresses, settings=FAST)
            engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
            try:
                params = GenerationParams(
                    prompt_token_ids=[5, 6, 7], sampling=GREEDY, max_new_tokens=64, num_speculative_tokens=3, ignore_eos=True
                )
                run = await failing_mid_request(engine, params, workers.draft_pool, lambda m: drafts[draft_addresses.index(m)])
                result, member, other, placed_before = run.result, run.member, run.other, run.placed_before
                assert result.fallback_reason == "draft_failed"
                failed_at = next(i for i, r in enumerate(result.rounds) if r.drafted == 0)
                assert any(r.drafted > 0 for r in result.rounds[failed_at:]), "the request speculates again"
                assert other.placed == placed_before + 1 and member.health is Health.UNREACHABLE
            finally:
                await workers.close()

    asyncio.run(run())


def test_a_draft_worker_too_slow_to_reopen_a_session_is_marked_failed_and_not_tried_again(target_model, draft_models):
    """The reopening's deadline is the one each draft worker gets in open_on_pool: a worker that misses it is marked
    failed there (an outer deadline of the same length cut it short, and the slow worker was tried on every reopen)."""
    from tests.support.draft_spies import slowed_prefill, spy_on_openings

    async def run():
        async with (
            draft_servers(draft_models, 2) as (draft_addresses, engines, drafts),
            target_servers(target_model) as (addresses, _, _),
        ):
            openings: list[list[int]] = []

            def stopping(address):
                # From now on every draft worker prefills far slower than the opening's deadline (0.3 s).
                for draft in engines:
                    openings.append(spy_on_openings(draft))
                    slowed_prefill(draft, 1.0)
                return drafts[draft_addresses.index(address)]

            # A failed member waits far longer than the request before it is polled back (each reopening would
            # otherwise find the slow worker healthy again).
            workers = GrpcWorkers(addresses, draft_addresses, settings=replace(FAST, retry_initial=30.0))
            engine = await build_engine(workers, CoordinatorConfig(draft_timeout=0.3), tokenizer=target_model.tokenizer)
            try:
                params = GenerationParams(
                    prompt_token_ids=[5, 6, 7], sampling=GREEDY, max_new_tokens=64, num_speculative_tokens=3, ignore_eos=True
                )
                run = await failing_mid_request(engine, params, workers.draft_pool, stopping)
                assert run.result.fallback_reason == "draft_failed"  # the first reason is kept
                other = draft_addresses.index(run.other.address)
                assert [len(lengths) for lengths in openings] == [int(i == other) for i in range(2)], (
                    "the slow worker was tried once"
                )
                assert run.other.failures == 1, "marked failed for missing its deadline"
            finally:
                await workers.close()

    asyncio.run(run())


def test_a_lone_target_that_restarts_and_loads_again_is_used_as_soon_as_it_serves(target_model):
    """A pool of one: the restarted worker answers NOT_SERVING while it loads, then SERVING; the request in progress
    reopens its session there at once, however often it failed meanwhile."""

    async def run():
        servicer = TargetServicer(TargetEngine(target_model))
        server, health, port = await start_serving(TARGET_SERVICE, servicer, ServerOptions(host="127.0.0.1"))
        address = f"127.0.0.1:{port}"
        workers = GrpcWorkers(address, None, settings=FAST)
        engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
        restarted = None
        try:
            params = GenerationParams(
                prompt_token_ids=[5, 6, 7], sampling=GREEDY, max_new_tokens=48, num_speculative_tokens=0, ignore_eos=True
            )
            reference = (await engine.generate_all(params)).token_ids
            events = engine.generate(params)
            await anext(events)
            attempts, open_target = [], workers.open_target

            async def counted_open_target(*args, **kwargs):
                attempts.append(time.monotonic())
                return await open_target(*args, **kwargs)

            workers.open_target = counted_open_target
            await server.stop(0)
            loading = TargetServicer(None)  # listening, model not loaded: NOT_SERVING, sessions refused
            restarted, health, _ = await start_serving(TARGET_SERVICE, loading, ServerOptions(host="127.0.0.1", port=port))
            await set_serving(health, [TARGET_SERVICE.full_name], False)
            rest = asyncio.ensure_future(anext_all(events))
            member = workers.target_pool.members[address]
            # The request tries to reopen its session again and again (backing off) while the worker loads, and is
            # still waiting 2 s after its first try.
            await wait_until(
                lambda: len(attempts) >= 4 and time.monotonic() - attempts[0] >= 2.0 and member.health is Health.NOT_SERVING,
                timeout=10,
                message="the request did not keep retrying, or the poll did not find the loading worker NOT_SERVING",
            )
            assert not rest.done()
            assert member.health is Health.NOT_SERVING, "a loading worker is not serving, not unreachable"
            loading.engine = TargetEngine(target_model)
            await set_serving(health, [TARGET_SERVICE.full_name], True)
            served = time.monotonic()
            result = (await asyncio.wait_for(rest, 10))[-1]
            assert result.token_ids == reference
            assert time.monotonic() - served < 2.0, "the request waited for a backoff after the worker served again"
        finally:
            await workers.close()
            await server.stop(0)
            if restarted is not None:
                await restarted.stop(0)

    asyncio.run(run())


async def anext_all(events) -> list:
    return [event async for event in events]


def test_workers_resolved_from_a_name_are_verified_against_that_name_over_tls(target_model, monkeypatch, tmp_path):
    """A dns:/// member is dialled at its IP; its certificate names the service, and that is what TLS checks."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from specdec.common.tls import TlsFiles

    def certificate(name: str, key, issuer=None, issuer_key=None, sans=None):
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer.subject if issuer else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(s) for s in sans]), critical=False)
        return builder.sign(issuer_key or key, hashes.SHA256())

    def write(stem, cert, key):
        (tmp_path / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (tmp_path / f"{stem}.key").write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        return str(tmp_path / f"{stem}.crt"), str(tmp_path / f"{stem}.key")

    ca_key, server_key, client_key = (
        ec.generate_private_key(ec.SECP256R1()),
        *(ec.generate_private_key(ec.SECP256R1()) for _ in range(2)),
    )
    ca = certificate("test CA", ca_key)
    ca_file, _ = write("ca", ca, ca_key)
    server_files = write("server", certificate("specdec-target", server_key, ca, ca_key, ["specdec-target"]), server_key)
    client_files = write("client", certificate("coordinator", client_key, ca, ca_key, ["coordinator"]), client_key)

    async def run():
        tls = TlsFiles(*server_files, ca=ca_file)
        server, _, port = await start_serving(
            TARGET_SERVICE, TargetServicer(TargetEngine(target_model)), ServerOptions(host="127.0.0.1", tls=tls)
        )

        async def resolve(host, resolved_port):
            return [f"127.0.0.1:{port}"]

        monkeypatch.setattr(pool_module, "resolve", resolve)
        workers = GrpcWorkers("dns:///specdec-target:50052", None, TlsFiles(*client_files, ca=ca_file), settings=FAST)
        try:
            await workers.target_info(5)
            session = await workers.open_target([1, 2], GREEDY, 0)
            assert (await session.verify([], [])).num_accepted == 0
            await session.close()
        finally:
            await workers.close()
            await server.stop(0)

    asyncio.run(run())


def test_the_client_goes_to_the_next_coordinator_when_one_is_unreachable(target_model):
    from specdec.coordinator.client import GenerationClient
    from specdec.coordinator.cluster import free_port
    from tests.support.services import BackgroundServices

    services = BackgroundServices(TargetEngine(target_model), None)
    try:
        dead = f"127.0.0.1:{free_port()}"
        with GenerationClient([dead, services.services.coordinator_address], timeout=30) as client:
            for i in range(4):  # each call starts at the next address: half of them start at the dead one
                assert len(client.generate(f"call {i}", max_new_tokens=3, temperature=0).token_ids) == 3
                streamed = list(client.stream(f"stream {i}", max_new_tokens=3, temperature=0))
                assert streamed[-1].HasField("final")
    finally:
        services.stop()
