"""Hostile and careless input: every argument of a step is checked before any matcher moves.

Each test pins one defect family of issue 22 on both decoders (the capturable one through the
hostfunc CPU stand-in): step arguments refused up front (strided or aliased logits, d2t targets
out of range, a second build of one batch, a matcher method that raises), bad types and values
(each request field, batch arguments, config fields), and requests served with the wrong guide.
A bad request fails alone with a named error; every other row is masked bit for bit as in a run
without it. A hypothesis property test throws garbage at every public argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import hostfunc
from capgraph import (CapgraphError, ConfigError, GuidedDecodingConfig, GuidedDecodingParams,
                      GuideType, LayoutError, QueueEpochError, RequestError, TensorArgError)
from capgraph.build import library as native_library
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.grammar import GrammarMatcher, create_matcher_factory
from capgraph.requests import GuidedRequest, as_int

# "node": the capturable decoder with its native host node serving (a graph captured first)
KINDS = ["eager", "capturable", "node"]
VOCAB = [chr(97 + i) for i in range(26)] + ["</s>"]  # 'a'..'z' are ids 0..25
EOS = 26
V = 64  # padded: ids 27..63 are never allowed on a guided row
A, B, C, X = 0, 1, 2, 23
ABC = GuidedDecodingParams.regex("[a-c]+")
XYZ = GuidedDecodingParams.regex("[x-z]+")


@pytest.fixture(scope="module")
def factory():
    config = GuidedDecodingConfig(encoded_vocab=VOCAB, stop_token_ids=[EOS], vocab_size_padded=V)
    made = create_matcher_factory(config)
    yield made
    made.close()


def new_decoder(factory, kind: str, seqs: int = 4, drafts: int = 2) -> GuidedDecoder:
    """A decoder of ``kind`` (:data:`KINDS`); for "node" one step of unguided placeholders is
    captured on a HostGraph first, so that the native node serves every step after (eager
    calls included); the test skips where the native node is unavailable here."""
    if kind == "eager":
        return GuidedDecoder(factory.config, seqs, drafts, factory=factory)
    if kind == "capturable":
        return CapturableGuidedDecoder(factory.config, seqs, drafts, factory=factory)
    reason = native_library.unavailable_reason()
    if reason is not None:
        pytest.skip(f"the native host node is unavailable here: {reason}")
    dec = CapturableGuidedDecoder(factory.config, seqs, drafts, factory=factory,
                                  host_node="native")
    dec.add_batch([GuidedRequest.placeholder(-1)], runtime_draft_len=0)
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        dec.execute(torch.zeros(1, V))
    dec._test_graph = graph  # type: ignore[attr-defined]  # (kept as long as the decoder)
    return dec


@pytest.fixture
def make(factory):
    """Decoders of any kind on the shared factory, closed afterwards."""
    made: list[GuidedDecoder] = []

    def build(kind: str, seqs: int = 4, drafts: int = 2) -> GuidedDecoder:
        dec = new_decoder(factory, kind, seqs, drafts)
        made.append(dec)
        return dec
    yield build
    for dec in made:
        dec.close()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical float tensors (NaN-safe)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def step(dec: GuidedDecoder, reqs, logits: torch.Tensor, draft_len: int | None = None,
         d2t: torch.Tensor | None = None) -> list:
    """add_batch + execute on either decoder kind; the failures of the step."""
    if isinstance(dec, CapturableGuidedDecoder):
        dec.add_batch(reqs, runtime_draft_len=draft_len)
        dec.execute(logits, d2t)
        return dec.take_failed_requests()
    dec.add_batch(reqs, draft_len)
    return dec.execute(logits, d2t)


def retry(dec: GuidedDecoder, logits: torch.Tensor, d2t: torch.Tensor | None = None) -> list:
    """execute again for the batch already added (after an execute that raised)."""
    if isinstance(dec, CapturableGuidedDecoder):
        dec.execute(logits, d2t)
        return dec.take_failed_requests()
    return dec.execute(logits, d2t)


def rows(n: int, seed: int, width: int = V) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def contexts(*slots_and_guides) -> list[GuidedRequest]:
    return [GuidedRequest.context(10 + s, s, g) for s, g in slots_and_guides]


def gen(slot: int, token: int, guide=ABC, **kw) -> GuidedRequest:
    return GuidedRequest.generation(10 + slot, slot, guide, token, **kw)


# -- family 1: step arguments checked before the first matcher call ---------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["every_other_column", "transposed", "expanded_rows"])
def test_strided_or_aliased_logits_are_refused_before_any_matcher_moves(kind, layout, make):
    """Logits whose columns are not contiguous (a [:, ::2] view, a transpose) or whose rows share
    memory (expand) raise TensorArgError before the build; the retry with proper logits then
    masks exactly as a decoder that never saw the bad call (each token fed once)."""
    dec, clean = make(kind), make(kind)
    for d in (dec, clean):
        assert step(d, contexts((0, ABC), (1, ABC)), torch.zeros(2, V), 0) == []
    bad = {"every_other_column": torch.zeros(2, 2 * V)[:, ::2],
           "transposed": torch.zeros(V, 2).t(),
           "expanded_rows": torch.zeros(1, V).expand(2, V)}[layout]
    dec.add_batch([gen(0, A), gen(1, B)], runtime_draft_len=0)
    with pytest.raises(TensorArgError, match="stride|overlap"):
        dec.execute(bad)
    assert dec.num_advanced_tokens[:2] == [0, 0], "a matcher moved before the error"
    got, want = rows(2, 1), rows(2, 1)
    assert retry(dec, got) == []
    assert step(clean, [gen(0, A), gen(1, B)], want, 0) == []
    assert same(got, want)
    got, want = rows(2, 2), rows(2, 2)  # the next step agrees too: no token was fed twice
    assert step(dec, [gen(0, C), gen(1, A)], got, 0) == []
    assert step(clean, [gen(0, C), gen(1, A)], want, 0) == []
    assert same(got, want)


def test_capturable_logits_with_more_rows_than_the_bitmask_are_refused(make):
    """Capturable logits may carry padding rows, but not more rows than the decoder's bitmask:
    TensorArgError before the build (not from the apply after it), and the retry serves the
    step."""
    dec = make("capturable", seqs=2, drafts=0)
    assert step(dec, contexts((0, ABC)), torch.zeros(1, V), 0) == []
    dec.add_batch([gen(0, A)], runtime_draft_len=0)
    with pytest.raises(TensorArgError, match="more than the decoder's 2"):
        dec.execute(torch.zeros(3, V))
    assert dec.num_advanced_tokens[0] == 0
    logits = torch.zeros(2, V)  # one padding row: left untouched
    assert retry(dec, logits) == []
    assert torch.isfinite(logits[0]).sum() == 4 and torch.isfinite(logits[1]).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", ["past_the_vocabulary", "negative"])
def test_d2t_targets_out_of_range_are_refused_before_the_build(kind, target, make):
    """A d2t whose target g + d2t[g] lies outside [0, vocab_size_padded) raises TensorArgError
    naming the draft id before any matcher moves; a good table then works, and a checked table
    changed in place is checked again (remembered by data_ptr and _version)."""
    draft_vocab = 32
    dec, clean = make(kind), make(kind)
    for d in (dec, clean):
        assert step(d, contexts((0, ABC)), torch.zeros(1, V), 0) == []
    d2t = torch.zeros(draft_vocab, dtype=torch.int32)
    d2t[5] = V if target == "past_the_vocabulary" else -6
    dec.add_batch([gen(0, A)], runtime_draft_len=0)
    with pytest.raises(TensorArgError, match="draft id 5"):
        dec.execute(torch.zeros(1, draft_vocab), d2t)
    assert dec.num_advanced_tokens[0] == 0
    good = torch.zeros(draft_vocab, dtype=torch.int32)
    got, want = rows(1, 3, draft_vocab), rows(1, 3, draft_vocab)
    assert retry(dec, got, good) == []
    assert step(clean, [gen(0, A)], want, 0, good) == []
    assert same(got, want)
    good[7] = 1000  # in place: _version moves, so the table is read again
    dec.add_batch([gen(0, B)], runtime_draft_len=0)
    with pytest.raises(TensorArgError, match="draft id 7"):
        dec.execute(torch.zeros(1, draft_vocab), good)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("change", ["new_object_same_address", "write_through_numpy"])
def test_d2t_changed_where_torch_does_not_see_it_is_refused_before_the_build(kind, change,
                                                                            make):
    """A table that passed the check, then (a) a NEW tensor object at the same address with a
    fresh _version of 0 (two torch.from_numpy of one array: what a freed table's address
    reused by the allocator gives), or (b) the same object written through .numpy() (no
    _version bump), now mapping draft id 5 outside the vocabulary: execute raises
    TensorArgError before any matcher moves (on CPU the values are read on every step), and
    the retry with a good table masks as a clean decoder (a check after the build would leave
    the matchers moved and the retry would meet QueueEpochError)."""
    draft_vocab = 32
    dec, clean = make(kind), make(kind)
    for d in (dec, clean):
        assert step(d, contexts((0, ABC)), torch.zeros(1, V), 0) == []
    values = np.zeros(draft_vocab, dtype=np.int32)
    first = torch.from_numpy(values)
    got, want = rows(1, 3, draft_vocab), rows(1, 3, draft_vocab)
    assert step(dec, [gen(0, A)], got, 0, first) == []
    assert step(clean, [gen(0, A)], want, 0, torch.zeros(draft_vocab, dtype=torch.int32)) == []
    assert same(got, want)
    values[5] = V  # draft id 5 -> target V + 5; torch counts no write
    if change == "new_object_same_address":
        table = torch.from_numpy(values)
        assert table is not first and table.data_ptr() == first.data_ptr()
        assert table._version == first._version == 0
    else:
        table = first
        assert table._version == 0
    before = list(dec.num_advanced_tokens)
    dec.add_batch([gen(0, B)], runtime_draft_len=0)
    with pytest.raises(TensorArgError, match=r"draft id 5 .*vocab_size_padded"):
        dec.execute(torch.zeros(1, draft_vocab), table)
    assert list(dec.num_advanced_tokens) == before, "a matcher moved before the error"
    good = torch.zeros(draft_vocab, dtype=torch.int32)
    got, want = rows(1, 4, draft_vocab), rows(1, 4, draft_vocab)
    assert retry(dec, got, good) == []
    assert step(clean, [gen(0, B)], want, 0, good) == []
    assert same(got, want)


def test_d2t_memory_on_cuda_is_by_tensor_object(monkeypatch):
    """The CUDA decoder's d2t memory (driven here with host tensors: only the bookkeeping is
    under test): the same object at the same _version is read once; a new object at the same
    address, an in-place torch write and a new length are read again; a write torch does not
    count is not read (the kernel then masks targets outside the row), nor an unseen table
    inside a graph capture."""
    from capgraph import tensor_checks
    reads = []
    real = tensor_checks.d2t_first_bad_target

    def counting(d2t, *args):
        reads.append(d2t.data_ptr())
        return real(d2t, *args)
    monkeypatch.setattr(tensor_checks, "d2t_first_bad_target", counting)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    checks = tensor_checks.LogitsChecks(torch.device("cuda"), V, 2, 0, 4)
    values = np.zeros(32, dtype=np.int32)
    table = torch.from_numpy(values)
    checks.check_d2t(table)
    checks.check_d2t(table)
    assert len(reads) == 1
    values[5] = V  # not counted by torch: not read, no error
    checks.check_d2t(table)
    assert len(reads) == 1
    with pytest.raises(TensorArgError, match="draft id 5"):
        checks.check_d2t(torch.from_numpy(values))  # another object, same address: read
    assert len(reads) == 2
    values[5] = 0
    table.add_(0)  # in place through torch: _version moves, read again
    checks.check_d2t(table)
    checks.check_d2t(table)
    assert len(reads) == 3
    checks.check_d2t(table[:16])  # a view: another object and length
    assert len(reads) == 4
    capturing[0] = True  # inside a capture an unseen table is not read (no sync)
    checks.check_d2t(torch.from_numpy(values.copy()))
    assert len(reads) == 4


def test_second_execute_for_one_add_batch_is_refused(make):
    """On the eager decoder a second execute() or build() for one add_batch raises
    QueueEpochError instead of feeding every token again; the rollbacks still use that batch,
    and the next step masks as a decoder that executed once."""
    dec, clean = make("eager"), make("eager")
    for d in (dec, clean):
        assert step(d, contexts((0, ABC)), torch.zeros(1, V), 2) == []
    for d in (dec, clean):
        assert step(d, [gen(0, A, draft_tokens=[B, C])], torch.zeros(3, V), 2) == []
    with pytest.raises(QueueEpochError, match="already built"):
        dec.execute(torch.zeros(3, V))
    with pytest.raises(QueueEpochError, match="already built"):
        dec.build()
    assert dec.num_advanced_tokens[0] == clean.num_advanced_tokens[0] == 3
    # the rollbacks still read that batch (no draft accepted): both keep only the golden token
    for d in (dec, clean):
        d.rollback_rejected_tokens()
    assert dec.num_advanced_tokens[0] == clean.num_advanced_tokens[0] == 1
    got, want = rows(1, 4), rows(1, 4)
    assert step(dec, [gen(0, C)], got, 0) == [] and step(clean, [gen(0, C)], want, 0) == []
    assert same(got, want)


class _TerminatedRaises(GrammarMatcher):
    """A real matcher whose is_terminated() raises from its ``fail_on``-th call on."""

    def __init__(self, inner: GrammarMatcher, fail_on: int) -> None:
        self.inner, self.fail_on, self.calls = inner, fail_on, 0

    def accept_token(self, token_id):
        return self.inner.accept_token(token_id)

    def rollback(self, num_tokens):
        return self.inner.rollback(num_tokens)

    def fill_next_token_bitmask(self, bitmask, index):
        return self.inner.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self):
        self.calls += 1
        if self.calls >= self.fail_on:
            raise RuntimeError("injected is_terminated fault")
        return self.inner.is_terminated()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fail_on", [1, 2], ids=["first_call", "after_a_draft_stop_token"])
@pytest.mark.parametrize("batch", [2, 3], ids=["row_by_row", "in_rounds"])
def test_is_terminated_that_raises_fails_only_its_request(kind, fail_on, batch, make):
    """A matcher whose is_terminated() raises (when the step starts, or after a draft stop
    token) fails only its request, with the exception in the failed list; the other requests'
    rows are bit-identical to a run without the fault."""
    slots = list(range(batch))
    dec, clean = make(kind), make(kind)
    for d in (dec, clean):
        assert step(d, contexts(*[(s, ABC) for s in slots]), torch.zeros(batch, V), 2) == []
    dec.grammar_matchers[1] = _TerminatedRaises(dec.grammar_matchers[1], fail_on)
    reqs = [gen(s, A, draft_tokens=[B, EOS]) for s in slots]
    got, want = rows(3 * batch, 5), rows(3 * batch, 5)
    failed = step(dec, reqs, got, 2)
    assert step(clean, reqs, want, 2) == []
    assert [f[0] for f in failed] == [11] and "injected is_terminated" in failed[0][1], failed
    for s in slots:
        if s != 1:
            assert same(got[3 * s:3 * s + 3], want[3 * s:3 * s + 3]), f"slot {s}"


# -- family 2: types and values -------------------------------------------------------------

BAD_FIELDS = {
    "seq_slot_float": ({"seq_slot": 1.0}, "seq_slot 1.0"),
    "seq_slot_str": ({"seq_slot": "1"}, "seq_slot '1'"),
    "seq_slot_bool": ({"seq_slot": True}, "seq_slot True"),
    "new_token_str": ({"new_token": "1234"}, "new_token '1234'"),
    "new_token_float": ({"new_token": 1.0}, "new_token 1.0"),
    "new_token_bool": ({"new_token": True}, "new_token True"),
    "draft_tokens_str": ({"draft_tokens": "12"}, "draft_tokens '12'"),
    "draft_token_float": ({"draft_tokens": [2.0]}, "draft token 2.0"),
    "draft_tokens_float_tensor": ({"draft_tokens": torch.tensor([1.0])}, "torch.float32"),
    "draft_tokens_int": ({"draft_tokens": 5}, "draft_tokens 5"),
    "request_id_str": ({"request_id": "r11"}, "request_id 'r11'"),
    "request_id_float": ({"request_id": 11.0}, "request_id 11.0"),
    "params_str": ({"guided_decoding_params": "[a-c]+"}, "guided_decoding_params '[a-c]+'"),
    "generating_str": ({"is_generation_in_progress_state": "yes"},
                       "is_generation_in_progress_state 'yes'"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_bad_request_field_fails_alone_naming_field_and_value(kind, case, make):
    """A request field of the wrong type or value fails that request alone with a RequestError
    naming the field and the value (eager: execute's list; capturable: take_failed_requests),
    decided at add_batch so neither build sees it; the other requests' rows are bit-identical
    to a run without the bad request, and its slot's matcher is dropped (kept where the bad
    field is the request_id: an id that is not an int shows no owner, and another request's
    matcher is never dropped)."""
    fields, fragment = BAD_FIELDS[case]
    dec, clean = make(kind), make(kind)
    assert step(dec, contexts((0, ABC), (1, ABC), (2, ABC)), torch.zeros(3, V), 1) == []
    assert step(clean, contexts((0, ABC), (2, ABC)), torch.zeros(2, V), 1) == []
    bad = dataclasses.replace(gen(1, A, draft_tokens=[B]), **fields)
    healthy = [gen(0, A, draft_tokens=[B]), gen(2, A, draft_tokens=[B])]
    logits = rows(6, 6)
    got, want = logits.clone(), torch.cat([logits[0:2], logits[4:6]])
    failed = step(dec, [healthy[0], bad, healthy[1]], got, 1)
    assert step(clean, healthy, want, 1) == []
    expect_id = -1 if case.startswith("request_id") else 11
    assert len(failed) == 1 and failed[0][0] == expect_id, failed
    assert "RequestError" in failed[0][1] and fragment in failed[0][1], failed
    assert same(got[0:2], want[0:2]) and same(got[4:6], want[2:4])
    assert same(got[2:4], logits[2:4]), "the bad request's rows must stay unmasked"
    if case.startswith("request_id"):  # (an id that is no int names no owner: kept)
        assert dec.grammar_matchers[1] is not None
    elif not case.startswith(("seq_slot", "params")):  # its own matcher: dropped
        assert dec.grammar_matchers[1] is None


@pytest.mark.parametrize("accepted", [-1, "1", 1.5, True, [1]])
def test_bad_num_accepted_draft_tokens_fails_alone_at_rollback(accepted, make):
    """An eager request whose num_accepted_draft_tokens is not an integer >= 0 fails alone
    with a RequestError naming the field and the value when rollback_rejected_tokens reads
    it; the other request is rolled back as usual. (The capturable decoder takes the counts
    from rollback_rejected_batch's tensor instead.)"""
    dec = make("eager")
    assert step(dec, contexts((0, ABC), (1, ABC)), torch.zeros(2, V), 2) == []
    assert step(dec, [gen(0, A, draft_tokens=[B, C]), gen(1, A, draft_tokens=[B, C])],
                torch.zeros(6, V), 2) == []
    dec.add_batch([gen(0, B, num_accepted_draft_tokens=0),
                   gen(1, B, num_accepted_draft_tokens=accepted)], 0)
    dec.rollback_rejected_tokens()
    failed = dec.execute(torch.zeros(2, V))
    assert [f[0] for f in failed] == [11], failed
    assert f"num_accepted_draft_tokens={accepted!r}" in failed[0][1]
    assert dec.num_advanced_tokens[0] == 1 and dec.grammar_matchers[1] is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("accepted", [-1, "1", 1.5, True, [1]])
def test_bad_count_of_a_rollback_left_out_fails_alone_at_the_next_step(kind, accepted, make):
    """The rollback of the last step's drafts left out (no rollback_rejected_tokens or
    rollback_rejected_batch): the next step settles each slot by its request's
    num_accepted_draft_tokens, and a request whose count is not an integer >= 0 fails alone
    with a RequestError naming the field and the value, on every decoder kind (the native
    node leaves that step to Python); the other request is settled and masked as usual."""
    dec = make(kind)
    assert step(dec, contexts((0, ABC), (1, ABC)), torch.zeros(2, V), 2) == []
    assert step(dec, [gen(0, A, draft_tokens=[B, C]), gen(1, A, draft_tokens=[B, C])],
                torch.zeros(6, V), 2) == []
    python_runs = dec.host_node_stats.python_runs if kind == "node" else 0
    logits = torch.zeros(2, V)
    failed = step(dec, [gen(0, B, num_accepted_draft_tokens=0),
                        gen(1, B, num_accepted_draft_tokens=accepted)], logits, 0)
    if kind == "node":
        assert dec.host_node_stats.python_runs == python_runs + 1
    assert [f[0] for f in failed] == [11], failed
    assert f"num_accepted_draft_tokens={accepted!r}" in failed[0][1]
    assert dec.num_advanced_tokens[0] == 1 and dec.grammar_matchers[1] is None
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [A, B, C, EOS]
    assert bool(torch.isfinite(logits[1]).all())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("drafts", [(B, C), torch.tensor([B, C]), np.array([B, C]),
                                    [np.int64(B), torch.tensor(C)]],
                         ids=["tuple", "tensor", "array", "mixed_integers"])
def test_draft_token_sequences_are_accepted_alike_on_both_decoders(kind, drafts, make):
    """draft_tokens given as a tuple, a 1-D integer tensor, a NumPy array or NumPy/tensor
    integers are converted to a list of ints at add_batch: the step masks exactly as with a
    plain list, on both decoders (a str is refused, see the bad-field test)."""
    dec, ref = make(kind), make("eager")
    for d in (dec, ref):
        assert step(d, contexts((0, ABC)), torch.zeros(1, V), 2) == []
    got, want = rows(3, 7), rows(3, 7)
    assert step(dec, [gen(0, A, draft_tokens=drafts)], got, 2) == []
    assert step(ref, [gen(0, A, draft_tokens=[B, C])], want, 2) == []
    assert same(got, want)
    assert dec.num_advanced_tokens[0] == 3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field", ["draft_tokens", "draft_parents"])
@pytest.mark.parametrize("source", ["tensor", "array"])
def test_a_huge_draft_sequence_is_refused_by_its_length_before_it_is_read(kind, field, source,
                                                                          make):
    """A draft sequence of 10**11 items that takes no memory (a broadcast tensor or array)
    next to a good request: refused by its length alone, before any item is read (reading
    it would raise MemoryError or take seconds per 10**7 items), the good row served."""
    n = 10 ** 11
    huge = (torch.zeros(1, dtype=torch.long).expand(n) if source == "tensor"
            else np.broadcast_to(np.int64(0), (n,)))
    dec, ref = make(kind), make("eager")
    for d in (dec, ref):
        assert step(d, contexts((0, ABC), (1, ABC)), torch.zeros(2, V), 2) == []
    bad = (gen(1, A, draft_tokens=huge) if field == "draft_tokens"
           else gen(1, A, draft_tokens=[B], draft_parents=huge))
    got, want = rows(6, 3), rows(6, 3)
    failed = step(dec, [gen(0, A, draft_tokens=[B, C]), bad], got, 2)
    assert [rid for rid, _ in failed] == [11]
    assert "exceed" in failed[0][1] and str(n) in failed[0][1]
    assert step(ref, [gen(0, A, draft_tokens=[B, C]), gen(1, A)], want, 2) == []
    assert same(got[:3], want[:3])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [1.5, "2", True, [1]])
