"""Tools in chats (OpenAI's tools, tool_choice, parallel_tool_calls): a conversation with tools rendered through
the model's own chat template, the grammar that enforces a required or named call, and calls parsed back out of
the output.

Calls are written as Hermes-style blocks, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`: the
format of Qwen2.5's template (and of many others). A template that knows no tools (SmolLM2's) is given the same
instructions in its system message, and its history's tool calls and results as text in that format.
"""

import json
import re
import uuid
from dataclasses import dataclass

from specdec.common.errors import InvalidArgument
from specdec.common.grammar import closed_objects

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_PATTERN = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MAX_TOOLS = 128
CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_tools(tools: list, tool_choice, field: str = "tools") -> tuple[list[dict], str | None]:
    """The tools' function definitions, and the name tool_choice forces ("" for required, None for auto or none);
    a bad definition or a choice of an unknown function names its field."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(field, f"at most {MAX_TOOLS} tools, got {len(tools)}")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidArgument(f"{field}[{i}]", 'must be {"type": "function", "function": {...}}')
        function = tool["function"]
        if not isinstance(function.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", function["name"]):
            raise InvalidArgument(f"{field}[{i}].function.name", "must be 1 to 64 letters, digits, _ . or -")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"{field}[{i}].function.parameters", "must be a JSON schema object")
        functions.append({**function, "parameters": parameters})
    names = [f["name"] for f in functions]
    if tool_choice in (None, "auto", "none"):
        return functions, None
    if tool_choice == "required":
        if not functions:
            raise InvalidArgument("tool_choice", "'required' needs at least one tool")
        return functions, ""
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        named = '{"type": "function", "function": {"name": ...}}'
        raise InvalidArgument("tool_choice", f'must be "none", "auto", "required" or {named}')
    if name not in names:
        raise InvalidArgument("tool_choice", f"names the function {name!r}, which is not among the tools ({', '.join(names)})")
    return functions, name


def call_schema(function: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": closed_objects(function["parameters"])},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# A call's JSON is written as the templates write it (Python's json.dumps, Jinja's tojson): no choice of
# whitespace is left to the model, whose output then always ends.
CALL_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tag(text: str, tokenizer) -> str:
    """A call tag in Lark: the token itself where the vocabulary has it as an added token (Qwen2.5's <tool_call>),
    which llguidance matches only as that token, never as the text spelled out; else the text."""
    added = getattr(getattr(tokenizer, "hf", None), "get_added_vocab", dict)()
    return f"<[{added[text]}]>" if text in added else json.dumps(text)


def calls_grammar(functions: list[dict], forced: str, parallel: bool, tokenizer=None) -> str:
    """Lark (llguidance's dialect) for the output of a required call (forced "") or of the named one: one call
    block, or for a required call with parallel several, each holding JSON that validates against its function's
    parameters. A named function is called once, as vLLM does (a model held to one function tends to call it again
    and again: Qwen2.5-Coder-1.5B repeats the same call until max_tokens)."""
    chosen = [f for f in functions if not forced or f["name"] == forced]
    schema = call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [call_schema(f) for f in chosen]}
    schema["x-guidance"] = CALL_JSON_STYLE
    repeat = ' ("\\n" call)*' if parallel and not forced else ""
    return (
        f"start: call{repeat}\n"
        f'call: {tag(CALL_OPEN, tokenizer)} "\\n" body "\\n" {tag(CALL_CLOSE, tokenizer)}\n'
        f"body: %json {json.dumps(schema)}\n"
    )


def system_text(functions: list[dict]) -> str:
    """The tools' instructions, for a template that renders none (the words of Qwen2.5's)."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}'
        f"\n{CALL_CLOSE}"
    )


def arguments_of(call: dict, field: str) -> dict:
    arguments = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        raise InvalidArgument(f"{field}.function.arguments", "must be a JSON object, as a string") from None


