"""Guides whose constructs a backend would ignore or mis-enforce: refused with
UnsupportedGuideError (Lark ``%json`` schemas and token references on llguidance, EBNF
lookaheads and a structural tag's regex / grammar elements on xgrammar), or prepared so that
they mean what capgraph documents (a tag's JSON schemas; a stop token that is ordinary text
on llguidance). Each is driven token by token through the public decoder."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from capgraph import GuidedDecodingConfig, GuidedDecodingParams
from capgraph.decoder import GuidedDecoder
from capgraph.errors import UnsupportedGuideError
from capgraph.grammar import create_matcher_factory
from capgraph.requests import GuidedRequest
from capgraph.tokenizers import encode_continuation

pytest.importorskip("llguidance")

P = GuidedDecodingParams



@pytest.fixture(scope="module")
def llg(factory_cache):
    return factory_cache("tekken", "llguidance")


@pytest.fixture(scope="module")
def llg_ignore(llg):
    return create_matcher_factory(dataclasses.replace(llg.config,
                                                      json_unenforced_keywords="ignore"))


class RequestFailed(Exception):
    """The decoder reported the request failed (its message: the error's type and text)."""


def drive(factory, params: GuidedDecodingParams, ids: list[int]) -> list[bool]:
    """Feed ``ids`` through a GuidedDecoder one step each; for every id, whether the masked
    row allowed it, then (last) whether the stop token is allowed after them all. Stops at the
    first id the mask refuses. A request that fails raises RequestFailed."""
    config = factory.config
    decoder = GuidedDecoder(config, max_num_sequences=1, factory=factory)
    stop = config.stop_token_ids[0]
    allowed: list[bool] = []
    try:
        decoder.add_batch([GuidedRequest.context(request_id=1, seq_slot=0, params=params)])
        for k in range(len(ids) + 1):
            logits = torch.zeros(1, config.vocab_size_padded)
            failed = decoder.execute(logits)
            if failed:
                raise RequestFailed(failed[0][1])
            if k == len(ids):
                allowed.append(bool(torch.isfinite(logits[0, stop])))
                break
            allowed.append(bool(torch.isfinite(logits[0, ids[k]])))
            if not allowed[-1]:
                break
            decoder.add_batch([GuidedRequest.generation(1, 0, params, new_token=ids[k])])
    finally:
        decoder.close()
    return allowed


def text_ids(factory, text: str) -> list[int]:
    return encode_continuation(factory.config.tokenizer, text)


def tag(fmt: dict) -> GuidedDecodingParams:
    return P.structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))


# --- llguidance: Lark %json schemas ----------------------------------------------------------

@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 5}, "x-guidance": {"lenient": True}}, "contains"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}],
      "x-guidance": {"coerce_one_of": True}}, "x-guidance"),
])
def test_lark_json_schema_follows_the_keyword_policy(llg, llg_ignore, schema, keyword):
    """A %json schema in a Lark grammar is judged like a JSON_SCHEMA guide: llguidance's
    x-guidance options (which drop keywords) and keywords it does not enforce are refused,
    naming them and the line; "ignore" lets it through."""
    grammar = "// a JSON value\nstart: %json " + json.dumps(schema)
    with pytest.raises(RequestFailed, match=rf"UnsupportedGuideError: .*%json schema at line 2: .*'{keyword}'"):
        drive(llg, P.ebnf(grammar), [])
    llg_ignore.compile(P.ebnf(grammar))


def test_lark_json_warning_refuses_where_the_policy_passes(llg, monkeypatch):
    """llguidance's own compile warnings refuse a Lark grammar (the second net, as for a
    JSON_SCHEMA guide): with the keyword policy passing everything, a lenient %json schema
    is still refused."""
    import capgraph.grammar.llguidance_backend as backend
    monkeypatch.setattr(backend, "unenforced_in_text", lambda *a, **k: [])
    grammar = 'start: "n=" %json {"type": "array", "uniqueItems": true, ' \
              '"x-guidance": {"lenient": true}}'
    with pytest.raises(UnsupportedGuideError, match="llguidance reported: .*uniqueItems"):
        llg.compile(P.ebnf(grammar))


def test_lark_json_schema_means_what_xgrammar_reads(llg):
    """A %json schema is given to llguidance as a JSON_SCHEMA guide is: properties it does
    not list are absent (llguidance's own default allows them)."""
    grammar = 'start: "v=" %json {"type": "object", "properties": {"a": {"type": "integer"}}}'
    assert all(drive(llg, P.ebnf(grammar), text_ids(llg, 'v={"a": 1}')))
    steps = drive(llg, P.ebnf(grammar), text_ids(llg, 'v={"a": 1, "b": 2}'))
    assert not all(steps)


