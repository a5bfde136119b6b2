"""The Batch API's pure parts: how many lines of a job are in flight and when it backs off (with an injected clock),
what an answer means for its line, which tenant's job a free slot takes, and the batch file formats (bounded: a
line to the interactive body limit, errors to a small list, memory to one line)."""
from __future__ import annotations

import io
import json
import tracemalloc

import pytest

from tasks.errors import InvalidInput
from tasks.policy.batchfile import (
    MAX_ERRORS,
    MAX_MESSAGE,
    InputCheck,
    check_filename,
    download_name,
    error_line,
    expiry_s,
    line_request_id,
    new_id,
    output_file_id,
    parse_input,
    read_lines,
    response_line,
)
from tasks.policy.feeding import (
    MAX_LINE_ATTEMPTS,
    Disposition,
    FeedControl,
    disposition,
    gives_up,
    pick_jobs,
)
from tests.fakes import FakeClock


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
    clock = FakeClock(start=1000.0)
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
    clock = FakeClock(start=1000.0)
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
    assert disposition(None) is Disposition.FINAL
    for kind in ("invalid_request", "poison_input", "forbidden", "retries_exhausted", "inference_failed"):
        assert disposition(kind) is Disposition.FINAL, kind  # the line's own fault: to the error file
    for kind in ("queue_full", "tenant_over_limit", "overloaded"):
        assert disposition(kind) is Disposition.REFUSED
    assert disposition("unavailable") is Disposition.UNAVAILABLE
    assert disposition("deadline_exceeded") is Disposition.RETRY
    assert disposition("model_not_found") is Disposition.RETRY
    assert disposition("internal_error") is Disposition.RETRY
    assert not gives_up(Disposition.REFUSED, 10_000) and not gives_up(Disposition.UNAVAILABLE, 10_000)
    assert not gives_up(Disposition.RETRY, MAX_LINE_ATTEMPTS - 1) and gives_up(Disposition.RETRY, MAX_LINE_ATTEMPTS)
    assert gives_up(Disposition.FINAL, 1)


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


def test_a_failed_jobs_errors_stay_small_whatever_its_lines_hold() -> None:
    """150 lines each echoing a 200 KB url: the errors list is the first 100 (and a count of the rest), and no
    message quotes more than a few dozen characters of what the tenant sent (they were 200 KB each)."""
    lines = [_line(f"r{i}", url="/v1/" + "x" * 200_000) for i in range(150)]
    _, errors = parse_input(lines, "/v1/infer", 1000)
    assert len(errors) == MAX_ERRORS + 1 and errors[-1].code == "more_errors" and "50 more" in errors[-1].message
    assert {e.code for e in errors[:-1]} == {"mismatched_endpoint"}
    assert all(len(e.message) <= MAX_MESSAGE for e in errors)
    assert len(json.dumps([e.to_dict() for e in errors])) < 25_000
    assert "200004 characters" in errors[0].message, "it says how long the value was"
    _, errors = parse_input([_line("a" * 500), _line("a" * 500), _line("b", method="G" * 10_000)], "/v1/infer", 9)
    assert [e.code for e in errors] == ["duplicate_custom_id", "invalid_request"]
    assert all(len(e.message) < 200 for e in errors)


def test_a_line_is_held_to_the_interactive_body_limit_and_a_deep_one_is_an_error_not_a_crash() -> None:
    limit = 10_000
    big_body = _line("big", body={"input": "x" * (limit + 1)})  # its body alone is over the limit
    huge = _line("huge", body={"input": "y" * (5 * limit)})  # the line too: skipped without being held whole
    deep = (b'{"custom_id": "deep", "method": "POST", "url": "/v1/infer", "body": ' + b"[" * 100_000
            + b"]" * 100_000 + b"}")
    fine = _line("fine", body={"input": "z" * (limit - 100)})
    _lines, errors = parse_input([big_body, huge, deep, fine], "/v1/infer", 10, max_body_bytes=limit)
    assert [(e.line, e.code) for e in errors] == [(1, "line_too_large"), (2, "line_too_large"), (3, "line_too_large")]
    assert "LLMB_MAX_BODY_BYTES" in errors[0].message and str(limit) in errors[0].message
    _, errors = parse_input([deep[:60_000] + b"]" * 10 + b"}"], "/v1/infer", 10, max_body_bytes=10**6)
    assert [e.code for e in errors] == ["invalid_json_line"], "too deep to parse: the line's error, not a crash"
    assert [x.custom_id for x in parse_input([fine], "/v1/infer", 10, max_body_bytes=limit)[0]] == ["fine"]


