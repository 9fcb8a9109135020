"""The prompts and settings of ``python -m benchmarks.spec`` (benchmarks/spec.py): the
*copy* and *open* workloads, the proposer settings, the predicted-output tasks, the
served model and its warm-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PARAGRAPH = (
    "The lighthouse stood at the edge of the northern cliffs for more than two hundred "
    "years. Every evening the keeper climbed its one hundred and twelve steps, trimmed the "
    "wick, polished the great lens and watched the ships pass safely through the narrow "
    "channel below. When the storms came in winter, the light was the only thing the "
    "sailors could see, and many of them owed their lives to its steady beam.")
SHOPPING = ("apples\nbread\nmilk\neggs\nbutter\ncheese\ntomatoes\nonions\nrice\npasta\n"
            "olive oil\ncoffee")
CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result'''
WORKLOADS: dict[str, list[str]] = {
    "copy": [
        f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
        f"Copy this shopping list, one item per line, numbering the items:\n\n{SHOPPING}",
        f"Repeat this Python function exactly as it is:\n\n```python\n{CODE}\n```",
    ],
    "open": [
        "What are three good habits for staying healthy? Explain each one.",
        "Write a short story about a robot who learns to paint.",
        "Explain how rainbows form.",
    ],
}
PROPOSERS: dict[str, dict[str, Any]] = {
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
    "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
    "suffix k=8": {"method": "suffix", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                   "prompt_lookup_min": 2},
}
TYPOS = ("The comittee met on Tuesday to discus the new budjet. After a long debate, the "
         "members agreed to increse funding for the library and to reduse spending on travel.")
# Predicted outputs (OpenAI's ``prediction``): (task, prompt, prediction).
PREDICTED: list[tuple[str, str, str]] = [
    ("rename in code", "Rename the function merge_sorted to merge everywhere in this code. "
     f"Reply with the whole code only.\n\n```python\n{CODE}\n```", f"```python\n{CODE}\n```"),
    ("fix spelling", "Correct the spelling mistakes in this paragraph. Reply with the corrected "
     f"paragraph only.\n\n{TYPOS}", TYPOS),
    ("unrelated", WORKLOADS["open"][2], CODE),
]
SERVED_SPEC = PROPOSERS["ngram k=8"]
SELF_DRAFT = "int4 draft k=6"


def self_draft(model: Path | str) -> dict[str, Any]:
    """The model drafted by its own int4 copy (for the default model, its GGUF's Q4_1
    blocks): a draft of any bf16 model, close enough that most guesses are accepted."""
    return {"method": "draft_model", "model": str(model), "quantization": "int4",
            "num_speculative_tokens": 6}
SERVED_MODEL = "SmolLM2-135M-Instruct"
WARM_UP = "Say hello in one sentence."  # a server's first request (not a measured prompt)
