"""A UTF-8 guard on a backend's masks: no row lets a sampler spell bytes that are not UTF-8.

xgrammar 0.2.9 builds its masks over bytes, and some of its byte automata are looser than
UTF-8: a negated class, ``.`` or a JSON string takes the encoding of a surrogate (``ED A0
80``), and what it builds as one automaton (a REGEX guide, a schema ``pattern``) takes
overlong forms (``E0 80 80``). Spelled one byte token at a time, the output then decodes to
U+FFFD characters outside the guide. So every xgrammar matcher carries a :class:`Utf8Guard`:
the state of the UTF-8 sequence its accepted text ends in (:data:`START` at a character
boundary, else one of seven pending states: how many continuation bytes are due, and the
range the next one must fall in). A row's mask is ANDed with the tokens whose bytes go on
validly from that state (:attr:`Utf8Tables.allowed`), and a token that does not is refused
before the backend sees it. A token without text (a special or stop token) keeps the state at
a character boundary and is refused inside a character.

The state after each accepted token is kept in a ring of :data:`RING` entries, so a rollback of
up to ``RING - 1`` tokens restores it, and several rollbacks in a row reach no further back than
the oldest state the ring still holds (a guard is about 1 KiB). The C++ builds (``csrc/builder.cc``)
read and write the same memory (:mod:`capgraph.build.library`): a guard lives in a C++
allocation once its matcher is handed to them, else in a ``bytearray`` of the same layout.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import MatcherError

__all__ = ["GUARD_BYTES", "INVALID", "NUM_STATES", "RING", "START", "Utf8Guard",
           "Utf8Tables", "utf8_tables"]

#: the state at a character boundary
START = 0
#: the states (START and seven pending ones); a transition to INVALID refuses the token
NUM_STATES = 8
INVALID = NUM_STATES
#: states kept per guard (the deepest rollback is RING - 1 tokens; a decoder's drafts are at
#: most RING - 2, GuidedDecoder checks)
RING = 1016
#: a guard's bytes: an int64 count of tokens accepted, an int64 floor (the lowest count whose
#: state the ring still holds), then the ring of states
GUARD_BYTES = 16 + RING

# pending state -> (continuation bytes due, lowest and highest next byte)
_PENDING = {1: (1, 0x80, 0xBF), 2: (2, 0x80, 0xBF), 3: (3, 0x80, 0xBF),
            4: (2, 0xA0, 0xBF),  # after E0: no overlong form
            5: (2, 0x80, 0x9F),  # after ED: no surrogate
            6: (3, 0x90, 0xBF),  # after F0: no overlong form
            7: (3, 0x80, 0x8F)}  # after F4: nothing past U+10FFFF
# the state after a continuation byte, by the continuation bytes then still due
_DUE = {0: START, 1: 1, 2: 2}


def _lead_states() -> bytes:
    """Per byte, the state after it at a character boundary (INVALID: a continuation byte,
    C0, C1, F5-FF)."""
    table = bytearray([INVALID]) * 256
    table[0x00:0x80] = bytes([START]) * 0x80
    table[0xC2:0xE0] = bytes([1]) * (0xE0 - 0xC2)
    table[0xE1:0xF0] = bytes([2]) * (0xF0 - 0xE1)
    table[0xF1:0xF4] = bytes([3]) * 3
    table[0xE0], table[0xED], table[0xF0], table[0xF4] = 4, 5, 6, 7  # (the pending states'
    return bytes(table)  # table above names what each one allows next)


_LEAD = _lead_states()


def _run(state: int, data: bytes) -> int:
    for byte in data:
        if state == START:
            state = _LEAD[byte]
        else:
            due, low, high = _PENDING[state]
            state = _DUE[due - 1] if low <= byte <= high else INVALID
        if state == INVALID:
            return INVALID
    return state


class Utf8Tables:
    """Per token and state, the state after the token's bytes (``trans[state, token]``,
    :data:`INVALID` where they are not UTF-8 from there), and per state the bitmask of the
    tokens that go on validly (``allowed[state]``, int32 words as the masks'; the row for
    INVALID allows nothing)."""

    def __init__(self, trans: np.ndarray, allowed: np.ndarray) -> None:
        self.trans = trans
        self.allowed = allowed
        self._rows = [row for row in allowed]  # (views, read per fill)
        self._trans_rows = [bytes(row) for row in trans]  # (indexed per accepted token)

    def next_state(self, state: int, token: int) -> int:
        """The state after ``token`` from ``state`` (INVALID for an id outside the table)."""
        row = self._trans_rows[state]
        return row[token] if 0 <= token < len(row) else INVALID

    def mask_rows(self, rows: np.ndarray, indices: Sequence[int],
                  guards: Sequence["Utf8Guard | None"]) -> None:
        """:meth:`mask_row` for ``rows[indices[k]]`` with ``guards[k]``'s state (None: that
        row is left)."""
        allowed, bitwise_and = self._rows, np.bitwise_and
        for index, guard in zip(indices, guards):
            if guard is not None:
                row = rows[index]
                bitwise_and(row, allowed[guard.state()], out=row)

    def mask_row(self, row: np.ndarray, state: int) -> None:
        """AND the int32 mask ``row`` with the tokens allowed from ``state``, in place (one
        NumPy call: at a character boundary, ANDing only the words that refuse some token
        costs as much from Python)."""
        np.bitwise_and(row, self._rows[state], out=row)


def utf8_tables(vocab: Sequence[bytes], vocab_size_padded: int) -> Utf8Tables:
    """The tables for a vocabulary whose token ``i`` spells ``vocab[i]`` (empty: a token
    without text, a special or stop token); ids from ``len(vocab)`` up to
    ``vocab_size_padded`` have no text either."""
    words = (vocab_size_padded + 31) // 32
    trans = np.empty((NUM_STATES, vocab_size_padded), dtype=np.uint8)
    trans[START, :] = START  # (a token without text, and every ASCII token)
    trans[1:, :] = INVALID  # (inside a character: a token without text, or an ASCII one)
    for token, data in enumerate(vocab[:vocab_size_padded]):
        if not data or data.isascii():
            continue
        trans[START, token] = _run(START, data)
        if 0x80 <= data[0] <= 0xBF:  # only a pending state takes a continuation byte first
            for state in range(1, NUM_STATES):
                trans[state, token] = _run(state, data)
    ok = np.zeros((NUM_STATES + 1, words * 32), dtype=bool)
    ok[:NUM_STATES, :vocab_size_padded] = trans != INVALID
    allowed = np.packbits(ok.reshape(NUM_STATES + 1, words, 32), axis=-1, bitorder="little")
    return Utf8Tables(trans, np.ascontiguousarray(allowed).view(np.int32).reshape(
        NUM_STATES + 1, words))


class Utf8Guard:
    """One matcher's UTF-8 state (see the module docstring), over a buffer of
    :data:`GUARD_BYTES` bytes laid out as the C++ builds read them (an int64 count and floor,
    then the ring): its own ``bytearray``, or a C++ allocation once :meth:`rebind` moves it there."""

    __slots__ = ("tables", "native", "_head", "_ring", "_buffer", "_trans_rows", "__weakref__")

    def __init__(self, tables: Utf8Tables) -> None:
        self.tables = tables
        self._trans_rows = tables._trans_rows
        #: the state lives in a C++ allocation the C++ builds look up (:meth:`rebind`)
        self.native = False
        self._bind(bytearray(GUARD_BYTES))

    def _bind(self, buffer: Any) -> None:
        self._buffer = buffer  # (kept: the views below do not own it)
        view = memoryview(buffer).cast("B")
        self._head = view[:16].cast("q")  # [count, floor]
        self._ring = view[16:]

    def rebind(self, buffer: Any) -> None:
        """Move the guard's state into ``buffer`` (a C++ allocation of GUARD_BYTES bytes, any
        object with the buffer protocol) and use that from now on."""
        memoryview(buffer).cast("B")[:] = memoryview(self._buffer).cast("B")
        self._bind(buffer)

    @property
    def count(self) -> int:
        """Tokens accepted so far (less those rolled back)."""
        return self._head[0]

    @count.setter
    def count(self, value: int) -> None:
        self._head[0] = value

    def state(self) -> int:
        """The state after the tokens accepted so far."""
        count = self._head[0]
        return START if count == 0 else self._ring[(count - 1) % RING]

    def next_state(self, token: int) -> int:
        """The state after ``token`` (:data:`INVALID`: its bytes are not UTF-8 from here, or
        an id outside the tables)."""
        count = self._head[0]  # (state() and Utf8Tables.next_state inline: once a token)
        row = self._trans_rows[START if count == 0 else self._ring[(count - 1) % RING]]
        return row[token] if 0 <= token < len(row) else INVALID

    def push(self, state: int) -> None:
        """Record one accepted token that left the text in ``state``."""
        head = self._head
        count = head[0] + 1
        self._ring[(count - 1) % RING] = state
        head[0] = count
        if count - (RING - 1) > head[1]:  # (the state of count - RING was overwritten)
            head[1] = count - (RING - 1)

    def pop(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens.

        Raises:
            MatcherError: back past the oldest state the ring holds (more than ``RING - 1``
                tokens before the latest push, in one rollback or several), or more tokens
                than were accepted: the state before them is not kept.
        """
        count, floor = self._head
        if count - num_tokens < floor:
            raise MatcherError(f"a rollback of {num_tokens} tokens goes past the UTF-8 guard's "
                               f"history ({count - floor} tokens)")
        self._head[0] = count - num_tokens

    def mask_row(self, row: np.ndarray) -> None:
        """AND the int32 mask ``row`` with the tokens allowed after the text so far."""
        self.tables.mask_row(row, self.state())
