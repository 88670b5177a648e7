"""Admission: every request of a batch is checked before any matcher moves.

:class:`Admission` holds, per slot, the guide its matcher is (being) created for and the
request that creates it (its owner), in ``add_batch`` order (the matcher itself may be created
later, by a host callback). A request passes when its fields have the exact types the build
reads and, where it advances a matcher, it is its slot's owner and carries its slot's guide; a
draft tree's parents must form a tree (each parent an earlier node or -1), and the number of
its nodes must match its draft tokens. A request that fails is replaced by an unguided stand-in
with the same rows and reported; a matcher it owned is dropped (by the decoder, before the
build), and no other request's.
"""

from __future__ import annotations

from typing import cast

from .errors import RequestError
from .params import GuidedDecodingParams
from .requests import GuidedRequest, as_int, checked_request

__all__ = ["Admission", "AdmissionResult"]

#: ``(requests to build, slots whose matcher is dropped, requests that may start a compile,
#: failures as (request_id, message))``
AdmissionResult = tuple[list, list[int], list[GuidedRequest], list[tuple[int, str]]]


class Admission:
    """The admission checks of one decoder (``max_num_sequences`` slots, vocabulary ``V``)."""

    def __init__(self, max_num_sequences: int, vocab_size_padded: int,
                 max_num_draft_tokens: int) -> None:
        self.max_num_sequences = max_num_sequences
        self.vocab_size_padded = vocab_size_padded
        self.max_num_draft_tokens = max_num_draft_tokens
        #: per slot, the guide its matcher is (being) created for, or None
        self.slot_guides: list[GuidedDecodingParams | None] = [None] * max_num_sequences
        #: per slot, the request_id of the request that created its matcher (the slot's
        #: owner: only it advances that matcher), or None
        self.slot_owners: list[int | None] = [None] * max_num_sequences

    def admit(self, requests: list, tokens_elsewhere: bool, start: int = 0) -> AdmissionResult:
        """Check ``requests[start:]`` (in place: a failed one becomes an unguided stand-in,
        one with convertible values its checked copy).

        The common request (generating, target or draft, exact types, the slot's own guide)
        passes the inline test; every other one takes :func:`checked_request` and the slot's
        guide check (:meth:`_check_guide`). ``tokens_elsewhere``: see ``checked_request``.
        ``start``: the requests before it passed the same test natively
        (:meth:`capgraph.build.HostBuild.admit`).
        """
        nseq, V, maxd, guides, owners = (self.max_num_sequences, self.vocab_size_padded,
                                         self.max_num_draft_tokens, self.slot_guides,
                                         self.slot_owners)
        # (no request is read past this loop before the build: a failure here changes nothing)
        # (index, slot, guide, owner)
        updates: list[tuple[int, int, GuidedDecodingParams, int | None]] = []
        dropped: list[int] = []
        failed: list[tuple[int, str]] = []
        fresh: list[GuidedRequest] = []
        for i in range(start, len(requests)):
            req = requests[i]
            try:  # (an attribute that raises: checked_request names it)
                params = req.guided_decoding_params
                if params is None:
                    if type(req.is_draft) is bool and type(req.is_context_init_state) is bool:
                        continue
                elif (req.is_generation_in_progress_state is True and type(req.is_draft) is bool
                        and req.is_context_init_state is False
                        and req.is_generation_only_first_iteration is False
                        and type(slot := req.seq_slot) is int and 0 <= slot < nseq
                        and guides[slot] is params and type(req.request_id) is int
                        and owners[slot] == req.request_id
                        and ((d := req.draft_tokens) is None or type(d) is list)
                        and getattr(req, "draft_parents", None) is None):  # (a tree: checked)
                    # (the values read per token, new_token and each draft token, are checked
                    # where the build reads them, before the request's matcher moves;
                    # num_accepted_draft_tokens by rollback_rejected_tokens)
                    continue
            except Exception:
                pass
            try:
                checked = checked_request(req, i, num_slots=nseq, vocab_size=V,
                                          max_num_draft_tokens=maxd,
                                          tokens_elsewhere=tokens_elsewhere)
                if checked.guided_decoding_params is not None:
                    self._check_guide(checked, i, updates)
            except RequestError as e:
                self._refuse(requests, i, e, updates, dropped, failed)
                continue
            requests[i] = checked
            fresh.append(checked)
        if updates:
            # a slot belongs to the first guided request of the batch on it (the build fails
            # any later one, "appears twice", before it touches the slot): a later request's
            # guide is not recorded, nor its compile started
            slots = [_field(r, "seq_slot") for r in requests]
            for i, slot, params, owner in updates:
                if _first_on_slot(requests, slots, i, slot):
                    guides[slot], owners[slot] = params, owner
                else:
                    fresh = [r for r in fresh if r is not requests[i]]
        return requests, dropped, fresh, failed

    def _check_guide(self, req: GuidedRequest, index: int,
                     updates: list[tuple[int, int, GuidedDecodingParams, int | None]]) -> None:
        """A request (at ``index`` of its batch) that creates its slot's matcher records its
        guide and itself as the slot's owner (in ``updates``); one that advances it must be
        that owner (the same ``request_id``) and carry that guide (the same object, or an
        equal one)."""
        slot = cast(int, req.seq_slot)  # (both checked by checked_request)
        params = cast(GuidedDecodingParams, req.guided_decoding_params)
        rid = cast(int, req.request_id)
        if not req.is_draft and (req.is_generation_only_first_iteration
                                 or (req.is_context_init_state and req.is_last_context_chunk)):
            updates.append((index, slot, params, rid))
            return
        if not req.require_matcher_advance():
            return
        held, owner = self.slot_guides[slot], self.slot_owners[slot]
        if held is None:
            raise RequestError(f"seq_slot {slot} has no matcher for this request: no context "
                               "request (or disaggregated first generation step) created "
                               "one, or the slot was released", request_id=rid, seq_slot=slot)
        if owner != rid:
            raise RequestError(f"seq_slot {slot} holds the matcher of request {owner}, not of "
                               f"request {rid}: a request advances only the matcher its own "
                               "context request (or disaggregated first generation step) "
                               "created; a new request on the slot needs the slot released "
                               "and a context request", request_id=rid, seq_slot=slot)
        if held is params:
            return
        if held != params:
            raise RequestError(f"guided_decoding_params ({_guide_text(params)}) differ from "
                               f"the guide slot {slot}'s matcher was created for "
                               f"({_guide_text(held)}); a new guide needs a context request",
                               request_id=rid, seq_slot=slot)
        updates.append((index, slot, params, rid))  # equal: later steps match by identity

    def _refuse(self, requests: list, i: int, error: RequestError,
                updates: list[tuple[int, int, GuidedDecodingParams, int | None]],
                dropped: list[int], failed: list[tuple[int, str]]) -> None:
        """Replace ``requests[i]`` by an unguided stand-in with its rows and record ``error``.
        The slot's matcher is dropped when it was this request's (its slot, its guide, the
        slot's owner its ``request_id``) or when this request was to replace it, unless
        another guided request of the batch keeps the slot (the owner again, or a request
        creating the slot's matcher); another request's matcher is never dropped, and a
        request that does not own the slot keeps nothing from being dropped."""
        req = requests[i]
        is_draft, is_context = bool(req.is_draft), bool(req.is_context_init_state)
        raw_id = _field(req, "request_id")
        rid = as_int(raw_id)
        requests[i] = GuidedRequest.stand_in(rid, is_context, is_draft)
        failed.append((-1 if rid is None else rid, f"{type(error).__name__}: {error}"))
        slot, params = as_int(req.seq_slot), req.guided_decoding_params
        if slot is None or not 0 <= slot < self.max_num_sequences or \
                not isinstance(params, GuidedDecodingParams):
            return
        owner = self.slot_owners[slot]
        if any(_keeps_slot(r, slot, owner) for k, r in enumerate(requests) if k != i):
            return
        held = self.slot_guides[slot]
        creates = not is_draft and (req.is_generation_only_first_iteration is True
                                    or (is_context and req.is_last_context_chunk is True))
        owns = _owner_id(raw_id, owner) and \
            (held is params or (held is not None and held == params))
        if creates or owns:
            dropped.append(slot)
            if creates:
                updates.append((i, slot, params, rid))


