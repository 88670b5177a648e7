"""Draft trees: a request's drafts as a tree (tokens and parent indices) instead of a chain.

Every mask row of a tree is checked against a brute force that walks each root-to-node path
with a fresh matcher; the accepted path is kept by the rollback and the next step continues
where a fresh matcher fed the accepted tokens stands; bad trees fail alone; the native
strategies (which hand trees to the Python loop) and the capturable decoder give the same rows.
"""

from __future__ import annotations

import random

import pytest
import torch

import hostfunc

from capgraph import GuidedDecodingParams, GuideType
from capgraph.bitmask import allocate_host_bitmask
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest
from capgraph.tokenizers import encode_continuation
from cases import CASES
from conftest import assert_steps_agree, settled_live_entries

TREE_CASES = [c for c in CASES if c.params.guide_type in
              (GuideType.JSON_SCHEMA, GuideType.REGEX, GuideType.EBNF_GRAMMAR)]
K = 6  # max_num_draft_tokens: tree nodes per request


@pytest.fixture(scope="module")
def factory(factory_cache):
    return factory_cache("tekken")


class Sequence:
    """One guided sequence walking its case's valid text, with a random draft tree (or chain)
    per step whose text-following branch the verification accepts part of."""

    def __init__(self, slot: int, case, tokens: list[int], pool: list[int]) -> None:
        self.slot, self.case, self.tokens, self.pool = slot, case, tokens, pool
        self.p = -1  # position of the newest token (-1: the context step comes next)
        self.node: int | None = None  # accepted node of the previous tree, None after a chain
        self.accepted = 0  # accepted drafts of the previous step
        self.drafts: list[int] = []
        self.parents: list[int] | None = None

    @property
    def done(self) -> bool:
        return self.p >= len(self.tokens)  # (the stop token was fed as a new token)

    def request(self, rng: random.Random, rl: int) -> GuidedRequest:
        if self.p < 0:
            return GuidedRequest.context(self.slot, self.slot, self.case.params)
        n = rng.randint(1, K)
        text = self.tokens[self.p + 1:]
        drafts, parents, depth, on_text = [], [], [], []
        for j in range(n):
            parent = rng.choice([-1] + list(range(j)))
            d = 0 if parent < 0 else depth[parent] + 1
            follows = parent < 0 or on_text[parent]
            if follows and d < len(text) and rng.random() < 0.6:
                token, exact = text[d], True
            else:
                token = rng.choice(self.pool) if rng.random() < 0.8 else rng.randrange(1000, 100000)
                exact = follows and d < len(text) and token == text[d]
            drafts.append(token)
            parents.append(parent)
            depth.append(d)
            on_text.append(exact)
        chain = rng.random() < 0.25
        if chain:  # a chain: the drafts in order, accepted as a prefix
            parents = [-1] + list(range(n - 1))
            depth = list(range(n))
            on_text = [all(drafts[i] == text[i] if i < len(text) else False for i in range(j + 1))
                       for j in range(n)]
        self.drafts, self.parents = drafts, None if chain else parents
        self._depth, self._on_text = depth, on_text
        req = GuidedRequest.generation(
            self.slot, self.slot, self.case.params, self.tokens[self.p], draft_tokens=drafts,
            num_accepted_draft_tokens=self.accepted, draft_parents=self.parents,
            accepted_draft_node=self.node, prev_seq_slot=self.slot)
        return req

    def verify(self, rng: random.Random, rl: int) -> None:
        """Accept a random node of the text branch among those with rows (or none)."""
        if self.p < 0:
            self.p, self.accepted, self.node = 0, 0, None
            return
        n = min(len(self.drafts), rl)
        # (a bonus token follows the accepted drafts: the stop token comes as a new token)
        left = len(self.tokens) - self.p - 1
        candidates = [-1] + [j for j in range(n) if self._on_text[j] and self._depth[j] + 1 < left]
        node = rng.choice(candidates)
        depth = 0 if node < 0 else self._depth[node] + 1
        self.p += 1 + depth
        self.accepted = depth
        self.node = None if self.parents is None else node


def path_tokens(drafts: list[int], parents: list[int], j: int) -> list[int]:
    path = []
    while j >= 0:
        path.append(drafts[j])
        j = parents[j]
    return path[::-1]


