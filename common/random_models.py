"""Models with random weights: tiny Llamas for the tests (the same spec string gives the same weights anywhere) and
real models' shapes for cost curves (random-shape:...)."""

import math

import torch

from specdec.common.errors import InvalidArgument
from specdec.common.loaded_model import LoadedModel
from specdec.common.model_specs import (
    TINY_RANDOM_CONTEXT,
    TINY_RANDOM_DEFAULTS,
    TINY_RANDOM_PREFIX,
    RANDOM_SHAPE_PREFIX,
    parse_spec_params,
)
from specdec.common.tokenizer import ByteTokenizer

# noise=x perturbs each weight by x * NOISE_SCALE of its tensor's init scale: at vocab 256, noise 0.5 makes a draft
# whose greedy choice agrees with the target's about half the time (0.1: ~90 %, 1.0: ~15 %).
NOISE_SCALE = 0.4


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
