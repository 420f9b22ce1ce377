"""An in-process client with the `openai.AsyncOpenAI` calls an agent uses, skipping HTTP.

`InProcessClient(service, session).chat.completions.create(**kwargs)` (and `.completions.create`)
takes the SDK's keyword arguments and returns the SDK's response objects (`ChatCompletion`,
`Completion`) when the `openai` package is installed, the plain response dicts otherwise. A bad
request raises `openai.BadRequestError` (or `RequestError` without the SDK), as over HTTP.
"""

from __future__ import annotations

from typing import Any

from areal_jax.agents.chat import ChatService
from areal_jax.agents.requests import RequestError
from areal_jax.agents.session import Session

__all__ = ["InProcessClient"]


def _sdk_error(exc: RequestError) -> Exception:
    try:
        import httpx
        import openai
    except ImportError:
        return exc
    response = httpx.Response(exc.status, json=exc.body(), request=httpx.Request("POST", "http://inprocess/v1"))
    kinds = {400: openai.BadRequestError, 401: openai.AuthenticationError, 404: openai.NotFoundError}
    kind = kinds.get(exc.status, openai.InternalServerError)
    return kind(str(exc), response=response, body=exc.body()["error"])


def _sdk_object(body: dict[str, Any], kind: str) -> Any:
    try:
        from openai.types import Completion
        from openai.types.chat import ChatCompletion
    except ImportError:
        return body
    return (ChatCompletion if kind == "chat" else Completion).model_validate(body)


def _plain(value: Any) -> Any:
    """SDK objects an agent passes back (e.g. a reply's message) as the JSON the SDK would send."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class _Create:
    def __init__(self, call, kind: str) -> None:
        self._call, self._kind = call, kind

    async def create(self, **kwargs: Any) -> Any:
        body = _plain({k: v for k, v in kwargs.items() if k not in ("extra_headers", "extra_query", "timeout")})
        body.update(body.pop("extra_body", None) or {})
        try:
            return _sdk_object(await self._call(body), self._kind)
        except RequestError as exc:
            raise _sdk_error(exc) from None


class _Chat:
    def __init__(self, completions: _Create) -> None:
        self.completions = completions


class InProcessClient:
    """`chat.completions.create` and `completions.create` for one session, without a server."""

    def __init__(self, service: ChatService, session: Session) -> None:
        self.session = session
        self.chat = _Chat(_Create(lambda body: service.chat(session, body), "chat"))
        self.completions = _Create(lambda body: service.complete(session, body), "text")
        self.api_key = session.id
