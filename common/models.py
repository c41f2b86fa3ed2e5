"""Model loading from a --model spec (spellings: common.model_specs): a GGUF file on the gguf engine, or a model
de-quantised for the torch engine, random models (common.random_models) and variants (common.model_variants).

On a CPU, float32 models run their linear layers on weights reordered once for oneDNN (common.packed_linear)
unless linear="eager" is asked for.
"""

import logging
import math
import os
import time

import torch

from specdec.common.errors import InvalidArgument
from specdec.common.loaded_model import LoadedModel
from specdec.common.memory import check_fits
from specdec.common.model_specs import (
    TINY_RANDOM_DEFAULTS,
    TINY_RANDOM_PREFIX,
    gguf_path,
    hf_source,
    is_random_shape,
    is_tiny_random,
    metadata_source,
    parse_spec_params,
    split_variant,
)
from specdec.common.model_variants import make_variant
from specdec.common.packed_linear import can_pack, pack_linear_layers
from specdec.common.random_models import RANDOM_SHAPE_VOCAB, build_random_shape, build_tiny_random
from specdec.common.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger("specdec")


def resolve_device(device: str) -> torch.device:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgument("device", f"{device!r} requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise InvalidArgument("dtype", f"{dtype!r} is not a floating-point torch dtype")
    return resolved


def eos_ids_of(model_config, generation_config, hf_tokenizer) -> list[int]:
    ids = getattr(generation_config, "eos_token_id", None) if generation_config else None
    ids = ids if ids is not None else getattr(model_config, "eos_token_id", None)
    ids = ids if ids is not None else hf_tokenizer.eos_token_id
    return sorted({ids} if isinstance(ids, int) else set(ids or []))


def hf_tokenizer_of(hf_tokenizer, model_config, generation_config) -> HFTokenizer:
    """The tokenizer with its end-of-sequence ids; where the file lacks them, the chat template and end-of-turn
    tokens its architecture's row gives (common/quantized/architectures.py)."""
    from specdec.common.quantized.architectures import architecture_of

    eos_ids = eos_ids_of(model_config, generation_config, hf_tokenizer)
    architecture = architecture_of(model_config.get_text_config().model_type)
    if architecture is not None:
        if hf_tokenizer.chat_template is None and architecture.chat_template:
            hf_tokenizer.chat_template = architecture.chat_template
        turns = [hf_tokenizer.convert_tokens_to_ids(token) for token in architecture.end_of_turn]
        eos_ids = sorted(set(eos_ids) | {t for t in turns if t is not None and t != hf_tokenizer.unk_token_id})
    return HFTokenizer(hf_tokenizer, eos_ids)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer alone, for the coordinator (which holds no model)."""
    spec = split_variant(spec)[0]
    if is_tiny_random(spec):
        return ByteTokenizer(int(parse_spec_params(spec, TINY_RANDOM_PREFIX, TINY_RANDOM_DEFAULTS)["vocab"]))
    if is_random_shape(spec):
        return ByteTokenizer(RANDOM_SHAPE_VOCAB)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    source, kwargs = metadata_source(spec)
    hf_tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    config = AutoConfig.from_pretrained(source, **kwargs)
    try:
        generation_config = GenerationConfig.from_pretrained(source, **kwargs)
    except OSError:
        generation_config = None
    return hf_tokenizer_of(hf_tokenizer, config, generation_config)


LINEAR_KERNELS = ("auto", "packed", "eager")


ENGINES = ("auto", "torch", "gguf")


def resolve_engine(engine: str, spec: str, device: str, dtype: str) -> str:
    """The engine a worker runs: "gguf" (the file's own quantized blocks, common.quantized) or "torch" (the model
    de-quantised to float32, or bfloat16 on a GPU). auto: gguf for a GGUF model on a CPU with AVX2 and no dtype
    asked for (a 1.5B step costs about half the float32 one there, measured); torch otherwise. Both are exact in
    specdec's sense (batch-invariant, greedy speculative output equal to target-only); only torch's float32 also
    equals Hugging Face's generate."""
    if engine not in ENGINES:
        raise InvalidArgument("engine", f"{engine!r}: expected one of {', '.join(ENGINES)}")
    if engine == "torch":
        return engine
    from specdec.common.quantized.kernels import unavailable_reason

    base, variants = spec.split("#")[0], spec.split("#")[1:]
    reasons = [
        "#int8 is the torch engine's quantization" if "int8" in variants else None,
        None if gguf_path(base) else f"{base!r} is not a GGUF model",
        None if resolve_device(device).type == "cpu" else "it runs on the CPU only",
        None if dtype in ("auto", "float32") else f"it computes in float32 and int8, not {dtype}",
        unavailable_reason(),
    ]
    reason = next((r for r in reasons if r), None)
    if engine == "gguf" and reason:
        raise InvalidArgument("engine", f"the gguf engine cannot serve {spec!r}: {reason}")
    return "torch" if reason else "gguf"


def load_model(spec: str, device: str = "cpu", dtype: str = "auto", linear: str = "auto", engine: str = "torch") -> LoadedModel:
    """The model of a --model spec. engine: see resolve_engine. linear (the torch engine): "auto" runs the linear
    layers on oneDNN-packed weights where that path serves the model (CPU, float32), "packed" requires it,
    "eager" keeps transformers' own layers."""
    if linear not in LINEAR_KERNELS:
        raise InvalidArgument("linear", f"{linear!r}: expected one of {', '.join(LINEAR_KERNELS)}")
    started = time.monotonic()
    if resolve_engine(engine, spec, device, dtype) == "gguf":
        loaded = load_unpacked(spec, device, dtype, quantized=True)
        log.info("loaded %s (gguf engine) in %.1f s", spec, time.monotonic() - started)
        return loaded
    loaded = load_unpacked(spec, device, dtype)
    log.info("loaded %s in %.1f s", spec, time.monotonic() - started)
    packable = can_pack(loaded.model)
    if linear == "packed" and not packable:
        raise InvalidArgument("linear", "packed linear layers need a float32 model on a CPU with oneDNN")
    if linear != "eager" and packable:
        started = time.monotonic()
        packed = pack_linear_layers(loaded.model)
        if packed:
            elapsed, min_rows = time.monotonic() - started, packed[0].min_rows
            log.info("packed %d linear layers in %.1f s (calls run on at least %d rows)", len(packed), elapsed, min_rows)
    return loaded


def load_unpacked(spec: str, device: str = "cpu", dtype: str = "auto", quantized: bool = False) -> LoadedModel:
    base, variant = split_variant(spec)
    if variant is not None:
        return make_variant(load_unpacked(base, device, dtype, quantized), variant, spec)
    if quantized:
        return load_quantized(spec)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if is_tiny_random(spec):
        return build_tiny_random(spec, torch_device, torch_dtype)
    if is_random_shape(spec):
        return build_random_shape(spec, torch_device, torch_dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, kwargs = hf_source(spec)
    if "gguf_file" in kwargs:
        check_dequantised_fits(os.path.join(source, kwargs["gguf_file"]), torch_dtype)
    model = (
        AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs).to(torch_device).eval().requires_grad_(False)
    )
    if "gguf_file" in kwargs:
        apply_file_rope_factors(model, os.path.join(source, kwargs["gguf_file"]))
    tokenizer_source, tokenizer_kwargs = metadata_source(spec)
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, **tokenizer_kwargs)
    tokenizer = hf_tokenizer_of(hf_tokenizer, model.config, model.generation_config)
    config = model.config.get_text_config()
    max_context = int(getattr(config, "max_position_embeddings", 0) or 0)
    return LoadedModel(spec, model, tokenizer, int(config.vocab_size), max_context, torch_device, torch_dtype)