def test_runtime_draft_len_must_be_an_integer(kind, value, make):
    """runtime_draft_len that is a float, a string, a bool or a list raises LayoutError naming
    the argument, and nothing is queued or changed: the next step runs normally."""
    dec = make(kind)
    with pytest.raises(LayoutError, match="runtime_draft_len"):
        dec.add_batch(contexts((0, ABC)), runtime_draft_len=value)
    assert step(dec, contexts((0, ABC)), torch.zeros(1, V), 1) == []
    assert dec.grammar_matchers[0] is not None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("requests", [None, 5, "abc", [object()],
                                      [dataclasses.replace(gen(0, A), is_draft="no")]],
                         ids=["none", "int", "str", "not_a_request", "layout_flag_not_bool"])
def test_batch_that_is_not_a_list_of_requests_is_a_layout_error(kind, requests, make):
    """requests that are not a sequence of requests, or a request whose is_draft /
    is_context_init_state is not a bool (its rows are unknown), raise LayoutError and change
    nothing."""
    dec = make(kind)
    assert step(dec, contexts((0, ABC)), torch.zeros(1, V), 0) == []
    with pytest.raises(LayoutError):
        dec.add_batch(requests)
    got, want = rows(1, 8), rows(1, 8)
    assert step(dec, [gen(0, A)], got, 0) == []
    clean = make(kind)
    assert step(clean, contexts((0, ABC)), torch.zeros(1, V), 0) == []
    assert step(clean, [gen(0, A)], want, 0) == []
    assert same(got, want)


