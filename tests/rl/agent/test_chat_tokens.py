"""Appending chat messages to recorded ids: equal to the full render when the template is prefix-stable, the
recorded ids kept when the template re-renders earlier assistant turns."""

from __future__ import annotations

import pytest
from hf_fixtures import make_tiny_tokenizer

from archon.data.encoding import encode_text
from archon.data.rl_dataset import RLPromptDataset
from archon.errors import DataError
from archon.rl.agent.chat_tokens import TEMPLATE_ROLE, append_messages, render_chat, start_messages
from archon.rl.agent.trajectory import Trajectory
from archon.rl.rollout_batch import Completion

WORDS = ["user", "assistant", "system", "tool", "tools", "call", "calc", "sep", ":", "<", ">", "/", "think", "r"]
WORDS += ["what", "is", "the", "answer", "again", "+", "=", "?"] + [str(i) for i in range(10)]
_HEAD = (
    "{% if tools %}<|im_start|>system tools : {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "<|im_end|> sep {% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% for c in m.get('tool_calls') or [] %}call {{ c['function']['name'] }} {{ c['function']['arguments'] }} "
    "{% endfor %}"
)
_TAIL = "<|im_end|> sep {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
STABLE = _HEAD + "{{ m['content'] }}" + _TAIL
"""Renders every message the same whatever follows it (tool calls and tool results supported)."""
STRIP_ALL = _HEAD + "{{ m['content'].split('</think>')[-1] if m['role'] == 'assistant' else m['content'] }}" + _TAIL
"""Drops reasoning from every assistant message (as DeepSeek-R1's template does)."""
STRIP_OLD = (
    _HEAD
    + "{{ m['content'].split('</think>')[-1] if m['role'] == 'assistant' and not loop.last else m['content'] }}"
    + _TAIL
)
"""Drops reasoning from assistant messages that another message follows (Qwen3-like: history re-renders)."""
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]


def _tokenizer(template: str):
    tok = make_tiny_tokenizer(vocab=WORDS)
    tok.chat_template = template
    return tok


def _sample(tok, text: str) -> list[int]:
    """Ids a policy 'sampled': the text's ids, then the end-of-turn token."""
    return encode_text(tok, text + " <|im_end|>")


def _run_episode(tok, replies: list[str], new: list[list[dict]], tools=None) -> tuple[Trajectory, list[dict]]:
    """An agent loop over hand-written model replies; returns the trajectory and the conversation's messages."""
    messages: list[dict] = [{"role": "user", "content": "what is 1 + 2 ?"}]
    traj = Trajectory()
    context = start_messages(tok, messages, tools=tools)
    for k, reply in enumerate(replies):
        prompt = traj.ids() + [t for s in context for t in s.ids]
        out = _sample(tok, reply)
        traj.add_turn(context, Completion(prompt, out, [-1.0] * len(out), "stop"))
        messages.append({"role": "assistant", "content": reply})
        if k < len(new):
            context = append_messages(tok, traj.ids(), messages, new[k], tools=tools)
            messages += new[k]
    return traj, messages


def test_prefix_stable_template_appends_exactly_the_full_render():
    tok = _tokenizer(STABLE)
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calc", "arguments": "1 + 2"}}]}
    messages = [{"role": "user", "content": "what is 1 + 2 ?"}, call]
    recorded = encode_text(tok, render_chat(tok, messages[:1], tools=TOOLS, add_generation_prompt=True))
    recorded += _sample(tok, "call calc 1 + 2")  # the tool call, as sampled
    new = [{"role": "tool", "content": "3"}]
    segments = append_messages(tok, recorded, messages, new, tools=TOOLS)
    full = encode_text(tok, render_chat(tok, messages + new, tools=TOOLS, add_generation_prompt=True))
    assert recorded + segments[0].ids + segments[1].ids == full
    assert [(s.role, tok.convert_ids_to_tokens(s.ids)[:2]) for s in segments] == [
        (TEMPLATE_ROLE, ["sep"]),
        ("tool", ["<|im_start|>", "tool"]),
    ]
    assert render_chat(tok, messages, tools=TOOLS).startswith("<|im_start|>system tools : calc ")

    traj, conv = _run_episode(tok, ["call calc 1 + 2", "the answer is 3"], [new], tools=TOOLS)
    assert traj.ids() == full_with_last_reply(tok, conv, TOOLS)


def full_with_last_reply(tok, conv: list[dict], tools) -> list[int]:
    """The full render of the conversation, cut after the last assistant turn's end-of-turn token."""
    ids = encode_text(tok, render_chat(tok, conv, tools=tools))
    return ids[: len(ids) - ids[::-1].index(encode_text(tok, "<|im_end|>")[0])]


