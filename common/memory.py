"""How much memory this process may still take, the start-up check that a model fits in it, and a malloc that
keeps what a pass frees for the next one.

A worker that loads a model larger than its memory is killed by the kernel (or its pod's cgroup) part-way through
loading, with no message; the check refuses it first, with one line naming the file.
"""

import ctypes
from pathlib import Path

from specdec.common.errors import ResourceExhausted

CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: a container's or pod's memory limit


def read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def available_bytes() -> int | None:
    """The least of the machine's available memory (MemAvailable) and what the cgroup's limit leaves; None when
    neither can be read."""
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    limit, used = read_int(CGROUP / "memory.max"), read_int(CGROUP / "memory.current")
    if limit is not None and used is not None:
        candidates.append(max(limit - used, 0))
    return min(candidates) if candidates else None


def check_fits(path: str, needed: int, what: str) -> None:
    """Raises ResourceExhausted naming the file when `needed` bytes (`what` they hold) exceed what is available."""
    available = available_bytes()
    if available is not None and needed > available:
        raise ResourceExhausted(
            f"model: {path}: {what} need {needed / 2**30:.2f} GiB, and {available / 2**30:.2f} GiB of memory is available"
        )


# Of the memory left once the model is loaded, what the KV caches may take: the rest is for a pass's activations,
# the logits it returns and the allocator's slack.
KV_MEMORY_FRACTION = 0.8


def kv_token_budget(bytes_per_token: int, device: str = "cpu", fraction: float = KV_MEMORY_FRACTION) -> int | None:
    """How many KV-cache tokens fit in `fraction` of the memory available now where the caches live (the GPU's
    free memory for a CUDA device); None when it cannot be read."""
    if device.startswith("cuda"):
        import torch

        available = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        available = available_bytes()
    if available is None or bytes_per_token <= 0:
        return None
    return int(available * fraction) // bytes_per_token


# glibc's malloc hands a freed block of over 32 MB (the ceiling of its dynamic mmap threshold) back to the kernel at
# once, trims a heap whenever 128 KB lie free at its top, and gives each thread that allocates a heap of its own of
# at most 64 MB. A long pass allocates and frees blocks of tens of MB in every layer (the MLP's activations, the
# quantized rows), on the worker's executor thread, which the kernel must then map and zero again for the next
# layer. Above these thresholds, and with every thread in the one main heap, which grows as far as it needs, freed
# memory stays with the process for the next layer's buffers; the peak is what a pass needs either way.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
KEPT_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Where the C library is glibc: let malloc keep up to KEPT_BYTES of freed memory, serve blocks up to that size
    from its heap, and serve threads that have not allocated yet from the main heap (so call it before a worker
    starts its threads); returns whether all three took."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    results = [
        mallopt(option, value)
        for option, value in ((M_MMAP_THRESHOLD, KEPT_BYTES), (M_TRIM_THRESHOLD, KEPT_BYTES), (M_ARENA_MAX, 1))
    ]
    return results == [1, 1, 1]
