"""An in-memory Google Cloud Storage for tests: one store of objects seen by both ways a run
reaches gs://.

- fsspec (what etils.epath and tensorboard use for gs://, gcsfs in production): `FakeGCSFileSystem`,
  registered for the "gs" and "gcs" protocols. Like GCS, it has objects only: a directory exists
  while an object lies under it, and mkdir creates nothing.
- TensorStore's own GCS driver (what Orbax writes arrays with): `serve()` runs the subset of the
  GCS JSON API it calls (media download with ranges and generation preconditions, media upload,
  delete, list) over HTTP on localhost; TENSORSTORE_GCS_HTTP_URL points the driver at it.

- google-cloud-storage (Orbax asks it whether a bucket has a hierarchical namespace when it deletes
  old steps): pointed at the server by STORAGE_EMULATOR_HOST. gcsfs brings it in production
  (the `[gcs]` extra); where it is not installed, a stand-in module asks the server the same question.

Object generations are derived from the content (a checksum and the length), so an object
rewritten through fsspec changes generation as it would on GCS.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import types
import urllib.request
import urllib.parse
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fsspec.registry  # noqa: F401  (its _registry is patched)
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.utils import stringify_path


class FakeGCSFileSystem(MemoryFileSystem):
    """gcsfs's view of the fake bucket store: paths "bucket/key", no directories of their own."""

    protocol = ("gs", "gcs")
    root_marker = ""
    store: dict = {}  # "bucket/key" -> MemoryFile, shared with the HTTP side
    pseudo_dirs: list = []

    @classmethod
    def _strip_protocol(cls, path):
        path = stringify_path(path)
        for prefix in ("gs://", "gcs://"):
            path = path.removeprefix(prefix)
        return path.strip("/")

    def mkdir(self, path, create_parents=True, **kwargs):
        pass  # GCS has no directories

    def makedirs(self, path, exist_ok=False):
        pass

    def rmdir(self, path):
        pass  # a "directory" goes with its last object

    def rm(self, path, recursive=False, maxdepth=None):
        for p in self.expand_path(path, recursive=recursive, maxdepth=maxdepth):
            if p in self.store:
                del self.store[p]


def generation(data: bytes) -> int:
    return (zlib.crc32(data) | (len(data) << 32)) + 1