def _keeps_slot(request: object, slot: int, owner: int | None) -> bool:
    """Whether ``request``, another of the batch, keeps ``slot``'s matcher from being dropped
    for a refused request: a guided request on the slot that creates its matcher (a context
    request's last chunk, a disaggregated first generation step) or carries the owner's
    ``request_id``. A refused one (an unguided stand-in by now) or another request's does
    not."""
    if as_int(_field(request, "seq_slot")) != slot or \
            _field(request, "guided_decoding_params") is None:
        return False
    if _field(request, "is_draft") is not True and (
            _field(request, "is_generation_only_first_iteration") is True
            or (_field(request, "is_context_init_state") is True
                and _field(request, "is_last_context_chunk") is True)):
        return True
    return _owner_id(_field(request, "request_id"), owner)


def _owner_id(request_id: object, owner: int | None) -> bool:
    """Whether ``request_id`` (as a request carries it) is the slot owner's id ``owner``: an
    int equal to it, or None where the owner's was None; an id that is not an int names no
    owner."""
    rid = as_int(request_id)
    return (rid is not None or request_id is None) and rid == owner


def _first_on_slot(requests: list, slots: list, i: int, slot: int) -> bool:
    """Whether no guided request before ``requests[i]`` (admitted: a guided one has an int
    slot) is on ``slot``; an unguided one takes no slot in the build. ``slots``: theirs."""
    k = -1
    while True:
        try:
            k = slots.index(slot, k + 1, i)
        except ValueError:
            return True
        if _field(requests[k], "guided_decoding_params") is not None:
            return False


def _field(request: object, name: str) -> object:
    """``request.<name>``, or None where reading it fails."""
    try:
        return getattr(request, name)
    except Exception:
        return None


def _guide_text(params: GuidedDecodingParams) -> str:
    guide = params.guide if len(params.guide) <= 40 else params.guide[:37] + "..."
    return f"{params.guide_type.name} {guide!r}"
