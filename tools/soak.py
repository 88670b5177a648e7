#!/usr/bin/env python3
"""Soak: thousands of guided steps with requests joining and leaving slots, speculative decoding
on, and every finished output checked for validity; prints throughput, memory and leak figures.

Each slot holds a request following one of several bounded grammars (two JSON schemas, two
regexes, an EBNF grammar), an unguided request, or a request whose guide does not compile
(it must come back in the failed list, alone). The "model" is random but valid: its logits for
(request, position) are a fixed random row, whitespace-only tokens penalised; the sampler takes
the argmax of the *masked* logits, so every output that ends must satisfy its grammar. A drafter
proposes ``runtime_draft_len`` tokens per step: a random-length prefix of what the target will
sample (a shadow matcher predicts it) followed by random tokens; verification accepts drafts that
equal the target's samples and, at random, rejects a matching one and samples the second-best
allowed token instead. Requests are also aborted at random.

Checks per step: no NaN, no guided row without a finite entry, every sampled guided row masked,
no failure except the expected ones. Per finished request: JSON outputs pass ``json.loads`` and
``jsonschema``; regex outputs pass ``re.fullmatch``; EBNF outputs are accepted by a fresh matcher
and match an equivalent Python regex; the bytes decode as strict UTF-8. At the end: every slot is
released, ``decoder.num_active_matchers == 0`` and ``hostfunc.live_entries()`` is back where it
started. Resident memory (VmRSS) is read after warm-up and at the end.

    python tools/soak.py --steps 5000 --decoder graph
    python tools/soak.py --steps 2000 --decoder eager --backend llguidance

``--decoder``: ``eager`` (GuidedDecoder), ``capturable`` (CapturableGuidedDecoder, callbacks on
hostfunc's CPU stand-in), ``graph`` (the capturable step captured once into a HostGraph and
replayed every step). ``--advance`` (with ``--drafts 0``, capturable and graph): a step of the
same requests as the step before, in its order, is queued with ``advance_batch`` (their tokens
alone); the run's random choices and outputs are those of the run without it. Exits non-zero
if any check failed.

    python tools/soak.py --steps 2000 --decoder graph --drafts 0 --advance
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import hostfunc
from capgraph import GuidedDecodingConfig, GuidedDecodingParams, LayoutError
from capgraph.bitmask import allocate_host_bitmask
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.grammar import GrammarMatcher, GrammarMatcherFactory, create_matcher_factory
from capgraph.ops import logits_bitmask
from capgraph.requests import GuidedRequest

__all__ = ["SoakGrammar", "SoakReport", "Soak", "soak_grammars", "run_soak", "rss_bytes",
           "decoded_vocab", "main"]

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "get_time", "search"]},
        "args": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "args"],
    "additionalProperties": False,
}

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 6},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 10}]},
    },
    "required": ["id", "items", "express"],
    "additionalProperties": False,
}

EMAIL = r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)"
PHONE = r"\+[0-9]{1,3} \([0-9]{3}\) [0-9]{3}-[0-9]{4}"
GREETING_GBNF = r'''root ::= greet " " name ("," " " name){0,3} "!"
greet ::= "hello" | "hi" | "hey"
name ::= [A-Z] [a-z]{1,7}
'''
GREETING_LARK = r'''start: GREET " " NAME names "!"
names: | ", " NAME | ", " NAME ", " NAME | ", " NAME ", " NAME ", " NAME
GREET: "hello" | "hi" | "hey"
NAME: /[A-Z][a-z]{1,7}/
'''
GREETING_RE = r"(hello|hi|hey) [A-Z][a-z]{1,7}(, [A-Z][a-z]{1,7}){0,3}!"
BAD_GUIDE = GuidedDecodingParams.regex("(unclosed[")


@dataclass(frozen=True)
class SoakGrammar:
    """A bounded grammar (random sampling inside it ends quickly) and how to check an output."""

    name: str
    params: GuidedDecodingParams
    check_text: Callable[[str], bool]
    check_matcher: bool = False  # also replay the tokens through a fresh matcher


def _json_check(schema: dict) -> Callable[[str], bool]:
    import jsonschema
    validator = jsonschema.Draft202012Validator(schema)

    def check(text: str) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return validator.is_valid(value)
    return check


def _regex_check(pattern: str) -> Callable[[str], bool]:
    compiled = re.compile(pattern)
    return lambda text: compiled.fullmatch(text) is not None


def soak_grammars(backend: str) -> list[SoakGrammar]:
    """The grammars of the soak for ``backend`` (EBNF is GBNF for xgrammar, Lark for llguidance)."""
    ebnf = GREETING_GBNF if backend == "xgrammar" else GREETING_LARK
    return [
        SoakGrammar("json_tool", GuidedDecodingParams.json_schema(TOOL_SCHEMA),
                    _json_check(TOOL_SCHEMA)),
        SoakGrammar("json_order", GuidedDecodingParams.json_schema(ORDER_SCHEMA),
                    _json_check(ORDER_SCHEMA)),
        SoakGrammar("regex_email", GuidedDecodingParams.regex(EMAIL), _regex_check(EMAIL)),
        SoakGrammar("regex_phone", GuidedDecodingParams.regex(PHONE), _regex_check(PHONE)),
        SoakGrammar("ebnf_greeting", GuidedDecodingParams.ebnf(ebnf), _regex_check(GREETING_RE),
                    check_matcher=True),
    ]


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS of /proc/self/status), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0  # pragma: no cover - non-Linux


def decoded_vocab(factory: GrammarMatcherFactory) -> list[bytes]:
    """The bytes of every token id (xgrammar's view of the tokenizer), padding ids empty."""
    info = getattr(factory, "tokenizer_info", None)  # the xgrammar factory already has one
    if info is None:
        from capgraph.grammar.xgrammar_backend import build_tokenizer_info
        info = build_tokenizer_info(factory.config)
    config = factory.config
    vocab = list(info.decoded_vocab)
    return vocab + [b""] * (config.vocab_size_padded - len(vocab))


@dataclass
class _Request:
    rid: int
    slot: int
    grammar: SoakGrammar | None  # None: unguided
    bad: bool  # its guide does not compile: it must fail at its first step
    seed: int
    max_tokens: int
    committed: list[int] = field(default_factory=list)  # sampled tokens; the last not yet fed
    acc_prev: int = 0
    started: bool = False
    shadow: GrammarMatcher | None = None
    shadow_fed: int = 0

    @property
    def params(self) -> GuidedDecodingParams | None:
        if self.bad:
            return BAD_GUIDE
        return self.grammar.params if self.grammar else None


@dataclass
class SoakReport:
    """What a soak run saw; ``problems`` is empty when every check passed."""

    steps: int = 0
    seconds: float = 0.0
    requests: int = 0
    tokens: int = 0
    finished_valid: dict[str, int] = field(default_factory=dict)
    capped: int = 0
    aborted: int = 0
    unguided: int = 0
    expected_failures: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    random_rejections: int = 0
    rss_warm: int = 0
    rss_end: int = 0
    rss_max: int = 0
    matchers_end: int = -1
    live_entries_start: int = 0
    live_entries_end: int = -1
    cache_nbytes_max: int = 0
    #: hash of every finished output, in request order (equal across decoder kinds and
    #: batch orders)
    outputs_digest: str = ""
    #: steps queued with advance_batch (``advance=True``): the same requests as the step before
    advanced: int = 0
    #: the graph decoder's host node: "native (runs, of which Python steps)" or "python"
    host_node: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        mb = 1 << 20
        return (f"steps={self.steps} steps/s={self.steps_per_s:.1f} requests={self.requests} "
                f"tokens={self.tokens} valid={sum(self.finished_valid.values())} "
                f"{dict(sorted(self.finished_valid.items()))} capped={self.capped} "
                f"aborted={self.aborted} unguided={self.unguided} "
                f"expected_failures={self.expected_failures} "
                f"drafts accepted/proposed={self.drafts_accepted}/{self.drafts_proposed} "
                f"random_rejections={self.random_rejections}\n"
                f"rss warm={self.rss_warm / mb:.1f} MiB end={self.rss_end / mb:.1f} MiB "
                f"max={self.rss_max / mb:.1f} MiB growth={(self.rss_end - self.rss_warm) / mb:+.1f}"
                f" MiB; matchers_end={self.matchers_end} live_entries "
                f"start={self.live_entries_start} end={self.live_entries_end}; "
                f"cache_nbytes_max={self.cache_nbytes_max}; outputs={self.outputs_digest}; "
                + (f"host_node={self.host_node}; " if self.host_node else "")
                + (f"advanced steps={self.advanced}; " if self.advanced else "")
                + f"problems={len(self.problems)}")


class Soak:
    """The soak loop over one decoder. Call :meth:`step` repeatedly, then :meth:`finish`."""

    def __init__(self, factory: GrammarMatcherFactory, decoder: str = "eager", *, slots: int = 6,
                 drafts: int = 3, seed: int = 0, join_p: float = 0.7, abort_p: float = 0.005,
                 bad_p: float = 0.04, unguided_p: float = 0.1, reject_p: float = 0.1,
                 max_tokens: int = 120, table_rows: int = 31,
                 vocab_bytes: list[bytes] | None = None, advance: bool = False) -> None:
        if decoder not in ("eager", "capturable", "graph"):
            raise ValueError(f"decoder must be eager, capturable or graph, got {decoder!r}")
        if advance and (decoder == "eager" or drafts):
            raise ValueError("advance needs the capturable decoder (capturable or graph) and "
                             "drafts=0: advance_batch continues a batch without drafts")
        cfg = factory.config
        self.factory, self.kind = factory, decoder
        self.S, self.K = slots, drafts
        self.V, self.vocab = cfg.vocab_size_padded, cfg.tokenizer_vocab_size
        self.eos = cfg.stop_token_ids[0]
        self.rng = random.Random(seed)
        self.join_p, self.abort_p, self.bad_p = join_p, abort_p, bad_p
        self.unguided_p, self.reject_p, self.max_tokens = unguided_p, reject_p, max_tokens
        self.grammars = soak_grammars(factory.backend_name)
        self.vocab_bytes = vocab_bytes if vocab_bytes is not None else decoded_vocab(factory)
        # The model: fixed random rows; whitespace-only tokens penalised so that flexible
        # whitespace (JSON) does not make random outputs run on.
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(table_rows, self.V, generator=g)
        ws = [i for i, b in enumerate(self.vocab_bytes) if b and not b.strip()]
        self.table[:, ws] -= 6.0
        cls = GuidedDecoder if decoder == "eager" else CapturableGuidedDecoder
        self.decoder = cls(cfg, slots, drafts, factory=factory)
        self.live: dict[int, _Request] = {}
        self.next_rid = 0
        gc.collect()  # (what earlier runs in this process left in reference cycles goes first)
        self.report = SoakReport(live_entries_start=hostfunc.live_entries())
        self._outputs: list[tuple[int, list[int]]] = []  # (the digest's, at the end)
        # advance: the latest batch's requests in its order, while the next step may be
        # queued with advance_batch (None: make it with add_batch)
        self.advance = advance
        self._advance_order: list[_Request] | None = None
        self._row = allocate_host_bitmask(1, self.V)
        self.graph: hostfunc.HostGraph | None = None
        if decoder == "graph":
            self.static = torch.zeros(slots * (drafts + 1), self.V)
            # unguided placeholders: the capture only needs the batch's shapes
            placeholders = [GuidedRequest.placeholder(-1 - i, drafts) for i in range(slots)]
            self.decoder.add_batch(placeholders, runtime_draft_len=drafts)
            self.graph = hostfunc.HostGraph()
            with hostfunc.capture(self.graph):
                self.decoder.execute(self.static)
        for gr in self.grammars:  # compiled before warm-up, so RSS after it is steady
            factory.compile(gr.params)

    # -- helpers -----------------------------------------------------------------------------
    def _problem(self, text: str) -> None:
        if len(self.report.problems) < 200:
            self.report.problems.append(f"step {self.report.steps}: {text}")

    def _rows(self, req: _Request, start: int, n: int) -> list[torch.Tensor]:
        """The model's logits rows for positions ``start .. start + n - 1`` (views)."""
        P = self.table.shape[0]
        return [self.table[(req.seed * 7 + start + i) % P] for i in range(n)]

    def _new_request(self, slot: int) -> _Request:
        rng = self.rng
        self.next_rid += 1
        u = rng.random()
        bad = u < self.bad_p
        grammar = None if bad or u < self.bad_p + self.unguided_p else rng.choice(self.grammars)
        req = _Request(self.next_rid, slot, grammar, bad, rng.randrange(1 << 30),
                       rng.randint(4, 24) if grammar is None and not bad else self.max_tokens)
        self.report.requests += 1
        return req

    def _sync_shadow(self, req: _Request) -> bool:
        if req.shadow is None:
            req.shadow = self.factory.create(req.grammar.params)  # type: ignore[union-attr]
        for t in req.committed[req.shadow_fed:]:
            if not req.shadow.accept_token(t):
                name = req.grammar.name  # type: ignore[union-attr]
                self._problem(f"request {req.rid} ({name}): a fresh matcher rejects committed "
                              f"token {t} at {req.shadow_fed}")
                return False
            req.shadow_fed += 1
        return True

    def _propose(self, req: _Request, rl: int) -> list[int]:
        """A prefix of what the target will sample (shadow-predicted), then random tokens."""
        rng = self.rng
        predicted: list[int] = []
        n_text = rng.randint(0, rl)
        if req.grammar is not None and n_text and self._sync_shadow(req):
            shadow, pos0 = req.shadow, len(req.committed)
            assert shadow is not None
            for i in range(n_text):
                if shadow.is_terminated():
                    break
                self._row.zero_()
                shadow.fill_next_token_bitmask(self._row, 0)
                row = self._rows(req, pos0 + i, 1)[0].unsqueeze(0).clone()
                logits_bitmask(row, self._row)
                t = int(row.max(dim=1).indices)
                if not shadow.accept_token(t):
                    break
                predicted.append(t)
            shadow.rollback(len(predicted))
        while len(predicted) < rl:
            predicted.append(self.eos if rng.random() < 0.03 else rng.randrange(self.vocab))
        if rl and rng.random() < 0.1:  # an engine may propose fewer than the step's length
            predicted = predicted[:rng.randint(0, rl)]
        return predicted

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> None:
        rng, dec = self.rng, self.decoder
        for slot in range(self.S):
            if slot not in self.live and rng.random() < self.join_p:
                self.live[slot] = self._new_request(slot)
            elif slot in self.live and self.live[slot].started and rng.random() < self.abort_p:
                self._retire(self.live[slot], "aborted")
        order = list(self.live.values())
        rng.shuffle(order)  # batch order is free; rows follow it
        if not order:
            self.report.steps += 1
            return
        rl = rng.randint(0, self.K)
        reqs, drafts, starts = [], {}, {}
        prev, self._advance_order = self._advance_order, None
        advanced = False
        if prev is not None and len(prev) == len(order) \
                and {id(r) for r in prev} == {id(r) for r in order}:
            try:  # the same requests as the step before, in its order: their tokens alone
                dec.advance_batch([r.committed[-1] for r in prev])  # type: ignore[union-attr]
            except LayoutError:
                pass
            else:
                advanced = True
                self.report.advanced += 1
                for _ in prev:  # (the draws _propose makes for no drafts: the run's random
                    rng.randint(0, rl)  # choices stay those of the same run without advance)
                order = prev
                reqs = list(dec.requests.requests)  # type: ignore[union-attr]
                starts = {r.rid: len(r.committed) for r in order}
        if not advanced:
            for r in order:
                if not r.started:
                    reqs.append(GuidedRequest.context(r.rid, r.slot, r.params))
                    starts[r.rid] = 0
                    continue
                d = self._propose(r, rl)
                drafts[r.rid] = d
                self.report.drafts_proposed += len(d)
                reqs.append(GuidedRequest.generation(r.rid, r.slot, r.params, r.committed[-1],
                                                     draft_tokens=d,
                                                     num_accepted_draft_tokens=r.acc_prev))
                starts[r.rid] = len(r.committed)
            dec.add_batch(reqs, runtime_draft_len=rl)
        if self.advance:
            self._advance_order = order
        layout = dec.requests
        assert layout is not None
        if self.kind == "eager":
            dec.rollback_rejected_tokens()
        elif any(r.is_generation_in_progress_state for r in reqs):
            dec.rollback_rejected_batch(torch.tensor(  # type: ignore[attr-defined]
                [1 + (r.num_accepted_draft_tokens or 0) for r in reqs], dtype=torch.int32))
        n = layout.num_bitmask_tokens
        logits = torch.stack([row for r, q in zip(order, reqs)
                              for row in self._rows(r, starts[r.rid], q.num_rows(rl))])
        if self.kind == "eager":
            failed = dec.execute(logits)
        elif self.kind == "capturable":
            dec.execute(logits)
            failed = dec.take_failed_requests()
        else:
            self.static[:n].copy_(logits)
            self.graph.replay()  # type: ignore[union-attr]
            hostfunc.drain()
            failed = dec.take_failed_requests()
            logits = self.static[:n]
        self._settle(order, reqs, layout.offsets, drafts, logits, dict(failed))
        self.report.steps += 1

    def _settle(self, order, reqs, offsets, drafts, logits, failed: dict[int, str]) -> None:
        # one reduction for the whole step: the sample of each row, and whether it is finite
        # (a NaN anywhere in a row makes its max NaN)
        best, index = logits.max(dim=1)
        if best.isnan().any():
            self._problem("NaN in masked logits")
        finite = best.isfinite().tolist()
        all_samples = index.tolist()
        token_mask = self.decoder.token_mask_host.tolist()
        for r, q, off in zip(order, reqs, offsets):
            if r.rid in failed:
                if r.bad:
                    self.report.expected_failures += 1
                    self._retire(r, None)
                else:
                    self._problem(f"request {r.rid} failed unexpectedly: {failed[r.rid]}")
                    self._retire(r, None)
                continue
            if r.bad:
                self._problem(f"request {r.rid} with a bad guide was not reported failed")
                self._retire(r, None)
                continue
            d = drafts.get(r.rid, [])
            samples = all_samples[off:off + 1 + len(d)]
            a, bonus, done = 0, None, False
            for i, t in enumerate(d):
                if t != samples[i]:
                    break
                if self.rng.random() < self.reject_p:
                    alt = self._second_best(logits[off + i], t)
                    if alt is not None:
                        bonus = alt
                        self.report.random_rejections += 1
                        break
                a += 1
                if r.grammar is not None and t == self.eos:
                    done = True
                    break
            used = a + (0 if done else 1)  # rows sampled from
            if r.grammar is not None:
                for i in range(used):
                    if not token_mask[off + i]:
                        self._problem(f"request {r.rid} ({r.grammar.name}) sampled an unmasked "
                                      f"row {i}")
                    elif not finite[off + i]:
                        self._problem(f"request {r.rid}: guided row {i} has no finite entry")
            if bonus is None and not done:
                bonus = samples[a]
            new = d[:a] + ([] if done else [bonus])
            r.committed += new
            r.acc_prev = a
            r.started = True
            self.report.tokens += len(new)
            self.report.drafts_accepted += a
            if r.grammar is None:
                if len(r.committed) >= r.max_tokens:
                    self.report.unguided += 1
                    self._retire(r, None)
            elif r.committed[-1] == self.eos:
                self._finish(r)
            elif len(r.committed) >= r.max_tokens:
                self.report.capped += 1
                self._sync_shadow(r)  # a capped output must still be a valid prefix
                self._retire(r, None)
        self.report.cache_nbytes_max = max(self.report.cache_nbytes_max, self.factory.cache.nbytes)

    def _second_best(self, row: torch.Tensor, exclude: int) -> int | None:
        alt = row.clone()
        alt[exclude] = float("-inf")
        t = int(alt.max(dim=0).indices)
        return t if torch.isfinite(alt[t]) else None

    def _finish(self, r: _Request) -> None:
        g = r.grammar
        assert g is not None
        body = r.committed[:-1]
        try:
            text = b"".join(self.vocab_bytes[t] for t in body).decode("utf-8")
        except UnicodeDecodeError as e:
            self._problem(f"request {r.rid} ({g.name}): output is not UTF-8: {e}")
            self._retire(r, None)
            return
        ok = g.check_text(text)
        if ok and g.check_matcher:
            m = self.factory.create(g.params)
            ok = all(m.accept_token(t) for t in r.committed) and m.is_terminated()
        self._outputs.append((r.rid, list(r.committed)))
        if ok:
            self.report.finished_valid[g.name] = self.report.finished_valid.get(g.name, 0) + 1
        else:
            self._problem(f"request {r.rid} ({g.name}): invalid output {text!r}")
        self._retire(r, None)

    def _retire(self, r: _Request, why: str | None) -> None:
        if why == "aborted":
            self.report.aborted += 1
        self.decoder.release(r.slot)
        self.live.pop(r.slot, None)

    # -- end ---------------------------------------------------------------------------------
    def finish(self) -> SoakReport:
        """Release every slot, drop the graph and the decoder, and take the end figures."""
        for r in list(self.live.values()):
            self._retire(r, None)
        rep = self.report
        rep.matchers_end = self.decoder.num_active_matchers
        rep.outputs_digest = hashlib.sha256(
            repr(sorted(self._outputs)).encode()).hexdigest()[:16]
        if self.graph is not None:
            stats = getattr(self.decoder, "host_node_stats", None)
            rep.host_node = "python" if stats is None else \
                f"native ({stats.runs} steps, {stats.python_runs} of them Python steps; " \
                f"{stats.rollback_runs} rollbacks, {stats.python_rollback_runs} of them " \
                "Python's)"
            self.graph.reset()
            self.graph = None
        hostfunc.drain()
        self.decoder.close()  # a capturable one stops its host stream; the factory stays open
        gc.collect()
        rep.live_entries_end = hostfunc.live_entries()
        rep.rss_end = rss_bytes()
        rep.rss_max = max(rep.rss_max, rep.rss_end)
        if rep.matchers_end != 0:
            self._problem(f"{rep.matchers_end} matchers still held after releasing every slot")
        if rep.live_entries_end != rep.live_entries_start:
            self._problem(f"hostfunc live entries {rep.live_entries_start} -> "
                          f"{rep.live_entries_end}")
        return rep


def run_soak(factory: GrammarMatcherFactory, steps: int, decoder: str = "eager", *,
             warmup: int | None = None, progress: bool = False, **kwargs: Any) -> SoakReport:
    """Run ``steps`` soak steps on ``factory``; RSS is sampled after ``warmup`` steps."""
    soak = Soak(factory, decoder, **kwargs)
    warmup = min(steps, max(20, steps // 5)) if warmup is None else warmup
    rep = soak.report
    t0 = time.perf_counter()
    for i in range(steps):
        soak.step()
        if i + 1 == warmup:
            gc.collect()
            rep.rss_warm = rss_bytes()
        if i + 1 >= warmup and (i + 1) % 50 == 0:
            rep.rss_max = max(rep.rss_max, rss_bytes())
        if progress and (i + 1) % 500 == 0:
            print(f"  {i + 1}/{steps} steps, {(i + 1) / (time.perf_counter() - t0):.1f} steps/s, "
                  f"rss {rss_bytes() / (1 << 20):.1f} MiB", flush=True)
    rep.seconds = time.perf_counter() - t0
    return soak.finish()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--decoder", choices=["eager", "capturable", "graph", "all"],
                        default="all")
    parser.add_argument("--backend", choices=["xgrammar", "llguidance"], default="xgrammar")
    parser.add_argument("--tokenizer", default="tekken")
    parser.add_argument("--slots", type=int, default=6)
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--advance", action="store_true",
                        help="queue a step of the same requests as the step before with "
                             "advance_batch (capturable and graph decoders; needs --drafts 0)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from capgraph.tokenizers import load_tokenizer
    tok = load_tokenizer(args.tokenizer)
    config = GuidedDecodingConfig.from_tokenizer(tok, backend=args.backend)
    factory = create_matcher_factory(config)
    vocab_bytes = decoded_vocab(factory)
    kinds = ["eager", "capturable", "graph"] if args.decoder == "all" else [args.decoder]
    failed = False
    for kind in kinds:
        print(f"soak: decoder={kind} backend={args.backend} tokenizer={args.tokenizer} "
              f"steps={args.steps} slots={args.slots} drafts={args.drafts} seed={args.seed} "
              f"torch_threads={torch.get_num_threads()}",
              flush=True)
        rep = run_soak(factory, args.steps, kind, warmup=args.warmup, progress=True,
                       slots=args.slots, drafts=args.drafts, seed=args.seed,
                       vocab_bytes=vocab_bytes, advance=args.advance and kind != "eager")
        print(rep.summary(), flush=True)
        for p in rep.problems[:20]:
            print("  PROBLEM", p)
        failed |= bool(rep.problems)
    factory.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
