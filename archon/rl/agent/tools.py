"""Tools for agent episodes: tool calls parsed from a model's sampled text, and tools run so that none can crash a run.

Tool-call format (``parse_tool_calls``): the Hermes format that Qwen2.5 and Qwen3 chat templates also use, one JSON
object ``{"name": ..., "arguments": {...}}`` inside each ``<tool_call>`` ... ``</tool_call>`` pair, several pairs for
parallel calls.  As in SGLang's and vLLM's parsers the JSON between the tags is stripped of surrounding whitespace
(the templates put it on its own line), and a final ``<tool_call>`` left unclosed because generation stopped there is
still parsed.  The text outside the pairs, stripped, is the assistant's content.  Calls come back OpenAI-shaped
(``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``, the shape chat templates render
and ``tool_calls`` messages carry).  Malformed JSON, an unknown tool name, or arguments that miss a required property,
have a wrong JSON type, fall outside an ``enum`` or are not allowed by ``additionalProperties: false`` make the reply
a parse error: a reason string and an error kind, never an exception.

Tools (``Tool``, ``load_tools``): a name, a description, JSON-schema parameters and a Python callable, sync or async.
Configs name tools ``"package.module:attr"`` (or a built-in such as ``"calculator"``).  When ``attr`` is a ``Tool``
it is used as is (the way to give a schema explicitly); when it is a plain function its schema is derived from its
signature (``str``/``int``/``float``/``bool``/``list``/``dict`` annotations, parameters without a default are
required) and its docstring's first paragraph is the description.  Anything richer (nested objects, enums,
per-parameter descriptions) is written as an explicit ``Tool``: deriving it from annotations would be fragile.

Running (``run_tool_call``): an async tool runs under ``asyncio.wait_for``; a sync tool runs in a fresh daemon thread
that is abandoned, not waited for, when it passes its timeout: Python cannot stop a thread, so a hung sync tool keeps
its thread (and whatever it holds) until it returns or the process exits.  A tool that may hang for good should be
async or run its work in a subprocess it can kill.  An async tool that blocks the event loop (a sync sleep inside
``async def``) cannot be timed out at all.  Exceptions, timeouts and results that are not text, a finite number or
JSON-serialisable become a ``ToolResult`` with an ``error`` sentence and a ``kind``; ``ToolMetrics`` counts the kinds
as ``tool/<kind>``.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import math
import operator
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, get_type_hints

from archon.config import ConfigError

TOOL_CALL_OPEN = "<tool_call>"
"""Tag that opens one tool call in Hermes / Qwen2.5 / Qwen3 chat templates."""
TOOL_CALL_CLOSE = "</tool_call>"
"""Tag that closes it."""

TOOL_OUTCOMES = ("ok", "timeout", "exception", "garbage", "parse_error", "unknown")
"""Outcome kinds counted by ``ToolMetrics`` (as ``tool/<kind>``)."""

DEFAULT_MAX_RESULT_CHARS = 4096
"""Default cap on a tool result's text: a tool that returns a whole file must not fill the context window."""

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