def test_capturable_new_tokens_must_be_an_integer_tensor(make):
    """A float new_tokens tensor (which a copy would truncate) raises TensorArgError at
    add_batch, before the batch is queued."""
    dec = make("capturable")
    with pytest.raises(TensorArgError, match="integer tensor"):
        dec.add_batch(contexts((0, ABC)), torch.zeros(3, 4), 0)
    assert step(dec, contexts((0, ABC)), torch.zeros(1, V), 0) == []


WIDE = [2**32 + B, -2**32 + B, 2**40 + B]  # int64 values whose low 32 bits are the token B


@pytest.mark.parametrize("path", ["python_step", "captured"])
@pytest.mark.parametrize("value", WIDE, ids=["2**32+b", "-2**32+b", "2**40+b"])
def test_int64_new_tokens_past_int32_are_refused_not_wrapped(path, value, make):
    """A new_tokens tensor of int64 holding a value past int32 (whose low 32 bits are a token
    the grammar allows) makes its request fail alone ("outside the vocabulary"), as -1 or V
    do, instead of the int32 copy wrapping it to that token; the other request is served (on
    a Python step and on the captured native node)."""
    if path == "captured" and _native_unavailable() is not None:
        pytest.skip("the C++ host build is unavailable")
    dec = make("capturable", 4, 0)
    ctx = contexts((0, ABC), (1, ABC))
    if path == "captured":
        run = _Captured(dec, ctx).step  # type: ignore[arg-type]
    else:
        def run(reqs, logits, new_tokens=None):
            dec.add_batch(reqs, new_tokens, runtime_draft_len=0)
            dec.execute(logits)
            return dec.take_failed_requests()
    assert run(ctx, torch.zeros(2, V)) == []
    tokens = torch.zeros(1, 4, dtype=torch.int64)
    tokens[0, 0], tokens[0, 1] = value, C
    logits = torch.zeros(2, V)
    failed = run([gen(0, A, prev_seq_slot=0), gen(1, A, prev_seq_slot=1)], logits, tokens)
    assert [f[0] for f in failed] == [10], failed
    assert "outside the vocabulary" in failed[0][1], failed
    assert dec.num_advanced_tokens[:2] == [0, 1]
    assert int(torch.isfinite(logits[1]).sum()) == 4 and bool(torch.isfinite(logits[0]).all())


