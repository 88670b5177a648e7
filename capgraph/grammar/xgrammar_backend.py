"""xgrammar backend: all five guide types, several stop tokens, multi-threaded batch fill."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import re
import threading
import time
import weakref
from typing import Any, Callable, Collection, Mapping, NoReturn, Sequence

import torch
import xgrammar as xgr

from ..errors import GrammarCompileError, MatcherError, NativeBuildError, UnsupportedGuideError
from ..params import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from .base import CompiledGuide, GrammarMatcher, GrammarMatcherFactory, whole_utf8_prefix
from .compile_pool import run_lowered
from .converter_log import captured, exclusive
from .disk_cache import serialized_bytes_estimate, source_digest
from .forced import (MAX_FORCED_TEXT_BYTES, MAX_FORCED_WALK_MS, forced_text_bound,
                     grammar_hides_bytes)
from .process_pool import CompileHere, ProcessCompilePool
from .utf8 import GUARD_BYTES, INVALID, Utf8Guard, Utf8Tables, utf8_tables
from .schema_policy import (describe, plain_tag_schema, unenforced_in_tag, unenforced_in_text,
                            xml_style)
from .lark_text import LarkTextError, lark_json_values, lark_regexes, replace_json_values
from .semantics import (JSON_CONTAINER_SCHEMA, changed_tag, ebnf_escape, ebnf_unescape,
                        ecma_ebnf, ecma_regex, ecma_tag, tag_nodes, xgrammar_schema,
                        xgrammar_wider)

__all__ = ["XGrammarMatcher", "XGrammarMatcherFactory", "build_tokenizer_info",
           "json_whitespace_options"]

BACKEND = "xgrammar"
# A Lark rule head ("start:" / "?value:") where GBNF would have "root ::=".
_LARK_RULE = re.compile(r"^\s*[?!]?[a-z_][a-z0-9_]*\s*:(?!:=)", re.MULTILINE)


#: First byte of the spelling a special token gets where a structural tag places it by a
#: ``token`` element. 0xFF never occurs in UTF-8, so JSON, regex, EBNF and const-string text
#: cannot spell it, while the ``token`` element matches it by id.
SPECIAL_SPELLING_PREFIX = b"\xff"


def build_tokenizer_info(config: GuidedDecodingConfig, placeable: Collection[int] = ()
                         ) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with metadata detected from the HF tokenizer.

    ``vocab_size`` is the padded width, so ids at or above the tokenizer's vocabulary are
    special to xgrammar and never allowed on a guided row.

    xgrammar 0.2.9 counts a token as special only when its text is empty, so on its own it
    reads ``[INST]``, ``<s>`` or ``<|im_start|>`` as the plain text they spell and allows them
    inside a JSON string, a regex's ``.*`` or an EBNF character class. Here every special token
    of the tokenizer (:func:`capgraph.tokenizers.special_token_ids`) gets an empty text, which
    makes it special to xgrammar: never allowed by any grammar. Stop tokens get an empty text
    too (otherwise ``</s>`` could complete a grammar ending in ``">"``) and stay stop tokens,
    allowed exactly where the grammar may end.

    ``placeable``: special ids a structural tag places with ``token`` elements. xgrammar's
    matcher refuses every special id, so these are spelled :data:`SPECIAL_SPELLING_PREFIX` +
    their text instead, which only a ``token`` element (by id) and the ``any_text`` content of
    a ``tag`` (xgrammar matches it as any bytes up to the end string) can match: a placed
    token may also appear there, no other special token can. A vocabulary given as
    ``encoded_vocab`` carries no special-token metadata and is taken as it is.
    """
    stop_ids = list(config.stop_token_ids or [])
    if config.tokenizer is None:
        encoded = list(config.encoded_vocab or [])
        for i in stop_ids:  # (a stop token is never text: see above)
            if 0 <= i < len(encoded):
                encoded[i] = ""
        return xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.RAW,
                                 vocab_size=config.vocab_size_padded, stop_token_ids=stop_ids)
    from ..tokenizers import special_token_ids

    detected = xgr.TokenizerInfo.from_huggingface(
        config.tokenizer, vocab_size=config.vocab_size_padded, stop_token_ids=stop_ids)
    specials = special_token_ids(config.tokenizer)
    # decoded_vocab is the text of every id (byte-level / byte-fallback spelling undone), so
    # the rebuilt vocabulary is RAW; add_prefix_space is carried over as detected.
    vocab = detected.decoded_vocab
    # a stop token that is ordinary text too ("a", '"'): with its text xgrammar would allow
    # it as the text that completes a guide ("b" + stop under "ba"), and the output, which
    # ends before the stop token, would fall short of the guide
    texts = [i for i in stop_ids if i not in specials and 0 <= i < len(vocab) and vocab[i]]
    if not specials and not texts:
        return detected
    for i in specials:
        if i < len(vocab):
            vocab[i] = SPECIAL_SPELLING_PREFIX + vocab[i] if i in placeable else b""
    for i in texts:
        vocab[i] = b""
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW,
                             vocab_size=config.vocab_size_padded, stop_token_ids=stop_ids,
                             add_prefix_space=detected.add_prefix_space)


def json_whitespace_options(config: GuidedDecodingConfig) -> dict[str, Any]:
    """``compile_json_schema`` keyword arguments for ``config.json_whitespace``. xgrammar's
    whitespace is space, newline, carriage return and tab, between tokens only."""
    mode = config.json_whitespace
    if mode == "compact":
        return {"any_whitespace": False, "separators": (",", ":")}
    if mode == "bounded":
        return {"any_whitespace": True, "max_whitespace_cnt": config.json_max_whitespace}
    return {"any_whitespace": True}


# In Lark text: a string literal, a regex literal or a comment (kept as written), else a token
# reference by id "<[151644]>" or by name "<|im_start|>".
_LARK_TOKEN_REF = re.compile(
    r'"(?:[^"\\\n]|\\.)*"|//[^\n]*|/(?:[^/\\\n]|\\.)+/'
    r'|<\[\s*(?P<id>\d+)\s*\]>|<(?P<name>[^<>\s"/]+)>')


def _resolve_tag_tokens(tag: str, ids_by_name: Mapping[str, int]) -> tuple[str, frozenset[int]]:
    """The structural tag ``tag`` with every special token it names by string replaced by its
    id, and the special ids it places (``token`` elements, ``trigger_tokens``, token-dispatch
    patterns, ``<name>`` / ``<[id]>`` in Lark ``grammar`` elements; exclusion lists place
    nothing).

    :func:`build_tokenizer_info` empties the text of special tokens, which hides them from
    xgrammar's lookup by string, so they are resolved here; the JSON schemas the tag embeds are
    data, left as written. Ordinary tokens named by string are left as they are (the compile
    refuses them). Text that is not JSON is returned unchanged,
    placing nothing (xgrammar's error names what is wrong).
    """
    if not ids_by_name:
        return tag, frozenset()
    try:
        doc = json.loads(tag)
    except ValueError:
        return tag, frozenset()
    specials = set(ids_by_name.values())
    placed: set[int] = set()

    def by_id(token: Any, place: bool) -> Any:
        token = ids_by_name.get(token, token) if isinstance(token, str) else token
        if place and isinstance(token, int) and token in specials:
            placed.add(token)
        return token

    def lark_ref(m: re.Match[str]) -> str:
        if m.group("id") is not None:
            token: int | None = int(m.group("id"))
        elif m.group("name") is not None:
            token = ids_by_name.get(m.group(0))  # else an ordinary token: xgrammar's
        else:
            token = None  # a string, a regex or a comment
        if token is None:
            return m.group(0)
        if token in specials:
            placed.add(token)
        return f"<[{token}]>"

    for node, _ in tag_nodes(doc):  # (the JSON schemas a tag embeds are not tag nodes)
        kind = node.get("type")
        if kind == "token" and "token" in node:
            node["token"] = by_id(node["token"], True)
        if isinstance(node.get("trigger_tokens"), list):
            node["trigger_tokens"] = [by_id(t, True) for t in node["trigger_tokens"]]
        if isinstance(node.get("exclude_tokens"), list):
            node["exclude_tokens"] = [by_id(t, False) for t in node["exclude_tokens"]]
        if kind == "token_dispatch" and isinstance(node.get("rules"), list):
            for rule in node["rules"]:
                if isinstance(rule, list) and rule:
                    rule[0] = by_id(rule[0], True)
        if kind == "grammar" and node.get("syntax") == "lark" \
                and isinstance(node.get("grammar"), str):
            node["grammar"] = _LARK_TOKEN_REF.sub(lark_ref, node["grammar"])
    return json.dumps(doc), frozenset(placed)


def _converted(convert: Callable[[], xgr.Grammar]) -> tuple[xgr.Grammar, list[str]]:
    """``convert()`` (a guide's conversion to an ``xgrammar.Grammar``, never its compile) with
    the warnings xgrammar's converters logged while it ran
    (:func:`~capgraph.grammar.converter_log.captured`: conversions run alongside each other,
    one whose warnings could be another's is converted again, alone at last), each once."""
    grammar, warned = captured(convert)
    return grammar, list(dict.fromkeys(warned))


def _ebnf_grammar(guide: str) -> xgr.Grammar:
    """The EBNF guide ``guide`` parsed, each ``Regex(...)`` element whose automaton would
    compute masks token by token given as rules (:func:`_ebnf_regexes_as_rules`), with the
    automata of its ``Regex(...)`` elements built once (:func:`_build_automata`)."""
    parsed = xgr.Grammar.from_ebnf(guide)
    text = _ebnf_regexes_as_rules(str(parsed))
    return _build_automata(parsed if text is None else xgr.Grammar.from_ebnf(text))


