"""``make bench``: int4 single-stream decode against llama.cpp's server (issue 54 item 5).

The default model's own Q4_1 blocks in both: ``pdserve serve --decode-quantization
int4`` (the default deployment, 1 prefill + 1 decode worker), ``pdserve serve`` colocated
with ``--quantization int4`` (one worker, both cores), and ``llama-server`` on the same
GGUF with 2 threads. Same client (``pdserve bench``: random 128-token prompts, 128
tokens out, ``--ignore-eos``, one at a time). Each round starts every server anew and
runs them one after the other; rounds alternate the order (this VM drifts ±15%), and
every round's ratio is printed: the goal is each of them, not their mean.

Run: ``python -m benchmarks.int4_decode --llama-server PATH [--rounds 3] [--prompts 8]
[--out result.json]`` (``LLAMA_SERVER`` in the environment works too).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from benchmarks.harness import External, Served, free_port
from benchmarks.pd import CONFIGS
from pdserve.engine.model.gguf_convert import default_gguf_path, resolve_model

SYSTEMS = ("default int4", "colocated int4", "llama-server")


def start(system: str, llama_server: str) -> Served | External:
    if system == "default int4":
        return Served(CONFIGS["default"], flags=("--decode-quantization", "int4"))
    if system == "colocated int4":
        return Served(CONFIGS["colocated"], flags=("--quantization", "int4"))
    port = free_port()
    return External([llama_server, "-m", str(default_gguf_path()), "--host", "127.0.0.1",
                     "--port", str(port), "-t", "2", "-c", "4096"], {},
                    f"http://127.0.0.1:{port}", start_timeout_s=180)


def one_round(order: tuple[str, ...], llama_server: str, prompts: int) -> dict[str, float]:
    tpot = {}
    tokenizer = ("--tokenizer", str(resolve_model(None)))  # (llama-server names its GGUF)
    for system in order:
        with start(system, llama_server) as server:
            server.bench("--dataset", "random", "--random-input-len", "128",
                         "--random-output-len", "8", "--num-prompts", "2", *tokenizer)  # warm-up
            r = server.bench("--dataset", "random", "--random-input-len", "128",
                             "--random-output-len", "128", "--num-prompts", str(prompts),
                             "--max-concurrency", "1", "--ignore-eos", *tokenizer)
            tpot[system] = float(r["median_tpot_ms"])
    return tpot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                    help="llama.cpp's llama-server binary")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", default=None, help="write every figure here (JSON)")
    args = ap.parse_args()
    if not args.llama_server:
        print("int4 decode: no llama-server given (--llama-server or LLAMA_SERVER); skipped")
        return
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        tpot = one_round(SYSTEMS if r % 2 == 0 else SYSTEMS[::-1], args.llama_server,
                         args.prompts)
        ratios = {s: tpot[s] / tpot["llama-server"] for s in SYSTEMS[:2]}
        rounds.append({"tpot_p50_ms": tpot, "ratio_to_llama_server": ratios})
        print(f"round {r + 1}: TPOT p50 " + ", ".join(f"{s} {tpot[s]:.2f} ms" for s in SYSTEMS)
              + " | " + ", ".join(f"{s} {v:.2f}x" for s, v in ratios.items()), flush=True)
    for s in SYSTEMS[:2]:
        worst = max(r["ratio_to_llama_server"][s] for r in rounds)
        print(f"{s}: worst round {worst:.2f}x llama-server's TPOT (goal: every round <= 0.80x)")
    if args.out:
        Path(args.out).write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
