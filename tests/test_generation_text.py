"""The stop rule both generation engines share, tested without torch or a model."""
from __future__ import annotations

import subprocess
import sys
from typing import Any

from gpu_worker.backends.generation import Row, StopText, completion, cut_at_stop
from tasks.schema import SamplingParams


def stream(rule: StopText, *texts: str) -> list[str]:
    """Feed each whole decoded text in turn (as an engine does after every token); the non-empty deltas."""
    return [d for d in (rule.feed(t) for t in texts) if d]


def test_without_stop_sequences_everything_is_streamed_at_once() -> None:
    rule = StopText([])
    assert stream(rule, "he", "hello", "hello world") == ["he", "llo", " world"]
    assert not rule.stopped and rule.flush("hello world") == "" and rule.final("hello world") == "hello world"


def test_a_stop_sequence_split_across_two_chunks_is_never_emitted() -> None:
    rule = StopText(["STOP"])
    deltas = stream(rule, "hello ST", "hello STOP and more")
    assert deltas == ["hello", " "] and rule.stopped
    assert "S" not in "".join(deltas) and rule.final("hello STOP and more") == "hello "


def test_what_looked_like_the_start_of_a_stop_is_released_once_it_is_not() -> None:
    rule = StopText(["STOP"])
    assert stream(rule, "ab ST") == ["ab"]  # "ST" (and one more character) could still become "STOP"
    deltas = stream(rule, "ab STAR", "ab STAR wars")
    assert "".join(deltas) == "ab STAR w"[2:] and not rule.stopped
    assert rule.flush("ab STAR wars") == "ars"  # the rest goes with the final chunk


def test_of_several_stop_sequences_the_earliest_in_the_text_wins() -> None:
    assert cut_at_stop("hello world", ["world", "lo"]) == ("hel", True)
    assert cut_at_stop("hello world", ["zz"]) == ("hello world", False)
    rule = StopText(["world", "lo"])
    assert "".join(stream(rule, "h", "hel", "hello", "hello world")) == "hel" and rule.stopped


def test_a_stop_at_the_very_start_gives_an_empty_answer() -> None:
    rule = StopText(["\n"])
    assert stream(rule, "\n", "\nmore") == [] and rule.stopped
    assert rule.final("\nmore") == "" and rule.flush("\nmore") == ""


def test_the_final_flush_completes_the_stream_to_the_final_text() -> None:
    for text, final in (("the cat sat on the mat. the end", "the cat sat on the "), ("the cat sat", "the cat sat")):
        rule = StopText(["mat.", "end"])
        deltas = stream(rule, *(text[:n] for n in range(1, len(text) + 1)))
        assert not any(s in d for d in deltas for s in rule.stop)
        assert "".join(deltas) + rule.flush(text) == final == rule.final(text)
        assert rule.flush(text) == ""  # flushing twice sends nothing more
    rule = StopText(["mat."])
    assert stream(rule, "the cat sat") == ["the cat "] and rule.flush("the cat sat") == "sat"  # held, then sent


def test_half_characters_are_held_back_until_they_are_whole() -> None:
    rule = StopText([])
    assert stream(rule, "ab\ufffd", "abé") == ["abé"]


def test_rows_take_the_same_defaults_as_the_api() -> None:
    assert Row.from_params(3, [1, 2], SamplingParams.from_dict({})) == Row(3, [1, 2], 16, [])
    assert Row.from_params(0, [1], SamplingParams.from_dict({"max_tokens": 5, "stop": "x"})) == Row(0, [1], 5, ["x"])
    assert Row.from_params(0, [1], SamplingParams.from_dict({"stop": None})).stop == []


class CharTokenizer:
    """One token per character, enough to check the counting of an answer cut at a stop."""

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, tokens))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, Any]:
        return {"input_ids": [ord(c) for c in text]}


def test_a_completion_is_cut_at_its_stop_and_counts_what_is_sent() -> None:
    tokens = [ord(c) for c in "yes. no"]
    answer = completion(CharTokenizer(), Row(0, [1, 2, 3], 10, ["."]), tokens, "length")
    assert answer.to_dict() == {"text": "yes", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 3}
    plain = completion(CharTokenizer(), Row(0, [1], 10, []), tokens, "length")
    assert plain.text == "yes. no" and plain.finish_reason == "length" and plain.completion_tokens == 7


def test_the_module_imports_neither_torch_nor_transformers() -> None:
    code = ("import gpu_worker.backends.generation, sys; "
            "print('torch' in sys.modules or 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "False"
