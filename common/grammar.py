"""Constrained decoding: a grammar (a JSON schema, Lark, a regex) as a mask over the vocabulary, with llguidance
(the library llama.cpp and vLLM use; docs/design/grammar.md says where each matcher lives and why).

A grammar travels as llguidance's own grammar text (Lark, or its JSON grammar object). Every party that samples
or tests a token of a constrained request holds a GrammarMatcher over the output tokens: the target worker masks p
at each verified position (and cuts a proposal at its first forbidden token), a model draft masks its q. Compiling
is bounded by llguidance's parser limits (GRAMMAR_LIMITS) and the grammar's size, and cached per grammar text: a
session starts from a deep copy of the compiled matcher.
"""

import functools
import json
import threading
from collections import OrderedDict

import llguidance
import numpy as np
import torch

from specdec.common.errors import InvalidArgument

MAX_GRAMMAR_CHARS = 64 * 1024
# Bounds on compiling and on each mask step (llguidance's "fuel": work, not time, so a grammar is refused the same
# way on every machine). Half llguidance's defaults: plenty for schemas of hundreds of fields, and a mask step
# stays a few milliseconds at worst.
GRAMMAR_LIMITS = dict(
    initial_lexer_fuel=500_000, step_lexer_fuel=100_000, step_max_items=25_000, max_lexer_states=100_000, max_grammar_size=100_000
)
COMPILED_CACHE_SIZE = 64


# Keywords whose values map names to subschemas, and keywords left as they are: data (an object schema written in
# one is a value) and `not` (closing an object inside it would widen what the schema allows, not narrow it).
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "required", "not", "x-guidance"})


def closed_objects(schema):
    """The schema with additionalProperties false on every object schema that lists properties and says nothing of
    others, as xgrammar, outlines and llama.cpp's converter read a schema: the output holds the fields asked for and
    then ends (under JSON Schema's own default a model may add fields until max_tokens; a Pydantic model's schema
    leaves additionalProperties out). An object schema without properties stays open: {"type": "object"} is any object."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            closed[key] = value if key in DATA_KEYWORDS else closed_objects(value)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def grammar_of_schema(schema: dict | str, lenient: bool = False, field: str = "constraint.json_schema") -> str:
    """A JSON schema as a grammar, its objects closed (closed_objects). lenient: keywords llguidance does not
    implement are ignored rather than refused (OpenAI's non-strict mode)."""
    try:
        parsed = json.loads(schema) if isinstance(schema, str) else schema
        return llguidance.LLMatcher.grammar_from_json_schema(
            closed_objects(parsed), overrides={"lenient": True} if lenient else None
        )
    except (ValueError, TypeError) as error:
        raise InvalidArgument(field, f"not a JSON schema object: {error}") from None


def grammar_of_constraint(constraint) -> str:
    """A GenerateRequest's OutputConstraint as a grammar ("" when none is set); a bad one names its field."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return ""
    text = getattr(constraint, kind)
    field = f"constraint.{kind}"
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidArgument(field, f"{len(text)} characters; at most {MAX_GRAMMAR_CHARS} are accepted")
    if kind == "json_schema":
        return grammar_of_schema(text, constraint.lenient, field)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    return llguidance.LLMatcher.grammar_from_regex(text)


def limits() -> "llguidance.LLParserLimits":
    return llguidance.LLParserLimits(**GRAMMAR_LIMITS, verbose_errors=False)


class Vocabulary:
    """A tokenizer as llguidance sees it (built once per tokenizer: about a second for 151k tokens)."""

    def __init__(self, tokenizer, vocab_size: int = 0):
        """vocab_size: the model's logits width (0: the tokenizer's own size, enough to check a grammar)."""
        self.eos_token_ids = list(tokenizer.eos_token_ids)
        backend = getattr(getattr(tokenizer, "hf", None), "backend_tokenizer", None)
        if backend is not None:
            self.ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size or None, eos_token=self.eos_token_ids)
        else:  # common.tokenizer.ByteTokenizer: id 0 is EOS, id 1 + b is byte b
            size = vocab_size or tokenizer.vocab_size
            self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokens(size)), n_vocab=size)
        self.vocab_size = self.ll.vocab_size
        # Special tokens other than EOS: llguidance's mask may allow one where the grammar spells its text, yet its
        # matcher consumes it only where the grammar names the token (<[id]>); allowed() keeps the two in step.
        special = [i for i in range(self.vocab_size) if self.ll.is_special_token(i) and i not in self.eos_token_ids]
        self.special = torch.tensor(special, dtype=torch.long)
        self.compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.lock = threading.Lock()

    def compile(self, grammar: str, field: str) -> "llguidance.LLMatcher":
        """The grammar's compiled matcher at its start (cached; callers deep-copy it); InvalidArgument naming field
        for a grammar that does not compile, or not within GRAMMAR_LIMITS."""
        with self.lock:
            if grammar in self.compiled:
                self.compiled.move_to_end(grammar)
                return self.compiled[grammar]
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise InvalidArgument(field, f"the grammar is {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS} are accepted")
        matcher = llguidance.LLMatcher(self.ll, grammar, log_level=0, limits=limits())
        if matcher.is_error():
            raise InvalidArgument(field, f"not a grammar specdec can use: {matcher.get_error()}")
        with self.lock:
            self.compiled[grammar] = matcher
            while len(self.compiled) > COMPILED_CACHE_SIZE:
                self.compiled.popitem(last=False)
        return matcher

    def matcher(self, grammar: str, field: str) -> "GrammarMatcher":
        return GrammarMatcher(self.compile(grammar, field).deep_copy(), self)

    def session_matcher(self, grammar: str, prompt: list[int], start: int, field: str) -> "GrammarMatcher":
        """A session's matcher, having replayed the output its prompt already holds (prompt[start:], where 0 is
        the prompt's end)."""
        if not 0 <= start <= len(prompt):
            raise InvalidArgument(f"{field}_start", f"must be in [0, {len(prompt)}] (the prompt's length), got {start}")
        matcher = self.matcher(grammar, field)
        replayed = prompt[start:] if start else []
        if matcher.consume(replayed) != len(replayed):
            raise InvalidArgument(f"{field}_start", "the output the prompt holds from there on does not match the grammar")
        return matcher


