"""Finding the processes a test started: each gets a unique mark in its environment
(inherited by everything it starts, Ray's processes included)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams

MARK_VAR = "PDSERVE_TEST_MARK"


def marked_env(mark: str | None = None) -> tuple[str, dict[str, str]]:
    """A fresh mark and the environment to start processes with (no RAY_ADDRESS: a
    server started with it brings up its own embedded cluster)."""
    mark = mark or uuid.uuid4().hex
    env = {**os.environ, MARK_VAR: mark}
    env.pop("RAY_ADDRESS", None)
    return mark, env


def processes_with(mark: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"{MARK_VAR}={mark}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile, or not ours to read
    return found


def command_lines(pids: list[int]) -> dict[int, str]:
    """What each process runs (for a failure's message; gone ones say so)."""
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            out[pid] = "(gone)"
    return out


def kill_marked(mark: str) -> None:
    for pid in processes_with(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_serve(args: list[str], log: Path, env: dict[str, str], timeout_s: float = 180,
                pdserve: Sequence[str] = (sys.executable, "-m", "pdserve.cli.main"),
                cwd: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``pdserve serve ARGS`` (``pdserve``: the command, this checkout's by default) in
    its own session, output to ``log``; returns once it prints that it is serving, with
    the log's text so far. If it exits first or takes longer than ``timeout_s``:
    AssertionError, with it and everything carrying its mark (``env``, from
    ``marked_env``) killed."""
    with log.open("wb") as out:
        proc = subprocess.Popen([*pdserve, "serve", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while "] serving " not in (text := log.read_text(errors="replace")):
        if proc.poll() is not None or time.monotonic() >= deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if MARK_VAR in env:
                kill_marked(env[MARK_VAR])
            raise AssertionError(f"serve did not come up:\n{text[-3000:]}")
        time.sleep(0.2)
    return proc, text


class ServeProcess:
    """One ``pdserve serve ARGS`` process (``start_serve``) serving ``model`` (its
    folder's name), and the HTTP calls the tests make on it."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str], model: str) -> None:
        self.model = model
        self.mark = env[MARK_VAR]
        self.log = log
        self.proc, text = start_serve(args, log, env)
        found = re.search(r"HTTP\s+(http://127\.0\.0\.1:\d+)/v1", text)
        assert found, text[-3000:]
        self.url = found[1]

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, dict[str, object]]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def complete(self, prompt: list[int], max_tokens: int,
                 timeout_s: float = 60) -> tuple[int, dict[str, object]]:
        """A greedy ``/v1/completions`` of exactly ``max_tokens`` tokens."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def workers(self) -> dict[str, dict[str, object]]:
        status, body = self.get("/admin/workers")
        assert status == 200, body
        return {str(w["id"]): w for w in body["workers"]}  # type: ignore[attr-defined]

    def kill(self) -> None:
        """kill -9 of the serve process and its session (Ray's detached actors are not
        in it)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        kill_marked(self.mark)


def golden(model: Path, prompts: Sequence[list[int]], max_tokens: int) -> list[str]:
    """The engine's own greedy texts (dtype auto, as served)."""
    engine = LLMEngine(model, EngineConfig(num_blocks=256, dtype="auto"))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [o.text for o in engine.generate(list(prompts), params)]


def check_golden(server: ServeProcess, prompts: Sequence[list[int]], want: list[str],
                 max_tokens: int) -> None:
    """``server`` serves exactly the texts ``golden`` computed."""
    for prompt, text in zip(prompts, want, strict=True):
        status, body = server.complete(prompt, max_tokens)
        assert status == 200, body
        assert body["choices"][0]["text"] == text  # type: ignore[index]


def listening_sockets() -> dict[int, tuple[str, int]]:
    """socket inode -> (ip, port) of every listening TCP socket on this machine (from
    /proc/net; "::" for every IPv6 interface, IPv4-mapped addresses as IPv4)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A":  # LISTEN
                continue
            hex_ip, hex_port = f[1].split(":")
            if hex_ip.startswith("0000000000000000FFFF0000"):  # ::ffff:a.b.c.d
                hex_ip = hex_ip[24:]
            if len(hex_ip) == 8:
                ip = ".".join(str(int(hex_ip[i:i + 2], 16)) for i in (6, 4, 2, 0))
            elif hex_ip == "00000000000000000000000001000000":
                ip = "::1"
            else:
                ip = "::" if set(hex_ip) == {"0"} else hex_ip
            out[int(f[9])] = (ip, int(hex_port, 16))
    return out


def sockets_of(pid: int | str) -> set[int]:
    """The socket inodes process ``pid`` ("self": this one) holds open."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    except OSError:  # gone meanwhile
        pass
    return found
