"""``LLMEngine``: one model, one KV cache, one scheduler; the object both worker
pools hold.

Colocated use: ``add_request`` then ``step`` until done (or ``generate``).
Disaggregated use (what the prefill and decode workers call):

* prefill role — ``add_request``/``step`` as usual; a request stops after its
  first token with status PREFILLED and keeps its blocks: ``block_ids(rid)``, which
  the transfer channel reads from ``kv_cache``, then ``release(rid)``.
* decode role — ``reserve(...)`` allocates blocks for a prompt whose KV comes from
  outside (a channel writes them into ``kv_cache``);
  ``start_decode(rid, first_token)`` makes it run; ``step`` decodes. Or, when the
  reservation shared all but a short suffix from this engine's prefix cache (a
  conversation's next turn), ``prefill_reserved(rid)`` computes that suffix here.

With ``speculative_config`` (``spec_decode.py``) a decoding request may get several
tokens from one step: its accepted draft tokens and one more, stop rules applied to
each in order, as if they had come one step each.

``step`` streams token ids and applies the token-level stops (EOS, stop token ids,
max_tokens), which free a request's blocks at once. Text and stop strings are made
outside the step loop by an ``OutputProcessor`` (``engine/output.py``): the router's
for served requests, ``generate``'s here.

Bad input raises ``ValueError`` from ``add_request``/``reserve`` and leaves the
engine serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from pdserve.engine import kernels
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig, ceil_div
from pdserve.engine.input_batch import InputBatch
from pdserve.engine.model.kv_cache import new_kv_cache
from pdserve.engine.model.loader import load_model
from pdserve.engine.output import OutputProcessor
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.results import Completion, EngineStats, RequestOutput, StepOutput
from pdserve.engine.roles import DisaggregatedRoles
from pdserve.engine.runner import ModelRunner, Sampled
from pdserve.engine.sampling.grammar import Grammars
from pdserve.engine.sampling.logprobs import TokenLogprob
from pdserve.engine.sampling.sampler import make_generator, skip_draws
from pdserve.engine.sampling.sampling_params import SamplingParams, request_problem
from pdserve.engine.sampling.stop import StopChecker
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.spec.draft_model import DraftModel, draft_dir, draft_model_id
from pdserve.engine.spec.drafting import Drafting
from pdserve.engine.spec.spec_decode import (
    PREDICTION_DEFAULTS,
    SpecState,
    SpecStats,
    SuffixCache,
    batch_limit,
    moving_average,
)
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.tp.collectives import TPGroup
from pdserve.engine.tp.lockstep import STOP, close_link, replicated
from pdserve.engine.tp.shard import Shard
from pdserve.kv_layout import KVLayout


class LLMEngine(DisaggregatedRoles, Drafting):
    # Under tensor parallelism a follower replays the leader's state-changing calls:
    # every public method is either ``@replicated`` or named here with why it is not
    # (tests/engine/test_tensor_parallel.py holds every new method to one or the other).
    NOT_REPLICATED: ClassVar[dict[str, str]] = {
        "check_ranks": "the leader's watch over its followers",
        "close": "the leader stops its followers",
        "validate": "reads", "block_ids": "reads", "has_unfinished": "reads",
        "has_request": "reads", "computed_blocks": "reads", "cached_tokens": "reads",
        "empty_blocks": "reads (this rank's heads)",
        "stats": "reads", "kv_layout": "reads", "check_integrity": "reads",
        "generate": "made of replicated calls (add_request, step)",
        "set_num_threads": "each rank's own (core sharing runs without tensor parallelism)",
    }

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, load_tokenizer: bool = True,
                 tp: TPGroup | None = None) -> None:
        """``tp``: this rank's tensor-parallel group (``engine/tp/``); rank 0 leads,
        the others ``follow``. None: the whole model here."""
        self.config = config or EngineConfig()
        self.tp = tp
        self._in_call = False  # inside a replicated call (tp.replicated)
        self._followers: list[Any] = []  # processes of ranks 1.. (tensor_parallel.create_engine)
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model directory not found: {self.model_dir}")
        if self.config.num_threads is not None and self.config.device == "cpu":
            kernels.set_num_threads(self.config.num_threads)
        loaded = load_model(self.model_dir, self.config, tp)
        self.model_config, self.max_model_len = loaded.config, loaded.max_model_len
        self.attention_backend = loaded.attention_backend
        self.linear_backend = loaded.linear_backend
        self.quant_report = loaded.quant_report
        self.model = loaded.model
        if tokenizer is None and load_tokenizer:
            tokenizer = Tokenizer.from_dir(self.model_dir)
        self.tokenizer = tokenizer
        eos = set(self.model_config.eos_token_ids)
        if tokenizer is not None:
            eos |= set(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)

        mc, local, device = self.model_config, loaded.local, self.config.device
        self.block_size = self.config.block_size

        self.num_blocks = self.config.resolve_num_blocks(
            mc if tp is None else Shard.widest_kv(mc, tp.size))
        # (Tensor parallel: this rank's KV heads only.)
        self.kv_cache = new_kv_cache(self.num_blocks, mc.num_layers, local.num_kv_heads,
                                     self.block_size, mc.head_dim, self.config.kv_cache_dtype,
                                     device)
        # Every rank's KV heads (tensor parallel: each rank's channel moves its own).
        self.kv_heads = [Shard.of(mc, r, tp.size).kv_heads for r in range(tp.size)] \
            if tp is not None else [(0, mc.num_kv_heads)]
        self.rank_links: list[Any] = []  # rank 0 of tensor_parallel.create_engine: a pipe
        # to each follower's KV channel
        self.pool = BlockPool(self.num_blocks, self.config.enable_prefix_caching)
        inputs = InputBatch(self.config.max_num_seqs, self.max_model_len,
                            self.config.max_num_batched_tokens, self.block_size, device)
        self.scheduler = Scheduler(self.pool, self.block_size,
                                   self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                   on_release=inputs.release)
        self.grammars = Grammars(tokenizer, mc.vocab_size, self.eos_token_ids)
        self.runner = ModelRunner(self.model, self.kv_cache, inputs, self.eos_token_ids,
                                  self.grammars)
        self.requests: dict[str, Request] = {}
        self._stops: dict[str, StopChecker] = {}  # token-level stop rules per request
        self.role = self.config.role
        # A prefill engine samples one token per request: nothing to speculate.
        self.spec_config = None if self.role == "prefill" else self.config.speculative_config
        self.spec_stats = SpecStats()
        spec = self.spec_config
        # Running requests above which no step drafts (the pool's, or this family's).
        self.spec_batch_limit = batch_limit(spec or PREDICTION_DEFAULTS, self.linear_backend,
                                            self.config.quantization)
        # suffix decoding: this worker's recent outputs, drafts for the requests after them
        self.suffix_cache = SuffixCache(
            spec.suffix_decoding_max_cached_requests, spec.prompt_lookup_min,
            spec.prompt_lookup_max) if spec is not None and spec.method == "suffix" else None
        # A draft model's: on a prefill engine it makes the draft's prompt KV, which
        # travels with the target's (``prefill_draft``); it speculates elsewhere. Under
        # tensor parallelism rank 0 alone holds it, whole, and tells the others its
        # drafts (``_propose``); its KV moves over rank 0's channel.
        self.draft: DraftModel | None = None
        self.draft_model_id: str | None = None
        # A decoding step's seconds (moving average): a draft model's forward pass
        # (``DraftModel.forward_s``) over it is what a draft token costs
        self._decode_step_s = 0.0
        spec = self.config.speculative_config
        if spec is not None and spec.method == "draft_model":
            assert spec.model is not None
            draft = draft_dir(spec.model)
            if tp is None or tp.rank == 0:
                # The target's own checkpoint (in another weight format) takes the KV of
                # the target's computed tokens from its cache; under tensor parallelism
                # this rank's cache holds only its heads.
                own = tp is None and draft.resolve() == self.model_dir.resolve()
                self.draft = DraftModel(draft, self.config, mc, self.max_model_len,
                                        self.num_blocks, self.eos_token_ids, self.grammars,
                                        self.kv_cache if own else None)
                self.draft_model_id = self.draft.model_id
            else:
                self.draft_model_id = draft_model_id(draft, self.config)

    def check_ranks(self) -> None:
        """``RuntimeError`` if one of this engine's tensor-parallel ranks is gone (the
        worker calls it while idle, when no collective would notice)."""
        if self.tp is not None and self._followers:
            gone = self.tp.peer_gone()
            if gone is not None:
                raise RuntimeError(gone)

    def close(self) -> None:
        """Stop the tensor-parallel followers this engine spawned (idempotent)."""
        procs, self._followers = self._followers, []
        links, self.rank_links = self.rank_links, []
        for link in links:  # first: each follower's channel closes (it sees the pipe end)
            close_link(link)
        if procs and self.tp is not None:
            with contextlib.suppress(Exception):  # a follower already gone
                self.tp.broadcast_object((STOP, (), {}, self.tp.last_error))
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()

    # ------------------------------------------------------------------ intake
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` if the request can never be served here."""
        problem = request_problem(prompt_token_ids, params, self.model_config.vocab_size,
                                  self.max_model_len)
        if problem is not None:
            message, field = problem
            raise ValueError(message if message.startswith(field) else f"{field}: {message}")
        n = len(prompt_token_ids)
        # A prefill engine holds only the prompt (its first token's KV is made later).
        need = n if self.role == "prefill" else n + params.max_tokens
        if ceil_div(need, self.block_size) > self.num_blocks:
            raise ValueError(
                f"prompt ({n}) + max_tokens ({params.max_tokens}) needs more KV blocks than "
                f"this engine has ({self.num_blocks} blocks of {self.block_size})"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")

    def _new_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     params: SamplingParams) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params)
        if self.tp is None or self.tp.rank == 0:  # rank 0 samples for every rank
            req.grammar = self.grammars.matcher(params, req.prompt_token_ids)
        req.generator = make_generator(params, self.config.device)
        if params.prediction and self.role != "prefill" and self.draft_model_id is None:
            output_start = len(prompt_token_ids) - params.resumed_tokens
            req.spec = SpecState.predicted(params.prediction, output_start, self.spec_config,
                                           self.suffix_cache)
        elif self.spec_config is not None:
            req.spec = SpecState.of(self.spec_config, self.suffix_cache)
        skip_draws(params, req.generator, params.resumed_tokens)
        self._stops[request_id] = StopChecker(params, self.eos_token_ids)
        self.requests[request_id] = req
        return req

    @replicated
    def admit(self, request_id: str, prompt_token_ids: Sequence[int],
              params: SamplingParams) -> bool:
        """Colocated admission: queue the request when its prompt's blocks fit in the
        free pool beside the blocks the queued requests still need; ``False`` (nothing
        queued) when they do not. ``ValueError`` for a request it can never serve."""
        self.validate(prompt_token_ids, params)
        if not self.scheduler.room_for(len(prompt_token_ids)):
            return False
        self.add_request(request_id, prompt_token_ids, params)
        return True

    @replicated
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None) -> None:
        """Queue a request for computation. A string prompt is tokenized as is."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        self.scheduler.add(self._new_request(request_id, prompt, params))

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    @replicated
    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks (idempotent)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.PREFILLED:
            self.release(request_id)
            return None
        self.scheduler.finish(req)
        req.finish_reason = "abort"
        if self.suffix_cache is not None:  # a stop string, a client gone: still real output
            self.suffix_cache.add(req.output_token_ids)
        out = self._output(req, [], [])
        self._forget(request_id)
        return out

    # --------------------------------------------------------------------- step
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @replicated
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (a new worker's, after its calibration steps)."""
        self.pool.reset_prefix_cache()

    def set_num_threads(self, n: int) -> None:
        """The CPU threads of the next steps (on the thread that steps the engine;
        every kernel gives the same bits at every count). A no-op off the CPU."""
        if self.config.device == "cpu" and n != torch.get_num_threads():
            kernels.set_num_threads(n)

    @replicated
    def step(self) -> StepOutput:
        """Schedule, run the model once, sample, and report what changed."""
        if self.role != "prefill":  # drafts: the pool's speculation, or predictions
            self._propose(self.spec_batch_limit)
        batch = self.scheduler.schedule()
        if not batch:
            return StepOutput([], None)
        now = time.monotonic()
        for req, _ in batch.work:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        shape = batch.step_info()
        sampled = self.runner.execute(batch)
        info = dataclasses.replace(shape, seconds=time.monotonic() - now,
                                   num_draft_tokens=sum(s.num_draft for s in sampled))
        if info.num_decode == info.num_seqs:
            self._decode_step_s = moving_average(self._decode_step_s, info.seconds)
        drafted = {s.request.request_id: s.num_draft for s in sampled if s.num_draft}
        for req, n in batch.work:  # accepted draft tokens advance as they are appended
            self.scheduler.advance(req, n - drafted.get(req.request_id, 0))
        outputs = [self._append_tokens(s) for s in sampled]
        for req, _ in batch.work:  # max_tokens=0: the prompt is scored, nothing generated
            if req.params.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:
                req.finish_reason = "length"
                self.scheduler.finish(req)
                outputs.append(self._output(req, [], []))
                self._forget(req.request_id)
        return StepOutput(outputs, info)

    def _append_tokens(self, s: Sampled) -> RequestOutput:
        """Append a step's tokens in order, each through the grammar and the stop rules;
        the first that stops the request ends it (what follows is dropped)."""
        req = s.request
        if s.num_draft:
            assert req.spec is not None
            req.spec.observe(s.num_draft, len(s.token_ids) - 1)
            self.spec_stats.observe(s.num_draft, len(s.token_ids) - 1)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for j, token in enumerate(s.token_ids):
            if j:  # the token before was an accepted draft token: its KV is computed
                self.scheduler.advance(req, 1)
            req.token_ids.append(token)
            if req.grammar is not None and not req.grammar.consume_token(token):
                # Sampled under its mask, or checked in start_decode: a bug if it misses.
                raise RuntimeError(f"request {req.request_id!r}: token {token} does not "
                                   f"match its grammar: {req.grammar.get_error()}")
            if self.role == "prefill":
                # Hand-off: the decode side owns stop decisions (it sees the first token
                # again in ``start_decode``), so the KV is always kept.
                self.scheduler.finish(req, keep_blocks=True)
                return self._output(req, [token], s.logprobs, prefilled=True)
            decision = self._stops[req.request_id].token_decision(token, req.num_output_tokens)
            if decision is not None:
                req.finish_reason = decision.finish_reason
                self.scheduler.finish(req)
                if self.suffix_cache is not None:
                    self.suffix_cache.add(req.output_token_ids)
                stop_id = decision.stop_reason if isinstance(decision.stop_reason, int) else None
                out = self._output(req, s.token_ids[: j + 1], s.logprobs[: j + 1], stop_id)
                self._forget(req.request_id)
                return out
        if s.num_draft:
            self.scheduler.trim(req)
        return self._output(req, s.token_ids, s.logprobs)

    def _output(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob],
                stop_reason: int | None = None, prefilled: bool = False) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            finished=req.status is RequestStatus.FINISHED,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            logprobs=logprobs,
            stop_reason=stop_reason,
            prefilled=prefilled,
            first_scheduled_time=req.first_scheduled_time,
            prompt_logprobs=self._prompt_logprobs(req, len(tokens)),
            spec=None if req.spec is None else (req.spec.num_draft_tokens,
                                                 req.spec.num_accepted_tokens),
        )

    def _prompt_logprobs(self, req: Request, num_new: int) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs, on the first output of a request that computed them
        (``num_new``: the output's tokens)."""
        if (req.params.prompt_logprobs is None or self.role == "decode"
                or req.num_output_tokens - num_new > 0):
            return None
        return [None, *req.prompt_logprobs]

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._stops.pop(request_id, None)
        if self.draft is not None:
            self.draft.release(request_id)

    # ---------------------------------------------------------------- helpers
    def stats(self) -> EngineStats:
        sch, pool = self.scheduler, self.pool
        queued = sum(r.num_new_tokens for r in sch.waiting)
        queued += sum(r.num_new_tokens for r in sch.running if r.num_new_tokens > 1)
        return EngineStats(
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            num_waiting_for_kv=len(sch.waiting_for_kv),
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free,
            num_cached_blocks=pool.num_cached,
            queued_prefill_tokens=queued,
            prefix_queries=pool.prefix_queries,
            prefix_hits=pool.prefix_hits,
            num_preemptions=sch.num_preemptions,
            spec=self.spec_stats.snapshot()
            if self.spec_config is not None or self.spec_stats.num_drafts else None,
        )

    def kv_layout(self) -> KVLayout:
        """This engine's cache, as the transfer channels see it (``pdserve.kv_layout``):
        under tensor parallelism this rank's KV heads only; with a draft model, its name
        (its KV travels too: both ends need this draft)."""
        mc = self.model_config
        return KVLayout(model_id=mc.name or self.model_dir.name,
                        dtype=self.config.kv_cache_dtype, num_layers=mc.num_layers,
                        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                        block_size=self.block_size,
                        heads=None if self.tp is None else self.kv_heads[self.tp.rank],
                        draft=self.draft_model_id)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        if self.draft is not None:
            self.draft.check_integrity()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[Completion]:
        """Run ``prompts`` to completion together (continuous batching) and return
        one ``Completion`` each, in order (text and stop strings by an
        ``OutputProcessor`` per request, as the router makes them). Not on a prefill-role
        engine: its requests stop after their first token, their KV held for hand-off."""
        if self.role == "prefill":
            raise ValueError("generate runs requests to completion, which a prefill-role "
                             "engine never does (each stops after its first token, its KV "
                             "held for hand-off): use add_request/step and release")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        results = {rid: Completion() for rid in ids}
        text: dict[str, OutputProcessor] = {}
        try:
            for rid, prompt, p in zip(ids, prompts, params, strict=True):
                self.add_request(rid, prompt, p)
                req = self.requests[rid]
                results[rid].prompt_tokens = req.num_prompt_tokens
                text[rid] = OutputProcessor(self.tokenizer, req.prompt_token_ids, p)
            while any(rid in self.requests for rid in ids):
                for out in self.step().outputs:
                    done = results[out.request_id].add(out, text[out.request_id])
                    if done and out.request_id in self.requests:  # a stop string
                        self.abort(out.request_id)
        finally:
            for rid in ids:
                if rid in self.requests:
                    self.abort(rid)
        return [results[rid] for rid in ids]
