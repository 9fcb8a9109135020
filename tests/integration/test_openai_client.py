"""``pdserve serve`` as a subprocess (embedded Ray cluster, tiny model, torch
transfer, free ports) driven by the official ``openai`` client: chat and
completions, streamed and not, stop strings, seeds, usage, every error status,
client disconnect, and a SIGINT that leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from tests.integration.procs import (
    kill_marked,
    marked_env,
    processes_with,
    start_serve,
)
from tests.waiting import until

KEY = "test-key"
CONFIG = """\
transfer: torch
prefill: {num_cpus: 1}
decode: {num_cpus: 1, engine: {num_blocks: 64}}  # 1024 tokens: room to provoke a 429
# A queued request gets its 429 long before a running 800-token request could end.
router: {queue_timeout_s: 0.1}
"""
IGNORE_EOS = {"ignore_eos": True}


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    mark: str  # in the environment of every process the server started
    log: Path
    client: openai.OpenAI
    model: str
    tokenizer: Tokenizer
    tokenizer_dir: Path
    decode_metrics: str  # the decode worker's /metrics URL
    file_sd: Path  # the Prometheus targets file serve keeps


@pytest.fixture(scope="module")
def served(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[Served]:
    model = tiny_model("llama-gqa")
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "cluster.yaml").write_text(CONFIG + f"file_sd_path: {tmp / 'targets.json'}\n")
    mark, env = marked_env()
    log = tmp / "serve.log"
    proc, text = start_serve(["--model", str(model), "--config", str(tmp / "cluster.yaml"),
                              "--http-port", "0", "--grpc-port", "0", "--api-key", KEY],
                             log, env, timeout_s=150)
    try:
        http = re.search(r"HTTP\s+(http://127\.0\.0\.1:\d+)/v1", text)
        metrics = re.search(r"worker decode-0: (http://\S+/metrics)", text)
        assert http and metrics, text
        client = openai.OpenAI(base_url=f"{http[1]}/v1", api_key=KEY, max_retries=0,
                               timeout=60)
        yield Served(proc, mark, log, client, client.models.list().data[0].id,
                     Tokenizer.from_dir(model), model, metrics[1], tmp / "targets.json")
    finally:
        if proc.poll() is None:  # test_sigint_... did not run or failed: stop hard
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_marked(mark)


def _ok(s: Served) -> None:
    """The server still serves."""
    r = s.client.completions.create(model=s.model, prompt="ok", max_tokens=2, temperature=0,
                                    extra_body=IGNORE_EOS)
    assert r.usage is not None and r.usage.completion_tokens == 2


def test_completions_streamed_and_not(served: Served) -> None:
    s = served
    prompt = "The quick brown fox"
    r = s.client.completions.create(model=s.model, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body=IGNORE_EOS)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.prompt_tokens == len(s.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    chunks = list(s.client.completions.create(
        model=s.model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage == r.usage


def test_chat_streamed_and_not_with_logprobs(served: Served) -> None:
    s = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = s.client.chat.completions.create(model=s.model, messages=messages,  # type: ignore[arg-type]
                                         max_completion_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS)
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(s.tokenizer.apply_chat_template(messages))
    assert r.usage.completion_tokens == 8 and r.choices[0].message.role == "assistant"
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.bytes is not None
    stream = s.client.chat.completions.create(model=s.model, messages=messages,  # type: ignore[arg-type]
                                              max_tokens=8, temperature=0, stream=True,
                                              extra_body=IGNORE_EOS)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content
    # a predicted output (the SDK's typed parameter): the same answer, usage's details
    p = s.client.chat.completions.create(model=s.model, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=8, temperature=0, extra_body=IGNORE_EOS,
                                         prediction={"type": "content", "content": text})
    assert p.choices[0].message.content == text
    assert p.usage is not None and p.usage.completion_tokens_details is not None
    assert p.usage.completion_tokens_details.accepted_prediction_tokens is not None


def test_stop_strings(served: Served) -> None:
    s = served
    kw = {"model": s.model, "prompt": "Prefill is", "max_tokens": 24, "temperature": 0}
    full = s.client.completions.create(**kw, extra_body=IGNORE_EOS).choices[0].text
    at = next(i for i in range(2, len(full) - 2) if full[i:i + 2].isascii()
              and full[i:i + 2].isalpha())
    stop = full[at:at + 2]
    cut = s.client.completions.create(**kw, stop=[stop, "never-seen"], extra_body=IGNORE_EOS)
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kept = s.client.completions.create(**kw, stop=stop, extra_body={
        **IGNORE_EOS, "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(stop) + len(stop)]


def test_seed_reproducibility(served: Served) -> None:
    s = served

    def sample(seed: int) -> str:
        return s.client.completions.create(model=s.model, prompt="Once", max_tokens=16,
                                           temperature=1.0, seed=seed,
                                           extra_body=IGNORE_EOS).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_errors_have_their_status_and_the_server_keeps_serving(served: Served) -> None:
    s = served
    cases: list[tuple[type[Exception], int, Callable[[], object]]] = [
        (openai.BadRequestError, 400, lambda: s.client.completions.create(
            model=s.model, prompt="x", n=17)),
        (openai.BadRequestError, 400, lambda: s.client.chat.completions.create(
            model=s.model, messages=[{"role": "user", "content": "x"}], temperature=-1)),
        (openai.BadRequestError, 400, lambda: s.client.completions.create(
            model=s.model, prompt="x", max_tokens=5000)),
        (openai.AuthenticationError, 401, lambda: s.client.with_options(
            api_key="wrong").models.list()),
        (openai.NotFoundError, 404, lambda: s.client.completions.create(
            model="gpt-4", prompt="x")),
        (openai.APIStatusError, 413, lambda: s.client.completions.create(
            model=s.model, prompt="a" * (9 << 20))),
        (openai.APIStatusError, 504, lambda: s.client.completions.create(
            model=s.model, prompt="x", max_tokens=200, extra_body={"timeout_s": 0.001})),
    ]
    for error, status, call in cases:
        with pytest.raises(error) as exc:
            call()
        assert exc.value.status_code == status, exc.value  # type: ignore[attr-defined]
        body = exc.value.body  # type: ignore[attr-defined]
        assert isinstance(body, dict) and body["message"] and body["type"], body
        _ok(s)


def _decode_blocks(s: Served) -> tuple[float, float]:
    text = urllib.request.urlopen(s.decode_metrics, timeout=10).read().decode()
    values = dict(re.findall(r"^pdserve_kv_blocks_(free|total|capacity)\{[^}]*\} (\S+)$", text,
                             re.MULTILINE))
    return float(values["free"]), float(values.get("capacity", values.get("total", "nan")))


def test_overload_429_and_disconnect_frees_blocks(served: Served) -> None:
    s = served
    # A holds 13 of the decode worker's 64 blocks and grows; B (57 blocks) cannot fit
    # while A runs, waits the router's 0.1 s queue timeout, and gets a 429.
    a = s.client.completions.create(model=s.model, prompt=[5] * 200, max_tokens=800,
                                    temperature=0, stream=True, extra_body=IGNORE_EOS)
    next(iter(a))
    with pytest.raises(openai.RateLimitError) as exc:
        s.client.completions.create(model=s.model, prompt=[6] * 900, max_tokens=4)
    assert exc.value.status_code == 429 and exc.value.response.headers["retry-after"]
    # the worker publishes its metrics at most every 0.5 s: A's blocks show by then
    until("A's blocks in use", lambda: _decode_blocks(s)[0] < 64, 20, poll_s=0.1)
    a.close()  # the client goes away mid-stream: the router aborts A on both workers
    until("decode blocks freed", lambda: (b := _decode_blocks(s))[0] == b[1], 20, poll_s=0.1)
    _ok(s)


def test_bench_against_the_server_with_every_dataset(served: Served, tmp_path: Path) -> None:
    """`pdserve bench` drives the real server with each dataset kind; the result JSON
    has vLLM's fields and its counts add up."""
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": f"Tell me about the number {i}."},
                           {"from": "gpt", "value": "It is a number that comes after "
                                                    "the one before it, as numbers do."}]}
        for i in range(6)]))
    mooncake = tmp_path / "mooncake.jsonl"
    mooncake.write_text("".join(json.dumps(
        {"timestamp": 100 * i, "input_length": 40 + 10 * i, "output_length": 4,
         "hash_ids": [1, 2 + i % 2]}) + "\n" for i in range(6)))
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:46.{i:06d},{20 + i},3\n" for i in range(6)))
    base = str(served.client.base_url).removesuffix("/").removesuffix("/v1")
    tokenizer = str(Path(served.tokenizer_dir))
    runs = {
        "random": ["--dataset", "random", "--random-input-len", "24",
                   "--random-output-len", "4"],
        "sharegpt": ["--dataset", "sharegpt", "--dataset-path", str(sharegpt),
                     "--sharegpt-output-len", "4"],
        "mooncake": ["--dataset", "trace", "--dataset-path", str(mooncake),
                     "--trace-time-scale", "0.01", "--trace-length-scale", "0.1"],
        "azure": ["--dataset", "trace", "--dataset-path", str(azure)],
    }
    for name, flags in runs.items():
        out = tmp_path / f"{name}.json"
        res = subprocess.run(
            [sys.executable, "-m", "pdserve.cli.main", "bench", "--base-url", base,
             "--api-key", KEY, "--tokenizer", tokenizer, "--num-prompts", "6",
             "--disable-tqdm", "--result-filename", str(out), *flags],
            capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{name}:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        assert "Serving Benchmark Result" in res.stdout
        r = json.loads(out.read_text())
        for field in ("completed", "total_input_tokens", "total_output_tokens", "duration",
                      "request_throughput", "output_throughput", "mean_ttft_ms",
                      "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
                      "mean_e2el_ms", "ttfts", "itls", "input_lens", "output_lens", "errors"):
            assert field in r, (name, field)
        assert r["completed"] == 6, (name, r.get("errors"))
        assert len(r["ttfts"]) == len(r["output_lens"]) == 6
        assert sum(r["output_lens"]) == r["total_output_tokens"] > 0
        assert sum(r["input_lens"]) == r["total_input_tokens"] > 0
    _ok(served)


def test_sigint_stops_everything(served: Served) -> None:
    s = served
    targets = json.loads(s.file_sd.read_text())
    assert sorted(g["labels"]["worker"] for g in targets) == ["decode-0", "prefill-0", "router"]
    # HTTP service discovery: the same groups, the router's as the scraper reached it
    base = str(s.client.base_url).removesuffix("/").removesuffix("/v1")
    discovered = json.loads(urllib.request.urlopen(f"{base}/metrics/targets", timeout=10).read())
    assert discovered == targets, (discovered, targets)
    for group in discovered:  # each a live /metrics
        urllib.request.urlopen(f"http://{group['targets'][0]}/metrics", timeout=10).read()
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(timeout=60) == 0, s.log.read_text(errors="replace")[-3000:]
    until("no process left behind", lambda: not processes_with(s.mark), 20, poll_s=0.2)
    assert not s.file_sd.exists()
