"""The OpenAPI 3.1 document of every route, served at ``GET /openapi.json``.

Written as data here, once, beside the routes it describes, and held to them two ways: ``tests/test_openapi.py``
fails when a route of the app is missing from it or it names one the app does not serve, and Schemathesis (the
property-based tester teams run against OpenAPI documents) sends each operation its generated cases in CI and
checks every answer against the status codes and schemas below. The error statuses of each route family are
those :mod:`tasks.errors` and :mod:`webapp.errors` can answer it with, in that family's JSON shape. Request
schemas say what the routes accept; the routes' own checks (:mod:`webapp.validation`,
:mod:`webapp.openai_schema`) stay the authority and answer anything else with a 400.
"""
from __future__ import annotations

from typing import Any

from tasks.config import Auth, Settings
from tasks.policy.batchfile import COMPLETION_WINDOWS, ENDPOINTS, MAX_EXPIRY_S, MAX_FILENAME, MIN_EXPIRY_S
from tasks.policy.tenancy import MAX_IN_FLIGHT, MAX_WEIGHT, TENANT_NAME
from tasks.schema import MAX_CHOICES, bounds
from webapp.batch_api import MAX_PAGE
from webapp.openai_fields import FIELDS, Handling
from webapp.openai_schema import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS
from webapp.openapi_links import linked
from webapp.validation import MODEL, timeout_limit_ms

Schema = dict[str, Any]

STRING, INTEGER, NUMBER, BOOLEAN = ({"type": t} for t in ("string", "integer", "number", "boolean"))
NULLABLE_STRING: Schema = {"type": ["string", "null"]}
TENANT: Schema = {"type": "string", "pattern": TENANT_NAME.pattern}
PRIORITY: Schema = {"enum": ["interactive", "offline"]}
NATIVE_ERROR = {"$ref": "#/components/schemas/NativeError"}
OPENAI_ERROR = {"$ref": "#/components/schemas/OpenAIError"}
# what every route may be answered with besides its own statuses (the body reader, the door, the gateway): 401
# without a key when keys are on, 408 slow body, 413 big body, 429 shedding, 503 a dependency away. No 500: an
# unexpected failure is a bug, and Schemathesis in CI fails on it.
COMMON = (401, 403, 404, 405, 408, 413, 429, 503)
INFERENCE = (400, 409, 422, 504)

DESCRIPTIONS = {200: "answered", 201: "created", 400: "malformed body, field or parameter",
                401: "no API key, or an unknown one",
                403: "an admin route without an admin key, another tenant's, or LLMB_MAX_REGISTERED_ADAPTERS reached",
                404: "no such path or object, or a model no worker serves",
                405: "method not allowed", 408: "the body or headers did not arrive in time",
                409: "an Idempotency-Key names another call, a record cannot be read, a call cannot be resumed, or "
                     "an adapter's name is taken",
                413: "body over LLMB_MAX_BODY_BYTES", 422: "a poison input", 429: "full, overloaded or over a limit",
                503: "RabbitMQ, Redis, the database or every worker away",
                504: "no answer before the deadline", 507: "the files folder is full"}


def _responses(ok: Schema | None, errors: tuple[int, ...], error: Schema, *, ok_type: str = "application/json",
               stream: bool = False, ok_status: int = 200) -> Schema:
    content: Schema = {ok_type: {"schema": ok or {}}}
    if stream:
        # each event: a chunk's JSON in ``data`` (the last one ``[DONE]``), or an error object
        content["text/event-stream"] = {"schema": _object({"data": STRING, "event": STRING}, ("data",))}
    out: Schema = {str(ok_status): {"description": DESCRIPTIONS[ok_status], "content": content}}
    for status in sorted(set(errors) | set(COMMON)):
        out[str(status)] = {"description": DESCRIPTIONS[status], "content": {"application/json": {"schema": error}}}
    return out


