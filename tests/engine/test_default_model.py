"""The real default model (SmolLM2-135M-Instruct, fp32): greedy parity with
transformers on the same prepared weights, and the CLI end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams


def test_greedy_matches_transformers_on_default_model(default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    eng = LLMEngine(default_model_dir, EngineConfig(num_blocks=128, max_num_batched_tokens=32))
    tok = eng.tokenizer
    assert tok is not None
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "Tell me about the ocean."}]),
        tok.encode("The history of the printing press begins"),
    ]
    outs = eng.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    for p, o in zip(prompts, outs, strict=True):
        ids = torch.tensor([p])
        # An explicit mask: the chat template's <|im_end|> is also the pad id, and
        # transformers would otherwise mask those prompt tokens out.
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                          do_sample=False)
        assert o.token_ids == ref[0, len(p):].tolist()
    assert "ocean" in outs[0].text.lower()


def test_cli_generate_json(default_model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "generate", "--model", str(default_model_dir),
         "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "16", "--json"],
        capture_output=True, text=True, check=True, timeout=300)
    obj = json.loads(out.stdout)
    assert {"token_ids", "text", "finish_reason", "prompt_tokens"} <= obj.keys()
    assert "Paris" in obj["text"] and obj["finish_reason"] in ("stop", "length")
    assert len(obj["token_ids"]) == obj["completion_tokens"] <= 16


def test_cli_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "generate", "--model", str(tmp_path / "nope"),
         "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.startswith("pdserve: error:") and "Traceback" not in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "generate", "--prompt", "hi",
         "--temperature", "-3"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "temperature" in res.stderr
