"""SGLang's HTTP protocol: validate request bodies, build response bodies.

The server parses raw JSON itself, so a bad request gets SGLang's answer (HTTP 400 with
``{"error": {"message": reason}}``), never FastAPI's 422.  Known fields are type-checked;
SGLang fields this server does not implement are accepted only with their neutral value
(``"n": 1``, ``"repetition_penalty": 1.0``, ...) and rejected otherwise, so a client never
silently gets something other than what it asked for.  Control endpoints (weight updates,
abort) ignore fields they do not know, as SGLang grows them release by release.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from archon.errors import ArchonError
from archon.server.generator import GenerationRequest, GenerationResult
from archon.server.sampling import SamplingParams
from archon.wire.weight_group import FLATTENED_BUCKET

DEFAULT_GROUP_NAME = "weight_update_group"
WEIGHT_GROUP_BACKENDS = ("gloo", "nccl")
"""torch.distributed backends a weight update group may use."""


class ProtocolError(ArchonError, ValueError):
    """A request body the server rejects with HTTP 400."""


# SGLang fields without an implementation here: value -> accepted only when neutral.
_ANY = object()
_NEUTRAL_SAMPLING: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "stop": (None, []),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "custom_params": (None,),
    "logit_bias": (None, {}),
    "skip_special_tokens": (_ANY,),
    "spaces_between_special_tokens": (_ANY,),
    "no_stop_trim": (_ANY,),
    "stream_interval": (_ANY,),
}
_NEUTRAL_GENERATE: dict[str, tuple[Any, ...]] = {
    "text": (None,),
    "input_embeds": (None,),
    "image_data": (None,),
    "audio_data": (None,),
    "video_data": (None,),
    "stream": (False, None),
    "logprob_start_len": (-1, None),
    "top_logprobs_num": (0, None),
    "token_ids_logprob": (None,),
    "return_hidden_states": (False, None),
    "lora_path": (None,),
    "custom_logit_processor": (None,),
    "session_params": (None,),
    "modalities": (None,),
    "return_text_in_logprobs": (_ANY,),
    "log_metrics": (_ANY,),
    "data_parallel_rank": (_ANY,),
}
_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
_GENERATE_FIELDS = {
    "input_ids",
    "sampling_params",
    "return_logprob",
    "rid",
    "return_routed_experts",
    "routed_experts_start_len",
    "priority",
}


def error_body(message: str) -> dict[str, Any]:
    """The body of an HTTP 400 answer to ``/generate``."""
    return {"error": {"message": message}}


MAX_JSON_DEPTH = 32
"""Deepest nesting of lists and objects a request body may have (the deepest valid body nests 4)."""


def _json_depth(value: Any) -> int:
    """Nesting depth of decoded JSON (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def parse_json(body: bytes) -> Any:
    """The decoded JSON body; ``ProtocolError`` if it is not JSON or nests deeper than ``MAX_JSON_DEPTH``."""
    too_deep = f"the request body nests lists and objects deeper than {MAX_JSON_DEPTH} levels; flatten it."
    try:
        value = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the request body is not valid JSON ({e}).") from None
    except RecursionError:  # the decoder recurses per level: thousands of '[' exhaust the stack
        raise ProtocolError(too_deep) from None
    if _json_depth(value) > MAX_JSON_DEPTH:
        raise ProtocolError(too_deep)
    return value


def _is_int(x: Any) -> bool:
    return type(x) is int  # bool is an int subclass; JSON true is not a token id


def _is_int64(x: Any) -> bool:
    # Sampling fields become int64 tensors: a larger JSON integer would fail the whole decode batch.
    return _is_int(x) and -(2**63) <= x < 2**63


def _is_number(x: Any) -> bool:
    # Python's JSON accepts NaN and Infinity; an integer too large for a float would raise OverflowError.
    return (type(x) is float and math.isfinite(x)) or (type(x) is int and abs(x) < 2**63)


def is_int64(x: Any) -> bool:
    """A JSON integer (not a bool) that fits int64."""
    return _is_int64(x)


def is_number(x: Any) -> bool:
    """A finite JSON number (not a bool)."""
    return _is_number(x)


def _check_unsupported(obj: dict[str, Any], known: set[str], neutral: dict[str, tuple[Any, ...]], where: str) -> None:
    for key, value in obj.items():
        if key in known:
            continue
        if key not in neutral:
            raise ProtocolError(f"{where} has an unknown field {key!r}; remove it.")
        allowed = neutral[key]
        if _ANY not in allowed and not any(value == a and type(value) is type(a) or value is a for a in allowed):
            raise ProtocolError(
                f"{where}.{key} = {value!r} is not supported by Archon's built-in server "
                f"(only {allowed[0]!r}); remove it or use an SGLang server."
            )


def parse_sampling_params(obj: Any, where: str = "sampling_params") -> SamplingParams:
    """``SamplingParams`` from a JSON object (None: all defaults); ``ProtocolError`` on a bad value."""
    if obj is None:
        return SamplingParams()
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where} must be a JSON object, got {type(obj).__name__}.")
    _check_unsupported(obj, _SAMPLING_FIELDS, _NEUTRAL_SAMPLING, where)
    obj = {k: v for k, v in obj.items() if v is not None}  # JSON null means "default"
    values: dict[str, Any] = {}
    for name in ("max_new_tokens", "min_new_tokens", "top_k"):
        if name in obj:
            if not _is_int64(obj[name]):
                raise ProtocolError(f"{where}.{name} must be an integer below 2**63, got {obj[name]!r}.")
            values[name] = obj[name]
    for name in ("temperature", "top_p", "min_p"):
        if name in obj:
            if not _is_number(obj[name]):
                raise ProtocolError(f"{where}.{name} must be a finite number, got {obj[name]!r}.")
            values[name] = float(obj[name])
    if "ignore_eos" in obj:
        if not isinstance(obj["ignore_eos"], bool):
            raise ProtocolError(f"{where}.ignore_eos must be true or false, got {obj['ignore_eos']!r}.")
        values["ignore_eos"] = obj["ignore_eos"]
    stop = obj.get("stop_token_ids")
    if stop is not None:
        if not isinstance(stop, list) or not all(_is_int64(t) for t in stop):
            raise ProtocolError(f"{where}.stop_token_ids must be a list of integers, got {stop!r}.")
        values["stop_token_ids"] = list(stop)
    seed = obj.get("sampling_seed")
    if seed is not None:
        if not _is_int(seed):
            raise ProtocolError(f"{where}.sampling_seed must be an integer or null, got {seed!r}.")
        values["sampling_seed"] = seed
    params = SamplingParams(**values)
    try:
        params.validate()
    except ValueError as e:
        raise ProtocolError(str(e).replace("sampling_params", where, 1)) from None
    return params