def _op(summary: str, ok: Schema | None, errors: tuple[int, ...] = (), *, openai: bool = True,
        body: Schema | None = None, params: list[Schema] | None = None, ok_type: str = "application/json",
        stream: bool = False, form: bool = False, ok_status: int = 200) -> Schema:
    op: Schema = {"summary": summary,
                  "responses": _responses(ok, errors, OPENAI_ERROR if openai else NATIVE_ERROR, ok_type=ok_type,
                                          stream=stream, ok_status=ok_status)}
    if body is not None:
        media = "multipart/form-data" if form else "application/json"
        op["requestBody"] = {"required": True, "content": {media: {"schema": body}}}
    if params:
        op["parameters"] = params
    return op


def _path_param(name: str, schema: Schema = STRING) -> Schema:
    return {"name": name, "in": "path", "required": True, "schema": schema}


def _query(name: str, schema: Schema) -> Schema:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _object(properties: Schema, required: tuple[str, ...] = (), *, closed: bool = False) -> Schema:
    out: Schema = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    return out


def _strings(most: int, *, non_empty: bool = False) -> Schema:
    """One string, or a list of 1..``most`` of them (one batch item each)."""
    one = {"type": "string", "minLength": 1} if non_empty else STRING
    return {"anyOf": [one, {"type": "array", "items": one, "minItems": 1, "maxItems": most}]}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _when(condition: Schema, then: Schema, otherwise: Schema | None = None) -> Schema:
    out = {"if": condition, "then": then}
    if otherwise is not None:
        out["else"] = otherwise
    return out


def _is(field: str, value: object) -> Schema:
    """``field`` is present and equals ``value``."""
    return {"properties": {field: {"const": value}}, "required": [field]}


def _at_most(field: str, most: float) -> Schema:
    return {"properties": {field: {"maximum": most}}}


def _model(settings: Settings) -> Schema:
    """A model name; the example is the default model (GET /v1/models lists what is served now)."""
    return {"type": "string", "pattern": MODEL.pattern, "examples": [settings.models.default_model]}


def _generation(settings: Settings, *, least_tokens: int) -> Schema:
    """The sampling fields both generation routes take, with this deployment's limits."""
    tokens = _nullable({"type": "integer", "minimum": least_tokens, "maximum": settings.models.max_tokens_cap})
    return {
        "model": _model(settings), "max_tokens": tokens, "max_completion_tokens": tokens,
        "temperature": _nullable({"type": "number", **bounds("temperature")}),
        "top_p": _nullable({"type": "number", **bounds("top_p")}),
        "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1}, {
            "type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}]}),
        "seed": _nullable({"type": "integer", **bounds("seed")}),
        "n": _nullable({"type": "integer", **bounds("n")}),
        "stream": _nullable(BOOLEAN),
        "stream_options": _nullable(_object({"include_usage": BOOLEAN}, closed=True)),
        "timeout_ms": _nullable({"type": "number", "minimum": 1, "maximum": timeout_limit_ms(settings)}),
        **{name: _nullable(FIELDS[name].schema or {}) for name in ("service_tier", "priority")}}


def _table(route: str) -> Schema:
    """The fields of ``route`` whose values :mod:`webapp.openai_fields` states (a refused field's: those it takes
    as asking nothing more), each nullable."""
    return {name: _nullable(field.schema) for name, field in FIELDS.items()
            if route in field.routes and field.schema is not None}


def documented(route: str) -> set[str]:
    """The fields of ``route`` the document must describe: every one the table does not refuse outright."""
    return {name for name, field in FIELDS.items()
            if route in field.routes and (field.handling != Handling.REFUSED or field.schema is not None)}


def _generation_rules(settings: Settings) -> list[Schema]:
    """What the routes check across fields: stream_options only with a stream; interactive calls keep the
    shorter deadline."""
    return [
        _when({"not": _is("stream", True)}, {"properties": {"stream_options": {"type": "null"}}}),
        interactive_deadline(settings),
    ]


def interactive_deadline(settings: Settings) -> Schema:
    """A call that is not offline (``"priority": "offline"``, or OpenAI's ``"service_tier": "flex"``) keeps the
    interactive deadline limit."""
    offline = {"anyOf": [_is("priority", "offline"), _is("service_tier", "flex")]}
    return _when(offline, {}, _at_most("timeout_ms", settings.admission.max_timeout_ms))


