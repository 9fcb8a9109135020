"""The OpenAI (and vLLM) API's shapes, free of any server: request bodies as pydantic
models and their mapping to router requests, response objects and stream chunks,
tool calls read from the output, the Responses API, tokenize / detokenize."""
