"""llguidance and Lark guides. llguidance does not force bytes for a Lark guide: a lexeme that
may end or go on before one that starts the same way (``start: /a+/ "a"``) sent llguidance
1.9.1's forcing into a loop that never ends (the compile's first mask never returned;
``compute_ff_bytes`` held the GIL while its memory grew). Such guides now compile and serve,
and their forced bytes are read from masks, bounded. A lazy rule matching the empty text
(which llguidance reads as one character) is refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from capgraph import GuidedDecodingParams, UnsupportedGuideError
from capgraph.grammar.llguidance_backend import MAX_FORCED_MASKS
from capgraph.tokenizers import encode_continuation

pytest.importorskip("llguidance", reason="the llguidance extra is not installed")

#: grammars whose forcing never ended, each with a text it takes
ENDLESS_FORCING = [('start: /a+/ "a"', "aaa"), ('start: / +/ " "', "   "),
                   ('start: /ab+/ "b"', "abb"), ('start: x* "a"\nx: /a+/', "aa")]


def test_guides_whose_forcing_never_ended_compile_and_serve():
    """In a fresh process (a hang there cannot hang this one): each grammar compiles on
    llguidance, its matcher takes a text token by token with a mask filled before each
    token, and forced_bytes returns, all well within the timeout."""
    script = textwrap.dedent(f"""
        from capgraph import GuidedDecodingConfig, GuidedDecodingParams
        from capgraph.bitmask import allocate_host_bitmask
        from capgraph.grammar import create_matcher_factory
        from capgraph.tokenizers import encode_continuation, load_tokenizer
        tok = load_tokenizer("tekken")
        f = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tok, backend="llguidance"))
        mask = allocate_host_bitmask(1, f.config.vocab_size_padded)
        for grammar, text in {ENDLESS_FORCING!r}:
            m = f.create(GuidedDecodingParams.ebnf(grammar))
            for t in encode_continuation(tok, text):
                m.fill_next_token_bitmask(mask, 0)
                assert m.accept_token(t), (grammar, text)
            m.fill_next_token_bitmask(mask, 0)
            m.forced_bytes(256)
            print("served", repr(grammar))
        f.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("served") == len(ENDLESS_FORCING)


@pytest.mark.parametrize("lark, gbnf, prefix", [
    ('start: "hello" /[0-9]+/ " world"', 'root ::= "hello" [0-9]+ " world"', ""),
    ('start: "hello" /[0-9]+/ " world"', 'root ::= "hello" [0-9]+ " world"', "hello1"),
    ('start: "ab" | "ac"', 'root ::= "ab" | "ac"', ""),
    ('start: "{\\"key\\": " /[0-9]/ "}"', 'root ::= "{\\"key\\": " [0-9] "}"', '{"key": 7'),
])
def test_lark_forced_bytes_are_read_from_masks(factory_cache, tekken, lark, gbnf, prefix):
    """A Lark guide's forced bytes on llguidance (read from its masks) are xgrammar's for
    the same grammar, and reading them leaves the matcher where it was."""
    llg, xg = factory_cache("tekken", "llguidance"), factory_cache("tekken")
    got = []
    for factory, guide in ((llg, lark), (xg, gbnf)):
        matcher = factory.create(GuidedDecodingParams.ebnf(guide))
        for t in encode_continuation(tekken, prefix):
            assert matcher.accept_token(t)
        got.append(matcher.forced_bytes(64))
        assert matcher.forced_bytes(64) == got[-1]  # the state is unchanged
    assert got[0] == got[1]


def test_lark_forced_bytes_read_a_bounded_number_of_masks(factory_cache, tekken):
    """A Lark guide forcing long text gives at most MAX_FORCED_MASKS tokens' worth of it,
    however many bytes are asked for; a JSON-schema guide keeps llguidance's own forcing."""
    llg = factory_cache("tekken", "llguidance")
    text = "x y " * 100
    matcher = llg.create(GuidedDecodingParams.ebnf(f'start: "{text}" "!"'))
    forced = matcher.forced_bytes(10_000)
    assert forced and text.encode().startswith(forced)
    # one mask per token, each token a few bytes: far from the 400 bytes forced
    assert len(forced) <= MAX_FORCED_MASKS * 4 < len(text)
    schema = llg.create(GuidedDecodingParams.json_schema(
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}))
    assert schema.forced_bytes(64).startswith(b'{')


@pytest.mark.parametrize("rule", [
    "r[lazy]: /[a-z]*/", "r[lazy]: /[a-z]?/", "r[capture, lazy]: /x*/  // a comment",
    # however the empty match is written (each of these was let through)
    "r[lazy]: R\nR: /[a-z]*/", "r[lazy]: (/[a-z]*/)", "r[lazy]: /[a-z]*/ \"\"",
    "r[lazy]: /\\p{Ll}*/", "r[lazy]:\n  | /[a-z]*/", "r[lazy]: \"a\" | [\"b\"]",
    "r[lazy]: \"a\"~0..2", "r[lazy, max_tokens=4]: s s\ns: \"a\"?",
])
def test_lazy_rule_matching_the_empty_text_is_refused(factory_cache, rule):
    """llguidance documents a lazy lexeme as matching as few bytes as possible; for one that
    matches the empty text it takes one character (``"<" r ">"`` accepted ``<a>``): refused by
    name, with the rule and its line, whether the empty match is the rule's one regex or comes
    through a terminal, a group, an alternative, an optional part or a repeat."""
    with pytest.raises(UnsupportedGuideError, match=r"lazy rule 'r' at line 2 .* empty text"):
        factory_cache("tekken", "llguidance").compile(
            GuidedDecodingParams.ebnf(f'start: "<" r ">"\n{rule}'))
    named = rule.replace("r[", "my-r[", 1)
    with pytest.raises(UnsupportedGuideError, match=r"lazy rule 'my-r' at line 2 .* empty"):
        factory_cache("tekken", "llguidance").compile(
            GuidedDecodingParams.ebnf(f'start: "<" my-r ">"\n{named}'))


def test_lazy_rule_capgraph_cannot_judge_is_refused(factory_cache):
    """A lazy rule whose body capgraph cannot show is never empty (a %regex value) is
    refused, saying so."""
    with pytest.raises(UnsupportedGuideError, match=r"lazy rule 'r' .* cannot tell"):
        factory_cache("tekken", "llguidance").compile(GuidedDecodingParams.ebnf(
            'start: "<" r ">"\nr[lazy]: %regex {"substring_words": "a b"}'))


def test_lazy_rule_matching_text_and_stop_rules_compile(factory_cache, tekken):
    """A lazy rule that must match a character, and a rule with a stop string, compile."""
    from cases import accepts
    factory = factory_cache("tekken", "llguidance")
    lazy = GuidedDecodingParams.ebnf('start: "<" r ">"\nr[lazy]: /[a-z]+/')
    assert accepts(factory, tekken, lazy, "<a>") and not accepts(factory, tekken, lazy, "<>")
    factory.compile(GuidedDecodingParams.ebnf('start: foo\nfoo[stop=""]: /.*/'))
    factory.compile(GuidedDecodingParams.ebnf('start: foo "x"\nfoo[stop="x"]: /.*/'))
    tools = GuidedDecodingParams.ebnf(  # (llguidance's own tool-calling example's shape)
        'start: f* TEXT\nhead[lazy]: TEXT "<f>"\nf: head %json {"type": "integer"} "</f>"\n'
        'TEXT: /(.|\\n)*/')
    assert accepts(factory, tekken, tools, "hi <f>12</f> bye")
