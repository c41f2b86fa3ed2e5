"""A pool of workers of one role (target or draft): the replicas a coordinator opens sessions on.

The members are a list of addresses (host:port, unix:PATH) or what one `dns:///name:port` target resolves to,
re-resolved periodically: a Kubernetes headless Service lists each ready pod's IP. A monitor polls every member's
health and GetInfo. Health decides whether a member gets new sessions (NOT_SERVING, as a worker draining on
SIGTERM reports, gets none while its open sessions finish); GetInfo gives its session count and tokenizer.

A session is one gRPC stream, and a stream stays on the connection it opened on, so placement is decided once per
session: the usable member with the fewest open sessions, ties broken at random. A member's count is what it last
reported, corrected by the sessions this coordinator opened and closed on it since, so that several coordinators
sharing the pool see each other's sessions (at the poll's delay) and their own at once.
"""

import asyncio
import contextlib
import logging
import random
import socket
import time
from collections.abc import Callable
from enum import Enum

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.common.errors import Unavailable
from specdec.coordinator.addresses import dns_name, join_host_port
from specdec.common.tls import TlsFiles
from specdec.coordinator.config import PoolSettings
from specdec.coordinator.workers import WorkerInfo
from specdec.v1 import worker_pb2

log = logging.getLogger("specdec.coordinator")


class Health(Enum):
    """What the last poll (or a failed session) found; the names are those of the status API and the metrics."""

    UNKNOWN = "unknown"  # not polled yet
    SERVING = "serving"
    NOT_SERVING = "not_serving"  # loading its model, or draining
    UNREACHABLE = "unreachable"  # did not answer, or a session on it failed
    REFUSED = "refused"  # answers, but does not fit the pool (another tokenizer)


class Backoff:
    """When a member whose session failed may get sessions again: pauses that double while it keeps failing and
    reset once a session opens on it. Failures inside a pause (every session of a crashed worker fails at once)
    count once."""

    def __init__(self, initial: float, maximum: float):
        self.initial, self.maximum = initial, maximum
        self.delay = 0.0
        self.retry_at = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.retry_at

    def failed(self) -> None:
        if not self.ready():
            return
        self.delay = min(max(2 * self.delay, self.initial), self.maximum)
        self.retry_at = time.monotonic() + self.delay

    def succeeded(self) -> None:
        self.delay, self.retry_at = 0.0, 0.0


async def resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(info[4][0], port) for info in infos})


def identity(info: WorkerInfo) -> tuple[str, str, str, str]:
    """What a target's greedy output depends on beyond the tokenizer: the model, its engine and dtype and the kind
    of device (a CPU and a GPU round differently, and so do the engines). A session is reopened only on a member of
    the same identity, so that a request never continues on other numerics (a rolling update of the model serves
    both for a while)."""
    return info.model_name, info.engine, info.dtype, info.device.split(":")[0]


class Member:
    """One worker of a pool: its channel, what the last poll found, and the sessions placed on it."""

    def __init__(self, address: str, channel: grpc.aio.Channel, stub, settings: PoolSettings):
        self.address = address
        self.channel = channel
        self.stub = stub
        self.health_stub = health_pb2_grpc.HealthStub(channel)
        self.info: WorkerInfo | None = None
        self.health = Health.UNKNOWN
        self.detail = ""  # why it is refused, not serving or unreachable
        self.local = 0  # sessions this coordinator holds on it
        self.reported = 0  # sessions the worker reported at the last poll ...
        self.local_at_report = 0  # ... of which this coordinator's, at most (see poll)
        self.placed = 0  # sessions this coordinator has opened on it, in all
        self.failures = 0  # sessions on it that failed: a poll sent before the last one does not clear it
        self.backoff = Backoff(settings.retry_initial, settings.retry_max)
        self.gone = False  # no longer resolved: closed once its last session ends

    @property
    def sessions(self) -> int:
        return max(0, self.reported - self.local_at_report) + self.local

    @property
    def full(self) -> bool:
        return self.info is not None and self.info.max_sessions > 0 and self.sessions >= self.info.max_sessions

    @property
    def usable(self) -> bool:
        return self.health is Health.SERVING and not self.gone and self.backoff.ready() and not self.full

    def acquire(self) -> None:
        self.local += 1
        self.placed += 1

    def release(self) -> None:
        self.local -= 1
        if self.gone and self.local == 0:
            close_later(self.channel)

    def failed(self, detail: str) -> None:
        """A session on the member failed: it gets no new sessions until a poll finds it serving after a pause."""
        self.failures += 1
        self.backoff.failed()
        self.health, self.detail = Health.UNREACHABLE, detail


CLOSING: set[asyncio.Task] = set()  # channel closings in progress (a task nobody holds may be collected)


def close_later(channel: grpc.aio.Channel) -> None:
    task = asyncio.ensure_future(channel.close())
    CLOSING.add(task)
    task.add_done_callback(CLOSING.discard)


