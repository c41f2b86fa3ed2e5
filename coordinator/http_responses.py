"""The HTTP API's answers in OpenAI's shapes: a whole completion, its stream's chunks, usage and specdec's
`speculation` figures."""

import time
import uuid
from collections import Counter


from specdec.coordinator.output import Delta
from specdec.coordinator.finish_reasons import FINISH_REASON_NAMES
from specdec.coordinator.tool_calls import CallArguments, CallStart, CallStream, parse_calls
from specdec.coordinator.types import GenerationParams, GenerationResult, summed_speculation
from specdec.common.sampling import TokenLogprob
from specdec.common.tokenizer import Tokenizer

from specdec.coordinator.http_translate import Tools


def speculation_of(results: list[GenerationResult], by_position: bool) -> dict:
    """specdec's figures of a request, summed over its choices."""
    speculation = summed_speculation(results)
    if by_position:
        drafted_at, accepted_at = Counter(), Counter()
        for result in results:
            for p, d, a in result.by_position():
                drafted_at[p] += d
                accepted_at[p] += a
        speculation["by_position"] = [
            {"position": p, "drafted": d, "accepted": accepted_at[p], "acceptance_rate": accepted_at[p] / d}
            for p, d in sorted(drafted_at.items())
        ]
    return speculation


def usage_of(results: list[GenerationResult]) -> dict:
    completion = sum(len(r.token_ids) for r in results)
    prompt = results[0].prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": results[0].cached_prompt_tokens},
    }


class LogprobsFormat:
    """Token log-probabilities in OpenAI's shapes: chat's `content` list, or completions' parallel lists."""

    def __init__(self, tokenizer: Tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.token(token_id), "logprob": logprob, "bytes": list(self.tokenizer.token_bytes(token_id))}

    def chat_content(self, token_ids: list[int], entries: list[TokenLogprob]) -> dict:
        return {
            "content": [
                {
                    **self.chat_entry(token, entry.logprob),
                    "top_logprobs": [self.chat_entry(t, lp) for t, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)],
                }
                for token, entry in zip(token_ids, entries, strict=True)
            ]
        }

    def completion_lists(self, token_ids: list[int], entries: list[TokenLogprob | None], offset: int) -> dict:
        """entries: None where a token has none (the prompt's first); offset: where the first token's text begins
        in the choice's text. Each position's top_logprobs holds its own token too, as vLLM's do (an eval harness
        checks that a token was the likeliest by comparing it with their maximum)."""
        tokens, top, offsets = [], [], []
        for token, entry in zip(token_ids, entries, strict=True):
            text = self.token(token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                top.append(None)
                continue
            alternatives = {self.token(t): lp for t, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)}
            top.append(alternatives | {text: entry.logprob} if text not in alternatives else alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }


