"""Tool calls in the Qwen3-Coder XML form (xserv/tool_calls/): the form read from the chat template, a block parsed
into OpenAI's arguments with values typed by the tool's schema, and the grammar of tool_choice "required" / named.

The reference for the form is the bundled Qwen3.5 chat template itself: a history turn's tool calls rendered by it
are what the model is trained to write, so the parser must give back the arguments it was given, and the grammar
must accept the rendered text token by token (the Qwen3.5 tokenizer: <tool_call> is one token there)."""
import json
import random
import string

import pytest

from xserv.chat_output import ChatOutputParser, parse_chat_output
from xserv.models.config import presets_dir
from xserv.tokenizer import Tokenizer
from xserv.tool_calls import call_parser, tool_call_format
from xserv.tool_calls.xml_form import convert_value, parse_xml_call, value_kind
from xserv.tool_calls.xml_grammar import xml_call_grammar

QWEN3_5 = presets_dir() / "tokenizer_qwen3_5"
EOS = [248046, 248044]
VOCAB_ROWS = 248320  # the checkpoints' embedding rows (more than the tokenizer's 248,077 tokens)

SEARCH = {"type": "object", "properties": {
    "query": {"type": "string"},
    "limit": {"type": "integer"},
    "score": {"type": "number"},
    "exact": {"type": "boolean"},
    "mode": {"type": "string", "enum": ["fast", "deep"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "filters": {"type": "object", "properties": {"lang": {"type": "string"}, "year": {"type": "integer"}}},
    "cursor": {"type": ["integer", "null"]},
}, "required": ["query", "limit"]}
NOTE = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TOOLS = [("search", SEARCH), ("note", NOTE), ("ping", None)]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(QWEN3_5)


@pytest.fixture(scope="module")
def grammar_tok(tok):
    from xserv.structured import grammar_tokenizer

    return grammar_tokenizer(tok, EOS, VOCAB_ROWS)


def _text(rng, n) -> str:
    """Free text with the characters that matter here: newlines, angle brackets, quotes, non-ASCII."""
    alphabet = string.ascii_letters + string.digits + " \n<>/=\"'{}[]é中🙂"
    return "".join(rng.choice(alphabet) for _ in range(n)).replace("</parameter>", "")


def _random_search_args(rng) -> dict:
    args = {"query": _text(rng, rng.randint(0, 30)), "limit": rng.randint(-10**6, 10**6)}
    optional = {"score": round(rng.uniform(-1e3, 1e3), rng.randint(0, 6)), "exact": rng.random() < 0.5,
                "mode": rng.choice(["fast", "deep"]), "tags": [_text(rng, rng.randint(0, 5)) for _ in range(3)],
                "filters": {"lang": _text(rng, 4), "year": rng.randint(1900, 2100)},
                "cursor": rng.choice([None, rng.randint(0, 99)])}
    for key in SEARCH["properties"]:  # the schema's order, as the grammar wants it
        if key in optional and rng.random() < 0.7:
            args[key] = optional[key]
    return args


def _rendered_calls(tok, calls) -> str:
    """The assistant turn's tool-call text as the Qwen3.5 template writes it (after its empty think block)."""
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    turn = prompt.split("<|im_start|>assistant\n", 1)[1]
    return turn[:turn.index("<|im_end|>")].split("</think>\n\n", 1)[1]


def _blocks(text: str) -> list[str]:
    return [b.split("</tool_call>")[0] for b in text.split("<tool_call>")[1:]]


def test_the_form_is_read_from_the_template(tok):
    assert tool_call_format(tok.chat_template) == "xml"
    qwen3 = Tokenizer.from_folder(presets_dir() / "tokenizer")
    assert tool_call_format(qwen3.chat_template) == "json"
    assert tool_call_format(None) == "json" and tool_call_format("{{ messages }}") == "json"
    with pytest.raises(ValueError, match="format"):
        call_parser("yaml")


def test_template_rendered_calls_parse_back_to_their_arguments(tok):
    """Red while a value comes back with another type or other text (a newline too many or too few, a number as a
    string, a string that looks like JSON parsed)."""
    rng = random.Random()
    parse = call_parser("xml", dict(TOOLS))
    for _ in range(40):
        calls = [("search", _random_search_args(rng)), ("note", {"text": rng.choice(["123", "true", "null", "[1]",
                                                                                     _text(rng, 12)])})]
        blocks = _blocks(_rendered_calls(tok, calls))
        assert len(blocks) == 2
        for (name, args), block in zip(calls, blocks):
            call = parse(block)
            assert call is not None and call.name == name, block
            assert json.loads(call.arguments) == args, block


@pytest.mark.parametrize("schema, written, expected", [
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, "3.0", 3),  # integral: the integer it names
    ({"type": "integer"}, "3.5", "3.5"),  # not an integer: the text as written
    ({"type": "integer"}, "forty", "forty"),
    ({"type": "number"}, "2", 2),
    ({"type": "number"}, "NaN", "NaN"),  # not JSON, and no client could parse it
    ({"type": "boolean"}, "true", True),
    ({"type": "boolean"}, "False", False),  # Python's spelling
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": "object"}, '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
    ({"type": "object"}, "{'a': True}", {"a": True}),  # a Python dict
    ({"type": "object"}, "[1]", "[1]"),  # an array where an object is due
    ({"type": "array"}, "(1, 2)", [1, 2]),
    ({"type": "array"}, "{1, 2}", "{1, 2}"),  # a Python set is no JSON value
    ({"type": ["integer", "null"]}, "null", None),
    ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", True),
    ({"anyOf": [{"type": "integer"}, {}]}, "7", "7"),  # a branch allows anything: the text
    ({"enum": [1, 2, 3]}, "2", 2),
    ({"type": "string"}, "123", "123"),
    ({"type": "string"}, "  spaced\n\n", "  spaced\n\n"),  # only the template's own newline comes off each end
    (None, '{"a": 1}', '{"a": 1}'),  # a parameter the schema does not list: the text
])
def test_values_are_typed_by_the_schema(schema, written, expected):
    value = convert_value("\n" + written + "\n", schema)
    assert value == expected and type(value) is type(expected)


def test_refs_and_unlisted_parameters():
    params = {"type": "object", "$defs": {"n": {"type": "integer"}},
              "properties": {"n": {"$ref": "#/$defs/n"}, "s": {"type": "string"}}}
    call = parse_xml_call("<function=f>\n<parameter=n>\n5\n</parameter>\n<parameter=x>\n5\n</parameter>\n"
                          "</function>", {"f": params})
    assert json.loads(call.arguments) == {"n": 5, "x": "5"}
    call = parse_xml_call("<function=g>\n<parameter=n>\n5\n</parameter>\n</function>", {"f": params})
    assert json.loads(call.arguments) == {"n": "5"}  # a function no tool names: every value raw


@pytest.mark.parametrize("block, expected", [
    ("\n<function=f>\n</function>\n", ("f", {})),
    ("<function=f>\n<parameter=a>\nx\n</parameter>\n", ("f", {"a": "x"})),  # no </function>
    ("<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>", ("f", {"a": "x", "b": "y"})),  # no closers
    # a string may hold "<parameter=" (the grammar lets it): a value ends at its closer when one follows
    ("<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n</parameter>\n</function>",
     ("f", {"a": "x\n<parameter=b>\ny"})),
    ("<function=f><parameter=a>x</parameter></function>", ("f", {"a": "x"})),  # no newlines at all
    ('{"name": "f", "arguments": {}}', None),  # the JSON form is not this one
    ("<function=f>\nhello\n</function>", None),  # text outside the parameters
    ("<function=>\n</function>", None),
    ("<function=f>\n<parameter=a>\nx\n</parameter>\n</function>\ntrailing", None),
])
def test_block_shapes(block, expected):
    call = parse_xml_call(block, {})
    assert (None if call is None else (call.name, json.loads(call.arguments))) == expected


def test_streamed_parts_equal_the_whole_at_every_split(tok):
    """The answer as the model writes it with thinking on (the prompt opened <think>): reasoning, a sentence, two
    calls; and a malformed block that stays content. Every split of the text into two pieces, and characters one
    at a time, give the same parts as the whole."""
    parse = call_parser("xml", dict(TOOLS))
    calls = _rendered_calls(tok, [("search", {"query": "a <b>", "limit": 2}), ("ping", {})])
    answer = "Let me look.\n</think>\n\nSearching now.\n\n" + calls + "\n<tool_call>\n<function=x>\nbad\n</tool_call>"
    kw = dict(reasoning=True, in_reasoning=True, tools=True, parse_call=parse)
    reasoning, content, found = parse_chat_output(answer, **kw)
    assert reasoning == "Let me look.\n"
    assert content == "Searching now.<tool_call>\n<function=x>\nbad\n</tool_call>"
    assert [(c.name, json.loads(c.arguments)) for c in found] == [("search", {"query": "a <b>", "limit": 2}),
                                                                  ("ping", {})]
    whole = (reasoning, content, found)
    for cut in list(range(len(answer) + 1)) + [None]:
        parser = ChatOutputParser(**kw)
        pieces = [answer[:cut], answer[cut:]] if cut is not None else list(answer)
        parts = [p for piece in pieces for p in parser.push(piece)] + parser.finish()
        got = ("".join(p.text for p in parts if p.kind == "reasoning"),
               "".join(p.text for p in parts if p.kind == "content"), [p.call for p in parts if p.kind == "tool_call"])
        assert got == whole, cut


# ---- the grammar ----------------------------------------------------------------------------------------------------
def _accepts(grammar_tok, tok, grammar: str, text: str) -> bool:
    from xserv.structured import GrammarConstraint, StructuredOutput

    c = GrammarConstraint(grammar_tok, StructuredOutput.lark(grammar))
    return all(c.consume(t) for t in tok.encode(text)) and c.accepting


def test_grammar_accepts_what_the_template_writes(tok, grammar_tok):
    """Red while the grammar's shape differs from the template's by a byte (a newline, the tag tokens) or a typed
    value cannot be written as the template's tojson writes it."""
    rng = random.Random()
    grammar = xml_call_grammar(TOOLS)
    for _ in range(8):
        calls = [("search", _random_search_args(rng)), ("note", {"text": _text(rng, 20)}), ("ping", {})]
        rng.shuffle(calls)
        text = _rendered_calls(tok, calls)
        assert _accepts(grammar_tok, tok, grammar, text), text
        assert _accepts(grammar_tok, tok, grammar, _rendered_calls(tok, calls[:1]))


@pytest.mark.parametrize("calls, why", [
    ([("search", {"query": "x"})], "a required parameter missing"),
    ([("search", {"query": "x", "limit": "ten"})], "a string where an integer is due"),
    ([("search", {"query": "x", "limit": 1, "mode": "slow"})], "a value outside the enum"),
    ([("search", {"limit": 1, "query": "x"})], "parameters out of the schema's order"),
    ([("search", {"query": "x", "limit": 1, "extra": 1})], "a parameter the schema does not list"),
    ([("search", {"query": "x", "limit": 1, "filters": {"year": "1999"}})], "a nested value of the wrong type"),
    ([("nope", {})], "a function that is not among the tools"),
    ([("note", {"text": "a</parameter>b"})], "a string value with the closing tag inside"),
])
def test_grammar_refuses(tok, grammar_tok, calls, why):
    assert not _accepts(grammar_tok, tok, xml_call_grammar(TOOLS), _rendered_calls(tok, calls)), why


def test_grammar_one_call_and_text_around(tok, grammar_tok):
    one = _rendered_calls(tok, [("note", {"text": "hi"})])
    two = _rendered_calls(tok, [("note", {"text": "hi"}), ("ping", {})])
    single = xml_call_grammar(TOOLS, parallel=False)
    assert _accepts(grammar_tok, tok, single, one) and not _accepts(grammar_tok, tok, single, two)
    many = xml_call_grammar(TOOLS)
    assert _accepts(grammar_tok, tok, many, two)
    assert not _accepts(grammar_tok, tok, many, "Sure. " + one) and not _accepts(grammar_tok, tok, many, one + " ok")
    assert not _accepts(grammar_tok, tok, many, "")


def test_grammar_with_text_tags_and_its_refusals(tok, grammar_tok):
    """A tokenizer without <tool_call> tokens gets the tags as text; names the form cannot carry are refused."""
    grammar = xml_call_grammar([("note", NOTE)], tag_tokens=False)
    assert '"<tool_call>"' in grammar and "<tool_call> " not in grammar
    with pytest.raises(ValueError, match="at least one tool"):
        xml_call_grammar([])
    with pytest.raises(ValueError, match="cannot be written"):
        xml_call_grammar([("a>b", None)])
    with pytest.raises(ValueError, match="cannot be written"):
        xml_call_grammar([("f", {"type": "object", "properties": {"a\nb": {"type": "string"}}})])


def test_value_kind_matches_the_grammar_split():
    """The parser's raw-or-JSON decision is the grammar's free-text-or-JSON one (one function decides both)."""
    assert value_kind({"type": "string"}) == value_kind(None) == value_kind({}) == "string"
    assert value_kind({"type": ["string", "null"]}) == "string"
    assert value_kind({"type": "integer"}) == value_kind({"enum": [1, 2]}) == "json"
