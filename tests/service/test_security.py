"""TLS on the client API, mutual TLS between the coordinator and its workers, and bearer-token authentication.
The tests make their own CA and certificates."""

import asyncio
import datetime
import ipaddress

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from specdec.common.config import ServerOptions
from specdec.common.tls import TlsFiles
from specdec.coordinator.client import GenerationClient, build_request
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.server import build_engine, start_coordinator_server
from specdec.coordinator.worker_clients import GrpcWorkers
from specdec.draft_worker.server import start_draft_server
from specdec.v1 import generation_pb2_grpc, target_pb2_grpc, worker_pb2
from specdec.target_worker.engine import TargetEngine
from specdec.target_worker.server import start_target_server
from tests.support.services import draft_engine_for

TOKEN = "s3cret-token"


def make_key():
    return ec.generate_private_key(ec.SECP256R1())


def make_certificate(subject: str, key, issuer_cert=None, issuer_key=None, is_ca=False):
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_cert.subject if issuer_cert else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key or key, hashes.SHA256())


def write_pair(directory, stem: str, cert, key) -> tuple[str, str]:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with server and client certificates, and a second CA whose client certificate must be refused."""
    directory = tmp_path_factory.mktemp("pki")
    ca_key, rogue_key = make_key(), make_key()
    ca = make_certificate("specdec test CA", ca_key, is_ca=True)
    rogue_ca = make_certificate("rogue CA", rogue_key, is_ca=True)
    files = {"ca": write_pair(directory, "ca", ca, ca_key)[0]}
    for stem, issuer, issuer_key in [("server", ca, ca_key), ("client", ca, ca_key), ("rogue-client", rogue_ca, rogue_key)]:
        key = make_key()
        files[stem] = write_pair(directory, stem, make_certificate(stem, key, issuer, issuer_key), key)
    return files


def serve_secured(pki, target_model, draft_models, scenario):
    """Workers with mutual TLS, the coordinator with TLS and a bearer token; runs scenario(addresses)."""

    async def run():
        worker_tls = ServerOptions(host="127.0.0.1", tls=TlsFiles(*pki["server"], ca=pki["ca"]))
        target_server, target_port = await start_target_server(TargetEngine(target_model), worker_tls)
        draft_server, draft_port = await start_draft_server(draft_engine_for(draft_models, 0.5), worker_tls)
        client_tls = TlsFiles(*pki["client"], ca=pki["ca"])
        workers = GrpcWorkers(f"localhost:{target_port}", f"localhost:{draft_port}", client_tls)
        engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
        api_tls = ServerOptions(host="127.0.0.1", tls=TlsFiles(*pki["server"]))
        coordinator_server, port = await start_coordinator_server(engine, api_tls, auth_token=TOKEN)
        try:
            await asyncio.to_thread(scenario, {"coordinator": f"localhost:{port}", "target": f"localhost:{target_port}"})
        finally:
            await workers.close()
            for server in (coordinator_server, draft_server, target_server):
                await server.stop(0)

    asyncio.run(run())


def test_requests_flow_over_tls_and_mutual_tls(pki, target_model, draft_models):
    def scenario(addresses):
        with GenerationClient(addresses["coordinator"], token=TOKEN, tls_ca=pki["ca"]) as client:
            response = client.generate("secured", max_new_tokens=8, temperature=0, num_speculative_tokens=4)
        assert response.usage.completion_tokens == 8 and response.speculation.drafted_tokens > 0

    serve_secured(pki, target_model, draft_models, scenario)


def get_info(address: str, credentials) -> grpc.StatusCode:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        try:
            target_pb2_grpc.TargetServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as error:
            return error.code()


def test_a_worker_refuses_clients_without_a_valid_certificate(pki, target_model, draft_models):
    ca = open(pki["ca"], "rb").read()

    def credentials(pair):
        cert, key = (open(p, "rb").read() for p in pair)
        return grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)

    def scenario(addresses):
        target = addresses["target"]
        assert get_info(target, credentials(pki["client"])) == grpc.StatusCode.OK
        assert get_info(target, grpc.ssl_channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE, "no client certificate"
        assert get_info(target, credentials(pki["rogue-client"])) == grpc.StatusCode.UNAVAILABLE, "certificate of another CA"
        assert get_info(target, None) == grpc.StatusCode.UNAVAILABLE, "plain text"

    serve_secured(pki, target_model, draft_models, scenario)


def test_generation_requires_the_bearer_token(pki, target_model, draft_models):
    ca = open(pki["ca"], "rb").read()

    def scenario(addresses):
        with grpc.secure_channel(addresses["coordinator"], grpc.ssl_channel_credentials(ca)) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = build_request("hi", max_new_tokens=2, ignore_eos=True)
            for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
                with pytest.raises(grpc.RpcError) as error:
                    stub.Generate(request, metadata=metadata, timeout=10)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as error:
                    next(stub.GenerateStream(request, metadata=metadata, timeout=10))
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (
                stub.Generate(request, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=10).usage.completion_tokens == 2
            )

    serve_secured(pki, target_model, draft_models, scenario)


def test_a_call_without_the_token_is_refused_before_its_message_is_read(target_model):
    # 15 MiB of prompt from a stranger: refused UNAUTHENTICATED by the interceptor, never parsed (a parsed prompt
    # that size would be INVALID_ARGUMENT, past the model's context).
    async def run():
        engine = TargetEngine(target_model, calibrate=False)
        workers = GrpcWorkers("127.0.0.1:1", None)
        coordinator_engine = await build_engine_offline(engine, workers)
        server, port = await start_coordinator_server(coordinator_engine, auth_token=TOKEN)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.Generate(build_request("x" * (15 * 2**20)))
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
        finally:
            await server.stop(0)
            await workers.close()

    asyncio.run(run())


async def build_engine_offline(target: TargetEngine, workers):
    from specdec.coordinator.engine import GenerationEngine
    from specdec.coordinator.workers import WorkerInfo

    return GenerationEngine(workers, target.loaded.tokenizer, WorkerInfo(**target.info()), None, CoordinatorConfig())


def test_workers_with_a_worker_token_serve_only_the_coordinator_that_sends_it(target_model, draft_models):
    async def run():
        target_server, target_port = await start_target_server(TargetEngine(target_model), token="worker-secret")
        draft_server, draft_port = await start_draft_server(draft_engine_for(draft_models, 0.1), token="worker-secret")
        servers = [target_server, draft_server]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{target_port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as error:  # a client straight on the worker port
                    await target_pb2_grpc.TargetServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest())
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
                call = target_pb2_grpc.TargetServiceStub(channel).Verify()
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call.read()
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            # A coordinator without the token cannot even read the worker's info.
            stranger = GrpcWorkers(f"127.0.0.1:{target_port}", None, token=None)
            try:
                with pytest.raises(Exception, match="UNAUTHENTICATED|authorization"):
                    await asyncio.wait_for(stranger.target_info(3), 10)
            finally:
                await stranger.close()
            workers = GrpcWorkers(f"127.0.0.1:{target_port}", f"127.0.0.1:{draft_port}", token="worker-secret")
            try:
                engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
                server, port = await start_coordinator_server(engine)
                servers.append(server)
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = generation_pb2_grpc.GenerationServiceStub(channel)
                    result = await stub.Generate(build_request("hi", max_new_tokens=8, ignore_eos=True, num_speculative_tokens=3))
                    assert result.usage.completion_tokens == 8 and result.speculation.drafted_tokens > 0
                    assert not result.speculation.fallback_reason
            finally:
                await workers.close()
        finally:
            await asyncio.gather(*(s.stop(0) for s in servers))

    asyncio.run(run())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--auth", "token"], "--auth token (SPECDEC_AUTH) requires --auth-token"),
        (["--auth-token", " "], "--auth-token (SPECDEC_AUTH_TOKEN) is set but empty"),
        (["--worker-auth-token", ""], "--worker-auth-token (SPECDEC_WORKER_AUTH_TOKEN) is set but empty"),
        (["--auth", "none", "--auth-token", "t"], "--auth none (SPECDEC_AUTH) contradicts"),
        (["--max-num-speculative-tokens", "64"], "--max-num-speculative-tokens must be in [0, 32]"),
    ],
)
def test_a_coordinator_configured_to_authenticate_without_a_token_refuses_to_start(args, message, capsys):
    from specdec.cli.main import main

    assert main(["serve", "coordinator", "--target", "127.0.0.1:1", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_worker_given_an_empty_worker_token_refuses_to_start(capsys):
    from specdec.cli.main import main

    assert main(["serve", "target", "--model", "tiny-random:seed=0", "--worker-auth-token", ""]) == 2
    assert "is set but empty" in capsys.readouterr().err
