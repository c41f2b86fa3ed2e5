"""The OpenAI request bodies the HTTP API takes (pydantic models), and OpenAI's limits on their fields."""

from pydantic import BaseModel, Field


MAX_CHOICES = 16  # n
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limits
MAX_COMPLETION_LOGPROBS = 5


class StreamOptions(BaseModel):
    include_usage: bool | None = None  # a last chunk with usage (and speculation) before [DONE]


class RequestFields(BaseModel):
    """What both endpoints take. Fields that would change what is generated and that specdec cannot honour are
    accepted at their neutral values only (null, or the default); other unknown fields are ignored."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # OpenAI's signed 64 bits, or specdec's unsigned ones
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's, which specdec takes too
    repetition_penalty: float | None = None
    min_p: float | None = None
    # specdec's own
    top_k: int | None = None
    num_speculative_tokens: int | None = None
    overlap: bool | None = None
    ignore_eos: bool | None = None
    speculation_by_position: bool | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF


class CompletionRequest(RequestFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(RequestFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
