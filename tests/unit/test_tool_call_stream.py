"""Tool calls parsed out of an output as it is generated (coordinator.tool_calls.CallStream): fed in any pieces,
what it tells adds up to what a whole response says (parse_calls), and an output without calls is its content
unchanged."""

import pytest

from specdec.coordinator.tool_calls import CallArguments, CallStart, CallStream, parse_calls

NAMES = {"get_weather", "f"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>'
CASES = [
    (CALL, None, [("get_weather", '{"city": "Oslo", "days": 1}')]),
    (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "O\\"s}lo", "days": [1, {"a": 2}]}}\n'
        '</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n',
        "Sure.",
        [("get_weather", '{"city": "O\\"s}lo", "days": [1, {"a": 2}]}'), ("f", "{}")],
    ),
    ("hi <tool_call>broken</tool_call> bye  ", "hi <tool_call>broken</tool_call> bye  ", []),
    ("  no calls at all <tool_", "  no calls at all <tool_", []),
    ('<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', None, [("f", '{"x": 1}')]),  # parsed whole
    (
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> tail',
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> tail',
        [],
    ),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1', None, [("f", '{"x": 1')]),  # cut at max_tokens
    ('<tool_call>\n{"name": "f", "argume', '<tool_call>\n{"name": "f", "argume', []),
]


def told(text: str, piece: int, parallel: bool = True) -> tuple[str | None, list[tuple[str, str]], int]:
    stream, events = CallStream(NAMES, parallel), []
    for i in range(0, len(text), piece):
        events += stream.feed(text[i : i + piece])
    events += stream.end()
    calls = [[e.name, ""] for e in events if isinstance(e, CallStart)]
    for event in events:
        if isinstance(event, CallArguments):
            calls[event.index][1] += event.text
    content = "".join(e for e in events if isinstance(e, str)) or None
    return content, [tuple(c) for c in calls], sum(isinstance(e, CallArguments) for e in events)


@pytest.mark.parametrize("text,content,calls", CASES)
def test_pieces_add_up_to_the_whole_response(text, content, calls):
    whole = parse_calls(text, NAMES, parallel=True)
    assert whole[0] == content and [(c["function"]["name"], c["function"]["arguments"]) for c in whole[1]] == calls
    for piece in (1, 3, 7, len(text)):
        assert told(text, piece)[:2] == (content, calls), piece


def test_arguments_are_told_as_they_come_once_the_name_is_known():
    content, calls, pieces = told(CALL, 1)
    assert pieces == len('{"city": "Oslo", "days": 1}')
    stream = CallStream(NAMES, True)
    assert stream.feed('<tool_call>\n{"name": "get_weather", ') == []
    assert stream.feed('"arguments": ') == []  # not yet known to be the arguments' start
    start, piece = stream.feed('{"ci')
    assert isinstance(start, CallStart) and (start.index, start.name) == (0, "get_weather")
    assert piece == CallArguments(0, '{"ci')
    assert stream.feed('ty": "Oslo"}}\n</tool') == [CallArguments(0, 'ty": "Oslo"}')]
    assert stream.feed("_call>") == [] and stream.end() == [] and stream.calls == 1


def test_a_second_call_without_parallel_calls_stays_content():
    content, calls, _ = told(CALL + "\n" + CALL, 5, parallel=False)
    assert calls == [("get_weather", '{"city": "Oslo", "days": 1}')] and content == CALL