# --- llguidance: Lark token references -------------------------------------------------------

@pytest.mark.parametrize("reference, named", [
    ("<[3]>", "[INST]"), ("<[0-5]>", "<unk>"), ("<[1000,2-4]>", "</s>"),
    ("<[^5]>", "<unk>"), ("<[*]>", "<unk>"), ("<s>", "s"), ("<[2]>", "</s>"),
])
def test_lark_token_reference_to_a_special_token_is_refused(llg, reference, named):
    """A Lark token reference that may place a special token (by id, range, negated range,
    wildcard or name), the stop token included, is refused naming it; without the check
    llguidance lets [INST] (id 3) through."""
    grammar = f'start: "a" {reference} "b"'
    with pytest.raises(RequestFailed, match=r"UnsupportedGuideError: .*token reference .* at line 1 .*"
                       + json.dumps(named)[1:-1].replace("[", r"\[").replace("]", r"\]")):
        drive(llg, P.ebnf(grammar), [1097, 3, 1098])


def test_lark_text_that_spells_a_reference_is_text(llg):
    """A string literal, a regex, a comment and a %json value that spell a reference are not
    one (the grammar compiles), and a reference to an ordinary token places it."""
    grammar = ('start: "<[3]>" /[<]s>/ <[1097]> // <[3]>\n'
               'other: %json {"const": "<[3]>"}')
    matcher = llg.create(P.ebnf(grammar))
    for token in [*text_ids(llg, "<[3]><s>"), 1097, llg.config.stop_token_ids[0]]:
        assert matcher.accept_token(token)


@pytest.mark.parametrize("hidden", ["\x1c", "\x1d", "\x1e", "\x1f"])
def test_text_python_reads_as_whitespace_hides_no_reference(llg, hidden):
    """llguidance reads ``<q\x1c/>`` as one token reference (U+001C-U+001F are no Unicode
    White_Space); read with Python's ``\\s`` it ended there, its ``/`` then opened a regex
    literal that hid the next line's ``<[3]>`` (and any %json or %llguidance) from every
    check, and [INST] went through. capgraph reads the text as llguidance's lexer does."""
    grammar = f'start: "a" b\nunused: <q{hidden}/>\nb: <[3]> "/"\n'
    with pytest.raises(RequestFailed, match="UnsupportedGuideError: .*token reference"):
        drive(llg, P.ebnf(grammar), [1097, 3])


def test_lark_text_llguidance_cannot_read_is_a_compile_error(llg):
    """Text where no lexeme of llguidance's Lark lexer starts is refused with the place (a
    reader that skipped it could be shown less than llguidance reads), in time linear in the
    text: an unclosed regex of 40,000 escaped slashes read for 37 s, rescanned from every
    slash."""
    import time
    from capgraph.errors import GrammarCompileError
    from capgraph.grammar.lark_text import LarkTextError, lark_token_refs
    for bad, where in (('start: "a" $', "line 1, column 12"), ('start: "a"\n  ^x', "line 2"),
                       ('start: "a\\q"', "line 1")):
        with pytest.raises(LarkTextError, match=where):
            lark_token_refs(bad)
        with pytest.raises(GrammarCompileError, match="cannot be read"):
            llg.compile(P.ebnf(bad))
    slashes = 'start: "a"\nx: /' + "\\/" * 40_000
    start = time.perf_counter()
    with pytest.raises(LarkTextError):
        lark_token_refs(slashes)
    assert time.perf_counter() - start < 5


def test_lark_reader_reads_what_llguidances_lexer_reads():
    """On random text of Lark's pieces (comments, strings, regex literals, references,
    directives, escapes, U+001C and U+00A0 among them), the reader fails exactly where
    llguidance's lexer does (its 'lexer error'); where llguidance fails reading a
    directive's JSON value (serde is stricter than Python's decoder), the grammar is refused
    by llguidance itself, so only that way round may the reader read more."""
    import random
    import llguidance
    from capgraph.grammar.lark_text import LarkTextError, lark_regexes
    rng = random.Random(5)
    pieces = ["start", ":", " ", "\n", '"a"', '"', "\\", "/", "x", "X", "<", ">", "[", "]",
              "%json", "{}", "#", "//", "%llguidance", "\x1c", "\t", "\r", "-", "+", "1", ".",
              "..", "|", "*", "?", "~", "@g", "_", "!", "%regex", "(", ")", ",", "=", "\u00a0",
              "é", "&", "0x1f", '\\"', "\\/", ";", "$", "'"]
    for _ in range(3000):
        text = "start: " + "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12)))
        try:
            lark_regexes(text)  # (reads every lexeme; a malformed <[...]> is the compile's)
            read = True
        except LarkTextError:
            read = False
        error = llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_lark(text))
        if "lexer error" in error:
            assert not read, text
        elif "failed to parse" not in error:
            assert read, (text, error)


