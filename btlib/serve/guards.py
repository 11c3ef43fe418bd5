"""What a request meets before a route: the Host check, the API key, the body limit; and the error shape they answer in.

Plain ASGI middleware (no task group per request, as Starlette's BaseHTTPMiddleware would add), importable without
fastapi: ``python -m btlib.serve`` checks its flags with :func:`check_api_key` before it imports the server.

    HostCheck    400 unless the request has one Host header (RFC 9112 3.2) naming this machine or an allowed name
                 (DNS rebinding)
    APIKey       401 unless ``Authorization: Bearer <key>`` (the scheme in any case; every route but /health)
    BodyLimit    413 for a body past the limit, before it is read (TEI: 2 MB)
"""

from __future__ import annotations

import ipaddress
import secrets
from typing import Sequence

__all__ = ["PAYLOAD_LIMIT", "LOOPBACK_HOSTS", "HTTPError", "TooLarge", "openai_path", "openai_type", "error_response",
           "check_api_key", "allowed_host_names", "APIKey", "BodyLimit", "HostCheck"]

PAYLOAD_LIMIT = 2_000_000  # bytes of a request body at most: TEI's --payload-limit default
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # the Host names a loopback server answers (any 127.x.y.z too)
# OpenAI's error types by status (its error-codes guide; the openai client's AuthenticationError, RateLimitError, ...):
# under /v1/ a client reads these, not TEI's kinds ("Validation", "overloaded", "payload_too_large", "not_found", ...)
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


class HTTPError(Exception):
    """An answer other than 200: its status, message, kind (TEI's error_type, OpenAI's type), headers and the
    request field it is about (OpenAI's ``param``), if one."""

    def __init__(self, status: int, message: str, kind: str, headers: dict | None = None, param: str | None = None):
        self.status, self.message, self.kind, self.headers, self.param = status, message, kind, headers, param


def openai_path(path: str) -> bool:
    """Whether ``path`` is in OpenAI's route family (its error shape): /v1/..., and TEI's /embeddings (OpenAI's body)."""
    return path.startswith("/v1/") or path == "/embeddings"


def openai_type(status: int) -> str:
    """OpenAI's error ``type`` for an answer's status: invalid_request_error for a 4xx that is the request's fault,
    server_error for a 5xx, OPENAI_TYPES' names for the others."""
    return OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_response(path: str, status: int, message: str, kind: str, headers: dict | None = None,
                   param: str | None = None) -> object:
    """The error in the shape of the route's API: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` under
    /v1/ and at /embeddings (type: :func:`openai_type`; param: the request field at fault, if one), TEI's
    ``{"error", "error_type"}`` (``kind``) elsewhere."""
    from starlette.responses import JSONResponse

    if openai_path(path):
        body = {"error": {"message": message, "type": openai_type(status), "param": param, "code": status}}
    else:
        body = {"error": message, "error_type": kind}
    return JSONResponse(body, status_code=status, headers=headers)


