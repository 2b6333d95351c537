"""The OpenAI API of the built-in server: ``/v1/completions`` and ``/v1/chat/completions``.

Agents written for the ``openai`` package (multi-turn and agentic RL) talk to the server through
these two endpoints; the trainer needs the exact tokens behind every answer, so each response
carries, besides OpenAI's fields, the names vLLM gives them (``return_token_ids``):

* ``choices[i].token_ids``: the sampled token ids (EOS or the matched stop token included);
* ``prompt_token_ids``: the prompt as the model saw it (in each choice for ``/v1/completions``
  as vLLM does, at the top level for ``/v1/chat/completions``, also as vLLM does);
* ``weight_version`` (top level): the server's weight version when the last token was sampled, as
  SGLang's ``meta_info.weight_version`` (Archon's own field name on the OpenAI shape).

The ids are always returned (``return_token_ids`` is accepted and changes nothing). Logprobs
follow ``archon.server.sampling``'s contract; only the sampled token's logprob is reported
(``logprobs: 0`` for completions, ``top_logprobs: 0`` for chat). Every field is checked before any
work starts; a bad one is a ``ProtocolError`` (HTTP 400, one sentence naming the field and the fix).
OpenAI fields this server does not implement are accepted only with their neutral value.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from archon.server.generator import GenerationRequest, GenerationResult
from archon.server.protocol import ProtocolError, is_int64, is_number
from archon.server.sampling import SamplingParams

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions`` (chat defaults to the rest of the context)."""
MAX_N = 64
"""Most completions one request may ask for."""
CHAT_ROLES = ("system", "user", "assistant", "tool")

_ANY = object()
# OpenAI / vLLM fields without an implementation here: accepted only with these values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stream": (False, None),
    "stream_options": (None,),
    "stop": (None, []),
    "echo": (False, None),
    "best_of": (None, 1),
    "suffix": (None,),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "auto", "none"),
    "user": (_ANY,),
    "parallel_tool_calls": (_ANY,),
    "skip_special_tokens": (True, None),
    "spaces_between_special_tokens": (_ANY,),
    "return_token_ids": (_ANY,),
    "metadata": (_ANY,),
    "store": (False, None),
}
_SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "min_tokens", "stop_token_ids", "seed", "n"}
_SAMPLING |= {"ignore_eos", "model"}
_COMPLETION_FIELDS = _SAMPLING | {"prompt", "logprobs"}
_CHAT_FIELDS = _SAMPLING | {"messages", "tools", "logprobs", "top_logprobs", "max_completion_tokens"}


@dataclass
class OpenAICall:
    """A parsed OpenAI request: the prompt and one generation request per choice."""

    model: str
    """The ``model`` field, echoed back."""
    prompt_ids: list[int]
    """Prompt token ids (rendered and tokenized for chat and text prompts)."""
    requests: list[GenerationRequest]
    """``n`` requests on the same prompt (choice ``i`` is request ``i``)."""
    logprobs: bool
    """Report the sampled tokens' logprobs."""


def _check_fields(obj: dict[str, Any], known: set[str], endpoint: str) -> None:
    for key, value in obj.items():
        if key in known:
            continue
        if key not in _NEUTRAL:
            raise ProtocolError(f"{endpoint}: the request has an unknown field {key!r}; remove it.")
        allowed = _NEUTRAL[key]
        if _ANY not in allowed and not any(value == a and type(value) is type(a) or value is a for a in allowed):
            raise ProtocolError(
                f"{endpoint}: {key} = {value!r} is not supported by Archon's built-in server "
                f"(only {allowed[0]!r}); remove it or use an SGLang or vLLM server."
            )


def _int_field(obj: dict[str, Any], name: str, endpoint: str, low: int, default: int | None) -> int | None:
    value = obj.get(name)
    if value is None:
        return default
    if not is_int64(value) or value < low:
        raise ProtocolError(f"{endpoint}: {name} must be an integer >= {low}, got {value!r}.")
    return value