def _ebnf_regexes_as_rules(printed: str) -> str | None:
    """The grammar xgrammar ``printed`` with its slow ``Regex(...)`` rules as grammar rules
    (:func:`_regexes_as_rules`), as text its parser reads (:func:`_edited`); None where
    none is slow, or the printed text does not read back (the guide then keeps its
    automata: the same language, slower masks)."""
    text = _regexes_as_rules(printed, json_string=False)
    if text == printed:
        return None
    try:
        return _edited(printed, text)
    except GrammarShapeError:
        return None


def _build_automata(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` (parsed), with the automata of its ``Regex(...)`` elements built once, so
    that what xgrammar's automaton builder logs about them (an anchor or a lookahead it
    ignores) is logged here, inside the conversion's capture: parsing alone builds none, the
    compile builds them again. Where this xgrammar has no separate automaton pass, or the pass
    raises, parsing is all (the compile reports a grammar's errors)."""
    build = _fsm_builder()
    if build is not None:
        try:
            build(grammar)
        except Exception:  # noqa: BLE001 - the compile reports the grammar's errors
            pass
    return grammar


def _fsm_builder() -> Callable[[xgr.Grammar], xgr.Grammar] | None:
    """xgrammar's automaton pass apart from a compile (``testing.GrammarFunctor.fsm_builder``:
    it builds the automata of a grammar's ``Regex(...)`` elements, adds the rule of a repeat it
    does not unroll to the grammar it is given, and returns the grammar built), or None where
    this xgrammar has none."""
    functor = getattr(getattr(xgr, "testing", None), "GrammarFunctor", None)
    return getattr(functor, "fsm_builder", None)


# The rule xgrammar's automaton builder adds for a repeat too large to unroll into a Regex
# element's automaton (an edge of the automaton refers to it, and masks at its states are
# computed token by token).
_REPEAT_RULE = re.compile(r"^root_repeat\w* ::= ", re.MULTILINE)


def _regex_grammar(regex: str) -> xgr.Grammar:
    """The REGEX guide ``regex`` (as :func:`~capgraph.grammar.semantics.ecma_regex` writes it)
    as one xgrammar automaton (:func:`_automaton`), or where that is not the faster reading,
    as the grammar rules ``Grammar.from_regex`` writes."""
    return _automaton(regex) or xgr.Grammar.from_regex(regex)


def _automaton(regex: str, json_string: bool = False) -> xgr.Grammar | None:
    """A grammar whose root is one ``Regex(...)`` element of ``regex`` (as
    :func:`~capgraph.grammar.semantics.ecma_regex` writes it; ``json_string``: with
    ``json_string=true``, as a schema pattern's), xgrammar's automaton, with the automaton
    built once (its warnings: inside the caller's capture); None where xgrammar would
    make a repeat of it an edge of the automaton (``[a-z]{2,255}``), where it cannot build it
    (its regex reader refuses what ``Grammar.from_regex`` takes), or where this xgrammar builds
    no automaton apart from a compile. Measured with Tekken (``python
    tools/bench_regex_paths.py``, docs/BENCHMARKS.md): an automaton's masks take 0.001-0.005 ms
    where ``from_regex``'s rules take up to 1 ms (``\\w+(\\s\\w+)*``), but with a repeat edge
    6 ms where the rules take 0.2 ms."""
    build = _fsm_builder()
    if build is None:
        return None
    option = ", json_string=true" if json_string else ""
    grammar = xgr.Grammar.from_ebnf(f'root ::= Regex("{ebnf_escape(regex)}"{option})')
    try:
        built = build(grammar)
    except Exception:  # noqa: BLE001 - a regex only the rules' reader takes
        return None
    return None if _REPEAT_RULE.search(str(built)) else grammar


def _tag_regexes_faster(tag: str) -> str:
    """The structural tag ``tag`` (JSON text, its regexes as
    :func:`~capgraph.grammar.semantics.ecma_tag` writes them) with each regex in the form
    whose masks xgrammar computes faster, the same language: a ``regex`` element that has an
    automaton (:func:`_automaton`) written as a ``grammar`` element holding that one
    ``Regex(...)`` (xgrammar converts a ``regex`` element to ``Grammar.from_regex``'s rules,
    whose masks are up to 200x slower), and an EBNF ``grammar`` element's ``Regex(...)``
    whose automaton would have a repeat edge as rules (:func:`_ebnf_regexes_as_rules`). Run
    inside the conversion's capture."""
    def change(node: dict[str, Any], _: str) -> bool:
        kind = node.get("type")
        if kind == "grammar" and node.get("syntax", "ebnf") != "lark" \
                and isinstance(node.get("grammar"), str):
            try:
                text = _ebnf_regexes_as_rules(str(xgr.Grammar.from_ebnf(node["grammar"])))
            except Exception:  # noqa: BLE001 - not EBNF xgrammar reads: the tag's compile says
                return False
            if text is not None:
                node["grammar"] = text
            return text is not None
        pattern = node.get("pattern")
        if kind != "regex" or not isinstance(pattern, str) \
                or set(node) != {"type", "pattern"} or _automaton(pattern) is None:
            return False
        node.clear()
        node.update(type="grammar", grammar=f'root ::= Regex("{ebnf_escape(pattern)}")')
        return True
    return changed_tag(tag, change)


def _tag_schemas_repaired(tag: str, whitespace: dict[str, Any] | None = None) -> str:
    """The structural tag ``tag`` (JSON text, its schemas prepared:
    :func:`_tag_schemas_prepared`) with each plain ``json_schema`` element
    (:func:`~capgraph.grammar.schema_policy.plain_tag_schema`) written as a ``grammar``
    element holding the grammar a JSON-schema guide of its schema compiles to, repaired
    (:func:`_repaired`). Its whitespace: any up to the element's own ``max_whitespace_cnt``
    where it gives one (xgrammar's reading of it), else ``whitespace``
    (:func:`json_whitespace_options` of the factory's ``json_whitespace``, as its JSON-schema
    guides get; None: any, as xgrammar gives an element). xgrammar converts a
    ``json_schema`` element with the same converter but none of capgraph's repairs: raw
    control characters in a length-limited string, a listed name spelled with an escape as
    an additional one, the slow automata of patterns. Run inside the conversion's capture
    (the converter's warnings are the tag's).

    Raises:
        GrammarShapeError: a repaired grammar's text does not read back as printed.
    """
    def change(node: dict[str, Any], _: str) -> bool:
        if not plain_tag_schema(node):
            return _bound_tag_whitespace(node, whitespace)
        own = node.get("max_whitespace_cnt")
        options = whitespace if own is None and whitespace is not None else \
            {"any_whitespace": True, "max_whitespace_cnt": own}
        printed = str(xgr.Grammar.from_json_schema(
            json.dumps(node["json_schema"]), strict_mode=True, **options))
        node.clear()
        node.update(type="grammar", grammar=_edited(printed, _repaired_text(printed)))
        return True
    return changed_tag(tag, change)


def _bound_tag_whitespace(node: dict[str, Any], whitespace: dict[str, Any] | None) -> bool:
    """A structural tag's JSON-schema element that xgrammar converts itself (not plain: an
    ``excludes``, a boolean schema, other keys), written JSON-style with no
    ``max_whitespace_cnt`` of its own: given the factory's bound on whitespace runs
    (``json_whitespace`` "bounded": its ``json_max_whitespace``; "compact": 1, the least
    xgrammar's element takes), so a model cannot loop on whitespace there either. Whether
    ``node`` changed."""
    if whitespace is None or node.get("type") != "json_schema" \
            or node.get("style", "json") != "json" or node.get("max_whitespace_cnt") is not None:
        return False
    cap = whitespace.get("max_whitespace_cnt")
    if cap is None and whitespace.get("any_whitespace", True):
        return False  # ("any": xgrammar's own reading)
    node["max_whitespace_cnt"] = cap or 1
    return True


def _refuse(what: str, guide_type: GuideType = GuideType.JSON_SCHEMA) -> None:
    """Refuse a JSON schema (or the schemas a structural tag embeds, or a tag's parts) of which
    xgrammar would not enforce ``what``."""
    raise UnsupportedGuideError(
        f"xgrammar would accept but not enforce {what}; remove them, use the llguidance "
        "backend, set GuidedDecodingConfig(json_unenforced_keywords='fallback') to let "
        "llguidance serve such schemas, or 'ignore' to generate with them unenforced",
        guide_type=guide_type.name, backend=BACKEND)


# A rule as xgrammar prints a grammar, and the string literals (Regex(...) bodies included)
# and character classes of its body, whose text may spell "(=".
_PRINTED_RULE = re.compile(r"^(?P<name>\S+) ::= (?P<body>.*)$", re.MULTILINE)
_PRINTED_TEXT = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')


def _lookahead_rules(grammar: xgr.Grammar) -> list[str]:
    """The rules of the parsed guide ``grammar`` that carry a lookahead assertion
    ``(= ...)``, which xgrammar 0.2.9 does not enforce (measured: with ``a ::= "x" (= "c")``,
    ``root ::= a "d"`` accepts ``xd`` and ``root ::= a`` accepts ``x``)."""
    return [rule.group("name") for rule in _PRINTED_RULE.finditer(str(grammar))
            if "(=" in _PRINTED_TEXT.sub('""', rule.group("body"))]


def _refuse_lookaheads(grammar: xgr.Grammar, guide_type: GuideType, where: str = "") -> None:
    """Refuse a user grammar (an EBNF guide, or ``where``: a tag's grammar element) with a
    lookahead assertion; ``json_unenforced_keywords`` does not apply."""
    rules = _lookahead_rules(grammar)
    if rules:
        raise UnsupportedGuideError(
            f"xgrammar does not enforce the lookahead assertion '(= ...)' of rule "
            f"{', '.join(repr(r) for r in rules[:5])}{where}: the output may go on with text it "
            "forbids; remove the lookahead or use the llguidance backend",
            guide_type=guide_type.name, backend=BACKEND)


def _refuse_ignored_in_tag(warned: Sequence[str], where: str) -> None:
    """Refuse a structural tag with a regex or grammar element (``where``) of which xgrammar
    ignores a construct; ``json_unenforced_keywords`` does not apply to these."""
    raise UnsupportedGuideError(
        f"xgrammar ignores part of {where}, so it would not enforce it: "
        + "; ".join(f"xgrammar reported: {w}" for w in warned)
        + "; rewrite that construct (anchors '^' / '$' only at the very start / end of a "
        "regex, no lookahead, no escape other than the standard ones)",
        guide_type=GuideType.STRUCTURAL_TAG.name, backend=BACKEND)


def _refuse_wider_lark_regexes(grammar: str, where: str) -> None:
    """Refuse the Lark ``grammar`` of a structural tag's ``grammar`` element (``where``) if
    xgrammar would read one of its regex literals wider than Lark does
    (:func:`~capgraph.grammar.semantics.xgrammar_wider`), or if capgraph cannot read it as
    llguidance's Lark lexer does (:mod:`~capgraph.grammar.lark_text`): its ``%json`` schemas
    and regexes are checked as read so, and text read otherwise could hide one."""
    try:
        regexes = lark_regexes(grammar)
    except LarkTextError as e:
        raise UnsupportedGuideError(
            f"capgraph cannot read the Lark grammar of {where} ({e}), so it cannot check its "
            "%json schemas and regexes; write it as llguidance's Lark reads it",
            guide_type=GuideType.STRUCTURAL_TAG.name, backend=BACKEND) from None
    for found in regexes:
        wider = xgrammar_wider(found.pattern, "i" in found.flags)
        if wider:
            raise UnsupportedGuideError(
                f"xgrammar would read the regex /{found.pattern}/{found.flags} at line "
                f"{found.line} of {where} wider than Lark does: {wider}; write the characters "
                "out in a class (or use the llguidance backend with the grammar as an "
                "EBNF_GRAMMAR guide)", guide_type=GuideType.STRUCTURAL_TAG.name, backend=BACKEND)


def _tag_schemas_prepared(tag: str, *, patterns: bool = True) -> str:
    """The structural tag ``tag`` (JSON text) with every JSON schema it embeds (the value of
    a ``"json_schema"`` key: ``json_schema`` and ``qwen_xml_parameter`` elements; each
    ``%json`` value of a Lark ``grammar`` element) as
    :func:`~capgraph.grammar.semantics.xgrammar_schema` writes it (with ``patterns``), as a
    JSON-schema guide is; text that is not JSON, or has nothing to change, is returned
    unchanged (:func:`~capgraph.grammar.semantics.changed_tag`)."""
    def change(node: dict[str, Any], _: str) -> bool:
        changed = False
        schema = node.get("json_schema")
        if isinstance(schema, dict):
            text = json.dumps(schema)
            # (an XML-style element's patterns and formats are refused by the policy; where
            # they are compiled anyway, xgrammar reads them as written: the raw text's)
            prepared = xgrammar_schema(text, patterns=patterns and not xml_style(node))
            if prepared != text:
                node["json_schema"], changed = json.loads(prepared), True
        grammar = node.get("grammar")
        if node.get("syntax") == "lark" and isinstance(grammar, str):
            node["grammar"] = _lark_schemas_prepared(grammar, patterns=patterns)
            changed |= node["grammar"] != grammar
        return changed
    return changed_tag(tag, change)


def _lark_schemas_prepared(grammar: str, *, patterns: bool = True) -> str:
    """The Lark ``grammar`` with each ``%json`` schema as
    :func:`~capgraph.grammar.semantics.xgrammar_schema` writes it (with ``patterns``);
    unchanged where its text cannot be read (the compile reports that)."""
    try:
        values = lark_json_values(grammar)
    except LarkTextError:
        return grammar
    if not values:
        return grammar
    return replace_json_values(grammar, values,
                               [xgrammar_schema(json.dumps(v.value), patterns=patterns)
                                for v in values])


def _refuse_ignored(guide_type: GuideType, warned: Sequence[str]) -> None:
    """Refuse a REGEX or EBNF guide of which xgrammar ignores a construct (``warned``: what it
    logged); ``json_unenforced_keywords`` does not apply to these."""
    what = "regex" if guide_type is GuideType.REGEX else "grammar"
    raise UnsupportedGuideError(
        f"xgrammar ignores part of this {what}, so it would not enforce it: "
        + "; ".join(f"xgrammar reported: {w}" for w in warned)
        + "; rewrite that construct (anchors '^' / '$' only at the very start / end of a "
        "regex, no lookahead, no escape other than the standard ones) or use the llguidance "
        "backend", guide_type=guide_type.name, backend=BACKEND)


def refuse_unsupported_regex(pattern: str, guide_type: GuideType = GuideType.REGEX) -> None:
    """Raise UnsupportedGuideError where this backend refuses the regex ``pattern`` as
    unsupported: what :func:`~capgraph.grammar.semantics.ecma_regex` refuses, or a construct
    xgrammar's regex parser ignores (it says so while converting). The conversion only (about
    as quick as parsing), never a compile; a pattern it cannot parse at all is left to the
    compile's error."""
    regex = ecma_regex(pattern, BACKEND, guide_type.name)
    try:
        _, warned = _converted(lambda: xgr.Grammar.from_regex(regex))
    except Exception:  # noqa: BLE001 - a parse error: the compile reports it
        return
    if warned:
        _refuse_ignored(guide_type, warned)


# xgrammar 0.2.9 spells a character of a length-limited string (minLength / maxLength) as
# [^\"\\\r\n], which lets U+0000-U+001F other than LF and CR through unescaped: not JSON
# (measured: {"type": "string", "maxLength": 5} accepts "a<U+000F>b"). Its other string rules
# exclude them all. Escapes stay unavailable inside such a string, as xgrammar has it.
_LENGTH_STRING_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\]'


def _repair_length_strings(text: str) -> str:
    """The grammar text ``text`` with every length-limited string character class made JSON's
    (no raw control character)."""
    return text.replace(_LENGTH_STRING_CHARS, _JSON_STRING_CHARS)


# xgrammar 0.2.9 writes the name of an additional (or unevaluated) property next to listed
# properties as a trie over the listed names' bytes, which leaves out only their literal
# spelling and lets JSON escapes in anywhere, so "\u0061" spells the listed "a" past the trie
# (and its value escapes a's schema). For {"properties": {"a": ...}, "additionalProperties":
# ...} (helper rules abridged to their shape):
#   root_addl_key ::= (("\"" root_addl_key_2)) (=([ \n\r\t]* [,}\]:]))
#   root_addl_key_2 ::= (("\"") | ([^\0-\x1f\"\\\r\na] basic_string_sub)
#       | ("\\" basic_escape basic_string_sub) | ("a" root_addl_key_1))
#   root_addl_key_1 ::= (([^\0-\x1f\"\\\r\n] basic_string_sub)
#       | ("\\" basic_escape basic_string_sub))
# The byte trie also misreads names beyond ASCII: its character class leaves out the first
# *byte* of "é" as if it were the character U+00C3, so "é" itself passes as an additional
# name and "Ã" is refused; and a lone byte cannot be written back as grammar text (xgrammar
# prints it as "\xc3", which it reads back as U+00C3).
_KEY_RULE = re.compile(
    r'^(?P<name>\w*_addl_key\w*) ::= \(\("\\"" (?P<root>\w+)\)\)(?P<tail>.*)$', re.MULTILINE)
_RULE = re.compile(r"^(?P<name>\w+) ::= (?P<body>.*)$", re.MULTILINE)
_TRIE_ALTERNATIVE = re.compile(
    r'(?P<end>\("\\""\))'  # the name may end here
    r'|\(\[\^(?:\\.|[^\]\\])*\] basic_string_sub\)'  # a character no listed name has here
    r'|\("\\\\" basic_escape basic_string_sub\)'  # an escape
    r'|\("(?P<byte>\\x[0-9a-f]{2}|\\.|[^"\\])" (?P<child>\w+)\)')  # a listed name goes on
# how xgrammar prints a byte as an escape (grammar_printer.cc / EscapeString)
_PRINTED_ESCAPES = {"'": 0x27, '"': 0x22, "?": 0x3F, "\\": 0x5C, "a": 0x07, "b": 0x08,
                    "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "0": 0x00, "e": 0x1B}
_STRING_SUB = re.compile(r"^basic_string_sub ::= \(.*\)(?P<lookahead> \(=.*\))$", re.MULTILINE)
# The raw characters of a JSON string: all but '"', '\' and the control characters.
_RAW_CHARS = r'\0-\x1f\"\\'
_KEY_REST = "capgraph_key_rest"


class GrammarShapeError(RuntimeError):
    """xgrammar's grammar text is not of the shape a repair was written for (another xgrammar
    version): the guide is refused rather than compiled unrepaired."""


def _repair_property_keys(text: str) -> str:
    """The grammar text ``text`` with the name of every additional / unevaluated property
    spelled without escapes and every listed name, by its characters, left out of it.

    A name without escapes has exactly one spelling, so a listed name can no longer pass as an
    additional one; the raw characters stay all that JSON allows in a string. Each such name
    rule (shown above) is rebuilt as a trie over the listed names' characters that ends in
    ``capgraph_key_rest``, ``basic_string_sub`` without its escape and with its lookahead.
    Listed names with a character JSON writes only escaped (``"``, ``\\``, a control
    character) need no exclusion: no name without escapes spells them.

    Raises:
        GrammarShapeError: a name rule, or ``basic_string_sub``, is not of the known shape.
    """
    keys = list(_KEY_RULE.finditer(text))
    rules = {m.group("name"): m.group("body") for m in _RULE.finditer(text)}
    if not keys:
        if any("_addl_key" in name for name in rules):
            raise GrammarShapeError("xgrammar's additional-property name rule is not of the "
                                    "known shape; capgraph cannot make it escape-free")
        return text
    string_sub = _STRING_SUB.search(text)
    if string_sub is None or _KEY_REST in rules:
        raise GrammarShapeError("xgrammar's basic_string_sub rule is not of the known shape; "
                                "capgraph cannot make property names escape-free")
    added = [f'{_KEY_REST} ::= (("\\"") | ([^{_RAW_CHARS}] {_KEY_REST}))'
             + string_sub.group("lookahead")]
    replaced: dict[str, str] = {}
    taken = set(rules)
    for key in keys:
        names = set()
        for raw in _read_trie(key.group("root"), rules, replaced):
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise GrammarShapeError(f"a listed property name read from {key.group('name')} "
                                        f"is not UTF-8: {raw!r}") from None
            if not any(ch in '"\\' or ord(ch) < 0x20 for ch in name):
                names.add(name)
        root = f"{key.group('name')}_noesc"
        replaced[key.group("name")] = f'(("\\"" {root})){key.group("tail")}'
        added.extend(_name_trie(root, names, taken))
    lines = []
    for line in text.splitlines():
        rule = _RULE.match(line)
        if rule is None or rule.group("name") not in replaced:
            lines.append(line)
        elif replaced[rule.group("name")]:
            lines.append(f"{rule.group('name')} ::= {replaced[rule.group('name')]}")
    return "\n".join([*lines, *added]) + "\n"


def _read_trie(root: str, rules: Mapping[str, str], dropped: dict[str, str]) -> list[bytes]:
    """The listed names the byte trie that starts at rule ``root`` leaves out; marks the
    trie's rules ``dropped`` (an empty body)."""
    names: list[bytes] = []
    stack = [(root, b"")]
    while stack:
        rule, prefix = stack.pop()
        body = rules.get(rule)
        if body is None or rule in dropped or not (body.startswith("(") and body.endswith(")")):
            raise GrammarShapeError(f"xgrammar's property-name trie rule {rule!r} is not of "
                                    "the known shape; capgraph cannot make it escape-free")
        dropped[rule] = ""
        body, pos, ends = body[1:-1], 0, False
        while True:
            alternative = _TRIE_ALTERNATIVE.match(body, pos)
            if alternative is None:
                raise GrammarShapeError(f"xgrammar's property-name trie rule {rule!r} is not "
                                        "of the known shape; capgraph cannot make it "
                                        "escape-free")
            ends = ends or alternative.group("end") is not None
            printed = alternative.group("byte")
            if printed is not None:
                byte = int(printed[2:], 16) if printed.startswith("\\x") else \
                    _PRINTED_ESCAPES[printed[1]] if printed.startswith("\\") else ord(printed)
                stack.append((alternative.group("child"), prefix + bytes([byte])))
            pos = alternative.end()
            if pos == len(body):
                break
            if not body.startswith(" | ", pos):
                raise GrammarShapeError(f"xgrammar's property-name trie rule {rule!r} is not "
                                        "of the known shape; capgraph cannot make it "
                                        "escape-free")
            pos += 3
        if not ends:
            names.append(prefix)
    return names


def _name_trie(root: str, names: Collection[str], taken: set[str]) -> list[str]:
    """Rules (the first named ``root``, the others ``root_1``, ``root_2``, ...) for the rest of
    a property name after its opening quote: any JSON string without escapes but the
    ``names``, one rule per trie node; every rule name must be new to ``taken``, which gets
    them."""
    trie: dict[str, Any] = {}  # character -> subtrie; "" -> True where a name ends
    for name in names:
        node = trie
        for ch in name:
            node = node.setdefault(ch, {})
        node[""] = True
    rules: list[str] = []
    stack = [(root, trie)]
    named = 0
    while stack:
        rule, node = stack.pop()
        if rule in taken:
            raise GrammarShapeError(f"the rule name {rule!r} is taken; capgraph cannot make "
                                    "property names escape-free")
        taken.add(rule)
        following = sorted(ch for ch in node if ch)
        alternatives = [] if "" in node else ['("\\"")']
        excluded = "".join(_grammar_char(ch) for ch in following)
        alternatives.append(f"([^{_RAW_CHARS}{excluded}] {_KEY_REST})")
        for ch in following:
            named += 1
            child = f"{root}_{named}"
            alternatives.append(f'("{_grammar_char(ch)}" {child})')
            stack.append((child, node[ch]))
        rules.append(f"{rule} ::= ({' | '.join(alternatives)})")
    return rules


def _grammar_char(ch: str) -> str:
    """``ch`` as xgrammar's EBNF reads it the same in a string and a character class."""
    if ch.isascii() and ch.isalnum():
        return ch
    code = ord(ch)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _repaired(grammar: xgr.Grammar) -> xgr.Grammar:
    """The converted JSON schema ``grammar`` with both repairs applied
    (:func:`_repair_length_strings`, :func:`_repair_property_keys`) and its patterns' slow
    automata as rules (:func:`_regexes_as_rules`); the same object where none changes it
    (:func:`_changed`). Run inside the conversion's capture: building the patterns' automata
    logs what xgrammar ignores in them again."""
    text = str(grammar)
    repaired = _repaired_text(text)
    return grammar if repaired == text else _changed(text, repaired)


def _repaired_text(printed: str) -> str:
    """:func:`_repaired`'s change of the text xgrammar ``printed`` for a converted JSON
    schema (not yet known to read back: :func:`_edited`)."""
    return _regexes_as_rules(_repair_property_keys(_repair_length_strings(printed)),
                             json_string=True)


# A rule whose body is one Regex element, as xgrammar prints it: a schema pattern's (with
# json_string=true, as its converter writes it) or a grammar's
_REGEX_RULE = re.compile(
    r'^(?P<name>\w+) ::= Regex\("(?P<body>(?:[^"\\]|\\.)*)"(?P<json>, json_string=true)?\)$',
    re.MULTILINE)
# in printed text: a string literal or a character class (skipped), or a rule name
_NAME_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|(?P<name>\b[A-Za-z_]\w*\b)',
                         re.DOTALL)
_REGEX_RULES = "capgraph_regex"


def _printed_string(body: str) -> str | None:
    """The text of a string xgrammar printed as ``body`` (between its quotes); None for an
    escape its parser does not read."""
    return ebnf_unescape(_unambiguous_hex(body))


def _regex_rules(pattern: str, name: str) -> list[str]:
    """The rules ``Grammar.from_regex`` writes for ``pattern`` (printed, one a line), the
    first named ``name``, the others ``name_1``, ``name_2``, ... as xgrammar numbers them."""
    text = str(xgr.Grammar.from_regex(pattern))
    names = {m.group("name") for m in _RULE.finditer(text)}

    def rename(m: re.Match[str]) -> str:
        found = m.group("name")
        if found is None or found not in names:
            return m.group(0)
        return name + found[len("root"):] if found.startswith("root") else f"{name}_{found}"
    return [line for line in _NAME_TOKEN.sub(rename, text).splitlines() if line.strip()]


def _regexes_as_rules(text: str, json_string: bool) -> str:
    """The printed grammar ``text`` with each ``Regex(...)`` rule whose automaton xgrammar
    would build with a repeat edge (``[a-z]{1,255}``; its masks are computed token by token:
    4-6 ms a token on Tekken, ``tools/bench_regex_paths.py``) as the rules
    ``Grammar.from_regex`` writes for it (0.1-0.2 ms), the same language.

    ``json_string``: the rules of a JSON schema's patterns (``json_string=true``), which
    :func:`~capgraph.grammar.semantics.xgrammar_schema` writes with no character JSON escapes
    left bare in a set, so their rules match what the ``json_string=true`` automaton matches
    (and an escape the automaton leaves out, ``\\n`` for ``\n``, too); else a grammar's plain
    ``Regex("...")`` rules. A regex ``from_regex`` cannot read, or a grammar without this
    xgrammar's automaton pass, is left as it is. (Each regex's automaton is built alone,
    :func:`_automaton`: the pass adds a repeat's rule to the grammar it is given.)"""
    found = [m for m in _REGEX_RULE.finditer(text) if bool(m.group("json")) == json_string]
    if not found or _fsm_builder() is None:
        return text
    taken = {m.group("name") for m in _RULE.finditer(text)}
    prefix = _REGEX_RULES
    while any(name.startswith(prefix) for name in taken):
        prefix += "x"
    replaced: dict[str, str] = {}
    added: list[str] = []
    for m in found:
        pattern = _printed_string(m.group("body"))
        if pattern is None or _automaton(pattern, json_string=json_string) is not None:
            continue
        name = f"{prefix}_{len(replaced)}"
        try:
            added.extend(_regex_rules(pattern, name))
        except Exception:  # noqa: BLE001 - from_regex cannot read it: the automaton stays
            continue
        replaced[m.group("name")] = f"{m.group('name')} ::= (({name}))"
    if not replaced:
        return text
    lines = [replaced.get(rule.group("name"), line) if (rule := _RULE.match(line)) else line
             for line in text.splitlines()]
    return "\n".join([*lines, *added]) + "\n"


# A \xHH escape of printed grammar text (the printer writes two digits): a backslash after
# an even run of backslashes (the pairs are escaped backslashes, kept as group 1), an x and
# two hex digits (group 2). Matched and rewritten without a Python call per match: a printed
# JSON-schema grammar holds hundreds of other escapes.
_PRINTED_HEX = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})")


def _unambiguous_hex(text: str) -> str:
    """Printed grammar ``text`` with each ``\\xHH`` written ``\\u00HH``: xgrammar prints a
    character up to U+00FF as ``\\xHH`` and its parser reads every hex digit after ``\\x``
    (``"\\xe9a"``, printed for ``"éa"``, reads back as U+0E9A)."""
    return _PRINTED_HEX.sub(r"\1\\u00\2", text)


def _reparsed(text: str) -> xgr.Grammar:
    """The grammar xgrammar printed as ``text``, parsed back (:func:`_unambiguous_hex`)."""
    return xgr.Grammar.from_ebnf(_unambiguous_hex(text))


def _edited(printed: str, new: str) -> str:
    """The grammar text ``new``, a change of the text xgrammar ``printed`` for a grammar (or
    that text itself), as its parser reads it (:func:`_unambiguous_hex`), once ``printed`` is
    known to read back as the grammar it was printed for (it prints the same once read back).

    Raises:
        GrammarShapeError: ``printed`` does not read back so: a change of it would not mean
            what it says.
    """
    if str(_reparsed(printed)) != printed:
        raise GrammarShapeError("xgrammar does not read its printed grammar back as printed; "
                                "capgraph cannot repair it as text")
    return _unambiguous_hex(new)


def _changed(printed: str, new: str) -> xgr.Grammar:
    """:func:`_edited`, parsed.

    Raises:
        GrammarShapeError: ``printed`` does not read back as printed.
    """
    return xgr.Grammar.from_ebnf(_edited(printed, new))


def _ffi(obj: Any, *methods: str) -> Any:
    """The FFI object behind an xgrammar wrapper, or None.

    xgrammar's Python classes are thin wrappers whose methods forward to ``_handle`` (an
    object fixed at construction, per xgrammar's ``XGRObject`` contract); calling its bound
    methods directly skips one Python frame per call (~0.1 us, measured with xgrammar 0.2.9),
    which this library pays per request per step. Without it the public methods are used.
    """
    handle = getattr(obj, "_handle", None)
    if handle is None or not all(hasattr(handle, m) for m in methods):
        return None
    return handle


class XGrammarMatcher(GrammarMatcher):
    """Wraps ``xgrammar.GrammarMatcher``; rollback is unlimited in xgrammar >= 0.2.9.

    ``is_terminated`` is answered from a flag kept in step with ``accept_token`` and
    ``rollback``: only an accepted stop token can terminate, only a rollback can undo it, and
    asking xgrammar costs a foreign call (~1.5 us) on every request of every step otherwise.

    With ``utf8`` tables (the factory's), the matcher carries a
    :class:`~capgraph.grammar.utf8.Utf8Guard`: a token whose bytes are not UTF-8 after the
    text so far is refused before xgrammar sees it, and every mask it fills is ANDed with the
    tokens that are (xgrammar's own masks take some byte sequences that are not UTF-8).
    A rollback deeper than the guard keeps (:data:`~capgraph.grammar.utf8.RING` - 1 tokens)
    raises ``MatcherError``.
    """

    __slots__ = ("_matcher", "_stop_ids", "_terminated", "_handle", "_chandle", "_accept",
                 "_fill", "_jump", "_compiled", "_jump_ok", "_guard")

    def __init__(self, matcher: xgr.GrammarMatcher, stop_ids: frozenset[int] = frozenset(),
                 compiled: xgr.CompiledGrammar | None = None,
                 utf8: Utf8Tables | None = None) -> None:
        self._matcher = matcher
        self._guard = None if utf8 is None else Utf8Guard(utf8)
        # the grammar, read once (on the first forced_bytes) for whether xgrammar's
        # jump-forward walk is bounded on it (_jump_forward_ok); None: not known, no forced text
        self._compiled = compiled
        self._jump_ok: bool | None = None
        self._stop_ids = stop_ids
        self._terminated = matcher.is_terminated()
        handle = _ffi(matcher, "accept_token", "fill_next_token_bitmask")
        self._handle = handle  # what BatchGrammarMatcher's FFI object takes, or None
        # the jump-forward string, a str (FFI string subclass: no conversion needed)
        jump = _ffi(matcher, "find_jump_forward_string")
        self._jump: Callable[[], str] = (jump.find_jump_forward_string if jump is not None
                                         else matcher.find_jump_forward_string)
        # its address, for the C++ fast path (capgraph.build.native; 0: none)
        chandle = getattr(handle, "__chandle__", None)
        self._chandle: int = int(chandle()) if chandle is not None else 0
        if handle is not None:  # (token, debug_print) / (bitmask, index, debug_print)
            self._accept = handle.accept_token
            self._fill = handle.fill_next_token_bitmask
        else:
            self._accept = lambda token_id, _debug: matcher.accept_token(token_id)
            self._fill = lambda bitmask, index, _debug: matcher.fill_next_token_bitmask(
                bitmask, index)

    @property
    def native(self) -> xgr.GrammarMatcher:
        """The wrapped ``xgrammar.GrammarMatcher`` (the native build calls it directly)."""
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        guard = self._guard
        if guard is None:
            ok = self._accept(token_id, False)
        else:
            state = guard.next_state(token_id)
            ok = state != INVALID and self._accept(token_id, False)
            if ok:
                guard.push(state)
        if ok and token_id in self._stop_ids:
            self._terminated = self._matcher.is_terminated()
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"rollback needs num_tokens >= 0, got {num_tokens}")
        if num_tokens:
            guard = self._guard
            if guard is not None:
                guard.pop(num_tokens)  # (first: a rollback past its history moves nothing)
            try:
                self._matcher.rollback(num_tokens)
            except BaseException:
                if guard is not None:
                    guard.count += num_tokens
                raise
            self._terminated = False  # termination is always the last step

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._fill(bitmask, index, False)
        if self._guard is not None:
            self._guard.mask_row(bitmask.numpy()[index])

    @property
    def utf8_guard(self) -> Utf8Guard | None:
        """The matcher's UTF-8 guard (None: built without the factory's tables)."""
        return self._guard

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_bytes(self, max_bytes: int) -> bytes:
        """xgrammar's jump-forward string (whole characters only), cut to ``max_bytes``; empty
        for a grammar on which xgrammar's walk, which has no length bound, could be long
        (:func:`_jump_forward_ok`), and from the first walk on a grammar that took longer than
        :data:`~capgraph.grammar.forced.MAX_FORCED_WALK_MS` for every matcher of it."""
        if self._terminated or max_bytes <= 0 or self._jump_ok is False:
            return b""
        if not _jump_forward_ok(self._compiled):  # (per grammar: another matcher may stop it)
            self._jump_ok = False
            return b""
        start = time.perf_counter()
        try:
            forced = self._jump()
        except Exception as e:  # noqa: BLE001 - xgrammar's errors, as capgraph's
            raise MatcherError(f"xgrammar's jump-forward search failed: "
                               f"{type(e).__name__}: {str(e).strip()[:200]}",
                               backend=BACKEND) from e
        if (time.perf_counter() - start) * 1e3 > MAX_FORCED_WALK_MS:
            # (a parser this slow per byte: later walks would be as long)
            self._jump_ok = False
            _stop_jump_forward(self._compiled)
        return whole_utf8_prefix(forced.encode(), max_bytes) if forced else b""

    def sync_state(self) -> None:
        """Re-read the termination flag after the FFI object was advanced directly (by the
        native host build, :mod:`capgraph.build.native`)."""
        self._terminated = self._matcher.is_terminated()

    def native_handle(self) -> Any:
        """The FFI object a C++ build or xgrammar's batch matcher runs for this matcher (None
        where this xgrammar exposes none), its UTF-8 guard handed to the C++ side first
        (:func:`_native_guard`; a build calls this every step: once handed over, nothing)."""
        if self._guard is not None and not self._guard.native:
            _native_guard(self)
        return self._handle

    @property
    def ffi_address(self) -> int:
        """The address of the xgrammar FFI object this matcher drives (0 where this xgrammar
        exposes none): what the native host build runs (its UTF-8 guard is handed to the C++
        side first: :func:`_native_guard`)."""
        if self._guard is not None and not self._guard.native:
            _native_guard(self)
        return self._chandle


def _native_guard(matcher: XGrammarMatcher) -> None:
    """Hand ``matcher``'s UTF-8 guard to the C++ builds, once, where the host build library
    is loaded: its state moves into a C++ allocation registered for the matcher's FFI object
    (``utf8_guard_new``), which the builds look up by that object and count while they use
    it; the guard's collection releases it (``utf8_guard_drop``: the guard, which
    :attr:`XGrammarMatcher.utf8_guard` hands out, may outlive its matcher)."""
    guard = matcher._guard
    if guard is None or guard.native or not matcher._chandle:
        return
    from ..build import library

    module = library.loaded()
    if module is None:
        return
    block, data = (int(x) for x in module.utf8_guard_new(matcher._chandle))
    guard.rebind((ctypes.c_uint8 * GUARD_BYTES).from_address(data))
    guard.native = True
    weakref.finalize(guard, module.utf8_guard_drop, matcher._chandle, block)


# id(compiled grammar) -> (a weak reference to it, verdict); an entry leaves with its grammar
# (CompiledGrammar is not hashable, so no WeakKeyDictionary)
_JUMP_OK: dict[int, tuple[weakref.ref[Any], bool]] = {}
_JUMP_OK_LOCK = threading.RLock()  # (re-entered where a weakref callback runs inside it)


def _jump_forward_ok(compiled: xgr.CompiledGrammar | None) -> bool:
    """Whether xgrammar's jump-forward walk is short on ``compiled``: the forced text of
    every state of its grammar is at most
    :data:`~capgraph.grammar.forced.MAX_FORCED_TEXT_BYTES`
    (:func:`~capgraph.grammar.forced_bound.forced_text_bound`; a grammar whose printed text
    hides bytes is stopped when it is compiled or loaded: :meth:`XGrammarFactory._unread`).
    The walk stops only at the end of the forced text, so on ``root ::= "ab" root`` it never returns (memory runs out),
    on a grammar of exponentially long completions it takes exponential time, and on
    ``r ::= "[" r "]" | "x"`` it builds one ``]`` per ``[`` written; those grammars get no
    forced text. Read once per compiled grammar (50 ms for the bundled corpus's largest
    schema, a 72 KB grammar), and False from a walk on it that ran too long
    (:func:`_stop_jump_forward`); None (a matcher built without its grammar): False."""
    if compiled is None:
        return False
    key = id(compiled)
    with _JUMP_OK_LOCK:
        known = _JUMP_OK.get(key)
    if known is not None and known[0]() is compiled:
        return known[1]
    try:
        ok = forced_text_bound(str(compiled.grammar)) <= MAX_FORCED_TEXT_BYTES
    except Exception:  # noqa: BLE001 - an unreadable grammar: no forced text
        ok = False
    return _remember_jump_ok(compiled, ok)


#: The guide types whose printed grammar may hide a NUL (:meth:`XGrammarFactory._unread`)
_UNREAD = (GuideType.EBNF_GRAMMAR, GuideType.REGEX, GuideType.STRUCTURAL_TAG)
#: How a NUL can be written in such a guide (in JSON text a backslash doubled, which these
#: still find): a guide with none of them holds no NUL, and is not read for one
_NUL_SPELLINGS = ("\x00", "\\0", "\\x00", "\\u0000", "\\U00000000", "\\c@")


def _tag_converted(tag: str, whitespace: dict[str, Any] | None = None
                   ) -> tuple[xgr.Grammar, list[str]]:
    """A structural tag (as :meth:`XGrammarFactory._tag_text` makes it) converted by
    xgrammar, with the warnings its converter logged; ``whitespace``: its JSON-schema
    elements' (:func:`_tag_schemas_repaired`)."""
    return _converted(lambda: xgr.Grammar.from_structural_tag(
        _tag_schemas_repaired(_tag_regexes_faster(tag), whitespace)))


def _refuse_tag_drops(tag: str) -> None:
    """Refuse a structural tag (JSON text) with an element xgrammar 0.2.9 converts wrongly:
    inside a ``repeat``, an ``exclude_token`` or the ``exclude_tokens`` of an ``any_tokens``
    is dropped (the rule allows every token) and a ``token_dispatch`` crashes the process in
    the converter; the ``excludes`` of a ``json_schema`` element are not applied to strings
    with a ``pattern`` or ``format``."""
    try:
        doc = json.loads(tag)
    except ValueError:
        return  # malformed: xgrammar's own error says where

    def refuse(detail: str) -> NoReturn:
        raise UnsupportedGuideError(detail, guide_type=GuideType.STRUCTURAL_TAG.name,
                                    backend=BACKEND)
    for node, at in tag_nodes(doc):
        kind = node.get("type")
        if kind == "repeat":
            for inner, where in tag_nodes(node.get("content")):
                inner_kind = inner.get("type")
                if inner_kind == "exclude_token" or (inner_kind == "any_tokens"
                                                     and inner.get("exclude_tokens")):
                    refuse(f"the {inner_kind} element at {at}/content{where} is inside a "
                           "repeat, where xgrammar drops its excluded tokens")
                if inner_kind == "token_dispatch":
                    refuse(f"the token_dispatch element at {at}/content{where} is inside a "
                           "repeat, which xgrammar's converter cannot take (it crashes)")
        if node.get("excludes") and "json_schema" in node \
                and _string_with_pattern_or_format(node["json_schema"]):
            refuse(f"the excludes of the element at {at or '/'} would not apply to its "
                   "schema's strings with a pattern or format (xgrammar filters only plain "
                   "strings)")


def _string_with_pattern_or_format(schema: Any) -> bool:
    """Whether a JSON schema has, at any of its schema positions, a ``pattern`` or ``format``
    that applies to strings (its ``type`` absent or naming ``string``); a property named so,
    a value inside ``const`` / ``enum`` or an integer's ``format`` is none."""
    from .schema_policy import subschemas
    stack = [schema]
    seen = 0
    while stack and seen < 100_000:  # (a schema is finite; the count only guards the walk)
        item = stack.pop()
        seen += 1
        if not isinstance(item, dict):
            continue
        types = item.get("type")
        strings = types is None or types == "string" or (isinstance(types, list)
                                                         and "string" in types)
        if strings and ("pattern" in item or isinstance(item.get("format"), str)):
            return True
        stack.extend(sub for sub, _ in subschemas(item))
    return bool(stack)


def _stop_jump_forward(compiled: xgr.CompiledGrammar | None) -> None:
    """No more forced text on ``compiled`` (a walk on it ran past
    :data:`~capgraph.grammar.forced.MAX_FORCED_WALK_MS`)."""
    if compiled is not None:
        _remember_jump_ok(compiled, False)


def _remember_jump_ok(compiled: xgr.CompiledGrammar, ok: bool) -> bool:
    """Store ``ok`` as ``compiled``'s verdict (a False already stored stays); the verdict."""
    key = id(compiled)

    def forget(ref: weakref.ref[Any]) -> None:
        with _JUMP_OK_LOCK:
            if _JUMP_OK.get(key, (None,))[0] is ref:
                del _JUMP_OK[key]

    with _JUMP_OK_LOCK:
        known = _JUMP_OK.get(key)
        if known is not None and known[0]() is compiled:
            if not ok:  # (a walk too long stays so)
                _JUMP_OK[key] = (known[0], False)
            return known[1] and ok
        _JUMP_OK[key] = (weakref.ref(compiled, forget), ok)
    return ok


def _delegate_handle(matcher: GrammarMatcher) -> Any:
    """The FFI object of the ``XGrammarMatcher`` ``matcher`` forwards every call to (its
    ``delegate``, see capgraph.build.slots.Delegating), or None."""
    delegate = getattr(matcher, "delegate", None)
    return delegate.native_handle() if type(delegate) is XGrammarMatcher else None


#: The modules whose code shapes an xgrammar compile (their source is in the disk-cache key).
_COMPILE_MODULES = ("capgraph.grammar.xgrammar_backend", "capgraph.grammar.semantics",
                    "capgraph.grammar.schema_policy", "capgraph.grammar.guide_limits",
                    "capgraph.grammar.converter_log", "capgraph.grammar.lark_text",
                    "capgraph.grammar.formats", "capgraph.grammar.regex_classes",
                    "capgraph.grammar.graphs")
#: The modules this one imports (directly or not) whose code does not decide what a guide
#: compiles to or whether it is refused (a test holds every import to one of the two lists).
_NOT_COMPILE_MODULES = ("capgraph.grammar.base", "capgraph.grammar.cache",
                        "capgraph.grammar.compile_cost", "capgraph.grammar.compile_pool",
                        "capgraph.grammar.disk_cache", "capgraph.grammar.forced",
                        "capgraph.grammar.forced_bound", "capgraph.grammar.process_pool",
                        "capgraph.grammar.utf8")


def _xgrammar_version() -> str:
    try:
        return importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:  # a source build
        return str(getattr(xgr, "__version__", "unknown"))


class XGrammarMatcherFactory(GrammarMatcherFactory):
    """Compiles guides with ``xgrammar.GrammarCompiler`` (its own cache off: ours bounds bytes).

    Compiled grammars go to the disk cache as ``CompiledGrammar.serialize_json()``, keyed by
    the xgrammar version and a digest of this factory's ``TokenizerInfo`` serialization (the
    vocabulary as xgrammar sees it: specials emptied, padding, stop ids)."""

    backend_name = BACKEND
    disk_cacheable = True

    def __init__(self, config: GuidedDecodingConfig) -> None:
        super().__init__(config)
        self.tokenizer_info = build_tokenizer_info(config)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info,
                                             max_threads=max(1, config.compile_threads),
                                             cache_enabled=False)
        # fill_threads 0 is xgrammar's "auto" (half the hardware threads); 1, the default, was
        # the fastest measured on a 2-core and a 16-core host (GuidedDecodingConfig).
        self._batch = xgr.BatchGrammarMatcher(config.fill_threads or "auto")
        batch_ffi = _ffi(self._batch, "batch_fill_next_token_bitmask")
        self._batch_fill_ffi = None if batch_ffi is None else \
            batch_ffi.batch_fill_next_token_bitmask  # (handles, bitmask, indices, debug)
        self._stop_ids = frozenset(config.stop_token_ids or ())
        #: the UTF-8 guard's tables over this vocabulary (special and stop tokens textless:
        #: their text is emptied in ``tokenizer_info``), which every matcher carries
        self.utf8: Utf8Tables | None = utf8_tables(self.tokenizer_info.decoded_vocab,
                                                   config.vocab_size_padded)
        self._json_options = json_whitespace_options(config)
        # special tokens by name, which a structural tag's token elements may name
        self._special_ids_by_name: dict[str, int] = {}
        if config.tokenizer is not None:
            from ..tokenizers import special_token_ids
            ids = sorted(special_token_ids(config.tokenizer))
            names = config.tokenizer.convert_ids_to_tokens(ids)
            self._special_ids_by_name = {str(n): i for n, i in zip(names, ids)}
        # compilers for structural tags that place special tokens, by the ids they place
        self._placing_compilers: dict[frozenset[int], xgr.GrammarCompiler] = {}
        self._placing_infos: dict[frozenset[int], xgr.TokenizerInfo] = {}
        self._placing_lock = threading.Lock()
        self._disk_key_prefix()  # (about 0.1 s for a 131k vocabulary, with the disk cache on)
        #: the compile worker processes (compile_isolation="process"), else None
        self.processes: ProcessCompilePool | None = None
        if config.compile_isolation == "process":
            self.processes = ProcessCompilePool(config, config.compile_threads,
                                                config.compile_memory_limit_bytes,
                                                wanted=self._still_wanted)
            self._pool.max_waiting = 4 * config.compile_threads

    def _compiler_placing(self, placed: frozenset[int]) -> xgr.GrammarCompiler:
        """The compiler for a structural tag that places the special ids ``placed``: the shared
        one when it places none, else one over a vocabulary where exactly those are placeable
        (:func:`build_tokenizer_info`), built once per set (about 1 s for a 150k vocabulary,
        in the compile thread) and kept for the factory's life."""
        if not placed:
            return self._compiler
        with self._placing_lock:
            compiler = self._placing_compilers.get(placed)
            if compiler is None:
                info = build_tokenizer_info(self.config, placed)
                compiler = xgr.GrammarCompiler(info,
                                               max_threads=max(1, self.config.compile_threads),
                                               cache_enabled=False)
                self._placing_compilers[placed] = compiler
                self._placing_infos[placed] = info
            return compiler

    def _tokenizer_info_for(self, params: GuidedDecodingParams) -> xgr.TokenizerInfo:
        """The vocabulary ``params`` compiles against: the shared one, or for a structural tag
        that places special tokens, the one where those are placeable."""
        if params.guide_type is not GuideType.STRUCTURAL_TAG:
            return self.tokenizer_info
        _, placed = _resolve_tag_tokens(params.guide, self._special_ids_by_name)
        if not placed:
            return self.tokenizer_info
        self._compiler_placing(placed)
        return self._placing_infos[placed]

    # -- disk cache hooks ----------------------------------------------------------------------
    def _disk_identity(self) -> list[str]:
        vocab = hashlib.sha256(self.tokenizer_info.serialize_json().encode()).hexdigest()
        return [f"xgrammar={_xgrammar_version()}", f"tokenizer_info={vocab}",
                f"code={source_digest(_COMPILE_MODULES)}"]

    def _serialize(self, compiled: CompiledGuide) -> str:
        return compiled.payload.serialize_json()

    def _serialized_bytes_estimate(self, compiled: CompiledGuide) -> int | None:
        """From the rule count (every rule prints as ``name ::= ...``, so counting can only
        overcount) and ``compiled.nbytes``
        (:func:`~capgraph.grammar.disk_cache.serialized_bytes_estimate`)."""
        grammar = getattr(compiled.payload, "grammar", None)
        if grammar is None:  # (not a CompiledGrammar: not written)
            return None
        return serialized_bytes_estimate(compiled.nbytes, str(grammar).count("::="))

    def _deserialize(self, params: GuidedDecodingParams, text: str) -> tuple[Any, int]:
        grammar = xgr.CompiledGrammar.deserialize_json(text, self._tokenizer_info_for(params))
        self._unread(params, grammar)
        return grammar, int(grammar.memory_size_bytes)

    def _stop_compile(self, key: tuple[str, str]) -> bool:
        return self.processes is not None and self.processes.stop(key)

    def close(self) -> None:
        super().close()
        if self.processes is not None:
            self.processes.close()

    def _compile(self, params: GuidedDecodingParams) -> tuple[Any, int]:
        if self.processes is not None and not self.processes.compiles_here(params):
            return self._compile_in_process(params)
        return self._compile_here(params)  # (in process mode: a guide estimated cheap)

    def _tag_text(self, guide: str) -> tuple[str, frozenset[int]]:
        """A structural tag as xgrammar is given it (its schemas as JSON-schema guides', its
        regexes as ECMA-262 reads them, its tokens placed by id) and the token ids placed."""
        prepared = _tag_schemas_prepared(guide)  # its schemas as JSON_SCHEMA guides'
        return _resolve_tag_tokens(ecma_tag(prepared), self._special_ids_by_name)

    def _unread(self, params: GuidedDecodingParams, compiled: Any,
                grammar: xgr.Grammar | None = None) -> None:
        """No forced text on ``compiled`` where its printed grammar hides bytes
        (:func:`~capgraph.grammar.forced_bound.grammar_hides_bytes`: a NUL in a string or a
        regex of an EBNF, regex or structural-tag guide; a JSON schema's strings and
        patterns never hold one, as JSON text writes it escaped and xgrammar refuses a
        pattern that matches it), which the forced-text bound could not read. ``grammar``:
        the guide as the compile here converted it; else (compiled in a worker process or
        loaded from the disk cache, which keep no uncompiled grammar) the guide is converted
        again, not compiled."""
        gt = params.guide_type
        if gt not in _UNREAD or not any(spelling in params.guide
                                         for spelling in _NUL_SPELLINGS):
            return
        try:
            if grammar is not None:
                pass
            elif gt is GuideType.STRUCTURAL_TAG:
                grammar, _ = _tag_converted(self._tag_text(params.guide)[0],
                                            self._json_options)
            else:
                grammar, _ = _converted(lambda: _ebnf_grammar(ecma_ebnf(params.guide))
                                        if gt is GuideType.EBNF_GRAMMAR
                                        else _regex_grammar(ecma_regex(params.guide, BACKEND)))
        except Exception:  # noqa: BLE001 - (it compiled: cannot tell, so no forced text)
            _stop_jump_forward(compiled)
            return
        if grammar_hides_bytes(grammar):
            _stop_jump_forward(compiled)

    def _compile_in_process(self, params: GuidedDecodingParams) -> tuple[Any, int]:
        """:meth:`_compile_here` in a worker process, the grammar sent back serialized; one
        too large to send back and quick to compile is compiled here again
        (:class:`~capgraph.grammar.process_pool.CompileHere`)."""
        assert self.processes is not None
        try:
            text, _, _ = self.processes.compile((params.guide_type.value, params.guide), params)
        except CompileHere:
            return self._compile_here(params)
        start = time.perf_counter()
        loaded = self._deserialize(params, text)
        self.processes.record_deserialize(time.perf_counter() - start)
        return loaded

    def _compile_here(self, params: GuidedDecodingParams) -> tuple[Any, int]:
        gt, guide = params.guide_type, params.guide
        try:
            # Every conversion runs inside the stderr capture (around the conversion only, not
            # the compile; conversions overlap, and one whose warnings may be another's is
            # converted again: converter_log.captured). A REGEX or EBNF guide whose conversion
            # logged one is refused; a JSON schema or tag, outside "ignore".
            refuse = self.config.json_unenforced_keywords != "ignore"
            if gt is GuideType.JSON:  # a JSON object or array, as on llguidance
                if self.config.json_whitespace == "any":  # (twice as fast per step)
                    compiled = run_lowered(self._compiler.compile_builtin_json_grammar)
                else:
                    grammar, _ = _converted(lambda: xgr.Grammar.from_json_schema(
                        JSON_CONTAINER_SCHEMA, strict_mode=False, **self._json_options))
                    compiled = run_lowered(lambda: self._compiler.compile_grammar(grammar))
            elif gt is GuideType.JSON_SCHEMA:
                schema = xgrammar_schema(guide)  # what capgraph means, as xgrammar reads it
                if refuse:  # (its patterns as written: the rewritten ones match JSON text)
                    self._refuse_unenforced(xgrammar_schema(guide, patterns=False))
                grammar, warned = _converted(lambda: _repaired(
                    xgr.Grammar.from_json_schema(schema, **self._json_options)))
                if warned and refuse:
                    _refuse("; ".join(f"xgrammar reported: {w}" for w in warned))
                compiled = self._compile_grammar(self._compiler, grammar, bool(warned))
            elif gt is GuideType.REGEX:
                regex = ecma_regex(guide, BACKEND)  # ECMA-262's '.', escapes refused
                grammar, warned = _converted(lambda: _regex_grammar(regex))
                if warned:
                    _refuse_ignored(gt, warned)
                compiled = run_lowered(lambda: self._compiler.compile_grammar(grammar))
            elif gt is GuideType.EBNF_GRAMMAR:
                ebnf = ecma_ebnf(guide)  # its Regex(...)s as ECMA-262 reads them
                grammar, warned = _converted(lambda: _ebnf_grammar(ebnf))
                if warned:
                    _refuse_ignored(gt, warned)
                _refuse_lookaheads(grammar, gt)
                compiled = run_lowered(lambda: self._compiler.compile_grammar(grammar))
            elif gt is GuideType.STRUCTURAL_TAG:
                tag, placed = self._tag_text(guide)
                self._refuse_placing(tag, placed)
                _refuse_tag_drops(tag)
                self._refuse_ignored_in_tag(tag)
                if refuse:  # the JSON schemas a tag embeds: as JSON-schema guides
                    self._refuse_unenforced_in_tag(_tag_schemas_prepared(guide, patterns=False))
                grammar, warned = _tag_converted(tag, self._json_options)
                if warned and refuse:
                    _refuse("; ".join(f"xgrammar reported: {w}" for w in warned), gt)
                compiled = self._compile_grammar(self._compiler_placing(placed), grammar,
                                                 bool(warned))
            else:  # pragma: no cover - GuideType is closed
                raise UnsupportedGuideError("unknown guide type", guide_type=str(gt),
                                            backend=BACKEND)
        except GrammarCompileError:
            raise
        except Exception as e:
            detail = f"{type(e).__name__}: {str(e).strip()}"
            if gt is GuideType.EBNF_GRAMMAR and "::=" not in guide and _LARK_RULE.search(guide):
                detail += (" (this looks like Lark; the xgrammar backend takes GBNF/EBNF with a "
                           "'root ::= ...' rule, the llguidance backend takes Lark)")
            raise GrammarCompileError(detail, guide_type=gt.name, backend=BACKEND) from e
        # (an EBNF, regex or structural-tag guide's branch converted it to ``grammar``)
        self._unread(params, compiled, grammar if gt in _UNREAD else None)
        return compiled, int(compiled.memory_size_bytes)

    def _refuse_placing(self, tag: str, placed: frozenset[int]) -> None:
        """Refuse a structural tag (as :func:`_resolve_tag_tokens` left it) whose tokens
        xgrammar would not match as written: a ``token`` element, ``trigger_tokens``,
        ``exclude_tokens`` or token-dispatch rule naming by text a token that is no special
        token (xgrammar's structural tags hold no vocabulary to look it up in: give its id),
        a stop token it places (xgrammar allows a stop token only where the output ends, so a
        tag with text after it dead-ends there), or special tokens placed next to an
        XML-style element (whose raw-text values would take a placed token's spelling as
        text)."""
        def refuse(detail: str) -> NoReturn:
            raise UnsupportedGuideError(detail, guide_type=GuideType.STRUCTURAL_TAG.name,
                                        backend=BACKEND)
        stops = sorted(placed & set(self.config.stop_token_ids or ()))
        if stops:
            refuse(f"the tag places stop token {stops[0]} by a token element: xgrammar allows "
                   "a stop token only where the output ends, so a tag that places one is "
                   "never completed; leave it out (the output ends with it)")
        try:
            doc = json.loads(tag)
        except ValueError:
            return
        for node, at in tag_nodes(doc):
            named = [node["token"]] if node.get("type") == "token" else []
            named += [t for key in ("trigger_tokens", "exclude_tokens")
                      if isinstance(node.get(key), list) for t in node[key]]
            if node.get("type") == "token_dispatch" and isinstance(node.get("rules"), list):
                named += [r[0] for r in node["rules"] if isinstance(r, list) and r]
            text = next((t for t in named if isinstance(t, str)), None)
            if text is not None:
                refuse(f"the tag names token {text!r} by text, and it is no special token of "
                       "this vocabulary: name an ordinary token by its id")
            if placed and "json_schema" in node and xml_style(node):
                refuse(f"the tag places special tokens and has an XML-style element at "
                       f"{at or '/'}, whose raw-text values would take a placed token as "
                       "text")

    @staticmethod
    def _compile_grammar(compiler: xgr.GrammarCompiler, grammar: xgr.Grammar,
                         warned: bool) -> xgr.CompiledGrammar:
        """``compiler.compile_grammar(grammar)`` at the compile's lowered priority; where its
        conversion logged warnings (``json_unenforced_keywords="ignore"`` lets it through),
        inside the capture instead (:func:`~capgraph.grammar.converter_log.exclusive`) and at
        normal priority (a starved thread must not hold the capture open for long): the
        compile logs them again, and a conversion alongside then reads the warnings in its
        window as possibly not its own."""
        if not warned:
            return run_lowered(lambda: compiler.compile_grammar(grammar))
        with exclusive():
            return compiler.compile_grammar(grammar)

    @staticmethod
    def _refuse_unenforced(guide: str) -> None:
        """Raise UnsupportedGuideError for the keywords of ``guide`` that xgrammar is not
        known to enforce (:mod:`capgraph.grammar.schema_policy`)."""
        found = unenforced_in_text(guide, BACKEND)
        if found:
            _refuse(describe(found))

    def _refuse_ignored_in_tag(self, tag: str) -> None:
        """Refuse the structural tag ``tag`` (JSON text, as it is compiled) if xgrammar ignores
        a construct of one of its ``regex`` or ``grammar`` elements (it logs that while
        converting them, each converted here alone) or a grammar element has a lookahead
        assertion (:func:`_lookahead_rules`), whatever ``json_unenforced_keywords`` says, as
        for REGEX and EBNF guides. An element xgrammar cannot convert alone is left for the
        tag's compile to report."""
        try:
            doc = json.loads(tag)
        except ValueError:
            return

        def check(convert: Callable[[], xgr.Grammar], where: str, lookahead: bool) -> None:
            try:
                grammar, warned = _converted(convert)
            except Exception:  # noqa: BLE001 - the tag's compile reports it
                return
            if warned:
                _refuse_ignored_in_tag(warned, where)
            if lookahead:
                _refuse_lookaheads(grammar, GuideType.STRUCTURAL_TAG, f" in {where}")

        for node, at in tag_nodes(doc):
            kind, where = node.get("type"), f"the {node.get('type')} element at {at or '/'}"
            if kind == "regex" and isinstance(node.get("pattern"), str):
                pattern = node["pattern"]  # (converted as its compile will)
                check(lambda: _regex_grammar(pattern), where, False)
            elif kind == "grammar" and isinstance(node.get("grammar"), str):
                text = node["grammar"]
                if node.get("syntax", "ebnf") == "lark":
                    # (Lark has no lookahead syntax: those of the converted grammar are
                    # xgrammar's own, in the rules it writes for a %json)
                    check(lambda: xgr.Grammar.from_lark(
                        text, tokenizer_info=self.tokenizer_info), where, False)
                    _refuse_wider_lark_regexes(text, where)
                else:  # (parsed and built only: the rules rewrite is the compile's)
                    check(lambda: _build_automata(xgr.Grammar.from_ebnf(text)), where, True)

    @staticmethod
    def _refuse_unenforced_in_tag(guide: str) -> None:
        """Raise UnsupportedGuideError for the keywords of the JSON schemas a structural tag
        embeds that xgrammar is not known to enforce there."""
        try:
            tag = json.loads(guide)
        except ValueError:
            return  # malformed: xgrammar's own error says where
        found = unenforced_in_tag(tag)
        if found:
            _refuse(describe(found), GuideType.STRUCTURAL_TAG)

    def create_from_compiled(self, compiled: CompiledGuide) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled.payload), self._stop_ids,
                               compiled.payload, self.utf8)

    def _likely_allowed_ids(self) -> Sequence[int]:
        single_byte = [i for i, b in enumerate(self.tokenizer_info.decoded_vocab) if len(b) == 1]
        return [*self._stop_ids, *single_byte]

    def batch_accept(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]
                     ) -> list[bool | Exception]:
        """Accept a token per matcher with one Python loop over the native matchers.

        Not ``xgrammar.BatchGrammarMatcher.batch_accept_token``: measured at batch 32
        (Tekken, JSON schema), converting its result array back to Python costs more than the
        calls it saves (26 us vs 15 us for this loop).
        """
        results: list[bool | Exception] = []
        append = results.append
        stops = self._stop_ids
        for m, t in zip(matchers, tokens):
            try:
                if type(m) is XGrammarMatcher:  # not a subclass or wrapper: its own methods
                    guard = m._guard
                    if guard is None:
                        ok = m._accept(t, False)
                    else:  # (XGrammarMatcher.accept_token, inline)
                        state = guard.next_state(t)
                        ok = state != INVALID and m._accept(t, False)
                        if ok:
                            guard.push(state)
                    if ok and t in stops:
                        m._terminated = m._matcher.is_terminated()
                else:
                    ok = m.accept_token(t)
            except Exception as e:
                append(e)
                continue
            append(bool(ok))
        return results

    @staticmethod
    def ffi_matcher_type() -> type:
        """xgrammar's FFI matcher class, whose methods the native host build calls.

        Raises:
            NativeBuildError: this xgrammar exposes none.
        """
        ffi_type = getattr(getattr(xgr.matcher, "_core", None), "GrammarMatcher", None)
        if ffi_type is None:
            raise NativeBuildError("this xgrammar exposes no FFI matcher type "
                                   "(xgrammar.matcher._core.GrammarMatcher)")
        return ffi_type

    @staticmethod
    def matcher_type() -> type:
        """The matcher class this factory creates."""
        return XGrammarMatcher

    def native_handles(self, matchers: Sequence[GrammarMatcher]) -> list | None:
        """The FFI object of every plain ``XGrammarMatcher`` (or of the one a matcher forwards
        to, its ``delegate``); None if one of ``matchers`` is a subclass or wrapper that must
        run its own methods, or xgrammar exposes no FFI object."""
        handles = [m.native_handle() if type(m) is XGrammarMatcher  # type: ignore[attr-defined]
                   else _delegate_handle(m) for m in matchers]
        return None if None in handles else handles

    def batch_fill(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                   indices: Sequence[int]) -> None:
        """One call into xgrammar's batch matcher: threads in C++, GIL released."""
        if not matchers:
            return
        if len(matchers) == 1 or any(type(m) is not XGrammarMatcher for m in matchers):
            # one row: the thread hand-off would cost more than it saves; subclasses or
            # wrappers: their own methods must run
            super().batch_fill(matchers, bitmask, indices)
            return
        # the FFI objects as they are: xgrammar's batch fill never reads a UTF-8 guard (the
        # rows are guarded below), so no guard is handed to the C++ builds here
        handles = [m._handle for m in matchers]  # type: ignore[attr-defined]
        if None not in handles and self._batch_fill_ffi is not None:
            self._batch_fill_ffi(handles, bitmask, list(indices), False)
        else:  # an xgrammar without the FFI objects: its Python batch call, threads all the same
            self._batch.batch_fill_next_token_bitmask(
                [m._matcher for m in matchers], bitmask, list(indices))  # type: ignore[attr-defined]
        if self.utf8 is not None:
            self.utf8.mask_rows(bitmask.numpy(), indices,
                                [m._guard for m in matchers])  # type: ignore[attr-defined]
