"""String formats a backend reads wider than their definition are given as exact patterns
(capgraph/grammar/formats.py): the patterns against Python's own checkers, and the formats
enforced through both backends."""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import re

import pytest

from capgraph import GuidedDecodingParams
from capgraph.grammar.formats import FORMAT_PATTERNS, WIDER_FORMATS, exact_format
from cases import accepts

P = GuidedDecodingParams
PATTERNS = {name: re.compile(pattern) for name, pattern in FORMAT_PATTERNS.items()}


def _date_ok(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return re.fullmatch(r"\d{4}-\d{2}-\d{2}", text) is not None


def test_date_pattern_is_pythons_calendar():
    """Every day, month 00-13 and day 00-32, of years 0000-0410 (every leap rule: 4, 100,
    400) and some later ones: the pattern takes exactly what ``datetime.date`` takes."""
    for year in [*range(0, 411), 1900, 2000, 2023, 2024, 2100, 2400, 9996, 9999]:
        for month in range(14):
            for day in range(33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                assert bool(PATTERNS["date"].match(text)) == _date_ok(text), text


def _time_ok(text: str) -> bool:
    """RFC 3339 full-time, with the second 60 only at 23:59 UTC written in UTC."""
    m = re.fullmatch(r"(\d\d):(\d\d):(\d\d)(\.\d+)?([Zz]|[+-](\d\d):(\d\d))", text)
    if m is None:
        return False
    hour, minute, second = int(m[1]), int(m[2]), int(m[3])
    if hour > 23 or minute > 59 or second > 60:
        return False
    if m[6] is not None and (int(m[6]) > 23 or int(m[7]) > 59):
        return False
    if second == 60:
        return (hour, minute) == (23, 59) and m[5] in ("Z", "z", "+00:00", "-00:00")
    return True


def test_time_pattern():
    """Hours, minutes, seconds, fractions and offsets in and out of range, and the leap
    second at every minute under many offsets."""
    rng = random.Random(0)
    offsets = ["Z", "z", "+00:00", "-00:00", "+01:30", "-08:00", "+23:59", "+24:00", "+05:60",
               "", "+0100"]
    texts = [f"{h:02d}:{m:02d}:{s:02d}{frac}{off}" for h in (0, 9, 23, 24)
             for m in (0, 58, 59, 60) for s in (0, 59, 60, 61) for frac in ("", ".5", ".")
             for off in offsets]
    texts += [f"{h:02d}:{m:02d}:60{rng.choice('+-')}{rng.randrange(24):02d}:"
              f"{rng.randrange(60):02d}" for h in range(24) for m in range(60)]
    for text in texts:
        assert bool(PATTERNS["time"].match(text)) == _time_ok(text), text
    for text in ("2024-02-29T23:59:60Z", "2021-11-30t08:15:00.5+01:30"):
        assert PATTERNS["date-time"].match(text)
    for text in ("2023-02-29T10:00:00Z", "2024-01-01 10:00:00Z", "2024-01-01T23:58:60Z"):
        assert not PATTERNS["date-time"].match(text)


def _address_ok(kind, text: str) -> bool:
    try:
        address = kind(text)
    except ValueError:
        return False
    return not getattr(address, "scope_id", None)


def test_address_patterns_are_pythons_ipaddress():
    """IPv4 (no leading zeros) and IPv6 (every compression, an IPv4 tail) as Python's
    ``ipaddress`` reads them (what jsonschema's format checker uses)."""
    octets = ["0", "00", "01", "1", "9", "10", "010", "99", "100", "199", "200", "249", "250",
              "255", "256", "300", "0255", ""]
    rng = random.Random(1)
    for _ in range(3000):
        text = ".".join(rng.choice(octets) for _ in range(rng.choice([3, 4, 4, 4, 5])))
        assert bool(PATTERNS["ipv4"].match(text)) == _address_ok(ipaddress.IPv4Address, text)
    parts = ["0", "1", "ff", "FFFF", "abcd", "12345", "g", "", "00000", "1.2.3.4", "01.2.3.4",
             "255.255.255.255", "256.1.1.1"]
    for _ in range(20000):
        text = ":".join(rng.choice(parts) for _ in range(rng.randrange(1, 10)))
        if rng.random() < 0.5:
            cut = rng.randrange(len(text) + 1)
            text = text[:cut] + ":" + text[cut:]
        assert bool(PATTERNS["ipv6"].match(text)) == _address_ok(ipaddress.IPv6Address, text), \
            text


def test_hostname_pattern_labels():
    """Labels of 1-63 letters, digits and inner hyphens, either case, dot-separated."""
    good = ["a", "A.b-c.example", "a" * 63 + ".com", "x1.y2", "xn--bcher-kva.example"]
    bad = ["", "-a", "a-", "a..b", "a.", ".a", "a" * 64 + ".com", "a_b", "é.com", "a b"]
    assert all(PATTERNS["hostname"].match(t) for t in good)
    assert not any(PATTERNS["hostname"].match(t) for t in bad)


def test_exact_format_swaps_format_for_pattern_in_place():
    """The pattern takes the format's place (the keys' order kept); a schema with a pattern,
    enum or const, a format the backend reads right, or another backend's, is left alone."""
    node = {"type": "string", "format": "date", "maxLength": 10}
    assert exact_format(node, "xgrammar")
    assert list(node) == ["type", "pattern", "maxLength"]
    assert node["pattern"] == FORMAT_PATTERNS["date"]
    for left in ({"type": "string", "format": "date", "pattern": "^2"},
                 {"format": "date", "enum": ["2020-01-01"]}, {"format": "date", "const": "x"},
                 {"type": "string", "format": "email"}, {"type": "string", "format": 7}):
        before = dict(left)
        assert not exact_format(left, "xgrammar") and left == before
    assert not exact_format({"type": "string", "format": "ipv4"}, "llguidance")
    assert WIDER_FORMATS["llguidance"] < WIDER_FORMATS["xgrammar"]


# What each backend's own regex let through (docs/CONFORMANCE.md), with a valid neighbour.
_CASES = [
    ("date", "2021-02-29", "2024-02-29"), ("date", "2020-04-31", "2020-04-30"),
    ("date", "2100-02-29", "2000-02-29"),
    ("date-time", "1990-02-31T15:59:59Z", "1990-02-28T15:59:59Z"),
    ("time", "23:58:60Z", "23:59:60Z"), ("time", "22:59:60+00:00", "12:30:00.25-08:00"),
    ("ipv4", "01.2.3.4", "1.2.3.4"), ("ipv4", "087.10.0.1", "87.10.0.1"),
    ("ipv6", "::ffff:192.168.0.01", "::ffff:192.168.0.1"),
    ("hostname", "a" * 64 + ".com", "A" * 63 + ".com"),
]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_formats_are_enforced_exactly_on_each_backend(factory_cache, tekken, backend):
    """Through the factory, inside an object: each case that passed on the backend's own
    regex is refused now, and its valid neighbour accepted (where the backend takes that
    form at all: llguidance's own ipv6 has no IPv4 tail)."""
    if backend == "llguidance":
        pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
    factory = factory_cache("tekken", backend)
    for fmt, bad, good in _CASES:
        params = P.json_schema(json.dumps({"type": "object", "required": ["v"], "properties": {
            "v": {"type": "string", "format": fmt}}}))
        assert not accepts(factory, tekken, params, json.dumps({"v": bad})), (fmt, bad)
        if fmt in WIDER_FORMATS[backend]:
            assert accepts(factory, tekken, params, json.dumps({"v": good})), (fmt, good)


def test_a_format_beside_a_pattern_holds_on_llguidance(factory_cache, tekken):
    """Beside a pattern (a second one has no key), llguidance gets the format's exact pattern
    as an allOf branch, which it intersects with the first: 2021-02-29 under ^20 is refused,
    as it is alone (llguidance's own date took it)."""
    pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
    from capgraph.grammar.semantics import llguidance_schema
    schema = {"type": "string", "format": "date", "pattern": "^20", "allOf": [{"minLength": 3}]}
    given = json.loads(llguidance_schema(json.dumps(schema)))
    assert "format" not in given and given["pattern"] == "^20"
    assert given["allOf"][0] == {"minLength": 3} and len(given["allOf"]) == 2
    factory = factory_cache("tekken", "llguidance")
    params = P.json_schema(json.dumps(schema))
    assert accepts(factory, tekken, params, '"2024-02-29"')
    for bad in ('"2021-02-29"', '"1999-01-01"'):
        assert not accepts(factory, tekken, params, bad), bad


def test_the_format_bench_runs(capsys):
    """``tools/bench_formats.py`` prints a row per side for xgrammar's wider formats."""
    from conftest import load_tool
    assert load_tool("bench_formats").main(["--backends", "xgrammar", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for fmt in [*WIDER_FORMATS["xgrammar"], "leap"]:
        for side in (["capgraph", "every offset"] if fmt == "leap" else ["own", "capgraph"]):
            assert re.search(rf"\|\s+xgrammar \|\s+{re.escape(fmt)} \|\s+{side} \|", out), \
                (fmt, side)