# ----------------------------------------------------------------------------------------
# Tools and their schemas
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A function the policy may call: its name, what it does, its JSON-schema parameters, and the callable."""

    name: str
    """Name the policy calls it by (unique among an episode's tools)."""
    fn: Callable[..., Any]
    """Called as ``fn(**arguments)``; sync or ``async def``."""
    description: str = ""
    """What the tool does, shown to the policy in the chat template's tool list."""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON schema of the arguments object (``type: object`` with ``properties`` and ``required``)."""

    @property
    def is_async(self) -> bool:
        """Whether ``fn`` is a coroutine function (run on the event loop rather than in a thread)."""
        return inspect.iscoroutinefunction(self.fn)

    def schema(self) -> dict[str, Any]:
        """The tool's entry in an OpenAI ``tools`` list (what ``apply_chat_template(tools=...)`` takes)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


def tool_from_function(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """A ``Tool`` whose schema is derived from ``fn``'s signature and whose description is its docstring's start."""
    tool_name = name or fn.__name__
    try:
        hints = get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 - unresolvable annotations are a user error, reported below
        raise ConfigError(f"tool '{tool_name}': cannot resolve its type annotations ({exc}); fix them") from None
    properties: dict[str, Any] = {}
    required: list[str] = []
    extra_allowed = False
    for param in inspect.signature(fn).parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra_allowed = True
            continue
        if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            raise ConfigError(
                f"tool '{tool_name}': parameter '{param.name}' cannot be passed by keyword; tools are called as "
                "fn(**arguments), so make it a keyword parameter"
            )
        json_type = _JSON_TYPES.get(hints.get(param.name))
        if json_type is None:
            raise ConfigError(
                f"tool '{tool_name}': parameter '{param.name}' needs an annotation among str, int, float, bool, "
                "list, dict to derive its schema; annotate it, or define the tool as an explicit Tool(...)"
            )
        properties[param.name] = {"type": json_type}
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    doc = inspect.getdoc(fn) or ""
    parameters: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if not extra_allowed:
        parameters["additionalProperties"] = False
    return Tool(name=tool_name, fn=fn, description=doc.split("\n\n")[0].strip(), parameters=parameters)


def _import_attr(spec: str) -> Any:
    """The object a ``"package.module:attr"`` string names (``attr`` may be dotted)."""
    module_name, _, attr = spec.partition(":")
    usage = "name a tool 'package.module:function' (or a Tool object), importable in the trainer, or a built-in"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"tool '{spec}': cannot import module '{module_name}' ({exc}); {usage}") from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"tool '{spec}': module '{module_name}' has no attribute '{attr}'; {usage}")
    return obj


def load_tool(spec: str | Tool | Callable[..., Any]) -> Tool:
    """A ``Tool`` from a built-in name, a ``"package.module:attr"`` string, a ``Tool``, or a plain function."""
    if isinstance(spec, Tool):
        return spec
    if callable(spec):
        return tool_from_function(spec)
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    if ":" not in spec:
        raise ConfigError(
            f"unknown tool '{spec}'; use a built-in ({', '.join(BUILTIN_TOOLS)}) or 'package.module:function'"
        )
    obj = _import_attr(spec)
    if isinstance(obj, Tool):
        return obj
    if not callable(obj):
        raise ConfigError(f"tool '{spec}' is neither a Tool nor callable; point it at a function or a Tool")
    return tool_from_function(obj)


def load_tools(specs: Iterable[str | Tool | Callable[..., Any]]) -> dict[str, Tool]:
    """Tools by name, from config-style specs (see ``load_tool``); two tools with one name are a config error."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if tool.name in tools:
            raise ConfigError(f"two tools are named '{tool.name}'; give each tool of an episode a distinct name")
        tools[tool.name] = tool
    return tools


def tools_schema(tools: Mapping[str, Tool]) -> list[dict[str, Any]]:
    """The OpenAI ``tools`` list of ``tools``, for the chat template."""
    return [tool.schema() for tool in tools.values()]


# ----------------------------------------------------------------------------------------
# Parsing tool calls
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedReply:
    """An assistant reply split into its content and its tool calls, or the reason its calls are unusable."""

    content: str
    """The text outside the ``<tool_call>`` pairs, stripped."""
    tool_calls: list[dict[str, Any]]
    """OpenAI-shaped tool calls in order; empty when there are none or when ``error`` is set."""
    error: str | None = None
    """Why the reply's tool calls cannot be run (one sentence), or None."""
    error_kind: str | None = None
    """'parse_error' (bad JSON, bad arguments) or 'unknown' (no such tool) when ``error`` is set."""


def _json_type_matches(value: Any, json_type: str) -> bool:
    # bool is an int subclass in Python but not a JSON number.
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    expected = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}.get(json_type)
    return expected is None or isinstance(value, expected)


