"""A local Google Cloud Storage for tests: ``gcp-storage-emulator`` (PyPI), started in this process.

Two things the emulator leaves out and TensorStore (orbax's array writer) relies on are added around
its handlers here, as GCS documents them: the object's generation in an ``x-goog-generation`` header
on reads, and the ``ifGenerationMatch`` / ``ifGenerationNotMatch`` preconditions (412 / 304), checked
and applied under one lock so that a conditional write is atomic — OCDBT's manifest depends on it.

``emulated_gcs(bucket)`` points gcsfs (``STORAGE_EMULATOR_HOST``) and TensorStore
(``TENSORSTORE_GCS_HTTP_URL``, ``GOOGLE_AUTH_TOKEN_FOR_TESTING``) at the server for the block. Both
libraries read those once per process (TensorStore) or per cached filesystem (gcsfs): use one
emulator per test process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from http import HTTPStatus
from typing import Iterator

_LOCK = threading.Lock()
_PATCHED = False
# what the emulator served: per object name {"gets": reads of its content, "bytes": content bytes sent},
# and "requests": every request it answered; a test clears it and checks a load fetched what it needed
SERVED: dict = {}


def _object_name(request):
    name = request.params.get("object_id")
    if name is None and request.query.get("name"):
        name = request.query["name"][0]
    return name


def _generation(storage, bucket: str, name: str) -> str:
    from gcp_storage_emulator.exceptions import NotFound

    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return "0"  # GCS: ifGenerationMatch=0 means "the object does not exist"


def _conditional(handler, method: str):
    def wrapped(request, response, storage, *args, **kwargs):
        bucket, name = request.params.get("bucket_name"), _object_name(request)
        with _LOCK:
            SERVED["requests"] = SERVED.get("requests", 0) + 1
            if bucket and name:
                gen = _generation(storage, bucket, name)
                match = request.query.get("ifGenerationMatch")
                not_match = request.query.get("ifGenerationNotMatch")
                if match and match[0] != gen:
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    return None
                if not_match and not_match[0] == gen:
                    response.status = HTTPStatus.NOT_MODIFIED if method == "GET" else HTTPStatus.PRECONDITION_FAILED
                    return None
            out = handler(request, response, storage, *args, **kwargs)
            if method == "GET" and name and request.query.get("alt") == ["media"]:
                served = SERVED.setdefault(name, {"gets": 0, "bytes": 0})
                served["gets"] += 1
                served["bytes"] += len(response._content or b"")
            if method == "GET" and bucket and name and response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
                gen = _generation(storage, bucket, name)
                if gen != "0":
                    response["x-goog-generation"] = gen
                    response["x-goog-metageneration"] = "1"
            return out

    return wrapped


def _patch_handlers() -> None:
    global _PATCHED
    if _PATCHED:
        return
    from gcp_storage_emulator import server

    for _, handlers in server.HANDLERS:
        for method, fn in list(handlers.items()):
            handlers[method] = _conditional(fn, method)
    _PATCHED = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def emulated_gcs(bucket: str = "confu-test") -> Iterator[str]:
    """A running emulator holding an empty ``bucket``; yields ``gs://<bucket>``."""
    from gcp_storage_emulator.server import create_server

    _patch_handlers()
    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                                            "GOOGLE_AUTH_TOKEN_FOR_TESTING")}
    os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator")
    # gcsfs asks the metadata server for credentials and the bucket's type; the emulator needs neither
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    try:
        yield f"gs://{bucket}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