def test_lark_token_ranges_read_as_llguidance_reads_them():
    """A range end may carry a '+' (Rust's u32 parse takes it); a digit that is not ASCII,
    or a number past u32, is malformed (LarkTextError, not a ValueError)."""
    from capgraph.grammar.lark_text import LarkTextError, lark_token_refs
    refs = lark_token_refs("start: <[+1097]> <[5-+9,12]> <[7]>")
    assert [r.ranges for r in refs] == [((1097, 1097),), ((5, 9), (12, 12)), ((7, 7),)]
    for bad in ("<[\u00b2]>", "<[\u0663]>", "<[4294967296]>", "<[1-2-3]>"):
        with pytest.raises(LarkTextError, match="malformed"):
            lark_token_refs(f"start: {bad}")


def test_lark_json_true_takes_the_whitespace_setting(llg):
    """``%json true`` (any value) follows json_whitespace as ``%json {}`` does: compact refuses
    a spaced value (``true`` was given to llguidance as is, which applies options to object
    schemas only); a JSON_SCHEMA guide ``true`` compiles."""
    compact = create_matcher_factory(dataclasses.replace(llg.config, json_whitespace="compact"))
    for grammar in ("start: %json true", "start: %json {}"):
        assert all(drive(compact, P.ebnf(grammar), text_ids(llg, '{"a":[1,2]}')))
        assert not all(drive(compact, P.ebnf(grammar), text_ids(llg, '{ "a" : [1, 2] }')))
    compact.compile(P.json_schema("true"))


def test_tag_lark_grammar_capgraph_cannot_read_is_refused(xg):
    """On xgrammar, a structural tag's Lark grammar element is read as llguidance's lexer
    reads it to check its %json schemas and regexes; text that reader cannot read is refused
    (it could hide a %json from the check), naming the element."""
    grammar = 'start: "a" b\nb: %json {"type": "string"} $'
    with pytest.raises(UnsupportedGuideError, match="cannot read the Lark grammar of the "
                       "grammar element at /format .*line 2"):
        xg.compile(tag({"type": "grammar", "syntax": "lark", "grammar": grammar}))


# --- llguidance: %llguidance options -------------------------------------------------------

def test_llguidance_allow_invalid_utf8_is_refused(llg, llg_ignore):
    """%llguidance {"allow_invalid_utf8": true} makes llguidance's regexes match bytes: /.+/
    then lets [INST] (id 3) and the other special tokens through. Refused whatever
    json_unenforced_keywords says, naming the option and its line."""
    grammar = '// bytes\n%llguidance {"allow_invalid_utf8": true}\nstart: /.+/'
    for factory in (llg, llg_ignore):
        with pytest.raises(RequestFailed, match="UnsupportedGuideError: .*%llguidance options "
                           "at line 2 .*allow_invalid_utf8.*special tokens"):
            drive(factory, P.ebnf(grammar), [1097, 3])
    assert drive(llg, P.ebnf('%llguidance {"allow_invalid_utf8": false}\nstart: /.+/'),
                 [1097, 3]) == [True, False]


def test_llguidance_unknown_option_is_refused(llg):
    """An option name llguidance does not know (it would ignore it: a misspelt option) is
    refused naming it; the options it knows, other than allow_invalid_utf8, compile, and text
    that spells the directive inside a string is text."""
    with pytest.raises(RequestFailed, match="UnsupportedGuideError: .*'no_forcin'.*does not "
                       "know.*no_forcing"):
        drive(llg, P.ebnf('%llguidance {"no_forcin": true}\nstart: "ab"'), [])
    with pytest.raises(RequestFailed, match="GrammarCompileError: .*not a JSON object"):
        drive(llg, P.ebnf('%llguidance [1]\nstart: "ab"'), [])
    ok = '%llguidance {"no_forcing": true, "allow_initial_skip": true}\nstart: "ab" /%llguidance/'
    assert all(drive(llg, P.ebnf(ok), text_ids(llg, "ab%llguidance")))
    once = '%llguidance {"ignore_once": true}\nstart: "a" "b"\n%ignore " "'
    assert all(drive(llg, P.ebnf(once), text_ids(llg, "a b")))


# --- xgrammar: EBNF lookaheads ---------------------------------------------------------------

