"""Stop conditions and streaming: EOS, stop strings, max_new_tokens, and held-back text."""

import pytest

from specdec.common.models import load_tokenizer
from specdec.common.tokenizer import ByteTokenizer
from specdec.coordinator.output import REPLACEMENT_CHAR, OutputTracker, held_back_length
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


MULTI_BYTE = "Größe — 日本語のテキスト, emoji 🙂🙃 and a 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 tail: ½ ≠ ∞.\n" * 3


def streamed_in_rounds(tracker: OutputTracker, token_ids: list[int], sizes: list[int]) -> str:
    """Feeds token_ids in rounds of the given sizes (cycled); returns the concatenated deltas."""
    text, i, r = "", 0, 0
    while i < len(token_ids) and not tracker.finished:
        size = sizes[r % len(sizes)]
        text += tracker.add(token_ids[i : i + size]).text
        i, r = i + size, r + 1
    return text


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer("smollm2-135m")


def test_incremental_detokenising_matches_full_decoding_on_multi_byte_text(smollm2_tokenizer):
    for tokenizer in (TOKENIZER, smollm2_tokenizer):
        token_ids = tokenizer.encode(MULTI_BYTE)
        for sizes in ([1], [2, 3], [5, 1, 4], [len(token_ids)]):
            tracker = OutputTracker(tokenizer, max_new_tokens=len(token_ids))
            streamed = streamed_in_rounds(tracker, token_ids, sizes)
            assert tracker.finish_reason == generation_pb2.FINISH_REASON_LENGTH
            assert streamed == tracker.text == tokenizer.decode(token_ids) == MULTI_BYTE


def test_stop_string_split_across_rounds_is_found_and_never_streamed(smollm2_tokenizer):
    text = "naïve café — the answer is 42 ⟨STOP⟩ and more text after it"
    expected = text[: text.index("⟨STOP⟩")]
    for tokenizer in (TOKENIZER, smollm2_tokenizer):
        token_ids = tokenizer.encode(text)
        for first in range(1, len(token_ids)):
            tracker = OutputTracker(tokenizer, max_new_tokens=1000, stop=["⟨STOP⟩", "never"])
            streamed = tracker.add(token_ids[:first]).text
            streamed += streamed_in_rounds(tracker, token_ids[first:], [1, 3])
            assert tracker.finish_reason == generation_pb2.FINISH_REASON_STOP, first
            assert streamed == tracker.text == expected, first


def test_whole_decoding_stream_matches_full_decoding_and_holds_back_unfinished_characters():
    from specdec.common.tokenizer import WholeDecodeStream

    token_ids = TOKENIZER.encode(MULTI_BYTE)
    stream = WholeDecodeStream(TOKENIZER.decode)
    pieces = [stream.step(t) for t in token_ids]
    assert "".join(pieces) == MULTI_BYTE and REPLACEMENT_CHAR not in "".join(pieces)


def test_a_failing_decode_stream_falls_back_to_whole_decoding_without_losing_text(smollm2_tokenizer):
    token_ids = smollm2_tokenizer.encode(MULTI_BYTE)
    stream = smollm2_tokenizer.decode_stream()
    text = "".join(stream.step(t) for t in token_ids[:10])

    class Failing:
        def step(self, backend, token_id):
            raise Exception("Invalid prefix encountered while decoding stream")

    stream.stream = Failing()
    text += "".join(stream.step(t) for t in token_ids[10:])
    assert text == MULTI_BYTE


def naive_first_stop(text: str, stop: list[str], start: int) -> int:
    found = [i for i in (text.find(s, max(0, start - len(s) + 1)) for s in stop) if i >= 0]
    return min(found) if found else -1


def naive_held(text: str, stop: list[str]) -> int:
    return max([k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])], default=0)


def test_the_stop_matcher_finds_what_a_rescan_of_the_whole_text_finds():
    # The incremental matcher against the obvious quadratic rescan, on random texts fed in random pieces over a
    # small alphabet (so that partial and overlapping matches are frequent).
    import random

    from specdec.coordinator.output import StopMatcher

    rng = random.Random(7)
    for _ in range(400):
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        matcher, text = StopMatcher(stop), ""
        while True:
            start, text = len(text), text + "".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
            found = matcher.feed(text, start)
            assert found == naive_first_stop(text, stop, start), (stop, text, start)
            if found >= 0:
                break
            assert matcher.held == naive_held(text, stop), (stop, text)


def test_held_back_matching_costs_time_linear_in_the_new_text():
    # 16 stop strings of 256 characters that the text keeps almost matching, the worst case for rescanning every
    # prefix of every stop string each round (16 x 256^2 / 2 characters compared). KMP touches each stop string
    # at most twice per new character, amortised: counted here through the characters it reads of them.
    from specdec.coordinator.output import StopMatcher

    reads = 0

    class CountingStr(str):
        def __getitem__(self, index):
            nonlocal reads
            reads += 1
            return super().__getitem__(index)

    stop = [CountingStr("a" * 255 + "b" * (i + 1)) for i in range(16)]
    matcher, text = StopMatcher(stop), ""
    reads = 0
    for _ in range(200):
        start, text = len(text), text + "a" * 8
        assert matcher.feed(text, start) == -1
    assert matcher.held == 255
    assert reads <= 2 * 2 * len(stop) * len(text)
    assert matcher.feed(text + "b", len(text)) == len(text) - 255  # the shortest one completes
