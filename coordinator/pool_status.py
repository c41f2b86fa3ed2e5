"""GetStatus's answer: the coordinator's worker pools, each member's health and sessions, as protobuf messages."""

from specdec.coordinator.pool import Health, Member, WorkerPool
from specdec.v1 import generation_pb2, worker_pb2

MEMBER_HEALTH = {
    Health.UNKNOWN: generation_pb2.MEMBER_HEALTH_UNSPECIFIED,
    Health.SERVING: generation_pb2.MEMBER_HEALTH_SERVING,
    Health.NOT_SERVING: generation_pb2.MEMBER_HEALTH_NOT_SERVING,
    Health.UNREACHABLE: generation_pb2.MEMBER_HEALTH_UNREACHABLE,
    Health.REFUSED: generation_pb2.MEMBER_HEALTH_REFUSED,
}
ROLES = {"target": worker_pb2.WORKER_ROLE_TARGET, "draft": worker_pb2.WORKER_ROLE_DRAFT}


def member_of(member: Member) -> generation_pb2.PoolMember:
    info = member.info
    return generation_pb2.PoolMember(
        address=member.address,
        health=MEMBER_HEALTH[member.health],
        model_name=info.model_name if info else "",
        sessions=member.sessions,
        coordinator_sessions=member.local,
        max_sessions=info.max_sessions if info else 0,
        sessions_placed=member.placed,
        detail=member.detail,
    )


def status_of(
    pools: list[WorkerPool], active_requests: int, target_model: str, draft_model: str
) -> generation_pb2.GetStatusResponse:
    return generation_pb2.GetStatusResponse(
        pools=[
            generation_pb2.WorkerPool(
                role=ROLES[pool.role], configured=pool.configured, members=[member_of(m) for m in pool.members.values()]
            )
            for pool in pools
        ],
        active_requests=active_requests,
        target_model=target_model,
        draft_model=draft_model,
    )
