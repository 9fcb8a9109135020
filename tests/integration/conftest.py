"""The integration suites' terminal summary: the chaos cases' outcomes."""

from __future__ import annotations

from tests.integration.chaos_summary import pytest_terminal_summary

__all__ = ["pytest_terminal_summary"]
