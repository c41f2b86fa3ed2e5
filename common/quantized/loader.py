"""A transformers model whose linear layers and embeddings compute on a GGUF file's own quantized blocks.

transformers builds the architecture (attention, norms, rotary embeddings) on the meta device; every linear layer
and the embeddings are then replaced by layers over the file's blocks (common.quantized.layers) and the norms and
biases are read as float32. Nothing is de-quantised to a float32 copy: the 1.5B loads in seconds and holds its
1 GB of blocks, not 7 GB of floats.
"""

import logging
import os
import time

import numpy as np
import torch

from specdec.common.errors import InvalidArgument
from specdec.common.memory import check_fits
from specdec.common.quantized.architectures import ARCHITECTURES, LINEARS, architecture_of, supported_names
from specdec.common.quantized.formats import FLOAT_FORMATS, UnsupportedFormat, check_kernel_format, pack
from specdec.common.quantized.gguf_file import GGUFFormatError, read_architecture, read_tensors
from specdec.common.quantized.layers import QuantizedEmbedding, QuantizedLinear

log = logging.getLogger("specdec")


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's conversion of a llama q or k projection (transformers'
    reverse_permute_weights, applied to row indices: the rows are independent blocks, so this is exact)."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


class GGUFTensors:
    """A GGUF file's tensors by name, with errors that name the file and the tensor."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.tensors = read_tensors(path)
        except (GGUFFormatError, OSError) as error:
            raise InvalidArgument("model", f"{path}: not a readable GGUF file ({error})") from None

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str):
        if name not in self.tensors:
            raise InvalidArgument("model", f"{self.path}: tensor {name} is missing")
        return self.tensors[name]

    def floats(self, name: str) -> torch.Tensor:
        t = self.get(name)
        if t.tensor_type not in FLOAT_FORMATS:
            raise InvalidArgument("model", f"{self.path}: {name} is {t.tensor_type.name}, expected F32 or F16")
        return torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))

    def linear(self, name: str, rows: np.ndarray | None = None, bias: str | None = None) -> QuantizedLinear:
        t = self.get(name)
        k, n = int(t.shape[0]), int(t.shape[1])
        raw = np.asarray(t.data)
        if raw.ndim != 2 or raw.shape[0] != n:
            raise InvalidArgument("model", f"{self.path}: {name} has {raw.shape} bytes for a [{n}, {k}] matrix")
        if rows is not None:
            raw = raw[rows]
        try:
            weight = pack(raw, t.tensor_type, n, k)
        except UnsupportedFormat as error:
            raise InvalidArgument("model", f"{self.path}: {name}: {error}") from None
        bias_values = None
        if bias and self.has(bias):
            bias_values = self.floats(bias)
            bias_values = bias_values if rows is None else bias_values[torch.from_numpy(rows)].contiguous()
        return QuantizedLinear(weight, bias_values)

    def embedding(self, name: str, scale: float | None = None) -> QuantizedEmbedding:
        t = self.get(name)
        return QuantizedEmbedding(np.asarray(t.data), t.tensor_type, int(t.shape[0]), scale)


def apply_rope_factors(rotary: torch.nn.Module, factors: torch.Tensor, path: str) -> None:
    """llama.cpp's files of Llama 3.1 and later hold their RoPE scaling as rope_freqs.weight, one divisor per
    frequency (convert_hf_to_gguf's llama3 factors), not in the metadata transformers converts: each frequency is
    divided by its factor, as llama.cpp's rotation does (theta / freq_factor)."""
    if getattr(rotary, "rope_type", "default") != "default":
        return  # the config already scales its frequencies
    if factors.shape != rotary.inv_freq.shape:
        raise InvalidArgument(
            "model", f"{path}: rope_freqs.weight has {factors.numel()} factors for {rotary.inv_freq.numel()} frequencies"
        )
    rotary.inv_freq = rotary.inv_freq / factors
    rotary.original_inv_freq = rotary.inv_freq.clone()


def check_file(path: str) -> None:
    """Refuses a file that is not a readable GGUF of an architecture the engine runs, or whose matrices are in a
    block format it does not compute on: from the header and the tensor index alone, before the tens of seconds of
    converting the file's metadata."""
    try:
        name = read_architecture(path)
        tensors = read_tensors(path)
    except (GGUFFormatError, OSError) as error:
        raise InvalidArgument("model", f"{path}: not a readable GGUF file ({error})") from None
    if name not in ARCHITECTURES:
        raise InvalidArgument("engine", f"{path}: the gguf engine runs {supported_names()} models, not {name}")
    # The products' matrices; token_embd is one where the head is tied to it (its lookups read any format).
    tied = "output.weight" not in tensors
    for tensor_name, t in tensors.items():
        if len(t.shape) == 2 and (tensor_name != "token_embd.weight" or tied):
            try:
                check_kernel_format(t.tensor_type)
            except UnsupportedFormat as error:
                raise InvalidArgument("model", f"{path}: {tensor_name}: {error}") from None


def build_quantized_model(path: str, config) -> torch.nn.Module:
    """The model of `config` (read from the same file by transformers) on the file's blocks."""
    from transformers import AutoModelForCausalLM

    text = config.get_text_config()
    architecture = architecture_of(config.model_type)
    if architecture is None:
        raise InvalidArgument("engine", f"{path}: the gguf engine runs {supported_names()} models, not {config.model_type}")
    started = time.monotonic()
    tensors = GGUFTensors(path)
    check_fits(path, sum(t.data.nbytes for t in tensors.tensors.values()), "the gguf engine's blocks of its tensors")
    # Quantized activations amplify float rounding: attention must score each verified token exactly as a one-token
    # step would (common.batched_forward.attend_rows).
    config.row_exact_attention = True
    config.tie_word_embeddings = False  # the head is a layer of its own here, even where it shares the file's tensor
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    decoder = model.get_decoder()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    head_dim = decoder.layers[0].self_attn.head_dim if decoder.layers else 0

    def norm(name: str) -> torch.nn.Parameter:
        weights = tensors.floats(name)
        return torch.nn.Parameter(
            weights - architecture.norm_offset if architecture.norm_offset else weights, requires_grad=False
        )

    for i, layer in enumerate(decoder.layers):
        for gguf_name, path_in_layer in LINEARS.items():
            rows = None
            if architecture.permuted_qk and gguf_name in ("attn_q", "attn_k"):
                count = (heads if gguf_name == "attn_q" else kv_heads) * head_dim
                rows = unpermute_rows(count, heads if gguf_name == "attn_q" else kv_heads)
            parent_path, _, attr = path_in_layer.rpartition(".")
            linear = tensors.linear(f"blk.{i}.{gguf_name}.weight", rows, bias=f"blk.{i}.{gguf_name}.bias")
            setattr(layer.get_submodule(parent_path), attr, linear)
        for gguf_name, path_in_layer in architecture.norms.items():
            layer.get_submodule(path_in_layer).weight = norm(f"blk.{i}.{gguf_name}.weight")
    decoder.norm.weight = norm("output_norm.weight")
    scale = text.hidden_size**0.5 if architecture.embedding_scale else None
    decoder.embed_tokens = tensors.embedding("token_embd.weight", scale)
    head = "output.weight" if tensors.has("output.weight") else "token_embd.weight"
    model.set_output_embeddings(tensors.linear(head))
    with torch.device("cpu"):
        decoder.rotary_emb = type(decoder.rotary_emb)(config=text)
    if tensors.has("rope_freqs.weight"):
        apply_rope_factors(decoder.rotary_emb, tensors.floats("rope_freqs.weight"), path)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise InvalidArgument("model", f"{path}: no GGUF tensor for {', '.join(left[:5])}")
    model.eval().requires_grad_(False)
    size = sum(t.numel() * t.element_size() for t in model.buffers()) / 2**30
    log.info("gguf engine: %s on its own blocks in %.1f s (%.2f GiB)", os.path.basename(path), time.monotonic() - started, size)
    return model
