"""Reading an upload (``POST /v1/files``): a multipart body streamed straight into the file store's folder.

The same bounds as every other body, applied as it arrives: the whole of it within ``LLMB_BODY_TIMEOUT_S`` of its
headers (:func:`webapp.body.time_limited`, the one body deadline), the file at most ``LLMB_MAX_FILE_BYTES``
(413 naming that setting), the tenant's quota (:meth:`tasks.store.files.FileStore.receive`), a full disk a 507.
Werkzeug's own form parsing (``request.files``) would spool the file to the system's temporary folder first (a
second copy, on a disk nobody sized for it), read it with no deadline, and refuse a large one with the app's
413 for JSON bodies (naming the 1 MiB ``LLMB_MAX_BODY_BYTES``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, cast

from flask import request
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.formparser import FormDataParser

from tasks.config import Settings
from tasks.errors import BatchingError, InvalidInput, PayloadTooLarge
from tasks.store.files import FileStore, Sink, file_too_large
from webapp.body import time_limited

FORM_OVERHEAD_BYTES = 64 * 1024  # a multipart body's room besides its file: boundaries, part headers, fields
MAX_FIELD_BYTES = 1024 * 1024  # above the parser's read buffer (64 KiB), which werkzeug also counts against it
MAX_PARTS = 16
HOW = "send multipart/form-data with a 'file' part and purpose=batch (as the openai client's files.create does)"


@dataclass
class Upload:
    """What an upload's body held: its text fields (the first value of each) and its one file, received."""

    fields: dict[str, str] = field(default_factory=dict)
    sink: Sink | None = None
    filename: str | None = None

    def discard(self) -> None:
        if self.sink is not None:
            self.sink.discard()


class _Timed:
    """The request stream, its deadline checked after every read and its bytes counted."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.check: Callable[[], None] = lambda: None
        self.read_bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.read_bytes += len(data)
        self.check()
        return data


def read_upload(store: FileStore, tenant: str, settings: Settings, started: float) -> Upload:
    """The upload's fields and file (its bytes in a :class:`Sink` of ``store``, not yet named: commit or discard
    it). Nothing of it is kept when this raises."""
    if request.mimetype != "multipart/form-data":
        raise InvalidInput(f"the body is {request.mimetype or 'missing'}; {HOW}")
    limit = settings.jobs.max_file_bytes
    length = request.content_length
    if length is not None and length > limit + FORM_OVERHEAD_BYTES:
        raise PayloadTooLarge(f"{file_too_large(limit).message} (Content-Length: {length})")
    upload = Upload()

    def sink_for(total_content_length: int | None, content_type: str | None, filename: str | None,
                 content_length: int | None = None) -> IO[bytes]:
        if upload.sink is not None:
            raise InvalidInput(f"the upload holds more than one file; {HOW}")
        upload.sink, upload.filename = store.receive(tenant, limit), filename
        return cast(IO[bytes], upload.sink)

    request.max_content_length = limit + FORM_OVERHEAD_BYTES  # werkzeug's own bound on the stream, above ours
    parser = FormDataParser(stream_factory=sink_for, max_form_memory_size=MAX_FIELD_BYTES,
                            max_form_parts=MAX_PARTS, silent=False)
    stream = _Timed(request.stream)
    try:
        with time_limited(settings.admission.body_timeout_s, started) as stream.check:
            _, form, _ = parser.parse(cast(IO[bytes], stream), request.mimetype, length, request.mimetype_params)
    except BatchingError:
        upload.discard()
        raise
    except RequestEntityTooLarge:
        upload.discard()
        if stream.read_bytes > limit:
            raise file_too_large(limit) from None
        raise PayloadTooLarge(f"a form field of the upload is larger than {MAX_FIELD_BYTES} bytes, or it has "
                              f"more than {MAX_PARTS} parts; {HOW}") from None
    except ValueError as exc:  # malformed multipart
        upload.discard()
        raise InvalidInput(f"the body is not valid multipart/form-data ({exc}); {HOW}") from None
    except BaseException:
        upload.discard()
        raise
    upload.fields = {k: form[k] for k in form if k}  # a part with no name (werkzeug keys it None) names nothing
    return upload
