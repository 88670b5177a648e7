"""Other engines' structured-output test cases through capgraph (``tools/engine_cases.py``):
the readers of their test files, the oracle, the verdicts, and the bundled vLLM / SGLang cases
on every backend (no invalid string accepted, no crash)."""

from __future__ import annotations

import json

import pytest

from conftest import load_tool

pytest.importorskip("llguidance", reason="the llguidance extra is not installed")

ec = load_tool("engine_cases")
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def factories(tekken):
    built = ec.suite.make_factories(tekken, ec.BACKENDS, TIMEOUT_S)
    yield built
    for factory in built.values():
        factory.close()


def test_bundled_cases_accept_no_invalid_string(factories, tekken):
    """The vLLM and SGLang guides of ``tests/data/engine_cases/serving_engines.json`` on every
    backend: each compiles or is refused by name, no invalid string gets through, and the check
    is not vacuous (most valid strings taken, every invalid one refused on xgrammar)."""
    cases = ec.load_bundled()
    assert len(cases) >= 20 and all("@" in c.source for c in cases)  # each names its commit
    for backend, factory in factories.items():
        tally = ec.Tally()
        for case in cases:
            tally.add(ec.run_case(factory, tekken, case, TIMEOUT_S))
        assert not tally.crashes, (backend, tally.crashes)
        assert not tally.invalid_accepted, (backend, tally.invalid_accepted)
        assert tally.cases == tally.compiled + tally.refused + tally.compile_errors
        if backend != "llguidance":  # (llguidance reads Lark: the GBNF guides do not compile)
            assert tally.compiled == len(cases)
            assert tally.valid_accepted >= 30 and tally.invalid_refused >= 70, backend


def test_an_invalid_string_accepted_is_reported(factories, tekken):
    """The verdict path: a string the engine marks invalid (no oracle for an EBNF grammar
    without one) that the guide takes is listed; the oracle decides where there is one, and a
    disagreement with the engine is listed as disputed."""
    case = ec.Case("ebnf", 'root ::= "a" | "b"', "probe",
                   [ec.Instance(text="a", expected=False), ec.Instance(text="c", expected=False),
                    ec.Instance(text="b", expected=True)])
    tally = ec.run_case(factories["xgrammar"], tekken, case)
    assert tally.invalid_accepted == ["probe ebnf 'root ::= \"a\" | \"b\"' / 'a': accepted 'a'"]
    assert (tally.invalid_refused, tally.valid_accepted) == (1, 1) and not tally.ok
    regex = ec.Case("regex", "[0-9]+", "probe", [ec.Instance(text="12", expected=False)])
    tally = ec.run_case(factories["xgrammar"], tekken, regex)
    assert tally.ok and tally.valid_accepted == 1 and len(tally.disputed) == 1


def test_oracle():
    """JSON-schema strings: parsed strictly and validated with the format assertion on (a
    format-only failure says so); JSON mode: an object or array; a regex: ``re.fullmatch`` with
    ASCII classes."""
    schema = ec.Case("json_schema", json.dumps({"type": "string", "format": "date"}), "s")
    assert ec.oracle(schema, ec.Instance(text='"2020-01-31"')) == (True, False)
    assert ec.oracle(schema, ec.Instance(text='"2020-02-31"')) == (False, True)
    assert ec.oracle(schema, ec.Instance(text="3")) == (False, False)
    assert ec.oracle(schema, ec.Instance(text='"x" "y"')) == (False, False)
    number = ec.Case("json_schema", '{"type": "number"}', "s")
    assert ec.oracle(number, ec.Instance(text="NaN")) == (False, False)
    mode = ec.Case("json", "", "s")
    assert ec.oracle(mode, ec.Instance(text="[1]"))[0] and not ec.oracle(
        mode, ec.Instance(text="1"))[0]
    regex = ec.Case("regex", r"\d+", "s")
    assert ec.oracle(regex, ec.Instance(text="12"))[0]
    assert ec.oracle(regex, ec.Instance(text="\uff11"))[0] is False  # ECMA's \d is ASCII
    assert ec.oracle(ec.Case("ebnf", 'root ::= "a"', "s"), ec.Instance(text="a")) == (None, False)


def test_outlines_core_reader(tmp_path):
    """Tuples (schema, regex, matches, non-matches) of a Rust test file, raw and escaped
    strings alike; tuples of another shape are skipped."""
    folder = tmp_path / "src" / "json_schema"
    folder.mkdir(parents=True)
    (folder / "mod.rs").write_text(r'''
    fn t() {
        for (schema, regex, a_match, not_a_match) in [
            (
                r#"{"type": "integer"}"#,
                INTEGER,
                vec!["0", "-1"], // a comment "with a quote"
                vec!["01", "a\"b\u{41}"],
            ),
            (format!("x"), "y", vec![], vec![]),
        ] {}
    }''')
    [case] = ec.load_outlines_core(tmp_path)
    assert (case.kind, json.loads(case.guide)) == ("json_schema", {"type": "integer"})
    assert [(i.text, i.expected) for i in case.instances] == [
        ("0", True), ("-1", True), ("01", False), ('a"bA', False)]
    assert case.source.endswith("mod.rs:4")  # the line of the tuple