def test_int64_rollback_count_past_int32_is_refused_not_wrapped(make):
    """The other int64 tensors copied into int32 buffers are clamped alike, not wrapped: a
    rollback_rejected_batch count of -2**32 + 2 fails its request ("cannot roll back"), where
    a wrapping copy kept 2 tokens; the other request rolls back as usual."""
    dec = make("capturable", 4, 2)
    assert step(dec, contexts((0, ABC), (1, ABC)), torch.zeros(2, V), 2) == []
    assert step(dec, [gen(0, A, draft_tokens=[B, C]), gen(1, A, draft_tokens=[B, C])],
                torch.zeros(6, V), 2) == []
    dec.add_batch([gen(0, B), gen(1, B)], runtime_draft_len=0)
    dec.rollback_rejected_batch(torch.tensor([1, -2**32 + 2], dtype=torch.int64))
    dec.execute(torch.zeros(2, V))
    failed = dec.take_failed_requests()
    assert [f[0] for f in failed] == [11] and "cannot roll back" in failed[0][1], failed
    assert dec.num_advanced_tokens[0] == 1


def test_int64_draft_token_past_int32_is_refused_not_wrapped(make):
    """An add_draft_batch token of 2**32 + b (int64) fails its request ("outside the
    vocabulary"), where a wrapping copy fed it b; the other request's draft row is masked."""
    dec = make("capturable", 4, 1)
    assert step(dec, contexts((0, ABC), (1, ABC)), torch.zeros(2, V), 1) == []
    dec.add_batch([gen(0, A), gen(1, A)], runtime_draft_len=1)
    dec.add_draft_batch(torch.tensor([2**32 + B, B], dtype=torch.int64),
                        torch.tensor([1, 1], dtype=torch.int64), 0)
    logits = torch.zeros(2, V)
    dec.execute_draft_batch(logits, draft_step=0)
    failed = dec.take_failed_requests()
    assert [f[0] for f in failed] == [10] and "outside the vocabulary" in failed[0][1], failed
    assert bool(torch.isfinite(logits[0]).all()) and int(torch.isfinite(logits[1]).sum()) == 4


@pytest.mark.parametrize("call", ["rollback", "draft tokens", "draft counts", "draft counts None"])
def test_per_request_tensors_shorter_than_the_batch_are_refused(call, make):
    """rollback_rejected_batch and add_draft_batch read one entry per request of the latest
    add_batch: a tensor with fewer entries than the batch has requests (the rest would be an
    earlier call's values left in the buffer, here the count 3 of a request released from
    the slot before), or no counts at draft step 0, is a TensorArgError naming the argument,
    raised before anything is copied; the step then runs with full tensors exactly as on a
    decoder that never saw the short one."""
    decs = [make("capturable", 4, 2), make("capturable", 4, 2)]
    for dec in decs:
        # request 11 on slot 1 accepts two drafts (count 3 in the buffer's entry 1), then ends
        assert step(dec, contexts((0, ABC), (1, ABC)), torch.zeros(2, V), 2) == []
        assert step(dec, [gen(0, A), gen(1, A, draft_tokens=[B, C])], torch.zeros(6, V),
                    2) == []
        dec.add_batch([gen(0, A), gen(1, C)], runtime_draft_len=0)
        dec.rollback_rejected_batch(torch.tensor([1, 3]))
        dec.execute(torch.zeros(2, V))
        assert dec.take_failed_requests() == []
        dec.release(1)
        assert step(dec, [GuidedRequest.context(21, 1, ABC)], torch.zeros(1, V), 2) == []
        assert step(dec, [gen(0, B), GuidedRequest.generation(21, 1, ABC, A,
                                                              draft_tokens=[B, C])],
                    torch.zeros(6, V), 2) == []
    bad, good = decs
    for dec, short in ((bad, True), (good, False)):
        dec.add_batch([gen(0, C), GuidedRequest.generation(21, 1, ABC, A)],
                      runtime_draft_len=1 if call.startswith("draft") else 0)
        if call == "rollback":
            if short:
                with pytest.raises(TensorArgError, match="num_accepted_tokens has 1 entries "
                                                         "for the 2 requests"):
                    dec.rollback_rejected_batch(torch.tensor([1]))
            dec.rollback_rejected_batch(torch.tensor([1, 1]))
            logits = rows(2, 3)
            dec.execute(logits)
        else:
            tokens, counts = torch.tensor([A, B]), torch.tensor([1, 1])
            if short:
                with pytest.raises(TensorArgError, match="new_tokens has 1 entries" if
                                   call == "draft tokens" else "num_accepted_tokens"):
                    dec.add_draft_batch(
                        tokens[:1] if call == "draft tokens" else tokens,
                        None if call == "draft counts None" else
                        counts[:1] if call == "draft counts" else counts, 0)
            dec.add_draft_batch(tokens, counts, 0)
            logits = rows(2, 3)
            dec.execute_draft_batch(logits, draft_step=0)
        assert dec.take_failed_requests() == []
        if short:
            refused = logits
        else:
            assert same(refused, logits)
            assert bad.num_advanced_tokens == good.num_advanced_tokens


@pytest.mark.parametrize("dtype", [getattr(torch, "uint32", None), getattr(torch, "uint64", None),
                                   torch.bool, torch.float16],
                         ids=["uint32", "uint64", "bool", "float16"])
def test_token_and_count_tensors_of_other_dtypes_are_refused(dtype, make):
    """new_tokens and the per-request count tensors must be int8..int64, uint8 or uint16: a
    uint32 / uint64 tensor (which neither fits int32 nor clamps) is refused with a
    TensorArgError before anything is queued, as a float one is."""
    if dtype is None:
        pytest.skip("no such dtype in this torch")
    dec = make("capturable", 4, 2)
    with pytest.raises(TensorArgError, match="integer tensor"):
        dec.add_batch(contexts((0, ABC)), torch.zeros(3, 4, dtype=dtype), 0)
    assert step(dec, contexts((0, ABC)), torch.zeros(1, V), 0) == []
    with pytest.raises(TensorArgError, match="num_accepted_tokens must be an integer tensor"):
        dec.rollback_rejected_batch(torch.zeros(1, dtype=dtype))


CONFIG_FIELDS = {
    "compile_timeout_s": [float("inf"), 1e12, float("nan"), "5", True, 0],
    "compile_threads": ["2", 2.0, True, 0],
    "compile_cache_bytes": ["1G", 1.5, -1, 2**63],
    "fill_threads": ["1", 1.0, -1],
    "stop_token_ids": [5, "12", [], [1.0], [True], [EOS, "x"]],
    "json_whitespace": ["no", True],
    "json_unenforced_keywords": [["error"], "warn"],
    "native_build": [1, "maybe"],
    "vocab_size_padded": ["64", 64.0, True, 10, 2**31],
    "backend": [5, "vllm"],
    "compile_memory_limit_bytes": [10**30],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in CONFIG_FIELDS.items() for v in vs],
                         ids=lambda x: repr(x)[:20])
def test_config_field_of_wrong_type_or_value_names_the_field(field, value):
    """Every GuidedDecodingConfig field refuses a wrong type (bool/float for an int, a str for a
    list or bool, inf/nan/1e12 seconds) with a ConfigError naming the field; strings are never
    iterated as token lists."""
    with pytest.raises(ConfigError, match=field):
        GuidedDecodingConfig(encoded_vocab=VOCAB, **{field: value})


