"""The Batch API, as OpenAI's: files (``/v1/files``) and batch jobs (``/v1/batches``) over them.

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files   GET /v1/files/ID   GET /v1/files/ID/content
    DELETE /v1/files/ID   POST /v1/batches   GET /v1/batches   GET /v1/batches/ID   POST /v1/batches/ID/cancel

Every file and batch belongs to the caller's tenant (its API key's; without keys the X-Tenant header's); another
tenant's is a 404. These routes only record and read: the jobs are run by ``llmb-jobs`` (:mod:`webapp.jobs`),
whose lines go through the same gateway as every other request, at offline priority. Errors are in OpenAI's shape.

Uploads are read by :mod:`webapp.uploads` (streamed into the file store under the body deadline, the file size
limit and the tenant's quota); files expire (``expires_after``, ``output_expires_after``, else
``LLMB_FILES_EXPIRE_S``) and are then not found. A tenant's batches not yet ended, and the lines they hold in the
database, are bounded (``LLMB_JOBS_TENANT_MAX_ACTIVE``, ``LLMB_JOBS_TENANT_MAX_LINES``: 403 ``quota_exceeded``).
"""
from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify, request, send_file
from sqlalchemy.exc import SQLAlchemyError

from tasks.errors import InvalidInput, NotFound, Unavailable
from tasks.policy.batchfile import COMPLETION_WINDOWS, ENDPOINTS, check_filename, download_name, expiry_s
from tasks.policy.tenancy import check_tenant_name
from tasks.store.files import FileStore
from tasks.store.jobs import FINAL, JobStore
from webapp import tenancy
from webapp.body import read_json
from webapp.errors import OPENAI, exception_response, register_error_handlers
from webapp.services import services
from webapp.uploads import read_upload

bp = Blueprint("batch", __name__)
register_error_handlers(bp, OPENAI)

MAX_PAGE = 100
STORES = "llmb.batch"  # app.extensions key of the stores


@bp.errorhandler(SQLAlchemyError)
def _database_down(exc: SQLAlchemyError) -> Response:
    return exception_response(Unavailable(f"the database is unreachable: {type(exc).__name__}"), OPENAI)


def _stores() -> tuple[FileStore, JobStore]:
    """This process's file and job stores, built at the first call (on the key store's engine: one pool)."""
    found = current_app.extensions.get(STORES)
    if found is None:
        s = services()
        found = current_app.extensions[STORES] = (FileStore.from_settings(s.settings, s.keys.engine, s.clock),
                                                  JobStore.from_settings(s.settings, s.keys.engine))
    return found


def _tenant() -> str:
    """The caller's tenant: its key's, or (without keys) the X-Tenant header's, ``default`` if none."""
    principal = g.get("principal")
    if principal is not None:
        return str(principal.tenant.name)
    return check_tenant_name(g.get("claimed_tenant") or "default")


def _page() -> tuple[int, str | None]:
    raw = request.args.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        raise InvalidInput(f"'limit' must be an integer from 1 to {MAX_PAGE}") from None
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"'limit' must be an integer from 1 to {MAX_PAGE}")
    return limit, request.args.get("after") or None


def _listing(data: list[dict[str, Any]], has_more: bool) -> Response:
    return jsonify(object="list", data=data, first_id=data[0]["id"] if data else None,
                   last_id=data[-1]["id"] if data else None, has_more=has_more)


# -- files --------------------------------------------------------------------------------------------------
@bp.post("/v1/files")
@tenancy.authenticated
def create_file() -> Response:
    tenant, store = _tenant(), _stores()[0]
    upload = read_upload(store, tenant, services().settings, g.started)
    try:
        purpose = upload.fields.get("purpose")
        if purpose != "batch":
            raise InvalidInput("'purpose' must be \"batch\" (the only kind of file this service takes)")
        if upload.sink is None:
            raise InvalidInput("the request needs a 'file' part (multipart/form-data)")
        expires = _expires_after(upload.fields)
        filename = check_filename(upload.filename or "upload.jsonl")
    except BaseException:
        upload.discard()
        raise
    return jsonify(store.commit(upload.sink, tenant, purpose, filename, expires).to_openai())


def _expires_after(fields: dict[str, str]) -> int | None:
    """``expires_after`` as the openai client sends it in a form (``expires_after[anchor]``,
    ``expires_after[seconds]``); None: the default expiry."""
    given = {k[len("expires_after["):-1]: v for k, v in fields.items() if k.startswith("expires_after[")}
    return expiry_s(given, "expires_after") if given or "expires_after" in fields else None


