"""OpenAI's Responses API (``POST /v1/responses``, what the Agents SDK and Codex speak)
over the chat machinery: a body is validated (``request.ResponsesRequest``), mapped to
a chat completions body (``to_chat_body``), served as chat, and the chat result
mapped back (``output``), whole (``response_object``) or as the Responses stream's
typed events (``ResponseEvents``).

State: a response is kept (unless ``store`` is false) in the router's memory, the
last ``STORED`` of them (``store.ResponseStore``), with the conversation that led to it
as input items; ``previous_response_id`` continues it (its instructions are not
carried over, as OpenAI does), ``GET`` / ``DELETE /v1/responses/{id}`` read and
forget it. A client may instead send the whole conversation as ``input`` (earlier
output items, function calls and their outputs included), as the Agents SDK does.
``conversation`` objects and ``background`` are refused. Function tools only; ``text.format``
(``json_schema``, ``json_object``) is chat's ``response_format``; logprobs come with
``include: ["message.output_text.logprobs"]``; ``developer`` messages are system
messages. A stopped output is ``completed``, one cut by ``max_output_tokens`` (or the
context) ``incomplete``. Errors name the Responses field (``renamed``).
"""