USAGE = _object({"prompt_tokens": INTEGER, "completion_tokens": INTEGER, "total_tokens": INTEGER},
                ("prompt_tokens", "completion_tokens", "total_tokens"))
LIST = _object({"object": {"const": "list"}, "data": {"type": "array"}}, ("object", "data"))


def _openai_paths(settings: Settings) -> Schema:
    most = settings.admission.max_inputs_per_call
    completion = _object({"id": STRING, "object": STRING, "created": INTEGER, "model": STRING,
                          "choices": {"type": "array"}, "usage": USAGE}, ("id", "object", "choices"))
    # prompts times n is at most the inputs of one call: with several choices the document promises no more than
    # the prompts that fit 16 choices (a rule per n is exact, but more than a few branches stall generators)
    prompts_times_n = _when({"properties": {"n": {"type": "integer", "minimum": 2}}, "required": ["n"]},
                            {"properties": {"prompt": {"maxItems": most // MAX_CHOICES}}})
    completions = {"allOf": [
        _object({**_generation(settings, least_tokens=0), **_table("completions"), "prompt": _strings(most),
                 "logprobs": _nullable({"anyOf": [{"type": "integer", "minimum": 0,
                                                   "maximum": MAX_COMPLETION_LOGPROBS}, {"const": False}]}),
                 "echo": _nullable(BOOLEAN)}, ("model", "prompt"), closed=True),
        _when({"not": _is("echo", True)}, {"properties": {
            "max_tokens": _nullable({"minimum": 1}), "max_completion_tokens": _nullable({"minimum": 1})}}),
        *_generation_rules(settings),
        prompts_times_n]}
    message = _object({"role": {"enum": ["system", "user", "assistant", "developer"]}, "content": STRING},
                      ("role", "content"))
    chat = {"allOf": [
        _object({**_generation(settings, least_tokens=1), **_table("chat"), "logprobs": _nullable(BOOLEAN),
                 "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
                 "echo": {"type": "null"},
                 "messages": {"type": "array", "minItems": 1, "items": message}}, ("model", "messages"),
                closed=True),
        _when({"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
              _is("logprobs", True)),
        *_generation_rules(settings)]}
    embeddings = {"allOf": [_object({
        "model": _model(settings), "input": _strings(most), "encoding_format": _nullable({"enum": ["float", "base64"]}),
        "timeout_ms": _nullable({"type": "number", "minimum": 1, "maximum": timeout_limit_ms(settings)}),
        "priority": _nullable(STRING), "service_tier": _nullable(STRING), "user": _nullable(STRING)},
        ("model", "input"), closed=True),
        interactive_deadline(settings)]}
    return {
        "/v1/completions": {"post": _op(
            "Text completion (OpenAI); streamed as server-sent events with \"stream\": true", completion,
            INFERENCE, stream=True, body=completions)},
        "/v1/chat/completions": {"post": _op(
            "Chat completion (OpenAI); streamed as server-sent events with \"stream\": true", completion,
            INFERENCE, stream=True, body=chat)},
        "/v1/embeddings": {"post": _op(
            "Embeddings (OpenAI)", _object({"object": STRING, "data": {"type": "array"}, "model": STRING,
                                            "usage": USAGE}, ("object", "data")),
            INFERENCE, body=embeddings)},
        "/v1/models": {"get": _op("The models live workers serve, and the LoRA adapters of them the caller may use "
                                  "(each with its parent model)", LIST)},
    }


def _batch_paths(settings: Settings) -> Schema:
    file_id, batch_id = [_path_param("file_id")], [_path_param("batch_id")]
    page = [_query("limit", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}), _query("after", STRING)]
    file = _object({"id": STRING, "object": {"const": "file"}, "bytes": INTEGER, "filename": STRING,
                    "purpose": STRING}, ("id", "object"))
    batch = _object({"id": STRING, "object": {"const": "batch"}, "status": STRING, "endpoint": STRING,
                     "input_file_id": STRING}, ("id", "object", "status"))
    seconds = {"type": "integer", "minimum": MIN_EXPIRY_S, "maximum": MAX_EXPIRY_S}
    expiry = _nullable(_object({"anchor": {"const": "created_at"}, "seconds": seconds}, ("anchor", "seconds"),
                               closed=True))
    upload = _object({"purpose": {"const": "batch"},
                      "file": {"type": "string", "format": "binary", "contentMediaType": "application/jsonl"},
                      "expires_after[anchor]": {"const": "created_at"}, "expires_after[seconds]": seconds},
                     ("purpose", "file"))
    upload["dependentRequired"] = {"expires_after[anchor]": ["expires_after[seconds]"],  # both or neither
                                   "expires_after[seconds]": ["expires_after[anchor]"]}
    metadata = _nullable({"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                          "additionalProperties": {"type": "string", "maxLength": 512}})
    start = _object({"input_file_id": STRING, "endpoint": {"enum": list(ENDPOINTS)},
                     "completion_window": {"enum": list(COMPLETION_WINDOWS)}, "metadata": metadata,
                     "output_expires_after": expiry}, ("input_file_id", "endpoint", "completion_window"), closed=True)
    return {
        "/v1/files": {
            "post": _op(f"Upload a batch input file (JSONL; filename at most {MAX_FILENAME} characters)", file,
                        (400, 507), body=upload, form=True),
            "get": _op("This tenant's files", LIST, (400,), params=[
                *page, _query("purpose", STRING), _query("order", {"enum": ["asc", "desc"]})])},
        "/v1/files/{file_id}": {
            "get": _op("One file", file, params=file_id),
            "delete": _op("Delete a file", _object({"id": STRING, "deleted": BOOLEAN}), (409,), params=file_id)},
        "/v1/files/{file_id}/content": {"get": _op("A file's bytes", STRING, params=file_id,
                                                   ok_type="application/octet-stream")},
        "/v1/batches": {
            "post": _op("Start a batch job over an uploaded file", batch, (400,), body=start),
            "get": _op("This tenant's batch jobs", LIST, (400,), params=page)},
        "/v1/batches/{batch_id}": {"get": _op("One batch job", batch, params=batch_id)},
        "/v1/batches/{batch_id}/cancel": {"post": _op("Cancel a batch job", batch, (409,), params=batch_id)},
    }


def _responses_paths(settings: Settings) -> Schema:
    """The Responses API (:mod:`webapp.responses_api`), its body as :mod:`webapp.responses_schema` takes it."""
    rid = [_path_param("response_id")]
    response = _object({"id": STRING, "object": {"const": "response"}, "status": STRING, "output": {"type": "array"}},
                       ("id", "object", "status"))
    part = _object({"type": {"enum": ["input_text", "output_text"]}, "text": STRING}, ("type", "text"))
    item = {"anyOf": [
        _object({"type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
                 "content": {"anyOf": [STRING, {"type": "array", "items": part}]}}, ("role", "content")),
        _object({"type": {"const": "function_call"}, "call_id": STRING, "name": STRING, "arguments": STRING},
                ("type", "call_id", "name", "arguments")),
        _object({"type": {"const": "function_call_output"}, "call_id": STRING, "output": STRING},
                ("type", "call_id", "output"))]}
    tool = _object({"type": {"const": "function"}, "name": STRING, "description": _nullable(STRING),
                    "parameters": _nullable({"type": "object"}), "strict": _nullable(BOOLEAN)}, ("type", "name"))
    fmt = {"anyOf": [_object({"type": {"enum": ["text", "json_object"]}}, ("type",)),
                     _object({"type": {"const": "json_schema"}, "name": STRING, "schema": {"type": "object"},
                              "strict": _nullable(BOOLEAN)}, ("type", "name", "schema"))]}
    metadata = _nullable({"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                          "additionalProperties": {"type": "string", "maxLength": 512}})
    sampling = _generation(settings, least_tokens=1)
    body = {"allOf": [_object({
        "model": _model(settings), "input": {"anyOf": [STRING, {"type": "array", "items": item, "minItems": 1}]},
        "instructions": _nullable(STRING), "max_output_tokens": sampling["max_tokens"],
        **{k: sampling[k] for k in ("temperature", "top_p", "seed", "timeout_ms", "service_tier", "priority")},
        "tools": _nullable({"type": "array", "items": tool}),
        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]},
                                            _object({"type": {"const": "function"}, "name": STRING},
                                                    ("type", "name"))]}),
        "parallel_tool_calls": _nullable(BOOLEAN), "text": _nullable(_object({"format": _nullable(fmt)})),
        "metadata": metadata, "store": _nullable(BOOLEAN), "previous_response_id": _nullable(STRING),
        "stream": _nullable(BOOLEAN), "background": _nullable(BOOLEAN), "user": _nullable(STRING)},
        ("model", "input")),
        _when(_is("background", True), {"not": _is("store", False)}),
        _when({"anyOf": [_is("background", True), _is("priority", "offline"), _is("service_tier", "flex")]}, {},
              _at_most("timeout_ms", settings.admission.max_timeout_ms))]}
    page = [_query("limit", {"type": "integer", "minimum": 1, "maximum": 100}), _query("after", STRING),
            _query("order", {"enum": ["asc", "desc"]})]
    return {
        "/v1/responses": {"post": _op("Create a response (OpenAI's Responses API); stored unless \"store\": false, "
                                      "streamed with \"stream\": true, run on with \"background\": true", response,
                                      INFERENCE, stream=True, body=body)},
        "/v1/responses/{response_id}": {
            "get": _op("A stored response; its events again with stream=true, after starting_after", response,
                       (400, 409), stream=True, params=[*rid, _query("stream", BOOLEAN),
                                                        _query("starting_after", INTEGER)]),
            "delete": _op("Delete a stored response", _object({"id": STRING, "deleted": BOOLEAN}), params=rid)},
        "/v1/responses/{response_id}/input_items": {"get": _op("A stored response's input items", LIST, (400,),
                                                               params=[*rid, *page])},
        "/v1/responses/{response_id}/cancel": {"post": _op("Cancel a background response", response, (400,),
                                                           params=rid)},
    }


def _adapter_paths(settings: Settings) -> Schema:
    """vLLM's routes for LoRA adapters (:mod:`webapp.adapters_api`), for an admin key, in OpenAI's error shape."""
    adapter = _object({"message": STRING, "name": STRING, "base_model": STRING, "path": STRING, "rank": INTEGER,
                       "tenant": NULLABLE_STRING, "pinned": BOOLEAN, "created_at": STRING}, ("message", "name"))
    load = _object({"lora_name": _model(settings), "lora_path": {"type": "string", "minLength": 1},
                    "base_model": _model(settings), "tenant": _nullable(TENANT), "pinned": BOOLEAN},
                   ("lora_name", "lora_path"), closed=True)
    unload = _object({"lora_name": {"type": "string", "minLength": 1}, "lora_int_id": {}}, ("lora_name",),
                     closed=True)
    return {
        "/v1/load_lora_adapter": {"post": _op(
            "Register a LoRA adapter of a served model (vLLM's route; an admin key): calls name it as their model",
            adapter, (400, 409), body=load)},
        "/v1/unload_lora_adapter": {"post": _op("Remove a registered LoRA adapter (vLLM's route; an admin key)",
                                                _object({"message": STRING, "name": STRING}), (400,), body=unload)},
    }


def _native_paths(settings: Settings) -> Schema:
    deadline = {"type": "number", "exclusiveMinimum": 0, "maximum": timeout_limit_ms(settings)}
    infer = {"allOf": [
        _object({"input": STRING, "inputs": {"type": "array", "items": STRING, "minItems": 1,
                                             "maxItems": settings.admission.max_inputs_per_call},
                 "timeout_ms": deadline, "model": _model(settings), "tenant": TENANT, "priority": _nullable(PRIORITY)},
                closed=True),
        {"oneOf": [{"required": ["input"]}, {"required": ["inputs"]}]},
        _when({"not": _is("priority", "offline")}, _at_most("timeout_ms", settings.admission.max_timeout_ms))]}
    answer = _object({"id": STRING, "output": {}, "outputs": {"type": "array"}, "batch": {}, "batches": {}},
                     ("id",))
    weight = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_WEIGHT}
    cap = {"type": "integer", "minimum": 1, "maximum": MAX_IN_FLIGHT}
    tenant = _object({"name": STRING, "weight": NUMBER, "max_in_flight": {"type": ["integer", "null"]},
                      "priority": PRIORITY})
    return {
        "/v1/infer": {"post": _op("Run inputs through the batching pipeline (native API)", answer,
                                  INFERENCE, openai=False, body=infer)},
        "/v1/requests/{request_id}": {"get": _op(
            "A call's record: its status, and its answer once it has one", _object({"id": STRING}), (409,),
            openai=False, params=[_path_param("request_id")])},
        "/v1/requests/{request_id}/stream": {"get": _op(
            "A streamed call's events again, after the one Last-Event-ID names (resuming a stream whose connection "
            "or API process died); each event's id is the client's position after it", STRING, (400, 409),
            openai=False, ok_type="text/event-stream", params=[
                _path_param("request_id"), _query("last_event_id", STRING),
                {"name": "Last-Event-ID", "in": "header", "required": False, "schema": STRING}])},
        "/v1/admin/tenants": {"get": _op("Every tenant, with its items in flight", _object(
            {"tenants": {"type": "array"}}, ("tenants",)), openai=False)},
        "/v1/admin/tenants/{name}": {"put": _op("Create or change a tenant", tenant, (400,), openai=False,
                                                params=[_path_param("name", TENANT)], body=_object(
                                                    {"weight": _nullable(weight), "max_in_flight": _nullable(cap),
                                                     "priority": _nullable(PRIORITY)}, closed=True))},
        "/v1/admin/keys": {
            "get": _op("API keys (never the keys themselves)", _object({"keys": {"type": "array"}}, ("keys",)),
                       (400,), openai=False, params=[_query("tenant", STRING)]),
            "post": _op("Create an API key (shown once)", _object({"id": STRING, "tenant": STRING, "key": STRING},
                                                                  ("id", "tenant", "key")),
                        (400,), openai=False, ok_status=201, body=_object(
                            {"tenant": TENANT, "admin": BOOLEAN,
                             "label": _nullable({"type": "string", "maxLength": 128})}, ("tenant",)))},
        "/v1/admin/keys/{key_id}": {"delete": _op("Revoke an API key", _object({"id": STRING, "revoked": BOOLEAN}),
                                                  openai=False, params=[_path_param("key_id")])},
        "/v1/admin/stats": {"get": _op("Admission and fleet figures, by model", _object({"models": {}}),
                                       openai=False)},
        "/healthz": {"get": _op("Liveness: the process answers", _object({"status": STRING}), openai=False)},
        "/readyz": {"get": _op("Readiness: broker, Redis and live workers", _object({"status": STRING}),
                               openai=False)},
        "/metrics": {"get": _op("Prometheus metrics", STRING, openai=False, ok_type="text/plain")},
        "/openapi.json": {"get": _op("This document", {"type": "object"}, openai=False)},
    }


def document(version: str, settings: Settings) -> Schema:
    """The whole document, with this deployment's limits (built once per process: nothing in it changes)."""
    native_error = _object({"error": _object({"type": STRING, "message": STRING, "request_id": NULLABLE_STRING},
                                             ("type", "message"))}, ("error",))
    openai_error = _object({"error": _object({"message": STRING, "type": STRING, "param": NULLABLE_STRING,
                                              "code": NULLABLE_STRING}, ("message", "type"))}, ("error",))
    return {
        "openapi": "3.1.0",
        "info": {"title": "llm-batcher", "version": version,
                 "description": "Batched LLM inference behind REST: a native API, OpenAI-compatible routes and "
                                "OpenAI's Batch API. Errors: the native routes answer {\"error\": {\"type\", "
                                "\"message\", \"request_id\"}}, every other /v1/ route OpenAI's shape."},
        "paths": linked({**_native_paths(settings), **_openai_paths(settings), **_batch_paths(settings),
                          **_responses_paths(settings), **_adapter_paths(settings)}),
        "components": {
            "schemas": {"NativeError": native_error, "OpenAIError": openai_error},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "an API key (llmb-admin keys create), when keys are on"}},
        },
        # with keys on (LLMB_AUTH=keys, the default) every route but the open ones needs one
        "security": [{"bearer": []}] if settings.tenants.auth == Auth.KEYS else [],
    }