def check_arguments(arguments: Mapping[str, Any], parameters: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the top level of the ``parameters`` schema, or None when they do."""
    properties: Mapping[str, Any] = parameters.get("properties", {})
    for name in parameters.get("required", []):
        if name not in arguments:
            return f"the required argument '{name}' is missing"
    for name, value in arguments.items():
        prop = properties.get(name)
        if prop is None:
            if parameters.get("additionalProperties", True) is False:
                return f"the argument '{name}' is not a parameter of the tool"
            continue
        types = prop.get("type")
        types = [types] if isinstance(types, str) else types
        if types and not any(_json_type_matches(value, t) for t in types):
            return f"the argument '{name}' is {type(value).__name__} {value!r}, not of JSON type {'/'.join(types)}"
        if "enum" in prop and value not in prop["enum"]:
            return f"the argument '{name}' is {value!r}, not one of {prop['enum']}"
    return None


def _split_tool_calls(text: str) -> tuple[str, list[str]]:
    """The text outside ``<tool_call>`` pairs and the raw text inside each (a last unclosed one included)."""
    outside: list[str] = []
    inside: list[str] = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end < 0:
            # Generation stopped inside the call (a stop token before the closing tag).
            inside.append(text[body_start:])
            return "".join(outside).strip(), inside
        inside.append(text[body_start:end])
        pos = end + len(TOOL_CALL_CLOSE)
    outside.append(text[pos:])
    return "".join(outside).strip(), inside


def _error_reply(content: str, error_kind: str, error: str) -> ParsedReply:
    return ParsedReply(content=content, tool_calls=[], error=error, error_kind=error_kind)


def parse_tool_calls(text: str, tools: Mapping[str, Tool]) -> ParsedReply:
    """The content and the OpenAI-shaped tool calls of a sampled reply, checked against ``tools``' schemas."""
    content, bodies = _split_tool_calls(text)
    calls: list[dict[str, Any]] = []
    for index, body in enumerate(bodies):
        where = f"tool call {index + 1} of {len(bodies)}"
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            return _error_reply(content, "parse_error", f"{where} is not valid JSON ({exc})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return _error_reply(content, "parse_error", f'{where} is not an object with a string "name"')
        name = call["name"]
        # Some models write "parameters" for "arguments"; SGLang's parser accepts both, and so do we.
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return _error_reply(
                    content, "parse_error", f"{where} ('{name}') has arguments that are not JSON ({exc})"
                )
        if not isinstance(arguments, dict):
            return _error_reply(content, "parse_error", f"{where} ('{name}') has arguments that are not an object")
        tool = tools.get(name)
        if tool is None:
            return _error_reply(content, "unknown", f"{where} names the unknown tool '{name}' (tools: {sorted(tools)})")
        mismatch = check_arguments(arguments, tool.parameters)
        if mismatch is not None:
            return _error_reply(content, "parse_error", f"{where} ('{name}'): {mismatch}")
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        )
    return ParsedReply(content=content, tool_calls=calls)


# ----------------------------------------------------------------------------------------
# Running tools
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolResult:
    """What one tool call gave: the text for the tool message, or why it failed."""

    content: str
    """The result as text (JSON for non-strings), truncated to the cap; empty when ``error`` is set."""
    error: str | None = None
    """One sentence saying why the call failed, or None."""
    kind: str = "ok"
    """Outcome for ``ToolMetrics``: 'ok', 'timeout', 'exception' or 'garbage'."""


def _result_text(value: Any) -> str | None:
    """``value`` as tool-message text, or None when it is not text, a finite number or JSON-serialisable."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bytes, bytearray)):
        return None
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[truncated: {len(text) - max_chars} more characters]"


# What a call gave: its value, or what it raised.  Exceptions travel as values, not raised through asyncio: a
# SystemExit raised inside a task escapes the event loop, and a tool calling sys.exit() must not stop the trainer.
_Outcome = tuple[Any, BaseException | None]


async def _call_async(fn: Callable[..., Any], arguments: Mapping[str, Any]) -> _Outcome:
    """``await fn(**arguments)``, with what it raises as the outcome (cancellation still propagates)."""
    try:
        return await fn(**arguments), None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a tool's failure ends its episode, not the run
        return None, exc


async def _call_in_thread(fn: Callable[..., Any], arguments: Mapping[str, Any]) -> _Outcome:
    """``fn(**arguments)`` in a new daemon thread; a caller that stops waiting leaves the thread behind."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_Outcome] = loop.create_future()

    def settle(outcome: _Outcome) -> None:
        if not future.done():  # done: timed out and cancelled already
            future.set_result(outcome)

    def work() -> None:
        outcome: _Outcome
        try:
            outcome = (fn(**arguments), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop closed while the abandoned tool ran
            pass

    # A daemon thread rather than an executor: executors join their threads at exit, so one hung tool would hang
    # the process's shutdown.
    threading.Thread(target=work, name="archon-tool", daemon=True).start()
    return await future


async def run_tool_call(
    tool: Tool, arguments: Mapping[str, Any], timeout_s: float, max_chars: int = DEFAULT_MAX_RESULT_CHARS
) -> ToolResult:
    """Run ``tool`` on ``arguments`` within ``timeout_s`` seconds; never raises for what the tool does."""
    call = _call_async if tool.is_async else _call_in_thread
    try:
        value, exc = await asyncio.wait_for(call(tool.fn, arguments), timeout_s)
    except asyncio.TimeoutError:
        return ToolResult("", f"tool '{tool.name}' did not return within {timeout_s:g} s", "timeout")
    if exc is not None:
        return ToolResult("", f"tool '{tool.name}' raised {type(exc).__name__}: {exc}", "exception")
    text = _result_text(value)
    if text is None:
        return ToolResult(
            "",
            f"tool '{tool.name}' returned {type(value).__name__}, which is not text, a finite number or "
            "JSON-serialisable",
            "garbage",
        )
    return ToolResult(_truncate(text, max_chars))


@dataclass
class ToolMetrics:
    """Counts of tool-call outcomes, logged as ``tool/<kind>``."""

    counts: Counter[str] = field(default_factory=Counter)
    """Outcome kind -> number of calls (or replies, for parse errors)."""

    def record(self, kind: str) -> None:
        """Count one outcome (one of ``TOOL_OUTCOMES``)."""
        assert kind in TOOL_OUTCOMES, f"unknown tool outcome {kind!r}"
        self.counts[kind] += 1

    def merge(self, other: ToolMetrics) -> None:
        """Add ``other``'s counts to these (e.g. episodes' metrics into a step's)."""
        self.counts.update(other.counts)

    def as_dict(self) -> dict[str, float]:
        """Every outcome's count as ``{"tool/<kind>": n}``, zeros included so that logged curves do not gap."""
        return {f"tool/{kind}": float(self.counts[kind]) for kind in TOOL_OUTCOMES}


# ----------------------------------------------------------------------------------------
# Built-in calculator
# ----------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 512
"""Longest expression ``calculator`` accepts."""
MAX_DEPTH = 200
"""Deepest nesting of operations ``calculator`` accepts (its evaluation recurses once per level)."""
MAX_MAGNITUDE = 10**30
"""Largest numerator or denominator, literal or intermediate, ``calculator`` accepts."""

_BINARY_OPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _check_magnitude(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise ValueError(f"the calculator refuses numbers larger than 10**{round(math.log10(MAX_MAGNITUDE))}")
    return value


def _evaluate_node(node: ast.AST, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise ValueError(f"the calculator refuses expressions nested more than {MAX_DEPTH} operations deep")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _check_magnitude(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate_node(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate_node(node.left, depth + 1), _evaluate_node(node.right, depth + 1)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("the calculator cannot divide by zero")
        return _check_magnitude(_BINARY_OPS[type(node.op)](left, right))
    shown = ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
    raise ValueError(f"the calculator accepts only integers, + - * / and parentheses, not '{shown}'")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression on integers with + - * / and parentheses; division is exact.

    The result is an integer, or a reduced fraction such as 7/2.  Names, calls, powers, floats and numbers beyond
    10**30 are refused with a ValueError.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the calculator accepts expressions of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        # Parsed, never evaluated by Python: only the node types _evaluate_node knows are computed.
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"the calculator cannot parse {expression!r} ({type(exc).__name__})") from None
    return str(_evaluate_node(tree.body, 0))


BUILTIN_TOOLS: dict[str, Tool] = {
    "calculator": Tool(
        name="calculator",
        fn=calculator,
        description="Evaluate an arithmetic expression on integers with + - * / and parentheses (exact division).",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "For example (12 + 3) * 4 / 5"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    )
}
"""Tools a config can name without an import path."""
