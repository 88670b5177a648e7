"""Tensor parallelism with vocab-sharded logits, with and without a pruned draft vocabulary (d2t).

* Two real processes over torch.distributed (gloo on 127.0.0.1) each run a GuidedDecoder on
  their vocab shard of the same logits; the all-gathered shards equal the unsharded result bit
  for bit over several grammar steps (real tokenizer, real grammars).
* Hand-made small cases where the reference design's coordinates (slice the bitmask words for
  the shard, slice d2t, read the slice's draft-relative offsets against the sliced target row)
  read the wrong bit, next to ours, which matches the brute-force reference.
* The decoder's layout errors, raised before any matcher advances.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from capgraph import GuidedDecodingConfig, GuidedDecodingParams, GuideType, LayoutError
from capgraph.decoder import GuidedDecoder
from capgraph.ops import logits_bitmask, logits_bitmask_reference
from capgraph.requests import GuidedRequest
from capgraph.tokenizers import encode_continuation

TOKENIZER = "mistral-sp32k"  # V = 32000 = 1000 words: divisible by 2 and 4
TEXTS = [
    (GuidedDecodingParams(GuideType.JSON, ""), '[1, {"a": null, "b": [true, 2.5e3]}, "xyz"]'),
    (GuidedDecodingParams(GuideType.JSON_SCHEMA,
                          '{"type": "object", "properties": {"city": {"type": "string"}, '
                          '"days": {"type": "integer"}}, "required": ["city", "days"]}'),
     '{"city": "Paris", "days": 3}'),
    (None, "unguided request: its rows stay unmasked"),
]
STEPS = 8
WORKER_TIMEOUT_S = 240


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _draft_table(vocab: int, keep: list[int], seed: int = 0) -> torch.Tensor:
    """d2t of a pruned draft vocabulary of vocab/4 ids: target ids chosen at random (always
    including ``keep``), in a random, non-monotone order; d2t[g] = target_id(g) - g."""
    g = torch.Generator().manual_seed(seed)
    draft = vocab // 4
    kept = set(keep)
    others = [t for t in torch.randperm(vocab, generator=g).tolist() if t not in kept]
    targets = torch.tensor((sorted(set(keep)) + others)[:draft])
    targets = targets[torch.randperm(draft, generator=g)]
    return (targets - torch.arange(draft)).to(torch.int32)


def _batch(step: int, tokens: list[list[int]]) -> list[GuidedRequest]:
    reqs = []
    for i, ((params, _), toks) in enumerate(zip(TEXTS, tokens)):
        if step == 0:
            reqs.append(GuidedRequest.context(i, i, params))
        else:
            reqs.append(GuidedRequest.generation(i, i, params, toks[step - 1]))
    return reqs


def _step_logits(step: int, rows: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, width, generator=g)


def _run_steps(config, factory, rank: int, world: int, d2t: torch.Tensor | None,
               gather) -> list[str]:
    """Drive a sharded and an unsharded decoder through STEPS steps; gather(shard) returns the
    full-width logits assembled from every rank's shard. Returns the mismatches found."""
    tok = config.tokenizer
    tokens = [encode_continuation(tok, text) for _, text in TEXTS]
    sharded = GuidedDecoder(config, len(TEXTS), 0, factory=factory, rank=rank)
    whole = GuidedDecoder(config, len(TEXTS), 0, factory=factory, rank=rank)
    full_width = config.vocab_size_padded if d2t is None else d2t.shape[0]
    width = full_width // world
    problems = []
    for step in range(STEPS):
        reqs = _batch(step, tokens)
        original = _step_logits(step, len(reqs), full_width)
        expected = original.clone()
        whole.add_batch(reqs)
        assert whole.execute(expected, d2t) == []
        local = original.clone()
        sharded.add_batch(reqs)
        assert sharded.execute(local[:, rank * width:(rank + 1) * width], d2t) == []
        gathered = gather(local[:, rank * width:(rank + 1) * width].contiguous())
        masked = torch.isneginf(expected[:2]).sum().item()
        if not torch.equal(_bits(gathered), _bits(expected)):
            problems.append(f"d2t={d2t is not None} step {step}: gathered shards differ")
        if masked == 0 or torch.isneginf(expected[2]).any():
            problems.append(f"d2t={d2t is not None} step {step}: guided rows unmasked or "
                            f"unguided row masked")
    return problems


