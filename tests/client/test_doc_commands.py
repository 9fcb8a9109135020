"""Every ``pdserve bench`` command in the README, docs/bench.md, docs/usage.md and
docs/performance.md parses (the README once showed ``--save-result result.json``, which
the CLI rejects) and makes a valid `BenchConfig`."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pdserve.cli.main import build_parser
from pdserve.client.bench_cli import config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _bench_commands(path: Path) -> list[str]:
    text = path.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    joined = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    return [line.split("#")[0] for line in joined if re.search(r"pdserve bench\b", line)]


COMMANDS = [cmd for doc in ("README.md", "docs/bench.md", "docs/usage.md", "docs/performance.md")
            for cmd in _bench_commands(ROOT / doc)]


@pytest.mark.parametrize("command", COMMANDS)
def test_documented_bench_command_parses(command: str) -> None:
    argv = shlex.split(command)
    argv = argv[argv.index("bench"):]
    args = build_parser().parse_args(argv)  # SystemExit on a rejected flag
    config_from_args(args)


def test_commands_were_found() -> None:
    assert len(COMMANDS) >= 4