def brute_force_rows(factory, params, prefix: list[int], drafts: list[int],
                     parents: list[int], rl: int) -> list[torch.Tensor | None]:
    """Row 0 and each node's row as a fresh matcher fed ``prefix`` then the node's path
    gives it (None: unguided: a refused token, a terminating stop token, no row)."""
    V = factory.config.vocab_size_padded
    stops = set(factory.config.stop_token_ids)
    rows: list[torch.Tensor | None] = []
    for j in [-1] + list(range(len(drafts))):
        if j >= rl:
            rows.append(None)
            continue
        matcher = factory.create(params)
        feed = prefix + ([] if j < 0 else path_tokens(drafts, parents, j))
        ok = True
        for t in feed:
            if matcher.is_terminated() or not matcher.accept_token(t):
                ok = False
                break
        if not ok or (feed and feed[-1] in stops and matcher.is_terminated()):
            rows.append(None)
            continue
        row = allocate_host_bitmask(1, V)
        matcher.fill_next_token_bitmask(row, 0)
        rows.append(row[0].clone())
    return rows


def make_sequences(factory, case_names: list[str]) -> list[Sequence]:
    tok = factory.config.tokenizer
    stop = factory.config.stop_token_ids[0]
    seqs = []
    for slot, name in enumerate(case_names):
        case = next(c for c in TREE_CASES if c.name == name)
        tokens = encode_continuation(tok, case.valid) + [stop]
        seqs.append(Sequence(slot, case, tokens, sorted(set(tokens))))
    return seqs


def run(factory, seed: int, case_names: list[str], decoders, check_brute_force: bool,
        capturable: CapturableGuidedDecoder | None = None, graphed: bool = False,
        sit_out: float = 0.0) -> int:
    """Drive ``decoders`` (eager) and ``capturable`` (tokens from the token tensor, accepted
    nodes from a tensor; ``graphed``: its step captured once in a HostGraph and replayed)
    through the sequences' steps; every decoder's masked logits must agree, and
    (``check_brute_force``) every row must equal the brute force's. ``sit_out``: the chance
    that a live sequence is left out of a step (at least one takes part): it comes back
    later with the rollback of its last step. Returns how many times a sequence whose last
    step was a tree with an accepted node came back after sitting out."""
    rng = random.Random(seed)
    gaps = 0
    sat_out: set[int] = set()
    seqs = make_sequences(factory, case_names)
    V = factory.config.vocab_size_padded
    S = len(seqs)
    graph = static = None
    if capturable is not None and graphed:
        static = torch.zeros(S * (K + 1), V)
        capturable.add_batch([GuidedRequest.placeholder(-1 - i, K) for i in range(S)],
                             runtime_draft_len=K)  # shapes for the capture
        graph = hostfunc.HostGraph()
        with hostfunc.capture(graph):
            capturable.execute(static)
    step = 0
    while not all(s.done for s in seqs):
        live = [s for s in seqs if not s.done]
        if sit_out:
            playing = [s for s in live if rng.random() >= sit_out] or live[:1]
            gaps += sum(s.slot in sat_out and s.node is not None and s.node >= 0
                        for s in playing)
            sat_out = {s.slot for s in live if s not in playing}
            live = playing
        rl = K if rng.random() < 0.7 else rng.randint(1, K)
        reqs = [s.request(rng, rl) for s in live]
        logits = torch.randn(sum(r.num_rows(rl) for r in reqs), V,
                             generator=torch.Generator().manual_seed(seed + step))
        results = []
        for dec in decoders:
            dec.add_batch(reqs, runtime_draft_len=rl)
            dec.rollback_rejected_tokens()
            out = logits.clone()
            assert dec.execute(out) == [], f"step {step}"
            n = dec.requests.num_bitmask_tokens
            results.append((out, dec.token_mask_host[:n].clone(), dec.requests.offsets))
        if capturable is not None:
            tokens = torch.zeros(K + 1, S, dtype=torch.int32)
            creqs = []
            for r in reqs:
                c = GuidedRequest.snapshot(r)
                if not c.is_context_init_state:
                    tokens[0, r.seq_slot] = r.new_token
                    tokens[1:1 + len(r.draft_tokens), r.seq_slot] = torch.tensor(r.draft_tokens)
                    c.new_token, c.draft_tokens = None, None
                c.accepted_draft_node = None  # (comes from the tensor below)
                creqs.append(c)
            capturable.add_batch(creqs, tokens, runtime_draft_len=rl)
            if step:
                capturable.rollback_rejected_batch(
                    torch.tensor([(r.num_accepted_draft_tokens or 0) + 1 for r in reqs]),
                    torch.tensor([-1 if r.accepted_draft_node is None else r.accepted_draft_node
                                  for r in reqs]))
            if graph is not None:
                static.zero_()
                static[:logits.shape[0]].copy_(logits)
                graph.replay()
                hostfunc.drain()
                out = static[:logits.shape[0]].clone()
            else:
                out = logits.clone()
                capturable.execute(out)
            assert capturable.take_failed_requests() == [], f"step {step}"
            n = capturable.requests.num_bitmask_tokens
            results.append((out, capturable.token_mask_host[:n].clone(),
                            capturable.requests.offsets))
        first = results[0]
        for other in results[1:]:
            assert torch.equal(first[1], other[1]), f"token mask, step {step}"
            assert torch.equal(first[0], other[0]), f"masked logits, step {step}"
        if check_brute_force:
            dec = decoders[0]
            for s, r, offset in zip(live, reqs, dec.requests.offsets):
                prefix = s.tokens[:s.p + 1]
                parents = s.parents if s.parents is not None else \
                    [-1] + list(range(len(s.drafts) - 1))
                if r.is_context_init_state:
                    expect = brute_force_rows(factory, s.case.params, [], [], [], 0)
                else:
                    expect = brute_force_rows(factory, s.case.params, prefix, s.drafts,
                                              parents, rl)
                for k, e in enumerate(expect[:r.num_rows(rl)]):  # (no rows past rl)
                    row = offset + k
                    if e is None:
                        assert not dec.token_mask_host[row], f"{s.case.name} node {k - 1}"
                    else:
                        assert dec.token_mask_host[row], f"{s.case.name} node {k - 1}"
                        assert torch.equal(dec.bitmask_host[row], e), \
                            f"{s.case.name} step {step} node {k - 1}"
        for s in live:
            s.verify(rng, rl)
        step += 1
    for dec in decoders + ([capturable] if capturable is not None else []):
        for s in seqs:
            assert dec.grammar_matchers[s.slot].is_terminated(), s.case.name
    if graph is not None:
        graph.reset()
    return gaps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_rows_equal_brute_force_over_every_path(factory, seed):
    """Over random draft trees (and some chains) on JSON schemas, a regex and grammars, each
    node's row is the mask a fresh matcher gives after the root's token and the node's path
    (unguided where the grammar refuses or stops a token on it, or past the runtime draft
    length); after each verification the accepted path is kept, so every next step's rows
    are a fresh matcher's after all accepted tokens, up to termination."""
    names = ["json_schema_tool", "regex_phone", "ebnf_arith"] if seed % 2 == 0 else \
        ["json_schema_order", "ebnf_csv"]
    dec = GuidedDecoder(factory.config, 3, K, factory=factory, host_build="python")
    run(factory, seed, names, [dec], check_brute_force=True)


