"""How the rollout client's requests are spelled for one server family.

``ServerAPI`` is SGLang's HTTP protocol (which the built-in server speaks too):
``/generate`` with ``input_ids`` and ``sampling_params``, and SGLang's control endpoints.
Other backends subclass it (``archon.rollout.vllm.VLLMAPI``); the client's ``Transport`` owns the
connections and fan-out, ``GenerateRequests`` the retries, and every backend returns the same ``GenerateResult``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from archon.config import ConfigError, GenerationConfig
from archon.errors import ArchonError

# SGLang's /health runs a one-token generation and answers after at least 1 s, up to its own
# 20 s HEALTH_CHECK_TIMEOUT under load; a shorter probe would call a busy server dead.
HEALTH_PROBE_TIMEOUT_S = 30.0


class RolloutError(ArchonError, RuntimeError):
    """A rollout server failed, refused a request, or cannot be reached; the message names it."""


class RolloutRequestError(RolloutError):
    """A server rejected a request with an HTTP 4xx; retrying the same request would not help."""

    def __init__(self, server: str, status: int, message: str):
        super().__init__(f"rollout server {server} rejected the request with HTTP {status}: {message}")
        self.server = server
        self.status = status
        self.message = message


@dataclass
class GenerateResult:
    """One completion and its behaviour-policy logprobs."""

    output_ids: list[int]
    """Generated token ids (prompt excluded)."""
    output_logprobs: list[float]
    """Logprob of each generated token under the server's weights; empty if logprobs were not asked for."""
    finish_reason: str
    """'stop' (EOS or a stop token), 'length' (max_new_tokens or context) or 'abort'."""
    prompt_tokens: int
    """Prompt length as the server counted it."""
    weight_version: str
    """Version of the weights that produced the completion."""
    server: str
    """Address of the server that answered."""
    matched_stop: int | None = None
    """Token id that ended the completion when finish_reason is 'stop' (None if unknown)."""
    routed_experts: Any = None
    """Flat int32 numpy array of the experts chosen for every token the server ran (prompt, then
    each generated token but the last), SGLang's ``meta_info["routed_experts"]`` decoded; its
    shape is ``[tokens, num_hidden_layers, top_k]``.  None unless requested."""
    output_versions: list[str] = field(default_factory=list)
    """Weight version of each generated token (``token_versions``)."""


@dataclass(frozen=True)
class Call:
    """One HTTP call of a control operation."""

    method: str
    """HTTP method."""
    path: str
    """Path, with its query string if any."""
    payload: Any = None
    """JSON body (None: no body)."""


