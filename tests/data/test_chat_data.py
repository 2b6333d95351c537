"""Chat data: prompts rendered by the tokenizer's chat template, and SFT that trains on the assistant turns only."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hf_fixtures import make_tiny_tokenizer

from archon.config.dataset import DatasetConfig
from archon.data import RLPromptDataset, SFTDataset
from archon.data.from_config import build_rl_dataset, build_sft_dataset, describe_chat_template
from archon.data.sft_dataset import build_chat_sft_sample
from archon.errors import DataError

CHAT = [
    {"role": "system", "content": "the answer"},
    {"role": "user", "content": "what is 2 + 2 ?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "what is 3 + 3 ?"},
    {"role": "assistant", "content": "the answer is 6"},
]

# Each message ends with its end token and a 'sep' word the model never generates (Qwen's templates write a newline
# there); the second form marks the assistant text with {% generation %}, for transformers' own assistant mask.
SEP_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> sep {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
SEP_TEMPLATE_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %} sep "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def sep_tokenizer(template):
    t = make_tiny_tokenizer(
        vocab=["user", "assistant", "system", "sep", "+", "?", "what", "is", "the", "answer", "old"]
        + [str(i) for i in range(10)]
    )
    t.chat_template = template
    return t


def template_ids(tokenizer, messages, **kw):
    """Transformers' own rendering: the reference every chat sample is compared with."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


# ---------------------------------------------------------------------------------------
# RL prompts
# ---------------------------------------------------------------------------------------


def test_chat_rows_render_like_apply_chat_template(tok):
    dapo_like = {"prompt": CHAT[:2], "reward_model": {"ground_truth": "4"}, "data_source": "math"}
    ds = RLPromptDataset([{"messages": CHAT[:4], "answer": "6"}, dapo_like], tok, use_chat_template=False)
    assert ds[0].input_ids == template_ids(tok, CHAT[:4], add_generation_prompt=True)
    assert ds[1].input_ids == template_ids(tok, CHAT[:2], add_generation_prompt=True)
    assert (ds[0].prompt, ds[0].answer, ds[1].prompt, ds[1].answer) == ("what is 3 + 3 ?", "6", "what is 2 + 2 ?", "4")
    # An agent workflow starts from 'messages', whichever field held them.
    assert ds[1].extra == {"messages": CHAT[:2], "reward_model": {"ground_truth": "4"}, "data_source": "math"}


def test_text_prompts_are_wrapped_only_when_asked(tok):
    rows = [{"prompt": "what is 2 + 2 ?", "answer": "4"}]
    wrapped = RLPromptDataset(rows, tok, use_chat_template=True)
    as_written = RLPromptDataset(rows, tok, use_chat_template=False)
    user = [{"role": "user", "content": "what is 2 + 2 ?"}]
    assert wrapped[0].input_ids == template_ids(tok, user, add_generation_prompt=True)
    assert as_written[0].input_ids == tok("what is 2 + 2 ?", add_special_tokens=False)["input_ids"]


def test_the_config_default_does_not_wrap_and_says_so(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "what is 2 + 2 ?", "answer": "4"}\n')
    default = DatasetConfig(path=str(path))
    assert build_rl_dataset(default, tok)[0].input_ids == tok("what is 2 + 2 ?", add_special_tokens=False)["input_ids"]
    assert describe_chat_template(default, tok).startswith(
        "train_dataset.apply_chat_template = false: text prompts are tokenised as written, without the tokenizer's "
        "chat template (set it to true for a chat or instruct model)"
    )
    on = DatasetConfig(path=str(path), apply_chat_template=True)
    user = [{"role": "user", "content": "what is 2 + 2 ?"}]
    assert build_rl_dataset(on, tok)[0].input_ids == template_ids(tok, user, add_generation_prompt=True)
    assert "= true: text prompts are wrapped in the tokenizer's chat template" in describe_chat_template(on, tok)
    plain = make_tiny_tokenizer()
    plain.chat_template = None
    assert "(the tokenizer has no chat template)" in describe_chat_template(default, plain)
    with pytest.raises(DataError, match="apply_chat_template = true but the tokenizer of actor.path has no chat"):
        build_rl_dataset(on, plain)
    with pytest.raises(DataError, match="apply_chat_template = true but the tokenizer"):
        build_sft_dataset(on, plain)