@bp.get("/v1/files")
@tenancy.authenticated
def list_files() -> Response:
    limit, after = _page()
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidInput("'order' must be 'asc' or 'desc'")
    found, more = _stores()[0].page(_tenant(), purpose=request.args.get("purpose"), limit=limit, after=after,
                                    newest_first=order == "desc")
    return _listing([f.to_openai() for f in found], more)


def _file(file_id: str) -> Any:
    info = _stores()[0].get(_tenant(), file_id)
    if info is None:
        raise NotFound(f"no file with id {file_id!r}")
    return info


@bp.get("/v1/files/<file_id>")
@tenancy.authenticated
def get_file(file_id: str) -> Response:
    return jsonify(_file(file_id).to_openai())


@bp.get("/v1/files/<file_id>/content")
@tenancy.authenticated
def file_content(file_id: str) -> Response:
    info = _file(file_id)
    try:  # an absolute path (the settings made it so): never resolved against the app's package folder
        return send_file(_stores()[0].path(info.id), mimetype="application/octet-stream", as_attachment=True,
                         download_name=download_name(info.filename), conditional=False, etag=False)
    except FileNotFoundError:  # its upload was cut off between its row and its bytes: gone for good
        raise NotFound(f"the content of file {file_id!r} is missing (its upload did not complete); upload it "
                       "again") from None


@bp.delete("/v1/files/<file_id>")
@tenancy.authenticated
def delete_file(file_id: str) -> Response:
    if not _stores()[0].delete(_tenant(), file_id):
        raise NotFound(f"no file with id {file_id!r}")
    return jsonify(id=file_id, object="file", deleted=True)


# -- batches ------------------------------------------------------------------------------------------------
@bp.post("/v1/batches")
@tenancy.authenticated
def create_batch() -> Response:
    body = read_json(services().settings)
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    endpoint, window, metadata = body.get("endpoint"), body.get("completion_window"), body.get("metadata")
    if endpoint not in ENDPOINTS:
        raise InvalidInput(f"'endpoint' must be one of {', '.join(ENDPOINTS)}")
    if not isinstance(window, str) or window not in COMPLETION_WINDOWS:  # {} is not hashable: not a 500
        raise InvalidInput(f"'completion_window' must be one of {', '.join(COMPLETION_WINDOWS)}")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
        raise InvalidInput("'metadata' must be an object of at most 16 string values (keys up to 64 characters, "
                           "values up to 512)")
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str):
        raise InvalidInput("'input_file_id' is required (the id `POST /v1/files` gave)")
    output_expires = (expiry_s(body["output_expires_after"], "output_expires_after")
                      if body.get("output_expires_after") is not None else None)
    info = _file(input_file_id)
    if info.purpose != "batch":
        raise InvalidInput(f"file {input_file_id!r} is not a batch input file (its purpose is {info.purpose!r})")
    _stores()[0].check_quota(_tenant())  # its output and error files will count against the files quota
    bounds = services().settings.jobs
    job = _stores()[1].create(_tenant(), endpoint, input_file_id, window, metadata, services().clock(),
                              output_expires, max_active=bounds.tenant_max_active, max_lines=bounds.tenant_max_lines)
    return jsonify(job.to_openai())


@bp.get("/v1/batches")
@tenancy.authenticated
def list_batches() -> Response:
    limit, after = _page()
    found, more = _stores()[1].page(_tenant(), limit=limit, after=after)
    return _listing([j.to_openai() for j in found], more)


@bp.get("/v1/batches/<batch_id>")
@tenancy.authenticated
def get_batch(batch_id: str) -> Response:
    job = _stores()[1].get(batch_id, _tenant())
    if job is None:
        raise NotFound(f"no batch with id {batch_id!r}")
    return jsonify(job.to_openai())


@bp.post("/v1/batches/<batch_id>/cancel")
@tenancy.authenticated
def cancel_batch(batch_id: str) -> Response:
    jobs = _stores()[1]
    job = jobs.cancel(batch_id, _tenant(), services().clock())
    if job is None:
        raise NotFound(f"no batch with id {batch_id!r}")
    if job.status in FINAL and job.status != "cancelled":
        raise InvalidInput(f"batch {batch_id!r} is {job.status}: it cannot be cancelled")
    return jsonify(job.to_openai())
