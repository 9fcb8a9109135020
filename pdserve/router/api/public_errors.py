"""What a client may see of an error (HTTP and gRPC alike): a short message that
never carries the server's insides.

Router errors can wrap worker failures whose text comes from Ray: tracebacks with
ANSI colour codes, pids, IP addresses, actor ids and file paths. Rules:

* ``INTERNAL`` errors always read "internal error", with the request id so an
  operator can find the details in the log;
* any other message is shown as it is when it is one line without anything that
  looks like an address, a path, a pid, a traceback, a colour code or a long hex
  id (the request's own id excepted), cut to `MAX_CHARS`; otherwise the kind's
  generic message is shown instead.

Whenever the client sees less than the message, the whole of it is logged with
the request id (`public_message` does that).
"""

from __future__ import annotations

import logging
import re

from pdserve.router.types import ErrorKind

log = logging.getLogger("pdserve.errors")

MAX_CHARS = 300
GENERIC = {
    ErrorKind.INVALID: "invalid request",
    ErrorKind.NOT_FOUND: "not found",
    ErrorKind.OVERLOADED: "the server is overloaded; retry later",
    ErrorKind.NOT_READY: "the service is not ready",
    ErrorKind.DEADLINE: "the request passed its deadline",
    ErrorKind.INTERNAL: "internal error",
}
_LEAK = re.compile(
    r"Traceback|\x1b|File \"|\bpid\b|\bip\b|ray::|actor|"
    r"\b\d{1,3}(?:\.\d{1,3}){3}\b|"  # IPv4
    r"\b[0-9a-f]{1,4}(?::[0-9a-f]{0,4}){2,7}\b|"  # IPv6
    r"(?:^|[\s'\"(=])/[\w.-]+/|[A-Za-z]:\\\\|"  # absolute paths
    r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{16,}\b",  # actor / node / object ids
    re.IGNORECASE)


def public_message(kind: ErrorKind, message: str, request_id: str) -> str:
    """The text a client gets for an error of ``kind`` on request ``request_id``."""
    if kind is ErrorKind.INTERNAL:
        shown = f"{GENERIC[kind]} (request id {request_id}; details are in the server log)"
    elif "\n" in message or _LEAK.search(message.replace(request_id, "")):
        shown = GENERIC[kind]
    elif len(message) > MAX_CHARS:
        shown = message[:MAX_CHARS - 1] + "…"
    else:
        return message
    log.warning("request %s: %s error shown as %r: %s", request_id, kind.value, shown, message)
    return shown
