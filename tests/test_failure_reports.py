"""One failure, one report: a request whose matcher raised inside the build is not reported
again by the rollback that follows, on the Python build, the C++ build and the capturable
decoder."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from capgraph import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.build import library as native
from capgraph.grammar import create_matcher_factory
from capgraph.requests import GuidedRequest
from conftest import AimedMethods

VOCAB = ["a", "b", "</s>", "ab", "c", "d"]
ALIVE = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= ("a" | "b")+')
V = 64  # padded width of the logits rows
needs_native = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"no C++ build here: {native.unavailable_reason()}")


@pytest.fixture(scope="module")
def tiny():
    """xgrammar over a 6-token raw vocabulary padded to 64 ids."""
    config = GuidedDecodingConfig(encoded_vocab=VOCAB, stop_token_ids=[2], vocab_size_padded=V,
                                  native_build="off")
    factory = create_matcher_factory(config)
    yield factory
    factory.close()


class _FillRaises:
    """A matcher that accepts tokens as its inner one does and raises when it fills a row:
    the failure comes after the new token advanced it."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def accept_token(self, token_id):
        return self.inner.accept_token(token_id)

    def fill_next_token_bitmask(self, bitmask, index):
        raise RuntimeError("fill raised")

    def rollback(self, num_tokens):
        self.inner.rollback(num_tokens)

    def is_terminated(self):
        return self.inner.is_terminated()


def _fill_raises_natively() -> AimedMethods:
    """xgrammar's FFI methods for the C++ loop, with the fill of the matcher aimed at later
    raising (tvm-ffi carries the error through C++ back to the decoder)."""

    def raising_fill(fill, handle, bitmask, index, debug):
        raise RuntimeError("fill raised")

    return AimedMethods(fill=raising_fill)


def _first_step(dec) -> None:
    """Slot 0 and slot 1 start their matchers."""
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE), GuidedRequest.context(2, 1, ALIVE)])
    assert dec.execute(torch.zeros(2, V)) in ([], None)
    dec.take_failed_requests()


def _drafting_batch() -> list[GuidedRequest]:
    """Both requests advance by their new token "a" and two drafts "a" "b"."""
    return [GuidedRequest.generation(1, 0, ALIVE, 0, draft_tokens=[0, 1]),
            GuidedRequest.generation(2, 1, ALIVE, 0, draft_tokens=[0, 1])]


@pytest.mark.parametrize("build", ["python", pytest.param("native", marks=needs_native)])
def test_rollback_does_not_report_a_build_failure_again(tiny, build):
    """The request whose matcher raised while its rows were filled is reported once, by
    ``execute``; the ``rollback_rejected_tokens`` of the same step skips its slot (advance
    count zeroed, as a dead end leaves it) and still rolls back the other request."""
    config = dataclasses.replace(tiny.config, native_build="on" if build == "native" else "off")
    methods = _fill_raises_natively() if build == "native" else None
    dec = GuidedDecoder(config, 2, 2, factory=tiny,
                        host_build=methods.host_build() if methods else "python")
    _first_step(dec)
    if methods is not None:
        methods.aim(dec.grammar_matchers[0])
    else:
        dec.grammar_matchers[0] = _FillRaises(dec.grammar_matchers[0])
    reqs = _drafting_batch()
    dec.add_batch(reqs)
    failed = dec.execute(torch.zeros(6, V))
    assert [(rid, msg.split(":")[0]) for rid, msg in failed] == [(1, "RuntimeError")]
    assert dec.grammar_matchers[0] is None and dec.num_advanced_tokens[0] == 0
    assert dec.num_advanced_tokens[1] == 3
    for r in reqs:
        r.num_accepted_draft_tokens = 0  # verification rejected both drafts
    dec.rollback_rejected_tokens()
    assert dec.take_failed_requests() == []
    assert dec.num_advanced_tokens[1] == 1
    dec.close()


def test_capturable_rollback_does_not_report_a_build_failure_again(tiny):
    """The same on the capturable decoder: the build callback reports the failure once, and
    the rollback callback of ``rollback_rejected_batch`` reports nothing."""
    config = dataclasses.replace(tiny.config, native_build="off")
    capt = CapturableGuidedDecoder(config, 2, 2, factory=tiny)
    try:
        _first_step(capt)
        capt.grammar_matchers[0] = _FillRaises(capt.grammar_matchers[0])
        capt.add_batch(_drafting_batch())
        capt.execute(torch.zeros(6, V))
        failed = capt.take_failed_requests()
        assert [(rid, msg.split(":")[0]) for rid, msg in failed] == [(1, "RuntimeError")]
        capt.rollback_rejected_batch(torch.tensor([1, 1], dtype=torch.int32))
        assert capt.take_failed_requests() == []
        assert capt.num_advanced_tokens[0] == 0 and capt.num_advanced_tokens[1] == 1
    finally:
        capt.close()