@pytest.mark.parametrize("seed", [3, 4])
def test_native_and_capturable_equal_python_on_trees(factory, seed):
    """The native strategies (which hand tree requests to the Python loop and build chains
    in C++) and the capturable decoder (tree tokens from its token tensor, accepted nodes
    from a tensor) mask every logit as the Python build does, step after step."""
    names = ["json_schema_tool", "regex_phone", "ebnf_csv"]
    decs = [GuidedDecoder(factory.config, 3, K, factory=factory, host_build=b)
            for b in ("python", "native-loop", "auto")]
    capt = CapturableGuidedDecoder(factory.config, 3, K, factory=factory)
    try:
        run(factory, seed, names, decs, check_brute_force=False, capturable=capt)
    finally:
        capt.close()


def test_capturable_hostgraph_replay_equals_eager_on_trees(factory):
    """The capturable decoder's step captured once in a HostGraph and replayed each step
    (tree tokens from the token tensor, parents from the requests, accepted nodes through
    rollback_rejected_batch) masks every logit as the eager decoder does."""
    live = settled_live_entries()
    eager = GuidedDecoder(factory.config, 2, K, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 2, K, factory=factory)
    try:
        run(factory, 6, ["json_schema_order", "regex_phone"], [eager], check_brute_force=False,
            capturable=capt, graphed=True)
    finally:
        capt.close()
    assert hostfunc.live_entries() == live