def test_ebnf_lookahead_is_refused(xg, xg_ignore):
    """xgrammar does not enforce a rule's lookahead ('xd' passes for a "x" (= "c")): an EBNF
    guide or a tag's grammar element with one is refused, whatever json_unenforced_keywords
    says; "(=" as text is not a lookahead."""
    grammar = 'root ::= a "d"\na ::= "x" (= "c")'
    for factory in (xg, xg_ignore):
        with pytest.raises(RequestFailed, match="UnsupportedGuideError: .*lookahead assertion .* rule 'a'"):
            drive(factory, P.ebnf(grammar), text_ids(xg, "xd"))
        with pytest.raises(RequestFailed, match="UnsupportedGuideError: .*rule 'a' in the grammar element"):
            drive(factory, tag({"type": "grammar", "grammar": grammar}), text_ids(xg, "xd"))
    assert all(drive(xg, P.ebnf('root ::= "(=" [(=] "x"'), text_ids(xg, "(==x")))


# --- xgrammar: a structural tag's JSON schemas and regex elements ----------------------------

@pytest.mark.parametrize("fmt, text, invalid", [
    ({"type": "tag", "begin": "<f>", "content": {
        "type": "json_schema", "json_schema": {"type": "array", "maxItems": 3}},
      "end": "</f>"}, "<f>[1, 2]</f>", "<f>[1, 2, 3, 4]</f>"),
    ({"type": "tag", "begin": "<f>", "content": {
        "type": "json_schema", "json_schema": {"type": "object", "maxProperties": 1}},
      "end": "</f>"}, '<f>{"a": 1}</f>', '<f>{"a": 1, "b": 2}</f>'),
    ({"type": "qwen_xml_parameter", "json_schema": {
        "type": "object", "properties": {"a": {"type": "array", "maxItems": 3}},
        "required": ["a"]}}, "<parameter=a>[1, 2]</parameter>",
     "<parameter=a>[1, 2, 3, 4]</parameter>"),
])
def test_tag_schema_that_lists_no_items_allows_any(xg, fmt, text, invalid):
    """A tag's JSON schema is prepared as a JSON_SCHEMA guide is: an array / object schema
    that lists no items / properties allows any (xgrammar alone admits only [] / {}), and its
    bounds hold."""
    assert all(drive(xg, tag(fmt), text_ids(xg, text)))
    assert not all(drive(xg, tag(fmt), text_ids(xg, invalid)))


def test_tag_regex_element_xgrammar_ignores_is_refused_under_ignore(xg_ignore):
    """A tag's regex element whose '^' xgrammar drops is refused even with
    json_unenforced_keywords="ignore" (as a REGEX guide is); a JSON-schema keyword xgrammar
    does not enforce still follows the setting."""
    with pytest.raises(RequestFailed, match="UnsupportedGuideError: .*regex element at /format/content"):
        drive(xg_ignore, tag({"type": "tag", "begin": "<r>",
                              "content": {"type": "regex", "pattern": "a^b"}, "end": "</r>"}),
              text_ids(xg_ignore, "<r>ab</r>"))
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    assert all(drive(xg_ignore, tag({"type": "json_schema", "json_schema": schema}),
                     text_ids(xg_ignore, "[1, 1]")))


# --- llguidance: a stop token that is ordinary text ------------------------------------------

@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_text_stop_token_is_allowed_only_where_the_output_may_end(tekken, backend):
    """A stop token that is ordinary text ('"', id 1034) is allowed only where the output may
    end, on both backends: llguidance alone allows it wherever its text fits, then refuses it
    there as the end, failing the request."""
    stop = tekken.convert_tokens_to_ids('"')
    config = GuidedDecodingConfig.from_tokenizer(tekken, backend=backend, stop_token_ids=[stop])
    factory = create_matcher_factory(config)
    schema = P.json_schema({"type": "object", "properties": {"a": {"type": "string"}},
                            "required": ["a"]})
    ids = text_ids(factory, '{"a": "x')
    assert drive(factory, schema, [*ids, stop]) == [True] * len(ids) + [False]
    ids = text_ids(factory, '{"a": "x"}')
    assert stop not in ids
    assert drive(factory, schema, ids) == [True] * (len(ids) + 1)
    factory.close()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_text_stop_token_never_completes_a_guide_as_text(tekken, backend):
    """A stop token that is ordinary text ('a') whose text would complete the guide ('ba')
    is never taken as that text: the output ends before the stop token, so 'b' + stop would
    leave 'b', outside the guide. llguidance refuses 'b' (no other token spells the 'a');
    xgrammar allows 'b' and then fails the request at the dead end. Before, xgrammar allowed
    the stop token after 'b' and the matcher ended there."""
    if backend == "llguidance":
        pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
    stop = tekken.convert_tokens_to_ids("a")
    b, ba = tekken.convert_tokens_to_ids("b"), tekken.convert_tokens_to_ids("ba")
    config = GuidedDecodingConfig.from_tokenizer(tekken, backend=backend, stop_token_ids=[stop])
    factory = create_matcher_factory(config)
    regex = P.regex("ba")
    try:
        assert drive(factory, regex, [b, stop]) == [False]
    except RequestFailed as e:
        assert backend == "xgrammar" and "DeadEndError" in str(e)
    assert drive(factory, regex, [ba]) == [True, True]
    factory.close()


