"""vLLM's tokenizer endpoints, ``POST /tokenize`` and ``POST /detokenize``, answered
from the router's tokenizer (``openai.tokenize``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.router.http.endpoint import Endpoint
from pdserve.router.http.request import ApiError, invalid, read_json
from pdserve.router.openai.request_models import InvalidRequest, validate_body
from pdserve.router.openai.tokenize import DetokenizeRequest, detokenize, parse_tokenize, tokenize
from pdserve.router.types import RouterError


class Tokenize(Endpoint):
    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, lambda body: tokenize(
            parse_tokenize(body), self.router.tokenizer, self.served.tools,
            self.router.models()[0].max_model_len))

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, lambda body: detokenize(
            validate_body(DetokenizeRequest, body), self.router.tokenizer))

    async def _answer(self, request: Request,
                      answer: Callable[[Any], dict[str, Any]]) -> Response:
        rid: str = request.state.request_id
        body = await read_json(request, rid)
        try:
            self.check_model(body)
            return JSONResponse(answer(body))
        except InvalidRequest as exc:
            raise invalid(exc, rid) from exc
        except RouterError as exc:
            raise ApiError.from_router(exc, rid) from exc