def _tp_worker(rank: int, world: int, port: int) -> None:
    """One TP rank (run in its own process): exits non-zero on any mismatch."""
    import torch.distributed as dist

    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import load_tokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=90))
    try:
        tok = load_tokenizer(TOKENIZER)
        config = GuidedDecodingConfig.from_tokenizer(tok)
        factory = create_matcher_factory(config)
        keep = sorted({t for _, text in TEXTS for t in encode_continuation(tok, text)}
                      | set(config.stop_token_ids))

        def gather(shard):
            parts = [torch.empty_like(shard) for _ in range(world)]
            dist.all_gather(parts, shard)
            return torch.cat(parts, dim=1)

        problems = _run_steps(config, factory, rank, world, None, gather)
        problems += _run_steps(config, factory, rank, world,
                               _draft_table(config.vocab_size_padded, keep), gather)
    finally:
        dist.destroy_process_group()
    if problems:
        raise SystemExit(f"rank {rank}: " + "; ".join(problems))
    print(f"rank {rank} ok")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_gloo_shards_equal_unsharded():
    """Two processes, tp=2 over gloo: each masks logits[:, r*V/2:(r+1)*V/2] (and, with d2t, its
    half of draft logits of a V/4 pruned vocabulary, non-monotone d2t) through GuidedDecoder
    with rank=r; the all_gather of the shards equals the unsharded decoder's result bit for bit
    at every step of two guided requests and one unguided."""
    port = _free_port()
    tests_dir = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(tests_dir)!r}); "
            "from test_tensor_parallel import _tp_worker; "
            "_tp_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), "2", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=tests_dir.parent, env=env)
             for rank in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=WORKER_TIMEOUT_S)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"TP workers did not finish within {WORKER_TIMEOUT_S}s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"
        assert f"rank {rank} ok" in out


# ---- the same check in one process (more shards) and the regressions it pins ----------------


@pytest.fixture(scope="module")
def factory(factory_cache):
    return factory_cache(TOKENIZER)


def test_four_shards_with_d2t_in_process(factory):
    """tp=4 over a V/4 draft vocabulary: 8000 draft ids are 250 bitmask words, not divisible
    by 4 — irrelevant, since the shard reads the full target row (1000 words) through the full
    d2t; the 4 shards equal the unsharded result (no LayoutError)."""
    config = factory.config
    tok = config.tokenizer
    keep = sorted({t for _, text in TEXTS for t in encode_continuation(tok, text)})
    d2t = _draft_table(config.vocab_size_padded, keep, seed=3)
    tokens = [encode_continuation(tok, text) for _, text in TEXTS]
    world = 4
    shards = [GuidedDecoder(config, len(TEXTS), 0, factory=factory, rank=r) for r in range(world)]
    whole = GuidedDecoder(config, len(TEXTS), 0, factory=factory)
    width = d2t.shape[0] // world
    for step in range(4):
        reqs = _batch(step, tokens)
        original = _step_logits(step, len(reqs), d2t.shape[0])
        expected = original.clone()
        whole.add_batch(reqs)
        assert whole.execute(expected, d2t) == []
        got = original.clone()
        for r, dec in enumerate(shards):
            dec.add_batch(reqs)
            assert dec.execute(got[:, r * width:(r + 1) * width], d2t) == []
        assert torch.equal(_bits(got), _bits(expected)), step


