"""``capgraph demo``: guided generation end to end, offline, with every output checked.

A tiny random Llama writes a batch of outputs under three kinds of guide — a tool-call JSON
schema (bundled in ``capgraph/data``), a date regex and a key=value EBNF grammar — through
:func:`capgraph.generate` with the Tekken tokenizer shipped in mistral-common. Each output that
ended on its stop token is validated independently of the decoder: JSON with ``jsonschema``,
the regex with ``re.fullmatch``, the grammar by a fresh matcher fed the output tokens. The exit
status is 1 if any such output fails.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import re
import sys
from dataclasses import dataclass

from .params import GuidedDecodingConfig, GuidedDecodingParams, GuideType

__all__ = ["DATE_REGEX", "KV_GRAMMAR", "bundled_schema", "read_schema_file", "demo_guides",
           "validate", "run_demo", "add_arguments"]

DATE_REGEX = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"

# bounded repetitions, so a random model reaches the end
KV_GRAMMAR = r'''
root ::= pair (";" pair){0,2}
pair ::= key "=" value
key ::= "name" | "age" | "city" | "unit"
value ::= [a-z]{1,8} | [0-9]{1,3}
'''

DEFAULT_PROMPTS = {
    GuideType.JSON_SCHEMA: ["Call the weather tool for Paris as JSON:",
                            "Which flights leave Oslo tomorrow? Answer with a tool call:"],
    GuideType.REGEX: ["Today's date (YYYY-MM-DD):", "When was the tower finished?"],
    GuideType.EBNF_GRAMMAR: ["Describe the user as key=value pairs:",
                             "Settings for the new account:"],
}


def bundled_schema() -> dict:
    """The tool-call JSON schema shipped in ``capgraph/data/tool_call_schema.json``."""
    text = importlib.resources.files("capgraph").joinpath("data/tool_call_schema.json").read_text()
    return json.loads(text)


def read_schema_file(path: str) -> dict:
    """The JSON schema of ``--schema``: a JSON object (a string would be read as schema text,
    a list is no schema); anything else, or a file that cannot be read or parsed, is a
    :class:`~capgraph.errors.ConfigError` naming the file."""
    from .cli import json_kind, read_json_file
    from .errors import ConfigError
    schema = read_json_file(path, "--schema")
    if not isinstance(schema, dict):
        raise ConfigError(f"--schema {path}: expected a JSON object (a JSON schema), got a "
                          f"JSON {json_kind(schema)}")
    return schema


def demo_guides(schema: dict) -> list[GuidedDecodingParams]:
    """The three guides of the demo: JSON schema, regex, EBNF."""
    return [GuidedDecodingParams.json_schema(schema), GuidedDecodingParams.regex(DATE_REGEX),
            GuidedDecodingParams.ebnf(KV_GRAMMAR)]


@dataclass(frozen=True)
class Verdict:
    ok: bool | None  # None: not checked (the output did not finish on its stop token)
    detail: str


def validate(result, params: GuidedDecodingParams, factory) -> Verdict:
    """Check one output against its guide without the decoder that produced it."""
    if result.finish_reason != "stop":
        return Verdict(None, f"not checked ({result.finish_reason})")
    gt = params.guide_type
    if gt is GuideType.JSON_SCHEMA:
        import jsonschema
        try:
            jsonschema.validate(json.loads(result.text), json.loads(params.guide))
        except (ValueError, jsonschema.ValidationError) as e:
            return Verdict(False, f"invalid JSON: {str(e).splitlines()[0]}")
        return Verdict(True, "valid (jsonschema)")
    if gt is GuideType.REGEX:
        ok = re.fullmatch(params.guide, result.text) is not None
        return Verdict(ok, "valid (re.fullmatch)" if ok else "no re.fullmatch")
    matcher = factory.create(params)
    for i, t in enumerate(result.tokens):
        if not matcher.accept_token(t):
            return Verdict(False, f"token {i} ({t}) rejected by a fresh matcher")
    ok = matcher.is_terminated()
    return Verdict(ok, "valid (fresh matcher)" if ok else "fresh matcher not terminated")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's command-line options (shared by ``capgraph demo``)."""
    p.add_argument("--schema", metavar="FILE",
                   help="JSON schema file for the JSON requests (default: the bundled tool call)")
    p.add_argument("--prompt", metavar="TEXT", help="one prompt for every request "
                   "(default: one per guide kind)")
    p.add_argument("--num-requests", type=int, default=6, metavar="N",
                   help="requests, cycling JSON schema / regex / EBNF (default: 6)")
    p.add_argument("--batch-size", type=int, default=4, metavar="N",
                   help="sequence slots; extra requests join as slots free (default: 4)")
    p.add_argument("--drafter", choices=("none", "model", "ngram", "grammar", "grammar+ngram",
                                         "grammar+model"), default="none",
                   help="speculative decoding: a second tiny model, prompt lookup, the tokens "
                        "the grammar forces (alone or followed by one of the others), or none")
    p.add_argument("--draft-tokens", type=int, default=4, metavar="K",
                   help="drafts per sequence per step with --drafter (default: 4)")
    p.add_argument("--decoder", choices=("eager", "capturable"), default="eager",
                   help="guided decoder: eager, or capturable (host work as stream callbacks)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="on CUDA, run the decode step eagerly instead of replaying graphs")
    p.add_argument("--max-new-tokens", type=int, default=96, metavar="N",
                   help="length limit per request (default: 96)")
    p.add_argument("--seed", type=int, default=0, help="model weights seed (default: 0)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch CPU threads (default: 1; the grammar backend uses its own)")


def run_demo(args: argparse.Namespace) -> int:
    """Generate, print each output with its validation and the timing breakdown."""
    # the schema file first: a bad one is named before any heavy import or load
    schema = read_schema_file(args.schema) if args.schema else bundled_schema()
    import torch

    from .grammar import create_matcher_factory
    from .runtime import generate, tiny_llama
    from .tokenizers import load_tokenizer

    if args.threads > 0:
        torch.set_num_threads(args.threads)  # this process is ours: the CLI owns it
    tok = load_tokenizer("tekken")
    factory = create_matcher_factory(
        GuidedDecodingConfig.from_tokenizer(tok, json_whitespace="compact"))
    kinds = demo_guides(schema)
    guides = [kinds[i % len(kinds)] for i in range(args.num_requests)]
    prompts = [args.prompt or DEFAULT_PROMPTS[g.guide_type][i // len(kinds) % 2]
               for i, g in enumerate(guides)]
    model = tiny_llama(len(tok), seed=args.seed, eos_token_id=tok.eos_token_id)
    print(f"capgraph demo: {len(prompts)} requests, {args.batch_size} slots, tiny random Llama "
          f"(vocab {len(tok)}, Tekken), decoder={args.decoder}, drafter={args.drafter}, "
          f"device={args.device}")
    try:
        results = generate(
            prompts, guides, model=model, tokenizer=tok, factory=factory,
            max_new_tokens=args.max_new_tokens, max_batch_size=args.batch_size,
            draft=args.drafter, num_draft_tokens=args.draft_tokens, decoder=args.decoder,
            cuda_graph=False if args.no_cuda_graph else None, device=args.device,
            seed=args.seed, progress=True)
        failures = 0
        for r, g in zip(results, guides):
            verdict = validate(r, g, factory)
            failures += verdict.ok is False
            shown = r.text if len(r.text) <= 100 else r.text[:97] + "..."
            print(f"[{r.index}] {g.guide_type.value:<12} {r.finish_reason:<6} "
                  f"{len(r.tokens):>3} tok  {verdict.detail}")
            print(f"    {r.error if r.error else json.dumps(shown, ensure_ascii=False)}")
        print(f"timing: {results.timings.summary()}")
        spec = [r for r in results if r.num_draft_tokens]
        if spec:
            acc = sum(r.num_accepted_draft_tokens for r in spec)
            total = sum(r.num_draft_tokens for r in spec)
            print(f"drafts: {acc}/{total} accepted ({acc / total:.0%})")
    finally:
        factory.close()
    if failures:
        print(f"capgraph demo: {failures} output(s) failed validation", file=sys.stderr)
        return 1
    print("all finished outputs validate")
    return 0
