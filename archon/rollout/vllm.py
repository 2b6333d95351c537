"""The rollout client's adapter to vLLM's HTTP API (launching is ``archon.launch.server_commands``).

Written against vLLM 0.33.0's own source (``vllm/entrypoints/openai/completion``,
``vllm/entrypoints/rl/online/api_router.py``, ``vllm/entrypoints/serve/dev``,
``vllm/v1/sample/sampler.py``):

- Generation goes through the OpenAI completions API with the prompt as token ids,
  ``logprobs: 0`` (the sampled token's logprob only), ``return_token_ids`` (the generated ids,
  EOS or stop token included) and ``return_tokens_as_token_ids`` (``"token_id:N"`` strings, so
  the ids are checked against the logprobs).  SGLang-style ``sampling_params`` are translated
  field by field (``max_new_tokens`` -> ``max_tokens``, ``min_new_tokens`` -> ``min_tokens``,
  ``sampling_seed`` -> ``seed``, ...); penalties are sent neutral so no server-side generation
  config applies.  Finish reasons are ``stop`` (EOS or a stop token, checked before the length
  budget, as in SGLang), ``length`` and ``abort``.
- Logprobs: vLLM reports ``raw_logprobs`` (``log_softmax`` of the raw logits, before
  temperature and every filter) by default, or ``processed_logprobs`` (after temperature,
  min-tokens, min-p, top-k and top-p).  The trainer recomputes ``log_softmax(logits / T)``
  before filtering, so ``vllm_logprobs_mode`` picks ``raw_logprobs`` where T = 1 (temperature
  1, greedy, or top_k = 1, which the trainer treats as greedy) and ``processed_logprobs`` for
  another temperature when nothing filters; any other combination has no matching vLLM mode
  and is refused at config check.
- Weights come from disk only: ``/pause?mode=wait`` (drain), ``/collective_rpc`` with method
  ``reload_weights`` and ``weights_path`` (in-place reload of the folder's safetensors; a model
  with tied word embeddings is served and synced untied, ``archon.rollout.tied_embeddings``),
  ``/reset_prefix_cache``, ``/update_weight_version`` and ``/resume``.  These are development
  endpoints: vLLM serves them only with ``VLLM_SERVER_DEV_MODE=1``, which the launcher sets.
  If a reload fails the server stays paused, so it never generates from half-loaded weights.
  Completions report the weights that produced them (``return_weight_versions``).
- Memory (``vllm/entrypoints/serve/dev/sleep/api_router.py``, also development endpoints; sleep mode needs
  ``--enable-sleep-mode`` and a GPU, vLLM's CPU worker ignores it): releasing the weights is
  ``/sleep?level=2&mode=wait`` (running requests finish first; level 2 discards weights and KV cache, as
  SGLang's release does, level 1 would keep a CPU copy of the weights that the next update overwrites
  anyway); releasing only the KV cache is ``/release_kv_cache_memory``.  Resuming the weights alone is
  ``/wake_up?tags=weights`` (room to load new weights before the KV cache returns), anything else is
  ``/wake_up``, which wakes everything.
- Weights from tensors (colocated servers, ``rollout.weight_sync = 'tensor'``, CUDA only): vLLM's IPC
  weight-transfer engine (0.32: ``vllm/entrypoints/rl/online/api_router.py``,
  ``vllm/distributed/weight_transfer/ipc_engine.py``), started with ``--weight-transfer-config
  '{"backend": "ipc"}'`` and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: ``/init_weight_transfer_engine`` once,
  then per sync ``/start_weight_update``, one ``/update_weights`` per bucket (CUDA IPC handles keyed by GPU
  UUID, ``archon.wire.vllm_ipc``), ``/finish_weight_update`` with the version and ``/reset_prefix_cache``.
  Colocated runs are synchronous, so nothing generates meanwhile and no pause is needed.
- Per-request seeds are always honoured by vLLM's sampler, but the logits themselves depend on
  the batch unless ``VLLM_BATCH_INVARIANT=1`` (``vllm.batch_invariant``).
"""

from __future__ import annotations

from typing import Any

from archon.rollout.server_api import Call, GenerateResult, RolloutError, ServerAPI, check_logprob_count
from archon.wire.sglang import SGLANG_DEFAULT_MAX_NEW_TOKENS
from archon.wire.vllm_ipc import IPC_INIT_INFO, vllm_update_info