@pytest.mark.parametrize("seed", [7, 8])
def test_tree_path_kept_while_its_request_sits_out_steps(factory, seed):
    """A request left out of one or more steps (other requests built meanwhile) between its
    tree step and the rollback still has the accepted path of its tree kept: every row of
    every step equals the brute force's."""
    dec = GuidedDecoder(factory.config, 3, K, factory=factory, host_build="python")
    gaps = run(factory, seed, ["json_schema_tool", "regex_phone", "ebnf_arith"], [dec],
               check_brute_force=True, sit_out=0.35)
    assert gaps > 0  # (a tree request with an accepted node came back after sitting out)


@pytest.mark.parametrize("graphed", [False, True])
def test_sit_outs_agree_across_strategies_and_capturable(factory, graphed):
    """With requests sitting out steps, the native strategies and the capturable decoder
    (eager, or replayed from a HostGraph with the native host node where it is available)
    mask every logit as the Python build does."""
    decs = [GuidedDecoder(factory.config, 3, K, factory=factory, host_build=b)
            for b in (("python", "native-loop", "auto") if not graphed else ("python",))]
    capt = CapturableGuidedDecoder(factory.config, 3, K, factory=factory)
    try:
        gaps = run(factory, 9, ["json_schema_tool", "regex_phone", "ebnf_csv"], decs,
                   check_brute_force=False, capturable=capt, graphed=graphed, sit_out=0.35)
    finally:
        capt.close()
    assert gaps > 0


#: the decoders of the sit-out tests: (name, how the rollback is given)
GAP_DECODERS = [("python", "tokens"), ("native-loop", "tokens"), ("auto", "tokens"),
                ("capturable", "tokens"), ("capturable", "batch"), ("capturable", "nodes"),
                ("graphed", "batch"), ("graphed", "nodes")]