@pytest.mark.parametrize("field, value, said", [
    ("stop_token_ids", np.array(3), "stop_token_ids"),
    ("stop_token_ids", torch.tensor(3), "stop_token_ids"),
    ("stop_token_ids", torch.tensor([True]), "stop_token_ids"),
    ("encoded_vocab", {"b": 1, "a": 0, "</s>": 2}, "mapping"),
    ("encoded_vocab", {"a", "b"}, "encoded_vocab"),
    ("encoded_vocab", ["a", 5], "encoded_vocab"),
])
def test_config_values_held_otherwise_are_refused_not_read_another_way(field, value, said):
    """A 0-d array or tensor of stop ids (iterating it raised a bare TypeError), a bool
    tensor (read as id 1), a token -> id mapping (read in key order, ignoring the ids: masks
    then allowed other tokens) or a set (no order) as the vocabulary: ConfigError."""
    fields = {"encoded_vocab": VOCAB, "stop_token_ids": [EOS], field: value}
    with pytest.raises(ConfigError, match=said):
        GuidedDecodingConfig(**fields)
    generated = GuidedDecodingConfig(encoded_vocab=(t for t in VOCAB), stop_token_ids=[EOS])
    assert generated.encoded_vocab == VOCAB  # (a generator is read once, as a list)


@pytest.mark.parametrize("field, value", [
    ("json_unenforced_keywords", "ignore"), ("compile_timeout_s", "5"),
    ("max_repetition_count", 2**40), ("stop_token_ids", [0]), ("backend", "llguidance"),
    ("host_step_budget_ms", None), ("vocab_size_padded", 1)])
def test_a_config_cannot_change_after_construction(field, value):
    """Factories, decoders and the disk cache's key read a config once: a field changed after
    construction (json_unenforced_keywords='ignore' compiled schemas with unenforced keywords
    into the shared disk cache under the key of 'error', and a string timeout failed every
    later request with a bare TypeError) is refused; replace() makes a checked copy."""
    config = GuidedDecodingConfig(encoded_vocab=VOCAB, stop_token_ids=[EOS])
    before = getattr(config, field)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, field, value)
    assert getattr(config, field) == before
    if field in ("compile_timeout_s", "max_repetition_count", "vocab_size_padded"):
        with pytest.raises(ConfigError, match=field):
            dataclasses.replace(config, **{field: value})
    copy = dataclasses.replace(config, compile_timeout_s=5)
    assert copy.compile_timeout_s == 5.0 and config.compile_timeout_s == 30.0


@pytest.mark.parametrize("differs", [
    {"encoded_vocab": ["b", "a", *VOCAB[2:]]}, {"stop_token_ids": [0]},
    {"vocab_size_padded": 96}, {"json_unenforced_keywords": "ignore"},
    {"max_repetition_count": 10}])
def test_a_shared_factory_must_read_guides_as_the_decoders_config(differs):
    """A factory built for another vocabulary (a decoder's masks then allowed the other
    vocabulary's tokens: 'b' for the regex a+), other stop ids, another padded width (a raw
    xgrammar shape error on every request) or another schema policy is refused at
    construction, naming the field; an equal config built apart, or one that differs only in
    how the decoder builds, is accepted."""
    config = GuidedDecodingConfig(encoded_vocab=VOCAB, stop_token_ids=[EOS], vocab_size_padded=V)
    other = create_matcher_factory(dataclasses.replace(config, **differs))
    try:
        with pytest.raises(ConfigError, match=next(iter(differs))):
            GuidedDecoder(config, 1, factory=other)
    finally:
        other.close()
    same = create_matcher_factory(GuidedDecodingConfig(encoded_vocab=list(VOCAB),
                                                       stop_token_ids=[EOS],
                                                       vocab_size_padded=V, fill_threads=2))
    try:
        dec = GuidedDecoder(config, 1, factory=same)
        dec.add_batch([GuidedRequest.context(1, 0, GuidedDecodingParams.regex("a+"))])
        logits = torch.zeros(1, V)
        assert dec.execute(logits) == []
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0]
        dec.close()
    finally:
        same.close()


def test_byte_count_variables_take_whole_numbers_only(monkeypatch):
    """CAPGRAPH_COMPILE_CACHE_BYTES=0.9 turned the cache off (truncated to 0); a fraction or a
    count past 2**62 is refused naming the variable; 512M is 512 MiB."""
    for text in ("0.9", "1.5", "1e30"):
        monkeypatch.setenv("CAPGRAPH_COMPILE_CACHE_BYTES", text)
        with pytest.raises(ConfigError, match="CAPGRAPH_COMPILE_CACHE_BYTES"):
            GuidedDecodingConfig(encoded_vocab=VOCAB)
    monkeypatch.setenv("CAPGRAPH_COMPILE_CACHE_BYTES", "512M")
    assert GuidedDecodingConfig(encoded_vocab=VOCAB).compile_cache_bytes == 512 << 20


@pytest.mark.parametrize("schema, said", [
    ({"type": "number", "maximum": float("nan")}, "not JSON"),
    ({"type": "number", "minimum": float("-inf")}, "not JSON"),
    ({"properties": {1: {}, "1": {"type": "string"}}}, "'1' comes twice"),
])
def test_schema_dicts_that_json_cannot_hold_are_refused(schema, said):
    """A schema dict with NaN / infinity (json.dumps wrote non-JSON that failed later with a
    parse error) or keys that print alike (1 and "1": one key twice, one schema lost) is a
    ConfigError at GuidedDecodingParams."""
    with pytest.raises(ConfigError, match=said):
        GuidedDecodingParams.json_schema(schema)


def test_tokenizer_whose_eos_is_not_in_its_vocabulary_is_refused(tokenizer_cache):
    """An EOS string missing from the vocabulary maps to the unknown token's id, which would
    then end guided outputs: refused, naming the token; the bundled tokenizers pass."""
    import copy
    tok = copy.deepcopy(tokenizer_cache("mistral-sp32k"))
    tok.eos_token = "<no_such_eos>"
    with pytest.raises(ConfigError, match="'<no_such_eos>' is not in its vocabulary"):
        GuidedDecodingConfig.from_tokenizer(tok)
    assert GuidedDecodingConfig.from_tokenizer(tokenizer_cache("mistral-sp32k")).stop_token_ids


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
@pytest.mark.parametrize("layout", ["csr", "coo"])
def test_sparse_logits_and_d2t_are_refused(make, layout):
    """Sparse logits (a bare RuntimeError: no strides) and a sparse d2t (a bare TypeError
    inside the mask op) are TensorArgErrors before any matcher moves."""
    dec = make("eager")
    dec.add_batch([GuidedRequest.context(0, 0, ABC)])
    dense = torch.zeros(1, V)
    sparse = dense.to_sparse_csr() if layout == "csr" else dense.to_sparse()
    with pytest.raises(TensorArgError, match="dense"):
        dec.execute(sparse)
    with pytest.raises(TensorArgError, match="d2t must be a dense"):
        dec.execute(dense, torch.zeros(V, dtype=torch.int32).to_sparse())
    assert dec.execute(dense) == []


@pytest.mark.parametrize("args, cache_dir", [
    ((None,), None), ((123,), None), ((b"tekken",), None), (("/tmp/\x00x",), None),
    (("a" * 5000,), None), (("tekken",), "/tmp/\x00")], ids=lambda a: repr(a)[:20])
def test_load_tokenizer_names_what_it_cannot_load(args, cache_dir):
    """Odd names and paths (not a string, a NUL byte, a name too long for the file system, a
    cache folder that cannot be one) are TokenizerLoadErrors, not TypeError / ValueError /
    OSError."""
    from capgraph.errors import TokenizerLoadError
    from capgraph.tokenizers import load_tokenizer
    with pytest.raises(TokenizerLoadError):
        load_tokenizer(*args, **({} if cache_dir is None else {"cache_dir": cache_dir}))


def test_tokenizer_without_eos_needs_stop_token_ids(tokenizer_cache):
    """A tokenizer with no EOS token and no stop_token_ids: a ConfigError at config creation
    that names stop_token_ids (not xgrammar's raw ValueError when the decoder is built); given
    stop_token_ids, the config and a decoder work."""
    import copy
    tok = copy.deepcopy(tokenizer_cache("mistral-sp32k"))
    tok.eos_token = None
    assert tok.eos_token_id is None
    with pytest.raises(ConfigError, match=r"stop_token_ids.*no EOS"):
        GuidedDecodingConfig.from_tokenizer(tok)
    config = GuidedDecodingConfig.from_tokenizer(tok, stop_token_ids=[2])
    assert config.stop_token_ids == [2]
    dec = GuidedDecoder(config, 1)
    dec.add_batch([GuidedRequest.context(0, 0, ABC)])
    logits = torch.zeros(1, len(tok))
    assert dec.execute(logits) == [] and torch.isneginf(logits).any()
    dec.close()


