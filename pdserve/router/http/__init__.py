"""The router's OpenAI-compatible HTTP front end: the FastAPI app and its routes, the
ASGI middleware, the operator's ``/admin/`` API, ``/openapi.json``, and running it
on uvicorn."""
