"""Layers on GGUF's quantized blocks: a linear layer on one of the kernels, an embedding that de-quantises only
the rows it looks up."""

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from specdec.common.quantized.formats import PackedWeight, rows_of, rows_per_index, select_rows
from specdec.common.quantized.kernels import kernels


class QuantizedLinear(torch.nn.Module):
    """y = x W^T + b with W in GGUF blocks. A row's result is bit-identical whatever else is in the call (see
    kernels.cpp), so a session's logits do not depend on the row count of the pass or on its batch-mates."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.kernel, self.in_features, self.out_features = weight.kernel, weight.in_features, weight.out_features
        self.names = [f"w{i}" for i in range(len(weight.tensors))]
        for name, tensor in zip(self.names, weight.tensors, strict=True):
            self.register_buffer(name, tensor)
        self.register_buffer("bias", bias)
        self.matmul = getattr(kernels(), f"{self.kernel}_matmul")

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.kernel, self.out_features, self.in_features, tuple(getattr(self, n) for n in self.names))

    def select_rows(self, rows: torch.Tensor) -> "QuantizedLinear":
        """The layer over some output features only (rows are independent blocks: an exact selection)."""
        bias = None if self.bias is None else self.bias[rows].contiguous()
        return QuantizedLinear(select_rows(self.packed, rows), bias)

    @property
    def stacking_key(self) -> tuple:
        """Layers with equal keys can share a kernel call (stacked): the same format and input, a bias on all or none."""
        # A format with operands stored tile by tile stacks only whole tiles (formats.TILED).
        whole_tiles = self.out_features % rows_per_index(self.kernel) == 0
        return self.kernel, self.in_features, self.bias is None, whole_tiles or id(self)

    @classmethod
    def stacked(cls, layers: list["QuantizedLinear"]) -> "QuantizedLinear":
        """One layer computing the given layers' outputs side by side (their weight rows one after the other); the
        layers must share a stacking_key.

        A call per layer pays the activations' quantization, a parallel region and Python's dispatch each time; for
        a one-row step these are a large share of the small q/k/v products. Output rows are independent blocks, so
        each output is bit-identical to its own layer's. The given layers' buffers become views of the stacked
        ones: no weight is held twice."""
        first = layers[0]
        if any(layer.stacking_key != first.stacking_key for layer in layers):
            raise ValueError("only layers of one format and input, with a bias on all or none, can be stacked")
        tensors = tuple(torch.cat([getattr(layer, name) for layer in layers]) for name in first.names)
        bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
        out_features = sum(layer.out_features for layer in layers)
        stacked = cls(PackedWeight(first.kernel, out_features, first.in_features, tensors), bias)
        start = 0
        for layer in layers:
            end = start + layer.out_features
            own = rows_of(stacked.packed, start, layer.out_features)
            for name, tensor in zip(first.names, own.tensors, strict=True):
                setattr(layer, name, tensor)
            if bias is not None:
                layer.bias = bias[start:end]
            start = end
        return stacked

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in_features], contiguous float32 -> [n, out_features], bias included."""
        y = self.matmul(rows, *(getattr(self, n) for n in self.names), self.out_features, self.in_features)
        return y if self.bias is None else y.add_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, self.in_features).float().contiguous())
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class QuantizedEmbedding(torch.nn.Module):
    """Token embeddings kept as the file's blocks ([vocab, row bytes]); a lookup de-quantises the rows it reads
    (151,936 x 1,536 floats would be 0.9 GB for Qwen2.5-1.5B). scale: a factor of every embedding (Gemma's
    sqrt(hidden_size)), multiplied in float32 as transformers' scaled embedding does."""

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, embedding_dim: int, scale: float | None = None):
        super().__init__()
        self.qtype, self.embedding_dim = qtype, embedding_dim
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)
        self.register_buffer("blocks", torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)))  # off the mmap
        self.num_embeddings = raw.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[ids.reshape(-1).cpu()].numpy()
        values = quants.dequantize(rows, self.qtype) if self.qtype != GGMLQuantizationType.F32 else rows.view(np.float32)
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1, self.embedding_dim))
        if self.scale is not None:
            out = out * self.scale
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={self.qtype.name}"
