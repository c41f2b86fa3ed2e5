"""TLS for the client API and mutual TLS between the coordinator and its workers, from PEM files."""

import os
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths. A server with `ca` set requires clients to present a certificate signed by it (mutual TLS);
    a client with `cert`/`key` set presents them."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)


def read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    if not (tls.cert and tls.key):
        raise ValueError("a TLS server needs both a certificate and its private key (--tls-cert, --tls-key)")
    return grpc.ssl_server_credentials(
        [(read(tls.key), read(tls.cert))], root_certificates=read(tls.ca), require_client_auth=tls.ca is not None
    )


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=read(tls.ca), private_key=read(tls.key), certificate_chain=read(tls.cert)
    )


def tls_from_env(prefix: str) -> TlsFiles:
    """TlsFiles from PREFIX_CERT, PREFIX_KEY and PREFIX_CA, e.g. SPECDEC_TLS_CERT."""
    return TlsFiles(os.environ.get(f"{prefix}_CERT"), os.environ.get(f"{prefix}_KEY"), os.environ.get(f"{prefix}_CA"))
