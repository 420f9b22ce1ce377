"""The OpenAI-compatible HTTP endpoint on localhost (aiohttp), on a thread of its own.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models. The session a request
belongs to is its API key (`Authorization: Bearer <session id>`): an agent's client is
`openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.id)`. Errors are OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (naming the field), 401
for an unknown session, 503 when the engine aborted the generation, 500 only for a bug here.

The server runs its own event loop on a daemon thread, so an agent may call it from any loop or
thread; `start()` returns once it listens, `stop()` once the port is released.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

from areal_jax.agents.chat import ChatService
from areal_jax.agents.requests import RequestError
from areal_jax.agents.session import SessionRegistry

__all__ = ["Endpoint"]

logger = logging.getLogger(__name__)


class Endpoint:
    """`service` (a ChatService) over HTTP for the sessions in `sessions`, on host:port (port 0:
    a free one, see `base_url` after `start`)."""

    def __init__(self, service: ChatService, sessions: SessionRegistry, *, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.service, self.sessions = service, sessions
        self.host, self.port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> None:
        if self._thread is not None:
            raise RuntimeError("the agent endpoint is already started")
        try:  # here, not on the server thread, where a missing package would only show as a timeout
            import aiohttp  # noqa: F401
        except ImportError as err:
            raise ImportError("the agent endpoint needs the `aiohttp` package: pip install 'areal-jax[agents]' "
                              "(or use agents.inprocess.InProcessClient, which needs no server)") from err
        self._thread = threading.Thread(target=self._main, name="agent-endpoint", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the agent endpoint did not start within {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"the agent endpoint failed to start: {self._error}") from self._error

    def stop(self, timeout_s: float = 30.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        self._loop = self._thread = None

    # ---- the server thread ----------------------------------------------------------------------

    def _main(self) -> None:
        from aiohttp import web  # the [agents] extra

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            app = web.Application(client_max_size=64 * 2**20)
            app.router.add_post("/v1/chat/completions", self._handler(self.service.chat))
            app.router.add_post("/v1/completions", self._handler(self.service.complete))
            app.router.add_get("/v1/models", self._models)
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # the port bound when 0 was asked
            self._loop = loop
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _handler(self, call):
        from aiohttp import web

        async def handle(request: web.Request) -> web.Response:
            try:
                session = self.sessions.get(_api_key(request))
                if session is None:
                    raise RequestError("no open agent session has this API key", status=401, code="invalid_api_key")
                try:
                    body = await request.json()
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise RequestError(f"the request body is not valid JSON: {exc}") from None
                return web.json_response(await call(session, body))
            except RequestError as exc:
                return web.json_response(exc.body(), status=exc.status)
            except Exception as exc:  # noqa: BLE001 - a bug here; the agent sees a server error
                logger.exception("agent endpoint: %s failed", request.path)
                return web.json_response({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error",
                                                    "param": None, "code": None}}, status=500)

        return handle

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.service.model_name, "object": "model",
                                                              "owned_by": "areal_jax"}]})


def _api_key(request: Any) -> str:
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth.startswith("Bearer ") else ""
