"""What stands in front of our HTTP servers (`serve`, `rollout-worker`): an API key and a
bound on request bodies, both checked before a route reads anything, and the rule that a
server other machines can reach must have a key (as the Rust retrograd and llama-server
expect of anything off loopback)."""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import socket
from collections.abc import Callable, Mapping

from retrograd.errors import ConfigError

API_KEY_ENV = "RETROGRAD_API_KEY"

Refusal = Callable[[int, str], dict]  # (status, one-line message) -> the server's JSON error body


def resolve_api_key(flag_value: str | None) -> str | None:
    """The key from --api-key, else from $RETROGRAD_API_KEY; None when neither is set."""
    key = flag_value if flag_value is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ConfigError(f"--api-key / ${API_KEY_ENV} is empty: give a key, or unset it to serve loopback without one")
    return key or None


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (a name is resolved)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def require_key_off_loopback(host: str, api_key: str | None) -> None:
    """Refuse, in one line, to listen beyond this machine without a key."""
    if api_key is None and not is_loopback(host):
        raise ConfigError(
            f"--host {host}: other machines could reach this server, so it needs a key: pass --api-key KEY "
            f"(or set ${API_KEY_ENV}); clients then send 'Authorization: Bearer KEY'"
        )


class Guard:
    """ASGI middleware: 401 without `Authorization: Bearer <api_key>` (when a key is set),
    413 for a body over its path's limit, counted as it arrives, whatever Content-Length
    claims. The body is read here, up to the limit, and handed on whole, so a route never
    sees an unbounded body."""

    def __init__(
        self,
        app,
        *,
        api_key: str | None,
        max_body_bytes: int,
        refusal: Refusal,
        path_limits: Mapping[str, int] | None = None,
    ):
        self.app, self.api_key, self.max_body_bytes, self.refusal = app, api_key, max_body_bytes, refusal
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and not self._authorized(headers.get("authorization", "")):
            return await self._refuse(send, 401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                      [(b"www-authenticate", b"Bearer")])
        limit = self.path_limits.get(scope["path"], self.max_body_bytes)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, 413, f"request body of {int(declared)} bytes is over this server's {limit}")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await self._refuse(send, 413, f"request body is over this server's {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, when it comes

        return await self.app(scope, replay, send)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _refuse(self, send, status: int, message: str, extra_headers=()) -> None:
        body = json.dumps(self.refusal(status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra_headers]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
