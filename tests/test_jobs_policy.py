"""The Batch API's pure parts: how many lines of a job are in flight and when it backs off (with an injected clock),
what an answer means for its line, and the batch file formats."""
from __future__ import annotations

import json

from tasks.policy.batchfile import (
    error_line,
    line_request_id,
    new_id,
    output_file_id,
    parse_input,
    response_line,
)
from tasks.policy.feeding import MAX_LINE_ATTEMPTS, FeedControl, Verdict, gives_up, verdict


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> float:
        self.now += s
        return self.now


def test_the_window_starts_small_and_doubles_every_round_trip_while_answers_are_prompt() -> None:
    c = FeedControl(initial=16, ceiling=1000)
    assert c.room(0, 0.0) == 16 and c.room(10, 0.0) == 6 and c.room(20, 0.0) == 0
    for _ in range(16):  # one round trip: every line answered in 0.3 s
        c.answered(0.3, 0.0)
    assert c.window == 32
    for _ in range(32):
        c.answered(0.3, 0.0)
    assert c.window == 64
    for _ in range(10_000):
        c.answered(0.3, 0.0)
    assert c.window == 1000, "never beyond the ceiling"


def test_it_stops_growing_once_lines_queue_behind_each_other() -> None:
    c = FeedControl(initial=16)
    for _ in range(16):
        c.answered(0.25, 0.0)
    before = c.window
    for _ in range(50):
        c.answered(0.8, 1.0)  # more than three times the fastest answer: lines wait for each other now
    assert c.window == before and not c.slow_start
    for t in range(31, 100):  # the fastest answer is forgotten after a period or two: a slower fleet is learnt
        c.answered(0.8, float(t))
    assert c.base_s == 0.8 and c.window > before
    grown = c.window
    c.answered(None, 100.0)  # an answer that says nothing of the fleet's speed (replayed, refused at the door)
    assert c.window == grown and c.base_s == 0.8


def test_a_refusal_halves_the_window_once_and_pauses_for_retry_after() -> None:
    clock = Clock()
    c = FeedControl(initial=64)
    sent = clock.now
    now = clock.advance(0.1)
    c.refused(sent, 2, now)
    assert c.window == 32 and c.room(0, now) == 0 and c.wait_s(now) == 2
    for _ in range(20):  # the other lines sent with it are refused too: one signal, one cut
        c.refused(sent, 2, clock.advance(0.001))
    assert c.window == 32
    assert c.room(0, clock.advance(2.0)) == 32, "sending again after Retry-After"
    later = clock.now
    c.refused(later, 1, clock.advance(0.1))  # a line sent after the cut: a new signal
    assert c.window == 16
    for _ in range(100):  # then it grows again, about one line per round trip
        c.answered(0.3, 0.0)
    assert 16 < c.window < 24


def test_outages_back_off_exponentially_and_an_answer_resets_the_backoff() -> None:
    clock = Clock()
    c = FeedControl(initial=8, first_backoff_s=0.5, max_backoff_s=30)
    waits = []
    for _ in range(9):
        sent = clock.now
        now = clock.advance(0.01)
        c.failed(sent, now)
        waits.append(round(c.wait_s(now), 2))
        clock.advance(c.wait_s(now))
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert c.window == 1, "never below the floor"
    sent = clock.now
    now = clock.advance(0.01)
    for _ in range(100):  # a hundred lines failing together are one signal: one step of the backoff
        c.failed(sent, now)
    assert round(c.wait_s(now), 2) == 30.0 and c.failures == 10
    c.answered(0.2, clock.advance(c.wait_s(now)))
    c.failed(clock.now, clock.advance(0.01))
    assert round(c.wait_s(clock.now), 2) == 0.5


def test_what_an_answer_means_for_its_line() -> None:
    assert verdict(200, None) is Verdict.FINAL
    for status, kind in ((400, "invalid_request"), (422, "poison_input"), (403, "forbidden"),
                         (503, "retries_exhausted"), (500, "inference_failed")):
        assert verdict(status, kind) is Verdict.FINAL, kind  # the line's own fault: to the error file
    for kind in ("queue_full", "tenant_over_limit", "overloaded"):
        assert verdict(429, kind) is Verdict.REFUSED
    assert verdict(503, "unavailable") is Verdict.UNAVAILABLE
    assert verdict(504, "deadline_exceeded") is Verdict.RETRY
    assert verdict(404, "model_not_found") is Verdict.RETRY
    assert not gives_up(Verdict.REFUSED, 10_000) and not gives_up(Verdict.UNAVAILABLE, 10_000)
    assert not gives_up(Verdict.RETRY, MAX_LINE_ATTEMPTS - 1) and gives_up(Verdict.RETRY, MAX_LINE_ATTEMPTS)
    assert gives_up(Verdict.FINAL, 1)


def _line(custom_id: object, url: str = "/v1/infer", method: str = "POST", body: object = None) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": {"input": "x"} if body is None else body}).encode()


def test_a_batch_input_file_is_parsed_and_every_fault_is_named_with_its_line() -> None:
    good = [_line(f"r{i}") for i in range(3)]
    lines, errors = parse_input([*good[:2], b"  \n", good[2]], "/v1/infer", 100)
    assert not errors and [(x.line_no, x.custom_id) for x in lines] == [(0, "r0"), (1, "r1"), (2, "r2")]
    bad = [_line("a"), _line("a"), b"{not json", _line("b", url="/v1/embeddings"), _line("c", method="GET"),
           _line("d", body=[1]), _line(""), b"[1]", b'{"custom_id": "e", "x": NaN}']
    _, errors = parse_input(bad, "/v1/infer", 100)
    assert [(e.line, e.code) for e in errors] == [
        (2, "duplicate_custom_id"), (3, "invalid_json_line"), (4, "mismatched_endpoint"), (5, "invalid_request"),
        (6, "invalid_request"), (7, "invalid_request"), (8, "invalid_request"), (9, "invalid_json_line")]
    _, errors = parse_input([_line(f"r{i}") for i in range(5)], "/v1/infer", 4)
    assert [e.code for e in errors] == ["too_many_requests"]
    assert [e.code for e in parse_input([b"", b"\n"], "/v1/infer", 4)[1]] == ["empty_file"]
    _, errors = parse_input([b"{"] * 150, "/v1/infer", 1000)
    assert len(errors) == 101 and errors[-1].message == "50 more line(s) are invalid"


def test_output_lines_are_openais_and_the_same_on_every_run() -> None:
    job = new_id("batch_", 1_800_000_000.0)
    assert job.startswith("batch_") and new_id("batch_", 1_800_000_000.001) > job, "ids sort by time"
    rid = line_request_id(job, 7)
    one = json.loads(response_line(rid, "r7", 200, {"output": "y"}))
    assert one == {"id": one["id"], "custom_id": "r7", "response": {"status_code": 200, "request_id": rid,
                                                                     "body": {"output": "y"}}, "error": None}
    assert response_line(rid, "r7", 200, {"output": "y"}) == response_line(rid, "r7", 200, {"output": "y"})
    never = json.loads(error_line(rid, "r7", "batch_cancelled", "not run"))
    assert never["response"] is None and never["error"]["code"] == "batch_cancelled" and never["id"] == one["id"]
    assert output_file_id(job, "output") == output_file_id(job, "output") != output_file_id(job, "error")
