#!/usr/bin/env python3
"""GPU: the cost of a replayed guided decode step next to a replayed unguided one.

Runs ``capgraph.generate`` on the same prompts with the same random Llama, CUDA-graph replay
on, the capturable decoder: per model one short guided warm-up run per host-node kind, then at
each point (model, batch) an unguided run and one guided run per host-node kind, every request
under the bundled tool-call JSON schema, all at the same max_new_tokens. The figure is (guided
replayed-step time) / (unguided replayed-step time), each the generate() "forward" stage (with
a graph: the whole replayed step) plus its "guide" stage (the guided host work outside the
replay: each step's batch where it is made before the launch, the failures read after the
sync), divided by its decode steps; the issue's target is <= 1.05 at every default point.
"replay ratio" is the same of the "forward" stage alone. Guided requests may finish earlier
(their grammar completes), which shrinks later steps' batch, so the table shows both runs'
step counts; compare at equal counts.

Host-node kinds (--host-node): ``python`` is the host callback that runs the decoder's Python
build under the GIL; ``native`` the C function the decoder's ``host_node="native"`` argument
selects. Where ``capgraph.CapturableGuidedDecoder`` takes no ``host_node`` argument, its one
host node is the Python callback: "python" runs with the decoder's default and "native" is
reported as not available.

Models: ``tiny`` is the demo's model (hidden 64, 2 layers), whose replayed step is shorter
than the grammar work of 64 rows, so the host node, not the GPU, sets the guided step's
length; ``small`` (hidden 1024, 16 layers, random weights) has a forward long enough to hide
that work. "host build ms/step" is the guided run's time in the decoder's Python host build
(run inside the step's host node, so it overlaps the forward) per decode step, and "host build
us/row" the same time per built row (decode rows plus one context row per request); empty
where generate() timed no Python build (a native node's steady-state steps run none).
"native node ms/step" and "us/row" are the native host node's own time (the decoder's
``host_node_stats``, which generate() reports as its "host_node" stage), empty for the
Python callback.

At the ``--before-points`` (default the tiny model's two) the native node also runs in the
other orders ``--compare`` names (default ``native-before,native-unfused``), each against
generate()'s default in the same run:

* ``native-before``: generate() makes a replayed step's guided batch after the graph's launch
  where it can (the native node without speculation: ``batch_after_launch``), so that the host
  work of making and queueing it runs while the GPU runs the forward; this kind makes it
  before the launch (``batch_after_launch=False``).
* ``native-unfused``: generate()'s greedy captured step takes its tokens from the decoder's
  fused masked argmax (``execute_argmax``); this kind masks the logits in place and then takes
  ``argmax`` (``capgraph.runtime.engine._FUSED_ARGMAX = False``).
* ``native-node-last``: generate() captures each step's guided host work (host node and
  bitmask copy) before the forward, so those graph nodes are created ahead of the forward's
  kernels; this kind captures it after the forward, inside ``execute``
  (``capgraph.runtime.engine._HOST_WORK_FIRST = False``).

Before each timed run the tool collects and freezes the heap (``gc.collect(); gc.freeze()``,
as serving engines do after start-up): a full collection of this process (torch, transformers,
the tokenizer: about 370 000 tracked objects) takes about 0.27 s on the CI machine (README,
"Replaying the step without Python", has the command), and one that lands inside a run of
about 50 steps adds several ms to each of them. The collector's time inside each timed run
is kept in the JSON (``unguided_gc_ms``, ``guided_gc_ms``).

``--breakdown`` also times the parts of each guided run's host work outside the replay and
of the batch made after the launch, inclusive of what each calls: ``take_failed`` (the guide
driver's, after the sync), the drain hooks it runs, the decoder's read of the native node's
records (``_node_collect``: ``HostNode.take`` and applying its records) and
``advance_batch``, and of every run's steps: ``generate()``'s decode step whole (``decode
step``, the engine's ``_decode_step``: the step's inputs, the replay, its sync, the tokens
appended) and the graph's launch call in it (``graph launch``, ``ModelRunner.replay``: the
CPU time of ``cudaGraphLaunch``, which a graph with a host node may spend differently); each
as wall and thread CPU time per decode step and as a call count, in the JSON's ``breakdown``
per guided row (and ``unguided_breakdown``, the same parts in the unguided run, where the
guide's parts have no calls) and two lines under it. Where a part's wall time is well
above its CPU time, its thread waited (a lock, the GIL, the scheduler) rather than worked.
The wrappers add about a microsecond a call to the runs they time.

Prints a table; --json writes every figure (rewritten after each row, so a time-boxed run
keeps what it measured). A guided run that raises is reported (in its row, the JSON's
"errors" and exit status 1) and the other runs go on. Exits 0 with a message where no CUDA
device is present; ``--device cpu`` runs the same protocol on the CPU stand-in (no graph
replay: a check of the tool, not a measurement).

    python tools/bench_graph_replay.py --points tiny:64,tiny:256,small:8,small:64,small:256
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import sys
import time
from typing import Any, Callable, Sequence

#: model name -> tiny_llama keyword arguments
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {}, "small": {"hidden": 1024, "layers": 16, "heads": 16}}
#: the points the issue's target names, in the order they run (the host-bound ones first)
DEFAULT_POINTS = "tiny:64,tiny:256,small:8,small:64,small:256"
HOST_NODE_CHOICES = ("python", "native", "both")
#: The native node's other orders (``--compare``): kind -> (batch_after_launch, host work
#: captured before the forward, fused masked argmax) for its runs
COMPARE_KINDS: dict[str, tuple[bool | None, bool, bool]] = {
    "native-before": (False, True, True),
    "native-unfused": (None, True, False),
    "native-node-last": (None, False, True),
}
#: a row's host-side figures (step_figures' keys besides the step time and count)
FIGURE_KEYS = ("host_build_ms_per_step", "host_build_us_per_row", "native_node_ms_per_step",
               "native_node_us_per_row")


def parse_points(text: str) -> list[tuple[str, int]]:
    """``"tiny:64,small:8"`` -> ``[("tiny", 64), ("small", 8)]``; a ValueError names the bad
    entry (unknown model, batch not an integer >= 1, missing colon) or a repeated point."""
    points: list[tuple[str, int]] = []
    for entry in (e.strip() for e in text.split(",")):
        model, sep, batch = entry.partition(":")
        if not sep or model not in MODEL_SIZES:
            raise ValueError(f"point {entry!r}: expected MODEL:BATCH with MODEL one of "
                             f"{', '.join(sorted(MODEL_SIZES))}")
        try:
            b = int(batch)
        except ValueError:
            b = 0
        if b < 1:
            raise ValueError(f"point {entry!r}: batch {batch!r} is not an integer >= 1")
        if (model, b) in points:
            raise ValueError(f"point {entry!r} is given twice")
        points.append((model, b))
    return points


def native_host_node_support(decoder_cls: type | None = None) -> str | None:
    """None when ``decoder_cls`` (default ``capgraph.CapturableGuidedDecoder``) takes a
    ``host_node`` argument, else why not. Follows ``**kwargs`` constructors up the MRO, so a
    subclass that forwards its keywords to a base class that takes the argument counts."""
    if decoder_cls is None:
        from capgraph import CapturableGuidedDecoder
        decoder_cls = CapturableGuidedDecoder
    for cls in decoder_cls.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        if "host_node" in params:
            return None
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return f"{decoder_cls.__name__} takes no host_node argument"


def host_node_runs(choice: str, native_missing: str | None) -> tuple[list[tuple[str, str | None]],
                                                                     dict[str, str]]:
    """Which guided runs to make for ``--host-node choice``: ``[(kind, host_node argument)]``
    (argument None: the decoder's default, used for "python" where the decoder has one host
    node) and ``{kind: why it is not run}``."""
    if choice not in HOST_NODE_CHOICES:
        raise ValueError(f"--host-node {choice!r}: expected one of {', '.join(HOST_NODE_CHOICES)}")
    kinds = ["python", "native"] if choice == "both" else [choice]
    runs: list[tuple[str, str | None]] = []
    missing: dict[str, str] = {}
    for kind in kinds:
        if native_missing is None:
            runs.append((kind, kind))
        elif kind == "python":
            runs.append((kind, None))
        else:
            missing[kind] = f"not available ({native_missing})"
    return runs, missing


def step_figures(results: Any) -> dict[str, Any]:
    """Per-step figures of one generate() call: ms per step (the replayed step and the guided
    host work outside it: generate()'s "forward" and "guide" stages), ms per replayed step
    alone ("forward"), decode steps, and per step and per built row the Python host build's
    time and the native host node's own time (each None where generate() timed no such
    stage)."""
    t = results.timings
    steps = max(t.steps, 1)
    rows = max(sum(r.num_steps for r in results) + len(results), 1)  # decode + context rows
    replay = t.stages.get("forward", t.total_s)
    out = {"ms_per_step": (replay + t.stages.get("guide", 0.0)) / steps * 1e3,
           "replay_ms_per_step": replay / steps * 1e3, "steps": t.steps}
    for stage, key in (("build", "host_build"), ("host_node", "native_node")):
        seconds = t.stages.get(stage)
        out[f"{key}_ms_per_step"] = None if seconds is None else seconds / steps * 1e3
        out[f"{key}_us_per_row"] = None if seconds is None else seconds / rows * 1e6
    return out


#: ``--breakdown``'s parts: (name, module, class or None, function)
BREAKDOWN_PARTS = (
    ("take_failed", "capgraph.runtime.guide", "GuideDriver", "take_failed"),
    ("drain hooks", "hostfunc.api", None, "_run_drain_hooks"),
    ("node records", "capgraph.capturable", "CapturableGuidedDecoder", "_node_collect"),
    ("HostNode.take", "capgraph.build.library", "HostNode", "take"),
    ("apply records", "capgraph.capturable", "CapturableGuidedDecoder", "_apply_node_results"),
    ("advance_batch", "capgraph.capturable", "CapturableGuidedDecoder", "advance_batch"),
    ("decode step", "capgraph.runtime.engine", "_Engine", "_decode_step"),
    ("graph launch", "capgraph.runtime.runner", "ModelRunner", "replay"),
)


class Breakdown:
    """Wall and thread CPU time of :data:`BREAKDOWN_PARTS` while installed (a context
    manager: the wrappers go in on entry and the originals come back on exit)."""

    def __init__(self) -> None:
        self.totals: dict[str, list] = {}  # name -> [wall ns, cpu ns, calls]
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "Breakdown":
        import importlib
        for name, module, cls, fn in BREAKDOWN_PARTS:
            owner = importlib.import_module(module)
            if cls is not None:
                owner = getattr(owner, cls)
            real = getattr(owner, fn, None)
            if real is None:  # (a tree without it)
                continue
            self._undo.append((owner, fn, vars(owner).get(fn)))  # (None: inherited)
            setattr(owner, fn, self._wrap(name, real))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, fn, own in reversed(self._undo):
            if own is None:
                delattr(owner, fn)
            else:
                setattr(owner, fn, own)
        self._undo.clear()

    def _wrap(self, name: str, real: Callable) -> Callable:
        totals = self.totals.setdefault(name, [0, 0, 0])
        wall, cpu = time.perf_counter_ns, time.thread_time_ns

        def timed(*args, **kwargs):
            w0, c0 = wall(), cpu()
            try:
                return real(*args, **kwargs)
            finally:
                totals[0] += wall() - w0
                totals[1] += cpu() - c0
                totals[2] += 1
        return timed

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        """Each part's wall and CPU us per decode step, and its calls."""
        steps = max(steps, 1)
        return {name: {"wall_us_per_step": w / steps / 1e3, "cpu_us_per_step": c / steps / 1e3,
                       "calls": n} for name, (w, c, n) in self.totals.items()}