def test_llguidance_reader(tmp_path):
    """In each test function: the schemas it checks (``let schema``, a static it names) against
    its ``json!`` values and string cases; a ``json!`` holding a Rust expression is skipped."""
    folder = tmp_path / "parser" / "tests"
    folder.mkdir(parents=True)
    (folder / "test_json_x.rs").write_text(r'''
lazy_static! {
    static ref S: Value = json!({"type": "object", "required": ["a"],});
}
#[rstest]
#[case(&json!({"a": 1}))]
#[case(&json!({"b": 1}))]
fn objects(#[case] v: &Value) {
    json_schema_check(&S, v, true);
}
#[rstest]
#[case("2020-01-01")]
fn dates(#[case] s: &str) {
    let schema = json!({"type": "string", "format": "date"});
    json_schema_check(&schema, &json!(s), true);
    let other = json!({"minimum": lower_bound});
}
''')
    cases = {json.loads(c.guide)["type"]: c for c in ec.load_llguidance(tmp_path)}
    assert [i.value for i in cases["object"].instances] == [{"a": 1}, {"b": 1}]
    assert [i.value for i in cases["string"].instances] == ["2020-01-01"]
    assert all(i.expected is None for c in cases.values() for i in c.instances)


def test_xgrammar_reader(tmp_path):
    """Parametrize tables (module-level or inline), asserts on literal grammars, and the
    compile refusals of an xgrammar test file, read without importing it; a grammar with
    another root rule is skipped."""
    folder = tmp_path / "tests" / "python"
    folder.mkdir(parents=True)
    (folder / "test_grammar_matcher_regex.py").write_text(r'''
import pytest
ROWS = [(r"a{2}", "aa", True), (r"a{2}", "a", False)]

@pytest.mark.parametrize("regex_string, instance, is_accepted", ROWS)
def test_a(regex_string, instance, is_accepted):
    pass

@pytest.mark.parametrize("schema, accepted_instances, rejected_instances",
                         [({"type": "integer"}, [1], ["x", 1.5])])
def test_b(schema, accepted_instances, rejected_instances):
    pass

@pytest.mark.parametrize("regex_input_refused", ["a{3,2}"])
def test_c(regex_input_refused):
    pass

def test_d():
    g = xgr.Grammar.from_ebnf('root ::= "b"')
    assert _is_grammar_accept_string(g, "b")
    assert not _is_grammar_accept_string(g, "bb")
    h = xgr.Grammar.from_ebnf('root ::= x\nx ::= "c"', root_rule_name="x")
    assert not _is_grammar_accept_string(h, "c")
''')
    got = {(c.kind, c.guide): c for c in ec.load_xgrammar(tmp_path)}
    assert [(i.text, i.expected) for i in got["regex", "a{2}"].instances] == [
        ("aa", True), ("a", False)]
    schema = got["json_schema", '{"type": "integer"}']
    assert [(i.value, i.text, i.expected) for i in schema.instances] == [
        (1, None, True), (None, "x", False), (1.5, None, False)]
    assert got["regex", "a{3,2}"].compiles is False
    assert [(i.text, i.expected) for i in got["ebnf", 'root ::= "b"'].instances] == [
        ("b", True), ("bb", False)]
    assert not any("root_rule" in g or 'x ::= "c"' in g for _, g in got)


def test_llguidance_lark_reader(tmp_path):
    """``parser/tests/test_lark.rs``: each ``lark_str_test_many`` call (its literal strings;
    ``FINAL_REJECT:`` dropped; a grammar named by a ``for`` loop gives a case per grammar) and
    each ``json_test_many`` call; an item built with ``format!`` is skipped."""
    folder = tmp_path / "parser" / "tests"
    folder.mkdir(parents=True)
    (folder / "test_lark.rs").write_text(r'''
#[test]
fn a() {
    lark_str_test_many(
        r#"start: "a" | "b""#,
        &["a", &format!("{}", x)],
        &["FINAL_REJECT:", "ab"],
    );
    for grm in &[r#"start: X
                    X: "x""#, "start: /y/"] {
        lark_str_test_many_quiet(grm, &["x"], &[]);
    }
    json_test_many(&json!({"type": "integer",}), &[json!(1)], &[json!("1"), json!(1.5)]);
    json_test_many(&json!({"type": "integer"}), &[json!(n)], &[]);
}
''')
    cases = ec.load_llguidance_lark(tmp_path)
    got = {(c.kind, c.guide): [(i.shown(), i.expected) for i in c.instances] for c in cases}
    assert got == {
        ("lark", 'start: "a" | "b"'): [("a", True), ("", False), ("ab", False)],
        ("lark", 'start: X\n                    X: "x"'): [("x", True)],
        ("lark", "start: /y/"): [("x", True)],
        ("json_schema", '{"type": "integer"}'): [("1", True), ('"1"', False), ("1.5", False)],
    }
    assert cases[0].source.endswith("test_lark.rs:4")


