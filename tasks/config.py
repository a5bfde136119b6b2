"""All configuration in one place.

Every setting is an environment variable prefixed ``LLMB_`` with a documented default (:data:`DOCS`; the table in
docs/configuration.md is printed from it by ``python -m tasks.config``, and a test keeps it current). Settings are loaded once per process with
:meth:`Settings.from_env` and passed down through constructors: nothing else reads the environment.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

PREFIX = "LLMB_"


@dataclass(frozen=True)
class Settings:
    broker_url: str = "amqp://guest:guest@127.0.0.1:5672//"
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "llmb"
    queue_type: str = "classic"
    broker_heartbeat_s: float = 1.0
    database_url: str = "sqlite:///var/llmb.db"
    default_model: str = "sim"
    served_name: str = ""
    max_tokens_cap: int = 1024
    device_price_per_hour: float = 2.0
    hf_mode: str = "static"
    cb_slots: int = 4
    cb_num_blocks: int = 256
    cb_page_size: int = 32
    cb_max_requests: int = 64
    cb_max_batch_tokens: int = 512

    max_batch_size: int = 100
    max_batch_bytes: int = 16_777_216
    max_wait_ms: float = 20.0
    wait_mode: str = "adaptive"
    min_wait_ms: float = 1.0
    adaptive_max_wait_ms: float = 50.0
    offline_max_wait_ms: float = 500.0
    batcher_prefetch: int = 10000

    auth: str = "keys"
    auth_cache_s: float = 5.0
    tenant_weight: float = 1.0
    tenant_max_in_flight: int = 5000
    tenant_priority: str = "interactive"
    fair_quantum: int = 10
    offline_max_timeout_ms: int = 3_600_000
    scale_headroom: float = 1.25
    kv_admission_factor: float = 4.0

    admission_cap: int = 10000
    offline_admission_cap: int = 10000
    api_lease_s: float = 5.0
    max_inputs_per_call: int = 100
    max_body_bytes: int = 1_048_576
    body_timeout_s: float = 10.0
    door_max_delay_ms: float = 2500.0
    door_standing_delay_ms: float = 1000.0
    door_standing_after_ms: float = 2000.0
    admit_concurrency: int = 32
    default_timeout_ms: int = 30_000
    max_timeout_ms: int = 300_000
    retry_after_s: int = 1
    result_ttl_s: int = 300
    result_recheck_ms: float = 3000.0
    redis_pool_size: int = 50
    broker_pool_size: int = 10
    publish_timeout_s: float = 5.0
    persistent_requests: bool = True

    web_bind: str = "127.0.0.1:8000"
    web_workers: int = 2
    web_connections: int = 0
    keepalive_s: float = 75.0
    header_timeout_s: float = 10.0

    heartbeat_interval_s: float = 1.0
    heartbeat_stale_factor: float = 3.0
    max_outstanding_batches: int = 2
    max_retries: int = 3
    store_inputs: bool = False
    ledger_buffer: int = 10_000
    dispatch_lead_ms: float = 15.0

    files_dir: str = "var/files"
    max_file_bytes: int = 209_715_200
    files_tenant_max_bytes: int = 10_737_418_240
    files_tenant_max_count: int = 1000
    files_expire_s: int = 2_592_000
    files_cleanup_s: float = 60.0
    jobs_max_lines: int = 50_000
    jobs_poll_s: float = 1.0
    jobs_lease_s: float = 30.0
    jobs_max_active: int = 8
    jobs_initial_in_flight: int = 100
    jobs_max_in_flight: int = 1000
    jobs_line_timeout_ms: int = 120_000
    jobs_nice: int = 10

    sim_batch_ms: float = 250.0
    sim_item_ms: float = 0.0
    sim_max_batch: int = 100
    sim_raise_on: str = ""
    sim_kill_on: str = ""
    sim_lm_mode: str = "continuous"
    sim_lm_speed: float = 1.0
    sim_lm_step_ms: float = 11.0
    sim_lm_step_ms_per_seq: float = 0.106
    sim_lm_prefill_ms_per_token: float = 0.09
    sim_lm_kv_tokens: int = 121_744
    sim_lm_page_size: int = 16
    sim_lm_prefix_sharing: bool = True
    sim_lm_max_seqs: int = 256
    sim_lm_slots: int = 4
    sim_lm_max_context: int = 4096
    sim_lm_eos_mean: float = 128.0

    log_level: str = "INFO"
    log_json: bool = False
    clock_skew_s: float = 0.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 overrides: Mapping[str, object] | None = None) -> "Settings":
        """Build settings from ``LLMB_*`` variables; ``overrides`` (by field name) win over the environment."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(PREFIX + f.name.upper())
            if raw is None:
                continue
            kind: type = type(f.default)
            try:
                values[f.name] = kind(raw) if kind is not bool else raw.lower() in ("1", "true", "yes")
            except ValueError:
                raise ValueError(f"{PREFIX}{f.name.upper()}={raw!r} is not a valid {kind.__name__}") from None
        values.update(overrides or {})
        return cls(**values)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        """Every path setting made absolute once, against the working directory the process started in: a
        relative path read later would resolve against whatever folder the reader assumes (Flask's send_file
        takes it from the app's package folder, so a download of a file written to ``var/files`` failed)."""
        object.__setattr__(self, "files_dir", absolute_path(self.files_dir))
        object.__setattr__(self, "database_url", absolute_sqlite_url(self.database_url))

    # Broker names derived from the namespace, so every component agrees on them (Redis keys: tasks.state.keys).
    @property
    def request_queue(self) -> str:
        return f"{self.namespace}.requests"

    @property
    def recovery_queue(self) -> str:
        return f"{self.namespace}.recovery"

    @property
    def batcher_queue(self) -> str:
        """Celery's own queue for the batcher worker (control only: requests arrive on request_queue)."""
        return f"{self.namespace}.batcher"

    @property
    def heartbeat_stale_s(self) -> float:
        """A worker whose last heartbeat is older than this has left the pool."""
        return self.heartbeat_interval_s * self.heartbeat_stale_factor

    def gpu_queue(self, host: str, device: int | str) -> str:
        return f"{self.namespace}.gpu.{host}.{device}"


