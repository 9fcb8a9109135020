"""Tool calling in chat completions: each model family's tool-call syntax, one module
per family (``hermes``, ``llama3``) over ``base.ToolSyntax``, and the registry that
picks one for a model (``syntax_for``). A new family is a module with a
``ToolSyntax`` whose ``claims`` recognises its chat templates, listed in ``SYNTAXES``.
"""

from __future__ import annotations

from pdserve.router.openai.tool_parsers.base import ToolSyntax
from pdserve.router.openai.tool_parsers.hermes import HERMES
from pdserve.router.openai.tool_parsers.llama3 import LLAMA3

DEFAULT = HERMES  # the syntax of a template no family claims (and of the default model)
SYNTAXES: dict[str, ToolSyntax] = {s.name: s for s in (HERMES, LLAMA3)}


def syntax_for(chat_template: str | None) -> ToolSyntax:
    """The family whose syntax ``chat_template`` writes calls in, else ``DEFAULT``."""
    return next((s for s in SYNTAXES.values()
                 if s is not DEFAULT and s.claims(chat_template or "")), DEFAULT)