def test_read_lines_holds_one_bounded_line_at_a_time() -> None:
    source = io.BytesIO(b"short\n" + b"L" * 50_000 + b"\n\nlast")
    assert [(n, x) for n, x in read_lines(source, 100)] == [(1, b"short\n"), (2, None), (3, b"\n"), (4, b"last")]
    assert list(read_lines(io.BytesIO(b"a" * 100 + b"\n"), 100)) == [(1, b"a" * 100 + b"\n")], "exactly the limit"


def _peak_of_check(data: bytes) -> int:
    tracemalloc.start()
    try:
        check = InputCheck("/v1/infer", 50_000, 1_048_576)
        count = sum(1 for _ in check.lines(io.BytesIO(data)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 10_000 and check.report() == []
    return peak


def test_input_check_streams_a_file_in_memory_independent_of_its_size() -> None:
    """10,000 lines of 3 MB and of 30 MB: the check holds the custom_ids' digests (bounded by
    LLMB_JOBS_MAX_LINES) and one line, not the parsed file (about ten times its size)."""
    one = '{"custom_id": "request-%06d", "method": "POST", "url": "/v1/infer", "body": {"input": "%s"}}\n'
    small, large = ("".join(one % (i, "w" * n) for i in range(10_000)).encode() for n in (200, 3000))
    peaks = _peak_of_check(small), _peak_of_check(large)
    assert abs(peaks[1] - peaks[0]) < 256 * 1024, f"peaks {peaks} for {len(small)} and {len(large)} bytes"
    assert peaks[1] < len(large) / 10, f"peak {peaks[1]} bytes for a file of {len(large)}"


def test_pick_jobs_gives_the_next_slot_to_the_tenant_running_fewest() -> None:
    waiting = [(f"batch_{i:03d}", "a") for i in range(8)] + [("batch_100", "b"), ("batch_101", "c"),
                                                             ("batch_102", "b")]
    assert pick_jobs(waiting, {}, 3) == ["batch_000", "batch_100", "batch_101"], "one each, oldest tenant first"
    assert pick_jobs(waiting, {"a": 2}, 4) == ["batch_100", "batch_101", "batch_102", "batch_000"]
    assert pick_jobs(waiting, {"a": 8, "b": 1, "c": 1}, 2) == ["batch_100", "batch_101"]
    assert pick_jobs(waiting, {}, 100) == ["batch_000", "batch_100", "batch_101", "batch_001", "batch_102",
                                           *(f"batch_{i:03d}" for i in range(2, 8))], "then round by round"
    assert pick_jobs(waiting, {}, 0) == [] and pick_jobs([], {"a": 1}, 4) == []
    assert pick_jobs([("batch_2", "a"), ("batch_1", "a")], {}, 1) == ["batch_1"], "oldest first within a tenant"


def test_filenames_and_expiry_as_uploads_give_them() -> None:
    assert check_filename("questions (1).jsonl") == "questions (1).jsonl"
    for bad in ("a\r\nb.jsonl", "x\x1b[31m.jsonl", "tab\there", "nul\x00", "sep\u2028"):
        with pytest.raises(InvalidInput, match="control character"):
            check_filename(bad)
    with pytest.raises(InvalidInput, match="255"):
        check_filename("n" * 256)
    assert download_name("a\r\nb\x1b.jsonl") == "a__b_.jsonl" and download_name("") == "file"
    assert expiry_s({"anchor": "created_at", "seconds": 3600}, "expires_after") == 3600
    assert expiry_s({"anchor": "created_at", "seconds": "86400"}, "expires_after") == 86400, "a form's text"
    bad_expiries: tuple[object, ...] = (
        {"anchor": "created_at", "seconds": 3599}, {"anchor": "created_at", "seconds": 2_592_001},
        {"anchor": "last_active_at", "seconds": 3600}, {"seconds": 3600}, {"anchor": "created_at", "seconds": True}, 7)
    for bad_expiry in bad_expiries:
        with pytest.raises(InvalidInput):
            expiry_s(bad_expiry, "expires_after")