class _GapDriver:
    """One decoder of :data:`GAP_DECODERS` with two slots, driven step by step: each step
    ``(requests, accepted counts, accepted nodes)``; returns the failures and the masked
    rows (token mask and bitmask) of each request."""

    def __init__(self, factory, kind: str, rollback: str) -> None:
        self.kind, self.rollback = kind, rollback
        self.V = V = factory.config.vocab_size_padded
        self.graph = self.static = None
        if kind in ("python", "native-loop", "auto"):
            self.dec = GuidedDecoder(factory.config, 2, 4, factory=factory, host_build=kind)
            return
        self.dec = CapturableGuidedDecoder(factory.config, 2, 4, factory=factory,
                                           host_node="auto" if kind == "graphed" else "python")
        if kind == "graphed":  # (the native host node serves every step after the capture)
            self.static = torch.zeros(10, V)
            self.dec.add_batch([GuidedRequest.placeholder(-1, 4),
                                GuidedRequest.placeholder(-2, 4)])
            self.graph = hostfunc.HostGraph()
            with hostfunc.capture(self.graph):
                self.dec.execute(self.static)

    def step(self, reqs, counts=None, nodes=None):
        dec, V = self.dec, self.V
        n = sum(r.num_rows(4) for r in reqs)
        logits = torch.zeros(n, V)
        dec.add_batch(reqs)
        if self.rollback == "tokens":
            dec.rollback_rejected_tokens()
        else:
            dec.rollback_rejected_batch(
                torch.tensor(counts or [1] * len(reqs), dtype=torch.int32),
                torch.tensor(nodes or [-1] * len(reqs), dtype=torch.int32)
                if self.rollback == "nodes" else None)
        if self.graph is not None:
            self.static.zero_()
            self.graph.replay()
            hostfunc.drain()
            failed = dec.take_failed_requests()
        elif isinstance(dec, CapturableGuidedDecoder):
            dec.execute(logits)
            failed = dec.take_failed_requests()
        else:
            failed = dec.execute(logits)
        mask = dec.token_mask_host[:n].clone()
        return sorted(failed), mask, dec.bitmask_host[:n][mask.bool()].clone()

    def close(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        if isinstance(self.dec, CapturableGuidedDecoder):
            self.dec.close()


def _gap_case(tekken):
    case = next(c for c in TREE_CASES if c.name == "json_schema_tool")
    other = next(c for c in TREE_CASES if c.name == "regex_phone")
    return case, other, encode_continuation(tekken, case.valid), \
        encode_continuation(tekken, other.valid)


@pytest.mark.parametrize("sit_outs", [1, 3])
@pytest.mark.parametrize("kind,rollback", GAP_DECODERS)
def test_tree_request_back_after_sitting_out_keeps_its_path(factory, tekken, kind, rollback,
                                                             sit_outs):
    """A request verifies a draft tree (text[1..3] on the path to node 3, beside refused
    nodes), then sits out ``sit_outs`` steps in which another request is built, then comes
    back with node 3 accepted and the bonus token text[4]: no failure, and its rows are
    those of the same drafts verified as a chain (a matcher fed text[0..4])."""
    case, other, text, text2 = _gap_case(tekken)
    results = []
    for tree in (True, False):
        d = _GapDriver(factory, kind, rollback)
        try:
            steps = [([GuidedRequest.context(7, 0, case.params),
                       GuidedRequest.context(8, 1, other.params)], None, None)]
            if tree:
                first = GuidedRequest.generation(
                    7, 0, case.params, text[0], draft_tokens=[text[1], 17, text[2], text[3]],
                    draft_parents=[-1, -1, 0, 2])
            else:
                first = GuidedRequest.generation(7, 0, case.params, text[0],
                                                 draft_tokens=text[1:4])
            steps.append(([first, GuidedRequest.generation(8, 1, other.params, text2[0])],
                          None, None))
            for k in range(sit_outs):  # (request 7 is left out; request 8 is built)
                steps.append(([GuidedRequest.generation(8, 1, other.params, text2[1 + k])],
                              None, None))
            back = GuidedRequest.generation(7, 0, case.params, text[4],
                                            draft_tokens=text[5:7],
                                            num_accepted_draft_tokens=3,
                                            accepted_draft_node=3 if tree else None)
            steps.append(([back], [4], [3 if tree else -1]))
            outs = [d.step(*s) for s in steps]
        finally:
            d.close()
        assert all(o[0] == [] for o in outs), [o[0] for o in outs]
        results.append(outs[-1])
    (_, tree_mask, tree_rows), (_, chain_mask, chain_rows) = results
    assert tree_mask.tolist()[:3] == [1, 1, 1]  # (row 0 and the two drafts)
    assert torch.equal(tree_mask, chain_mask) and torch.equal(tree_rows, chain_rows)
    fresh = factory.create(case.params)
    for t in text[:5]:
        assert fresh.accept_token(t)
    row = allocate_host_bitmask(1, factory.config.vocab_size_padded)
    fresh.fill_next_token_bitmask(row, 0)
    assert torch.equal(tree_rows[0], row[0])


@pytest.mark.parametrize("kind,rollback", GAP_DECODERS)
def test_stale_tree_not_applied_after_the_slot_is_built_again(factory, tekken, kind, rollback):
    """After a tree step and a sit-out, the slot's tree is not applied once the slot is built
    again: (a) the request comes back without a rollback (its matcher at the root), steps
    on as a chain and then rolls back a chain; (b) a new request takes the slot (a context
    step, no release) and rolls back its own chain. Both equal the same steps on a decoder
    that never saw the tree."""
    case, other, text, text2 = _gap_case(tekken)
    tree = GuidedRequest.generation(7, 0, case.params, text[0],
                                    draft_tokens=[text[1], 17, text[2], text[3]],
                                    draft_parents=[-1, -1, 0, 2])
    for scenario in ("back", "new"):
        outs = []
        for with_tree in (True, False):
            d = _GapDriver(factory, kind, rollback)
            try:
                steps = [([GuidedRequest.context(7, 0, case.params),
                           GuidedRequest.context(8, 1, other.params)], None, None)]
                if with_tree:
                    steps += [([GuidedRequest.snapshot(tree)], None, None)]
                else:  # (the same token, no drafts)
                    steps += [([GuidedRequest.generation(7, 0, case.params, text[0])],
                               None, None)]
                steps += [([GuidedRequest.generation(8, 1, other.params, text2[0])],
                           None, None)]
                if scenario == "back":  # the tree's node 3 was not accepted: no rollback
                    steps += [([GuidedRequest.generation(7, 0, case.params, text[1],
                                                         draft_tokens=text[2:5])], None, None),
                              ([GuidedRequest.generation(7, 0, case.params, text[5],
                                                         num_accepted_draft_tokens=3)],
                               [4], [-1])]
                else:  # request 9 takes slot 0, then verifies a chain
                    steps += [([GuidedRequest.context(9, 0, case.params)], None, None),
                              ([GuidedRequest.generation(9, 0, case.params, text[0],
                                                         draft_tokens=text[1:4])], None, None),
                              ([GuidedRequest.generation(9, 0, case.params, text[4],
                                                         num_accepted_draft_tokens=3)],
                               [4], [-1])]
                outs.append([d.step(*s) for s in steps])
            finally:
                d.close()
        with_tree_outs, plain = outs
        for k in range(2, len(plain)):  # (from the sit-out step on)
            assert with_tree_outs[k][0] == plain[k][0] == [], (scenario, k)
            assert torch.equal(with_tree_outs[k][1], plain[k][1]), (scenario, k)
            assert torch.equal(with_tree_outs[k][2], plain[k][2]), (scenario, k)


def test_chain_given_as_tree_equals_the_chain(factory, tekken):
    """A chain written as the tree [-1, 0, 1, ...] gets the chain's rows and token mask, in a
    batch that also holds an unguided request and a chain."""
    case = next(c for c in TREE_CASES if c.name == "json_schema_tool")
    text = encode_continuation(tekken, case.valid)
    V = factory.config.vocab_size_padded
    drafts = text[1:4] + [text[9]]
    results = []
    for parents in (None, [-1, 0, 1, 2]):
        dec = GuidedDecoder(factory.config, 3, 4, factory=factory)
        dec.add_batch([GuidedRequest.context(0, 0, case.params),
                       GuidedRequest.context(2, 2, case.params)])
        assert dec.execute(torch.zeros(2, V)) == []
        reqs = [GuidedRequest.generation(0, 0, case.params, text[0], draft_tokens=drafts,
                                         draft_parents=parents),
                GuidedRequest.generation(1, 1, None, 0, draft_tokens=[1, 2]),
                GuidedRequest.generation(2, 2, case.params, text[0], draft_tokens=text[1:3])]
        dec.add_batch(reqs)
        assert dec.execute(torch.zeros(15, V)) == []
        results.append((dec.token_mask_host[:15].clone(), dec.bitmask_host[:15].clone(),
                        list(dec.num_guided_tokens)))
    assert results[0][0].tolist()[:5] == [1, 1, 1, 1, 0]
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1][results[0][0].bool()], results[1][1][results[1][0].bool()])
    assert results[0][2] == results[1][2]