def call_text(call: dict, field: str) -> str:
    body = json.dumps({"name": call.get("function", {}).get("name", ""), "arguments": arguments_of(call, field)})
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def template_messages(messages: list[dict], functions: list[dict], native: bool) -> list[dict]:
    """The conversation as the chat template takes it: native, with tool calls and tool results as the template
    renders them; otherwise as text in the Hermes format, tool results as user turns, the tools in the system
    message."""
    out = []
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content") or ""
        if role not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{i}].role", f"unknown role {role!r}; use one of {', '.join(CHAT_ROLES)}")
        calls = message.get("tool_calls") or []
        if native:
            entry = {"role": role, "content": content}
            if calls:
                entry["tool_calls"] = [
                    {"type": "function", "function": {"name": c.get("function", {}).get("name", ""),
                                                      "arguments": arguments_of(c, f"messages[{i}].tool_calls[{j}]")}}
                    for j, c in enumerate(calls)
                ]  # fmt: skip
            out.append(entry)
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif calls:
            blocks = [call_text(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        else:
            out.append({"role": role, "content": content})
    if functions and not native:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system_text(functions)}
        else:
            out.insert(0, {"role": "system", "content": system_text(functions)})
    return out


def renders_tools(tokenizer) -> bool:
    template = getattr(getattr(tokenizer, "hf", None), "chat_template", None) or ""
    return "tools" in template and "tool_call" in template


def render_chat(tokenizer, messages: list[dict], functions: list[dict]) -> list[int]:
    """The prompt's token ids: the model's own template with the tools where it renders them, else with the tools
    given as instructions (common.tokenizer's rendering)."""
    if renders_tools(tokenizer):
        hf = tokenizer.hf
        tools = [{"type": "function", "function": f} for f in functions] or None
        rendered = template_messages(messages, functions, True)
        text = hf.apply_chat_template(rendered, tools=tools, tokenize=False, add_generation_prompt=True)
        return list(hf.encode(text, add_special_tokens=False))
    return tokenizer.render_chat(template_messages(messages, functions, False))


# The head of a Hermes call block up to its arguments, which can then be streamed as they are generated.
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
HEAD_READY = re.compile(r'"arguments"\s*:\s*\S')  # enough of a block's head to tell whether it is CALL_HEAD
MAX_HEAD = 512  # a head that long without its arguments is not CALL_HEAD's
OPENERS, CLOSERS = "{[", "}]"


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArguments:
    index: int
    text: str


class CallStream:
    """Tool calls parsed out of an output as it is generated, in the pieces OpenAI streams them in: content (text
    outside call blocks), a call's start (its index, id and function name) once the block's head up to its
    arguments has come, then the arguments' JSON text piece by piece as the model writes it (its own text: what
    a whole response returns too, so that the pieces add up to it).

    A block whose head is not `{"name": <a tool's>, "arguments": ...` is held to its end and parsed whole (a call
    if it holds a known function's name and JSON arguments, else content); so is a second call without
    parallel_tool_calls (always content). Whitespace between content and a call block is dropped, and at the end
    of an output with calls. Text that may begin a call tag is held back until it is known not to."""

    def __init__(self, names: set[str], parallel: bool):
        self.names, self.parallel = names, parallel
        self.buffer = ""  # text not told yet
        self.state = "content"  # content, head (of a block), arguments, tail (of a streamed call), block (held whole)
        self.calls = 0  # call blocks ended
        self.calls_started = 0  # calls told (the last may be cut short with the output)
        self.held_space = ""  # content's trailing whitespace, dropped if a call block follows
        self.space_before = ""  # the whitespace dropped before the current block, if it turns out to be content
        self.after_call = False  # a call block ended just before: the content's leading whitespace is dropped
        self.depth, self.in_string, self.escaped = 0, False, False  # the arguments' JSON scanner

    def feed(self, text: str) -> list:
        self.buffer += text
        events: list = []
        while self.step(events):
            pass
        return events

    def end(self) -> list:
        """What is left once the output ends: a block left open is content, as is text held back."""
        events: list = []
        if self.state in ("head", "block"):
            self.content(events, self.space_before + CALL_OPEN + self.buffer, final=True)
        elif self.state == "content":
            self.content(events, self.buffer, final=True)
        self.buffer = ""
        return events

    def content(self, events: list, text: str, final: bool = False, before_block: bool = False) -> None:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        text, self.held_space = self.held_space + text, ""
        told = text.rstrip()
        if final and not self.calls:
            told = text
        elif not before_block and not final:
            self.held_space = text[len(told) :]
        if before_block:
            self.space_before = text[len(told) :]
        if told:
            events.append(told)

    def step(self, events: list) -> bool:
        """Tells what the buffer holds as far as it can; True when there may be more to tell."""
        if self.state == "content":
            at = self.buffer.find(CALL_OPEN)
            if at < 0:
                keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self.buffer)), 0, -1)
                             if CALL_OPEN.startswith(self.buffer[-k:])), 0)  # fmt: skip
                self.content(events, self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return False
            self.content(events, self.buffer[:at], before_block=True)
            self.buffer = self.buffer[at + len(CALL_OPEN) :]
            self.state = "head" if self.parallel or not self.calls else "block"
            return True
        if self.state == "head":
            if CALL_CLOSE not in self.buffer and not HEAD_READY.search(self.buffer) and len(self.buffer) < MAX_HEAD:
                return False
            head = CALL_HEAD.match(self.buffer)
            if head is None or head.group(1) not in self.names:
                self.state = "block"
                return True
            events.append(CallStart(self.calls, f"call_{uuid.uuid4().hex[:24]}", head.group(1)))
            self.calls_started += 1
            self.buffer = self.buffer[head.end() :]
            self.state, self.depth, self.in_string, self.escaped = "arguments", 0, False, False
            return True
        if self.state == "arguments":
            end, done = self.scan()
            if end:
                events.append(CallArguments(self.calls, self.buffer[:end]))
            self.buffer = self.buffer[end:]
            if done:
                self.state = "tail"
            return done
        at = self.buffer.find(CALL_CLOSE)
        if at < 0:
            return False
        block, self.buffer = self.buffer[:at], self.buffer[at + len(CALL_CLOSE) :]
        if self.state == "tail":
            self.calls += 1
            self.after_call = True
        else:
            self.whole_block(events, block)
        self.state = "content"
        return True

    def scan(self) -> tuple[int, bool]:
        """How much of the buffer belongs to the arguments' JSON value, and whether the value ends there: where it
        closes (an object, an array or a string), or for a bare value (a number, true...) at the first character
        that ends it."""
        for i, char in enumerate(self.buffer):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1, True
            elif char == '"':
                self.in_string = True
            elif char in OPENERS:
                self.depth += 1
            elif char in CLOSERS:
                if self.depth == 0:  # a bare value ended by its object's brace
                    return i, True
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
            elif self.depth == 0 and (char.isspace() or char == ","):
                return i, True
        return len(self.buffer), False

    def whole_block(self, events: list, block: str) -> None:
        call = None
        if self.parallel or not self.calls:
            try:
                call = json.loads(block)
            except json.JSONDecodeError:
                pass
        if not isinstance(call, dict) or call.get("name") not in self.names:
            self.content(events, self.space_before + CALL_OPEN + block + CALL_CLOSE)
            return
        events.append(CallStart(self.calls, f"call_{uuid.uuid4().hex[:24]}", call["name"]))
        self.calls_started += 1
        events.append(CallArguments(self.calls, json.dumps(call.get("arguments", {}))))
        self.calls += 1
        self.after_call = True


def parse_calls(text: str, names: set[str], parallel: bool) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output, as CallStream tells it: the call blocks that hold a known
    function's name and JSON arguments become tool_calls in OpenAI's shape (arguments as a JSON string), the rest
    stays content (None if empty)."""
    stream = CallStream(names, parallel)
    content, calls = [], []
    for event in [*stream.feed(text), *stream.end()]:
        if isinstance(event, CallStart):
            calls.append({"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, CallArguments):
            calls[event.index]["function"]["arguments"] += event.text
        else:
            content.append(event)
    return "".join(content) or None, calls
