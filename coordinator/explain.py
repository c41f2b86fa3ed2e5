"""`specdec generate --explain`: where each round's time went, as a table for people without Jaeger at hand."""

from specdec.v1 import generation_pb2

COLUMNS = ["draft", "verify", "sync", "queue", "network", "coord", "total", "hidden draft", "hidden verify"]


def ms(us: int) -> str:
    return f"{us / 1000:.2f}"


def split_cells(split: generation_pb2.TimeSplit) -> list[str]:
    return [
        ms(split.draft_us),
        ms(split.verify_us),
        ms(split.sync_us),
        ms(split.queue_us),
        ms(split.network_us),
        ms(split.coordinator_us),
        ms(split.total_us),
        ms(split.draft_overlapped_us),
        ms(split.verify_ahead_us),
    ]


def explain_table(response: generation_pb2.GenerateResponse) -> str:
    header = ["round", "gamma", "drafted", "accepted", "rollback", *[f"{c} ms" for c in COLUMNS], "bytes out", "bytes in"]
    rows = [
        [
            str(i),
            str(r.gamma),
            str(r.drafted),
            str(r.accepted),
            str(r.rollback),
            *split_cells(r.time_split),
            str(r.bytes_sent),
            str(r.bytes_received),
        ]
        for i, r in enumerate(response.rounds, start=1)
    ]
    total = response.time_split
    rows.append(
        [
            "all",
            "",
            str(response.speculation.drafted_tokens),
            str(response.speculation.accepted_tokens),
            "",
            *split_cells(total),
            "",
            "",
        ]
    )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    names = ("prefill", "draft", "verify", "sync", "queue", "network", "coordinator")
    share = {name: getattr(total, f"{name}_us") for name in names}
    parts = ", ".join(f"{name} {100 * us / total.total_us:.1f}%" for name, us in share.items()) if total.total_us else ""
    lines.append(f"request {ms(total.total_us)} ms: {parts}")
    return "\n".join(lines)
