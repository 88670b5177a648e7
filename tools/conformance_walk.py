"""Differential walk: random outputs of ``GuidedDecoder`` under JSON-schema masks, each one
validated with ``jsonschema``. Every output capgraph lets through must satisfy its schema.

For each schema (the bundled JSON Schema Bench sample, ``capgraph/data/jsonschemabench.jsonl``,
and small random schemas from :func:`random_schema`), the schema is compiled under the default
policy; a refused schema is counted, not walked. Walkable schemas are decoded in batches
through the public decoder API (``add_batch`` / ``execute`` with random logits, one allowed
token sampled per row and fed back as ``new_token``) until a stop token or the length cap.
A finished output that is not JSON, or that ``jsonschema`` (the schema's ``$schema`` draft,
else 2020-12, with format checks) rejects, is counted invalid and printed. The row
``xgrammar-tag`` walks each schema on xgrammar as a structural tag's ``json_schema`` element.

    python tools/conformance_walk.py                      # bench + 200 random, every row
    python tools/conformance_walk.py --walks 4 --random 1000 --backends xgrammar
    python tools/conformance_walk.py --record             # the run docs/CONFORMANCE.md cites

Exit status 1 if any output is invalid. ``tests/test_conformance_walk.py`` runs a short
version of the same walk.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "capgraph" / "data" / "jsonschemabench.jsonl"
RECORD = ROOT / "docs" / "conformance_walk.json"
RECORD_ARGS = ["--tokenizer", "tekken", "--walks", "2", "--random", "200", "--seed", "0"]
#: the walk's rows: a backend, or ``"xgrammar-tag"``: each schema on xgrammar as the
#: ``json_schema`` element of a structural tag ``<t>...</t>``
BACKENDS = ("xgrammar", "llguidance", "fallback", "xgrammar-tag")


@dataclass
class Counts:
    schemas: int = 0  #: guides given (schemas; for walk_guides any guides)
    refused: int = 0
    walked: int = 0  #: schemas walked (compiled under the default policy)
    validated: int = 0  #: finished outputs checked with jsonschema
    invalid: int = 0
    unfinished: int = 0  #: walks that hit the length cap
    failed: int = 0  #: walks the decoder reported as failed (dead end, matcher error)
    examples: list[str] = field(default_factory=list)  #: the first invalid outputs


def bench_schemas() -> list[dict]:
    """The bundled JSON Schema Bench sample (schema objects only)."""
    with open(BENCH, encoding="utf-8") as f:
        return [json.loads(line)["schema"] for line in f if line.strip()]


# -- a generator of small random schemas --------------------------------------------------------
_WORDS = ("a", "b", "id", "name", "x_1", "tags")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A small schema mixing the keywords of the JSON Schema vocabulary, nested up to three
    levels (many of them are refused by one backend or both; that is counted too)."""
    kinds = ["integer", "number", "string", "boolean", "null", "enum", "const"]
    if depth < 3:
        kinds += ["object", "object", "array", "anyOf", "oneOf", "allOf", "ref"]
    kind = rng.choice(kinds)
    s: dict[str, Any]
    if kind in ("integer", "number"):
        s = {"type": kind}
        if rng.random() < 0.5:
            s["minimum"] = rng.randint(-5, 5)
        if rng.random() < 0.4:
            s["maximum"] = s.get("minimum", -5) + rng.randint(0, 50)
        if rng.random() < 0.2:
            s["exclusiveMinimum" if rng.random() < 0.5 else "exclusiveMaximum"] = \
                rng.randint(-5, 60)
        if rng.random() < 0.2:
            s["multipleOf"] = rng.choice([2, 3, 5, 0.5])
    elif kind == "string":
        s = {"type": "string"}
        if rng.random() < 0.4:
            s["minLength"] = rng.randint(0, 3)
        if rng.random() < 0.4:
            s["maxLength"] = s.get("minLength", 0) + rng.randint(0, 6)
        if rng.random() < 0.3:
            s["pattern"] = rng.choice(["^[a-z]+$", "^[0-9]{2,4}$", "^a", "b$", "^(ab|cd)*$"])
        if rng.random() < 0.2:
            s["format"] = rng.choice(["date", "email", "uuid", "ipv4", "time", "date-time"])
    elif kind in ("boolean", "null"):
        s = {"type": kind}
    elif kind == "enum":
        s = {"enum": rng.sample([1, 2.5, "a", "b", None, True, [1], {"k": 1}], rng.randint(1, 4))}
        if rng.random() < 0.3:
            s["type"] = rng.choice(["string", "integer", "number"])
    elif kind == "const":
        s = {"const": rng.choice([0, "x", None, False, [1, 2], {"k": "v"}])}
    elif kind == "object":
        names = rng.sample(_WORDS, rng.randint(0, 3))
        s = {"type": "object",
             "properties": {n: random_schema(rng, depth + 1) for n in names}}
        if names and rng.random() < 0.6:
            s["required"] = rng.sample(names, rng.randint(1, len(names)))
        if rng.random() < 0.5:
            s["additionalProperties"] = rng.choice([False, True, {"type": "integer"}])
        if rng.random() < 0.15:
            s["patternProperties"] = {"^p": random_schema(rng, depth + 1)}
        if rng.random() < 0.15:
            s["maxProperties"] = rng.randint(0, 3)
        if rng.random() < 0.1:
            s["propertyNames"] = {"maxLength": 3}
    elif kind == "array":
        s = {"type": "array", "items": random_schema(rng, depth + 1)}
        if rng.random() < 0.3:
            s["prefixItems"] = [random_schema(rng, depth + 1)]
        if rng.random() < 0.4:
            s["minItems"] = rng.randint(0, 2)
        if rng.random() < 0.4:
            s["maxItems"] = s.get("minItems", 0) + rng.randint(0, 3)
        if rng.random() < 0.15:
            s["uniqueItems"] = True
    elif kind == "ref":
        s = {"$defs": {"d": random_schema(rng, depth + 1)}, "$ref": "#/$defs/d"}
        if depth:  # $defs only resolve from the root: wrap at the root below
            s = random_schema(rng, depth + 1)
    else:  # anyOf / oneOf / allOf
        s = {kind: [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
        if rng.random() < 0.2:
            s["minimum"] = 0
    return s


def random_schemas(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]


# -- the walk -----------------------------------------------------------------------------------
#: Formats whose jsonschema check follows the standard without optional packages ("time"
#: and "date-time" need rfc3339-validator, "uri" rfc3987, "hostname" fqdn; without them
#: jsonschema either skips them or, for "time", refuses RFC 3339 times with an offset).
CHECKED_FORMATS = ("date", "email", "ipv4", "ipv6", "uuid")


def _validator(schema: Any) -> Any:
    from jsonschema import Draft202012Validator, FormatChecker, validators
    cls = validators.validator_for(schema, default=Draft202012Validator)
    return cls(schema, format_checker=FormatChecker(formats=CHECKED_FORMATS))


def make_factory(tokenizer: Any, backend: str) -> Any:
    """A factory for ``backend`` (``"fallback"``: xgrammar, llguidance where it refuses;
    ``"xgrammar-tag"``: xgrammar)."""
    from capgraph import GuidedDecodingConfig
    from capgraph.grammar import create_matcher_factory
    if backend == "fallback":
        config = GuidedDecodingConfig.from_tokenizer(tokenizer, json_unenforced_keywords="fallback")
    else:
        config = GuidedDecodingConfig.from_tokenizer(
            tokenizer, backend=backend.removesuffix("-tag"))
    return create_matcher_factory(config)


#: the structural tag a schema is walked inside with ``in_tag``
TAG_BEGIN, TAG_END = "<t>", "</t>"


def walk(factory: Any, tokenizer: Any, schemas: Sequence[Any], *, walks: int = 1,
         max_tokens: int = 160, batch: int = 32, seed: int = 0, in_tag: bool = False) -> Counts:
    """Walk every schema ``walks`` times through one ``GuidedDecoder`` on ``factory``; a
    finished output must parse as JSON and validate against its schema. With ``in_tag`` each
    schema is the ``json_schema`` element of a structural tag (:data:`TAG_BEGIN`,
    :data:`TAG_END`), and an output must be that tag around such JSON."""
    from capgraph import GuidedDecodingParams

    def check(schema: Any) -> Checker:
        def valid(text: str) -> bool:
            if in_tag:
                if not (text.startswith(TAG_BEGIN) and text.endswith(TAG_END)):
                    return False
                text = text[len(TAG_BEGIN):len(text) - len(TAG_END)]
            try:
                return bool(_validator(schema).is_valid(json.loads(text)))
            except ValueError:
                return False
        return valid

    def params(schema: Any) -> Any:
        if not in_tag:
            return GuidedDecodingParams.json_schema(schema)
        return GuidedDecodingParams.structural_tag(json.dumps({
            "type": "structural_tag", "format": {
                "type": "tag", "begin": TAG_BEGIN, "end": TAG_END,
                "content": {"type": "json_schema", "json_schema": schema}}}))

    guides = [(params(schema), check(schema), json.dumps(schema)) for schema in schemas]
    return walk_guides(factory, tokenizer, guides, walks=walks, max_tokens=max_tokens,
                       batch=batch, seed=seed, tilt=JSON_TILT)


#: a checker of finished outputs: valid, invalid, or None (no verdict)
Checker = Callable[[str], "bool | None"]
#: texts whose last token the walk's random logits favour, with their weights: the JSON walk
#: draws the characters that end things (quotes, brackets) so that most walks finish
JSON_TILT = (('"', 7.0), ("}", 8.0), ("]", 8.0), (",", 4.0), ("1", 5.0), ("a", 4.0))


def walk_guides(factory: Any, tokenizer: Any, guides: Sequence[tuple[Any, Checker, str]], *,
                walks: int = 1, max_tokens: int = 160, batch: int = 32, seed: int = 0,
                tilt: Sequence[tuple[str, float]] = JSON_TILT) -> Counts:
    """Walk every guide ``(params, checker, label)`` ``walks`` times through one
    ``GuidedDecoder`` on ``factory``: a guide that does not compile is counted refused; each
    finished output (a stop token drawn) goes to its checker, and one it calls invalid is
    counted and kept (``label -> output``) in :attr:`Counts.examples`."""
    import torch

    from capgraph import GuidedDecoder, GuidedRequest
    from capgraph.errors import GrammarCompileError

    counts = Counts(schemas=len(guides))
    jobs: list[tuple[Any, Checker, str]] = []  # one per walk
    for params, checker, label in guides:
        try:
            factory.compile(params)
        except GrammarCompileError:
            counts.refused += 1
            continue
        counts.walked += 1
        jobs += [(params, checker, label)] * walks
    if not jobs:
        return counts
    config = factory.config
    V = config.vocab_size_padded
    stops = set(config.stop_token_ids or ())
    gen = torch.Generator().manual_seed(seed)
    # random logits, tilted towards the tokens of ``tilt`` and the stop tokens so that most
    # walks finish under the cap; any allowed token can be drawn
    tilted = torch.zeros(V)
    for text, weight in tilt:
        for t in tokenizer.encode(text, add_special_tokens=False)[-1:]:
            tilted[t] += weight
    tilted[list(stops)] += 10.0
    dec = GuidedDecoder(config, max_num_sequences=batch, vocab_size_padded=V, factory=factory)
    queue = list(enumerate(jobs))
    active: dict[int, tuple[int, list[int]]] = {}  # slot -> (job index, tokens so far)
    free = list(range(batch))
    try:
        while queue or active:
            requests = []
            order = []
            for slot, (j, toks) in sorted(active.items()):
                requests.append(GuidedRequest.generation(j, slot, jobs[j][0], toks[-1]))
                order.append(slot)
            while queue and free:
                j, _ = queue.pop()
                slot = free.pop()
                active[slot] = (j, [])
                requests.append(GuidedRequest.context(j, slot, jobs[j][0]))
                order.append(slot)
            dec.add_batch(requests)
            # logits: [rows, V]; masked in place, then one token drawn per row
            logits = torch.randn(len(requests), V, generator=gen) + tilted
            failed = {rid for rid, _ in dec.execute(logits)}
            # a softmax sample by the Gumbel-max trick; a row with nothing allowed stays -inf
            noise = torch.rand(logits.shape, generator=gen).clamp_(min=1e-20).log_().neg_().log_()
            best, drawn = (logits - noise).max(dim=1)
            dead = best == float("-inf")
            for row, slot in enumerate(order):
                j, toks = active[slot]
                if j in failed or bool(dead[row]):
                    counts.failed += 1
                    _finish(active, free, slot)
                    continue
                token = int(drawn[row])
                if token in stops:
                    _check(counts, tokenizer, jobs[j][1], jobs[j][2], toks)
                    _finish(active, free, slot)
                elif len(toks) + 1 >= max_tokens:
                    counts.unfinished += 1
                    _finish(active, free, slot)
                else:
                    toks.append(token)
    finally:
        dec.close()
    return counts


def _finish(active: dict, free: list, slot: int) -> None:
    del active[slot]
    free.append(slot)


def _check(counts: Counts, tokenizer: Any, checker: Checker, label: str,
           tokens: list[int]) -> None:
    from capgraph.tokenizers import decode_continuation
    text = decode_continuation(tokenizer, tokens)
    verdict = checker(text)
    if verdict is None:
        return
    counts.validated += 1
    if not verdict:
        counts.invalid += 1
        if len(counts.examples) < 10:
            counts.examples.append(f"{label[:300]} -> {text[:300]!r}")


def print_counts(results: dict[str, Counts], guides: str) -> None:
    """The table of ``backend -> Counts`` (``guides``: what the second column counts), each
    invalid output after its backend's row."""
    width = max([11, *map(len, results)])
    print(f"{'backend':<{width}} {guides:>8} {'refused':>7} {'walked':>6} {'validated':>9} "
          f"{'invalid':>7} {'unfinished':>10} {'failed':>6}")
    for backend, c in results.items():
        print(f"{backend:<{width}} {c.schemas:>8} {c.refused:>7} {c.walked:>6} "
              f"{c.validated:>9} {c.invalid:>7} {c.unfinished:>10} {c.failed:>6}")
        for example in c.examples:
            print(f"  INVALID {example}")


#: one row of a walk table: its name, its guides ``(params, checker, label)`` and the tilt
Suite = tuple[str, Sequence[tuple[Any, Checker, str]], Sequence[tuple[str, float]]]


def walk_backends(tokenizer_name: str, backends: Iterable[str],
                  suites: Callable[[str], Iterable[Suite]], *, walks: int, seed: int,
                  max_tokens: int) -> dict[str, Counts]:
    """Walk the suites ``suites(backend)`` gives for each backend (:func:`walk_guides`), one
    factory per backend with its defaults; the counts by row name."""
    from capgraph import GuidedDecodingConfig
    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import load_tokenizer
    tokenizer = load_tokenizer(tokenizer_name)
    out = {}
    for backend in backends:
        factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
            tokenizer, backend=backend))
        try:
            for name, guides, tilt in suites(backend):
                out[name] = walk_guides(factory, tokenizer, guides, walks=walks, seed=seed,
                                        max_tokens=max_tokens, tilt=tilt)
        finally:
            factory.close()
    return out