def _float_field(obj: dict[str, Any], name: str, endpoint: str, default: float) -> float:
    value = obj.get(name)
    if value is None:
        return default
    if not is_number(value):
        raise ProtocolError(f"{endpoint}: {name} must be a finite number, got {value!r}.")
    return float(value)


def _sampling(
    obj: dict[str, Any], endpoint: str, prompt_len: int, context_length: int, default_max: int | None
) -> tuple[SamplingParams, int]:
    """``(SamplingParams, n)`` from the OpenAI sampling fields (range checks in ``SamplingParams.validate``)."""
    room = context_length - prompt_len
    if room < 0:
        raise ProtocolError(
            f"{endpoint}: the prompt ({prompt_len} tokens) is longer than the context length {context_length}; "
            "shorten it."
        )
    max_tokens = obj.get("max_completion_tokens")  # chat's newer name for max_tokens
    if max_tokens is None:
        max_tokens = obj.get("max_tokens")
    if max_tokens is None:
        max_tokens = min(default_max, room) if default_max is not None else room
    elif not is_int64(max_tokens) or max_tokens < 0:
        raise ProtocolError(f"{endpoint}: max_tokens must be a non-negative integer, got {max_tokens!r}.")
    if max_tokens > room:
        raise ProtocolError(
            f"{endpoint}: the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the context "
            f"length {context_length}; lower max_tokens to at most {max(room, 0)} or shorten the prompt."
        )
    top_k = _int_field(obj, "top_k", endpoint, -1, -1)
    stop = obj.get("stop_token_ids")
    if stop is not None and (not isinstance(stop, list) or not all(is_int64(t) for t in stop)):
        raise ProtocolError(f"{endpoint}: stop_token_ids must be a list of token ids, got {stop!r}.")
    ignore_eos = obj.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ProtocolError(f"{endpoint}: ignore_eos must be true or false, got {ignore_eos!r}.")
    seed = obj.get("seed")
    if seed is not None and not is_int64(seed):
        raise ProtocolError(f"{endpoint}: seed must be an integer below 2**63 or null, got {seed!r}.")
    n = _int_field(obj, "n", endpoint, 1, 1)
    assert n is not None
    if n > MAX_N:
        raise ProtocolError(f"{endpoint}: n = {n} asks for too many completions; send at most {MAX_N} per request.")
    params = SamplingParams(
        max_new_tokens=max_tokens,
        min_new_tokens=_int_field(obj, "min_tokens", endpoint, 0, 0) or 0,
        temperature=_float_field(obj, "temperature", endpoint, 1.0),
        top_p=_float_field(obj, "top_p", endpoint, 1.0),
        top_k=-1 if top_k == 0 else top_k or -1,  # vLLM: 0 and -1 both turn top-k off
        min_p=_float_field(obj, "min_p", endpoint, 0.0),
        stop_token_ids=list(stop or []),
        ignore_eos=ignore_eos,
        sampling_seed=seed,
    )
    try:
        params.validate()
    except ValueError as e:
        message = str(e).replace("max_new_tokens", "max_tokens").replace("min_new_tokens", "min_tokens")
        raise ProtocolError(f"{endpoint}: {message.replace('sampling_params.', '')}") from None
    return params, n


def _requests(
    endpoint: str,
    prompt: list[int],
    params: SamplingParams,
    n: int,
    logprobs: bool,
    check: Callable[[GenerationRequest], None],
) -> list[GenerationRequest]:
    requests = []
    for i in range(n):
        # With a seed, choice i uses seed + i: reproducible, yet the n choices differ.
        seed = None if params.sampling_seed is None else (params.sampling_seed + i) % 2**63
        copy = SamplingParams(**{**vars(params), "stop_token_ids": list(params.stop_token_ids), "sampling_seed": seed})
        requests.append(GenerationRequest(list(prompt), copy, logprobs, f"oai-{uuid.uuid4().hex}"))
    try:
        check(requests[0])
    except ValueError as e:  # the generator's words, in this API's field names
        message = str(e).replace("input_ids", "prompt").replace("sampling_params.", "")
        raise ProtocolError(f"{endpoint}: {message}") from None
    return requests