def test_xgrammar_lark_reader(tmp_path):
    """xgrammar's ``test_lark.py``: ``_assert_language`` calls, their arguments taken from
    ``pytest.param`` rows, f-strings and ``json.dumps`` of literals; a call with a vocabulary
    of its own is skipped."""
    folder = tmp_path / "tests" / "python"
    folder.mkdir(parents=True)
    (folder / "test_lark.py").write_text(r'''
import json, pytest

@pytest.mark.parametrize("grammar, accepted, rejected", [
    pytest.param('start: "a"', ["a"], ["b"], id="one"),
])
def test_rows(grammar, accepted, rejected):
    _assert_language(grammar, accepted, rejected)

@pytest.mark.parametrize("name, accepted, rejected", [pytest.param("INT", ["1"], ["a"])])
def test_common(name, accepted, rejected):
    _assert_language(f"%import common.{name}\nstart: {name}", accepted, rejected)

def test_json():
    _assert_language("start: %json " + json.dumps({"type": "integer"}), ["1"], ["x"])
    _assert_language('start: <t>', ["x"], [], tokenizer_info=info)
''')
    got = {c.guide: [(i.text, i.expected) for i in c.instances]
           for c in ec.load_xgrammar(tmp_path) if c.kind == "lark"}
    assert got == {'start: "a"': [("a", True), ("b", False)],
                   "%import common.INT\nstart: INT": [("1", True), ("a", False)],
                   'start: %json {"type": "integer"}': [("1", True), ("x", False)]}


@pytest.mark.parametrize("grammar, text, valid", [
    ('start: /a|ab/ "c"', "abc", True),  # not only the prefixes of the first match
    ('start: /a|ab/ "c"', "abbc", False),
    ("start: /a{2,}?/", "aaa", True), ("start: /a{2,}?/", "a", False),
    ("start: A B\nA: /a+/\nB: /a+b/", "aaab", True),
    ('%import common.WS\n%ignore WS\nstart: "a" "b"', " a b ", True),
    ('start: "\\b"', "\b", None),  # lark keeps "\b" as two characters; llguidance does not
    ('start: <|tool|> "x"', "x", None),  # an extension lark cannot read
    ('start: %json {"type": "integer", "minimum": 2}', "3", True),  # the schema decides
    ('start: %json {"type": "integer", "minimum": 2}', "1", False),
])
def test_lark_oracle(grammar, text, valid):
    """A Lark grammar's verdict is the ``lark`` package's Earley parse over every length each
    terminal matches whole; ``start: %json SCHEMA`` is the schema's verdict; none where lark
    cannot read the grammar or reads its strings otherwise."""
    pytest.importorskip("lark", reason="the lark package (the test extra) is not installed")
    assert ec.oracle(ec.Case("lark", grammar, "s"), ec.Instance(text=text))[0] is valid


def test_lark_cases_run_on_every_backend(factories, tekken):
    """A Lark case compiles as an EBNF guide on llguidance and as a structural tag's Lark
    grammar on xgrammar, and its strings get their oracle verdicts there."""
    pytest.importorskip("lark", reason="the lark package (the test extra) is not installed")
    case = ec.Case("lark", 'start: "x" NUM\nNUM: /[0-9]+/', "probe",
                   [ec.Instance(text="x12"), ec.Instance(text="x"), ec.Instance(text="y1")])
    for backend, factory in factories.items():
        tally = ec.run_case(factory, tekken, case)
        assert (tally.compiled, tally.valid_accepted, tally.invalid_refused) == (1, 1, 2), backend


def test_xgrammar_structural_tag_reader(tmp_path):
    """xgrammar's ``check_stag_with_instance(format, instance[, is_accepted])`` calls, from
    stacked parametrize tables of module-level lists: each is a structural-tag case; a format
    built from a pydantic class is skipped."""
    folder = tmp_path / "tests" / "python"
    folder.mkdir(parents=True)
    (folder / "test_structural_tag_converter.py").write_text(r'''
import pytest
FORMATS = [({"type": "const_string", "value": "Hi"}, "const_string ::= ...")]
INSTANCES = [("Hi", True), ("Ho", False)]

@pytest.mark.parametrize("stag_format, expected_grammar", FORMATS)
@pytest.mark.parametrize("instance, is_accepted", INSTANCES)
def test_format(stag_format, expected_grammar, instance, is_accepted):
    check_stag_with_instance(stag_format, instance, is_accepted)

def test_model():
    check_stag_with_instance(TagFormat(begin="a", end="b"), "ab")
    check_stag_with_instance({"type": "regex", "pattern": "a+"}, "aa")
''')
    got = {}
    for c in ec.load_xgrammar(tmp_path):
        got.setdefault((c.kind, c.guide), []).extend((i.text, i.expected) for i in c.instances)
    tag = '{"type": "structural_tag", "format": {"type": "const_string", "value": "Hi"}}'
    assert got == {
        ("structural_tag", tag): [("Hi", True), ("Ho", False)],
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "regex", '
                           '"pattern": "a+"}}'): [("aa", True)]}