def walk_arguments(description: str, what: str,
                   backends: Sequence[str]) -> argparse.ArgumentParser:
    """The command line the random walks share: ``--tokenizer``, ``--backends``, ``--<what>``
    (how many, default 300), ``--walks``, ``--seed``, ``--max-tokens``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tokenizer", default="tekken")
    parser.add_argument("--backends", nargs="+", default=list(backends), choices=backends)
    parser.add_argument(f"--{what}", type=int, default=300)
    parser.add_argument("--walks", type=int, default=4, help="walks per guide")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=24)
    return parser


def run(tokenizer_name: str, backends: Iterable[str], walks: int, n_random: int, seed: int,
        max_tokens: int) -> dict[str, Counts]:
    from capgraph.tokenizers import load_tokenizer
    tokenizer = load_tokenizer(tokenizer_name)
    schemas = bench_schemas() + random_schemas(n_random, seed)
    out = {}
    for backend in backends:
        factory = make_factory(tokenizer, backend)
        try:
            out[backend] = walk(factory, tokenizer, schemas, walks=walks, seed=seed,
                                max_tokens=max_tokens, in_tag=backend.endswith("-tag"))
        finally:
            factory.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="tekken")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--walks", type=int, default=2, help="walks per schema")
    parser.add_argument("--random", type=int, default=200, help="random schemas besides the bench")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--record", action="store_true",
                        help=f"run {' '.join(RECORD_ARGS)} and write {RECORD.relative_to(ROOT)}")
    args = parser.parse_args(RECORD_ARGS if argv is None and "--record" in sys.argv[1:]
                             else argv)
    record = argv is None and "--record" in sys.argv[1:]
    start = time.perf_counter()
    results = run(args.tokenizer, args.backends, args.walks, args.random, args.seed,
                  args.max_tokens)
    print_counts(results, "schemas")
    print(f"({time.perf_counter() - start:.0f} s)")
    if record:
        RECORD.write_text(json.dumps({
            "command": "python tools/conformance_walk.py " + " ".join(RECORD_ARGS),
            "backends": {b: {k: v for k, v in asdict(c).items() if k != "examples"}
                         for b, c in results.items()}}, indent=1) + "\n")
        print(f"wrote {RECORD.relative_to(ROOT)}; regenerate docs/CONFORMANCE.md with "
              "python tools/conformance_table.py")
    return 1 if any(c.invalid for c in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