def _object(payload: Any, endpoint: str) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise ProtocolError(f"the {endpoint} body must be a JSON object.")
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError(f"{endpoint}: model must be a string, got {model!r}.")
    return payload


def parse_completion(
    payload: Any, tokenizer: Any, context_length: int, check: Callable[[GenerationRequest], None]
) -> OpenAICall:
    """Parse a ``/v1/completions`` body (``tokenizer`` None: token-id prompts only)."""
    ep = "/v1/completions"
    obj = _object(payload, ep)
    _check_fields(obj, _COMPLETION_FIELDS, ep)
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ProtocolError(
                f"{ep}: a text prompt needs a tokenizer, which this server did not load; send the prompt as token ids."
            )
        if not prompt:
            raise ProtocolError(f"{ep}: prompt is empty; send some text or token ids.")
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ProtocolError(f"{ep}: prompt holds several prompts; send one prompt per request (use n for samples).")
    else:
        raise ProtocolError(f"{ep}: prompt must be a string or a non-empty list of token ids, got {prompt!r}.")
    logprobs = obj.get("logprobs")
    if logprobs is not None and (not is_int64(logprobs) or logprobs != 0):
        raise ProtocolError(
            f"{ep}: logprobs = {logprobs!r} is not supported; send 0 (the sampled tokens' logprobs, no alternatives) "
            "or null."
        )
    params, n = _sampling(obj, ep, len(ids), context_length, COMPLETION_DEFAULT_MAX_TOKENS)
    wanted = logprobs == 0
    return OpenAICall(obj.get("model") or "", ids, _requests(ep, ids, params, n, wanted, check), wanted)


def _check_messages(messages: Any, ep: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ProtocolError(f"{ep}: messages must be a non-empty list of {{role, content}} objects.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ProtocolError(f"{ep}: messages[{i}] must be an object with role and content, got {m!r}.")
        if m.get("role") not in CHAT_ROLES:
            raise ProtocolError(f"{ep}: messages[{i}].role = {m.get('role')!r} must be one of {', '.join(CHAT_ROLES)}.")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m["role"] == "assistant"):
            raise ProtocolError(
                f"{ep}: messages[{i}].content must be a string (text parts and images are not supported), "
                f"got {content!r}."
            )
    return messages


def _check_tools(tools: Any, ep: str) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ProtocolError(f"{ep}: tools must be a list of {{type: 'function', function: {{...}}}} objects.")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ProtocolError(f"{ep}: tools[{i}] must be {{'type': 'function', 'function': {{name, parameters}}}}.")
        if not isinstance(fn.get("name"), str) or not isinstance(fn.get("parameters", {}), dict):
            raise ProtocolError(
                f"{ep}: tools[{i}].function needs a string name and a JSON-schema object as parameters."
            )
    return tools


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """Prompt ids of ``messages`` through the tokenizer's chat template, ready for the assistant's turn."""
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(t) for t in ids]


def parse_chat(
    payload: Any, tokenizer: Any, context_length: int, check: Callable[[GenerationRequest], None]
) -> OpenAICall:
    """Parse a ``/v1/chat/completions`` body (needs ``tokenizer`` with a chat template)."""
    ep = "/v1/chat/completions"
    obj = _object(payload, ep)
    _check_fields(obj, _CHAT_FIELDS, ep)
    messages = _check_messages(obj.get("messages"), ep)
    tools = _check_tools(obj.get("tools"), ep)
    logprobs = obj.get("logprobs", False)
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise ProtocolError(f"{ep}: logprobs must be true or false, got {logprobs!r}.")
    top = obj.get("top_logprobs")
    if top is not None and (not is_int64(top) or top != 0):
        raise ProtocolError(f"{ep}: top_logprobs = {top!r} is not supported; send 0 or null (no alternatives).")
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ProtocolError(
            f"{ep} needs a tokenizer with a chat template, which this server did not load; "
            "use /v1/completions with token ids."
        )
    try:
        ids = render_chat(tokenizer, messages, tools)
    except Exception as e:  # noqa: BLE001  a template error is the request's fault (a role it does not know...)
        raise ProtocolError(f"{ep}: the chat template could not render these messages: {e}") from None
    params, n = _sampling(obj, ep, len(ids), context_length, None)
    return OpenAICall(obj.get("model") or "", ids, _requests(ep, ids, params, n, logprobs, check), logprobs)


