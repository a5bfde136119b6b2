"""What ties the operations of ``/openapi.json`` together: each operation's id, the links from what creates an
object to what reads it (Schemathesis's stateful phase follows them, so a file it uploads is then read, downloaded
and deleted), and the routes open without a key."""
from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

# what a created object's id opens: (method, path) -> {link: (method, path, parameter)}
LINKS = {
    ("post", "/v1/files"): {"GetFile": ("get", "/v1/files/{file_id}", "file_id"),
                            "GetFileContent": ("get", "/v1/files/{file_id}/content", "file_id"),
                            "DeleteFile": ("delete", "/v1/files/{file_id}", "file_id")},
    ("post", "/v1/batches"): {"GetBatch": ("get", "/v1/batches/{batch_id}", "batch_id"),
                              "CancelBatch": ("post", "/v1/batches/{batch_id}/cancel", "batch_id")},
    ("post", "/v1/infer"): {"GetRequest": ("get", "/v1/requests/{request_id}", "request_id")},
    ("post", "/v1/responses"): {"GetResponse": ("get", "/v1/responses/{response_id}", "response_id"),
                                "GetInputItems": ("get", "/v1/responses/{response_id}/input_items", "response_id"),
                                "DeleteResponse": ("delete", "/v1/responses/{response_id}", "response_id")},
    ("post", "/v1/admin/keys"): {"RevokeKey": ("delete", "/v1/admin/keys/{key_id}", "key_id")},
}


def operation_id(method: str, path: str) -> str:
    """``get /v1/files/{file_id}`` -> ``get_v1_files_file_id``: unique, and derived, so never out of step."""
    return "_".join([method, *(part.strip("{}").replace(".", "_") for part in path.split("/") if part)])


OPEN = {"/healthz", "/readyz", "/metrics", "/openapi.json"}  # answered without a key, whatever LLMB_AUTH says


def linked(paths: Schema) -> Schema:
    """Give every operation its id, and the operations that create an object the links to what reads it."""
    for path, operations in paths.items():
        for method, op in operations.items():
            op["operationId"] = operation_id(method, path)
            if path in OPEN:
                op["security"] = []
            links = LINKS.get((method, path))
            if links:
                ok = next(status for status in op["responses"] if status.startswith("2"))
                op["responses"][ok]["links"] = {
                    name: {"operationId": operation_id(m, p), "parameters": {param: "$response.body#/id"}}
                    for name, (m, p, param) in links.items()}
    return paths
