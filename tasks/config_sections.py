"""The sections of the settings (:class:`tasks.config.Settings`), each a frozen dataclass of the settings of one part
of the system, and the modes they choose between. A field is declared with :func:`setting`: its default, its flat
name (the variable is ``LLMB_<FLAT_NAME>``) and its documentation, which docs/configuration.md is printed from.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tasks.schema import Priority


def absolute_path(path: str) -> str:
    """``path`` made absolute against the current working directory (``~`` expanded); empty stays empty."""
    return os.path.abspath(os.path.expanduser(path)) if path else path


def absolute_sqlite_url(url: str) -> str:
    """A SQLite URL whose file is named relative (``sqlite:///var/llmb.db``) made absolute
    (``sqlite:////abs/var/llmb.db``); in-memory databases and other databases' URLs are left as they are."""
    scheme, sep, rest = url.partition(":///")
    if not sep or scheme.split("+")[0] != "sqlite":
        return url
    path, query_sep, query = rest.partition("?")
    if not path or path == ":memory:" or path.startswith(("/", "file:")):
        return url
    return f"{scheme}:///{absolute_path(path)}{query_sep}{query}"


class QueueType(StrEnum):
    CLASSIC = "classic"
    QUORUM = "quorum"  # replicated across a RabbitMQ cluster


class HfMode(StrEnum):
    STATIC = "static"
    CONTINUOUS = "continuous"


class WaitMode(StrEnum):
    ADAPTIVE = "adaptive"
    FIXED = "fixed"


class Auth(StrEnum):
    KEYS = "keys"
    NONE = "none"


class SimLmMode(StrEnum):
    CONTINUOUS = "continuous"
    STATIC = "static"


def setting(default: Any, name: str, doc: str, *, ms: bool = False) -> Any:
    """A field of a section: ``name`` is its flat name (the variable is ``LLMB_<NAME>``); ``ms``: the variable is
    in milliseconds, the field in seconds."""
    return field(default=default, metadata={"name": name, "doc": doc, "scale": 1000.0 if ms else 1.0})


@dataclass(frozen=True)
class Broker:
    """RabbitMQ: where it is, the names and types of the queues, how requests are published."""
    url: str = setting('amqp://guest:guest@127.0.0.1:5672//', "broker_url",
        "RabbitMQ URL (kombu syntax).")
    namespace: str = setting('llmb', "namespace",
        "Prefix of every queue name and Redis key; lets several systems share one broker and Redis.")
    queue_type: QueueType = setting(QueueType.CLASSIC, "queue_type",
        "RabbitMQ type of the request, recovery and GPU worker queues: 'classic' or 'quorum' (replicated across a RabbitMQ cluster; what production runs). An existing queue keeps its type: delete it (when empty) to switch.")
    heartbeat_s: float = setting(1.0, "broker_heartbeat_s",
        "AMQP heartbeat of batchers and GPU workers: RabbitMQ closes the connection of a host it has not heard from for about this long, so a cut-off batcher's requests go to a standby and a cut-off worker's batches come back (0: off).")
    pool_size: int = setting(10, "broker_pool_size",
        "RabbitMQ connections per API process used for publishing.")
    publish_timeout_s: float = setting(5.0, "publish_timeout_s",
        "Longest wait for RabbitMQ to confirm a request (never past the caller's deadline); beyond it the caller gets 503 (e.g. during a broker memory or disk alarm).")
    persistent_requests: bool = setting(True, "persistent_requests",
        "Write request messages to disk in RabbitMQ, so they outlive a broker restart; false saves ~0.25 ms of broker CPU per request.")


@dataclass(frozen=True)
class Stores:
    """Redis and the SQL database: where they are, how long results live, what the ledger keeps."""
    redis_url: str = setting('redis://127.0.0.1:6379/0', "redis_url",
        "Redis URL for results, heartbeats and counters: `redis://`, `rediss://`, `unix://`, or `redis+sentinel://[[user]:[password]@]host[:port][,host[:port]...]/<service>[/<db>][?sentinel_password=...]` for the master that those Sentinels (port 26379 by default) name `<service>`, followed across failovers.")
    redis_pool_size: int = setting(50, "redis_pool_size",
        "Redis connections per API process (shared by all waiting requests).")
    database_url: str = setting('sqlite:///var/llmb.db', "database_url",
        "SQLAlchemy URL of the outcome ledger (SQLite file by default).")
    result_ttl_s: int = setting(300, "result_ttl_s",
        "How long a result key lives in Redis.")
    stream_resume_s: float = setting(10.0, "stream_resume_ms",
        "A stream whose client went away keeps generating this long for the client to resume it (GET /v1/requests/<id>/stream with Last-Event-ID, on any API process) before it is cancelled; 0: cancelled at once.", ms=True)
    result_recheck_s: float = setting(3.0, "result_recheck_ms",
        "A waiting request re-reads its keys this often even without a wake-up (a safety net: wake-ups lost to a Redis reconnect are re-read at once).", ms=True)
    ledger_buffer: int = setting(10_000, "ledger_buffer",
        "Ledger records a process keeps while the database is unreachable; beyond that they are dropped and counted.")
    store_inputs: bool = setting(False, "store_inputs",
        "Keep each input's text in the ledger (needed by `llmb-admin replay` and `requeue`).")

    responses_expire_s: int = setting(2_592_000, "responses_expire_s",
        "Responses API: a stored response (`store`, the default) is kept this many seconds after its creation (30 days, as OpenAI's; 0: never), then not found; expired ones are deleted as the tenant stores new ones.")
    responses_tenant_max_count: int = setting(10_000, "responses_tenant_max_count",
        "Responses API: most stored responses one tenant may hold; a stored response beyond it gets 403 quota_exceeded (0: no limit).")

    def __post_init__(self) -> None:
        """A relative SQLite path made absolute once, against the working directory the process started in."""
        object.__setattr__(self, "database_url", absolute_sqlite_url(self.database_url))


@dataclass(frozen=True)
class Models:
    """What the workers serve and how: model names, limits, price, and the hf-causal engine."""
    default_model: str = setting('sim', "default_model",
        "Model used when a request names none.")
    served_name: str = setting('', "served_name",
        "Name a GPU worker serves its model under (default: the hub id, or a local folder's name).")
    max_tokens_cap: int = setting(1024, "max_tokens_cap",
        "Largest max_tokens a completion request may ask for.")
    device_price_per_hour: float = setting(2.0, "device_price_per_hour",
        "What one device costs per hour (any currency): `llmb-admin stats` turns it into a cost per million tokens.")
    hf_mode: HfMode = setting(HfMode.CONTINUOUS, "hf_mode",
        "hf-causal workers: 'continuous' (every request, sampled ones with their own seeds, joins and leaves the running batch at every step; prompt blocks are shared and cached) or 'static' (one padded generate() per batch, or per seed group when sampled).")
    cb_slots: int = setting(4, "cb_slots",
        "Continuous mode: batches a worker runs at once (their requests share the decode batch).")
    cb_num_blocks: int = setting(256, "cb_num_blocks",
        "Continuous mode: KV-cache pages; pages x page size is the token budget the worker advertises.")
    cb_page_size: int = setting(32, "cb_page_size",
        "Continuous mode: tokens per KV-cache page.")
    cb_max_requests: int = setting(64, "cb_max_requests",
        "Continuous mode: most requests in one decoding step.")
    cb_max_batch_tokens: int = setting(512, "cb_max_batch_tokens",
        "Continuous mode: most tokens in one forward pass (prefill included).")
    max_adapters: int = setting(16, "max_adapters",
        "LoRA adapters one worker keeps resident at most (least recently used evicted first, pinned ones never; 0: the worker serves no adapters).")
    max_adapters_per_batch: int = setting(4, "max_adapters_per_batch",
        "Distinct LoRA adapters in one batch (the batcher's cap) and in one decoding step (the worker's) at most.")


@dataclass(frozen=True)
class BatcherSettings:
    """How the batcher forms batches and hands them to workers."""
    max_batch_size: int = setting(100, "max_batch_size",
        "A batch is flushed as soon as it holds this many items.")
    max_batch_bytes: int = setting(16_777_216, "max_batch_bytes",
        "...or as soon as its inputs add up to this many bytes (a batch must fit in one RabbitMQ message).")
    max_wait_s: float = setting(0.02, "max_wait_ms",
        "...or when its first item has waited this long.", ms=True)
    wait_mode: WaitMode = setting(WaitMode.ADAPTIVE, "wait_mode",
        "'adaptive' (the wait shrinks to min_wait_ms when batches fill on their own or no device is free, and stretches up to adaptive_max_wait_ms when a full batch is that close) or 'fixed' (always max_wait_ms).")
    min_wait_s: float = setting(0.001, "min_wait_ms",
        "Adaptive mode: the shortest wait (coalesces requests that arrive together).", ms=True)
    adaptive_max_wait_s: float = setting(0.05, "adaptive_max_wait_ms",
        "Adaptive mode: the longest wait, and never more than a fifth of the measured batch time.", ms=True)
    offline_max_wait_s: float = setting(0.5, "offline_max_wait_ms",
        "Offline requests' batches may wait this long to fill (throughput over latency).", ms=True)
    prefetch: int = setting(10_000, "batcher_prefetch",
        "Request messages the batcher may hold unacknowledged (its buffer bound). Keep it at least the admission cap, so every admitted request is in a batcher's fair buffer rather than behind a flood in the FIFO queue.")
    dispatch_lead_s: float = setting(0.015, "dispatch_lead_ms",
        "A busy worker's next batch is sent this long before its running batch should end (until then it keeps filling); the starting value: each batcher learns each worker's lead from the hand-overs that came late.", ms=True)
    max_retries: int = setting(3, "max_retries",
        "Times a request is sent again after its worker was lost before running it; then it fails (503).")
    fair_quantum: int = setting(10, "fair_quantum",
        "Items a tenant of weight 1 may put in a batch per round of weighted deficit round robin.")
    prefix_routing: bool = setting(True, "prefix_routing",
        "Among the workers able to take a batch, send each item to one whose prefix cache holds its prompt's start (workers that report one: sim-lm), weighed against load; false: the least backlog alone.")
    adapter_routing: bool = setting(True, "adapter_routing",
        "Send each item naming a LoRA adapter to a worker holding it (else one with room to load it), scored as the Gateway API Inference Extension does and weighed with the prefix-cache score and load; false: adapter-blind (the bench's baseline).")
    prefix_wait_s: float = setting(1.0, "prefix_wait_ms",
        "Prefix- and adapter-aware routing: an item whose prompt start a busy worker holds waits up to this long for that worker to take a batch, rather than being prefilled again elsewhere; so does an item whose LoRA adapter only busy workers hold or have room for, rather than evicting another adapter elsewhere (0: never waits).", ms=True)


@dataclass(frozen=True)
class Tenants:
    """Who may call, and each tenant's share: authentication, default weights, caps and class."""
    auth: Auth = setting(Auth.KEYS, "auth",
        "'keys': every inference call needs `Authorization: Bearer <key>` (keys from `llmb-admin keys create`); 'none': no authentication, the tenant comes from X-Tenant or the body (for local use only).")
    auth_cache_s: float = setting(5.0, "auth_cache_s",
        "API processes cache key lookups this long: a revoked key stops working within this time.")
    max_registered_adapters: int = setting(1000, "max_registered_adapters",
        "LoRA adapters that may be registered at most (`llmb-admin adapters add`, POST /v1/load_lora_adapter); over it: 403 adapter_limit.")
    adapter_cache_s: float = setting(2.0, "adapter_cache_s",
        "API processes read the registered LoRA adapters once per this long: a new one answers, a removed one stops answering, within this time.")
    weight: float = setting(1.0, "tenant_weight",
        "Weight of a tenant with no settings of its own (its share of batch slots when tenants compete).")
    max_in_flight: int = setting(5000, "tenant_max_in_flight",
        "In-flight cap of a tenant with no settings of its own (items admitted, not yet answered); over it: 429.")
    priority: Priority = setting(Priority.INTERACTIVE, "tenant_priority",
        "Priority class of a tenant with no settings of its own: 'interactive' or 'offline'.")
    kv_admission_factor: float = setting(4.0, "kv_admission_factor",
        "Generation models whose workers advertise a KV cache: tokens (prompt + max_tokens, estimated) admitted at once may be this many times the fleet's KV caches together (the rest waits for room); over it: 429.")
    scale_headroom: float = setting(1.25, "scale_headroom",
        "Recommended workers = arrival rate x batch time / batch size x this.")


@dataclass(frozen=True)
class AdmissionSettings:
    """What an API process admits, how fast it sheds what it cannot serve in time, and the deadlines."""
    cap: int = setting(10_000, "admission_cap",
        "Most interactive items admitted and not yet answered, across all API processes (fewer when the fleet could not answer a new request within its deadline); over it: 429.")
    queue_share: float = setting(1.0, "queue_share",
        "Share of what the fleet can answer within a request's deadline (its measured throughput x the deadline less two batch times, or one once the line has been deep enough for its running batches to be full, beyond one batch per worker) that admission fills before refusing with 429 queue_full while the model's line is good queue (a burst: it emptied within LLMB_QUEUE_INTERVAL_MS). 1.0 lets a burst into an idle fleet fill all it can answer in time. Between 0.1 and 1.")
    queue_standing_share: float = setting(0.75, "queue_standing_share",
        "The same share while the model's line stands (it has not emptied for LLMB_QUEUE_INTERVAL_MS: a steady overload): the margin that keeps a steady overload's callers from waiting close to their deadlines (300%: answered p50 3.1 s of 4.5 s at 0.75, 3.6 s at 0.9; the same goodput). Between 0.1 and 1.")
    queue_target_s: float = setting(0.0, "queue_target_ms",
        "Optional: a standing line also admits only while it is shorter than what the fleet answers in this long (CoDel's target, whatever the callers' deadlines; keep it above two batch times so the devices never wait for work); 0: off, the standing share alone.", ms=True)
    queue_interval_s: float = setting(3.0, "queue_interval_ms",
        "How long a model's line must go without emptying before it counts as standing (CoDel's interval). Longer than a burst takes to arrive and be let in (the door lets a call wait up to LLMB_DOOR_MAX_DELAY_MS for its turn), so a burst into an idle fleet fills all the fleet can answer before each caller's deadline; a steady overload is held to LLMB_QUEUE_STANDING_SHARE from one interval in, the excess refused as it arrives. 0: never standing (LLMB_QUEUE_SHARE alone).", ms=True)
    offline_cap: int = setting(10_000, "offline_admission_cap",
        "Most offline items admitted and not yet answered, across all API processes (offline items do not count against LLMB_ADMISSION_CAP, so an offline backlog never closes the door to interactive callers).")
    api_lease_s: float = setting(5.0, "api_lease_s",
        "Each API process holds a lease in Redis for this long, renewed three times as often; when it lapses (the process died) the capacity its callers held is released within seconds instead of at their deadlines.")
    max_inputs_per_call: int = setting(100, "max_inputs_per_call",
        "Largest 'inputs' list accepted by one call.")
    max_body_bytes: int = setting(1_048_576, "max_body_bytes",
        "Largest request body; larger bodies get 413.")
    body_timeout_s: float = setting(10.0, "body_timeout_s",
        "A request body must arrive within this many seconds of its headers; slower ones get 408 and the connection is closed.")
    door_max_delay_s: float = setting(2.5, "door_max_delay_ms",
        "An inference request whose API process would get to it this long after its bytes arrived (the process is CPU-bound: a burst) is refused at once from its bytes with 429 overloaded, so that the excess is told fast and the work already admitted is still answered in time; also the longest a call waits for its turn at admission. Whether a request let in can still be answered within its own deadline is admission's call.", ms=True)
    admit_concurrency: int = setting(32, "admit_concurrency",
        "Calls one API process takes through admission at once (its Redis round trips and the publish; a call gives its turn up before waiting for RabbitMQ's confirm); the rest wait their turn in arrival order for at most LLMB_DOOR_MAX_DELAY_MS, and the door refuses at once, before the body is read, a call that could not get its turn in time (429 overloaded, Retry-After the expected wait at the measured drain rate). 0: no limit.")
    default_timeout_ms: int = setting(30_000, "default_timeout_ms",
        "Deadline of a request that gives no timeout_ms.")
    max_timeout_ms: int = setting(300_000, "max_timeout_ms",
        "Largest timeout_ms a caller may ask for.")
    offline_max_timeout_ms: int = setting(3_600_000, "offline_max_timeout_ms",
        "Largest timeout_ms an offline request may ask for.")
    retry_after_s: int = setting(1, "retry_after_s",
        "Smallest Retry-After (s) sent with 429; a refusal for room says when the work ahead will have drained at the measured rate.")

    def __post_init__(self) -> None:
        for name, share in (("LLMB_QUEUE_SHARE", self.queue_share),
                            ("LLMB_QUEUE_STANDING_SHARE", self.queue_standing_share)):
            if not 0.1 <= share <= 1.0:
                raise ValueError(f"{name}={share} is not between 0.1 and 1")


@dataclass(frozen=True)
class Web:
    """gunicorn: where it listens, how many processes and connections, connection time limits."""
    bind: str = setting('127.0.0.1:8000', "web_bind",
        "Address gunicorn listens on.")
    workers: int = setting(2, "web_workers",
        "gunicorn worker processes (each holds many waiting requests on gevent).")
    connections: int = setting(0, "web_connections",
        "Simultaneous connections per gunicorn worker process; 0 (default): enough for the admission caps (interactive + offline) spread over the worker processes, plus room to refuse the excess fast.")
    keepalive_s: float = setting(75.0, "keepalive_s",
        "How long an API process keeps an idle kept-alive connection open, waiting for its next request (nginx's default; longer than common clients' pool expiry: httpx 5 s, aiohttp 15 s, so a pooled client retires an idle connection before the server closes it).")
    graceful_s: float = setting(30.0, "web_graceful_s",
        "gunicorn's graceful timeout: on SIGTERM (or a SIGHUP reload) an API process stops accepting, closes its idle connections and answers the calls it holds for up to this long before they are cut. Keep it at least the timeout_ms most callers give (the default deadline, 30 s), and the pod's terminationGracePeriodSeconds above preStop + this.")
    header_timeout_s: float = setting(10.0, "header_timeout_s",
        "A request's headers must all arrive within this many seconds of its first byte (slow-header protection); slower ones get 408 and the connection is closed.")
    metrics_bind: str = setting('', "metrics_bind",
        "Address of a separate listener for /metrics (e.g. 127.0.0.1:9100), to keep it off the public port (its series name tenants): gunicorn's master binds it, every API process serves it with all their figures, and the API port's /metrics answers 404. Empty (default): /metrics is served on the API port.")
    trace_parent_max_per_s: float = setting(10.0, "trace_parent_max_per_s",
        "With tracing on: at most this many calls a second per API process have their caller's sampled flag (a traceparent ending -01) honoured, beyond an authenticated tenant's (see trace_parent_tenants); the others are sampled as calls without a traceparent are. 0: none.")
    trace_parent_tenants: bool = setting(True, "trace_parent_tenants",
        "With tracing on: a call with a live API key has its caller's sampled flag always honoured; false: it counts against trace_parent_max_per_s as anyone's does.")
    stream_send_timeout_s: float = setting(30.0, "stream_send_timeout_ms",
        "A response (a stream's, a resumed stream's) whose client takes none of its bytes for this long ends: its connection is closed and what it holds is released (the stream's generation is cancelled as when its client leaves, a resumed stream's slot is freed), rather than held until TCP gives up; 0: no limit. nginx's send_timeout is 60 s.", ms=True)


@dataclass(frozen=True)
class Worker:
    """A GPU worker's heartbeat and how much work it holds."""
    heartbeat_interval_s: float = setting(1.0, "heartbeat_interval_s",
        "How often a GPU worker reports to Redis.")
    heartbeat_stale_factor: float = setting(3.0, "heartbeat_stale_factor",
        "A worker silent for this many intervals leaves the pool.")
    max_outstanding_batches: int = setting(2, "max_outstanding_batches",
        "Batches sent to one worker and not finished (one running, one waiting); beyond it the batcher keeps accumulating.")
    torch_threads: int = setting(1, "torch_threads",
        "CPU threads torch runs one worker's operators on (torch.set_num_threads), for the hf-* backends. 1, as vLLM sets for its workers: the model runs on the worker's own device, and the host's cores are shared by the other workers, the API and the batcher. torch's default (one spinning thread per core) made a tiny model's batch of 100 take 28 s instead of 1.3 s on a 2-core host with one other busy process. Raise it for a CPU-only host that runs one worker. It takes precedence over OMP_NUM_THREADS; 0: torch's own choice (OMP_NUM_THREADS if set, else a thread per core).")
    restart_hold_s: float = setting(60.0, "restart_hold_s",
        "A worker stopped gracefully (SIGTERM: a rollout, a restart) is counted as its model's for this long after it left, while no other worker of the model is live: the API admits that model's calls and they wait in the batcher for the replacement within their deadlines, instead of 404/503 while the model's only worker restarts. 0: off (calls are refused from the moment it left).")

    def __post_init__(self) -> None:
        if self.torch_threads < 0:
            raise ValueError(f"LLMB_TORCH_THREADS={self.torch_threads} is negative (0: torch's default)")

    @property
    def heartbeat_stale_s(self) -> float:
        """A worker whose last heartbeat is older than this has left the pool."""
        return self.heartbeat_interval_s * self.heartbeat_stale_factor


@dataclass(frozen=True)
class Jobs:
    """The Batch API: its files and the `llmb-jobs` runners."""
    files_dir: str = setting('var/files', "files_dir",
        "Batch API: folder holding uploaded input files and the output and error files of batch jobs (every API process and `llmb-jobs` must see the same folder: a shared volume across hosts).")
    max_file_bytes: int = setting(209_715_200, "max_file_bytes",
        "Batch API: largest file `POST /v1/files` takes (bigger: 413).")
    files_tenant_max_bytes: int = setting(10_737_418_240, "files_tenant_max_bytes",
        "Batch API: most bytes of files one tenant may hold (uploads and job outputs, until deleted or expired); an upload beyond it gets 403 quota_exceeded, and so does a new batch once it is reached (0: no limit).")
    files_tenant_max_count: int = setting(1000, "files_tenant_max_count",
        "Batch API: most files one tenant may hold; an upload beyond it gets 403 quota_exceeded, and so does a new batch once it is reached (0: no limit).")
    files_expire_s: int = setting(2_592_000, "files_expire_s",
        "Batch API: a file expires this many seconds after its creation unless its upload's `expires_after` (or its batch's `output_expires_after`) says otherwise (30 days, as OpenAI's batch files; 0: never); expired files are deleted by `llmb-jobs`.")
    files_cleanup_s: float = setting(60.0, "files_cleanup_s",
        "`llmb-jobs`: how often it deletes expired files (their bytes and rows), upload leftovers, and the lines of ended batches (at most 50,000 lines a pass).")
    max_lines: int = setting(50_000, "jobs_max_lines",
        "Batch API: most lines (requests) in one batch's input file.")
    tenant_max_active: int = setting(100, "jobs_tenant_max_active",
        "Batch API: most batches of one tenant not yet ended (validating, in progress, finalizing, cancelling); one more `POST /v1/batches` gets 403 quota_exceeded (0: no limit).")
    tenant_max_lines: int = setting(1_000_000, "jobs_tenant_max_lines",
        "Batch API: most lines (rows of `batch_lines` in the database) one tenant's batches may hold: those of batches not yet ended and of completed ones until their expiry (the lines of a batch cancelled, failed or expired are deleted when it ends). A batch that would take its tenant over fails validation with `too_many_lines`; at the bound, `POST /v1/batches` gets 403 quota_exceeded (0: no limit).")
    poll_s: float = setting(1.0, "jobs_poll_s",
        "`llmb-jobs`: how often it looks in the database for batch jobs to run, and renews the leases of those it runs.")
    lease_s: float = setting(30.0, "jobs_lease_s",
        "`llmb-jobs`: a job's lease; a process that stops renewing it (killed, cut off) loses the job this long after its last renewal, and another process (or its restart) takes it over.")
    max_active: int = setting(8, "jobs_max_active",
        "`llmb-jobs`: batch jobs one process runs at once (the others wait their turn).")
    initial_in_flight: int = setting(100, "jobs_initial_in_flight",
        "`llmb-jobs`: lines of a job in flight at its start (one full batch); the number grows while lines are admitted and answered promptly (within 3 times the fastest answer) and halves on 429.")
    max_in_flight: int = setting(1000, "jobs_max_in_flight",
        "`llmb-jobs`: most lines of one tenant's jobs in flight at once, per process.")
    line_timeout_ms: int = setting(120_000, "jobs_line_timeout_ms",
        "`llmb-jobs`: deadline of each batch line that gives no timeout_ms (offline: at most LLMB_OFFLINE_MAX_TIMEOUT_MS); a line past it is sent again, as a new run. It also bounds how long a line sent again after a crash waits for its first run.")
    nice: int = setting(10, "jobs_nice",
        "`llmb-jobs`: the niceness it runs at (Unix `nice`, 0-19): where it shares CPUs with API processes, their callers go first, as interactive items do in every batch.")

    def __post_init__(self) -> None:
        """The files folder made absolute once, against the working directory the process started in: a relative
        path read later would resolve against whatever folder the reader assumes (Flask's send_file takes it from
        the app's package folder, so a download of a file written to ``var/files`` failed)."""
        object.__setattr__(self, "files_dir", absolute_path(self.files_dir))


@dataclass(frozen=True)
class Sim:
    """The simulated backends (`sim`, `sim-lm`): timings and faults to inject, for tests and benchmarks."""
    batch_ms: float = setting(250.0, "sim_batch_ms",
        "sim backend: fixed time per batch.")
    item_ms: float = setting(0.0, "sim_item_ms",
        "sim backend: extra time per item in the batch.")
    max_batch: int = setting(100, "sim_max_batch",
        "sim backend: most items the simulated device takes at once.")
    raise_on: str = setting('', "sim_raise_on",
        "sim backend: a batch holding an input that contains this text raises (poison tests; empty: off).")
    kill_on: str = setting('', "sim_kill_on",
        "sim backend: a batch holding an input that contains this text kills the worker process (empty: off).")
    lm_mode: SimLmMode = setting(SimLmMode.CONTINUOUS, "sim_lm_mode",
        "sim-lm backend (a simulated generative device; defaults: Llama-2-7B fp16 on one A100 80GB): 'continuous' (one engine steps every running sequence; requests join and leave at every step under the KV budget) or 'static' (a batch holds the device until its longest member is done).")
    lm_speed: float = setting(1.0, "sim_lm_speed",
        "sim-lm: how many times faster than the modelled device it runs (every simulated time is divided by this; for tests).")
    lm_step_ms: float = setting(11.0, "sim_lm_step_ms",
        "sim-lm: fixed time of one decoding step (11.0: fitted to NVIDIA's published Llama-2-7B A100 latencies).")
    lm_step_ms_per_seq: float = setting(0.106, "sim_lm_step_ms_per_seq",
        "sim-lm: extra time of a decoding step per sequence in it.")
    lm_prefill_ms_per_token: float = setting(0.09, "sim_lm_prefill_ms_per_token",
        "sim-lm: time per prompt token prefilled (0.09: about 11,000 tokens/s).")
    lm_kv_tokens: int = setting(121_744, "sim_lm_kv_tokens",
        "sim-lm: KV-cache capacity in tokens, the budget the worker advertises (121744: 90% of 80 GiB less the weights, at 512 KiB a token).")
    lm_page_size: int = setting(16, "sim_lm_page_size",
        "sim-lm: tokens per KV-cache page; a sequence holds ceil((prompt + generated) / page size) pages.")
    lm_prefix_sharing: bool = setting(True, "sim_lm_prefix_sharing",
        "sim-lm: sequences whose prompts start with the same whole pages hold (and prefill) those pages once.")
    lm_max_seqs: int = setting(256, "sim_lm_max_seqs",
        "sim-lm: most sequences in one decoding step (and in one static batch).")
    lm_slots: int = setting(4, "sim_lm_slots",
        "sim-lm continuous mode: batches a worker runs at once (their requests share the decode batch).")
    lm_max_context: int = setting(4096, "sim_lm_max_context",
        "sim-lm: most tokens per request (prompt + max_tokens).")
    lm_adapter_step_share: float = setting(0.25, "sim_lm_adapter_step_share",
        "sim-lm: extra time of a decoding step holding LoRA adapters, as a share of the base step, for a rank-64 adapter (0.25: vLLM's one rank-64 adapter on Llama-7B, 25% slower; half of it scales with the largest rank in the step).")
    lm_adapter_extra_share: float = setting(0.02, "sim_lm_adapter_extra_share",
        "sim-lm: extra time of a decoding step per further distinct adapter in it, as a share of the base step (Punica/S-LoRA: the cost grows slowly with distinct adapters).")
    lm_adapter_load_ms: float = setting(5.0, "sim_lm_adapter_load_ms",
        "sim-lm: fixed time of loading an adapter onto the device (on top of its bytes over sim_lm_adapter_load_gb_per_s).")
    lm_adapter_load_gb_per_s: float = setting(25.0, "sim_lm_adapter_load_gb_per_s",
        "sim-lm: host-to-device copy rate of an adapter's weights, GB/s (25: PCIe 4.0 x16 from pinned host memory).")
    lm_adapter_rank: int = setting(16, "sim_lm_adapter_rank",
        "sim-lm: an adapter's rank when its adapter_config.json cannot be read (its size: rank x q_proj and v_proj of Llama-2-7B).")
    lm_eos_mean: float = setting(128.0, "sim_lm_eos_mean",
        "sim-lm: mean output length: each answer ends at an EOS position drawn from a hash of its prompt (geometric, a constant chance per step), capped by max_tokens; 0: every answer runs to its max_tokens.")


@dataclass(frozen=True)
class Process:
    """Every process: its logs, and (for tests) its clock."""
    log_level: str = setting('INFO', "log_level",
        "Log level of every process.")
    log_json: bool = setting(False, "log_json",
        "Log one JSON object per line instead of plain text.")
    clock_skew_s: float = setting(0.0, "clock_skew_s",
        "For tests only: shifts this process's own clock by this many seconds, to show that hosts whose clocks disagree still agree on deadlines and heartbeats (every process reads time corrected to Redis's clock).")
