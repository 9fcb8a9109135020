"""Draft-model speculation (``speculative_config.method: draft_model``): a smaller
model of the same tokenizer guesses a decoding request's next tokens, the target
checks them in one step (``spec_decode.verify``).

The draft samples its guess as the target will sample: with the request's own
sampling parameters (penalties, bias, temperature, top-k/p, min-p, min_tokens) and
the very uniforms verification will draw, read ahead from a copy of the request's
generator (a random request without a seed gets a generator of its own, seeded from
torch's, when it first drafts). Both draws are inverse-CDF draws over the vocabulary
in one order, so where the draft's distribution is close to the target's they land
on the same token and the guess is accepted; greedy requests draft their argmax.
Verification is unchanged (``spec_decode.verify``: the target's sampler, position by
position), so the output is the plain sampler's stream token for token, seeded or
not, whatever the draft proposes. It has its
own paged KV cache (as many blocks as the target's, no prefix caching) and keeps a
mirror ``Request`` per speculating request: each step the mirror first drops the KV
of the tokens the target rejected (its computed tokens are cut back to the longest
prefix it shares with the target's), catches up on what the target appended (at
first the whole prompt, in chunks within the token budget), then runs one
single-token step per further draft token, every speculating request batched in each.
A draft from the target's own checkpoint (``speculative_config.quantization``: the
model drafting for itself in int4) copies the KV of what the target computed from the
target's cache instead of catching up on it.
A structured-output request drafts under its grammar: each draft token is sampled
under the mask of a copy of the request's matcher advanced over the draft so far (as
verification masks each position), so a close draft's guesses stay allowed; the
draft ends where the grammar stops.

Disaggregated, the draft's prompt KV is made on the prefill worker and travels with
the target's (``kv_transfer/with_draft.py``). The prefill worker's draft cache is
indexed by the target's block ids (``prefill``: a request's draft KV sits at its
target blocks, so it never lacks room and goes out beside them); the decode worker
reserves a mirror's blocks for it (``reserve``: held, never evicted, until the KV
landed and ``adopt`` starts the mirror from the whole prompt, or the request is gone).
With no room there, the mirror catches up on the prompt itself, as colocated.

Under tensor parallelism rank 0 alone holds the draft, whole, and tells the other
ranks its drafts (``LLMEngine._share_drafts``); its KV moves over rank 0's channel.

Mirrors live as long as their requests (``release``); when the draft's rows or
blocks run out, the least recently used mirror is dropped (it catches up again if
it speculates later), and a request that still finds no room gets no draft."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig, ModelConfig, ceil_div
from pdserve.engine.input_batch import InputBatch
from pdserve.engine.model.gguf_convert import resolve_model
from pdserve.engine.model.kv_cache import new_kv_cache
from pdserve.engine.model.loader import load_model
from pdserve.engine.request import Request
from pdserve.engine.sampling.grammar import Grammars
from pdserve.engine.sampling.sampler import Sampler, SamplingRow
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.spec.spec_decode import moving_average
from pdserve.kv_layout import KVLayout

if TYPE_CHECKING:
    import llguidance

_PARAMS = SamplingParams(max_tokens=1)  # a mirror's own (its samples follow its request's)


def draft_dir(model: str) -> Path:
    """``speculative_config.model``'s directory: a checkpoint directory, or the default
    model's name (as ``--model`` takes it); ValueError if neither."""
    try:
        return resolve_model(model)
    except FileNotFoundError as exc:
        raise ValueError(f"speculative_config.model: {exc}") from exc


def draft_quantization(config: EngineConfig) -> str:
    """The draft's weight format: ``speculative_config.quantization``, else the target's."""
    spec = config.speculative_config
    return (spec.quantization if spec is not None and spec.quantization is not None
            else config.quantization)


def draft_model_id(model_dir: Path, config: EngineConfig) -> str:
    """The draft's name in KV layouts (its config's, else its directory's), and its
    weight format where quantized: a prefill worker's draft makes the prompt KV the
    decode worker's drafts from, so both must load the same weights."""
    name = ModelConfig.from_dir(model_dir).name or model_dir.name
    quant = draft_quantization(config)
    return name if quant == "none" else f"{name} ({quant})"