@pytest.mark.parametrize("template", [STRIP_ALL, STRIP_OLD], ids=["strip_all", "strip_old"])
def test_recorded_ids_win_when_the_template_rerenders_reasoning(template):
    tok = _tokenizer(template)
    reply = "<think> r r </think> 3"
    traj, conv = _run_episode(tok, [reply, "3"], [[{"role": "user", "content": "again"}]])
    first_prompt = encode_text(tok, "<|im_start|>user what is 1 + 2 ? <|im_end|> sep <|im_start|>assistant")
    second = traj.turns[1].context
    # The recorded reasoning stays; only the closing text and the new message's own span are appended.
    assert [s.role for s in second] == [TEMPLATE_ROLE, "user"]
    assert second[0].ids == encode_text(tok, "sep")
    assert second[1].ids == encode_text(tok, "<|im_start|>user again<|im_end|> sep <|im_start|>assistant")
    assert traj.ids() == first_prompt + _sample(tok, reply) + second[0].ids + second[1].ids + _sample(tok, "3")
    # The template's own render of the same conversation has lost the reasoning: the recorded ids differ from it.
    rendered = full_with_last_reply(tok, conv, None)
    assert traj.ids() != rendered and len(rendered) == len(traj.ids()) - len(encode_text(tok, "<think> r r </think>"))


def test_chat_rows_start_episodes_with_their_messages_and_tools():
    tok = _tokenizer(STABLE)
    messages = [{"role": "system", "content": "tools"}, {"role": "user", "content": "what is 2 + 2 ?"}]
    rows = [{"messages": messages, "tools": TOOLS, "answer": "4", "level": 1}, {"prompt": "2 + 2 =", "answer": "4"}]
    ds = RLPromptDataset(rows, tok)
    text = render_chat(tok, messages, tools=TOOLS, add_generation_prompt=True)
    assert ds[0].input_ids == encode_text(tok, text) == start_messages(tok, messages, tools=TOOLS)[0].ids
    assert text.startswith("<|im_start|>system tools : calc ")
    assert (ds[0].prompt, ds[0].answer) == ("what is 2 + 2 ?", "4")
    assert ds[0].extra == {"messages": messages, "tools": TOOLS, "level": 1}
    assert ds[1].input_ids == encode_text(tok, "<|im_start|>user 2 + 2 =<|im_end|> sep <|im_start|>assistant")
    with pytest.raises(DataError, match="row 1 is a chat row"):
        RLPromptDataset(rows, tok, system_prompt="the answer")
    with pytest.raises(DataError, match="'tools' must be a list"):
        RLPromptDataset([{"messages": messages, "tools": "calc", "answer": "4"}], tok)
    with pytest.raises(DataError, match="'messages' must be a non-empty list"):
        RLPromptDataset([{"messages": [], "answer": "4"}], tok)


@pytest.mark.parametrize("template", [STABLE, STRIP_ALL], ids=["stable", "strip_all"])
def test_a_turn_cut_before_its_end_token_is_closed_by_the_template(template):
    tok = _tokenizer(template)
    reply = "<think> r </think> 3"
    history = [{"role": "user", "content": "what is 1 + 2 ?"}, {"role": "assistant", "content": reply}]
    recorded = start_messages(tok, history[:1])[0].ids + encode_text(tok, reply)  # cut: no <|im_end|> sampled
    segments = append_messages(tok, recorded, history, [{"role": "user", "content": "again"}])
    assert [(s.role, s.ids) for s in segments] == [
        (TEMPLATE_ROLE, encode_text(tok, "<|im_end|> sep")),
        ("user", encode_text(tok, "<|im_start|>user again<|im_end|> sep <|im_start|>assistant")),
    ]


def test_errors():
    tok = _tokenizer(STABLE)
    with pytest.raises(ValueError, match="no new messages"):
        append_messages(tok, [1], [{"role": "user", "content": "1"}], [])
    tok.chat_template = None
    with pytest.raises(DataError, match="need a tokenizer with a chat_template"):
        start_messages(tok, [{"role": "user", "content": "1"}])
    with pytest.raises(ValueError, match="has no chat_template"):
        render_chat(tok, [{"role": "user", "content": "1"}])
    # A template whose earlier messages change with every message after them has no boundary to diff at.
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {{ messages | length }} {% endfor %}"
    with pytest.raises(ValueError, match="even after a one-message stand-in history"):
        append_messages(tok, [9], [{"role": "assistant", "content": "1"}], [{"role": "user", "content": "2"}])
