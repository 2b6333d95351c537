"""Agent tools: tool calls parsed from sampled text, tools run safely (raise, hang, garbage), and the calculator."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
from fractions import Fraction

import pytest

from archon.config import ConfigError
from archon.rl.agent.tools import (
    BUILTIN_TOOLS,
    Tool,
    ToolMetrics,
    calculator,
    load_tool,
    load_tools,
    parse_tool_calls,
    run_tool_call,
    tool_from_function,
    tools_schema,
)


def get_weather(city: str, days: int = 1) -> str:
    """Weather forecast for a city.

    Longer text that is not part of the description.
    """
    return f"{city}: sunny for {days} day(s)"


TOOLS = load_tools(["calculator", get_weather])
EXPLICIT = Tool(
    "weather", get_weather, "explicit schema", {"type": "object", "properties": {"city": {"type": "string"}}}
)


def _call(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ----------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------


def test_parse_one_call_keeps_content_and_is_openai_shaped():
    reply = parse_tool_calls("Let me compute.\n" + _call("calculator", {"expression": "1+2"}), TOOLS)
    assert reply.error is None and reply.content == "Let me compute."
    [call] = reply.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "1+2"}


def test_parse_several_calls_in_order_with_text_between_and_after():
    text = "A " + _call("calculator", {"expression": "2*3"}) + "\nB\n" + _call("get_weather", {"city": "Oslo"}) + " C"
    reply = parse_tool_calls(text, TOOLS)
    assert reply.error is None
    assert [c["function"]["name"] for c in reply.tool_calls] == ["calculator", "get_weather"]
    assert json.loads(reply.tool_calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert reply.content == "A \nB\n C"
    assert len({c["id"] for c in reply.tool_calls}) == 2


def test_parse_zero_calls_and_unclosed_last_call():
    plain = parse_tool_calls("  The answer is 4.  ", TOOLS)
    assert plain.tool_calls == [] and plain.error is None and plain.content == "The answer is 4."
    # Generation stopped on a stop token before the closing tag.
    cut = parse_tool_calls('Hm.<tool_call>\n{"name": "calculator", "arguments": {"expression": "5"}}\n', TOOLS)
    assert cut.error is None and cut.content == "Hm." and len(cut.tool_calls) == 1


def test_parse_arguments_given_as_json_string_or_parameters_key():
    as_string = parse_tool_calls(
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7\\"}"}</tool_call>', TOOLS
    )
    as_parameters = parse_tool_calls(
        '<tool_call>{"name": "get_weather", "parameters": {"city": "X"}}</tool_call>', TOOLS
    )
    assert as_string.error is None and as_parameters.error is None
    assert json.loads(as_string.tool_calls[0]["function"]["arguments"]) == {"expression": "7"}


@pytest.mark.parametrize(
    "text, kind, fragment",
    [
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}\n</tool_call>', "parse_error", "JSON"),
        ("<tool_call>[1, 2]</tool_call>", "parse_error", '"name"'),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "parse_error", "not an object"),
        (_call("search", {"q": "x"}), "unknown", "unknown tool 'search'"),
        (_call("get_weather", {"days": 2}), "parse_error", "required argument 'city'"),
        (_call("get_weather", {"city": 3}), "parse_error", "'city' is int"),
        (_call("get_weather", {"city": "x", "days": True}), "parse_error", "'days' is bool"),
        (_call("get_weather", {"city": "x", "unit": "C"}), "parse_error", "'unit' is not a parameter"),
    ],
)
def test_parse_errors_are_reasons_not_exceptions(text, kind, fragment):
    reply = parse_tool_calls("Sure. " + _call("calculator", {"expression": "1"}) + text, TOOLS)
    assert reply.error_kind == kind and fragment in (reply.error or "")
    assert reply.tool_calls == [] and reply.content == "Sure."
    assert "tool call 2 of 2" in (reply.error or "")


# ----------------------------------------------------------------------------------------
# Tools, schemas, registry
# ----------------------------------------------------------------------------------------


def test_schema_from_signature_and_docstring():
    tool = TOOLS["get_weather"]
    assert tool.schema() == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    assert tools_schema(TOOLS)[0]["function"]["name"] == "calculator"


def test_load_tool_by_import_path_builtin_and_errors():
    # This module as pytest imported it (its dotted name depends on pytest's import mode).
    derived = load_tool(f"{__name__}:get_weather")
    assert derived.fn is get_weather and derived.schema() == TOOLS["get_weather"].schema()
    assert load_tool(f"{__name__}:EXPLICIT") is EXPLICIT
    assert load_tool("calculator") is BUILTIN_TOOLS["calculator"]
    assert load_tool(EXPLICIT) is EXPLICIT
    with pytest.raises(ConfigError, match="unknown tool 'nope'"):
        load_tool("nope")
    with pytest.raises(ConfigError, match="cannot import module"):
        load_tool("no_such_module_xyz:f")
    with pytest.raises(ConfigError, match="no attribute"):
        load_tool(f"{__name__}:missing")
    with pytest.raises(ConfigError, match="two tools are named"):
        load_tools([get_weather, f"{__name__}:get_weather"])

    def untyped(x):
        return x

    with pytest.raises(ConfigError, match="parameter 'x' needs an annotation"):
        tool_from_function(untyped)


# ----------------------------------------------------------------------------------------
# Running tools
# ----------------------------------------------------------------------------------------


def _run(tool: Tool, arguments: dict, timeout_s: float = 5.0, **kw):
    return asyncio.run(run_tool_call(tool, arguments, timeout_s, **kw))


async def _async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


def test_sync_and_async_tools_return_text():
    assert _run(TOOLS["get_weather"], {"city": "Oslo", "days": 2}).content == "Oslo: sunny for 2 day(s)"
    result = _run(tool_from_function(_async_add), {"a": 2, "b": 40})
    assert (result.content, result.error, result.kind) == ("42", None, "ok")
    assert _run(Tool("d", lambda: {"k": [1, 2.5]}), {}).content == '{"k": [1, 2.5]}'


def test_raising_tool_is_an_exception_outcome():
    def broken(x: int) -> int:
        raise KeyError(f"no row {x}")

    async def broken_async() -> int:
        raise ZeroDivisionError("division by zero")

    result = _run(tool_from_function(broken), {"x": 3})
    assert result.kind == "exception" and result.error == "tool 'broken' raised KeyError: 'no row 3'"
    assert (
        _run(tool_from_function(broken_async), {}).error
        == "tool 'broken_async' raised ZeroDivisionError: division by zero"
    )
    assert _run(Tool("bad_args", get_weather), {"town": "x"}).kind == "exception"
    assert _run(Tool("exits", lambda: sys.exit(3)), {}).error == "tool 'exits' raised SystemExit: 3"

    async def exits_async() -> None:
        sys.exit(4)

    assert _run(Tool("exits_async", exits_async), {}).error == "tool 'exits_async' raised SystemExit: 4"


@pytest.mark.parametrize("value", [object(), None, b"bytes", float("nan"), {"k": {1, 2}}])
def test_garbage_results(value):
    result = _run(Tool("junk", lambda: value), {})
    assert result.kind == "garbage" and result.content == "" and "not text" in (result.error or "")


def test_results_are_truncated():
    result = _run(Tool("long", lambda: "x" * 50), {}, max_chars=10)
    assert result.content == "x" * 10 + "\n[truncated: 40 more characters]"


def test_hung_sync_tool_is_abandoned_within_its_timeout():
    release, finished = threading.Event(), threading.Event()

    def hang() -> str:
        release.wait()
        finished.set()
        return "late"

    t0 = time.monotonic()
    result = _run(Tool("hang", hang), {}, timeout_s=0.3)
    elapsed = time.monotonic() - t0
    assert not finished.is_set()  # the call returned while the tool was still blocked: it was not waited for
    assert result.kind == "timeout" and result.error == "tool 'hang' did not return within 0.3 s"
    assert elapsed < 0.3 + 2.0
    # Let the abandoned thread finish: its late result lands on a closed event loop, harmlessly.
    release.set()
    assert finished.wait(10)


def test_hung_async_tool_is_cancelled_within_its_timeout():
    cancelled = threading.Event()

    async def hang() -> str:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        return "never"

    t0 = time.monotonic()
    result = _run(Tool("hang", hang), {}, timeout_s=0.3)
    assert result.kind == "timeout" and cancelled.is_set()
    assert time.monotonic() - t0 < 0.3 + 2.0


def test_metrics_count_every_kind():
    metrics, other = ToolMetrics(), ToolMetrics()
    for kind in ("ok", "ok", "timeout"):
        metrics.record(kind)
    other.record("parse_error")
    metrics.merge(other)
    assert metrics.as_dict() == {
        "tool/ok": 2.0,
        "tool/timeout": 1.0,
        "tool/exception": 0.0,
        "tool/garbage": 0.0,
        "tool/parse_error": 1.0,
        "tool/unknown": 0.0,
    }


# ----------------------------------------------------------------------------------------
# Calculator
# ----------------------------------------------------------------------------------------


def _random_expression(rng: random.Random, depth: int, ops: str) -> tuple[str, Fraction]:
    """An expression string and its value, computed on the tree directly (not by parsing the string)."""
    if depth == 0 or rng.random() < 0.3:
        n = rng.randint(-50, 50)
        return (f"({n})" if n < 0 else str(n)), Fraction(n)
    op = rng.choice(ops)
    (ls, lv), (rs, rv) = _random_expression(rng, depth - 1, ops), _random_expression(rng, depth - 1, ops)
    if op == "/" and rv == 0:
        rs, rv = "7", Fraction(7)
    value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else lv}[op]
    return f"({ls} {op} {rs})", value


def test_calculator_matches_integer_arithmetic():
    rng = random.Random(1234)
    for _ in range(200):
        text, value = _random_expression(rng, 4, "+-*")
        assert calculator(text) == str(int(value)), text


def test_calculator_divides_exactly():
    rng = random.Random(99)
    for _ in range(200):
        text, value = _random_expression(rng, 3, "+-*/")
        assert Fraction(calculator(text)) == value, text
    assert calculator("7 / 2") == "7/2" and calculator("-(8 / 4)") == "-2"


@pytest.mark.parametrize(
    "expression, fragment",
    [
        ("x + 1", "not 'x'"),
        ("__import__('os')", "not"),
        ("abs(-3)", "not 'abs(-3)'"),
        ("2 ** 10", "not '2 ** 10'"),
        ("1.5 + 1", "not '1.5'"),
        ("True + 1", "not 'True'"),
        ("10 // 3", "not '10 // 3'"),
        ("1 / 0", "divide by zero"),
        ("1" * 40, "larger than 10**30"),
        ("*".join(["1000000000000"] * 4), "larger than 10**30"),
        ("(" * 201 + "1" + ")" * 201, "cannot parse"),
        ("-" * 201 + "1", "nested more than 200"),
        ("1 +" * 300 + "1", "at most 512 characters"),
        ("1 +", "cannot parse"),
    ],
)
def test_calculator_refusals(expression, fragment):
    with pytest.raises(ValueError, match="calculator") as info:
        calculator(expression)
    assert fragment in str(info.value)