# ---- responses -----------------------------------------------------------------------------


def _finish_reason(result: GenerationResult) -> str:
    kind = result.finish_reason.get("type")
    return kind if kind in ("stop", "length") else "abort"


def _stop_reason(result: GenerationResult) -> int | None:
    return result.finish_reason.get("matched") if result.finish_reason.get("type") == "stop" else None


def _usage(call: OpenAICall, results: list[GenerationResult]) -> dict[str, int]:
    completion = sum(r.completion_tokens for r in results)
    prompt = len(call.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


_DECODE_WINDOW = 6
"""Tokens of left context when decoding one token's text (enough for a multi-byte character or a merged space)."""


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text (special tokens skipped: ``""``), so that they join to the text.

    A token's text is what decoding it adds after a few tokens of context, as in vLLM's incremental
    detokenizer; a lone ``decode([t])`` would lose the space a word-level or SentencePiece tokenizer
    puts between tokens.  Without a tokenizer, vLLM's ``token_id:<id>`` form.
    """
    if tokenizer is None:
        return [f"token_id:{t}" for t in ids]
    texts = []
    for k in range(len(ids)):
        context = ids[max(0, k - _DECODE_WINDOW) : k]
        before = tokenizer.decode(context, skip_special_tokens=True)
        texts.append(tokenizer.decode([*context, ids[k]], skip_special_tokens=True)[len(before) :])
    return texts


def _weight_version(results: list[GenerationResult]) -> str:
    return results[-1].weight_version if results else ""


def completion_response(call: OpenAICall, results: list[GenerationResult], tokenizer: Any) -> dict[str, Any]:
    """OpenAI's ``text_completion`` object, plus ``token_ids``, ``prompt_token_ids`` and ``weight_version``."""
    choices = []
    for i, r in enumerate(results):
        text = tokenizer.decode(r.output_ids, skip_special_tokens=True) if tokenizer is not None else ""
        logprobs = None
        if call.logprobs:
            tokens = token_texts(tokenizer, r.output_ids)
            offsets, at = [], 0
            for t in tokens:
                offsets.append(at)
                at += len(t)
            logprobs = {
                "tokens": tokens,
                "token_logprobs": r.output_logprobs,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        choices.append(
            {
                "index": i,
                "text": text,
                "finish_reason": _finish_reason(r),
                "stop_reason": _stop_reason(r),
                "logprobs": logprobs,
                "token_ids": r.output_ids,
                "prompt_token_ids": call.prompt_ids,
            }
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": call.model,
        "choices": choices,
        "usage": _usage(call, results),
        "weight_version": _weight_version(results),
    }


def chat_response(call: OpenAICall, results: list[GenerationResult], tokenizer: Any) -> dict[str, Any]:
    """OpenAI's ``chat.completion`` object, plus ``prompt_token_ids``, ``choices[i].token_ids``, ``weight_version``."""
    choices = []
    for i, r in enumerate(results):
        logprobs = None
        if call.logprobs:
            assert r.output_logprobs is not None
            logprobs = {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(token_texts(tokenizer, r.output_ids), r.output_logprobs)
                ]
            }
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": tokenizer.decode(r.output_ids, skip_special_tokens=True)},
                "finish_reason": _finish_reason(r),
                "stop_reason": _stop_reason(r),
                "logprobs": logprobs,
                "token_ids": r.output_ids,
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": call.model,
        "choices": choices,
        "usage": _usage(call, results),
        "prompt_token_ids": call.prompt_ids,
        "weight_version": _weight_version(results),
    }


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(folder: str | Path) -> Any:
    """The Hugging Face tokenizer saved in ``folder``, or None if it has none or it does not load (token ids only)."""
    if not any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001  the SGLang endpoints need no tokenizer: serve them anyway
        logger.warning("the tokenizer in %s does not load (%s); the OpenAI endpoints take token ids only.", folder, e)
        return None
