"""Request validation: pure functions, no server."""
from __future__ import annotations

import pytest

from tasks.config import Settings
from tasks.errors import Forbidden, InvalidInput
from tasks.policy.tenancy import Principal, TenantPolicy
from tasks.schema import Priority
from webapp.validation import asks_offline, bearer_token, bind, parse_infer, priority_class, request_id_from

S = Settings.of(max_inputs_per_call=3, default_timeout_ms=1000, max_timeout_ms=5000, offline_max_timeout_ms=9000)


def test_single_and_multi_input() -> None:
    call = parse_infer({"input": "hi"}, S, "rid")
    assert call.inputs == ("hi",) and call.timeout_ms == 1000 and call.model == "sim" and call.tenant == "default"
    call = parse_infer({"inputs": ["a", "b"], "timeout_ms": 250, "tenant": "team-a"}, S, "rid")
    assert call.inputs == ("a", "b") and call.timeout_ms == 250 and call.tenant == "team-a"


@pytest.mark.parametrize("body", [
    [], "text", None, {}, {"input": "a", "inputs": ["b"]}, {"input": 5}, {"inputs": []}, {"inputs": ["a", 1]},
    {"inputs": ["a", "b", "c", "d"]}, {"input": "a", "timeout_ms": 0}, {"input": "a", "timeout_ms": 9001},
    {"input": "a", "timeout_ms": "10"}, {"input": "a", "timeout_ms": True}, {"input": "a", "model": ""},
    {"input": "a", "tenant": "no spaces"}, {"input": "a", "surprise": 1}, {"input": "a", "priority": "urgent"},
    {"input": "a", "model": "sim:arrivals"},
])
def test_malformed_bodies_are_rejected_with_a_reason(body: object) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_infer(body, S, "rid")
    assert info.value.message


def test_request_id_is_taken_only_when_well_formed() -> None:
    assert request_id_from("abc-123") == "abc-123"
    generated = request_id_from("bad id with spaces")
    assert generated != "bad id with spaces" and len(generated) == 32
    assert len(request_id_from(None)) == 32
    assert len(request_id_from("x" * 500)) == 32


def test_settings_from_env_parse_and_reject() -> None:
    s = Settings.from_env({"LLMB_MAX_BATCH_SIZE": "7", "LLMB_MAX_WAIT_MS": "2.5", "LLMB_LOG_JSON": "true"})
    assert s.batcher.max_batch_size == 7 and s.batcher.max_wait_s == 0.0025 and s.process.log_json is True
    with pytest.raises(ValueError, match="LLMB_MAX_BATCH_SIZE"):
        Settings.from_env({"LLMB_MAX_BATCH_SIZE": "many"})



def principal(name: str = "team-a", priority: Priority = Priority.INTERACTIVE, key_id: str = "k1") -> Principal:
    return Principal(TenantPolicy(name, 2.0, 50, priority), key_id=key_id, admin=False)


def test_bind_gives_the_call_its_tenants_policy() -> None:
    call = bind(parse_infer({"input": "a"}, S, "rid"), principal(), S)
    assert (call.tenant, call.weight, call.tenant_cap, call.priority) == ("team-a", 2.0, 50, "interactive")


def test_longer_deadlines_only_for_offline_requests() -> None:
    with pytest.raises(InvalidInput):
        bind(parse_infer({"input": "a", "timeout_ms": 6000}, S, "rid"), principal(), S)
    call = bind(parse_infer({"input": "a", "timeout_ms": 6000, "priority": "offline"}, S, "rid"), principal(), S)
    assert call.priority == "offline" and call.timeout_ms == 6000


def test_an_offline_tenant_cannot_ask_to_be_interactive() -> None:
    call = parse_infer({"input": "a", "priority": "interactive"}, S, "rid")
    call = bind(call, principal(priority=Priority.OFFLINE), S)
    assert call.priority == "offline"


def test_what_asks_for_offline_and_which_class_a_call_gets() -> None:
    assert asks_offline({"priority": "offline"}, openai=False) and asks_offline({"priority": "offline"}, openai=True)
    assert asks_offline({"service_tier": "flex"}, openai=True)
    assert not asks_offline({"service_tier": "flex"}, openai=False)  # an OpenAI word: not on /v1/infer
    assert not asks_offline({"priority": "interactive"}, openai=True) and not asks_offline(["offline"], openai=True)
    i, o = Priority.INTERACTIVE, Priority.OFFLINE
    assert [priority_class(asked, tenant) for asked, tenant in ((i, i), (o, i), (i, o), (o, o))] == [i, o, o, o]


def test_a_bearer_header_gives_its_key_and_nothing_else_does() -> None:
    assert bearer_token("Bearer llmb_k") == "llmb_k" and bearer_token("bearer  llmb_k ") == "llmb_k"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None and bearer_token("") is None


def test_a_key_cannot_claim_another_tenant_but_without_keys_the_name_is_the_tenant() -> None:
    call = parse_infer({"input": "a", "tenant": "team-b"}, S, "rid")
    with pytest.raises(Forbidden):
        bind(call, principal("team-a"), S, claimed_tenant="team-b")
    assert bind(call, principal("team-b", key_id=""), S, claimed_tenant="team-b").tenant == "team-b"
