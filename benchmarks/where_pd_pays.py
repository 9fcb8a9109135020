"""Where disaggregation pays at GPU scale, from pdserve's own simulator (issue 51):
the most requests per second per GPU that meet both SLOs for 90% of requests
(DistServe's goodput), for one GPU budget deployed three ways --

* ``colocated``: every worker does both phases (chunked prefill beside decodes);
* ``disaggregated``: prefill and decode pools, every prompt on a prefill worker
  (``placement: static``), the best of the prefill:decode splits;
* ``decider``: the same pools with pdserve's per-request placement rule
  (``placement: measured``: a prompt may be computed on its decode worker);

as the prompt length and the SLOs vary. Step times: the analytic model (datasheet
peaks at 50% MFU / 80% MBU), KV over InfiniBand. SLOs per prompt length, from the
unloaded request (DistServe's convention, scaled by ``--slo-scales``): TTFT 5x the
prompt's prefill, TPOT 3x a lone decode step.

Run: ``python -m benchmarks.where_pd_pays [--models llama-3-8b:1:4,llama-3-70b:4:4]
[--prompts 512,2048,8192] [--output 256] [--slo-scales 1] [--duration 40]``
(model:TP:workers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pdserve.planner.sizing import SLO
from pdserve.planner.step_times import AnalyticModel, resolve_hardware, resolve_model_config
from pdserve.sim.link import get_link
from pdserve.sim.plan import TARGET, Candidate, evaluate, workload

BISECTIONS = 7


def max_rate(c: Candidate, steps_for: Any, prompt: int, output: int, slo: SLO,
             duration: float, placement: str, hi: float) -> float:
    """The highest rate (req/s) at which ``c`` meets both SLOs for 90% of requests."""
    link = get_link("infiniband")
    lo = 0.0
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        o = evaluate(c, steps_for, link, workload(mid, prompt, output, duration, slo),
                     prompt + output, placement)
        lo, hi = (mid, hi) if o.attainment >= TARGET else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-3-8b:1:4,llama-3-70b:4:4")
    ap.add_argument("--prompts", default="512,2048,8192")
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--slo-scales", default="1")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hw = resolve_hardware("h100")
    rows = []
    for spec in args.models.split(","):
        name, tp_s, n_s = spec.split(":")
        tp, n = int(tp_s), int(n_s)
        model = AnalyticModel(resolve_model_config(name), hw, tp=tp)

        def steps_for(t: int, m: AnalyticModel = model) -> AnalyticModel:
            return m

        for prompt in (int(x) for x in args.prompts.split(",")):
            for scale in (float(x) for x in args.slo_scales.split(",")):
                slo = SLO(5 * model.prefill_ms(prompt) * scale,
                          3 * model.decode_ms(1, prompt) * scale)
                # an upper bound: every worker prefilling back to back
                hi = 2 * n * 1e3 / model.prefill_ms(prompt)
                best: dict[str, tuple[float, str]] = {}
                colo = Candidate(0, 0, n, tp)
                best["colocated"] = (max_rate(colo, steps_for, prompt, args.output, slo,
                                              args.duration, "measured", hi), colo.describe())
                for kind, placement in (("disaggregated", "static"), ("decider", "measured")):
                    for p in range(1, n):
                        c = Candidate(p, n - p, 0, tp)
                        r = max_rate(c, steps_for, prompt, args.output, slo, args.duration,
                                     placement, hi)
                        if r > best.get(kind, (-1.0, ""))[0]:
                            best[kind] = (r, c.describe())
                gpus = n * tp
                row = {"model": name, "tp": tp, "gpus": gpus, "prompt": prompt,
                       "output": args.output, "ttft_slo_ms": round(slo.ttft_ms, 1),
                       "tpot_slo_ms": round(slo.tpot_ms, 2),
                       **{k: {"rps_per_gpu": round(v[0] / gpus, 3), "deployment": v[1]}
                          for k, v in best.items()}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'model':<13}{'prompt':>7}{'SLO TTFT/TPOT ms':>19}"
          f"{'colocated':>11}{'disagg.':>9}{'decider':>9}  (req/s per GPU at 90% attainment)")
    for out in rows:
        print(f"{out['model']:<13}{out['prompt']:>7}{out['ttft_slo_ms']:>12.0f} / "
              f"{out['tpot_slo_ms']:<5.1f}{out['colocated']['rps_per_gpu']:>11.3f}"
              f"{out['disaggregated']['rps_per_gpu']:>9.3f}{out['decider']['rps_per_gpu']:>9.3f}"
              f"  best split {out['decider']['deployment']}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