def test_unsharded_d2t_logits_on_a_nonzero_rank(factory):
    """Full-width draft logits on TP rank 1 (every rank holds the whole draft row) mask like
    rank 0 (rank 1 is not refused as outside the shards)."""
    config = factory.config
    tok = config.tokenizer
    d2t = _draft_table(config.vocab_size_padded, encode_continuation(tok, TEXTS[0][1]), seed=4)
    reqs = [GuidedRequest.context(0, 0, TEXTS[0][0])]
    results = []
    for rank in (0, 1):
        dec = GuidedDecoder(config, 1, 0, factory=factory, rank=rank)
        dec.add_batch(reqs)
        logits = _step_logits(0, 1, d2t.shape[0])
        assert dec.execute(logits, d2t) == []
        results.append(logits)
    assert torch.isneginf(results[0]).any()
    assert torch.equal(_bits(results[0]), _bits(results[1]))


@pytest.mark.parametrize("use_d2t", [False, True])
def test_shards_whose_word_count_does_not_divide_tp(factory, use_d2t):
    """1000 bitmask words over tp=16 (1000 % 16 = 8): the shards (2000 target columns, odd
    ranks starting mid-word at bit 16 of a word; or 500 draft columns of the 8000-id draft
    table) are masked from the full row with col_offset, so each rank's result equals its
    slice of the unsharded result over several steps (no LayoutError: the
    bitmask words per row need not divide by tp_size)."""
    config = factory.config
    tok = config.tokenizer
    tokens = [encode_continuation(tok, text) for _, text in TEXTS]
    keep = sorted({t for toks in tokens for t in toks})
    d2t = _draft_table(config.vocab_size_padded, keep, seed=5) if use_d2t else None
    full = config.vocab_size_padded if d2t is None else d2t.shape[0]
    world = 16
    assert -(-config.vocab_size_padded // 32) % world and full % world == 0
    shards = [GuidedDecoder(config, len(TEXTS), 0, factory=factory, rank=r) for r in range(world)]
    whole = GuidedDecoder(config, len(TEXTS), 0, factory=factory)
    width = full // world
    for step in range(3):
        reqs = _batch(step, tokens)
        original = _step_logits(step, len(reqs), full)
        expected = original.clone()
        whole.add_batch(reqs)
        assert whole.execute(expected, d2t) == []
        assert torch.isneginf(expected[0]).any()
        got = original.clone()
        for r, dec in enumerate(shards):
            dec.add_batch(reqs)
            assert dec.execute(got[:, r * width:(r + 1) * width], d2t) == []
        assert torch.equal(_bits(got), _bits(expected)), step
    for dec in (*shards, whole):
        dec.close()


def test_qwen_tp8_shards_are_slices_of_the_full_mask():
    """Qwen's padded vocabulary 151936 (4748 words) over tp=8: 18992 columns per rank, so
    rank r starts at bit 16 * r of word 593 * r. The op with col_offset = r * 18992 on the
    full row (C++ CPU pass, the torch code, the brute-force reference) gives each rank exactly
    its slice of the full-row result, with and without a token mask."""
    from capgraph.bitmask import vocab_shard
    from capgraph.ops.torch_impl import apply_logits_bitmask_torch_

    vocab, tp, rows = 151936, 8, 3
    g = torch.Generator().manual_seed(151936)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, vocab // 32), generator=g,
                            dtype=torch.int32)
    bitmask[1, ::3] = 0
    token_mask = torch.tensor([1, 1, 0], dtype=torch.int32)
    logits = torch.randn(rows, vocab, generator=g)
    for tm in (None, token_mask):
        expected = logits.clone()
        logits_bitmask(expected, bitmask, tm)
        for r in range(tp):
            shard = vocab_shard(vocab, tp, r)
            assert shard.col_offset == r * 18992 and shard.width == 18992
            piece = logits[:, shard.start:shard.end]
            want = expected[:, shard.start:shard.end]
            ours = piece.clone()
            logits_bitmask(ours, bitmask, tm, col_offset=shard.col_offset)
            torch_path = piece.clone()
            apply_logits_bitmask_torch_(torch_path, bitmask, tm, None, shard.col_offset)
            ref = logits_bitmask_reference(piece, bitmask, tm, col_offset=shard.col_offset)
            for got in (ours, torch_path, ref):
                assert torch.equal(_bits(got), _bits(want)), (r, tm is None)


