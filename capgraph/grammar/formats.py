"""String formats as exact regexes: what a backend is given in place of a ``format`` it reads
wider than the format's definition.

xgrammar 0.2.9 and llguidance 1.9 write each ``format`` they enforce as a regex of its syntax,
and some of those are wider than the definition a validator checks: a ``date`` takes
``2021-02-29`` and (on xgrammar) ``2020-04-31``; a ``time`` takes the leap second ``60`` at any
minute; xgrammar's ``ipv4`` takes ``01.2.3.4``, its ``ipv6`` such an address as its last 32
bits, its ``hostname`` labels of any length. Where the backend's regex is wider, capgraph gives
the schema a ``pattern`` of :data:`FORMAT_PATTERNS` instead of the ``format``
(:func:`exact_format`): the strings RFC 3339 (dates and times), RFC 2673 / 4291 (addresses)
and RFC 1123 (host names) define, with these choices:

- ``date``: the year ``0000`` is refused (RFC 3339 allows it; Python's ``datetime``, which
  ``jsonschema`` checks with, does not).
- ``date-time`` / ``time``: ``T`` and ``Z`` in either case (RFC 3339 5.6); the second ``60``
  only as ``23:59:60`` written in UTC (``Z``, ``+00:00`` or ``-00:00``), when a leap second
  is inserted: RFC 3339 also allows it at the local time of any other offset (``01:29:60+01:30``),
  which is refused; which days had one is not checked.
- ``hostname``: ASCII letters, digits and ``-`` in labels of 1-63 characters, neither first nor
  last ``-``; not checked (wider than the definition, as both backends' own regexes are): the
  name's total length (253) and the validity of an ``xn--`` label's Punycode.

Each pattern is anchored (``^...$``) and uses only ECMA-262 syntax both backends read.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["FORMAT_PATTERNS", "WIDER_FORMATS", "exact_format", "exact_format_beside_pattern"]

_D = "[0-9]"  # (ECMA-262's \d, written out: one way, whatever the backend's regex reader)

# A year 0001-9999, and those of them that are leap years (divisible by 4, centuries by 400).
_YEAR = f"(?:[1-9]{_D}{{3}}|0[1-9]{_D}{{2}}|00[1-9]{_D}|000[1-9])"
_LEAP_YEAR = (f"(?:{_D}{{2}}(?:0[48]|[2468][048]|[13579][26])"
              "|(?:0[48]|[2468][048]|[13579][26])00)")
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]{_D}|3[01])"
         f"|(?:0[469]|11)-(?:0[1-9]|[12]{_D}|30)|02-(?:0[1-9]|1{_D}|2[0-8]))"
         f"|{_LEAP_YEAR}-02-29)")

_HOUR = f"(?:[01]{_D}|2[0-3])"
_MINUTE = f"[0-5]{_D}"
_FRACTION = f"(?:\\.{_D}+)?"
_OFFSET = f"(?:[Zz]|[+-]{_HOUR}:{_MINUTE})"


# The second 60 only at 23:59 in UTC, written so (``Z`` or a zero offset): a leap second is
# inserted then. (Every other offset has its own local minute for it; the 2,880 alternatives
# that spell those out cost 86 ms of xgrammar's compile and 58 ms of llguidance's, against
# 3 ms, for a time no output needs: ``python tools/bench_formats.py``, docs/BENCHMARKS.md.)
_LEAP_SECOND = f"23:59:60{_FRACTION}(?:[Zz]|[+-]00:00)"
_TIME = f"(?:{_HOUR}:{_MINUTE}:[0-5]{_D}{_FRACTION}{_OFFSET}|{_LEAP_SECOND})"

_OCTET = f"(?:25[0-5]|2[0-4]{_D}|1{_D}{_D}|[1-9]?{_D})"  # 0-255, no leading zero
_IPV4 = f"{_OCTET}(?:\\.{_OCTET}){{3}}"
_H16 = "[0-9A-Fa-f]{1,4}"
_LS32 = f"(?:{_H16}:{_H16}|{_IPV4})"


def _ipv6() -> str:
    """RFC 4291 2.2 as RFC 3986 3.2.2 writes it: eight 16-bit groups, or fewer with one ``::``
    standing for the rest, the last 32 bits as two groups or a dotted IPv4 address."""
    def before(n: int) -> str:  # [ *n( h16 ":" ) h16 ]
        return f"(?:(?:{_H16}:){{0,{n}}}{_H16})?" if n else f"(?:{_H16})?"
    forms = [f"(?:{_H16}:){{6}}{_LS32}", f"::(?:{_H16}:){{5}}{_LS32}",
             f"{before(0)}::(?:{_H16}:){{4}}{_LS32}", f"{before(1)}::(?:{_H16}:){{3}}{_LS32}",
             f"{before(2)}::(?:{_H16}:){{2}}{_LS32}", f"{before(3)}::{_H16}:{_LS32}",
             f"{before(4)}::{_LS32}", f"{before(5)}::{_H16}", f"{before(6)}::"]
    return f"(?:{'|'.join(forms)})"


_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"

#: The exact pattern of each format capgraph may write out (see the module's text).
FORMAT_PATTERNS: Mapping[str, str] = MappingProxyType({
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "ipv4": f"^{_IPV4}$",
    "ipv6": f"^{_ipv6()}$",
    "hostname": f"^{_LABEL}(?:\\.{_LABEL})*$",
})

#: Per backend, the formats whose own regex is wider than the format (measured against the
#: JSON Schema Test Suite's ``optional/format`` files: ``tools/schema_test_suite.py``).
WIDER_FORMATS: Mapping[str, frozenset[str]] = MappingProxyType({
    "xgrammar": frozenset({"date", "time", "date-time", "ipv4", "ipv6", "hostname"}),
    "llguidance": frozenset({"date", "time", "date-time"}),
})


def exact_format(node: dict[str, Any], backend: str) -> bool:
    """Give the schema object ``node`` the exact pattern of its ``format`` in place of the
    ``format`` where ``backend`` reads that format wider (:data:`WIDER_FORMATS`); whether it
    did. Both keywords apply to strings alone, so the schema means the same. Left as written:
    a schema with a ``pattern`` already (a second one has no key to go in: see
    :func:`exact_format_beside_pattern`) and one with ``enum`` / ``const`` (the values are
    the language)."""
    pattern = _exact_pattern(node, backend)
    if pattern is None or "pattern" in node:
        return False
    rebuilt = {("pattern" if key == "format" else key): (pattern if key == "format" else value)
               for key, value in node.items()}
    node.clear()
    node.update(rebuilt)
    return True


def exact_format_beside_pattern(node: dict[str, Any], backend: str) -> str | None:
    """For a schema object ``node`` with a ``pattern`` beside a ``format`` that ``backend``
    reads wider (and no ``enum`` / ``const``), the format's exact pattern, to be given as a
    pattern of its own (an ``allOf`` branch, for a backend that intersects those); else
    None."""
    return _exact_pattern(node, backend) if "pattern" in node else None


def _exact_pattern(node: dict[str, Any], backend: str) -> str | None:
    """The exact pattern of ``node``'s ``format`` where ``backend`` reads it wider and no
    ``enum`` / ``const`` makes the values the language; else None."""
    fmt = node.get("format")
    if not isinstance(fmt, str) or fmt not in WIDER_FORMATS.get(backend, ()) \
            or "enum" in node or "const" in node:
        return None
    return FORMAT_PATTERNS[fmt]
