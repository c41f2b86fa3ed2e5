"""Linear layers whose weights oneDNN has reordered once, so that a pass over a few rows costs about one pass over
one row.

A forward pass over k new tokens streams every weight once whatever k is; that is what makes verifying gamma
drafted tokens nearly as cheap as one decoding step. torch's float32 `linear` goes to MKL, whose few-row products
are slow and grow with the row count on CPUs (a [k, 1536] x [1536, 8960] product: 3.7 ms for k = 1, 7.2 for 2,
11 for 3). oneDNN on a weight reordered once into its blocked layout takes 2.3-2.7 ms for every k from 1 to 16
on the same machine. The reordering changes only the summation order: results differ from MKL's by float
rounding (about 1e-4 on values of 10-40).
"""

import os
import statistics
import time

import torch
import torch.nn.functional as F

# The row count oneDNN's weight layout is chosen for. On the machines measured, 16 keeps every pass of 1 to 16
# rows within 1.3x of the best layout for that row count.
ROWS_HINT = 16
EXACT_ROWS = 16  # row counts up to this run as they are (verification rounds); larger ones are bucketed


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's reordered layout (CPU, float32)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Buffers, so that state_dict() and memory accounting see them.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.min_rows = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        padded = padded_rows(count, self.min_rows)
        if padded > count:
            rows = F.pad(rows, (0, 0, 0, padded - count))
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y[:count].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def padded_rows(count: int, min_rows: int) -> int:
    """The row count a call of `count` rows runs at: at least min_rows (fewer can cost more: oneDNN picks its kernel
    by the row count), exact up to 16, then rounded up to one of 8 steps per power of two. oneDNN builds and keeps
    a kernel for every row count it meets (about 0.5 MB each); batches and prompts of every size would otherwise
    grow a worker's memory without bound. Padding costs at most 1/8 more rows."""
    if count <= EXACT_ROWS:
        return max(count, min_rows)
    step = 1 << (count.bit_length() - 4)
    return -(-count // step) * step


def can_pack(model: torch.nn.Module) -> bool:
    """oneDNN's reordered weights serve float32 models on a CPU built with oneDNN."""
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and parameter.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linear_layers(model: torch.nn.Module) -> list[PackedLinear]:
    """Replaces every float32 nn.Linear of the model by a PackedLinear, and pads their few-row calls to the
    cheapest row count measured on this machine; returns the packed layers."""
    packed = []
    # Parents only: a list of every module would keep each replaced layer's float32 weight alive until the end,
    # doubling the model's memory at its peak (a 1.5B model: 6 GB more). A head tied to the input embeddings does
    # keep one more copy: the embeddings still hold the original (0.9 GB on Qwen2.5-1.5B).
    parents = [m for m in model.modules() if any(type(c) is torch.nn.Linear for c in m.children())]
    for parent in parents:
        for name in [n for n, c in parent.named_children() if type(c) is torch.nn.Linear and c.weight.dtype == torch.float32]:
            packed.append(PackedLinear(getattr(parent, name)))
            setattr(parent, name, packed[-1])
    if packed:
        # SPECDEC_PACKED_MIN_ROWS pins it: the row count decides oneDNN's kernel and so the float rounding, which
        # replicas of one deployment (or a restarted worker) then share instead of each measuring its own.
        pinned = os.environ.get("SPECDEC_PACKED_MIN_ROWS")
        largest = max(packed, key=lambda layer: layer.in_features * layer.out_features)
        min_rows = int(pinned) if pinned else cheapest_min_rows(largest)
        for layer in packed:
            layer.min_rows = min_rows
    return packed


def cheapest_min_rows(layer: PackedLinear, max_rows: int = 8, repeats: int = 5) -> int:
    """The row count up to max_rows whose product costs least on this machine (the smallest within 5 % of the
    cheapest): a call over fewer rows is padded to it. On the AMD EPYC measured, 4-6 rows cost 0.75-0.85 of one."""
    layer.min_rows = 1
    costs = {}
    with torch.inference_mode():
        for rows in range(1, max_rows + 1):
            x = torch.randn(rows, layer.in_features)
            layer(x)  # the first call of a shape sets up oneDNN's primitive
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                layer(x)
                samples.append(time.perf_counter() - start)
            costs[rows] = statistics.median(samples)
    cheapest = min(costs.values())
    return min(rows for rows, cost in costs.items() if cost <= 1.05 * cheapest)
