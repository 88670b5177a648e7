#!/usr/bin/env python3
"""GPU: the cost of a replayed guided decode step next to a replayed unguided one.

Runs ``capgraph.generate`` on the same prompts with the same tiny random Llama, CUDA-graph replay
on, the capturable decoder: a warm-up run, then unguided, then every request under the bundled
tool-call JSON schema, all at the same max_new_tokens. The figure is (guided replayed-step time)
/ (unguided replayed-step time), each the generate() "forward" stage (with a graph: the whole
replayed step) divided by its decode steps; the issue's target is <= 1.05 at batch 64. Guided
requests may finish earlier (their grammar completes), which shrinks later steps' batch, so the
table shows both runs' step counts; compare at equal counts. Prints a table; --json writes
every figure. Exits 0 with a message where no CUDA device is present.

Models (--models): ``tiny`` is the demo's model (hidden 64, 2 layers), whose replayed step
(~0.4 ms at batch 64 on an H200) is shorter than the grammar work of 64 rows, so the host
work, not the GPU, sets the guided step's length; ``small`` (hidden 1024, 16 layers, random
weights) has a forward long enough to hide that work, which shows what the overlap gives.
"host build ms/step" is the guided run's mean time in the decoder's host build (inside the
step's host callback, so it overlaps the forward), the figure to hold against the forward.

    python tools/bench_graph_replay.py --batch 64 --steps 64 --models tiny,small
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--steps", type=int, default=64, help="decode steps per request")
    ap.add_argument("--tokenizer", default="tekken")
    ap.add_argument("--models", default="tiny", help="comma-separated: tiny, small")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("bench_graph_replay: no CUDA device, nothing measured")
        return 0
    from capgraph import GuidedDecodingConfig, GuidedDecodingParams, generate
    from capgraph.demo import bundled_schema
    from capgraph.grammar import create_matcher_factory
    from capgraph.runtime import tiny_llama
    from capgraph.tokenizers import load_tokenizer

    sizes = {"tiny": {}, "small": dict(hidden=1024, layers=16, heads=16)}
    models = args.models.split(",")
    unknown = [m for m in models if m not in sizes]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {sorted(sizes)}")
    tok = load_tokenizer(args.tokenizer)
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tok, json_whitespace="compact"))
    guide = GuidedDecodingParams.json_schema(bundled_schema())
    rows = []
    print(f"{'model':>6}{'batch':>6}{'steps u/g':>11}{'unguided ms/step':>18}"
          f"{'guided ms/step':>16}{'ratio':>8}{'host build ms/step':>20}")
    for model_name, batch in ((m, b) for m in models for b in args.batch):
        if not rows or rows[-1]["model"] != model_name:
            model = tiny_llama(len(tok), seed=0, device="cuda", **sizes[model_name])
        prompts = [f"Call {i}:" for i in range(batch)]
        per_step = {}
        for name, guides in (("warmup", None), ("unguided", None), ("guided", [guide] * batch)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            results = generate(prompts, guides, model=model, tokenizer=tok,
                               max_new_tokens=args.steps, max_batch_size=batch,
                               decoder="capturable", cuda_graph=True, device="cuda",
                               factory=factory)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            t = results.timings
            per_step[name] = (t.stages.get("forward", wall) / max(t.steps, 1), t.steps, wall,
                              t.stages.get("build", 0.0) / max(t.steps, 1))
        (ug, ug_steps, _, _), (gd, gd_steps, _, build) = per_step["unguided"], per_step["guided"]
        row = {"model": model_name, "batch": batch, "unguided_steps": ug_steps,
               "guided_steps": gd_steps, "unguided_ms_per_step": ug * 1e3, "guided_ms_per_step": gd * 1e3,
               "ratio": gd / ug, "host_build_ms_per_step": build * 1e3}
        rows.append(row)
        if args.json:  # written per row: a time-boxed run keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        print(f"{model_name:>6}{batch:>6}{f'{ug_steps}/{gd_steps}':>11}{ug * 1e3:>18.3f}"
              f"{gd * 1e3:>16.3f}{gd / ug:>8.3f}{build * 1e3:>20.3f}")
    factory.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