# --- xgrammar: structural-tag elements its converter drops or cannot take ---------------------

_HELLO = 29706  # ("hello" on Tekken: an ordinary token, excluded by id)
_STRING_EXCLUDES = {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
    "type": "json_schema", "excludes": ["bad"], "json_schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}},
        "required": ["a"]}}}


@pytest.mark.parametrize("fmt, said", [
    ({"type": "repeat", "min": 2, "max": 2,
      "content": {"type": "exclude_token", "exclude_tokens": [_HELLO]}},
     "exclude_token element at /format/content is inside a repeat"),
    ({"type": "repeat", "min": 1, "max": 3, "content": {
        "type": "sequence", "elements": [
            {"type": "any_tokens", "exclude_tokens": [_HELLO]}]}},
     "any_tokens element at /format/content/elements/0 is inside a repeat"),
    (_STRING_EXCLUDES, "excludes of the element at /format/content would not apply"),
], ids=["exclude_token", "any_tokens", "json_schema_excludes"])
def test_tag_elements_xgrammar_converts_without_their_exclusions_are_refused(
        factory_cache, fmt, said):
    """xgrammar 0.2.9 drops the excluded tokens of an exclude_token / any_tokens inside a
    repeat (its row would allow "hello" twice), and a json_schema element's excludes on
    strings with a pattern or format (it would let "bad" be written): refused, naming the
    element."""
    with pytest.raises(UnsupportedGuideError, match=said):
        factory_cache("tekken").compile(tag(fmt))


def test_excludes_beside_names_or_values_that_read_like_keywords_compile(factory_cache):
    """A json_schema element's excludes is refused only for strings with a pattern or format:
    a property named "format", a const object with a "pattern" key or an integer's format
    leave it served."""
    schema = {"type": "object", "properties": {
        "format": {"type": "string"}, "n": {"type": "integer", "format": "int32"},
        "c": {"const": {"pattern": "x"}}}, "required": ["format"]}
    factory_cache("tekken").compile(tag({"type": "tag", "begin": "<a>", "end": "</a>",
                                         "content": {"type": "json_schema",
                                                     "excludes": ["bad"],
                                                     "json_schema": schema}}))


def test_tag_elements_outside_a_repeat_keep_their_exclusions(factory_cache):
    """The same exclusions outside a repeat, and excludes on a plain string, compile and
    hold: the excluded token and the excluded string are not allowed."""
    factory = factory_cache("tekken")
    assert drive(factory, tag({"type": "exclude_token", "exclude_tokens": [_HELLO]}),
                 [_HELLO]) == [False]
    plain = json.loads(json.dumps(_STRING_EXCLUDES))
    del plain["content"]["json_schema"]["properties"]["a"]["pattern"]
    allowed = drive(factory, tag(plain), text_ids(factory, '<a>{"a": "bad"}</a>'))
    assert False in allowed  # (a token of it refused, or the end after it)


_DISPATCH_CHILD = r'''
import json
from capgraph import GuidedDecodingConfig, GuidedDecodingParams
from capgraph.errors import UnsupportedGuideError
from capgraph.grammar import create_matcher_factory
from capgraph.tokenizers import load_tokenizer
factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(load_tokenizer("tekken")))
fmt = {"type": "repeat", "min": 1, "max": 1, "content": {
    "type": "token_dispatch", "rules": [[1000, {"type": "const_string", "value": "z"}]],
    "exclude_tokens": [1001]}}
try:
    factory.compile(GuidedDecodingParams.structural_tag(
        json.dumps({"type": "structural_tag", "format": fmt})))
except UnsupportedGuideError as e:
    print("REFUSED", e)
'''


def test_a_token_dispatch_inside_a_repeat_is_refused_before_it_crashes_the_converter():
    """xgrammar's converter crashes (SIGSEGV, the whole process) on a token_dispatch inside a
    repeat: the guide is refused before it gets there (run in a child process)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _DISPATCH_CHILD], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "REFUSED" in done.stdout and "token_dispatch element" in done.stdout
