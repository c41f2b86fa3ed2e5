"""Addresses of services as flags and clients give them: host:port, unix:PATH, several (a list, comma-separated),
or one dns:///name:port target that stands for every address the name resolves to."""

DNS_SCHEME = "dns:"


def parse_addresses(values: str | list[str] | None) -> list[str]:
    """Addresses from flags: repeated and/or comma-separated."""
    if values is None:
        return []
    items = [values] if isinstance(values, str) else values
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def dns_name(address: str) -> tuple[str, int] | None:
    """(host, port) of a `dns:///host:port` (or `dns://authority/host:port`) target; None for a plain address."""
    if not address.startswith(DNS_SCHEME):
        return None
    rest = address[len(DNS_SCHEME) :].removeprefix("//")
    rest = rest.split("/", 1)[1] if "/" in rest else rest
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r}: a dns target needs a port, e.g. dns:///specdec-target:50052")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
