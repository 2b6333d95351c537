"""Chat messages appended to a recorded conversation's token ids with a tokenizer's chat template, never
re-tokenising what was recorded.

An agent's next prompt is the recorded ids (every earlier prompt and every sampled id) plus the ids of the new
messages (tool results, a user reply) and the generation prompt.  ``append_messages`` finds those ids:

1. Prefix-stable: render the whole conversation (``history + new``, ``tools``, ``add_generation_prompt``) and
   tokenise it; when its ids start with the recorded ids, the rest is appended.  The next prompt then equals the
   full render's ids exactly.
2. Otherwise (the template renders earlier turns differently from what was sampled, e.g. it strips
   ``<think>...</think>`` from old assistant turns, or the policy sampled a non-canonical tokenisation) the
   recorded ids win and only the new messages' own span is rendered, by diffing strings at the message boundary:
   ``render(history + new)[len(render(history)):]`` when the first render starts with the second; when the new
   messages change how the history renders (Qwen3 renders the last assistant turn differently once a message
   follows it), the same diff after a one-message stand-in history ``[{"role": "user", ...}]``.  Before the span
   comes the template's text that closes the last assistant turn after the sampled ids (e.g. the newline after
   ``<|im_end|>``): what ``render(history)`` has after its last end-of-turn token, including that token when the
   policy did not sample it (cut off by a length limit or a stop string).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from archon.data.encoding import encode_messages, encode_text, has_chat_template
from archon.rl.agent.trajectory import Segment

TEMPLATE_ROLE = "template"
"""Role of chat-template text that belongs to no new message (the closing of the last assistant turn)."""
PROMPT_ROLE = "prompt"
"""Role of an episode's first prompt (``start_messages``)."""
STAND_IN_HISTORY: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
"""History the new messages are rendered after when the real history re-renders once they follow it."""


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """The chat template's text of ``messages`` (with the ``tools`` JSON schemas, and the generation prompt)."""
    if not has_chat_template(tokenizer):
        raise ValueError(
            "the tokenizer has no chat_template, which multi-turn agents need to render messages; use a tokenizer "
            "folder whose tokenizer_config.json defines one"
        )
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    assert isinstance(text, str)  # tokenize=False renders text
    return text


def start_messages(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None
) -> list[Segment]:
    """An episode's first context: ``messages`` rendered with the generation prompt (as the RL data's chat rows
    are), as one ``PROMPT_ROLE`` segment."""
    ids = encode_messages(tokenizer, [dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None)
    return [Segment(ids, PROMPT_ROLE)]


def append_messages(
    tokenizer: Any,
    recorded_ids: Sequence[int],
    history: Sequence[Mapping[str, Any]],
    new_messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """The context segments to append to ``recorded_ids`` (the ids of ``history``, as recorded) for
    ``new_messages``; see the module docstring for the method.  The last segment has the new messages' role
    ('tool', 'user', or their roles joined by '+'); a ``TEMPLATE_ROLE`` segment may come first."""
    if not new_messages:
        raise ValueError("append_messages() got no new messages; pass the tool results or user reply to append")
    role = "+".join(dict.fromkeys(str(m["role"]) for m in new_messages))
    full = render_chat(tokenizer, [*history, *new_messages], tools=tools, add_generation_prompt=add_generation_prompt)
    full_ids = encode_text(tokenizer, full)
    before = render_chat(tokenizer, history, tools=tools)
    closing = encode_text(tokenizer, _closing_text(tokenizer, recorded_ids, history, before))
    n = len(recorded_ids)
    if full_ids[:n] == list(recorded_ids):
        rest = full_ids[n:]
        if closing and rest[: len(closing)] == closing:  # the same segments as the boundary diff would give
            return [Segment(closing, TEMPLATE_ROLE), Segment(rest[len(closing) :], role)]
        return [Segment(rest, role)]
    if full.startswith(before):
        span = full[len(before) :]
    else:
        stand_in = render_chat(tokenizer, STAND_IN_HISTORY, tools=tools)
        rendered = render_chat(
            tokenizer, [*STAND_IN_HISTORY, *new_messages], tools=tools, add_generation_prompt=add_generation_prompt
        )
        if not rendered.startswith(stand_in):
            raise ValueError(
                "the chat template renders earlier messages differently once new ones follow them, even after a "
                "one-message stand-in history, so the new messages' own tokens cannot be found; use a template "
                "whose rendering of a conversation starts with its rendering of every earlier part"
            )
        span = rendered[len(stand_in) :]
    return ([Segment(closing, TEMPLATE_ROLE)] if closing else []) + [Segment(encode_text(tokenizer, span), role)]


def _closing_text(
    tokenizer: Any, recorded_ids: Sequence[int], history: Sequence[Mapping[str, Any]], before: str
) -> str:
    """The template's text after the last assistant turn's sampled ids: what ``before`` (the history's render)
    has after its last end-of-turn token, with that token when the policy did not sample it."""
    if not history or history[-1].get("role") != "assistant" or not recorded_ids:
        return ""  # the recorded ids do not end with a sampled turn: nothing to close
    last = tokenizer.convert_ids_to_tokens(int(recorded_ids[-1]))
    if last in tokenizer.all_special_tokens and last in before:
        return before[before.rindex(last) + len(last) :]
    eos = tokenizer.eos_token
    if eos and eos in before:
        return before[before.rindex(eos) :]
    return ""