@dataclass
class GenerateCall:
    """A parsed ``/generate`` body."""

    requests: list[GenerationRequest]
    """One request, or the batch in order."""
    is_batch: bool
    """``input_ids`` was a list of lists: answer with a JSON list."""


def _per_item(value: Any, n: int, is_batch: bool, name: str) -> list[Any]:
    """Broadcast a single value over a batch, or check a per-item list's length."""
    if is_batch and isinstance(value, list):
        if len(value) != n:
            raise ProtocolError(f"{name} has {len(value)} entries for a batch of {n} prompts; give one per prompt.")
        return value
    return [value] * n


def parse_generate(
    payload: Any, check: Callable[[GenerationRequest], None], context_length: int | None = None
) -> GenerateCall:
    """Parse a ``/generate`` body; ``check`` (``Generator.check_request``) validates each request.

    ``"max_new_tokens": null`` means "up to the context length", as in SGLang (needs ``context_length``).
    """
    if not isinstance(payload, dict):
        raise ProtocolError("the /generate body must be a JSON object with input_ids.")
    if payload.get("text") is not None:
        raise ProtocolError(
            "text prompts need a tokenizer, which /generate does not use; send input_ids, or text to /v1/completions."
        )
    _check_unsupported(payload, _GENERATE_FIELDS, _NEUTRAL_GENERATE, "the request")
    ids = payload.get("input_ids")
    if ids is None:
        raise ProtocolError("input_ids is missing; send the prompt as a list of token ids.")
    if not isinstance(ids, list) or not ids:
        raise ProtocolError("input_ids must be a non-empty list of token ids (or a list of such lists).")
    is_batch = isinstance(ids[0], list)
    prompts = ids if is_batch else [ids]
    if is_batch and not all(isinstance(p, list) for p in prompts):
        raise ProtocolError("input_ids mixes lists and single ids; send one list of ids or a list of lists.")
    n = len(prompts)

    sampling = payload.get("sampling_params")
    if not is_batch and isinstance(sampling, list):
        raise ProtocolError("sampling_params is a list, but input_ids is a single prompt; send one object.")
    return_logprob = payload.get("return_logprob", False)
    return_routed = payload.get("return_routed_experts", False)
    routed_start = payload.get("routed_experts_start_len", 0)
    priority = payload.get("priority")
    if priority is not None and not _is_int64(priority):
        raise ProtocolError(f"priority must be an integer, got {priority!r}.")
    rid = payload.get("rid")
    if not is_batch and isinstance(rid, list):
        raise ProtocolError("rid is a list, but input_ids is a single prompt; send one string.")

    if is_batch and rid is not None and not isinstance(rid, list):
        raise ProtocolError("rid must be a list with one id per prompt for a batch.")
    samplings = _per_item(sampling, n, is_batch, "sampling_params")
    logprob_flags = _per_item(return_logprob, n, is_batch, "return_logprob")
    routed_flags = _per_item(return_routed, n, is_batch, "return_routed_experts")
    routed_starts = _per_item(routed_start, n, is_batch, "routed_experts_start_len")
    rids = _per_item(rid, n, is_batch, "rid")
    requests = []
    for i, prompt in enumerate(prompts):
        where = f"request {i}: " if is_batch else ""
        per_prompt = is_batch and isinstance(sampling, list)
        params = parse_sampling_params(samplings[i], f"sampling_params[{i}]" if per_prompt else "sampling_params")
        unbounded = (
            isinstance(samplings[i], dict)
            and "max_new_tokens" in samplings[i]
            and samplings[i]["max_new_tokens"] is None
        )
        if unbounded and context_length is not None and isinstance(prompt, list):
            params.max_new_tokens = max(context_length - len(prompt), params.min_new_tokens)
        flag = logprob_flags[i]
        if flag is None:
            flag = False
        if not isinstance(flag, bool):
            raise ProtocolError(f"{where}return_logprob must be true or false, got {flag!r}.")
        if rids[i] is not None and not isinstance(rids[i], str):
            raise ProtocolError(f"{where}rid must be a string, got {rids[i]!r}.")
        routed = False if routed_flags[i] is None else routed_flags[i]
        if not isinstance(routed, bool):
            raise ProtocolError(f"{where}return_routed_experts must be true or false, got {routed!r}.")
        start = 0 if routed_starts[i] is None else routed_starts[i]
        if not _is_int(start) or not 0 <= start <= (len(prompt) if isinstance(prompt, list) else 0):
            raise ProtocolError(
                f"{where}routed_experts_start_len = {start!r} must be an integer in [0, the number of prompt tokens]."
            )
        request = GenerationRequest(
            list(prompt),
            params,
            flag,
            rids[i],
            return_routed_experts=routed,
            routed_experts_start_len=start,
            priority=priority or 0,
        )
        try:
            check(request)
        except ValueError as e:
            raise ProtocolError(f"{where}{e}") from None
        requests.append(request)
    return GenerateCall(requests, is_batch)