class APIKey:
    """ASGI middleware: every HTTP route but /health and ``GET /`` (TEI's health check there) answers 401 unless
    ``Authorization: Bearer <api_key>`` is sent; the scheme is case-insensitive (RFC 9110 11.1: ``bearer KEY`` is
    the same credential).

    A plain ASGI class, added only when a key is set: Starlette's BaseHTTPMiddleware (``@app.middleware("http")``)
    runs each request through a task group and memory streams, which cost a third of the server's CPU per small
    request even with no key to check (btlib.serve.remote's server_cpu_ms measures it per request).
    The credential's bytes are compared in constant time (secrets.compare_digest) with the key's UTF-8 bytes; the
    scheme is no secret.
    """

    def __init__(self, app, api_key: str):  # the key was checked by create_app: Starlette builds this on the first request
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not (scope["path"] == "/" and scope["method"] == "GET"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, credential = given.partition(b" ")
            if not (secrets.compare_digest(credential.lstrip(b" "), self.expected) and scheme.lower() == b"bearer"):
                response = error_response(scope["path"], 401, "missing or wrong API key: send Authorization: Bearer <key>",
                                          "authentication_error", {"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def check_api_key(api_key: str) -> None:
    """ValueError unless ``api_key`` is a key a client can send: an empty key made the check compare against
    "Bearer ", which a bare ``Authorization: Bearer `` header passed (and ``--api-key ""`` or an empty BTLIB_API_KEY
    turned the key off without a word); spaces and control characters cannot survive an HTTP header intact."""
    if not isinstance(api_key, str) or not api_key:
        raise ValueError("the API key is empty: set a key (--api-key KEY or BTLIB_API_KEY=KEY), or unset both to serve "
                         "without one")
    if not all(33 <= ord(c) <= 126 for c in api_key):
        raise ValueError("the API key must be printable ASCII without spaces (it travels in an Authorization header); "
                         "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'")


class TooLarge(Exception):
    """Raised into the app by :class:`BodyLimit`'s receive once a body passes the limit."""


class BodyLimit:
    """ASGI middleware: a request body past ``limit`` bytes is answered 413 without being read.

    A Content-Length past the limit is refused before the first byte of the body is received; a chunked body is
    counted as it arrives and refused when it passes the limit. ``Connection: close``: the rest of the body is never
    read, so the connection cannot carry another request.
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._refuse(scope, receive, send, int(declared) if declared.isdigit() else None)
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise TooLarge
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except TooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send, None)

    async def _refuse(self, scope, receive, send, size: int | None) -> None:
        what = f"a body of {size:,} bytes" if size is not None else "the body"
        response = error_response(scope["path"], 413, f"{what} exceeds this server's limit of {self.limit:,} bytes "
                                  "(python -m btlib.serve --payload-limit BYTES raises it); split the request",
                                  "payload_too_large", {"Connection": "close"})
        await response(scope, receive, send)


def allowed_host_names(host: str, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The Host names a server bound to ``host`` answers: loopback names for a loopback address, ``host`` itself and
    loopback for another address, and "*" (any) for a wildcard address (0.0.0.0, ::), where the operator chose to
    serve the network; ``extra`` adds names (a DNS name behind a proxy)."""
    if host in ("", "0.0.0.0", "::") and not extra:
        return ("*",)
    return tuple(dict.fromkeys([*LOOPBACK_HOSTS, *([] if host in ("", "0.0.0.0", "::") else [host]), *extra]))


class HostCheck:
    """ASGI middleware: 400 unless the request has exactly one Host header and it names an allowed host (any port;
    ``allowed`` None: any name).

    DNS rebinding: a web page on evil.example whose name is made to resolve to 127.0.0.1 can have the visitor's
    browser post to a loopback server; the browser still sends ``Host: evil.example``, which this refuses. A second
    Host header is refused whatever it names (RFC 9112 3.2: a server MUST answer 400 to more than one, and to an
    HTTP/1.1 request without one): only the first was checked, so ``127.0.0.1`` then ``evil.example`` was answered.
    An HTTP/1.0 request without a Host header passes: a browser always sends one.
    """

    def __init__(self, app, allowed: Sequence[str] | None):
        self.app = app
        self.allowed = None if allowed is None else frozenset(h.lower().strip("[]") for h in allowed)

    def _ok(self, host: bytes) -> bool:
        if self.allowed is None:
            return True
        name = host.decode("latin-1").strip().lower()
        if name.startswith("["):  # [::1]:8080
            name = name[1:].partition("]")[0]
        elif name.count(":") == 1:
            name = name.partition(":")[0]
        if name in self.allowed:
            return True
        try:
            return "127.0.0.1" in self.allowed and ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            hosts = [v for k, v in scope["headers"] if k == b"host"]
            message = None
            if len(hosts) > 1:
                message = f"{len(hosts)} Host headers: a request has one (RFC 9112 3.2)"
            elif not hosts and scope.get("http_version") == "1.1":
                message = "no Host header: an HTTP/1.1 request has one (RFC 9112 3.2)"
            elif hosts and not self._ok(hosts[0]):
                message = (f"Host {hosts[0].decode('latin-1')!r} is not this server's ({', '.join(sorted(self.allowed))}): "
                           "to serve another name start python -m btlib.serve with --allowed-host NAME")
            if message is not None:
                return await error_response(scope["path"], 400, message, "invalid_host")(scope, receive, send)
        await self.app(scope, receive, send)
