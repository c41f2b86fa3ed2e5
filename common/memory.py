"""How much memory this process may still take, and the start-up check that a model fits in it.

A worker that loads a model larger than its memory is killed by the kernel (or its pod's cgroup) part-way through
loading, with no message; the check refuses it first, with one line naming the file.
"""

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