class WorkerPool:
    """The members of one role and their monitor. accept(info) returns why a member does not fit ('' if it does)."""

    def __init__(
        self,
        role: str,
        addresses: list[str],
        open_channel: Callable[..., grpc.aio.Channel],
        stub_class,
        info_of: Callable,
        tls: TlsFiles | None = None,
        settings: PoolSettings | None = None,
    ):
        if not addresses:
            raise ValueError(f"the {role} pool needs at least one address")
        self.role = role
        self.configured = list(addresses)
        self.dns = dns_name(addresses[0]) if len(addresses) == 1 else None
        if any(dns_name(a) for a in addresses) and self.dns is None:
            raise ValueError(f"--{role}: a dns:/// target must be the only address of its pool")
        self.open_channel, self.stub_class, self.info_of, self.tls = open_channel, stub_class, info_of, tls
        self.settings = settings or PoolSettings()
        self.members: dict[str, Member] = {}
        self.accept: Callable[[WorkerInfo], str] = lambda info: ""
        self.monitor: asyncio.Task | None = None
        self.polled = asyncio.Event()
        self.resolved_at = float("-inf")
        if self.dns is None:
            for address in addresses:
                self.add(address)

    def add(self, address: str) -> None:
        # A member resolved from a name is dialled at its IP; its certificate names the service, not the IP.
        channel = self.open_channel(address, self.tls, server_name=self.dns[0] if self.dns else None)
        self.members[address] = Member(address, channel, self.stub_class(channel), self.settings)

    def drop(self, address: str) -> None:
        member = self.members.pop(address)
        member.gone = True
        if member.local == 0:
            close_later(member.channel)
        log.info("%s worker %s left the pool (%d sessions on it finish there)", self.role, address, member.local)

    def start(self) -> None:
        if self.monitor is None:
            self.monitor = asyncio.ensure_future(self.watch())

    async def watch(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the monitor must outlive any one bad poll
                log.exception("%s pool: poll failed", self.role)
            self.polled.set()
            await asyncio.sleep(self.settings.poll_interval)

    async def refresh(self) -> None:
        """One resolution (when due) and one poll of every member."""
        now = time.monotonic()
        if self.dns is not None and now - self.resolved_at >= self.settings.resolve_interval:
            self.resolved_at = now
            await self.resolve()
        await asyncio.gather(*(self.poll(m) for m in list(self.members.values())))

    async def resolve(self) -> None:
        host, port = self.dns
        try:
            addresses = await resolve(host, port)
        except OSError as error:
            log.warning("%s pool: resolving %s failed (%s); keeping its %d members", self.role, host, error, len(self.members))
            return
        for address in addresses:
            if address not in self.members:
                self.add(address)
                log.info("%s worker %s joined the pool (%s)", self.role, address, host)
        for address in set(self.members) - set(addresses):
            self.drop(address)

    async def poll(self, member: Member) -> None:
        """Health first: a worker loading its model (or draining) answers NOT_SERVING, and its GetInfo would fail.
        What the poll finds replaces what a session failure found only if the poll began after that failure."""
        timeout, failures, local, placed = self.settings.poll_timeout, member.failures, member.local, member.placed
        try:
            checked = await member.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            serving = checked.status == health_pb2.HealthCheckResponse.SERVING
            info = self.info_of(await member.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout)) if serving else None
        except grpc.aio.AioRpcError as error:
            member.health, member.detail = Health.UNREACHABLE, f"{error.code().name}: {error.details()}"
            return
        if member.failures != failures:
            return
        if not serving:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(checked.status)
            member.health, member.detail = Health.NOT_SERVING, status
            return
        # A session this coordinator opened while the poll was out may or may not be in the report. Counting it as
        # reported never counts it twice (it is in `local` already); otherwise it would show as another
        # coordinator's until the next poll, and a worker could look full with room left.
        member.info, member.reported = info, info.active_sessions
        member.local_at_report = local + member.placed - placed
        refused = self.accept(info)
        if refused:
            if member.detail != refused:
                log.error("%s worker %s (%s) refused: %s", self.role, member.address, info.model_name, refused)
            member.health, member.detail = Health.REFUSED, refused
        else:
            member.health, member.detail = Health.SERVING, ""

    async def recheck(self) -> None:
        """Applies a changed accept() to every member now (at start-up, once the tokenizer is known)."""
        await asyncio.gather(*(self.poll(m) for m in list(self.members.values())))

    def usable(self) -> list[Member]:
        return [m for m in self.members.values() if m.usable]

    def pick(self, exclude: set[str] = frozenset(), fallback: bool = False, same_as: tuple | None = None) -> Member:
        """The usable member with the fewest sessions (random among equals).

        fallback: when no member is usable, one not known to refuse sessions: an unreachable one may be restarting,
        and one backing off after a failure may have recovered; a pool of one waits for its worker rather than
        failing at once. same_as: only members of this identity (see identity()).
        """

        def fits(m: Member) -> bool:
            return m.address not in exclude and (same_as is None or (m.info is not None and identity(m.info) == same_as))

        candidates = [m for m in self.usable() if fits(m)]
        if not candidates and fallback:
            candidates = [
                m
                for m in self.members.values()
                if fits(m) and not m.gone and m.health in (Health.UNKNOWN, Health.UNREACHABLE, Health.SERVING)
            ]
        if not candidates:
            raise Unavailable(f"{self.role} worker unavailable: no healthy {self.role} worker ({self.describe()})")
        fewest = min(m.sessions for m in candidates)
        return random.choice([m for m in candidates if m.sessions == fewest])

    async def info(self, timeout: float | None = None) -> WorkerInfo:
        """A usable member's info, waiting up to timeout (default: first_answer_timeout) for the monitor to find one."""
        self.start()
        deadline = time.monotonic() + (self.settings.first_answer_timeout if timeout is None else timeout)
        while True:
            usable = self.usable()
            if usable:
                return usable[0].info
            if time.monotonic() >= deadline:
                raise Unavailable(f"{self.role} worker unavailable: none of {self.describe()} is serving")
            self.polled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.polled.wait(), max(0.05, deadline - time.monotonic()))

    def describe(self) -> str:
        if not self.members:
            return f"{self.configured[0]} resolves to no address"
        return ", ".join(f"{m.address} {m.health.value}" + (f" ({m.detail})" if m.detail else "") for m in self.members.values())

    async def close(self) -> None:
        if self.monitor is not None:
            self.monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.monitor
        await asyncio.gather(*(m.channel.close() for m in self.members.values()))