BAD_TREES = [
    ([-1, 1, 0], "draft_parents[1]=1 is not an earlier node"),
    ([-1, -2], "draft_parents[1]=-2 is not an earlier node"),
    ([-1, 0], "draft_parents has 2 entries for 3 draft tokens"),
    ([-1, 0.0, 1], "draft_parents[1] 0.0 is not an integer"),
    ("-101", "draft_parents '-101' is not a sequence"),
    (torch.tensor([-1.0, 0.0, 1.0]), "float32 tensor"),
]


@pytest.mark.parametrize("parents,message", BAD_TREES)
def test_bad_tree_fails_alone_before_any_matcher_moves(factory, tekken, parents, message):
    """A request whose parents do not form a tree over its drafts fails alone at add_batch
    with a RequestError naming draft_parents; its rows stay unmasked, the batch's other
    requests (a tree and a chain) get exactly the rows they get without it, and no matcher
    moved (the failed request's own matcher is dropped, the others advanced by their own
    tokens only)."""
    case = next(c for c in TREE_CASES if c.name == "json_schema_tool")
    text = encode_continuation(tekken, case.valid)
    V = factory.config.vocab_size_padded

    def step(bad: bool):
        dec = GuidedDecoder(factory.config, 3, 3, factory=factory)
        dec.add_batch([GuidedRequest.context(i, i, case.params) for i in range(3)])
        assert dec.execute(torch.zeros(3, V)) == []
        reqs = [GuidedRequest.generation(0, 0, case.params, text[0], draft_tokens=text[1:4],
                                         draft_parents=[-1, 0, -1]),
                GuidedRequest.generation(1, 1, case.params, text[0], draft_tokens=text[1:4],
                                         draft_parents=parents if bad else [-1, 0, 1]),
                GuidedRequest.generation(2, 2, case.params, text[0], draft_tokens=text[1:3])]
        dec.add_batch(reqs)
        return dec, dec.execute(torch.zeros(12, V))

    dec, failed = step(True)
    assert len(failed) == 1 and failed[0][0] == 1
    assert failed[0][1].startswith("RequestError") and message in failed[0][1]
    assert dec.token_mask_host[4:8].tolist() == [0, 0, 0, 0]
    assert dec.grammar_matchers[1] is None
    good, _ = step(False)
    for rows in (slice(0, 4), slice(8, 12)):
        assert torch.equal(dec.token_mask_host[rows], good.token_mask_host[rows])
        assert torch.equal(dec.bitmask_host[rows], good.bitmask_host[rows])
    assert dec.num_advanced_tokens[0] == good.num_advanced_tokens[0] == 1
    assert dec.num_advanced_tokens[2] == good.num_advanced_tokens[2] == 3