class ByteTokens:
    """ByteTokenizer's vocabulary in llguidance.TokenizerWrapper's terms."""

    def __init__(self, vocab_size: int):
        self.eos_token_id, self.bos_token_id = 0, None
        self.tokens = [b"<eos>"] + [bytes([i - 1]) if i < 257 else b"<unused-%d>" % i for i in range(1, vocab_size)]
        self.special_token_ids = [0, *range(257, vocab_size)]

    def __call__(self, text: bytes) -> list[int]:
        return [1 + b for b in text]


@functools.lru_cache(maxsize=8)
def vocabulary_of(tokenizer, vocab_size: int = 0) -> Vocabulary:
    return Vocabulary(tokenizer, vocab_size)


def check_grammar(grammar: str, tokenizer, field: str) -> None:
    """Compiles the grammar (and caches it) for the tokenizer; InvalidArgument naming field when it cannot be."""
    vocabulary_of(tokenizer).compile(grammar, field)


class GrammarMatcher:
    """One session's matcher: its state follows the session's committed output tokens."""

    def __init__(self, matcher: "llguidance.LLMatcher", vocabulary: Vocabulary):
        self.matcher, self.vocabulary = matcher, vocabulary
        self.tokens: list[int] = []  # consumed, in order

    def consume(self, tokens: list[int]) -> int:
        """Commits tokens in order; how many it took (it stops before the first one the grammar forbids)."""
        taken = self.matcher.try_consume_tokens(list(tokens))
        self.tokens += tokens[:taken]
        return taken

    def rollback(self, count: int) -> None:
        if count:
            self.matcher.rollback(count)
            del self.tokens[-count:]

    def follow(self, tokens: list[int]) -> bool:
        """Brings the state to the output `tokens`: what differs from what it consumed is rolled back, the rest
        consumed. False when the grammar forbids one of them (the state is then at the tokens before it)."""
        same = 0
        for mine, theirs in zip(self.tokens, tokens, strict=False):
            if mine != theirs:
                break
            same += 1
        self.rollback(len(self.tokens) - same)
        return self.consume(tokens[same:]) == len(tokens) - same

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next (EOS alone once it is complete or failed)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: self.vocabulary.vocab_size].view(bool))
        special = self.vocabulary.special
        for token in special[allowed[special]].tolist():
            if not self.matcher.validate_tokens([token]):
                allowed[token] = False
        if not allowed.any():  # a failed step (its fuel ran out): the output ends here
            allowed[self.vocabulary.eos_token_ids] = True
        return allowed

    def masks_along(self, draft_tokens: list[int]) -> tuple[torch.Tensor, int, int]:
        """(allowed [k + 1, V], k, tested) for a proposal: the masks at the committed state and after each of the
        first k drafted tokens, k being how many the grammar allows in a row (the target feeds those), and how
        many drafted tokens the acceptance test takes: the k, and the forbidden one after them (its p masked to
        0, so it is rejected), none after an allowed EOS. The matcher is left where it was."""
        eos = self.vocabulary.eos_token_ids
        valid = self.matcher.validate_tokens(list(draft_tokens))
        ends = next((i for i, t in enumerate(draft_tokens[:valid]) if t in eos), None)
        if ends is not None:  # the output ends at an EOS: nothing after it is fed or tested
            valid = ends + 1
        rows = [self.allowed()]
        for token in draft_tokens[:valid]:
            self.matcher.consume_token(token)
            rows.append(self.allowed())
        if valid:
            self.matcher.rollback(valid)
        if ends is not None or valid == len(draft_tokens):
            return torch.stack(rows), valid, valid
        if draft_tokens[valid] in eos and rows[-1][draft_tokens[valid]]:
            # EOS where the grammar may end, which validate_tokens may not count: allowed, and the output ends.
            after = torch.zeros_like(rows[-1])
            after[eos] = True
            return torch.stack([*rows, after]), valid + 1, valid + 1
        rows[-1][draft_tokens[valid]] = False  # what the matcher refuses has p = 0, whatever the mask said
        if not rows[-1].any():
            rows[-1][eos] = True
        return torch.stack(rows), valid, valid + 1


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The grammar's stage of sampling: forbidden tokens get -inf, so softmax renormalises over the allowed ones
    (and argmax picks among them). logits [..., V] and allowed [..., V] broadcast."""
    return torch.where(allowed, logits.float(), NEG_INF)


NEG_INF = torch.tensor(float("-inf"))