def format_breakdown(parts: dict[str, dict[str, float]], run: str = "") -> str:
    """One line of :meth:`Breakdown.per_step`: ``name wall/cpu`` us per step (``run``: a
    word before it, such as ``unguided``)."""
    return f"  {run + ' ' if run else ''}breakdown, us per step (wall/cpu): " + ", ".join(
        f"{name} {p['wall_us_per_step']:.1f}/{p['cpu_us_per_step']:.1f}"
        for name, p in parts.items())


def _cell(value: float | None, width: int, spec: str = ".3f") -> str:
    return f"{'-' if value is None else format(value, spec):>{width}}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=DEFAULT_POINTS,
                    help=f"comma-separated MODEL:BATCH (default {DEFAULT_POINTS})")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per request")
    ap.add_argument("--warmup-steps", type=int, default=4,
                    help="decode steps of each model's guided warm-up run")
    ap.add_argument("--host-node", default="both", choices=HOST_NODE_CHOICES)
    ap.add_argument("--before-points", default="tiny:64,tiny:256",
                    help="points that also run the native node in the --compare kinds' "
                         "orders; empty: none")
    ap.add_argument("--compare", default="native-before,native-unfused",
                    help=f"comma-separated kinds run at --before-points, of "
                         f"{', '.join(COMPARE_KINDS)} (see above)")
    ap.add_argument("--tokenizer", default="tekken")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the parts of each guided run's host work (see above)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    try:
        points = parse_points(args.points)
        before_points = set(parse_points(args.before_points)) if args.before_points else set()
    except ValueError as e:
        ap.error(str(e))
    compare = list(dict.fromkeys(k for k in args.compare.split(",") if k))  # (once each)
    unknown = [k for k in compare if k not in COMPARE_KINDS]
    if unknown:
        ap.error(f"--compare {args.compare!r}: unknown kind(s) {unknown}; choose from "
                 f"{', '.join(COMPARE_KINDS)}")
    if args.steps < 1 or args.warmup_steps < 1:
        ap.error(f"--steps {args.steps} and --warmup-steps {args.warmup_steps} must be >= 1")
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_graph_replay: no CUDA device, nothing measured")
        return 0
    from capgraph import GuidedDecodingConfig, GuidedDecodingParams, generate
    from capgraph.demo import bundled_schema
    from capgraph.grammar import create_matcher_factory
    from capgraph.runtime import tiny_llama
    from capgraph.tokenizers import load_tokenizer

    runs, missing = host_node_runs(args.host_node, native_host_node_support())
    for kind, why in missing.items():
        print(f"{kind}: {why}")
    tok = load_tokenizer(args.tokenizer)
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tok, json_whitespace="compact"))
    guide = GuidedDecodingParams.json_schema(bundled_schema())
    device_name = (torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    out: dict[str, Any] = {
        "device": device_name, "replayed": args.device == "cuda", "steps": args.steps,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host_nodes": {**{k: "measured" for k, _ in runs}, **missing}, "rows": []}

    # (a tree whose generate() has no batch_after_launch makes every batch before the launch;
    # one without _HOST_WORK_FIRST captures the host work after the forward)
    has_order = "batch_after_launch" in inspect.signature(generate).parameters
    from capgraph.runtime import engine
    has_first = hasattr(engine, "_HOST_WORK_FIRST")
    has_fused = hasattr(engine, "_FUSED_ARGMAX")

    gc_seconds = [0.0]  # the collector's time inside the latest timed run
    gc_started = [0.0]

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_seconds[0] += time.perf_counter() - gc_started[0]

    gc.callbacks.append(on_gc)

    def run(model, prompts, guides, max_new_tokens, host_node, after_launch=None,
            host_work_first=True, fused=True):
        if args.device == "cuda":
            torch.cuda.synchronize()
        gc.collect()
        gc.freeze()
        gc_seconds[0] = 0.0
        order = {"batch_after_launch": after_launch} if has_order else {}
        flags = {name: value for name, value, present in (
            ("_HOST_WORK_FIRST", host_work_first, has_first),
            ("_FUSED_ARGMAX", fused, has_fused)) if present}
        saved = {name: getattr(engine, name) for name in flags}
        for name, value in flags.items():
            setattr(engine, name, value)
        try:
            return generate(prompts, guides, model=model, tokenizer=tok,
                            max_new_tokens=max_new_tokens, max_batch_size=len(prompts),
                            decoder="capturable", cuda_graph=True, device=args.device,
                            factory=factory, host_node=host_node, **order)
        finally:
            for name, value in saved.items():
                setattr(engine, name, value)

    print(f"{'model':>6}{'batch':>6}{'host node':>18}{'steps u/g':>11}{'unguided ms/step':>18}"
          f"{'guided ms/step':>16}{'ratio':>8}{'replay ratio':>14}{'host build ms/step':>20}"
          f"{'host build us/row':>19}{'native node ms/step':>21}{'native node us/row':>20}")
    model_name, model = None, None
    errors: list[str] = []  # a failing guided run is reported and the others still run

    def guarded(what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
        try:
            return fn(), None
        except Exception as e:  # noqa: BLE001 - named in the row, the JSON and the exit code
            error = f"{type(e).__name__}: {e}"
            errors.append(f"{what}: {error}")
            print(f"{what}: failed: {error}")
            return None, error

    def write() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(out, errors=errors), f, indent=1)

    try:
        for name, batch in points:
            prompts = [f"Call {i}:" for i in range(batch)]
            if name != model_name:
                model_name, model = name, tiny_llama(len(tok), seed=0, device=args.device,
                                                     **MODEL_SIZES[name])
                for kind, host_node in runs:  # first-use costs (kernel compile, grammar cache)
                    guarded(f"{name} warm-up, {kind} host node",
                            lambda: run(model, prompts, [guide] * batch, args.warmup_steps + 1,
                                        host_node))
            unguided_breakdown = Breakdown() if args.breakdown else None
            with unguided_breakdown or contextlib.nullcontext():
                unguided = step_figures(run(model, prompts, None, args.steps, None))
            unguided_gc_ms = gc_seconds[0] * 1e3
            kinds = [(kind, host_node, None, True, True) for kind, host_node in runs]
            if (name, batch) in before_points and ("native", "native") in runs:
                present = {"native-before": has_order, "native-unfused": has_fused,
                           "native-node-last": has_first}
                kinds += [(kind, "native", *COMPARE_KINDS[kind]) for kind in compare
                          if present[kind]]
                for kind in compare:
                    if not present[kind]:
                        print(f"{kind}: not available in this tree's generate() (skipped)")
            for kind, host_node, after_launch, first, fused in kinds:
                breakdown = Breakdown() if args.breakdown else None
                with breakdown or contextlib.nullcontext():
                    results, error = guarded(
                        f"{name} batch {batch}, {kind} host node",
                        lambda: run(model, prompts, [guide] * batch, args.steps, host_node,
                                    after_launch, first, fused))
                if error is not None:
                    out["rows"].append({"model": name, "batch": batch, "host_node": kind,
                                        "error": error})
                    write()
                    continue
                guided = step_figures(results)
                ratio = guided["ms_per_step"] / unguided["ms_per_step"]
                replay_ratio = guided["replay_ms_per_step"] / unguided["replay_ms_per_step"]
                row = {"model": name, "batch": batch, "host_node": kind,
                       "unguided_steps": unguided["steps"], "guided_steps": guided["steps"],
                       "unguided_ms_per_step": unguided["ms_per_step"],
                       "guided_ms_per_step": guided["ms_per_step"], "ratio": ratio,
                       "replay_ratio": replay_ratio, "unguided_gc_ms": unguided_gc_ms,
                       "guided_gc_ms": gc_seconds[0] * 1e3,
                       **{k: guided[k] for k in FIGURE_KEYS}}
                if breakdown is not None and unguided_breakdown is not None:
                    row["breakdown"] = breakdown.per_step(guided["steps"])
                    row["unguided_breakdown"] = unguided_breakdown.per_step(unguided["steps"])
                out["rows"].append(row)
                write()
                counts = f"{unguided['steps']}/{guided['steps']}"
                print(f"{name:>6}{batch:>6}{kind:>18}{counts:>11}"
                      f"{unguided['ms_per_step']:>18.3f}{guided['ms_per_step']:>16.3f}"
                      f"{ratio:>8.3f}{replay_ratio:>14.3f}"
                      f"{_cell(row['host_build_ms_per_step'], 20)}"
                      f"{_cell(row['host_build_us_per_row'], 19, '.2f')}"
                      f"{_cell(row['native_node_ms_per_step'], 21)}"
                      f"{_cell(row['native_node_us_per_row'], 20, '.2f')}")
                if breakdown is not None:
                    print(format_breakdown(row["unguided_breakdown"], "unguided"))
                    print(format_breakdown(row["breakdown"]))
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
        factory.close()
    write()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