@pytest.mark.parametrize("env", ["inf", "nan", "-1", "lots"])
def test_compile_cache_env_must_be_a_finite_byte_count(env, monkeypatch):
    """CAPGRAPH_COMPILE_CACHE_BYTES=inf/nan/negative/garbage raises ConfigError naming the
    variable."""
    monkeypatch.setenv("CAPGRAPH_COMPILE_CACHE_BYTES", env)
    with pytest.raises(ConfigError, match="CAPGRAPH_COMPILE_CACHE_BYTES"):
        GuidedDecodingConfig(encoded_vocab=VOCAB)


@pytest.mark.parametrize("args,name", [
    ({"rank": "0"}, "rank"), ({"rank": -1}, "rank"), ({"max_num_sequences": 2.0},
                                                      "max_num_sequences"),
    ({"max_num_sequences": True}, "max_num_sequences"),
    ({"max_num_draft_tokens": "1"}, "max_num_draft_tokens"),
    ({"vocab_size_padded": 64.0}, "vocab_size_padded"), ({"device": "nowhere"}, "device"),
    ({"device": "meta"}, "device"), ({"factory": "xgrammar"}, "factory")])
@pytest.mark.parametrize("kind", KINDS)
def test_decoder_constructor_arguments_are_checked(kind, args, name, factory):
    """GuidedDecoder / CapturableGuidedDecoder arguments of the wrong type raise ConfigError
    naming the argument."""
    cls = GuidedDecoder if kind == "eager" else CapturableGuidedDecoder
    kw = {"max_num_sequences": 2, "factory": factory, **args}
    with pytest.raises(ConfigError, match=name):
        cls(factory.config, **kw)


@pytest.mark.parametrize("text", ['{"type": "integer"} junk', '{"type": "integer"}{}',
                                  '{"type": "string"} {"not": {}}'])
def test_json_schema_text_with_trailing_garbage_is_refused(text):
    """JSON-schema text with anything after its first JSON value is refused at construction
    (a backend would compile the first value alone, past the unenforced-keyword check);
    surrounding whitespace is fine."""
    with pytest.raises(ConfigError, match="one JSON document"):
        GuidedDecodingParams.json_schema(text)
    assert GuidedDecodingParams.json_schema('  {"type": "integer"}\n').guide


def _nested_dict(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("make_guide,what", [
    (lambda: GuidedDecodingParams.json_schema('{"type":"array","items":' * 3000 + "{}"
                                              + "}" * 3000), "3001 levels"),
    (lambda: GuidedDecodingParams.json_schema('{"allOf":[' * 900 + "{}" + "]}" * 900),
     "1801 levels"),
    (lambda: GuidedDecodingParams.structural_tag('{"type":"structural_tag","format":'
                                                 + "[" * 5000 + "]" * 5000 + "}"),
     "5001 levels"),
    (lambda: GuidedDecodingParams.json_schema(_nested_dict(5000)), "nests too deeply"),
], ids=["schema_arrays", "schema_allOf", "structural_tag_lists", "schema_dict"])
def test_guide_nested_past_the_recursion_limit_is_a_config_error(make_guide, what):
    """JSON guide text (or a schema dict) nested deeper than Python's parser recurses raises a
    ConfigError naming GuidedDecodingParams.guide and the nesting, not a bare RecursionError."""
    with pytest.raises(ConfigError, match="GuidedDecodingParams.guide") as info:
        make_guide()
    assert what in str(info.value) and "recursion limit" in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seq_slots", [None, 0, 1.5, "0", b"0"])
def test_forced_tokens_batch_of_a_non_sequence_is_a_request_error(kind, seq_slots, make):
    """forced_tokens_batch's seq_slots that is not a sequence of slots (None, an int, a str)
    raises RequestError naming seq_slots, as a bad slot in it does; a generator is read once
    and its slots checked."""
    dec = make(kind)
    with pytest.raises(RequestError, match="seq_slots must be a sequence"):
        dec.forced_tokens_batch(seq_slots, 3)
    with pytest.raises(RequestError, match="seq_slot 99"):
        dec.forced_tokens_batch(iter([0, 99]), 3)


# -- family 4: the guide of a slot --------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["never_had_context", "released", "other_guide"])
def test_generation_request_without_its_matcher_fails(kind, case, make):
    """A generation request whose slot never had a context request, whose slot was released, or
    which carries another guide than the one its slot's matcher was created for fails alone
    (RequestError), instead of being served unguided or masked by the old grammar; the other
    request's rows are bit-identical."""
    dec, clean = make(kind), make(kind)
    ctx = contexts((0, ABC)) if case == "never_had_context" else contexts((0, ABC), (1, ABC))
    assert step(dec, ctx, torch.zeros(len(ctx), V), 0) == []
    assert step(clean, contexts((0, ABC)), torch.zeros(1, V), 0) == []
    if case == "released":
        dec.release(1)
    odd = gen(1, X, XYZ) if case == "other_guide" else gen(1, A)
    got, want = rows(2, 9), rows(2, 9)
    failed = step(dec, [gen(0, A), odd], got, 0)
    assert step(clean, [gen(0, A)], want[:1], 0) == []
    assert [f[0] for f in failed] == [11] and "RequestError" in failed[0][1], failed
    assert ("differ" if case == "other_guide" else "no matcher") in failed[0][1]
    assert same(got[:1], want[:1]) and same(got[1:], rows(2, 9)[1:])


@pytest.mark.parametrize("kind", KINDS)
def test_equal_guide_and_disaggregated_first_step_are_served(kind, make):
    """A generation request carrying an equal (not identical) guide is served by its slot's
    matcher, and a disaggregated first generation step creates its matcher (it is not
    "missing a context")."""
    dec = make(kind)
    assert step(dec, contexts((0, ABC)), torch.zeros(1, V), 0) == []
    copy = GuidedDecodingParams.regex("[a-c]+")
    assert copy == ABC and copy is not ABC
    first = dataclasses.replace(gen(1, A), is_generation_only_first_iteration=True)
    dec.add_batch([gen(0, A, copy), first], runtime_draft_len=0)
    dec.init_disagg_gen_requests()
    logits = torch.zeros(2, V)
    failed = dec.execute(logits)
    failed = failed if failed is not None else dec.take_failed_requests()
    assert failed == []
    assert torch.isfinite(logits).sum(dim=1).tolist() == [4, 4]  # a, b, c and EOS
    assert step(dec, [gen(0, B, copy), gen(1, C)], torch.zeros(2, V), 0) == []


def _native_unavailable() -> str | None:
    from capgraph.build import library
    return library.unavailable_reason()


class _Captured:
    """A capturable decoder whose steps replay one captured HostGraph (2 static logits rows),
    so that from the capture on they take the native host node where it runs."""

    def __init__(self, dec: CapturableGuidedDecoder, requests) -> None:
        self.dec, self.static = dec, torch.zeros(2, V)
        dec.add_batch(requests)
        self.graph = hostfunc.HostGraph()
        with hostfunc.capture(self.graph):
            dec.execute(self.static)

    def step(self, reqs, logits: torch.Tensor, new_tokens: torch.Tensor | None = None) -> list:
        self.dec.add_batch(reqs, new_tokens, runtime_draft_len=0)
        self.static[:logits.shape[0]].copy_(logits)
        self.graph.replay()
        hostfunc.drain()
        logits.copy_(self.static[:logits.shape[0]])
        return self.dec.take_failed_requests()


def _decoder_pair(kind: str, build: str, factory) -> tuple[list, Any, Any]:
    """Two decoders of ``kind`` ("eager", "capturable", or "captured": capturable with its
    steps replayed through one captured HostGraph on the native host node) on the host build
    ``build`` (skipped where the C++ build is unavailable), each set up with a context
    request on slot 0 (ABC): the decoders (to close) and a step function for each."""
    if build != "python" and (reason := _native_unavailable()) is not None:
        pytest.skip(f"the C++ host build is unavailable: {reason}")
    cls = GuidedDecoder if kind == "eager" else CapturableGuidedDecoder
    kw = {"host_node": "native"} if kind == "captured" else {}
    made = [cls(factory.config, 4, 0, factory=factory, host_build=build, **kw)
            for _ in range(2)]
    if kind == "captured":
        runs = [_Captured(d, contexts((0, ABC))).step for d in made]  # type: ignore[arg-type]
        assert made[0].host_node == "native"  # type: ignore[attr-defined]
    else:
        runs = [lambda r, l, d=d: step(d, r, l, 0) for d in made]
    for go in runs:
        assert go(contexts((0, ABC)), torch.zeros(1, V)) == []
    return made, runs[0], runs[1]


@pytest.mark.parametrize("kind,build", [(k, b) for k in KINDS
                                        for b in ("python", "native-loop", "native")]
                         + [("captured", "native")])
def test_second_request_on_a_slot_leaves_the_slot_to_its_first(kind, build, factory):
    """A batch ``[generation on slot 0, a context request also on slot 0 with another
    guide]``: the second fails alone ("appears twice") and changes nothing of the slot, whose
    guide stays the first request's, so that request's next step is served and masked as in a
    run without the duplicate (on every build, and through the captured native node)."""
    made, run, clean = _decoder_pair(kind, build, factory)
    try:
        got, want = rows(2, 21), rows(1, 21)
        twin = GuidedRequest.context(20, 0, XYZ)
        failed = run([gen(0, A), twin], got)
        assert [f[0] for f in failed] == [20] and "appears twice" in failed[0][1], failed
        assert clean([gen(0, A)], want) == []
        assert same(got[:1], want) and same(got[1:], rows(2, 21)[1:])
        for k, token in enumerate((B, C)):  # the first request's next steps, alone
            got, want = rows(1, 30 + k), rows(1, 30 + k)
            assert run([gen(0, token)], got) == []
            assert clean([gen(0, token)], want) == []
            assert same(got, want) and int(torch.isfinite(got).sum()) == 4  # a, b, c, EOS
    finally:
        for d in made:
            d.close()


@pytest.mark.parametrize("kind,build", [(k, b) for k in KINDS
                                        for b in ("python", "native-loop", "native")]
                         + [("captured", "native")])
@pytest.mark.parametrize("token", [C, 99], ids=["allowed-token", "bad-token"])
def test_a_request_on_a_slot_another_request_owns_is_refused_and_the_owner_kept(kind, build,
                                                                               token, factory):
    """A slot's matcher belongs to the request whose context request created it: a
    generation request of another request_id on that slot, with the very same guide object
    (request 20 on request 10's slot, which the engine never released), is refused by name
    ("holds the matcher of request 10"; a token out of the vocabulary is named first); its
    rows stay unmasked, the owner's matcher is neither advanced nor dropped,
    and the owner's next steps are masked as in a run that never saw request 20 (on every
    build, and through the captured native node)."""
    made, run, clean = _decoder_pair(kind, build, factory)
    try:
        for go in (run, clean):
            assert go([gen(0, A)], torch.zeros(1, V)) == []
        got = rows(1, 40)
        failed = run([GuidedRequest.generation(20, 0, ABC, token)], got)
        assert [f[0] for f in failed] == [20], failed
        assert ("holds the matcher of request 10" if token == C else
                "outside the vocabulary") in failed[0][1], failed
        assert same(got, rows(1, 40))  # unmasked
        for k, next_token in enumerate((B, C)):  # the owner's next steps
            got, want = rows(1, 50 + k), rows(1, 50 + k)
            assert run([gen(0, next_token)], got) == []
            assert clean([gen(0, next_token)], want) == []
            assert same(got, want) and int(torch.isfinite(got).sum()) == 4  # a, b, c, EOS
    finally:
        for d in made:
            d.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["owner alone", "owner, then intruder", "intruder, then owner",
                                  "owner id None"])
