"""A model loaded for a worker, with what the worker needs to know of it besides the weights."""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.common.tokenizer import Tokenizer

if TYPE_CHECKING:
    from specdec.common.model_runner import ModelRunner


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
        from specdec.common.model_runner import runner_for

        return runner_for(self.model, self.engine, self.batch_invariant)
