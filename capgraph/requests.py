"""Per-step request snapshots and their row layout in the bitmask.

A :class:`GuidedRequest` copies, at ``add_batch`` time, the few fields of an engine's request
that guided decoding reads, so host work that runs later (a callback replayed by a CUDA graph)
sees this step's values even after the engine has moved on.

Row layout (:class:`GuidedRequests`): rows follow request order; a context request takes 1 row,
a generation request ``1 + draft_len`` rows (the golden token and each draft position), and
in a draft step every request takes 1 row. Unguided requests take their rows but get no mask.

Draft trees: a generation request whose ``draft_parents`` is set carries a tree of drafts
instead of a chain. Node ``j`` is ``draft_tokens[j]``, its parent ``draft_parents[j]`` (an
earlier node, or -1 for a child of the root, the position after ``new_token``); row 0 is the
root's mask and row ``1 + j`` the mask after the path from the root to node ``j``. A chain
is the tree ``draft_parents = [-1, 0, 1, ...]``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .errors import LayoutError, RequestError
from .params import GuidedDecodingParams

__all__ = ["GuidedRequest", "GuidedRequests", "NATIVE_RECORD_FIELDS", "REQUEST_FIELDS",
           "TREE_FIELDS", "as_int", "checked_request", "checked_parents"]


@dataclass(slots=True)
class GuidedRequest:
    """What guided decoding needs of one request in one step (field names follow
    TensorRT-LLM's, so an engine written against it ports easily).

    Args:
        guided_decoding_params: the request's guide; ``None`` for an unguided request.
        request_id: the engine's id, reported back with failures.
        seq_slot: the slot whose matcher this request uses (a draft request uses its target's).
        prev_seq_slot: the request's batch index in the previous step (``None`` if new); the
            capturable decoder reads new tokens from it.
        is_context_init_state: the request is in its context (prefill) phase.
        is_last_context_chunk: this step runs the last chunk of the prompt.
        is_generation_in_progress_state: the request is generating.
        is_generation_only_first_iteration: first step of a request whose prefill ran
            elsewhere (disaggregated serving): its matcher is created by
            ``init_disagg_gen_requests``.
        new_token: the last accepted token, fed to the matcher before filling row 0.
        is_draft: this is a draft-model step.
        draft_tokens: proposed tokens to verify this step (generation requests).
        num_accepted_draft_tokens: how many of the previous step's drafts the target accepted.
        draft_parents: ``None`` for a chain of drafts; for a tree, the parent of each draft
            node (``draft_parents[j] < j``, -1 for a child of the root), one per draft token.
        accepted_draft_node: after a step whose drafts were a tree, the deepest node the
            target accepted (-1: none); the path from the root to it is kept by
            ``rollback_rejected_tokens``. Not read after a chain.
    """

    guided_decoding_params: GuidedDecodingParams | None = None
    request_id: int | None = None
    seq_slot: int | None = None
    prev_seq_slot: int | None = None
    is_context_init_state: bool = False
    is_last_context_chunk: bool = False
    is_generation_in_progress_state: bool = False
    is_generation_only_first_iteration: bool = False
    new_token: int | None = None
    is_draft: bool = False
    draft_tokens: list[int] | None = None
    num_accepted_draft_tokens: int | None = None
    draft_parents: list[int] | None = None
    accepted_draft_node: int | None = None

    def require_matcher_init(self) -> bool:
        """A new matcher is created at the last context chunk (never for draft requests)."""
        if self.guided_decoding_params is None or self.is_draft:
            return False
        return self.is_context_init_state and self.is_last_context_chunk

    def require_matcher_advance(self) -> bool:
        """The matcher consumes ``new_token`` this step."""
        if self.guided_decoding_params is None:
            return False
        if self.is_draft:
            return ((self.is_context_init_state and self.is_last_context_chunk)
                    or self.is_generation_in_progress_state)
        return self.is_generation_in_progress_state

    def num_rows(self, draft_len: int) -> int:
        """Bitmask rows this request takes in a step whose runtime draft length is ``draft_len``."""
        if self.is_draft or self.is_context_init_state:
            return 1
        return 1 + draft_len

    @classmethod
    def snapshot(cls, request: "GuidedRequest") -> "GuidedRequest":
        """A copy of ``request``'s fields with its own ``draft_tokens`` list, so that later
        changes by the caller do not reach it (any object with these attribute names works).

        About 9x cheaper than ``copy.copy`` (0.2 vs 1.9 us), which the capturable decoder would
        otherwise pay per request per step. Values are not checked here (see
        :func:`checked_request`).
        """
        drafts = request.draft_tokens
        if type(drafts) is list:
            drafts = list(drafts)
        # (any other draft_tokens value is left to checked_request, which copies a tuple,
        # tensor or array into a new list of ints and refuses the rest; the same for a tree's
        # parents. An object without the tree fields carries chains.)
        parents = getattr(request, "draft_parents", None)
        if type(parents) is list:
            parents = list(parents)
        return cls(request.guided_decoding_params, request.request_id, request.seq_slot,
                   request.prev_seq_slot, request.is_context_init_state,
                   request.is_last_context_chunk, request.is_generation_in_progress_state,
                   request.is_generation_only_first_iteration, request.new_token,
                   request.is_draft, drafts, request.num_accepted_draft_tokens, parents,
                   getattr(request, "accepted_draft_node", None))

    @classmethod
    def placeholder(cls, request_id: int, num_draft_tokens: int = 0) -> "GuidedRequest":
        """An unguided generation request with no slot: it takes ``1 + draft length`` rows
        and is never masked (padding of a graph batch; a capture needs only the shapes)."""
        return cls(None, request_id, None, None, False, False, True, False, 0, False,
                   [0] * num_draft_tokens if num_draft_tokens else None, 0)

    @classmethod
    def stand_in(cls, request_id: int | None, is_context: bool, is_draft: bool
                 ) -> "GuidedRequest":
        """An unguided request with the rows of a failed one (a context or draft request: one
        row, else ``1 + draft length``): it takes them and masks nothing."""
        return cls(None, request_id, None, None, is_context, False, not is_context, False,
                   None, is_draft)

    @classmethod
    def context(cls, request_id: int, seq_slot: int, params: GuidedDecodingParams | None,
                *, last_chunk: bool = True, new_token: int | None = None) -> "GuidedRequest":
        """A request in its prefill step (convenience for engines and tests)."""
        return cls(params, request_id, seq_slot, None, True, last_chunk, False, False,
                   new_token)

    @classmethod
    def generation(cls, request_id: int, seq_slot: int, params: GuidedDecodingParams | None,
                   new_token: int, *, draft_tokens: Sequence[int] | None = None,
                   num_accepted_draft_tokens: int = 0, prev_seq_slot: int | None = None,
                   draft_parents: Sequence[int] | None = None,
                   accepted_draft_node: int | None = None) -> "GuidedRequest":
        """A request in a generation step (convenience for engines and tests); lists of
        drafts and parents are copied, any other value is left for ``add_batch`` to convert
        or refuse. ``draft_parents`` makes the drafts a tree (see the module docstring)."""
        drafts: object = [] if draft_tokens is None else draft_tokens
        if type(drafts) is list:
            drafts = list(drafts)
        parents: object = draft_parents
        if type(parents) is list:
            parents = list(parents)
        return cls(params, request_id, seq_slot, prev_seq_slot, False, False, True, False,
                   new_token, False, drafts, num_accepted_draft_tokens,  # type: ignore[arg-type]
                   parents, accepted_draft_node)  # type: ignore[arg-type]


#: The fields a request object may leave out: it then carries chains of drafts only.
TREE_FIELDS: tuple[str, ...] = ("draft_parents", "accepted_draft_node")

#: The fields every request object must have (GuidedRequest's, in constructor order, less
#: :data:`TREE_FIELDS`).
REQUEST_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GuidedRequest)
                                        if f.name not in TREE_FIELDS)

#: The fields of a request that the native build's CPython entry reads, in the order of its
#: ``RecordField`` positions (``csrc/host_build.h``): ``NativeBuilder.bind_fast`` hands these
#: names to the entry, which looks each one up on :class:`GuidedRequest` once (its
#: ``__slots__`` member) and reads other request objects by name; the C++ holds no names.
NATIVE_RECORD_FIELDS: tuple[str, ...] = (
    "guided_decoding_params", "seq_slot", "new_token", "is_generation_in_progress_state",
    "is_draft", "is_context_init_state", "draft_tokens", "request_id",
    "is_generation_only_first_iteration", "draft_parents", "prev_seq_slot",
    "is_last_context_chunk", "num_accepted_draft_tokens")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_int(value: Any) -> int | None:
    """``value`` as an exact int when it is an integer (int, NumPy integer, 0-d integer
    tensor); None for anything else, bool and float included (never truncated)."""
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_, float, str, bytes)) or (
            isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool)):
        return None
    try:
        return operator.index(value)
    except Exception:  # (TypeError, or whatever a foreign __index__ raises)
        return None


def _flag(value: Any) -> bool | None:
    """``value`` as a bool when it is one (bool or NumPy bool); None otherwise."""
    if type(value) is bool:
        return value
    return bool(value) if isinstance(value, np.bool_) else None


def checked_request(request: Any, index: int, *, num_slots: int, vocab_size: int,
                    max_num_draft_tokens: int, tokens_elsewhere: bool = False
                    ) -> GuidedRequest:
    """``request`` with every field checked, as a GuidedRequest of exact types.

    Integers may be ints, NumPy integers or 0-d integer tensors (converted); a bool or a float
    where an integer belongs is refused, never truncated. ``draft_tokens`` may be a list,
    tuple, 1-D integer tensor or array of token ids (copied into a new list); a string is
    refused, never iterated. Token ids are checked against ``[0, vocab_size)`` where this step
    reads them; ``tokens_elsewhere``: a generation request with a ``prev_seq_slot`` takes its new
    token and drafts from a token tensor instead (the capturable decoder's ``new_tokens``), so
    those two fields are not read. ``draft_parents`` must describe a tree over the draft tokens
    (:func:`checked_parents`); an object without it carries chains. An unguided request is
    returned as it is (only its rows count).

    Raises:
        LayoutError: ``request`` lacks a GuidedRequest field, or its ``is_draft`` /
            ``is_context_init_state`` is not a bool: its rows, and every later request's,
            are unknown.
        RequestError: any other field is bad (the message names the field and the value).
    """
    try:
        values = [getattr(request, name) for name in REQUEST_FIELDS]
        parents_raw = getattr(request, "draft_parents", None)
        accepted_node = getattr(request, "accepted_draft_node", None)
    except Exception as e:
        raise LayoutError(f"requests[{index}] is not a GuidedRequest ({type(e).__name__}: "
                          f"{e})") from None
    (params, request_id, slot, prev_slot, context, last_chunk, generating, first_iteration,
     token, draft, drafts, accepted) = values
    is_draft, is_context = _flag(draft), _flag(context)
    if is_draft is None or is_context is None:
        name, raw = ("is_draft", draft) if is_draft is None else ("is_context_init_state", context)
        raise LayoutError(f"requests[{index}].{name} {_show(raw)} is not a bool (it decides "
                          "the request's rows)")
    if params is None:
        return request
    rid = as_int(request_id)

    def bad(detail: str) -> RequestError:
        return RequestError(detail, request_id=rid, seq_slot=as_int(slot))

    if not isinstance(params, GuidedDecodingParams):
        raise bad(f"guided_decoding_params {_show(params)} is not a GuidedDecodingParams "
                  "(or None for an unguided request)")
    if rid is None and request_id is not None:
        raise bad(f"request_id {_show(request_id)} is not an integer")

    def flag(name: str, raw: Any) -> bool:
        value = _flag(raw)
        if value is None:
            raise bad(f"{name} {_show(raw)} is not a bool")
        return value

    last_chunk = flag("is_last_context_chunk", last_chunk)
    generating = flag("is_generation_in_progress_state", generating)
    first_iteration = flag("is_generation_only_first_iteration", first_iteration)
    seq_slot = as_int(slot)
    if seq_slot is None or not 0 <= seq_slot < num_slots:
        raise bad(f"seq_slot {_show(slot)} is not a slot index in [0, max_num_sequences="
                  f"{num_slots})")
    checked = GuidedRequest(params, rid, seq_slot, prev_slot, is_context, last_chunk, generating,
                            first_iteration, None, is_draft, None, None)
    if not (tokens_elsewhere and prev_slot is not None and not is_context):
        checked.new_token = _checked_new_token(token, checked.require_matcher_advance(),
                                               vocab_size, bad)
        checked.draft_tokens = _checked_drafts(drafts, max_num_draft_tokens, vocab_size, bad)
        if checked.draft_tokens and is_context and not is_draft:
            raise bad(f"draft_tokens {_show(drafts)} on a context request (it takes one row)")
        checked.draft_parents = checked_parents(  # (a context request: refused below)
            parents_raw, None if is_context and not is_draft else
            len(checked.draft_tokens or ()), max_num_draft_tokens, bad)
    else:
        checked.new_token, checked.draft_tokens = token, drafts  # (replaced from the tensor)
        checked.draft_parents = checked_parents(parents_raw, None, max_num_draft_tokens, bad)
    if checked.draft_parents and is_context and not is_draft:
        raise bad(f"draft_parents {_show(parents_raw)} on a context request (it takes one row)")
    checked.accepted_draft_node = accepted_node  # (read and checked by the rollback)
    if accepted is not None:
        checked.num_accepted_draft_tokens = as_int(accepted)
        if checked.num_accepted_draft_tokens is None or checked.num_accepted_draft_tokens < 0:
            raise bad(f"num_accepted_draft_tokens={_show(accepted)} is not an integer >= 0")
    return checked


def _checked_new_token(token: Any, read: bool, vocab_size: int, bad: Any) -> int | None:
    value = as_int(token)
    if value is None and (token is not None or read):
        raise bad(f"new_token {_show(token)} is not an integer token id")
    if read and not 0 <= value < vocab_size:  # type: ignore[operator]
        raise bad(f"new_token {value} is outside the vocabulary [0, {vocab_size})")
    return value


def _int_sequence(values: Any, name: str, what: str, bad: Any, most: int,
                  too_many: Any) -> Any:
    """``values`` as something to iterate for ints (a tensor as a list); refuses a string,
    a mapping, a non-sequence, a tensor or array that is not 1-D or not of integers, and one
    of more than ``most`` items (``too_many(count)``: the message), before it reads an item
    (a long one, even a broadcast tensor of no memory, costs nothing to refuse)."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or (
            isinstance(values, (torch.Tensor, np.ndarray)) and values.ndim != 1):
        raise bad(f"{name} {_show(values)} is not a sequence of {what} (list, tuple or 1-D "
                  "integer tensor)")
    try:
        count = len(values)
    except Exception as e:  # noqa: BLE001 - a __len__ that raises is the request's fault
        raise bad(f"{name}: len() raised {type(e).__name__}: {e}") from None
    if count > most:
        raise bad(too_many(count))
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or \
                values.dtype == torch.bool:
            raise bad(f"{name} is a {values.dtype} tensor; {what} are integers")
        return values.tolist()
    return values


def checked_parents(parents: Any, num_tokens: int | None, max_drafts: int, bad: Any
                    ) -> list[int] | None:
    """A draft tree's ``draft_parents`` as a new list of ints, or None for a chain.

    Each node's parent is an earlier node or -1 (the root): ``-1 <= parents[j] < j``, so the
    nodes are in an order where a parent comes first and every list of such numbers is a tree.
    ``num_tokens``: the number of draft tokens the request carries (None: its tokens come
    from a tensor of ``max_drafts`` positions). ``bad(detail)`` makes the error raised.
    """
    if parents is None:
        return None
    values = _int_sequence(parents, "draft_parents", "node indices", bad, max_drafts,
                           lambda n: f"a draft tree of {n} nodes exceeds max_num_draft_tokens="
                                     f"{max_drafts}")
    out = []
    for j, p in enumerate(values):
        value = as_int(p)
        if value is None:
            raise bad(f"draft_parents[{j}] {_show(p)} is not an integer node index")
        if not -1 <= value < j:
            raise bad(f"draft_parents[{j}]={value} is not an earlier node or -1 (the root): "
                      "a tree's nodes come after their parents")
        out.append(value)
    if num_tokens is not None and len(out) != num_tokens:
        raise bad(f"draft_parents has {len(out)} entries for {num_tokens} draft tokens (one "
                  "parent per draft node)")
    return out


def _checked_drafts(drafts: Any, max_drafts: int, vocab_size: int, bad: Any) -> list[int] | None:
    if drafts is None:
        return None
    drafts = _int_sequence(drafts, "draft_tokens", "token ids", bad, max_drafts,
                           lambda n: f"{n} draft tokens exceed max_num_draft_tokens={max_drafts}")
    out = []
    for i, t in enumerate(drafts):
        value = as_int(t)
        if value is None:
            raise bad(f"draft token {_show(t)} (draft_tokens[{i}]) is not an integer token id")
        if not 0 <= value < vocab_size:
            raise bad(f"draft token {value} (draft_tokens[{i}]) is outside the vocabulary "
                      f"[0, {vocab_size})")
        out.append(value)
    return out


@dataclass(slots=True)
class GuidedRequests:
    """The requests of one step and their bitmask rows.

    Args:
        requests: snapshots in batch order.
        max_num_draft_tokens: the runtime draft length of this step (rows per generation
            request minus one); drafts beyond it are not guided.
        dropped_slots: slots whose matcher this step drops before it builds (their request
            failed the decoder's checks at ``add_batch``; see ``GuidedDecoder.add_batch``).
        disagg_pending: the batch holds a disaggregated first generation step whose matcher
            ``init_disagg_gen_requests`` has not created yet (the build creates it then).
    """

    requests: list[GuidedRequest]
    max_num_draft_tokens: int = 0
    dropped_slots: Sequence[int] = ()
    disagg_pending: bool = False
    offsets: list[int] = field(init=False, repr=False)
    num_bitmask_tokens: int = field(init=False)
    #: the batch is a draft model's step: some request of it is a draft (padding, such as a
    #: :meth:`GuidedRequest.placeholder`, may sit anywhere in it)
    is_draft_step: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.max_num_draft_tokens < 0:
            raise LayoutError(f"runtime draft length must be >= 0, got {self.max_num_draft_tokens}")
        offsets: list[int] = []
        append, row, generation_rows = offsets.append, 0, 1 + self.max_num_draft_tokens
        drafts = False
        for req in self.requests:  # GuidedRequest.num_rows, inline: this runs every step
            append(row)
            if req.is_draft:
                drafts, row = True, row + 1
            else:
                row += 1 if req.is_context_init_state else generation_rows
        self.offsets = offsets
        self.num_bitmask_tokens = row
        self.is_draft_step = drafts

    def __len__(self) -> int:
        return len(self.requests)

    def valid_requests(self) -> Iterator[GuidedRequest]:
        """The guided requests, in order."""
        return (r for r in self.requests if r.guided_decoding_params is not None)

    def valid_requests_with_offsets(self) -> Iterator[tuple[GuidedRequest, int]]:
        """The guided requests with their first row (offsets count unguided rows too)."""
        for req, offset in zip(self.requests, self.offsets):
            if req.guided_decoding_params is not None:
                yield req, offset