def test_a_refused_owner_drops_its_matcher_whatever_else_is_on_the_slot(kind, case, make):
    """The slot's owner refused at admission (draft_tokens given as a string) drops its own
    matcher, which never took the refused step, so its later rows go unmasked rather than
    masked from a stale state: alone, beside a refused generation request of another
    request_id on the same slot (in either order: a refused request keeps nothing), and for
    an owner whose request_id is None (its id as any int is)."""
    rid = None if case == "owner id None" else 10
    dec = make(kind)
    assert step(dec, [GuidedRequest.context(rid, 0, ABC)], torch.zeros(1, V), 0) == []
    assert step(dec, [GuidedRequest.generation(rid, 0, ABC, A)], torch.zeros(1, V), 0) == []
    bad = GuidedRequest.generation(rid, 0, ABC, B, draft_tokens="ab")
    intruder = GuidedRequest.generation(20, 0, ABC, B)
    batch = {"owner, then intruder": [bad, intruder],
             "intruder, then owner": [intruder, bad]}.get(case, [bad])
    failed = step(dec, batch, torch.zeros(len(batch), V), 0)
    assert sorted(f[0] for f in failed) == sorted([-1 if rid is None else rid] +
                                                  ([20] if len(batch) == 2 else [])), failed
    assert dec.grammar_matchers[0] is None
    logits = rows(1, 60)
    step(dec, [GuidedRequest.generation(rid, 0, ABC, B)], logits, 0)
    assert same(logits, rows(1, 60))  # unmasked, not masked from the stale matcher


# -- property: garbage in every public argument --------------------------------------------------

GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 70),
    st.floats(allow_nan=True), st.text(max_size=4), st.binary(max_size=4),
    st.lists(st.one_of(st.integers(-5, 70), st.floats(-2, 70), st.text(max_size=2)),
             max_size=4),
    st.tuples(st.integers(0, 30)),
    st.builds(lambda n: torch.arange(n), st.integers(0, 3)),
    st.builds(lambda n: torch.ones(n) * 2.0, st.integers(0, 3)),
    st.builds(lambda n: torch.ones(n, 2, dtype=torch.int32), st.integers(0, 3)),
    st.just(np.int64(3)), st.just(np.float32(1.0)), st.just(object()), st.just({}),
    st.just(ABC), st.just(XYZ),
)
REQUEST_FIELD_NAMES = ["guided_decoding_params", "request_id", "seq_slot", "prev_seq_slot",
                       "is_context_init_state", "is_last_context_chunk",
                       "is_generation_in_progress_state", "is_generation_only_first_iteration",
                       "new_token", "is_draft", "draft_tokens", "num_accepted_draft_tokens"]
BAD_LOGITS = ["strided", "transposed", "expanded", "int", "extra_row", "3d", "narrow", "empty"]


FIELDS = st.dictionaries(st.sampled_from(REQUEST_FIELD_NAMES), GARBAGE, min_size=1, max_size=3)
LOGITS = st.one_of(st.sampled_from(BAD_LOGITS), GARBAGE)
D2T = st.one_of(GARBAGE, st.builds(
    lambda k, v: torch.zeros(V, dtype=torch.int32).index_fill_(0, torch.tensor([k]), v),
    st.integers(0, V - 1), st.integers(-70, 70)))


def _bad_logits(spec, n: int):
    if not isinstance(spec, str) or spec not in BAD_LOGITS:
        return spec
    return {"strided": rows(n, 0, 2 * V)[:, ::2], "transposed": rows(V, 0, n).t(),
            "expanded": rows(1, 0).expand(n, V), "int": rows(n, 0).to(torch.int32),
            "extra_row": rows(n + 1, 0), "3d": rows(n, 0)[None], "narrow": rows(n, 0, V - 1),
            "empty": torch.zeros(n, 0)}[spec]


def _int_or_none(value) -> int | None:
    return value if type(value) is int else None


def _fill(matcher: GrammarMatcher) -> list[int]:
    probe = torch.zeros(1, 2, dtype=torch.int32)
    matcher.fill_next_token_bitmask(probe, 0)
    return probe[0].tolist()


def _states(dec: GuidedDecoder, failures: list | None = None) -> list:
    """What each healthy slot's matcher allows next (equal states allow the same tokens); the
    failures taken on the way (this ends a build still in flight) go to ``failures``."""
    taken = dec.take_failed_requests()
    if failures is not None:
        failures.extend(taken)
    return [_fill(dec.grammar_matchers[s]) for s in (0, 2)]


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), case=st.one_of(
           st.tuples(FIELDS, st.none(), st.none()),  # a bad request
           st.tuples(st.just({}), LOGITS, st.none()),  # bad logits
           st.tuples(st.just({}), st.none(), D2T),  # a bad d2t
           st.tuples(FIELDS, LOGITS, D2T)),  # all at once
       seed=st.integers(0, 3))