def apply_file_rope_factors(model: torch.nn.Module, path: str) -> None:
    """Llama 3's RoPE scaling, which llama.cpp's files hold as rope_freqs.weight and transformers' GGUF loading
    leaves out (common.quantized.loader.apply_rope_factors)."""
    from specdec.common.quantized.gguf_file import read_tensors
    from specdec.common.quantized.loader import apply_rope_factors

    factors = read_tensors(path).get("rope_freqs.weight")
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if factors is not None and rotary is not None and hasattr(rotary, "inv_freq"):
        device = rotary.inv_freq.device
        apply_rope_factors(rotary, torch.from_numpy(factors.data.astype("float32").reshape(-1)).to(device), path)


def check_dequantised_fits(path: str, dtype: torch.dtype) -> None:
    """Refuses a GGUF file whose weights, de-quantised to dtype (the torch engine), exceed the memory left."""
    from specdec.common.quantized.gguf_file import GGUFFormatError, read_tensors

    try:
        elements = sum(math.prod(t.shape) for t in read_tensors(path).values())
    except (GGUFFormatError, OSError) as error:
        raise InvalidArgument("model", f"{path}: not a readable GGUF file ({error})") from None
    check_fits(path, elements * dtype.itemsize, f"its weights de-quantised to {str(dtype).removeprefix('torch.')}")


def load_quantized(spec: str) -> LoadedModel:
    """A GGUF model on its own quantized blocks (the gguf engine, common.quantized)."""
    from transformers import AutoConfig

    from specdec.common.quantized.loader import build_quantized_model, check_file

    path = gguf_path(spec)
    check_file(path)
    source, kwargs = metadata_source(spec)
    config = AutoConfig.from_pretrained(source, **kwargs)
    model = build_quantized_model(path, config)
    tokenizer = load_tokenizer(spec)
    text = config.get_text_config()
    max_context = int(getattr(text, "max_position_embeddings", 0) or 0)
    return LoadedModel(spec, model, tokenizer, int(text.vocab_size), max_context, torch.device("cpu"), torch.float32, "gguf")