def absolute_path(path: str) -> str:
    """``path`` made absolute against the current working directory (``~`` expanded); empty stays empty."""
    return os.path.abspath(os.path.expanduser(path)) if path else path


def absolute_sqlite_url(url: str) -> str:
    """A SQLite URL whose file is named relative (``sqlite:///var/llmb.db``) made absolute
    (``sqlite:////abs/var/llmb.db``); in-memory databases and other databases' URLs are left as they are."""
    scheme, sep, rest = url.partition(":///")
    if not sep or not scheme.split("+")[0] == "sqlite":
        return url
    path, query_sep, query = rest.partition("?")
    if not path or path == ":memory:" or path.startswith(("/", "file:")):
        return url
    return f"{scheme}:///{absolute_path(path)}{query_sep}{query}"


def documented_settings() -> list[tuple[str, object, str]]:
    """(variable, default, doc) for every setting: the source of docs/configuration.md's table."""
    return [(PREFIX + f.name.upper(), f.default, DOCS[f.name]) for f in fields(Settings)]


DOCS: dict[str, str] = {
    "broker_url": "RabbitMQ URL (kombu syntax).",
    "redis_url": "Redis URL for results, heartbeats and counters: `redis://`, `rediss://`, `unix://`, or `redis+sentinel://[[user]:[password]@]host[:port][,host[:port]...]/<service>[/<db>][?sentinel_password=...]` for the master that those Sentinels (port 26379 by default) name `<service>`, followed across failovers.",
    "queue_type": "RabbitMQ type of the request, recovery and GPU worker queues: 'classic' or 'quorum' (replicated across a RabbitMQ cluster; what production runs). An existing queue keeps its type: delete it (when empty) to switch.",
    "broker_heartbeat_s": "AMQP heartbeat of batchers and GPU workers: RabbitMQ closes the connection of a host it has not heard from for about this long, so a cut-off batcher's requests go to a standby and a cut-off worker's batches come back (0: off).",
    "namespace": "Prefix of every queue name and Redis key; lets several systems share one broker and Redis.",
    "database_url": "SQLAlchemy URL of the outcome ledger (SQLite file by default).",
    "default_model": "Model used when a request names none.",
    "served_name": "Name a GPU worker serves its model under (default: the hub id, or a local folder's name).",
    "max_tokens_cap": "Largest max_tokens a completion request may ask for.",
    "hf_mode": "hf-causal workers: 'static' (one padded generate() per batch; the default, measured faster on this CPU: see Real models) or 'continuous' (greedy requests join and leave the running batch at every step; sampled ones still run static).",
    "cb_slots": "Continuous mode: batches a worker runs at once (their requests share the decode batch).",
    "cb_num_blocks": "Continuous mode: KV-cache pages; pages x page size is the token budget the worker advertises.",
    "cb_page_size": "Continuous mode: tokens per KV-cache page.",
    "cb_max_requests": "Continuous mode: most requests in one decoding step.",
    "cb_max_batch_tokens": "Continuous mode: most tokens in one forward pass (prefill included).",
    "device_price_per_hour": "What one device costs per hour (any currency): `llmb-admin stats` turns it into a cost per million tokens.",
    "max_batch_size": "A batch is flushed as soon as it holds this many items.",
    "max_batch_bytes": "...or as soon as its inputs add up to this many bytes (a batch must fit in one RabbitMQ message).",
    "max_wait_ms": "...or when its first item has waited this long.",
    "wait_mode": "'adaptive' (the wait shrinks to min_wait_ms when batches fill on their own or no device is free, and stretches up to adaptive_max_wait_ms when a full batch is that close) or 'fixed' (always max_wait_ms).",
    "min_wait_ms": "Adaptive mode: the shortest wait (coalesces requests that arrive together).",
    "adaptive_max_wait_ms": "Adaptive mode: the longest wait, and never more than a fifth of the measured batch time.",
    "offline_max_wait_ms": "Offline requests' batches may wait this long to fill (throughput over latency).",
    "batcher_prefetch": "Request messages the batcher may hold unacknowledged (its buffer bound). Keep it at least the admission cap, so every admitted request is in a batcher's fair buffer rather than behind a flood in the FIFO queue.",
    "auth": "'keys': every inference call needs `Authorization: Bearer <key>` (keys from `llmb-admin keys create`); 'none': no authentication, the tenant comes from X-Tenant or the body (for local use only).",
    "auth_cache_s": "API processes cache key lookups this long: a revoked key stops working within this time.",
    "tenant_weight": "Weight of a tenant with no settings of its own (its share of batch slots when tenants compete).",
    "tenant_max_in_flight": "In-flight cap of a tenant with no settings of its own (items admitted, not yet answered); over it: 429.",
    "tenant_priority": "Priority class of a tenant with no settings of its own: 'interactive' or 'offline'.",
    "fair_quantum": "Items a tenant of weight 1 may put in a batch per round of weighted deficit round robin.",
    "offline_max_timeout_ms": "Largest timeout_ms an offline request may ask for.",
    "kv_admission_factor": "Generation models whose workers advertise a KV cache: tokens (prompt + max_tokens, estimated) admitted at once may be this many times the fleet's KV caches together (the rest waits for room); over it: 429.",
    "scale_headroom": "Recommended workers = arrival rate x batch time / batch size x this.",
    "offline_admission_cap": "Most offline items admitted and not yet answered, across all API processes (offline items do not count against LLMB_ADMISSION_CAP, so an offline backlog never closes the door to interactive callers).",
    "api_lease_s": "Each API process holds a lease in Redis for this long, renewed three times as often; when it lapses (the process died) the capacity its callers held is released within seconds instead of at their deadlines.",
    "admission_cap": "Most interactive items admitted and not yet answered, across all API processes (fewer when the fleet could not answer a new request within its deadline); over it: 429.",
    "max_inputs_per_call": "Largest 'inputs' list accepted by one call.",
    "max_body_bytes": "Largest request body; larger bodies get 413.",
    "door_max_delay_ms": "An inference request whose API process would get to it this long after its bytes arrived (the process is CPU-bound: a burst) is refused at once from its bytes with 429 overloaded, so that the excess is told fast and the work already admitted is still answered in time; also the longest a call waits for its turn at admission. Whether a request let in can still be answered within its own deadline is admission's call.",
    "door_standing_delay_ms": "The door's bound once its line has stood (a steady overload, not a burst): when requests have waited over half this for their process for LLMB_DOOR_STANDING_AFTER_MS, the bound drops from LLMB_DOOR_MAX_DELAY_MS to this, so that a steady excess is refused fast instead of after the long bound (CoDel's idea); it rises again once a request waits under half this.",
    "door_standing_after_ms": "How long the door's line must stand (every request waiting over half LLMB_DOOR_STANDING_DELAY_MS) before it counts as a steady overload rather than a transient burst.",
    "admit_concurrency": "Calls one API process takes through admission at once (its Redis round trips and the publish; a call gives its turn up before waiting for RabbitMQ's confirm); the rest wait their turn in arrival order for at most LLMB_DOOR_MAX_DELAY_MS, and the door refuses at once, before the body is read, a call that could not get its turn in time (429 overloaded, Retry-After the expected wait at the measured drain rate). 0: no limit.",
    "body_timeout_s": "A request body must arrive within this many seconds of its headers; slower ones get 408 and the connection is closed.",
    "default_timeout_ms": "Deadline of a request that gives no timeout_ms.",
    "max_timeout_ms": "Largest timeout_ms a caller may ask for.",
    "retry_after_s": "Smallest Retry-After (s) sent with 429; a refusal for room says when the work ahead will have drained at the measured rate.",
    "result_ttl_s": "How long a result key lives in Redis.",
    "result_recheck_ms": "A waiting request re-reads its keys this often even without a wake-up (a safety net: wake-ups lost to a Redis reconnect are re-read at once).",
    "redis_pool_size": "Redis connections per API process (shared by all waiting requests).",
    "broker_pool_size": "RabbitMQ connections per API process used for publishing.",
    "publish_timeout_s": "Longest wait for RabbitMQ to confirm a request (never past the caller's deadline); beyond it the caller gets 503 (e.g. during a broker memory or disk alarm).",
    "persistent_requests": "Write request messages to disk in RabbitMQ, so they outlive a broker restart; false saves ~0.25 ms of broker CPU per request.",
    "web_bind": "Address gunicorn listens on.",
    "web_workers": "gunicorn worker processes (each holds many waiting requests on gevent).",
    "keepalive_s": "How long an API process keeps an idle kept-alive connection open, waiting for its next request (nginx's default; longer than common clients' pool expiry: httpx 5 s, aiohttp 15 s, so a pooled client retires an idle connection before the server closes it).",
    "header_timeout_s": "A request's headers must all arrive within this many seconds of its first byte (slow-header protection); slower ones get 408 and the connection is closed.",
    "web_connections": "Simultaneous connections per gunicorn worker process; 0 (default): enough for the admission caps (interactive + offline) spread over the worker processes, plus room to refuse the excess fast.",
    "max_retries": "Times a request is sent again after its worker was lost before running it; then it fails (503).",
    "store_inputs": "Keep each input's text in the ledger (needed by `llmb-admin replay` and `requeue`).",
    "ledger_buffer": "Ledger records a process keeps while the database is unreachable; beyond that they are dropped and counted.",
    "dispatch_lead_ms": "A busy worker's next batch is sent this long before its running batch should end (until then it keeps filling); the starting value: each batcher learns each worker's lead from the hand-overs that came late.",
    "files_dir": "Batch API: folder holding uploaded input files and the output and error files of batch jobs (every API process and `llmb-jobs` must see the same folder: a shared volume across hosts).",
    "max_file_bytes": "Batch API: largest file `POST /v1/files` takes (bigger: 413).",
    "files_tenant_max_bytes": "Batch API: most bytes of files one tenant may hold (uploads and job outputs, until deleted or expired); an upload beyond it gets 403 quota_exceeded (0: no limit).",
    "files_tenant_max_count": "Batch API: most files one tenant may hold; an upload beyond it gets 403 quota_exceeded (0: no limit).",
    "files_expire_s": "Batch API: a file expires this many seconds after its creation unless its upload's `expires_after` (or its batch's `output_expires_after`) says otherwise (30 days, as OpenAI's batch files; 0: never); expired files are deleted by `llmb-jobs`.",
    "files_cleanup_s": "`llmb-jobs`: how often it deletes expired files (their bytes and rows) and upload leftovers.",
    "jobs_max_lines": "Batch API: most lines (requests) in one batch's input file.",
    "jobs_poll_s": "`llmb-jobs`: how often it looks in the database for batch jobs to run, and renews the leases of those it runs.",
    "jobs_lease_s": "`llmb-jobs`: a job's lease; a process that stops renewing it (killed, cut off) loses the job this long after its last renewal, and another process (or its restart) takes it over.",
    "jobs_max_active": "`llmb-jobs`: batch jobs one process runs at once (the others wait their turn).",
    "jobs_initial_in_flight": "`llmb-jobs`: lines of a job in flight at its start (one full batch); the number grows while lines are admitted and answered promptly (within 3 times the fastest answer) and halves on 429.",
    "jobs_max_in_flight": "`llmb-jobs`: most lines of one tenant's jobs in flight at once, per process.",
    "jobs_line_timeout_ms": "`llmb-jobs`: deadline of each batch line that gives no timeout_ms (offline: at most LLMB_OFFLINE_MAX_TIMEOUT_MS); a line past it is sent again, as a new run. It also bounds how long a line sent again after a crash waits for its first run.",
    "jobs_nice": "`llmb-jobs`: the niceness it runs at (Unix `nice`, 0-19): where it shares CPUs with API processes, their callers go first, as interactive items do in every batch.",
    "heartbeat_interval_s": "How often a GPU worker reports to Redis.",
    "heartbeat_stale_factor": "A worker silent for this many intervals leaves the pool.",
    "max_outstanding_batches": "Batches sent to one worker and not finished (one running, one waiting); beyond it the batcher keeps accumulating.",
    "sim_batch_ms": "sim backend: fixed time per batch.",
    "sim_item_ms": "sim backend: extra time per item in the batch.",
    "sim_max_batch": "sim backend: most items the simulated device takes at once.",
    "sim_raise_on": "sim backend: a batch holding an input that contains this text raises (poison tests; empty: off).",
    "sim_kill_on": "sim backend: a batch holding an input that contains this text kills the worker process (empty: off).",
    "sim_lm_mode": "sim-lm backend (a simulated generative device; defaults: Llama-2-7B fp16 on one A100 80GB): 'continuous' (one engine steps every running sequence; requests join and leave at every step under the KV budget) or 'static' (a batch holds the device until its longest member is done).",
    "sim_lm_speed": "sim-lm: how many times faster than the modelled device it runs (every simulated time is divided by this; for tests).",
    "sim_lm_step_ms": "sim-lm: fixed time of one decoding step (11.0: fitted to NVIDIA's published Llama-2-7B A100 latencies).",
    "sim_lm_step_ms_per_seq": "sim-lm: extra time of a decoding step per sequence in it.",
    "sim_lm_prefill_ms_per_token": "sim-lm: time per prompt token prefilled (0.09: about 11,000 tokens/s).",
    "sim_lm_kv_tokens": "sim-lm: KV-cache capacity in tokens, the budget the worker advertises (121744: 90% of 80 GiB less the weights, at 512 KiB a token).",
    "sim_lm_page_size": "sim-lm: tokens per KV-cache page; a sequence holds ceil((prompt + generated) / page size) pages.",
    "sim_lm_prefix_sharing": "sim-lm: sequences whose prompts start with the same whole pages hold (and prefill) those pages once.",
    "sim_lm_max_seqs": "sim-lm: most sequences in one decoding step (and in one static batch).",
    "sim_lm_slots": "sim-lm continuous mode: batches a worker runs at once (their requests share the decode batch).",
    "sim_lm_max_context": "sim-lm: most tokens per request (prompt + max_tokens).",
    "sim_lm_eos_mean": "sim-lm: mean output length: each answer ends at an EOS position drawn from a hash of its prompt (geometric, a constant chance per step), capped by max_tokens; 0: every answer runs to its max_tokens.",
    "log_level": "Log level of every process.",
    "log_json": "Log one JSON object per line instead of plain text.",
    "clock_skew_s": "For tests only: shifts this process's own clock by this many seconds, to show that hosts whose clocks disagree still agree on deadlines and heartbeats (every process reads time corrected to Redis's clock).",
}


if __name__ == "__main__":
    print("| Variable | Default | What it does |\n|---|---|---|")
    for name, default, doc in documented_settings():
        print(f"| `{name}` | `{default}` | {doc} |")
