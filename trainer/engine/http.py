"""One HTTP exchange with an engine, and what its failure means.

Every failure is sorted into what the caller can do about it:

* ``Gone``: no process took the connection (refused, reset): a server being restarted;
  wait for it;
* ``Busy``: it answered with 5xx, 408 or 429, or took longer than the socket's timeout: a
  loaded or restarting server (or a proxy in front of one); wait, naming the status;
* ``EngineError`` at once, where waiting cannot help: any other 4xx (a web server's 404,
  an API key's 401, a 405: not the engine expected), or a whole reply that is not JSON (a
  web page). Each names the URL, the status and what the server said.

A loopback URL (``localhost``, ``127.x``, ``::1``) is never sent through an HTTP proxy from
the environment (``http_proxy``): a proxy cannot reach this machine's loopback and answers
for it, with its own 403 or 502. Other URLs use the environment's proxy, and every message
about them names it.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from trainer.engine.errors import EngineError

#: Statuses a server says while it is loaded or restarting: worth waiting for.
RETRY_STATUSES = (408, 429)


class Gone(Exception):
    """No process took the connection: refused or reset."""


class Busy(Exception):
    """The server (or something in front of it) answered "not now", or took too long."""


def loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def proxy_of(url: str) -> str | None:
    """The proxy the environment puts in front of ``url`` (None: none, or loopback)."""
    if loopback(url):
        return None
    scheme = urllib.parse.urlsplit(url).scheme
    host = urllib.parse.urlsplit(url).hostname or ""
    proxies = urllib.request.getproxies()
    if scheme not in proxies or urllib.request.proxy_bypass(host):
        return None
    return proxies[scheme]


def opener(url: str) -> urllib.request.OpenerDirector:
    """An opener for ``url``: without proxies for a loopback URL, else the environment's."""
    if loopback(url):
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener()


def via(url: str) -> str:
    """`` (through the proxy P, from the environment)`` where one is used, else ''."""
    proxy = proxy_of(url)
    return f" (through the proxy {proxy}, from the environment's *_proxy)" if proxy else ""


def exchange(
    url: str, body: dict[str, Any] | None, timeout_s: float, headers: dict[str, str] | None = None
) -> Any:
    """GET (no ``body``) or POST JSON to ``url``; the reply's JSON. Raises ``Gone``,
    ``Busy`` or ``EngineError`` as the module says."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json",
                                                 **(headers or {})})  # fmt: skip
    try:
        with opener(url).open(request, timeout=timeout_s) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as e:
        text = e.read()[:300].decode(errors="replace").strip()
        said = f"{url} answered HTTP {e.code} {e.reason}{via(url)}: {text or '(no body)'}"
        if e.code >= 500 or e.code in RETRY_STATUSES:
            raise Busy(said) from None
        raise EngineError(f"{said}; {_hint(e.code)}") from None
    except TimeoutError as e:
        raise Busy(f"{url}: no reply within {timeout_s:.0f} s{via(url)}") from e
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            raise Busy(f"{url}: no reply within {timeout_s:.0f} s{via(url)}") from None
        what = f"{url}: {reason or type(e).__name__}{via(url)}"
        if isinstance(reason, (ConnectionRefusedError, ConnectionResetError)):
            raise Gone(what) from None
        raise Busy(what) from None  # a reply cut short (killed mid-body), a DNS hiccup
    try:
        return json.loads(raw)
    except ValueError:
        start = raw[:120].decode(errors="replace").strip()
        raise EngineError(
            f"{url} answered{via(url)} with something that is not JSON ({start!r}...): not "
            "a vLLM OpenAI server (a web page?)"
        ) from None


def _hint(status: int) -> str:
    if status in (401, 403):
        return "it wants credentials this run does not send: not a server the run can use"
    if status in (404, 405):
        return "no such endpoint there: not a vLLM OpenAI server (check --engine-url)"
    return "waiting cannot help: the run stops"