# ---------------------------------------------------------------------------------------
# SFT on chats
# ---------------------------------------------------------------------------------------


def test_sft_chat_mask_is_exactly_the_assistant_turns(tok):
    sample = SFTDataset([{"messages": CHAT}], tok)[0]
    assert sample["input_ids"] == template_ids(tok, CHAT)
    # Hand-computed: the tiny template writes '<|im_start|> role content <|im_end|>' per message (spaces split
    # words); the assistant's content and its <|im_end|> are trained, its role word (the generation prompt) is not.
    tokens = tok.convert_ids_to_tokens(sample["input_ids"])
    expected_tokens = (
        ["<|im_start|>", "system", "the", "answer", "<|im_end|>"]
        + ["<|im_start|>", "user", "what", "is", "2", "+", "2", "?", "<|im_end|>"]
        + ["<|im_start|>", "assistant", "4", "<|im_end|>"]
        + ["<|im_start|>", "user", "what", "is", "3", "+", "3", "?", "<|im_end|>"]
        + ["<|im_start|>", "assistant", "the", "answer", "is", "6", "<|im_end|>"]
    )
    assert tokens == expected_tokens
    expected_mask = [0] * 5 + [0] * 9 + [0, 0, 1, 1] + [0] * 9 + [0, 0, 1, 1, 1, 1, 1]
    assert sample["loss_mask"] == expected_mask


def test_sft_chat_mask_matches_transformers_assistant_mask_and_skips_text_after_eos():
    plain, marked = sep_tokenizer(SEP_TEMPLATE), sep_tokenizer(SEP_TEMPLATE_GENERATION)
    sample = build_chat_sft_sample(plain, CHAT)
    reference = marked.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert isinstance(reference, Mapping)
    assert sample["input_ids"] == list(reference["input_ids"])
    assert sample["loss_mask"] == list(reference["assistant_masks"])
    sep = plain.convert_tokens_to_ids("sep")
    assert all(m == 0 for t, m in zip(sample["input_ids"], sample["loss_mask"]) if t == sep)
    assert sum(sample["loss_mask"]) == 2 + 5  # '4 <|im_end|>' and 'the answer is 6 <|im_end|>'


def test_sft_chat_rows_truncate_and_refuse_what_cannot_train(tok):
    rows = [{"messages": CHAT}, {"messages": CHAT[:3]}]
    cut = SFTDataset(rows, tok, max_length=20, truncation="truncate")
    assert cut.n_truncated == 1 and cut.n_dropped == 0 and cut[0]["loss_mask"] == [0] * 16 + [1, 1, 0, 0]
    assert len(SFTDataset(rows, tok, max_length=17, truncation="truncate")) == 2
    with pytest.raises(DataError, match="dropped 2"):  # no trained token left in either
        SFTDataset(rows, tok, max_length=16, truncation="truncate")
    with pytest.raises(DataError, match="row 1: 'messages' has no assistant message"):
        SFTDataset([{"messages": CHAT[:2]}], tok)
    with pytest.raises(DataError, match="row 1 is a chat row"):
        SFTDataset(rows, tok, system_prompt="be brief")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # Like Qwen3's template dropping earlier turns' reasoning: an assistant turn followed by more messages is
    # rendered differently, so its tokens are not where rendering the chat up to it puts them.
    rewrites = sep_tokenizer(
        "{% for m in messages %}<|im_start|>{{ m['role'] }} "
        "{% if m['role'] == 'assistant' and not loop.last %}old{% else %}{{ m['content'] }}{% endif %}<|im_end|> "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    assert sum(build_chat_sft_sample(rewrites, CHAT[:3])["loss_mask"]) == 2  # one turn: nothing follows it
    with pytest.raises(DataError, match="renders message 3 \\(assistant\\) differently once more messages follow"):
        build_chat_sft_sample(rewrites, CHAT)