class ServerAPI:
    """How the client's requests are spelled for one server family: SGLang's HTTP protocol.

    Subclasses map the same operations onto another server's API; each control operation is
    a list of calls made in order on every server.
    """

    name = "SGLang"
    """Server family, for error messages."""
    generate_path = "/generate"
    """Path of a generate request."""
    distributed_weights = True
    """Whether the servers can join a weight-update group (update_weights_from_distributed)."""
    missing_endpoint_hint = ""
    """Appended to the error when a control endpoint answers HTTP 404."""
    batch_generate = False
    """Whether generate requests made together are sent as one batched request (``archon.rollout.batching``)."""
    priority_field = False
    """Whether the servers admit requests by SGLang's ``priority`` field (sent only then)."""
    tensor_share_format = "sglang"
    """The form of a shared tensor part (``archon.wire.tensor_share.SHARE_TENSORS``)."""

    def generate_payload(
        self,
        input_ids: list[int],
        params: dict[str, Any],
        return_logprob: bool,
        rid: str,
        return_routed_experts: bool = False,
        lora_name: str = "",
    ) -> dict[str, Any]:
        """Body of one generate request; ``params`` are SGLang ``sampling_params``; ``lora_name``: the loaded
        adapter it runs with (SGLang's ``lora_path`` takes an adapter's name; "": none)."""
        payload = {
            "input_ids": input_ids,
            "sampling_params": dict(params),
            "return_logprob": return_logprob,
            "rid": rid,
        }
        if return_routed_experts:
            payload["return_routed_experts"] = True
        if lora_name:
            payload["lora_path"] = lora_name
        return payload

    def parse_generate(
        self, body: Any, server: str, return_logprob: bool, weight_version: str, return_routed_experts: bool = False
    ) -> GenerateResult:
        """The answer to a generate request; ``weight_version`` is what the client last set on the server."""
        if not isinstance(body, dict) or "output_ids" not in body or "meta_info" not in body:
            raise RolloutError(
                f"rollout server {server} answered /generate without output_ids/meta_info "
                f"(got {str(body)[:200]!r}); is it an SGLang-protocol server started with "
                "--skip-tokenizer-init?"
            )
        meta = body["meta_info"]
        output_ids = [int(t) for t in body["output_ids"]]
        logprobs: list[float] = []
        if return_logprob:
            entries = meta.get("output_token_logprobs") or []
            logprobs = [float(e[0]) for e in entries]
            check_logprob_count(server, output_ids, logprobs)
        finish = meta.get("finish_reason")
        matched = None
        if isinstance(finish, dict):
            reason = str(finish.get("type", ""))
            if isinstance(finish.get("matched"), int):
                matched = finish["matched"]
        else:
            reason = str(finish or "")
        routed = decode_routed_experts(meta.get("routed_experts"), server) if return_routed_experts else None
        return GenerateResult(
            output_ids=output_ids,
            output_logprobs=logprobs,
            finish_reason=reason,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            weight_version=str(meta.get("weight_version", weight_version)),
            server=server,
            matched_stop=matched,
            routed_experts=routed,
            output_versions=token_versions(meta, len(output_ids), weight_version),
        )

    def abort(self, rid: str) -> Call | None:
        """Frees a timed-out request's slot (None: the server does that when the connection drops)."""
        return Call("POST", "/abort_request", {"rid": rid})

    def pause(self, mode: str | None = None) -> list[Call]:
        """``mode``: SGLang's ('abort', 'retract', 'in_place'; None: the server's default, abort)."""
        return [Call("POST", "/pause_generation", {"mode": mode} if mode else {})]

    def resume(self) -> list[Call]:
        return [Call("POST", "/continue_generation", {})]

    def flush_cache(self) -> list[Call]:
        return [Call("POST", "/flush_cache")]

    def update_weights_from_disk(self, path: str, version: str, abort_all_requests: bool) -> list[Call]:
        return [
            Call(
                "POST",
                "/update_weights_from_disk",
                {"model_path": path, "weight_version": version, "abort_all_requests": abort_all_requests},
            )
        ]

    def load_lora_adapter(self, name: str, path: str, version: str) -> list[Call]:
        """Load the PEFT adapter folder ``path`` as ``name`` (a server started with ``--enable-lora``), then report
        ``version`` (SGLang's ``/update_weight_version``: its load carries no version)."""
        return [
            Call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path}),
            Call("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False}),
        ]

    def unload_lora_adapter(self, name: str) -> list[Call]:
        """Unload adapter ``name`` (SGLang lets requests that use it finish first)."""
        return [Call("POST", "/unload_lora_adapter", {"lora_name": name})]

    def release_memory(self, tags: list[str] | None) -> list[Call]:
        """Give the memory of ``tags`` back ('weights', 'kv_cache', 'cuda_graph'; None: all), SGLang's
        ``/release_memory_occupation``; requests wait until it is resumed."""
        return [Call("POST", "/release_memory_occupation", {"tags": tags})]

    def resume_memory(self, tags: list[str] | None) -> list[Call]:
        """Take the memory of ``tags`` again (None: all); resumed weights hold no values until the next update."""
        return [Call("POST", "/resume_memory_occupation", {"tags": tags})]

    def setup_tensor_weights(self) -> list[Call]:
        """Once before the first ``update_weights_from_tensor`` (SGLang needs nothing)."""
        return []

    def update_weights_from_tensor(
        self, parts: list[Any], version: str | None, flush_cache: bool, abort_all_requests: bool, first: bool
    ) -> list[Call]:
        """Load tensors shared on the machine: ``parts`` holds one ``archon.wire.tensor_ipc`` string per
        tensor-parallel rank of the server; ``first``: the first bucket of a sync (SGLang needs no start)."""
        payload: dict[str, Any] = {
            "serialized_named_tensors": parts,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if version is not None:
            payload["weight_version"] = version
        return [Call("POST", "/update_weights_from_tensor", payload)]


def token_versions(meta: dict[str, Any], n_tokens: int, default: str = "") -> list[str]:
    """The weight version that produced each of ``n_tokens`` generated tokens, from a ``meta_info``.

    SGLang (0.5.x and later) and the built-in server report ``weight_versions``, spans
    ``{"version", "start", "end"}`` over the generated tokens; a request paused in retract mode
    across a weight update has several.  Tokens no span covers (older servers report no spans)
    get ``weight_version``, the version when the answer was made (``default`` if absent).
    """
    fallback = str(meta.get("weight_version", default))
    versions: list[str | None] = [None] * n_tokens
    for span in meta.get("weight_versions") or []:
        if isinstance(span, dict):
            version, start, end = span.get("version"), span.get("start", 0), span.get("end", 0)
        else:  # SGLang's msgspec form is array-like: [version, start, end]
            version, start, end = span
        lo, hi = max(0, int(start)), min(n_tokens, int(end))
        versions[lo:hi] = [str(version)] * max(0, hi - lo)
    return [fallback if v is None else v for v in versions]


def decode_routed_experts(value: Any, server: str) -> Any:
    """SGLang's base64 encoding of int32 expert ids (``meta_info["routed_experts"]``) -> flat numpy array."""
    import base64

    import numpy as np

    if not isinstance(value, str):
        raise RolloutError(
            f"rollout server {server} was asked for routed experts but answered without them (got "
            f"{type(value).__name__}); start SGLang with --enable-return-routed-experts"
        )
    return np.frombuffer(base64.b64decode(value), dtype=np.int32)


def check_logprob_count(server: str, output_ids: list[int], logprobs: list[float]) -> None:
    """A completion is only trainable with one logprob per token."""
    if len(logprobs) != len(output_ids):
        raise RolloutError(
            f"rollout server {server} returned {len(output_ids)} tokens but {len(logprobs)} "
            "logprobs; the completion cannot be trained on"
        )


def normalize_addr(addr: str) -> str:
    """'host:port' or 'http://host:port[/]' -> 'http://host:port'."""
    addr = addr.strip().rstrip("/")
    if not addr:
        raise ConfigError("a rollout server address is empty; write it as host:port, e.g. 127.0.0.1:30000")
    return addr if "://" in addr else f"http://{addr}"


def sampling_params(gconfig: GenerationConfig, **overrides: Any) -> dict[str, Any]:
    """SGLang ``sampling_params`` from the run's generation config (overrides win).

    Every field of ``GenerationConfig`` but ``n_samples`` (samples per prompt, the trainer's
    business) carries SGLang's name, so the fields map one to one.
    """
    params = {k: v for k, v in dataclasses.asdict(gconfig).items() if k != "n_samples"}
    params.update(overrides)
    return params


def error_message(body: Any, text: str) -> str:
    """The human part of an error body: SGLang answers {'error': {'message'}}, {'message'} or plain text."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    return text.strip()[:2000] or "(empty body)"


class BuiltinServerAPI(ServerAPI):
    """The built-in server's: SGLang's protocol, with requests made together sent as one batch.

    Its per-request HTTP handling costs as much as a small model's generation on CPU, so
    batching pays; SGLang's own batched form is not the default for SGLang servers, whose
    per-request cost is small next to a GPU generation (and is not exercised here).  It admits
    requests by SGLang's ``priority`` field (SGLang itself only with ``--enable-priority-scheduling``).
    """

    batch_generate = True
    priority_field = True

    def load_lora_adapter(self, name: str, path: str, version: str) -> list[Call]:
        # The built-in server merges the adapter into its weights and takes the version with them, in one step.
        return [Call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path, "weight_version": version})]