def generate_response(result: GenerationResult) -> dict[str, Any]:
    """SGLang's ``/generate`` answer for one request (``text`` is empty: no tokenizer)."""
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
    }
    if result.output_logprobs is not None:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(result.output_logprobs, result.output_ids)]
    if result.routed_experts is not None:
        # SGLang's encoding: the int32 array [tokens, layers, top_k], C order, base64.
        meta["routed_experts"] = base64.b64encode(
            result.routed_experts.to(torch.int32).contiguous().numpy().tobytes()
        ).decode("ascii")
    meta["weight_version"] = result.weight_version
    # SGLang's per-token versions: which weights produced each span of generated tokens.
    meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in result.weight_versions]
    meta["e2e_latency"] = result.e2e_latency
    return {"text": "", "output_ids": result.output_ids, "meta_info": meta}


# ---- control endpoints -------------------------------------------------------------------


def _object(payload: Any, endpoint: str) -> dict[str, Any]:
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        raise ProtocolError(f"the {endpoint} body must be a JSON object.")
    return payload


def _field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], endpoint: str, default: Any = ...) -> Any:
    if name not in obj or obj[name] is None:
        if default is ...:
            raise ProtocolError(f"{endpoint} needs the field {name!r}.")
        return default
    value = obj[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not any(type(value) is k for k in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ProtocolError(f"{endpoint}: {name} must be {names}, got {value!r}.")
    return value


@dataclass
class AbortArgs:
    """A parsed ``/abort_request`` body."""

    rids: list[str]
    """Request ids to abort."""
    abort_all: bool
    """Abort every queued and running request."""


def parse_abort(payload: Any) -> AbortArgs:
    obj = _object(payload, "/abort_request")
    abort_all = _field(obj, "abort_all", bool, "/abort_request", False)
    rid = obj.get("rid")
    if rid is None or rid == "":
        rids = []
    elif isinstance(rid, str):
        rids = [rid]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        rids = list(rid)
    else:
        raise ProtocolError(f"/abort_request: rid must be a string or a list of strings, got {rid!r}.")
    if not rids and not abort_all:
        raise ProtocolError("/abort_request needs a rid or abort_all: true.")
    return AbortArgs(rids, abort_all)


@dataclass
class UpdateOptions:
    """What every weight-update body says besides the weights."""

    weight_version: str | None
    """Version reported after the update (None keeps the current one)."""
    abort_all_requests: bool
    """Abort running requests instead of waiting for them."""


def _update_options(obj: dict, ep: str) -> dict[str, Any]:
    return {
        "weight_version": _field(obj, "weight_version", str, ep, None),
        "abort_all_requests": _field(obj, "abort_all_requests", bool, ep, False),
    }


def _group_name(obj: dict, ep: str) -> str:
    return _field(obj, "group_name", str, ep, DEFAULT_GROUP_NAME)


@dataclass
class UpdateFromDiskArgs(UpdateOptions):
    """A parsed ``/update_weights_from_disk`` body."""

    model_path: str
    """Hugging Face folder with the new weights."""


def parse_update_from_disk(payload: Any) -> UpdateFromDiskArgs:
    ep = "/update_weights_from_disk"
    obj = _object(payload, ep)
    return UpdateFromDiskArgs(model_path=_field(obj, "model_path", str, ep), **_update_options(obj, ep))


@dataclass
class InitGroupArgs:
    """A parsed ``/init_weights_update_group`` body."""

    master_address: str
    """Host of the trainer's rendezvous store."""
    master_port: int
    """Its port."""
    rank_offset: int
    """This server's rank in the group (the trainer is rank 0)."""
    world_size: int
    """Trainer plus every server process in the group."""
    group_name: str
    """Name both sides use for the group."""
    backend: str
    """``gloo`` (CPU) or ``nccl`` (GPU)."""


def parse_init_group(payload: Any) -> InitGroupArgs:
    ep = "/init_weights_update_group"
    obj = _object(payload, ep)
    args = InitGroupArgs(
        master_address=_field(obj, "master_address", str, ep),
        master_port=_field(obj, "master_port", int, ep),
        rank_offset=_field(obj, "rank_offset", int, ep),
        world_size=_field(obj, "world_size", int, ep),
        group_name=_group_name(obj, ep),
        backend=_field(obj, "backend", str, ep, "gloo"),
    )
    if args.backend not in WEIGHT_GROUP_BACKENDS:
        raise ProtocolError(
            f"{ep}: backend {args.backend!r} is not supported; send one of {', '.join(WEIGHT_GROUP_BACKENDS)}."
        )
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise ProtocolError(f"{ep}: backend 'nccl' needs a GPU, and this server has none; send 'gloo'.")
    if not 1 <= args.master_port <= 65535:
        raise ProtocolError(f"{ep}: master_port {args.master_port} is not a TCP port; send one in [1, 65535].")
    if not 0 < args.rank_offset < args.world_size:
        raise ProtocolError(
            f"{ep}: rank_offset {args.rank_offset} must be in [1, world_size={args.world_size}) "
            "(rank 0 is the trainer)."
        )
    return args


def parse_dtype(name: Any, where: str) -> torch.dtype:
    """``"float32"`` / ``"torch.bfloat16"`` -> ``torch.dtype``."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ProtocolError(f"{where}: {name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16').")
    return dtype


@dataclass
class UpdateFromDistributedArgs(UpdateOptions):
    """A parsed ``/update_weights_from_distributed`` body."""

    names: list[str]
    """Hugging Face tensor names, in broadcast order."""
    dtypes: list[torch.dtype]
    """Dtype of each broadcast tensor."""
    shapes: list[list[int]]
    """Shape of each broadcast tensor."""
    group_name: str
    """Group made by ``/init_weights_update_group``."""
    flattened: bool = False
    """``load_format = 'flattened_bucket'``: one broadcast of the tensors' bytes, in order (SGLang's format)."""


def parse_update_from_distributed(payload: Any) -> UpdateFromDistributedArgs:
    ep = "/update_weights_from_distributed"
    obj = _object(payload, ep)
    names = _field(obj, "names", list, ep)
    raw_dtypes = _field(obj, "dtypes", list, ep)
    shapes = _field(obj, "shapes", list, ep)
    if not all(isinstance(n, str) for n in names):
        raise ProtocolError(f"{ep}: names must be a list of strings.")
    if not all(isinstance(s, list) and all(_is_int(d) and d >= 0 for d in s) for s in shapes):
        raise ProtocolError(f"{ep}: shapes must be a list of lists of non-negative integers.")
    if not len(names) == len(raw_dtypes) == len(shapes):
        raise ProtocolError(
            f"{ep}: names, dtypes and shapes have {len(names)}, {len(raw_dtypes)} and {len(shapes)} entries; "
            "give one of each per tensor."
        )
    load_format = _field(obj, "load_format", str, ep, None)
    if load_format not in (None, FLATTENED_BUCKET):
        raise ProtocolError(
            f"{ep}: load_format {load_format!r} is not supported; send null (one broadcast per tensor) or "
            f"'{FLATTENED_BUCKET}' (one broadcast of the bucket's bytes)."
        )
    return UpdateFromDistributedArgs(
        names=list(names),
        dtypes=[parse_dtype(d, f"{ep} dtypes[{i}]") for i, d in enumerate(raw_dtypes)],
        shapes=[list(s) for s in shapes],
        group_name=_group_name(obj, ep),
        flattened=load_format == FLATTENED_BUCKET,
        **_update_options(obj, ep),
    )


def parse_group_name(payload: Any, endpoint: str) -> str:
    """``group_name`` of a body (default ``weight_update_group``)."""
    return _group_name(_object(payload, endpoint), endpoint)


def parse_memory_tags(payload: Any, endpoint: str) -> list[str] | None:
    """The ``tags`` of a ``/release_memory_occupation`` or ``/resume_memory_occupation`` body (None: all)."""
    tags = _field(_object(payload, endpoint), "tags", list, endpoint, None)
    if tags is not None and not all(type(t) is str for t in tags):
        raise ProtocolError(f"{endpoint}: tags must be a list of strings, got {tags!r}.")
    return tags


@dataclass
class UpdateFromTensorArgs(UpdateOptions):
    """A parsed ``/update_weights_from_tensor`` body."""

    serialized: str
    """The one rank's ``serialized_named_tensors`` entry (``archon.wire.tensor_ipc``)."""


def parse_update_from_tensor(payload: Any) -> UpdateFromTensorArgs:
    ep = "/update_weights_from_tensor"
    obj = _object(payload, ep)
    entries = _field(obj, "serialized_named_tensors", list, ep)
    if len(entries) != 1 or type(entries[0]) is not str:
        raise ProtocolError(
            f"{ep}: serialized_named_tensors must hold one string (one per tensor-parallel rank, and the built-in "
            f"server runs one), got {len(entries)} entries."
        )
    load_format = _field(obj, "load_format", str, ep, None)
    if load_format is not None:
        raise ProtocolError(
            f"{ep}: load_format {load_format!r} is not supported; send (name, tensor) pairs under Hugging Face "
            "names without a load_format."
        )
    _field(obj, "flush_cache", bool, ep, True)  # accepted: no prefix cache is kept across requests
    return UpdateFromTensorArgs(serialized=entries[0], **_update_options(obj, ep))