def test_tree_on_context_request_is_refused(factory):
    """A context request takes one row: draft_parents on it fails that request alone."""
    case = TREE_CASES[0]
    dec = GuidedDecoder(factory.config, 2, 2, factory=factory)
    bad = GuidedRequest.context(0, 0, case.params)
    bad.draft_parents = [-1]
    dec.add_batch([bad, GuidedRequest.context(1, 1, case.params)])
    failed = dec.execute(torch.zeros(2, factory.config.vocab_size_padded))
    assert [i for i, _ in failed] == [0] and "context request" in failed[0][1]
    assert dec.token_mask_host[:2].tolist() == [0, 1]


def test_rollback_without_accepted_node_is_a_named_error(factory, tekken):
    """After a tree step, a next request that says drafts were accepted but not which node
    fails alone (RequestError naming accepted_draft_node); one that names a node outside
    the tree too; a request that accepted none may leave the node out."""
    case = next(c for c in TREE_CASES if c.name == "json_schema_tool")
    text = encode_continuation(tekken, case.valid)
    V = factory.config.vocab_size_padded
    dec = GuidedDecoder(factory.config, 3, 3, factory=factory)
    dec.add_batch([GuidedRequest.context(i, i, case.params) for i in range(3)])
    dec.execute(torch.zeros(3, V))
    dec.add_batch([GuidedRequest.generation(i, i, case.params, text[0], draft_tokens=text[1:4],
                                            draft_parents=[-1, 0, 1]) for i in range(3)])
    assert dec.execute(torch.zeros(12, V)) == []
    assert dec.num_advanced_tokens == [1, 1, 1]
    dec.add_batch([GuidedRequest.generation(0, 0, case.params, text[3],
                                            num_accepted_draft_tokens=2),
                   GuidedRequest.generation(1, 1, case.params, text[3], accepted_draft_node=7),
                   GuidedRequest.generation(2, 2, case.params, text[1])], 0)
    dec.rollback_rejected_tokens()
    failed = dec.execute(torch.zeros(3, V))
    assert sorted(i for i, _ in failed) == [0, 1]
    assert all("accepted_draft_node" in m for _, m in failed)
    assert dec.token_mask_host[:3].tolist() == [0, 0, 1]


@pytest.mark.parametrize("capturable", [False, True])
def test_accepted_node_and_count_that_disagree_are_refused(factory, tekken, capturable):
    """A node at depth 3 named with num_accepted_draft_tokens=1 (the engine holds one draft,
    the decoder would keep three: its matcher two tokens ahead of the text, which later let
    the stop token through where the guide cannot end) fails its request alone before the
    matcher is fed; a node and a count that agree keep the path, here and on the capturable
    decoder (whose count comes from the verification's tensor)."""
    case = next(c for c in TREE_CASES if c.name == "json_schema_tool")
    text = encode_continuation(tekken, case.valid)
    V = factory.config.vocab_size_padded
    cls = CapturableGuidedDecoder if capturable else GuidedDecoder
    dec = cls(factory.config, 2, 3, factory=factory)
    dec.add_batch([GuidedRequest.context(i, i, case.params) for i in range(2)])
    dec.execute(torch.zeros(2, V))
    dec.add_batch([GuidedRequest.generation(i, i, case.params, text[0], draft_tokens=text[1:4],
                                            draft_parents=[-1, 0, 1]) for i in range(2)])
    dec.execute(torch.zeros(8, V))
    assert dec.take_failed_requests() == []
    dec.add_batch([GuidedRequest.generation(0, 0, case.params, text[2],
                                            num_accepted_draft_tokens=1, accepted_draft_node=2),
                   GuidedRequest.generation(1, 1, case.params, text[4],
                                            num_accepted_draft_tokens=3, accepted_draft_node=2)],
                  runtime_draft_len=0)
    dec.rollback_rejected_tokens()
    failed = dec.take_failed_requests()
    assert [rid for rid, _ in failed] == [0] and "depth 3" in failed[0][1]
    assert dec.grammar_matchers[0] is None
    assert dec.num_advanced_tokens[1] == 4  # the new token and its three accepted drafts
    fresh = factory.create(case.params)
    for t in text[:4]:
        assert fresh.accept_token(t)
    assert dec.grammar_matchers[1].accept_token(text[4]) == fresh.accept_token(text[4])
    dec.close()


