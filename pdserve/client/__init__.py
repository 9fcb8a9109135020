"""Python client and load tester (``pdserve bench``) for OpenAI-compatible servers.

No torch and no Ray here: the client runs on any machine that can reach the
server. One job per module:

| module | owns |
|---|---|
| `openai_stream` | the async HTTP client: streaming requests, SSE parsing, per-request timings |
| `tokens` | finding the served model's tokenizer; prompts of exact token lengths |
| `datasets` | `SampleRequest`; the random and ShareGPT datasets |
| `trace` | Azure / Mooncake trace replay: scaling, clipping, shared prefixes |
| `request_runner` | arrival process (Poisson / gamma / trace) and the concurrency cap |
| `metrics` | TTFT / TPOT / ITL / E2EL statistics, throughput, goodput |
| `server_metrics` | the server's stage histograms, before vs after a run |
| `sweep` | a rate sweep's DistServe goodput (highest rate with >= 90% SLO attainment) |
| `report` | result JSON (vLLM field names), the printed block, the sweep table |
| `plots` | PNG figures: latency CDFs, request timeline, sweep |
| `bench`, `bench_cli` | `BenchConfig` and the run; the command-line flags |
"""

from pdserve.client.openai_stream import (
    OpenAIStreamClient,
    RequestOutput,
    Timeouts,
    complete,
    request_body,
)

__all__ = ["OpenAIStreamClient", "RequestOutput", "Timeouts", "complete", "request_body"]
