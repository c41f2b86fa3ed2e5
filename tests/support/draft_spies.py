"""Wrappers on a draft engine that record or slow its calls."""

import time


def spy_on_openings(draft) -> list[int]:
    """The prompt length of every session the draft engine begins."""
    lengths, begin = [], draft.begin_session

    def recording(prompt, *args, **kwargs):
        lengths.append(len(prompt))
        return begin(prompt, *args, **kwargs)

    draft.begin_session = recording
    return lengths


def slowed_prefill(draft, seconds: float) -> None:
    prefill = draft.prefill_chunk

    def slow(handle):
        time.sleep(seconds)
        return prefill(handle)

    draft.prefill_chunk = slow
