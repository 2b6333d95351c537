"""Turning a prompt into token ids: optional template, then the tokenizer's chat template if it has one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from archon.errors import DataError

PROMPT_PLACEHOLDER = "{prompt}"


def apply_prompt_template(text: str, prompt_template: str = PROMPT_PLACEHOLDER) -> str:
    """``prompt_template`` with ``{prompt}`` replaced by ``text``; other braces are kept literally
    (so a template may say ``\\boxed{}``)."""
    if PROMPT_PLACEHOLDER not in prompt_template:
        raise DataError(
            f"prompt_template {prompt_template!r} has no '{{prompt}}' placeholder; write e.g. "
            "'{prompt}\\nPut your final answer in \\\\boxed{}.'"
        )
    return prompt_template.replace(PROMPT_PLACEHOLDER, text)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _ids(result: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True) by default.
    if isinstance(result, Mapping):
        result = result["input_ids"]
    return [int(t) for t in result]


def encode_prompt(
    tokenizer: Any, text: str, *, system_prompt: str | None = None, use_chat_template: bool | None = None
) -> list[int]:
    """Token ids of a user prompt, ready for generation.

    With a chat template (``use_chat_template`` None means "if the tokenizer has one") the
    prompt becomes a user message (after an optional system message) and the template's
    generation prompt is appended; otherwise the text is tokenised as is, without special
    tokens (a system prompt is then prepended as text on its own line).
    """
    use_chat = has_chat_template(tokenizer) if use_chat_template is None else use_chat_template
    if use_chat:
        if not has_chat_template(tokenizer):
            raise DataError(
                "use_chat_template is on but the tokenizer has no chat_template; turn it off or "
                "use a tokenizer folder whose tokenizer_config.json defines one"
            )
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": text}
        ]
        return _ids(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    if system_prompt:
        text = f"{system_prompt}\n{text}"
    return _ids(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_messages(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a chat (``messages``, and the ``tools`` JSON schemas the template shows the model) rendered by
    the tokenizer's chat template, with the generation prompt unless ``add_generation_prompt`` is false."""
    if not has_chat_template(tokenizer):
        raise DataError(
            "chat messages (chat-formatted data, agent episodes) need a tokenizer with a chat_template; use a "
            "tokenizer folder whose tokenizer_config.json defines one"
        )
    return _ids(
        tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    )


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Plain token ids of ``text`` (no special tokens)."""
    return _ids(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_tokenizer(path: str, key: str = "actor.path") -> Any:
    """The tokenizer of the Hugging Face folder ``path`` (config key ``key``); ``DataError`` if none loads."""
    from pathlib import Path

    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise DataError(
            f"{key} = '{path}' is not a folder; point it at a local Hugging Face model folder "
            "(config.json, *.safetensors and the tokenizer files)"
        )
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:  # transformers' paragraph, cut to its first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"cannot load a tokenizer from {key} = '{path}' ({first}); the folder needs tokenizer.json or "
            "tokenizer_config.json with its vocabulary files"
        ) from None