def test_draft_tree_batches_agree_across_strategies(factory, tekken):
    """Mixed batches of trees, chains and unguided requests leave the same failures, rows,
    counters and matchers under the Python and the native strategies."""
    cases = [c for c in TREE_CASES if c.name in ("json_schema_tool", "regex_phone")]
    texts = [encode_continuation(tekken, c.valid) for c in cases]
    decs = [GuidedDecoder(factory.config, 3, 3, factory=factory, host_build=b)
            for b in ("python", "native")]
    assert_steps_agree(decs, [GuidedRequest.context(i, i, c.params)
                              for i, c in enumerate(cases)], 3)
    step = [GuidedRequest.generation(0, 0, cases[0].params, texts[0][0],
                                     draft_tokens=[texts[0][1], texts[0][2], 17],
                                     draft_parents=[-1, -1, 0]),
            GuidedRequest.generation(2, 2, None, 5, draft_tokens=[1, 2, 3]),
            GuidedRequest.generation(1, 1, cases[1].params, texts[1][0],
                                     draft_tokens=texts[1][1:4])]
    assert_steps_agree(decs, step, 3)


def test_readme_tree_example_runs():
    """The README's draft-tree example runs after its decode-loop example, as printed, with
    no failure, and after its rollback the matcher stands where a fresh one fed the accepted
    tokens does (the next step's row 0 equals that matcher's mask after the bonus token)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    first = re.search(r"## Using it in a decode loop\s+```python\n(.*?)```", readme, re.S)
    tree = re.search(r"Draft trees \(EAGLE-style.*?```python\n(.*?)```", readme, re.S)
    assert first and tree, "the README lost its decode-loop or draft-tree example"
    namespace: dict = {}
    exec(compile(first.group(1), "README.md", "exec"), namespace)
    exec(compile(tree.group(1), "README.md", "exec"), namespace)
    dec, text = namespace["decoder"], namespace["text"]
    assert namespace["failed"] == []
    assert dec.num_advanced_tokens[0] == 4
    V = dec.vocab_size_padded
    dec.execute(torch.zeros(5, V))
    fresh = dec.grammar_matcher_factory.create(namespace["schema"])
    for t in text[:5]:
        assert fresh.accept_token(t)
    row = allocate_host_bitmask(1, V)
    fresh.fill_next_token_bitmask(row, 0)
    assert dec.token_mask_host[0] and torch.equal(dec.bitmask_host[0], row[0])


def test_llguidance_tree_rows_equal_brute_force(factory_cache):
    """The same brute-force check on the llguidance backend (whose matcher counts its own
    termination in rollback), over a JSON schema and a regex."""
    pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
    factory = factory_cache("tekken", "llguidance")
    dec = GuidedDecoder(factory.config, 2, K, factory=factory)
    run(factory, 5, ["json_schema_tool", "regex_phone"], [dec], check_brute_force=True)


@pytest.mark.parametrize("pad", [0, -1, 2**31 - 1])
def test_tree_tokens_past_its_nodes_are_not_read(factory, tekken, pad):
    """The capturable decoder takes a tree's tokens from its new_tokens tensor: only the
    tree's nodes are read, so positions past them may hold any padding (-1, as engines
    write for unused draft slots, failed the whole request as a draft outside the
    vocabulary)."""
    params = GuidedDecodingParams.regex("(ab|cd)+")
    ab, cd = encode_continuation(tekken, "ab")[0], encode_continuation(tekken, "cd")[0]
    V = factory.config.vocab_size_padded
    dec = CapturableGuidedDecoder(factory.config, 1, K, factory=factory, host_node="python")
    dec.add_batch([GuidedRequest.context(7, 0, params)])
    dec.execute(torch.zeros(1, V))
    tokens = torch.full((K + 1, 1), pad, dtype=torch.int32)
    tokens[0, 0], tokens[1, 0], tokens[2, 0] = ab, cd, ab
    dec.add_batch([GuidedRequest.generation(7, 0, params, None, draft_parents=[-1, -1],
                                            prev_seq_slot=0)], tokens, runtime_draft_len=K)
    dec.execute(torch.zeros(1 + K, V))
    assert dec.take_failed_requests() == []
    assert dec.token_mask_host[:1 + K].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert dec.grammar_matchers[0] is not None
    dec.close()
