"""``make bench`` for speculative decoding (n-gram prompt lookup, suffix decoding,
and the model's own int4 copy as draft model), on the default model, greedy chat
prompts, against the same engine or server without speculation measured in the same
run.

1. Engine (colocated engines in this process, one per setting): per workload,
   single-stream TPOT (first token to last / tokens after the first) without and with
   each proposer setting, every prompt run on each engine in turn for ``--repeats``
   rounds (this machine drifts over minutes: interleaved, the ratio is one sitting's),
   the ratio, acceptance (accepted / draft tokens), tokens per verifying
   step, and whether the tokens are the same; then output tokens/s at 1..32
   concurrent streams under sustained load (a finished request replaced at once, as
   on a server) with and without speculation (where it stops paying:
   ``disable_by_batch_size``), and at each of those batch sizes the time of a step
   verifying 4 drafted tokens per request against a plain step's, and the acceptance
   at which drafting breaks even there (``verification_cost``).
2. Served (``pdserve serve``, colocated on 2 threads and 1P+1D, each worker's threads
   on both cores, through the HTTP chat endpoint as a client sees it): single-stream TPOT and text
   with and without ``--speculative-config`` (1P+1D: ngram, and the int4 copy as
   draft, both pools loading it); with ``--llama-server PATH``, llama.cpp's
   server on the same GGUF and prompts, without and with its n-gram speculation
   (``ngram-simple`` as it comes, and ``ngram-mod``), against pdserve in bf16 and with
   an int4 decode pool (the GGUF's own Q4_1 blocks, the weights llama-server runs).
   The servers compared run side by side (a pdserve server and its speculating twin,
   with llama-server + ``ngram-mod`` beside every pair, started anew each round: its
   n-grams outlive a request and would learn the same prompts' earlier answers), every
   prompt on each in turn for ``--repeats`` rounds: one server after another, this
   VM's drift (up to 4x between runs minutes apart) decided the ratios.

3. Draft rules at temperature 0.8, top-p 0.9, top-k 50 (no server, no engine: the
   target's and a draft's full distributions over the default model's own sampled
   answers to the open questions, through transformers): the expected acceptance per
   draft token of a greedy draft (the draft's argmax, accepted with the target's
   probability of it), of the probability-ratio rule (sum of min(p, q)), and of
   pdserve's draft sampled with the draws verification makes next (the overlap of
   the two inverse-CDF intervals of each token). Drafts: the model in bfloat16 (a
   close draft) and its first 24 and 20 of 30 layers (distant ones).

4. Predicted outputs (OpenAI's ``prediction``): renaming a function in a snippet and
   correcting a paragraph's spelling, the prediction the text given, and an open
   question with an unrelated prediction; TPOT with and without the prediction on an
   engine that does not speculate otherwise and on an ngram one, in turn for
   ``--repeats`` rounds, the drafted tokens accepted and rejected, the same tokens.

Workloads: *copy* (repeat a paragraph, copy a list adding numbers, repeat a code
snippet) and *open* (open-ended questions: nothing to copy).

Run: ``python -m benchmarks.spec [--parts 1,2,3,4] [--threads 2]
[--max-tokens 160] [--llama-server PATH] [--json FILE]``.

This module runs the parts: 1 and 4 are in ``benchmarks/spec_engine.py``, 2 in
``spec_served.py``, 3 in ``spec_draft_rules.py``, the prompts and settings in
``spec_workloads.py``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from benchmarks.spec_draft_rules import part3
from benchmarks.spec_engine import part1, part4
from benchmarks.spec_served import part2
from pdserve.engine.model.gguf_convert import resolve_model
from pdserve.engine.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--parts", default="1,2,3,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--concurrency", default="1,2,4,8,32")
    ap.add_argument("--repeats", type=int, default=3,
                    help="single-stream rounds (summed; engines and servers) and throughput runs "
                         "per point (best)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                    help="llama.cpp's llama-server binary, to compare against (default: "
                         "$LLAMA_SERVER; skipped when unset)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    model = resolve_model(args.model)
    tok = Tokenizer.from_dir(model)
    report: dict[str, Any] = {"model": model.name, "threads": args.threads}
    if 1 in parts:
        report["engine"] = part1(model, tok, args.threads, args.max_tokens,
                                 [int(c) for c in args.concurrency.split(",")], args.repeats)
    if 2 in parts:
        report["served"] = part2(args.threads, args.max_tokens, args.llama_server,
                                 args.repeats)
    if 3 in parts:
        report["draft_rules"] = part3(model, tok, args.max_tokens)
    if 4 in parts:
        report["predicted"] = part4(model, tok, args.threads, args.max_tokens, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
