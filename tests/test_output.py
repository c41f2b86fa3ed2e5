"""Stop conditions and streaming: EOS, stop strings, max_new_tokens, and held-back text."""

from common.tokenizer import ByteTokenizer
from coordinator.output import OutputTracker, held_back_length
from specdec.v1 import generation_pb2

TOKENIZER = ByteTokenizer(256)


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def test_stop_string_cuts_the_text_and_ends_generation():
    tracker = OutputTracker(TOKENIZER, max_new_tokens=100, stop=["END"])
    streamed = tracker.add(ids("hello E")).text
    streamed += tracker.add(ids("ND and more")).text
    assert tracker.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert tracker.text == "hello " and streamed == "hello "
    assert tracker.token_ids == ids("hello END")


def test_text_that_may_start_a_stop_string_is_held_back():
    assert held_back_length("abc EN", ["END"]) == 2
    assert held_back_length("abc", ["END"]) == 0
    tracker = OutputTracker(TOKENIZER, max_new_tokens=100, stop=["END"])
    assert tracker.add(ids("abc EN")).text == "abc "
    assert tracker.add(ids("X")).text == "ENX"


def test_eos_ends_generation_unless_ignored():
    tracker = OutputTracker(TOKENIZER, max_new_tokens=100, eos_token_ids=[0])
    tracker.add(ids("ab") + [0] + ids("cd"))
    assert tracker.finish_reason == generation_pb2.FINISH_REASON_EOS
    assert tracker.token_ids == ids("ab") + [0] and tracker.text == "ab"
    ignoring = OutputTracker(TOKENIZER, max_new_tokens=100, eos_token_ids=[0], ignore_eos=True)
    ignoring.add(ids("ab") + [0] + ids("cd"))
    assert not ignoring.finished and len(ignoring.token_ids) == 5


def test_max_new_tokens_cuts_a_round_that_overshoots():
    tracker = OutputTracker(TOKENIZER, max_new_tokens=3)
    delta = tracker.add(ids("abcdef"))
    assert tracker.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert delta.token_ids == ids("abc") and delta.text == "abc"


def test_incomplete_utf8_is_not_streamed_until_complete():
    tracker = OutputTracker(TOKENIZER, max_new_tokens=100)
    euro = ids("€")
    assert tracker.add(euro[:2]).text == ""
    assert tracker.add(euro[2:]).text == "€"