# SGLang sampling_params key -> vLLM completions field.
_FIELDS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "sampling_seed": "seed",
    "n": "n",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
}
# SGLang's defaults where vLLM's differ (vLLM: max_tokens 16, model generation config for the rest).
_DEFAULTS = {
    "max_tokens": SGLANG_DEFAULT_MAX_NEW_TOKENS,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
_TOKEN_ID_PREFIX = "token_id:"
_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class VLLMAPI(ServerAPI):
    """RolloutClient's requests spelled in vLLM's OpenAI completions and RL endpoints."""

    name = "vLLM"
    generate_path = "/v1/completions"
    distributed_weights = False
    tensor_share_format = "vllm_ipc"
    missing_endpoint_hint = (
        "; vLLM serves its pause, resume and weight-reload endpoints only with "
        "VLLM_SERVER_DEV_MODE=1 (set for launched servers; set it yourself for "
        "rollout.server_addrs) and Archon uses the API of vLLM 0.33"
    )

    def generate_payload(
        self,
        input_ids: list[int],
        params: dict[str, Any],
        return_logprob: bool,
        rid: str,
        return_routed_experts: bool = False,
        lora_name: str = "",
    ) -> dict[str, Any]:
        if return_routed_experts:
            raise RolloutError(
                "vLLM servers do not report the experts each token was routed to; set "
                "actor.moe_routing_replay = false or use an SGLang or built-in rollout backend"
            )
        unknown = sorted(set(params) - set(_FIELDS))
        if unknown:
            raise ValueError(
                f"sampling_params {unknown} have no vLLM equivalent here; use {', '.join(sorted(_FIELDS))}"
            )
        body: dict[str, Any] = dict(_DEFAULTS)
        body.update({_FIELDS[k]: v for k, v in params.items()})
        if body["max_tokens"] is None:
            raise ValueError(
                "sampling_params.max_new_tokens = None (up to the context length) has no vLLM equivalent; give a number"
            )
        if body.get("seed") is None:
            body.pop("seed", None)
        if body.get("ignore_eos"):
            body["stop_token_ids"] = []  # SGLang's ignore_eos ignores stop_token_ids too; vLLM's does not
        body.update(
            {
                "prompt": input_ids,
                "request_id": rid,
                "stream": False,
                "echo": False,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "return_weight_versions": True,
            }
        )
        if return_logprob:
            body["logprobs"] = 0
        if lora_name:
            body["model"] = lora_name  # vLLM selects a loaded adapter by the model name
        return body

    def parse_generate(
        self, body: Any, server: str, return_logprob: bool, weight_version: str, return_routed_experts: bool = False
    ) -> GenerateResult:
        choices = body.get("choices") if isinstance(body, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise RolloutError(
                f"vLLM server {server} answered /v1/completions without choices "
                f"(got {str(body)[:200]!r}); is it a vLLM server?"
            )
        choice = choices[0]
        if choice.get("token_ids") is None:
            raise RolloutError(
                f"vLLM server {server} answered without token_ids; Archon needs a vLLM whose "
                "completions API honours return_token_ids (0.10.2 or later)"
            )
        output_ids = [int(t) for t in choice["token_ids"]]
        logprobs: list[float] = []
        if return_logprob:
            lp = choice.get("logprobs") or {}
            values = lp.get("token_logprobs") or []
            if any(v is None for v in values):
                raise RolloutError(f"vLLM server {server} returned a null logprob; the completion cannot be trained on")
            logprobs = [float(v) for v in values]
            check_logprob_count(server, output_ids, logprobs)
            tokens = lp.get("tokens") or []
            named = [int(t[len(_TOKEN_ID_PREFIX) :]) for t in tokens if str(t).startswith(_TOKEN_ID_PREFIX)]
            if len(named) == len(tokens) and named and named != output_ids:
                raise RolloutError(
                    f"vLLM server {server} returned logprobs for tokens {named[:8]}.. but token_ids "
                    f"{output_ids[:8]}..; the completion cannot be trained on"
                )
        reason = str(choice.get("finish_reason") or "")
        stop_reason = choice.get("stop_reason")
        matched = None
        if reason == "stop" and output_ids:
            # vLLM names the stop token in stop_reason; EOS leaves it null but is the last token.
            matched = stop_reason if isinstance(stop_reason, int) else output_ids[-1]
        spans = choice.get("weight_versions") or []
        latest = spans[-1].get("version") if spans and isinstance(spans[-1], dict) else None
        version = weight_version if latest is None else str(latest)
        prompt_ids = choice.get("prompt_token_ids")
        usage = body.get("usage") or {}
        prompt_tokens = len(prompt_ids) if prompt_ids is not None else int(usage.get("prompt_tokens", 0))
        return GenerateResult(
            output_ids=output_ids,
            output_logprobs=logprobs,
            finish_reason=reason,
            prompt_tokens=prompt_tokens,
            weight_version=version,
            server=server,
            matched_stop=matched,
            output_versions=[version] * len(output_ids),
        )

    def abort(self, rid: str) -> Call | None:
        return None  # vLLM aborts a request whose connection drops (with_cancellation)

    def pause(self, mode: str | None = None) -> list[Call]:
        if mode not in (None, "abort"):
            raise RolloutError(
                f"vLLM servers cannot pause in mode {mode!r}; set rollout.pause_generation_mode = "
                "'abort' (interrupted requests are then sent again with their tokens so far)"
            )
        return [Call("POST", "/pause?mode=abort")]  # like SGLang's: running requests end with 'abort'

    def resume(self) -> list[Call]:
        return [Call("POST", "/resume")]

    def flush_cache(self) -> list[Call]:
        return [Call("POST", "/reset_prefix_cache")]

    def update_weights_from_disk(self, path: str, version: str, abort_all_requests: bool) -> list[Call]:
        # Drained first, so no request mixes weights; resumed only after every step succeeded.
        return [
            Call("POST", f"/pause?mode={'abort' if abort_all_requests else 'wait'}"),
            Call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}),
            Call("POST", "/reset_prefix_cache"),
            Call("POST", "/update_weight_version", {"new_version": version}),
            Call("POST", "/resume"),
        ]

    def load_lora_adapter(self, name: str, path: str, version: str) -> list[Call]:
        # Runtime loading needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora (set by the launcher).
        # A new name every sync: vLLM refuses a loaded name unless load_inplace, and caches adapters by id.
        return [
            Call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}),
            Call("POST", "/update_weight_version", {"new_version": version}),
        ]

    def unload_lora_adapter(self, name: str) -> list[Call]:
        # Requests already running keep the adapter they were admitted with.
        return [Call("POST", "/v1/unload_lora_adapter", {"lora_name": name})]

    def release_memory(self, tags: list[str] | None) -> list[Call]:
        released = _check_tags(tags)
        if "weights" in released:
            return [Call("POST", "/sleep?level=2&mode=wait")]
        if "kv_cache" in released:
            return [Call("POST", "/release_kv_cache_memory")]
        raise RolloutError(
            "vLLM releases its CUDA graphs only with its weights (sleep); release 'weights' or 'kv_cache' as well"
        )

    def resume_memory(self, tags: list[str] | None) -> list[Call]:
        if set(_check_tags(tags)) == {"weights"}:
            return [Call("POST", "/wake_up?tags=weights")]
        return [Call("POST", "/wake_up")]

    def setup_tensor_weights(self) -> list[Call]:
        return [Call("POST", "/init_weight_transfer_engine", {"init_info": IPC_INIT_INFO})]

    def update_weights_from_tensor(
        self, parts: list[Any], version: str | None, flush_cache: bool, abort_all_requests: bool, first: bool
    ) -> list[Call]:
        # parts: one archon.wire.vllm_ipc part per GPU of the server, merged into one update.
        calls = [Call("POST", "/start_weight_update")] if first else []
        calls.append(Call("POST", "/update_weights", {"update_info": vllm_update_info(parts)}))
        if version is not None:
            calls += [
                Call("POST", "/finish_weight_update", {"weight_version": version}),
                Call("POST", "/reset_prefix_cache"),
            ]
        return calls


def _check_tags(tags: list[str] | None) -> list[str]:
    """SGLang's memory tags (None or empty: all); a RolloutError names an unknown one."""
    if not tags:
        return list(_MEMORY_TAGS)
    unknown = sorted(set(tags) - set(_MEMORY_TAGS))
    if unknown:
        raise RolloutError(f"unknown memory tag(s) {unknown}; use any of {list(_MEMORY_TAGS)} (None: all)")
    return list(tags)