class _Handler(BaseHTTPRequestHandler):
    fs: FakeGCSFileSystem

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, code: int, body: bytes = b"", headers: dict | None = None,
               content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, obj) -> None:
        self._reply(code, json.dumps(obj).encode())

    def _parse(self):
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        parts = [urllib.parse.unquote(p) for p in url.path.split("/")]
        return url.path, parts, query

    def _meta(self, key: str, data: bytes) -> dict:
        bucket, name = key.split("/", 1)
        return {"kind": "storage#object", "bucket": bucket, "name": name, "size": str(len(data)),
                "generation": str(generation(data)), "metageneration": "1"}

    def _precondition_fails(self, query: dict, data: bytes | None) -> bool:
        current = 0 if data is None else generation(data)
        if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != current:
            return True
        return False

    def do_GET(self):
        path, parts, query = self._parse()
        # /storage/v1/b/<bucket>/o[/<object>]
        if len(parts) >= 6 and parts[1:4] == ["storage", "v1", "b"] and parts[5] == "o":
            bucket = parts[4]
            if len(parts) == 6 or (len(parts) == 7 and parts[6] == ""):
                return self._list(bucket, query)
            key = f"{bucket}/{'/'.join(parts[6:])}"
            data = self.fs.store[key].getvalue() if key in self.fs.store else None
            if data is None:
                return self._json(404, {"error": {"code": 404, "message": "No such object"}})
            if self._precondition_fails(query, data):
                return self._json(412, {"error": {"code": 412, "message": "precondition failed"}})
            gen = generation(data)
            if "ifGenerationNotMatch" in query and int(query["ifGenerationNotMatch"]) == gen:
                return self._reply(304, headers={"x-goog-generation": str(gen)})
            if query.get("alt") != "media":
                return self._json(200, self._meta(key, data))
            rng = self.headers.get("Range")
            headers = {"x-goog-generation": str(gen)}
            if rng and rng.startswith("bytes="):
                first, _, last = rng[len("bytes="):].partition("-")
                if first == "":  # suffix range: the last N bytes
                    start, end = max(len(data) - int(last), 0), len(data) - 1
                else:
                    start, end = int(first), (int(last) if last else len(data) - 1)
                if start >= len(data) and len(data) > 0:
                    return self._reply(416, headers=headers)
                end = min(end, len(data) - 1)
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                return self._reply(206, data[start:end + 1], headers, "application/octet-stream")
            return self._reply(200, data, headers, "application/octet-stream")
        if len(parts) == 5 and parts[1:4] == ["storage", "v1", "b"]:
            return self._json(200, {"kind": "storage#bucket", "name": parts[4]})
        return self._json(404, {"error": {"code": 404, "message": f"unsupported {path}"}})

    def _list(self, bucket: str, query: dict):
        prefix = f"{bucket}/{query.get('prefix', '')}"
        start, end = query.get("startOffset"), query.get("endOffset")
        items = []
        for key in sorted(self.fs.store):
            if not key.startswith(prefix):
                continue
            name = key.split("/", 1)[1]
            if (start is not None and name < start) or (end and name >= end):
                continue
            items.append(self._meta(key, self.fs.store[key].getvalue()))
        return self._json(200, {"kind": "storage#objects", "items": items})

    def do_POST(self):
        path, parts, query = self._parse()
        # /upload/storage/v1/b/<bucket>/o?uploadType=media&name=<object>
        if parts[1:5] == ["upload", "storage", "v1", "b"] and query.get("uploadType") == "media":
            length = int(self.headers.get("Content-Length", 0))
            body = self.rfile.read(length)
            key = f"{parts[5]}/{query['name']}"
            current = self.fs.store[key].getvalue() if key in self.fs.store else None
            if self._precondition_fails(query, current):
                return self._json(412, {"error": {"code": 412, "message": "precondition failed"}})
            self.fs.pipe_file(key, body)
            return self._json(200, self._meta(key, body))
        return self._json(404, {"error": {"code": 404, "message": f"unsupported POST {path}"}})

    def do_DELETE(self):
        path, parts, query = self._parse()
        if len(parts) >= 7 and parts[1:4] == ["storage", "v1", "b"] and parts[5] == "o":
            key = f"{parts[4]}/{'/'.join(parts[6:])}"
            if key not in self.fs.store:
                return self._json(404, {"error": {"code": 404, "message": "No such object"}})
            if self._precondition_fails(query, self.fs.store[key].getvalue()):
                return self._json(412, {"error": {"code": 412, "message": "precondition failed"}})
            del self.fs.store[key]
            return self._reply(204)
        return self._json(404, {"error": {"code": 404, "message": f"unsupported DELETE {path}"}})


@contextlib.contextmanager
def fake_gcs(monkeypatch) -> Iterator[FakeGCSFileSystem]:
    """Registers the fake for gs:// in fsspec and serves it to TensorStore; yields the filesystem
    (its `store` holds every object written, keyed "bucket/key")."""
    FakeGCSFileSystem.store.clear()
    FakeGCSFileSystem.clear_instance_cache()
    registry = sys.modules["fsspec.registry"]._registry  # undone on exit: later tests see no gs://
    for protocol in ("gs", "gcs"):
        monkeypatch.setitem(registry, protocol, FakeGCSFileSystem)
    fs = FakeGCSFileSystem()
    handler = type("Handler", (_Handler,), {"fs": fs})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "fake-token")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        import google.cloud.storage  # noqa: F401
    except ImportError:
        monkeypatch.setitem(sys.modules, "google.cloud.storage", _storage_stand_in())
    try:
        yield fs
    finally:
        server.shutdown()
        server.server_close()


def _storage_stand_in() -> types.ModuleType:
    """`google.cloud.storage` reduced to what Orbax calls: Client().get_bucket(name), read from the
    server named by STORAGE_EMULATOR_HOST."""

    class Bucket:
        def __init__(self, meta: dict):
            self.name = meta["name"]
            self.hierarchical_namespace_enabled = (meta.get("hierarchicalNamespace") or {}).get("enabled")

    class Client:
        def get_bucket(self, name: str) -> Bucket:
            url = f"{os.environ['STORAGE_EMULATOR_HOST']}/storage/v1/b/{urllib.parse.quote(name)}"
            with urllib.request.urlopen(url) as reply:
                return Bucket(json.loads(reply.read()))

    module = types.ModuleType("google.cloud.storage")
    module.Client = Client
    return module
