"""The Batch API's uploads through real gunicorn, with the official openai client (``max_retries=0``) and raw
sockets: the file size limit named in its 413, the per-tenant quota, ``expires_after``, filenames no header can
hold, the body deadline, and a full disk (a real tmpfs) answered 507 with nothing left behind.

Only the API processes run: uploads never reach a worker.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests
from sqlalchemy.orm import Session

from harness.stack import Stack, running_stack
from tasks.store.models import FileRecord, make_engine

if os.environ.get("CI"):
    import openai
else:
    openai = pytest.importorskip("openai", reason="bin/test installs the test extra (the official openai client)")

MAX_FILE = 100_000
FORM = "multipart/form-data; boundary=B"


@pytest.fixture(scope="module")
def files_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("batch_files"))
    with running_stack(tmp, workers=(), batchers=0, web_workers=1, auth="keys", auth_cache_s=0.5,
                       files_dir=tmp / "files", max_file_bytes=MAX_FILE, files_tenant_max_count=3,
                       files_tenant_max_bytes=250_000, files_expire_s=86_400, body_timeout_s=1.5) as s:
        yield s


def key(stack: Stack, tenant: str) -> str:
    return stack.admin("keys", "create", tenant).stdout.strip()


def client(stack: Stack, tenant: str, url: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=(url or stack.url) + "/v1", api_key=key(stack, tenant), max_retries=0, timeout=30)


def leftovers(folder: Path) -> list[str]:
    """Files in the folder that no row names (temporary names included)."""
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def openai_error(response: requests.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text[:300]
    error: dict[str, object] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def test_a_file_over_the_limit_gets_413_naming_llmb_max_file_bytes(files_stack: Stack) -> None:
    c = client(files_stack, "big")
    with pytest.raises(openai.APIStatusError) as refused:
        c.files.create(file=("big.jsonl", b"x" * (MAX_FILE + 1)), purpose="batch")
    assert refused.value.status_code == 413
    message = refused.value.body["message"]  # type: ignore[index]
    assert f"LLMB_MAX_FILE_BYTES={MAX_FILE}" in message and "1048576" not in message, message
    # chunked, no Content-Length: counted as it arrives, the same answer
    body = (b"--B\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--B\r\nContent-Disposition: "
            b"form-data; name=\"file\"; filename=\"c.jsonl\"\r\n\r\n" + b"y" * (MAX_FILE + 10) + b"\r\n--B--\r\n")
    r = requests.post(files_stack.url + "/v1/files", data=iter([body[i:i + 8192] for i in range(0, len(body), 8192)]),
                      headers={"Authorization": f"Bearer {key(files_stack, 'big')}",
                               "Content-Type": "multipart/form-data; boundary=B"}, timeout=30)
    assert f"LLMB_MAX_FILE_BYTES={MAX_FILE}" in str(openai_error(r, 413)["message"])
    assert c.files.create(file=("ok.jsonl", b"x" * MAX_FILE), purpose="batch").bytes == MAX_FILE
    assert not [n for n in leftovers(files_stack.tmp / "files") if n.startswith(".upload-")]


def test_a_tenant_over_its_file_quota_is_refused_until_it_deletes(files_stack: Stack) -> None:
    c, other = client(files_stack, "quota"), client(files_stack, "quota-other")
    kept = [c.files.create(file=(f"{i}.jsonl", b"q" * 90_000), purpose="batch") for i in range(2)]
    with pytest.raises(openai.PermissionDeniedError) as over:
        c.files.create(file=("2.jsonl", b"q" * 90_000), purpose="batch")  # 270,000 bytes: over 250,000
    assert over.value.body["code"] == "quota_exceeded"  # type: ignore[index]
    assert "LLMB_FILES_TENANT_MAX_BYTES" in over.value.body["message"]  # type: ignore[index]
    c.files.create(file=("small.jsonl", b"q"), purpose="batch")
    with pytest.raises(openai.PermissionDeniedError, match="LLMB_FILES_TENANT_MAX_COUNT"):
        c.files.create(file=("one-more.jsonl", b"q"), purpose="batch")
    other.files.create(file=("theirs.jsonl", b"q" * 90_000), purpose="batch")  # its own quota
    c.files.delete(kept[0].id)
    assert c.files.create(file=("again.jsonl", b"q" * 90_000), purpose="batch").bytes == 90_000
    assert not [n for n in leftovers(files_stack.tmp / "files") if n.startswith(".upload-")]


def test_files_expire_as_expires_after_or_the_default_says(files_stack: Stack) -> None:
    c = client(files_stack, "expiry")
    default = c.files.create(file=("d.jsonl", b"{}\n"), purpose="batch")
    assert default.expires_at == default.created_at + 86_400
    hour = c.files.create(file=("h.jsonl", b"{}\n"), purpose="batch",
                          expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at == hour.created_at + 3600 and c.files.retrieve(hour.id).expires_at == hour.expires_at
    with pytest.raises(openai.BadRequestError, match="3600"):
        c.files.create(file=("x.jsonl", b"{}\n"), purpose="batch", expires_after={"anchor": "created_at",
                                                                                 "seconds": 60})
    # a file past its expiry (its row aged here) is gone for its tenant, before any clean-up ran
    with Session(make_engine(files_stack.database_url)) as s, s.begin():
        s.get(FileRecord, hour.id).expires_at = datetime.fromtimestamp(time.time() - 1, tz=UTC)  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        c.files.content(hour.id)
    assert hour.id not in {f.id for f in c.files.list()}


def multipart(filename_param: str, content: bytes = b'{"x": 1}\n') -> bytes:
    return (b"--B\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--B\r\nContent-Disposition: "
            b"form-data; name=\"file\"; " + filename_param.encode() + b"\r\n\r\n" + content + b"\r\n--B--\r\n")


def test_a_filename_with_control_characters_is_refused_and_a_stored_one_still_downloads(files_stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {key(files_stack, 'names')}", "Content-Type": FORM}
    for name in ("filename*=UTF-8''two%0D%0Alines.jsonl", "filename*=UTF-8''%1B%5B31mred.jsonl"):
        r = requests.post(files_stack.url + "/v1/files", data=multipart(name), headers=headers, timeout=30)
        assert "control character" in str(openai_error(r, 400)["message"])
    # a file kept before uploads were checked: its download is a 200 with a header-safe name, not a 500
    file_id = f"file-{uuid.uuid4().hex}"
    (files_stack.tmp / "files" / file_id).write_bytes(b"old\n")
    with Session(make_engine(files_stack.database_url)) as s, s.begin():
        s.add(FileRecord(id=file_id, tenant="names", purpose="batch", filename="evil\r\nSet-Cookie: x=1.jsonl",
                         bytes=4, created_at=datetime.now(UTC)))
    r = requests.get(f"{files_stack.url}/v1/files/{file_id}/content", headers=headers, timeout=30)
    assert r.status_code == 200 and r.content == b"old\n" and "Set-Cookie" not in r.headers
    assert "\r" not in r.headers["Content-Disposition"] and "evil__Set-Cookie" in r.headers["Content-Disposition"]


def test_an_upload_trickling_in_gets_408_within_llmb_body_timeout_s(files_stack: Stack) -> None:
    body = multipart('filename="slow.jsonl"', b"z" * 50_000)
    host, port = files_stack.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    started = time.monotonic()
    sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: multipart/"
                 b"form-data; boundary=B\r\nContent-Length: %d\r\n\r\n" % (key(files_stack, "slow").encode(),
                                                                          len(body)) + body[:20_000])
    got = b""
    try:
        while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < 10:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    except TimeoutError:
        pass
    finally:
        sock.close()
    waited = time.monotonic() - started
    assert got.startswith(b"HTTP/1.1 408"), (waited, got[:300])
    assert waited < 1.5 + 2.0, waited
    _head, _, payload = got.partition(b"\r\n\r\n")
    error = json.loads(payload[:payload.rindex(b"}") + 1])["error"]
    assert set(error) == {"message", "type", "param", "code"} and "LLMB_BODY_TIMEOUT_S" in error["message"]
    wait_empty = time.monotonic() + 5
    while time.monotonic() < wait_empty and [n for n in leftovers(files_stack.tmp / "files") if n.startswith(".")]:
        time.sleep(0.1)
    assert not [n for n in leftovers(files_stack.tmp / "files") if n.startswith(".upload-")], "no orphan bytes"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a disk that fills up for real (ENOSPC). The tests run as root in CI (network namespaces
    need it too); elsewhere, without the right to mount, this test is skipped."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs for the full-disk test: {done.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_a_full_disk_answers_507_in_openais_shape_and_keeps_no_bytes(files_stack: Stack, small_disk: Path) -> None:
    url = files_stack.start_web("web_small_disk", workers=1, files_dir=small_disk, max_file_bytes=1_000_000,
                                files_tenant_max_bytes=0)
    headers = {"Authorization": f"Bearer {key(files_stack, 'disk')}", "Content-Type": FORM}
    r = requests.post(url + "/v1/files", data=multipart('filename="big.jsonl"', b"d" * 400_000), headers=headers,
                      timeout=30)
    error = openai_error(r, 507)
    assert error["code"] == "insufficient_storage" and "no space left" in str(error["message"]), error
    assert leftovers(small_disk) == [], "the partial upload is removed"
    c = client(files_stack, "disk", url)
    small = c.files.create(file=("small.jsonl", b"{}\n" * 1000), purpose="batch")
    assert c.files.content(small.id).content == b"{}\n" * 1000 and leftovers(small_disk) == [small.id]
    files_stack.kill("web_small_disk")