class DraftModel:
    def __init__(self, model_dir: Path, config: EngineConfig, target: ModelConfig,
                 max_model_len: int, num_blocks: int, eos_token_ids: frozenset[int],
                 grammars: Grammars, target_kv: torch.Tensor | None = None) -> None:
        mc = self.model_config = ModelConfig.from_dir(model_dir)
        self.model_id = draft_model_id(model_dir, config)
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {str(model_dir)!r} has a vocabulary of "
                             f"{mc.vocab_size} tokens, the target {target.vocab_size}: a draft "
                             "must share the target's tokenizer")
        if mc.max_position_embeddings < max_model_len:
            raise ValueError(f"draft model {str(model_dir)!r} takes {mc.max_position_embeddings} "
                             f"positions, fewer than the target's max_model_len {max_model_len}")
        # The target's dtype, backends and KV cache dtype; its own quantization.
        loaded = load_model(model_dir, dataclasses.replace(
            config, max_model_len=max_model_len, quantization=draft_quantization(config)))
        self.model = loaded.model
        self.block_size = config.block_size
        self.kv_dtype = config.kv_cache_dtype
        self.kv_cache = new_kv_cache(num_blocks, mc.num_layers, mc.num_kv_heads,
                                     self.block_size, mc.head_dim, config.kv_cache_dtype,
                                     config.device)
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        # The target's KV cache, where the draft is the target's own checkpoint (in
        # another weight format: ``speculative_config.quantization``): the same layout,
        # so a mirror copies the KV of the tokens the target computed instead of
        # computing them itself (a prompt's, in int4 prefill, cost more than the
        # target's own bf16 prefill on AMX), and a prefill worker sends it as the draft's.
        same = target_kv is not None and target_kv.shape == self.kv_cache.shape
        self.target_kv = target_kv if same else None
        self.max_rows = config.max_num_seqs
        self.max_tokens = config.max_num_batched_tokens
        self.inputs = InputBatch(self.max_rows, max_model_len, self.max_tokens, self.block_size,
                                 config.device)
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids  # the target's (masked during min_tokens)
        self.grammars = grammars  # the target's: the masks of structured-output drafts
        # seconds a forward pass of ``propose`` takes, all it does counted (moving average)
        self.forward_s = 0.0
        self.mirrors: OrderedDict[str, Request] = OrderedDict()  # least recently used first
        self._synced: dict[str, int] = {}  # request id -> tokens known equal to the target's
        self._landing: set[str] = set()  # mirrors whose prompt KV a transfer writes (reserve)

    def release(self, request_id: str) -> None:
        """The request is gone (finished, aborted, handed off): its blocks and row too."""
        m = self.mirrors.pop(request_id, None)
        if m is not None:
            self.pool.free(m.block_ids)
            m.block_ids = []
            self.inputs.release(m)
            del self._synced[request_id]
            self._landing.discard(request_id)

    def _evict(self, keep: set[str]) -> bool:
        """Drop the least recently used mirror not in ``keep`` (nor one a transfer
        writes into); False if none."""
        for rid in self.mirrors:
            if rid not in keep and rid not in self._landing:
                self.release(rid)
                return True
        return False

    def _mirror(self, req: Request, k: int, keep: set[str]) -> Request | None:
        """The request's mirror, cut back to what it shares with the target and with
        blocks for the tokens it computes this step; None: no room for it."""
        rid = req.request_id
        m = self.mirrors.get(rid)
        if m is None:
            m = self._new_mirror(rid, keep)
            if m is None:
                return None
        self.mirrors.move_to_end(rid)
        tokens, mine = req.token_ids, m.token_ids
        same = self._synced[rid]
        end = min(len(mine), len(tokens))
        while same < end and mine[same] == tokens[same]:
            same += 1
        del mine[same:]
        mine.extend(tokens[same:])
        self._synced[rid] = len(tokens)
        # (at least the last token is computed again: it gives the first guess)
        m.num_computed_tokens = min(m.num_computed_tokens, same, len(tokens) - 1)
        # KV for every token computed: the target's and the first k - 1 drafted
        need = ceil_div(len(tokens) + k - 1, self.block_size) - len(m.block_ids)
        while need > 0:
            got = self.pool.allocate(need)
            if got is not None:
                m.block_ids += got
                break
            if not self._evict(keep | {rid}):
                return None
        if self.target_kv is not None and m.num_computed_tokens < req.num_computed_tokens:
            self._copy_target(req.block_ids, m.block_ids, m.num_computed_tokens,
                              req.num_computed_tokens)
            m.num_computed_tokens = req.num_computed_tokens
        return m

    def _copy_target(self, src: Sequence[int], dst: Sequence[int], start: int, end: int) -> None:
        """The target's KV of positions [start, end) into the draft's cache: the whole
        blocks that hold them (a block's other positions are either the same context or
        not yet computed: the draft writes those before it reads them)."""
        first, last = start // self.block_size, ceil_div(end, self.block_size)
        if first < last:
            self.kv_cache[torch.tensor(dst[first:last])] = self.target_kv[  # type: ignore[index]
                torch.tensor(src[first:last])]

    def _new_mirror(self, rid: str, keep: set[str]) -> Request | None:
        while len(self.mirrors) >= self.max_rows:
            if not self._evict(keep):
                return None
        m = self.mirrors[rid] = Request(rid, [], _PARAMS, token_ids=[])
        self._synced[rid] = 0
        return m

    # ------------------------------------------------- disaggregated serving
    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Decode role: blocks for the draft KV of a prompt of ``num_tokens`` that a
        prefill worker sends; [] when there is no room (the mirror then catches up
        here). They are held until ``adopt`` or ``release``."""
        if request_id in self.mirrors:
            raise ValueError(f"request {request_id!r} has a draft mirror already")
        m = self._new_mirror(request_id, set())
        if m is None:
            return []
        need = ceil_div(num_tokens, self.block_size)
        while (got := self.pool.allocate(need)) is None:
            if not self._evict({request_id}):
                self.release(request_id)
                return []
        m.block_ids = got
        self._landing.add(request_id)
        return list(got)

    def adopt(self, request_id: str, prompt: Sequence[int]) -> None:
        """Decode role: the prompt's draft KV landed in the reserved blocks (a request
        that reserved none is left to catch up)."""
        if request_id not in self._landing:
            return
        self._landing.discard(request_id)
        m = self.mirrors[request_id]
        m.token_ids = list(prompt)
        m.num_computed_tokens = self._synced[request_id] = len(prompt)

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> None:
        """Prefill role: the draft KV of each ``(request id, prompt, block ids)``, written
        at the target's blocks; in chunks within the token budget, at most
        ``max_rows`` requests at once."""
        if self.target_kv is not None:  # the target's own prompt KV, at the same blocks
            for _, tokens, blocks in prompts:
                self._copy_target(blocks, blocks, 0, len(tokens))
            return
        todo = [Request(rid, [], _PARAMS, token_ids=list(tokens), block_ids=list(blocks))
                for rid, tokens, blocks in prompts]
        todo.reverse()
        active: list[Request] = []
        while todo or active:
            while todo and len(active) < self.max_rows:
                active.append(todo.pop())
            budget, work = self.max_tokens, []
            for m in active:
                n = min(m.num_new_tokens, budget)
                if n <= 0:
                    break
                work.append((m, n))
                budget -= n
            self._run(work, {})
            for m in active:
                if not m.num_new_tokens:
                    self.inputs.release(m)
            active = [m for m in active if m.num_new_tokens]

    def kv_layout(self) -> KVLayout:
        """This draft's cache, as its transfer channel sees it."""
        mc = self.model_config
        return KVLayout(model_id=self.model_id, dtype=self.kv_dtype, num_layers=mc.num_layers,
                        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                        block_size=self.block_size)

    def _run(self, work: list[tuple[Request, int]],
             rows: dict[str, SamplingRow]) -> dict[str, int]:
        """Compute ``n`` tokens of each mirror; the next token of each that caught up
        with its tokens, sampled by its row in ``rows`` (no rows: the prefill role's
        prompt KV, nothing sampled)."""
        step = self.inputs.prepare(work)
        hidden = self.model(step.input_ids, self.kv_cache, step.meta, step.logits_indices)
        for m, n in work:
            m.num_computed_tokens += n
        if not step.sampled or not rows:
            return {}
        logits = self.model.logits(hidden[: len(step.sampled)])
        assert logits is not None  # a draft is whole: rank 0's alone under TP
        out = self.sampler(logits, [rows[m.request_id] for m in step.sampled])
        return {m.request_id: t for m, t in zip(step.sampled, out.token_ids, strict=True)}

    def _row(self, req: Request, mirror: Request) -> SamplingRow:
        """How ``mirror`` samples its draft of ``req``: as the target will, from a copy
        of the request's generator (the draws verification makes next), over the
        mirror's tokens (the request's, then the draft so far)."""
        params, generator = req.params, None
        if params.logprobs is not None:
            params = dataclasses.replace(params, logprobs=None)
        if not params.greedy:
            assert req.generator is not None, "a random request drafts from its generator"
            generator = torch.Generator(req.generator.device)
            generator.set_state(req.generator.get_state())
        return SamplingRow(params, mirror.token_ids, req.num_prompt_tokens, generator,
                           self.eos_token_ids)

    @torch.inference_mode()
    def propose(self, wanted: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """A draft of ``k`` tokens for each ``(request, k)`` (empty: no room)."""
        t0, forwards = time.monotonic(), 0
        keep = {req.request_id for req, _ in wanted}
        mirrors = [self._mirror(req, k, keep) for req, k in wanted]
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _ in wanted}
        want = {req.request_id: k for req, k in wanted}
        rows = {req.request_id: self._row(req, m)
                for (req, _), m in zip(wanted, mirrors, strict=True) if m is not None}
        # structured outputs: a copy of each request's matcher, advanced over its draft
        grammar = {req.request_id: req.grammar.deep_copy()
                   for (req, _), m in zip(wanted, mirrors, strict=True)
                   if m is not None and req.grammar is not None}
        active = [m for m in mirrors if m is not None]
        while active:
            budget, work = self.max_tokens, []
            for m in active:  # catching up on a long prompt: chunks within the budget
                n = min(m.num_new_tokens, budget)
                if n <= 0:
                    break
                work.append((m, n))
                budget -= n
            self._mask(work, rows, grammar)
            forwards += 1
            for rid, token in self._run(work, rows).items():
                drafts[rid].append(token)
                self.mirrors[rid].token_ids.append(token)
                if rid in grammar:
                    ok = grammar[rid].consume_token(token)  # sampled under its mask
                    assert ok, grammar[rid].get_error()
                    if grammar[rid].is_stopped():  # nothing may follow: the draft ends
                        want[rid] = len(drafts[rid])
            # the last draft token is never computed: its KV is not needed
            active = [m for m in active if len(drafts[m.request_id]) < want[m.request_id]]
        if forwards:
            self.forward_s = moving_average(self.forward_s,
                                            (time.monotonic() - t0) / forwards)
        return [drafts[req.request_id] for req, _ in wanted]

    def _mask(self, work: list[tuple[Request, int]], rows: dict[str, SamplingRow],
              grammar: dict[str, llguidance.LLMatcher]) -> None:
        """The grammar masks of this step's structured-output rows that sample (the
        mirrors that catch up with their tokens)."""
        due = [m.request_id for m, n in work
               if n == m.num_new_tokens and m.request_id in grammar]
        if due:
            masks = self.grammars.fill([grammar[rid] for rid in due])
            for rid, mask in zip(due, masks, strict=True):
                rows[rid].allowed = mask

    def check_integrity(self) -> None:
        """Every block is held by one live mirror or free."""
        held = [b for m in self.mirrors.values() for b in m.block_ids]
        assert len(held) == len(set(held)), "a draft block held twice"
        assert self.pool.num_used == len(held), (self.pool.num_used, len(held))
        self.pool.check_integrity()