def test_qwen_tp8_decoder_shards(factory_cache, tokenizer_cache):
    """A GuidedDecoder on each of 8 ranks over V=151936 (Tekken padded to Qwen's padded size,
    4748 words): accepted, and the 8 shards equal the unsharded result."""
    factory = factory_cache("tekken", pad=151936 - len(tokenizer_cache("tekken")))
    config = factory.config
    assert config.vocab_size_padded == 151936
    params = GuidedDecodingParams.regex(r"[a-c]{1,9}x")
    tp, width = 8, 151936 // 8
    shards = [GuidedDecoder(config, 1, 0, factory=factory, rank=r) for r in range(tp)]
    whole = GuidedDecoder(config, 1, 0, factory=factory)
    reqs = [GuidedRequest.context(0, 0, params)]
    original = _step_logits(0, 1, 151936)
    expected = original.clone()
    whole.add_batch(reqs)
    assert whole.execute(expected) == []
    got = original.clone()
    for r, dec in enumerate(shards):
        dec.add_batch(reqs)
        assert dec.execute(got[:, r * width:(r + 1) * width]) == []
    assert torch.isfinite(expected).sum() > 0 and torch.isneginf(expected).any()
    assert torch.equal(_bits(got), _bits(expected))
    for dec in (*shards, whole):
        dec.close()


# ---- coordinate arithmetic on hand-made cases -----------------------------------------------


