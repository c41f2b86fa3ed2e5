"""Variants: a cheaper model made from a loaded one (MODEL#layers=N, MODEL#vocab=N, MODEL#int8, MODEL#q4_1), a draft
that shares its target's tokenizer and weights."""

import warnings

import numpy as np
import torch

from specdec.common.errors import InvalidArgument
from specdec.common.loaded_model import LoadedModel


def make_variant(loaded: LoadedModel, variant: str, spec: str) -> LoadedModel:
    """A cheaper model made from a loaded one: a draft that shares its target's tokenizer and weights."""
    key, _, value = variant.partition("=")
    if key == "layers" and value.isdigit() and int(value) >= 1:
        loaded = keep_first_layers(loaded, int(value), spec)
    elif key == "int8" and not value:
        loaded = quantize_int8(loaded)
    elif key == "vocab" and value.isdigit() and int(value) >= 1:
        loaded = restrict_vocab(loaded, int(value))
    elif key == "q4_1" and not value:
        loaded = requantize_q4_1(loaded, spec)
    else:
        raise InvalidArgument(
            "model", f"{spec!r}: expected MODEL#layers=N (N >= 1), MODEL#vocab=N (N >= 1), MODEL#int8 or MODEL#q4_1"
        )
    loaded.name = spec
    return loaded


def quantize_int8(loaded: LoadedModel) -> LoadedModel:
    """Every linear layer with int8 weights (per-tensor scales) and dynamically quantized activations: about 3.5x
    faster than float32 on a CPU, a draft for its own float32 original."""
    if loaded.device.type != "cpu":
        raise InvalidArgument("model", "#int8 (dynamic quantization) runs on the CPU only")
    with warnings.catch_warnings():
        # PyTorch announces the move of quantization to torchao; this pinned version still ships it.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.ao.quantization.quantize_dynamic(loaded.model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    # Activations are quantized with one scale per tensor: in a batched pass one session's scale would depend on
    # the others' activations, so each session gets its own pass (see common.model_runner).
    loaded.batch_invariant = False
    return loaded


def keep_first_layers(loaded: LoadedModel, layers: int, spec: str) -> LoadedModel:
    """Drops every decoder layer after the first `layers`: the rest of the model (embeddings, final norm, head) is
    shared, so the truncated model is an early-exit draft of the full one."""
    decoder = loaded.model.get_decoder()
    config = loaded.model.config.get_text_config()
    if layers > len(decoder.layers):
        raise InvalidArgument("model", f"{spec!r}: the model has only {len(decoder.layers)} layers")
    decoder.layers = decoder.layers[:layers]
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    return loaded


class RestrictedHead(torch.nn.Module):
    """An output layer over some token ids only; every other token gets logit -inf, i.e. probability 0.

    A draft sampled from these logits samples from exactly the distribution it reports (its q is zero outside
    the kept ids), so restricting the draft's vocabulary can lower acceptance but never changes the output."""

    def __init__(self, head: torch.nn.Linear, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        if hasattr(head, "select_rows"):  # a layer on quantized blocks (the gguf engine): its rows are exact
            self.linear = head.select_rows(token_ids.cpu())
        else:
            self.linear = torch.nn.Linear(head.in_features, len(token_ids), bias=head.bias is not None)
            with torch.no_grad():
                self.linear.weight.copy_(head.weight[token_ids])
                if head.bias is not None:
                    self.linear.bias.copy_(head.bias[token_ids])
        self.register_buffer("token_ids", token_ids)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self.linear(hidden)
        logits = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.token_ids, kept)


def frequent_token_ids(loaded: LoadedModel, count: int) -> torch.Tensor:
    """The count lowest ids (a byte-level BPE vocabulary numbers its tokens in merge order, so the lowest ids are
    the earliest, most frequent merges: on code, Qwen's first 32768 ids cover 92 % of tokens, 65536 cover 98 %)
    and every special token above them, EOS included."""
    special = [*loaded.tokenizer.eos_token_ids, *getattr(getattr(loaded.tokenizer, "hf", None), "all_special_ids", [])]
    ids = set(range(min(count, loaded.vocab_size))) | {i for i in special if 0 <= i < loaded.vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long, device=loaded.device)


def restrict_vocab(loaded: LoadedModel, count: int) -> LoadedModel:
    """The model with an output layer over its count most frequent tokens (see RestrictedHead)."""
    head = loaded.model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) and not hasattr(head, "select_rows"):
        raise InvalidArgument("model", f"{loaded.name!r}: #vocab needs a plain linear output layer")
    loaded.model.set_output_embeddings(RestrictedHead(head, frequent_token_ids(loaded, count), loaded.vocab_size))
    loaded.model.config.tie_word_embeddings = False  # the head no longer shares the input embeddings' tensor
    return loaded


def requantize_q4_1(loaded: LoadedModel, spec: str) -> LoadedModel:
    """Every product layer of a model on the gguf engine in Q4_1 (5 bits a weight), but those in Q4_K already: a
    step streams fewer bytes (Q5_0, which the engine unpacks to int8 codes, and Q8_0 take 8.5, Q6_K 6.6). A draft
    samples from exactly the q it reports whatever its weights, so a coarser draft may lower acceptance but never
    changes the output."""
    from specdec.common.quantized.layers import QuantizedLinear

    if loaded.engine != "gguf":
        raise InvalidArgument("model", f"{spec!r}: #q4_1 re-quantizes the gguf engine's layers (--engine gguf)")
    for module in list(loaded.model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QuantizedLinear) and child.kernel not in ("q41", "q4k") and child.in_features % 32 == 0:
                setattr(module, name, as_q4_1(child))
    return loaded


def as_q4_1(layer):
    """The layer's weights de-quantized and quantized again to Q4_1 (as gguf's own quantizer does), a slice of rows at
    a time."""
    from specdec.common.quantized.formats import dequantize, pack_q41, quantize_q4_1, rows_of
    from specdec.common.quantized.layers import QuantizedLinear

    rows, packed, n, k = 8192, layer.packed, layer.out_features, layer.in_features
    parts = [quantize_q4_1(dequantize(rows_of(packed, start, min(rows, n - start))).float()) for start in range(0, n, rows)]
    codes, d, m = (np.concatenate(operand) for operand in zip(*parts, strict=True))
    return QuantizedLinear(pack_q41(codes, d, m, n, k), layer.bias)
