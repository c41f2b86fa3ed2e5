"""The architectures the gguf engine runs, one row each: where it reads a family's tensors and which of the decoder
layer's optional blocks (decoder_layers.h) the family has. The next family is a row here (and a block there if it
brings one), not a new code path.

The hyper-parameters themselves (sizes, RoPE bases and scaling, the sliding window and which layers use it, the
attention scale, soft caps) are transformers' config of the file, converted once (common.gguf_metadata); the
loader and the decoder read them from it and from the modules transformers builds for it.
"""

from dataclasses import dataclass, field

# llama.cpp's blk.N tensor names -> the transformers module under model.layers.N, shared by every family.
LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


# Gemma 3's chat format (its instruction-tuned models' template, for text): llama.cpp's GGUF files of Gemma 3 carry
# no tokenizer.chat_template, and the plain "role: text" fallback is not what the model was tuned on.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class Architecture:
    gguf_name: str  # the file's general.architecture
    model_type: str  # transformers' config.model_type for it
    # blk.N.<name>.weight -> the RMS norm module under model.layers.N. The roles the C++ layer gives them are
    # fixed by the module names: input_layernorm before attention; q_norm and k_norm on each head (QK-norm);
    # post_attention_layernorm after attention where pre_feedforward_layernorm exists (Gemma's norms around each
    # block), else before the MLP; post_feedforward_layernorm after the MLP.
    norms: dict[str, str] = field(default_factory=lambda: dict(PRE_NORMS))
    # The file stores norm weights w + norm_offset for transformers' w: llama.cpp's conversion of Gemma's (1 + w)
    # RMS norm adds the 1 (transformers' Gemma2TensorProcessor takes it off again).
    norm_offset: float = 0.0
    # llama.cpp's conversion permuted the rows of q and k (llama's rotary layout): the loader undoes it.
    permuted_qk: bool = False
    gelu: bool = False  # GeGLU (GELU, tanh form) instead of SwiGLU
    embedding_scale: bool = False  # embeddings times sqrt(hidden_size)
    rope_by_layer_type: bool = False  # a rotary table per layer type (Gemma 3's local and global bases)
    # The chat template where the file has none, and the tokens that end a turn besides the file's end of sequence.
    chat_template: str | None = None
    end_of_turn: tuple[str, ...] = ()

    @property
    def sandwich_norms(self) -> bool:
        return "post_ffw_norm" in self.norms


ARCHITECTURES = {
    a.gguf_name: a
    for a in (
        Architecture("llama", "llama", permuted_qk=True),
        Architecture("qwen2", "qwen2"),
        Architecture("qwen3", "qwen3", norms={**PRE_NORMS, **QK_NORMS}),
        Architecture(
            "gemma3",
            "gemma3_text",
            norms={
                "attn_norm": "input_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
                **QK_NORMS,
            },
            norm_offset=1.0,
            gelu=True,
            embedding_scale=True,
            rope_by_layer_type=True,
            chat_template=GEMMA_CHAT_TEMPLATE,
            end_of_turn=("<end_of_turn>",),
        ),
    )
}
BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}


def architecture_of(model_type: str) -> Architecture | None:
    return BY_MODEL_TYPE.get(model_type)


def supported_names() -> str:
    return ", ".join(ARCHITECTURES)