def reference_design_apply(shard: torch.Tensor, bitmask: torch.Tensor, d2t: torch.Tensor | None,
                           tp_rank: int, tp_size: int) -> torch.Tensor:
    """The reference design's TP arithmetic (seed section 8), element by element: the shard
    gets the bitmask words [rank*words/tp, (rank+1)*words/tp) and, with d2t, the d2t slice of
    its draft columns; its kernel then reads bit (j + d2t_slice[j]) -- or bit j without d2t --
    counted from the start of the word slice, with the full row stride (so an offset past the
    slice reads on into the row, as pointer arithmetic does)."""
    out = shard.clone()
    rows, width = shard.shape
    words = bitmask.shape[1]
    start_word = tp_rank * words // tp_size
    d2t_slice = None if d2t is None else d2t[tp_rank * width:(tp_rank + 1) * width]
    flat = [w & 0xFFFFFFFF for w in bitmask.flatten().tolist()] + [0] * (words + 1)
    for r in range(rows):
        for j in range(width):
            offset = j if d2t_slice is None else j + int(d2t_slice[j])
            word = flat[r * words + start_word + offset // 32]
            if not (word >> (offset % 32)) & 1:
                out[r, j] = float("-inf")
    return out


def _words(allowed: set[int], vocab: int) -> torch.Tensor:
    words = [0] * -(-vocab // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words]],
                        dtype=torch.int32)


def test_reference_design_misreads_d2t_shards():
    """Target V=64 (2 words), pruned draft of 32 ids, tp=2. On rank 1 the reference design
    reads bit 32 + j + d2t[16 + j] = target + 16 (past the row for the highest targets)
    instead of the target's own bit, so it masks allowed tokens and lets masked ones through;
    ours (full row, full d2t, col_offset=16) equals the brute-force reference."""
    vocab, draft, tp = 64, 32, 2
    targets = [16 + (7 * g + 3) % 48 for g in range(draft)]  # distinct, non-monotone, >= 16
    d2t = torch.tensor([t - g for g, t in enumerate(targets)], dtype=torch.int32)
    allowed = {targets[g] for g in range(draft) if g % 3 == 0}
    bitmask = _words(allowed, vocab)
    logits = torch.arange(draft, dtype=torch.float32).unsqueeze(0)
    rank, width = 1, draft // tp
    shard = logits[:, rank * width:(rank + 1) * width]

    truth = logits_bitmask_reference(shard, bitmask, d2t=d2t, col_offset=rank * width)
    ours = shard.clone()
    logits_bitmask(ours, bitmask, d2t=d2t, col_offset=rank * width)
    theirs = reference_design_apply(shard, bitmask, d2t, rank, tp)

    assert torch.equal(ours, truth)
    assert not torch.equal(theirs, truth)
    finite = [16 + j for j in range(width) if torch.isfinite(truth[0, j])]
    assert finite == [g for g in range(16, 32) if g % 3 == 0]  # by construction


def test_reference_design_misreads_unaligned_shards():
    """Without d2t: V=48 (2 words, divisible by tp=2, so the reference design's assertion
    passes) puts rank 1's first column at bit 24, inside word 0; slicing words gives it bit 32.
    Ours (full row, col_offset=24) matches the brute-force reference; theirs does not."""
    vocab, tp, rank = 48, 2, 1
    bitmask = _words(set(range(24, 32)), vocab)  # columns 0..7 of rank 1 allowed
    logits = torch.zeros(1, vocab)
    width = vocab // tp
    shard = logits[:, rank * width:]
    truth = logits_bitmask_reference(shard, bitmask, col_offset=rank * width)
    ours = shard.clone()
    logits_bitmask(ours, bitmask, col_offset=rank * width)
    theirs = reference_design_apply(shard, bitmask, None, rank, tp)
    assert torch.equal(ours, truth)
    assert torch.isfinite(truth[0, :8]).all() and torch.isneginf(truth[0, 8:]).all()
    assert torch.isneginf(theirs).all()


def test_reference_design_agrees_where_coordinates_coincide():
    """Sanity check of the emulation: with shards aligned to whole words and no d2t, the
    reference design's slices are right and agree with ours."""
    g = torch.Generator().manual_seed(0)
    vocab, tp = 128, 2
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=g, dtype=torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    for rank in range(tp):
        shard = logits[:, rank * 64:(rank + 1) * 64]
        ours = shard.clone()
        logits_bitmask(ours, bitmask, col_offset=rank * 64)
        assert torch.equal(ours, reference_design_apply(shard, bitmask, None, rank, tp))


def _padding_builds() -> list[str]:
    from capgraph.build import library
    return ["python", *([] if library.unavailable_reason() else ["native-loop", "native"])]


@pytest.mark.parametrize("host_build", _padding_builds())
@pytest.mark.parametrize("guide", [".*", "[^\\x00]*"])
def test_bits_past_the_vocabulary_are_cleared_so_no_d2t_target_reads_them(host_build, guide):
    """V = 33 (the tokenizer's own size, not a multiple of 32): where most tokens are allowed
    xgrammar fills whole words, setting bits 33..63 of the last word. The decoder clears them
    in every row, so a draft id mapped to target 40 (no such token) is masked, as one mapped
    to 64 is refused."""
    vocab = [chr(97 + i % 26) * (1 + i // 26) for i in range(32)] + ["</s>"]
    config = GuidedDecodingConfig(encoded_vocab=vocab, stop_token_ids=[32])
    dec = GuidedDecoder(config, 1, 0, host_build=host_build)
    dec.add_batch([GuidedRequest.context(0, 0, GuidedDecodingParams.regex(guide))])
    assert dec.execute(torch.zeros(1, 33)) == []
    assert int(dec.bitmask_host[0, 1]) == 1  # id 32 only
    draft_logits = torch.zeros(1, 2)
    logits_bitmask(draft_logits, dec.bitmask[:1], None, torch.tensor([40, -1], dtype=torch.int32))
    assert draft_logits.tolist() == [[float("-inf"), 0.0]]  # (draft 1 -> target 0: allowed)
    dec.close()
