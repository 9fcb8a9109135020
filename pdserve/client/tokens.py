"""Prompts of exact token lengths for the served model, without torch.

This module owns finding the served model's tokenizer (a Hugging Face directory
with ``tokenizer.json``; `tokenizers` is all it needs) and building prompt text
whose token count, as the server will count it, is exactly what a dataset asked
for.

Prompts are sent as text (portable across servers), so the ids we pick must
survive decode -> re-encode unchanged. Byte-level BPE does not promise that for
arbitrary ids (two neighbours may merge), so prompts are drawn from *stable word
tokens*: ids whose text is one space plus ASCII letters (" house") and that
re-encode to themselves alone. A pre-tokenizer splits text before every such
word, so any sequence of them re-encodes to the same ids — exact lengths, and a
shared id prefix is a shared text prefix (what prefix caching needs). For
tokenizers where fewer than `MIN_STABLE_WORDS` such words exist, any non-special
id is used and `fit_to_length` repairs the length by decode/re-encode rounds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

# ~/.cache/pdserve/models/<name>: where `pdserve model prepare` puts the default model
# (the same rule as pdserve.engine.model.gguf_convert, which imports torch and so is not used).
MODELS_CACHE = Path.home() / ".cache" / "pdserve" / "models"
MIN_STABLE_WORDS = 32
_WORD = re.compile(r" [A-Za-z]+")
_FIT_ROUNDS = 8


def resolve_tokenizer_dir(tokenizer: str | None, model: str | None) -> Path:
    """The directory holding ``tokenizer.json`` for ``--tokenizer`` / the served model.

    Tried in order: the argument as a path, then ``~/.cache/pdserve/models/<name>``
    (the last path component of the name, so "org/Name" finds "Name").
    """
    name = tokenizer or model
    if not name:
        raise ValueError("no tokenizer: pass --tokenizer DIR (a Hugging Face model directory)")
    candidates = [Path(name).expanduser(), MODELS_CACHE / Path(name).name]
    for cand in candidates:
        if (cand / "tokenizer.json").is_file():
            return cand
        if cand.is_file() and cand.name.endswith(".json"):
            return cand.parent
    raise FileNotFoundError(
        f"no tokenizer.json for {name!r} (looked in {', '.join(str(c) for c in candidates)}); "
        "pass --tokenizer DIR with the served model's Hugging Face directory"
    )


class PromptTokenizer:
    """Counts tokens as the server does and builds texts of exact token lengths."""

    def __init__(self, backend: Tokenizer, name: str = "") -> None:
        self.backend = backend
        self.name = name
        # Tokens the server's encode adds around any prompt (a BOS, for example).
        self.num_special = int(backend.num_special_tokens_to_add(False))
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self._special = special
        self._pool: np.ndarray | None = None
        self._stable = False

    @classmethod
    def from_dir(cls, path: str | Path) -> PromptTokenizer:
        path = Path(path)
        return cls(Tokenizer.from_file(str(path / "tokenizer.json")), name=str(path))

    def count(self, text: str) -> int:
        """Tokens the server sees for `text` (special tokens included)."""
        return len(self.backend.encode(text, add_special_tokens=True).ids)

    def encode(self, text: str) -> list[int]:
        """Content ids of `text` (no special tokens)."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=False))

    @property
    def stable(self) -> bool:
        """Whether prompts are drawn from stable word tokens (exact by construction)."""
        _ = self.pool
        return self._stable

    @property
    def pool(self) -> np.ndarray:
        """The ids prompts are drawn from (stable words, or every non-special id)."""
        if self._pool is None:
            self._pool = self._stable_words()
            self._stable = len(self._pool) >= MIN_STABLE_WORDS
            if not self._stable:
                self._pool = np.array([i for i in range(self.vocab_size)
                                       if i not in self._special], dtype=np.int64)
        return self._pool

    def _stable_words(self) -> np.ndarray:
        ids = [i for i in range(self.vocab_size) if i not in self._special]
        texts = self.backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        words = [(i, t) for i, t in zip(ids, texts, strict=True) if _WORD.fullmatch(t)]
        encoded = self.backend.encode_batch([t for _, t in words], add_special_tokens=False)
        keep = [i for (i, _), enc in zip(words, encoded, strict=True) if enc.ids == [i]]
        return np.array(keep, dtype=np.int64)

    def random_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        """`n` ids drawn uniformly from the pool."""
        if n <= 0:
            return []
        pool = self.pool
        return [int(x) for x in pool[rng.integers(0, len(pool), size=n)]]

    def fit_to_length(self, ids: Sequence[int], target: int,
                      rng: np.random.Generator) -> tuple[str, int]:
        """Text for content `ids` whose full token count is `target` when possible.

        Returns (text, the server-side token count of text). With stable words the
        first round already fits; otherwise each round truncates or tops up the
        re-encoded ids (vLLM's decode/re-encode repair).
        """
        content = max(0, target - self.num_special)
        cur = list(ids)[:content]
        cur += self.random_ids(rng, content - len(cur))
        text = self.decode(cur)
        for _ in range(_FIT_ROUNDS):
            got = self.encode(text)
            if len(got) == content:
                break
            cur = got[:content] if len(got) > content else got + self.random_ids(
                rng, content - len(got))
            text = self.decode(cur)
        return text, self.count(text)
