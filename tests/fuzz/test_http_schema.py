"""Schemathesis against the live server's ``/openapi.json``: generated and
schema-violating requests to every operation. Asserted for each: no 5xx (a 504
only for a request that set its own ``timeout_s`` and did not finish within it), only
documented statuses and content types, error bodies in OpenAI's shape, a body
that breaks the schema is a 4xx, and one the schema allows is never refused for
a field whose rules the schema states (so the document describes the bodies the
server really takes). A request that does not answer within the deadline fails."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.fuzz.conftest import AUTH, STATS
from tests.integration.live_server import CALL_TIMEOUT_S, LiveServer

MAX_EXAMPLES = 400
# 400s for rules between fields, which a JSON schema of each field cannot state
# (openai.sampling_fields' docstring lists them); any other field named in a 400 for a
# schema-valid body means the document and the server disagree.
# Constraints too: whether a regex, grammar or JSON schema compiles, one per request;
# and the model's limits (context, vocabulary: request_problem's fields, as each API
# names them).
CROSS_FIELD = {"min_tokens", "stream_options", "top_logprobs", "messages", "max_tokens",
               "best_of", "response_format", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "structured_outputs", "structural_tag", "tools", "tool_choice",
               "prompt", "max_completion_tokens", "logit_bias", "stop_token_ids",
               "allowed_token_ids", "bad_words",  # the vocabulary; a word's tokens
               "prompt_logprobs",  # not with stream
               "use_beam_search",  # not with fields it would ignore, nor stream, nor n > 10
               "input", "max_output_tokens", "text",
               "tokens",  # /detokenize: the vocabulary
               "continue_final_message", "chat_template_kwargs",
               "previous_response_id"}  # a response this server keeps: state, not schema


def no_server_error(ctx: Any, response: Any, case: schemathesis.Case) -> None:
    """Never a 5xx, except 504 when the client asked for that deadline."""
    asked = isinstance(case.body, dict) and "timeout_s" in case.body
    assert response.status_code < 500 or (response.status_code == 504 and asked), (
        f"{response.status_code}: {response.text}")


def schema_describes_the_fields(ctx: Any, response: Any, case: schemathesis.Case) -> None:
    """A schema-valid body is not refused for one field's value."""
    if case.meta is None or case.meta.generation.mode.is_negative or response.status_code != 400:
        return
    param = response.json()["error"]["param"]
    assert param is None or param in CROSS_FIELD, (
        f"a body the schema allows was refused for {param!r}: {response.text}")


CHECKS = [no_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection, schema_describes_the_fields]


def test_openapi_schema_fuzz(live: LiveServer) -> None:
    document = requests.get(f"{live.http_url}/openapi.json", headers=AUTH,
                            timeout=CALL_TIMEOUT_S).json()
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    strategy = st.one_of(*(op.as_strategy(generation_mode=mode) for op in operations
                           for mode in schemathesis.GenerationMode))
    session = requests.Session()

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def one(case: schemathesis.Case) -> None:
        response = case.call(base_url=live.http_url, session=session, headers=AUTH,
                             timeout=CALL_TIMEOUT_S)
        STATS.record("http", str(response.status_code))
        case.validate_response(response, checks=CHECKS)

    one()
    # The server still serves after all of it.
    ok = session.post(f"{live.http_url}/v1/completions", headers=AUTH, timeout=CALL_TIMEOUT_S,
                      json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