def test_garbage_in_requests_and_step_tensors_is_named_and_isolated(factory, kind, case, seed):
    """Garbage in any field of one request, and in execute's logits and d2t: add_batch and
    execute raise a CapgraphError or serve the step, never a generic exception; an error leaves
    every matcher where it was (the retry then masks as a clean decoder); the two healthy
    requests' rows are bit-identical to a decoder that never saw the bad request, and only the
    bad request can fail."""
    fields, logits, d2t = case
    assume(_int_or_none(fields.get("seq_slot")) not in (0, 2))  # (its own slot, not theirs)
    assume(_int_or_none(fields.get("request_id")) not in (10, 12))
    dec, clean = (new_decoder(factory, kind, 3, 1) for _ in range(2))
    try:
        # two guides, so that a mask leaking into another request's row would show
        for d in (dec, clean):  # a context step, then a step with a draft (rollback material)
            assert step(d, contexts((0, ABC), (1, ABC), (2, XYZ)), torch.zeros(3, V), 1) == []
            assert step(d, [gen(0, A, draft_tokens=[B]), gen(1, A, draft_tokens=[B]),
                            gen(2, X, XYZ, draft_tokens=[X + 1])], torch.zeros(6, V), 1) == []
        bad = gen(1, B, draft_tokens=[C])
        for name, value in fields.items():
            setattr(bad, name, value)
        healthy = [gen(0, B, draft_tokens=[C]), gen(2, X + 1, XYZ, draft_tokens=[X + 2])]
        before = _states(dec)
        try:
            if isinstance(dec, CapturableGuidedDecoder):
                dec.add_batch([healthy[0], bad, healthy[1]], runtime_draft_len=1)
            else:
                dec.add_batch([healthy[0], bad, healthy[1]], 1)
        except CapgraphError:
            assert _states(dec) == before
            return
        if isinstance(dec, CapturableGuidedDecoder):
            dec.rollback_rejected_batch(torch.ones(3, dtype=torch.int32))
        else:
            dec.rollback_rejected_tokens()
        failures: list = []
        rolled_back = _states(dec, failures)
        n = dec.requests.num_bitmask_tokens
        table = d2t if isinstance(d2t, torch.Tensor) and d2t.shape == (V,) and \
            d2t.dtype == torch.int32 and bool(((d2t + torch.arange(V)) >= 0).all()) and \
            bool(((d2t + torch.arange(V)) < V).all()) else None
        served = rows(n, seed) if logits is None else _bad_logits(logits, n)
        values = served.clone() if isinstance(served, torch.Tensor) else None
        try:
            failures += retry(dec, served, d2t)
        except CapgraphError:
            assert _states(dec, failures) == rolled_back, "a matcher moved before the error"
            served, table = rows(n, seed), None
            values = served.clone()
            failures += retry(dec, served)  # the documented retry: each token fed once
        else:
            if d2t is not None and table is None:
                values = None  # (a table accepted but not the one compared below)
        bad_id = as_int(fields.get("request_id", 11))
        assert {f[0] for f in failures} <= {-1, 11, bad_id}, failures
        clean.add_batch(healthy, runtime_draft_len=1) if kind != "eager" else \
            clean.add_batch(healthy, 1)
        if isinstance(clean, CapturableGuidedDecoder):
            clean.rollback_rejected_batch(torch.ones(2, dtype=torch.int32))
        else:
            clean.rollback_rejected_tokens()
        offsets = [dec.requests.offsets[k] for k in (0, 2)]
        if values is not None and values.dim() == 2 and values.shape[1] == V:
            # the served logits, whatever their layout: each healthy request's rows must be
            # masked exactly as a clean decoder masks the same values
            want = torch.cat([values[o:o + 2] for o in offsets]).contiguous()
            assert retry(clean, want, table) == []
            for k, o in enumerate(offsets):
                assert same(served[o:o + 2].contiguous(), want[2 * k:2 * k + 2]), \
                    f"healthy request {2 * k} changed"
        else:
            assert retry(clean, rows(4, seed), table) == []
        assert _states(dec) == _states(clean)
    finally:
        dec.close()
        clean.close()


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(draft_len=GARBAGE, accepted=GARBAGE, slot=GARBAGE, draft_tokens=GARBAGE,
       draft_step=GARBAGE, draft_logits=st.one_of(st.sampled_from(BAD_LOGITS), GARBAGE))
def test_garbage_in_batch_arguments_is_a_named_error(factory, draft_len, accepted, slot,
                                                      draft_tokens, draft_step, draft_logits):
    """Garbage in runtime_draft_len, the rollback counts, release's slot and the capturable
    drafting API (add_draft_batch, execute_draft_batch, rollback_rejected_batch) raises a
    CapgraphError (from a host callback: hostfunc.HostFuncError caused by one) or is served,
    never a generic exception, and the decoders keep serving: a healthy step afterwards masks
    as on a decoder that never saw the garbage."""
    decs = [GuidedDecoder(factory.config, 3, 1, factory=factory),
            CapturableGuidedDecoder(factory.config, 3, 1, factory=factory)]
    clean = GuidedDecoder(factory.config, 3, 1, factory=factory)
    try:
        for d in (*decs, clean):
            assert step(d, contexts((0, ABC)), torch.zeros(1, V), 1) == []
        eager, capt = decs
        calls = [lambda: eager.add_batch([gen(0, A)], draft_len),
                 lambda: capt.add_batch([gen(0, A)], runtime_draft_len=draft_len),
                 lambda: eager.release(slot), lambda: capt.release(slot),
                 lambda: capt.rollback_rejected_batch(accepted),
                 lambda: capt.add_draft_batch(draft_tokens, accepted, draft_step),
                 lambda: capt.execute_draft_batch(_bad_logits(draft_logits, 1), None, draft_step)]
        for call in (*calls, hostfunc.drain):
            try:
                call()
            except CapgraphError:
                pass
            except hostfunc.HostFuncError as e:
                # a host callback's error, re-raised at the drain (the capturable protocol's
                # way, e.g. a draft step whose add_batch was refused): a named cause
                assert isinstance(e.__cause__, CapgraphError), e
        for d in decs:  # whatever the garbage did to slot 0, a fresh request is served
            d.take_failed_requests()
            d.release(0)
            d.requests = None
            if isinstance(d, CapturableGuidedDecoder):
                d.discard_queued_batches()
        clean.release(0)
        for d in (*decs, clean):
            assert step(d, contexts((0, XYZ)), torch.zeros(1, V), 1) == []
        want = rows(2, 1)
        assert step(clean, [gen(0, X, XYZ, draft_tokens=[X])], want, 1) == []
        for d in decs:
            got = rows(2, 1)
            assert step(d, [gen(0, X, XYZ, draft_tokens=[X])], got, 1) == []
            assert same(got, want)
    finally:
        for d in (*decs, clean):
            d.close()


CONFIG_FIELD_NAMES = ["backend", "tokenizer", "encoded_vocab", "stop_token_ids",
                      "vocab_size_padded", "compile_cache_bytes", "compile_timeout_s",
                      "compile_threads", "fill_threads", "native_build", "json_whitespace",
                      "json_max_whitespace", "json_unenforced_keywords", "max_repetition_count",
                      "host_step_budget_ms"]


@settings(max_examples=150, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(CONFIG_FIELD_NAMES), GARBAGE, min_size=1,
                              max_size=3))
def test_garbage_config_fields_are_a_config_error_or_typed(fields):
    """GuidedDecodingConfig with garbage in any public field raises ConfigError, or builds a
    config whose integer fields are ints, whose duration is finite and whose stop tokens are
    a list of ints: never a generic exception, never a silently coerced value."""
    base = {"encoded_vocab": VOCAB, "stop_token_ids": [EOS], "native_build": "off"}
    try:
        config = GuidedDecodingConfig(**{**base, **fields})
    except ConfigError:
        return
    for name in ("vocab_size_padded", "compile_cache_bytes", "compile_threads", "fill_threads",
                 "json_max_whitespace", "max_repetition_count"):
        assert type(getattr(config, name)) is int, name
    assert math.isfinite(config.compile_timeout_s) and config.compile_timeout_s > 0
    budget = config.host_step_budget_ms
    assert budget is None or (type(budget) in (int, float) and math.isfinite(budget)
                              and budget >= 0)  # (0 and None: no budget)
    assert type(config.stop_token_ids) is list and all(type(t) is int
                                                       for t in config.stop_token_ids)
    assert config.stop_token_ids or fields.get("stop_token_ids", [EOS]) is None  # (no EOS)
    assert config.tokenizer_vocab_size >= 1
    assert type(config.native_build) is str and type(config.json_whitespace) is str


@settings(max_examples=150, deadline=None)
@given(guide_type=st.one_of(GARBAGE, st.sampled_from(list(GuideType)),
                            st.sampled_from([t.value for t in GuideType])),
       guide=st.one_of(GARBAGE, st.text(max_size=30),
                       st.dictionaries(st.text(max_size=3), GARBAGE, max_size=2)))
def test_garbage_guide_params_are_a_config_error_or_a_text_guide(guide_type, guide):
    """GuidedDecodingParams with garbage guide_type / guide raises ConfigError or holds a
    GuideType and a str guide: never a generic exception (a dict that is not JSON included)."""
    try:
        params = GuidedDecodingParams(guide_type, guide)
    except ConfigError:
        return
    assert isinstance(params.guide_type, GuideType) and type(params.guide) is str


def test_a_shared_factory_accepts_a_copy_of_its_config(factory_cache):
    """A config copied (deepcopy, or unpickled) holds an equal,
    not the same, tokenizer: the factory still reads guides as it does, so it is accepted."""
    import copy
    factory = factory_cache("tekken")
    dec = GuidedDecoder(copy.deepcopy(factory.config), 1, factory=factory)
    dec.close()