class Completion:
    """The envelope of one response: its id, creation time, model and kind (chat or text completion), and how its
    choices are told (their log-probabilities; with echo, the prompt before each choice's text)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        by_position: bool,
        tokenizer: Tokenizer | None = None,
        params: GenerationParams | None = None,
        echo: str | None = None,
        tools: Tools | None = None,
    ):
        self.chat, self.model, self.by_position = chat, model, by_position
        self.tools = tools if tools is not None and tools.parsed else None  # calls are parsed out of the output
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.logprobs = params is not None and params.logprobs is not None
        self.format = LogprobsFormat(tokenizer, chat) if self.logprobs else None
        self.echo = echo  # the prompt's text, which a completion's choices begin with (None: no echo)
        self.prompt_ids = params.prompt_token_ids if params is not None else []
        self.offsets: dict[int, int] = {}  # per streamed choice: the length of its text so far

    def envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def echoed(self, prompt_logprobs: list[TokenLogprob]) -> tuple[list[int], list[TokenLogprob | None]]:
        """The prompt's tokens and their entries (none for the first), where a completion echoes them."""
        if self.echo is None or not self.logprobs:
            return [], []
        return self.prompt_ids, [None, *prompt_logprobs]

    def logprobs_of(self, token_ids: list[int], entries: list[TokenLogprob], prompt: tuple = ([], []), offset: int = 0):
        if not self.logprobs:
            return None
        if self.chat:
            return self.format.chat_content(token_ids, entries)
        return self.format.completion_lists([*prompt[0], *token_ids], [*prompt[1], *entries], offset)

    def choice(self, index: int, text: str, finish_reason: str | None, chunk: bool, first: bool = False, logprobs=None) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        if chunk:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}

    def calls_of(self, text: str) -> tuple[str | None, list[dict]]:
        if self.tools is None:
            return text, []
        return parse_calls(text, {f["name"] for f in self.tools.functions}, self.tools.parallel)

    def whole(self, results: list[GenerationResult]) -> dict:
        choices = []
        for index, result in enumerate(results):
            prompt = self.echoed(result.prompt_logprobs)
            logprobs = self.logprobs_of(result.token_ids, result.logprobs, prompt)
            text = (self.echo or "") + result.text
            finish = FINISH_REASON_NAMES.get(result.finish_reason)
            choice = self.choice(index, text, finish, False, logprobs=logprobs)
            content, calls = self.calls_of(result.text)
            if calls:  # an output cut at max_tokens says so, whatever calls it completed before
                choice.update(message={"role": "assistant", "content": content, "tool_calls": calls})
                choice["finish_reason"] = "length" if finish == "length" else "tool_calls"
            choices.append(choice)
        return {
            **self.envelope(chunk=False),
            "choices": choices,
            "usage": usage_of(results),
            "speculation": speculation_of(results, self.by_position),
        }

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None = None,
        first: bool = False,
        delta: Delta | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> dict:
        """A chunk of choice `index`: its text and, when asked for, the log-probabilities of delta's tokens; a first
        chunk with echo begins with the prompt (and its log-probabilities: prompt_logprobs)."""
        logprobs = None
        echoed = first and self.echo is not None
        text = (self.echo if echoed else "") + text
        if self.logprobs and (delta is not None or echoed):
            prompt = self.echoed(prompt_logprobs or []) if echoed else ([], [])
            tokens, entries = (delta.token_ids, delta.logprobs) if delta is not None else ([], [])
            offset = 0 if echoed else self.offsets.get(index, 0) + len(text) - len(delta.text)
            logprobs = self.logprobs_of(tokens, entries, prompt, offset)
        self.offsets[index] = self.offsets.get(index, 0) + len(text)
        return {**self.envelope(chunk=True), "choices": [self.choice(index, text, finish_reason, True, first, logprobs)]}

    def call_stream(self) -> CallStream:
        return CallStream({f["name"] for f in self.tools.functions}, self.tools.parallel)

    def tool_chunks(self, index: int, events: list, first: bool, delta: Delta | None = None) -> list[dict]:
        """Chunks of choice `index` with tools, from what its CallStream told of a delta (`events`): content as
        delta.content; a call's start as delta.tool_calls with its index, id, type, name and its arguments so far;
        its arguments' further pieces as delta.tool_calls with the index and function.arguments only (the pieces
        a client appends). The delta's log-probabilities go with the first chunk (alone if it tells nothing yet)."""
        deltas: list[dict] = []
        for event in events:
            if isinstance(event, CallStart):
                function = {"name": event.name, "arguments": ""}
                deltas.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": function}]})
            elif isinstance(event, CallArguments):
                last = deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
                if last is not None and last["index"] == event.index:
                    last["function"]["arguments"] = last["function"].get("arguments", "") + event.text
                else:
                    deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
            else:
                deltas.append({"content": event})
        logprobs = self.logprobs_of(delta.token_ids, delta.logprobs) if delta is not None and delta.logprobs else None
        if not deltas and (first or logprobs):
            deltas.append({})
        chunks = []
        for i, piece in enumerate(deltas):
            if first and i == 0:
                piece = {"role": "assistant", "content": None, **piece}
            choice = {"index": index, "delta": piece, "finish_reason": None, "logprobs": logprobs if i == 0 else None}
            chunks.append({**self.envelope(chunk=True), "choices": [choice]})
        return chunks

    def last_tool_chunk(self, index: int, calls: int, finish_reason: str | None) -> dict:
        """The finish of choice `index` with tools: tool_calls if it made calls (unless cut at max_tokens)."""
        if calls and finish_reason != "length":
            finish_reason = "tool_calls"
        return self.chunk(index, "", finish_reason)

    def usage_chunk(self, results: list[GenerationResult]) -> dict:
        return {
            **self.envelope(chunk=True),
            "choices": [],
            "usage": usage_of(results),
            "speculation": speculation_of(results, self.by_position),
        }
