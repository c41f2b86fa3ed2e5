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

from common.errors import InvalidArgument

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
        "properties": {"name": {"const": function["name"]}, "arguments": function["parameters"]},
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
    block, or with parallel several, each holding JSON that validates against its function's parameters."""
    chosen = [f for f in functions if not forced or f["name"] == forced]
    schema = call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [call_schema(f) for f in chosen]}
    schema["x-guidance"] = CALL_JSON_STYLE
    repeat = ' ("\\n" call)*' if parallel else ""
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


def parse_calls(text: str, names: set[str], parallel: bool) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an output: the call blocks that hold a known function's name and JSON arguments
    become tool_calls in OpenAI's shape (arguments as a JSON string), the rest stays content (None if empty)."""
    calls, kept, last = [], [], 0
    for match in CALL_PATTERN.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names or (calls and not parallel):
            continue
        arguments = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(arguments)},
            }
        )
        kept.append(text[last : match.start()])
        last = match.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls
