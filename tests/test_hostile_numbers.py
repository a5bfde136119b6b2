"""Huge and non-finite numbers in every numeric field (issue 43, item 9): 1e308, 1e400 (Python's json reads it as
inf), NaN and Infinity (bare tokens it reads unless told not to), 2**64, an integer of 4,001 digits (past
``int()``'s limit), 1.5 where an integer goes, booleans (Python's ints), strings and nested lists, in each numeric
field of /v1/infer, the OpenAI routes, /v1/responses, the Batch API, the admin routes and the numeric query
parameters. Each is a JSON 400 naming its field, never a 500, an HTML page, a hang or a value that reaches a
worker; a steady caller beside the sweep is served throughout.

The parsers alone first (no processes: every case of the sweep, in microseconds), then the same cases through a
real stack (gunicorn, batcher, sim workers; keys on, loopback, pooled clients with retries off).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.hostile import NUMBERS, NumberCase, number_call, number_cases, pooled, steady_calls
from harness.stack import Stack, running_stack
from harness.stats import percentile
from tasks.config import Settings
from tasks.errors import InvalidInput
from tasks.policy import strict_json
from tasks.policy.batchfile import parse_input
from webapp.body import parse_json
from webapp.openai_schema import parse_chat, parse_completion, parse_embeddings
from webapp.responses_schema import chat_body, check_fields, in_our_terms, input_items
from webapp.validation import parse_infer

CASES = number_cases()


# -- the parsers alone ----------------------------------------------------------------------------------------------
def test_the_reader_refuses_numbers_no_field_takes_and_names_where_they_are() -> None:
    for text, path in (('{"a": NaN}', "a"), ('{"a": {"b": [1, Infinity]}}', "a.b[1]"), ("-Infinity", ""),
                       ('{"t": 1e400}', "t"), ('[{"x": -1e400}]', "[0].x"), ('{"n": 1' + "0" * 4400 + "}", "n")):
        with pytest.raises(strict_json.NotANumber) as info:
            strict_json.loads(text)
        assert info.value.path == path, text
    with pytest.raises(strict_json.NotANumber, match=r"'n' is 100000000000\u2026 \(a 4401-digit number\)"):
        strict_json.loads('{"n": 1' + "0" * 4400 + "}")
    # what it takes, it reads as json does: finite floats at the edges of the range, big integers, 1e-400 as 0.0
    assert strict_json.loads('[1e308, -1e308, 18446744073709551616, 1e-400, 5.0]') == [
        1e308, -1e308, 2**64, 0.0, 5.0]


def test_a_batch_input_line_with_a_number_no_field_takes_is_refused_at_upload_naming_it() -> None:
    """Before: 1e400 in a line's body was read as inf and the file accepted; the line failed later, as Infinity."""
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/infer", "body": {"input": "x", "timeout_ms": 1e400}}'
    _, errors = parse_input([line], "/v1/infer", 10)
    assert [e.code for e in errors] == ["invalid_json_line"] and "'body.timeout_ms' is 1e400" in errors[0].message


SETTINGS = Settings.from_env(overrides={"auth": "none", "max_tokens_cap": 4096})


def _responses(body: Any, settings: Settings, rid: str, tenant: str) -> object:
    body = check_fields(body)
    try:
        return parse_chat(chat_body(body, input_items(body.get("input"), "resp_x")), settings, rid, tenant)
    except InvalidInput as exc:
        raise in_our_terms(exc) from None


PARSERS: dict[str, Callable[[Any, Settings, str, str], object]] = {
    "POST /v1/infer": lambda body, *rest: parse_infer(body, SETTINGS, "r"),
    "POST /v1/chat/completions": parse_chat, "POST /v1/completions": parse_completion,
    "POST /v1/embeddings": parse_embeddings, "POST /v1/responses": _responses}


@pytest.mark.parametrize("case", [c for c in CASES if c.route in PARSERS],
                         ids=lambda c: f"{c.route} {c.field}={c.label[:9]}")
def test_each_route_parser_refuses_each_hostile_number_naming_its_field(case: NumberCase) -> None:
    assert case.body is not None
    if case.taken:
        PARSERS[case.route](parse_json(case.body), SETTINGS, "r", "default")
        return
    with pytest.raises(InvalidInput) as refused:  # the reader (a number no field takes) or the route's parser
        PARSERS[case.route](parse_json(case.body), SETTINGS, "r", "default")
    assert case.named_in(refused.value.message), (case.label, refused.value.message)


# -- through the real system ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("hostile-numbers")), workers=[0, (1, {"backend": "sim-lm"})],
                       web_workers=2, auth="keys", sim_batch_ms=20) as s:
        yield s


def test_every_hostile_number_is_a_json_400_naming_its_field_beside_a_steady_caller(stack: Stack) -> None:
    key = stack.admin("keys", "create", "hostile").stdout.strip()
    admin = stack.admin("keys", "create", "ops", "--admin").stdout.strip()
    steady_key = stack.admin("keys", "create", "steady").stdout.strip()
    steady = {"Authorization": f"Bearer {steady_key}"}
    solo, _ = steady_calls(stack.url, steady, count=20)
    done = threading.Event()
    beside: list[tuple[list[float], Counter[int]]] = []
    caller = threading.Thread(target=lambda: beside.append(steady_calls(stack.url, steady, until=done.is_set)))
    caller.start()
    wrong: list[str] = []
    answered: Counter[str] = Counter()
    try:
        with pooled() as session:
            for case in CASES:
                headers = {"Authorization": f"Bearer {admin if case.admin else key}"}
                r = number_call(session, stack.url, case, headers)
                answered[str(r.status_code)] += 1
                deadline = time.monotonic() + 30
                while r.status_code == 429 and time.monotonic() < deadline:  # shed while this shared 2-core host
                    # stalled, before its body was read: asked again after its Retry-After, as a client would
                    time.sleep(min(float(r.headers.get("Retry-After", "1")), deadline - time.monotonic()))
                    r = number_call(session, stack.url, case, headers)
                what = f"{case.route} {case.field}={case.label[:12]}: {r.status_code} {r.text[:160]!r}"
                if not r.headers.get("Content-Type", "").startswith("application/json"):
                    wrong.append(what)
                elif case.taken:
                    if r.status_code != 200:
                        wrong.append(what)
                elif r.status_code != 400 or not case.named_in(r.json()["error"]["message"]):
                    wrong.append(what)
    finally:
        done.set()
        caller.join(60)
    times, statuses = beside[0]
    print(f"\n{len(CASES)} hostile numbers ({len(NUMBERS)} values): {dict(answered)}; steady caller solo p99 "
          f"{percentile(solo, 99):.0f} ms, beside {dict(statuses)} p50 {percentile(times, 50):.0f} ms p99 "
          f"{percentile(times, 99):.0f} ms")
    assert not wrong, "\n".join(wrong)
    # served throughout: no error, no time-out; a 429 only as the door's shedding when this shared 2-core host
    # starves the API process for seconds (seen with other test runs beside it), never most of its calls
    assert set(statuses) <= {200, 429} and statuses[200] >= 5 and statuses[429] <= len(times) // 10, statuses
