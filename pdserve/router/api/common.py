"""What the router's API layers (gRPC, OpenAI HTTP) share: the ``RouterLike``
protocol they are written against, request ids, the served-model check, and compiling
a request's output constraints before it runs. How a router stream is ended:
``router_stream``."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from pdserve.engine.sampling.structured import StructuredOutput, grammar_of
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    ModelInfo,
    RouterError,
    StreamChunk,
)

if TYPE_CHECKING:
    from pdserve.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"  # HTTP header / gRPC metadata: the id the router used
# A client's id is used as given when it is short printable ASCII (it ends up in
# logs and response headers); anything else is refused rather than rewritten.
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")


class RouterLike(Protocol):
    """What the API layers need from the router (``pdserve.router.router.Router``)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    # An async generator: the last item is a FinalChunk; raises RouterError.
    def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk | FinalChunk]: ...

    def models(self) -> list[ModelInfo]: ...

    def ready(self) -> bool: ...

    def prompt_ids(self, req: GenerateRequest) -> list[int]: ...


def new_request_id() -> str:
    return uuid.uuid4().hex


def checked_request_id(client_id: str | None) -> str:
    """The client's request id if it is acceptable, a fresh one if none was given;
    ValueError for an id that is empty, too long or not printable ASCII."""
    if client_id is None:
        return new_request_id()
    if not _REQUEST_ID_RE.fullmatch(client_id):
        raise ValueError("request id must be 1-128 printable ASCII characters without spaces")
    return client_id


def served_model(router: RouterLike, model: str) -> ModelInfo:
    """The served model named ``model``; RouterError(NOT_FOUND) if there is none."""
    models = router.models()
    for m in models:
        if m.id == model:
            return m
    raise RouterError(
        ErrorKind.NOT_FOUND,
        f"model {model!r} is not served here; available: {', '.join(m.id for m in models)}",
    )


def check_model(router: RouterLike, model: str | None) -> None:
    """RouterError(NOT_FOUND) unless ``model`` is empty/None or served here."""
    if model:
        served_model(router, model)


STRUCTURED_COMPILE_TIMEOUT_S = 10.0  # a constraint that takes longer to compile is refused


class ConstraintRefused(ValueError):
    """A request's constraint ``name`` does not compile (``message``, on one line), or
    did not within ``limit_s`` seconds (``limit_s`` set: it timed out)."""

    def __init__(self, name: str, message: str, limit_s: float | None = None):
        super().__init__(f"{name}: {message}")
        self.name, self.message, self.limit_s = name, message, limit_s


def one_line(message: str) -> str:
    """A compiler's message on one line (clients see one-line messages only: a status
    message that spans lines is replaced by a generic one, ``api.public_errors``), without
    the source excerpt and caret lines it draws under it."""
    return " ".join(line.strip() for line in message.splitlines()
                    if line.strip() and not re.fullmatch(r"\s*(\d+ \|.*|[\s^]*)", line))


async def compile_constraints(named: list[tuple[str, StructuredOutput]]) -> None:
    """Compile each (name, constraint) (``grammar_of``: cached; on a thread, so the loop
    keeps serving), all within ``STRUCTURED_COMPILE_TIMEOUT_S``; ``ConstraintRefused``
    for the first that does not compile."""
    timeout_s = STRUCTURED_COMPILE_TIMEOUT_S
    deadline = asyncio.get_running_loop().time() + timeout_s
    for name, constraint in named:
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.to_thread(grammar_of, constraint)
        except TimeoutError:
            raise ConstraintRefused(name, f"took longer than {timeout_s:g} s to compile",
                                    limit_s=timeout_s) from None
        except ValueError as exc:
            raise ConstraintRefused(name, one_line(str(exc))) from None
