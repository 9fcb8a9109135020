"""``python -m benchmarks.spec`` part 3 (benchmarks/spec.py): the expected acceptance of
draft rules at temperature 0.8, top-p 0.9, top-k 50 over the default model's own
sampled answers (a greedy draft, the probability-ratio rule, pdserve's shared draws)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.spec_workloads import (
    WORKLOADS,
)
from pdserve.engine.tokenizer import Tokenizer

SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 50}


def _processed(logits: Any) -> Any:
    """The sampler's distribution at ``SAMPLED`` (temperature, top-k, then top-p)."""
    import torch

    top, idx = (logits.float() / SAMPLED["temperature"]).topk(SAMPLED["top_k"], dim=-1)
    p = top.softmax(dim=-1)
    p = torch.where(p.cumsum(dim=-1) - p < SAMPLED["top_p"], p, 0.0)
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(
        -1, idx, p / p.sum(dim=-1, keepdim=True))


def part3(model: Path, tok: Tokenizer, max_tokens: int) -> dict[str, Any]:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    torch.manual_seed(0)
    answers = []
    for question in WORKLOADS["open"]:
        ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": question}])])
        out = target.generate(ids, max_new_tokens=max_tokens, do_sample=True, **SAMPLED)
        answers.append((out, ids.shape[1]))

    def first_layers(n: int) -> Any:
        m = copy.deepcopy(target)
        m.model.layers = m.model.layers[:n]
        m.config.num_hidden_layers = n
        return m

    drafts = {"bf16 copy": copy.deepcopy(target).to(torch.bfloat16),
              "24 of 30 layers": first_layers(24), "20 of 30 layers": first_layers(20)}
    print(f"\n3. draft rules: expected acceptance per draft token at {SAMPLED} over "
          f"{sum(a.shape[1] - n for a, n in answers)} answer tokens")
    print(f"   {'draft':16} {'greedy draft':>12} {'ratio rule':>11} {'shared draws':>13}")
    result: dict[str, Any] = {}
    with torch.no_grad():
        for name, draft in drafts.items():
            sums, n = [0.0, 0.0, 0.0], 0
            for ids, start in answers:
                p = _processed(target(ids).logits[0, start - 1 : -1])
                q = _processed(draft(ids).logits[0, start - 1 : -1])
                sums[0] += float(p.gather(-1, q.argmax(dim=-1, keepdim=True)).sum())
                sums[1] += float(torch.minimum(p, q).sum())
                cp, cq = p.double().cumsum(dim=-1), q.double().cumsum(dim=-1)
                lo = torch.maximum(cp - p.double(), cq - q.double())
                sums[2] += float((torch.minimum(cp, cq) - lo).clamp(min=0).sum())
                n += p.shape[0]
            row = dict(zip(("greedy_draft", "ratio_rule", "shared_draws"),
                           (x / n for x in sums), strict=True))
            result[name] = row
            print(f"   {name:16} {row['greedy_draft']:12.3f} {row['ratio_rule']:11.3f} "
                  f"{row['shared_draws']:13.3f}")
    return result
