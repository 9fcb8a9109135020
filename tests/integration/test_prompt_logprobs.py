"""Prompt logprobs through the whole serving path: ``/v1/completions`` with ``echo`` and
``logprobs`` (also ``max_tokens: 0``) on a prefill/decode pair and on a colocated worker
equal the engine's own numbers, and lm-evaluation-harness' ``local-completions``
model runs a loglikelihood task from local files against the server."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from openai import OpenAI

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from tests.integration.live_server import LiveServer

LAYOUTS = {"pair": {"n_prefill": 1, "n_decode": 1},
           "colocated": {"n_prefill": 0, "n_decode": 0, "n_colocated": 1}}


def engine_logprobs(model: Path, ids: list[int], top: int = 1) -> list[float]:
    eng = LLMEngine(model, EngineConfig(num_blocks=256))
    out = eng.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=top))[0]
    assert out.prompt_logprobs is not None
    return [lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_with_logprobs_equals_the_engine(tiny_model: Callable[[str], Path], layout: str,
                                              max_tokens: int) -> None:
    model = tiny_model("llama-gqa")
    with LiveServer(model, **LAYOUTS[layout]) as live:  # type: ignore[arg-type]
        tok = live.pair.workers[0].engine.tokenizer
        assert tok is not None
        text = "The river town woke slowly that spring, and the ferry bell rang."
        ids = tok.encode(text)
        client = OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="tiny", prompt=text, max_tokens=max_tokens,
                                      echo=True, logprobs=2, temperature=0)
        choice = r.choices[0]
        assert choice.text.startswith(text)
        assert r.usage is not None and r.usage.completion_tokens == max_tokens
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts it
        got = lp.token_logprobs[1 : len(ids)]
        want = engine_logprobs(model, ids)
        assert all(g is not None and math.isclose(g, w, abs_tol=1e-4)
                   for g, w in zip(got, want, strict=True))
        assert all(len(t) >= 1 for t in lp.top_logprobs[1:] if t is not None)
        # streaming: the echoed prompt (and its logprobs) come first
        chunks = list(client.completions.create(
            model="tiny", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1,
            temperature=0, stream=True))
        first = chunks[0].choices[0]
        assert first.text == tok.decode(ids)
        assert first.logprobs is not None and first.logprobs.token_logprobs is not None
        assert first.logprobs.token_logprobs[0] is None
        assert len(first.logprobs.token_logprobs) == len(ids)


def test_max_tokens_zero_needs_echo(tiny_model: Callable[[str], Path]) -> None:
    with LiveServer(tiny_model("llama-gqa")) as live:
        client = OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0)
        from openai import BadRequestError

        with pytest.raises(BadRequestError, match="max_tokens"):
            client.completions.create(model="tiny", prompt="hi", max_tokens=0)


# ----------------------------------------------------------------- lm-eval
TASK = """task: pdserve_local_continuations
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: " {{{{target}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
DOCS = [("The ferry bell rang and the first carts rolled down to the", "landing"),
        ("The teacher opened the windows to let in the", "air"),
        ("A tinker mended pots beside the", "fountain"),
        ("When the rain stopped the evening was clear and", "cold")]


@pytest.mark.slow
def test_lm_eval_local_completions_loglikelihood(tiny_model: Callable[[str], Path],
                                                 tmp_path: Path) -> None:
    """lm-eval (its own CLI, in a process of its own, as a user runs it) drives the
    server with echo + logprobs and token-id prompts on a task built from local files;
    its loglikelihoods equal the engine's own."""
    model = tiny_model("llama-gqa")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "out"
    with LiveServer(model) as live:
        args = ",".join([
            "model=tiny", f"base_url={live.http_url}/v1/completions",
            "tokenizer_backend=huggingface", f"tokenizer={model}", "tokenized_requests=True",
            "num_concurrent=1", "max_retries=1"])
        run = subprocess.run(
            [str(Path(sys.executable).with_name("lm_eval")), "run",
             "--model", "local-completions", "--model_args", args, "--batch_size", "2",
             "--tasks", "pdserve_local_continuations", "--include_path", str(tmp_path),
             "--output_path", str(out), "--log_samples"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
    tok = live.pair.workers[0].engine.tokenizer
    assert tok is not None
    want = []
    for context, target in DOCS:
        ctx, whole = tok.encode(context), tok.encode(context + " " + target)
        assert whole[: len(ctx)] == ctx  # the continuation starts at a token boundary
        want.append(sum(engine_logprobs(model, whole)[len(ctx) - 1 :]))
    (samples_file,) = out.rglob("samples_pdserve_local_continuations_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    got = [float(s["resps"][0][0][0]) for s in sorted(samples, key=lambda s: s["doc_id"])]
    assert [round(g, 3) for g in got] == [round(w, 3) for w in want]
    (results_file,) = out.rglob("results_*.json")
    ppl = json.loads(results_file.read_text())["results"]["pdserve_local_continuations"][
        "perplexity,none"]
    assert math.isclose(ppl, math.exp(-sum(want) / len(want)), rel_tol=1e-4)
