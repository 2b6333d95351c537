"""The config schema: nested dataclasses with a one-line doc under every field.

Section and key names follow AReaL's wherever AReaL has one.  ``critic``, ``ref`` and
``teacher`` have the shape of ``actor``'s engine fields and inherit every one of them from
``actor`` unless set explicitly (``archon.config.loading``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from archon.alloc import AllocationError, ModelAllocation
from archon.config.archon_engine import ArchonEngineConfig
from archon.config.dataset import DatasetConfig
from archon.config.evaluator import EvaluatorConfig, ValidDatasetConfig
from archon.config.lora import LoRAConfig
from archon.config.scheduler import SchedulerConfig
from archon.config.stats_logger import StatsLoggerConfig
from archon.errors import ArchonError
from archon.wire.sglang import SGLangSampling


class ConfigError(ArchonError, ValueError):
    """A config file, key or value a user wrote is wrong; the message says where and how to fix it."""


# --------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------

NormLevel = Literal["batch", "group", "none"]


@dataclass
class ClusterConfig:
    n_nodes: int = 1
    """Number of nodes in the cluster."""
    n_gpus_per_node: int = 8
    """Accelerators per node; on a CPU-only machine, the number of processes per node the run may use."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB (an 80 GB H100 or A100: 80), for the memory-fit check of `python -m archon.plan`."""
    pin_cpu_cores: bool = False
    """Give each CPU training rank and built-in rollout server its own share of the cores
    (archon.runtime.cpu_pinning)."""


@dataclass
class OptimizerConfig:
    type: Literal["adamw", "adamw_8bit", "adamw_fp8"] = "adamw"
    """AdamW: 'adamw' (torch, float32 state), or torchao's low-bit state (fp8 extra): 'adamw_8bit' or 'adamw_fp8'."""
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1 and beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate shape after warmup."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine/linear schedule, as a fraction of `lr`."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (the norm is still reported)."""


@dataclass
class MicroBatchSpec:
    n_mbs: int = 1
    """Minimum number of microbatches per data-parallel rank and optimizer step."""
    max_tokens_per_mb: int = 0
    """Upper bound on packed tokens in one microbatch (more microbatches are made if needed); 0 means no bound."""


@dataclass
class TrainEngineConfig:
    backend: str = ""
    """Allocation string for this engine, e.g. 'archon:d4p2t2' (see the allocation grammar)."""
    path: str = ""
    """Hugging Face model folder (config.json + safetensors); empty initialises from `model_config`."""
    model_config: str = ""
    """Folder or config.json used to build an uninitialised model when `path` is empty."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter dtype for compute (FSDP mixed precision; master weights stay float32); unset: bfloat16 on CUDA,
    float32 on CPU."""
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of gradient reduce-scatter/all-reduce."""
    gradient_checkpointing: bool = False
    """Turn on activation checkpointing with `archon.ac_mode`."""
    pad_to_maximum: bool = False
    """Pad every microbatch to `mb_spec.max_tokens_per_mb` (fixed shapes); set automatically, with a note at start,
    when `archon.enable_compile` is on and `mb_spec.max_tokens_per_mb` is set."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    """How a data-parallel rank's share of the batch is cut into packed microbatches."""
    archon: ArchonEngineConfig = field(default_factory=ArchonEngineConfig)
    """Engine options; the fsdp: engine reads the activation checkpointing, compile, FSDP and determinism ones too."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters (LoRA) on the archon: and fsdp: engines: base frozen, adapters trained and exported."""


@dataclass
class NormConfig:
    mean_level: NormLevel = "group"
    """Subtract the mean over the 'group' of samples of one prompt, the whole 'batch', or 'none'."""
    std_level: NormLevel = "group"
    """Divide by the std over 'group', 'batch', or 'none' (Dr.GRPO uses none); as in AReaL the std is the spread around
    the subtracted mean (around 0 when mean_level is 'none')."""
    mean_leave1out: bool = False
    """Use the leave-one-out mean (each sample's baseline excludes itself)."""
    std_unbiased: bool = True
    """Unbiased (n-1) standard deviation."""
    eps: float = 1e-5
    """Added to the std before dividing."""
    group_size: int = 0
    """Samples per group; 0 takes `actor.group_size`."""

    @property
    def is_identity(self) -> bool:
        """Both levels 'none': the values are left as they are."""
        return self.mean_level == "none" and self.std_level == "none"


def default_norms(adv_estimator: str) -> tuple[NormConfig, NormConfig]:
    """``(reward_norm, adv_norm)`` of an estimator when the user sets neither (applied by load_config): GRPO
    normalises rewards by group mean/std (the schema's defaults); PPO with a critic ('gae', standard PPO) leaves
    rewards raw, as AReaL leaves reward_norm unset, and whitens advantages over the batch (AReaL's PPO recipe; verl
    always whitens GAE advantages)."""
    if adv_estimator == "gae":
        return NormConfig(mean_level="none", std_level="none"), NormConfig(mean_level="batch", std_level="batch")
    return NormConfig(), NormConfig(mean_level="none", std_level="none")


RSLevel = Literal["token", "sequence", "none"]


@dataclass
class RejectionSamplingConfig:
    level: RSLevel = "token"
    """Decoupled loss: judge each 'token' or each 'sequence' by its divergence pi_prox/pi_behav; 'none' applies no
    behaviour correction at all (AReaL's rejection_sampling = null)."""
    action: Literal["mask", "clamp"] = "mask"
    """'mask' drops out-of-bounds tokens from the policy gradient (they still count in the normalisation, as in AReaL);
    'clamp' bounds their importance weight to [lower or 0, upper] (metric 'ratio' only)."""
    metric: Literal["ratio", "kl_k1", "kl_k2", "kl_k3"] = "ratio"
    """Divergence judged: the importance ratio pi_prox/pi_behav, or a k1/k2/k3 KL estimate of the two logprobs."""
    agg: Literal["sum", "mean", "max"] = "mean"
    """level 'sequence': aggregate of the token metric over the sequence (for 'ratio' in log space, so 'mean' is the
    geometric mean, which is also then every token's weight)."""
    upper: float = 5.0
    """Upper bound of the metric (above 1 for 'ratio'); AReaL's pre-0.5 default cap (behave_imp_weight_cap = 5, token
    mask)."""
    lower: float = float("-inf")
    """Lower bound of the metric; -inf means none."""


@dataclass
class DynamicFilterConfig:
    enable: bool = False
    """DAPO dynamic sampling (verl's algorithm.filter_groups, AReaL's dynamic_filter_fn): drop prompt groups whose raw
    rewards are all equal (they have no GRPO signal) and refill the batch from new prompts."""
    max_num_gen_batches: int = 10
    """Rollout rounds per step at most, the first included (verl's name); 0 means no limit (verl's default, which loops
    forever when no prompt ever mixes). When the limit is hit, the batch is completed with dropped groups (counted in
    dynamic_filter/taken_back_groups) instead of verl's error."""


@dataclass
class ActorConfig(TrainEngineConfig):
    backend: str = "archon:d1"
    offload: bool = False
    """Offload the parameters and optimizer state to CPU while colocated servers generate (AReaL's actor.offload)."""
    group_size: int = 0
    """Rows that form one group for group-normalised advantages; 0 uses gconfig.n_samples (must divide it)."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per pass over the rollout batch (the batch is cut into this many minibatches)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per RL step (verl's ppo_epochs); ppo_epochs * ppo_n_minibatches optimizer steps."""
    shuffle: bool = False
    """Shuffle the rows into different minibatches before every pass (verl's actor.shuffle), seeded by `seed` and the
    optimizer step so that allocations and resumed runs agree; off keeps contiguous minibatches."""
    recompute_logprob: bool = False
    """Recompute proximal logprobs with the trainer before the update instead of using the rollout's."""
    moe_routing_replay: bool = False
    """MoE: ask the servers for the experts each token was routed to and use those in every actor forward."""
    use_decoupled_loss: bool = False
    """Decoupled PPO: behaviour logprobs from the rollout, proximal logprobs recomputed by the trainer."""
    proximal_from_update: bool = True
    """With one optimizer step per RL step, proximal logprobs come from its own forward, not one more (PPOActor)."""
    adv_estimator: Literal["grpo", "gae", "rloo", "reinforce++"] = "grpo"
    """Advantage estimator; 'gae' needs a critic."""
    eps_clip: float = 0.2
    """PPO ratio clip (lower side, and upper side unless `eps_clip_higher` is set)."""
    eps_clip_higher: float = 0.0
    """Upper clip for the ratio (DAPO clip-higher); 0 uses `eps_clip`."""
    c_clip: float = 0.0
    """Dual-clip constant (> 1) for negative advantages; 0 disables dual clip."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO) or per sequence (GSPO, with each sequence's mean advantage as AReaL); the GSPO
    objective exactly needs loss_agg_mode 'seq-mean-token-mean' (verl's gspo loss always uses it), while 'token-mean'
    weighs sequences by length, as AReaL does."""
    rejection_sampling: RejectionSamplingConfig = field(default_factory=RejectionSamplingConfig)
    """Decoupled loss: behaviour importance weight pi_prox/pi_behav and which tokens keep it (AReaL's
    rejection_sampling); Archon's default is on (ratio <= 5, token mask) where AReaL's is off."""
    temperature: float = 0.0
    """Trainer logprobs are of logits / temperature; 0 follows gconfig.temperature (1 when greedy: temperature 0 or
    top_k 1), as the server reports."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus: entropy_coef * (entropy aggregated like the loss) is subtracted from the actor loss
    (verl's entropy_coeff)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses are aggregated over the global batch; 'seq-mean-token-sum-norm' is Dr.GRPO's mean over
    sequences of token sums / gconfig.max_new_tokens, which is verl's loss divided by its per-GPU micro-batch size (see
    archon.rl.losses)."""
    kl_ctl: float = 0.0
    """Coefficient of the KL-to-reference penalty inside the reward (the initial one when kl_ctl_type is 'adaptive'); 0
    disables it."""
    kl_ctl_type: Literal["fixed", "adaptive"] = "fixed"
    """'adaptive': after each step kl_ctl *= 1 + clip(kl / kl_ctl_target - 1, -0.2, 0.2) * samples / kl_ctl_horizon
    (verl's algorithm.kl_ctrl.type; the coefficient is checkpointed)."""
    kl_ctl_target: float = 0.1
    """Target of the per-sequence mean penalty KL for the adaptive controller (verl's kl_ctrl.target_kl)."""
    kl_ctl_horizon: float = 10000.0
    """Horizon, in samples, of the adaptive controller (verl's kl_ctrl.horizon)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator of the penalty inside the reward (AReaL's kl_estimator; verl's algorithm.kl_penalty)."""
    kl_loss_coef: float = 0.0
    """KL-to-reference term inside the loss; 0 disables it."""
    kl_loss_type: Literal["k1", "k2", "k3", "k1+", "k3+", "kl", "mse", "low_var_kl", "kl+", "low_var_kl+"] = (
        "low_var_kl"
    )
    """KL estimator of the loss term (verl's kl_loss_type): low_var_kl = k3, whose gradient is that of KL(ref||pi); k2
    (mse) and the straight-through k1+/k3+ (value of k1/k3) have the gradient of KL(pi||ref); k1 (kl) has zero expected
    gradient."""
    kd_coef: float = 0.0
    """On-policy distillation: weight of the reverse KL to the teacher (`teacher.*`) on the sampled tokens in the loss;
    0 disables it and the teacher."""
    kd_estimator: Literal["k1", "k2", "k3", "k1+", "k3+", "kl", "mse", "low_var_kl", "kl+", "low_var_kl+"] = "k2"
    """Estimator of the distillation KL (choices as kl_loss_type); k2's and k3+'s gradients are the reverse KL's on
    on-policy samples, k1's averages to zero."""
    discount: float = 1.0
    """Discount factor (GAE, REINFORCE++)."""
    gae_lambda: float = 1.0
    """GAE lambda."""
    reward_scaling: float = 1.0
    """Rewards are (reward + reward_bias) * reward_scaling, then clipped."""
    reward_bias: float = 0.0
    """Added to every reward before scaling."""
    reward_clip: float = 20.0
    """Rewards are clipped to [-reward_clip, reward_clip]."""
    overlong_reward_penalty: bool = False
    """DAPO overlong penalty on responses longer than max_new_tokens - overlong_tokens."""
    overlong_tokens: int = 0
    """Length of the soft overlong-penalty window."""
    overlong_penalty_factor: float = 1.0
    """Penalty at the end of the overlong window."""
    mask_no_eos_with_zero: bool = False
    """Responses cut off without EOS get a final reward of 0 after reward_norm (AReaL's behaviour); they still train, so
    with adv_norm a 0 can become a negative advantage; overlong_filtering drops them from the loss instead."""
    overlong_filtering: bool = False
    """DAPO overlong filtering: responses cut off without EOS leave the actor loss and adv_norm's statistics (they still
    count in reward_norm's groups)."""
    bootstrap_truncated: bool = True
    """'gae': a response cut off without EOS bootstraps from the critic's value of the state after its last token
    (AReaL); false treats truncation as the episode's end (verl)."""
    reward_norm: NormConfig = field(default_factory=NormConfig)
    """Normalisation of sequence rewards ('grpo', 'gae'). Default: group mean/std for 'grpo'; for 'gae', unless set,
    none (standard PPO; AReaL leaves it unset). Group levels need groups of more than one sample."""
    adv_norm: NormConfig = field(default_factory=lambda: NormConfig(mean_level="none", std_level="none"))
    """Final normalisation of token advantages. Default: none; for 'gae', unless set, batch mean/std (AReaL's PPO
    recipe; verl always whitens GAE advantages)."""


@dataclass
class CriticConfig(TrainEngineConfig):
    ppo_n_minibatches: int = 1
    """Critic optimizer steps per pass over the rollout batch."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per RL step (verl's critic.ppo_epochs)."""
    shuffle: bool = False
    """Shuffle the rows into different minibatches before every pass, seeded like actor.shuffle."""
    eps_clip: float = 0.5
    """Value clip: new values are kept within old values +- eps_clip; 0 disables clipping."""
    loss_fn_type: Literal["mse", "huber"] = "mse"
    """Value loss: 0.5 * err^2, or Huber (0.5 * err^2 below huber_delta, linear above), as AReaL's
    ppo_critic_loss_fn."""
    huber_delta: float = 10.0
    """Where the Huber value loss turns linear (AReaL's fixed value)."""
    mask_no_eos_with_zero: bool = False
    """Give zero loss weight to responses cut off without EOS."""


@dataclass
class GenerationConfig(SGLangSampling):
    """The run's sampling.  Every field but ``n_samples`` is sent with each request under SGLang's name
    (``archon.rollout.server_api.sampling_params``), so a server's own defaults never apply to Archon's requests.
    The sampling fields, their docs and defaults are SGLang's (``archon.wire.sglang``), but ``max_new_tokens``."""

    max_new_tokens: int = 512
    """Maximum completion length (sent with every request; a request without one gets SGLang's 128)."""
    n_samples: int = 1
    """Completions sampled per prompt."""


@dataclass
class RolloutConfig:
    backend: str = "local:d1"
    """Inference allocation: 'sglang:dNtM' (N servers of M GPUs), 'vllm:dNtMpK' (N servers of M*K GPUs), 'local:dN' (N
    built-in CPU servers) or 'inprocess:dN' (the built-in generator inside each of the actor's N ranks, no server)."""
    colocate: bool = False
    """Servers and training ranks take turns on the same GPUs (AReaL's "colocation"): server i runs on the GPUs of
    training ranks i*size..(i+1)*size-1, so the rollout's d*t*p must equal the actor's world size; the servers release
    their memory while the trainer trains (sglang.mem_fraction_static, vllm.gpu_memory_utilization: 0.5 by default)."""
    server_addrs: list[str] = field(default_factory=list)
    """host:port of servers already running; when set, no servers are launched."""
    request_timeout: float = 3600.0
    """Seconds before one generate request is abandoned."""
    request_retries: int = 3
    """Retries (with backoff) of a request after a connection error or a 5xx."""
    setup_timeout: float = 300.0
    """Seconds to wait for launched servers to become healthy."""
    weight_sync: Literal["distributed", "disk", "tensor"] = "distributed"
    """How new weights reach the servers: a broadcast group, an HF folder on shared disk (vllm: disk only), or, for
    colocated servers (their default), the trainer's own tensors by reference (CUDA IPC / shared memory)."""
    lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    """With actor.lora: 'adapter' sends only the adapters (a PEFT folder the servers must read, loaded through
    their LoRA endpoints), 'merged' the merged full weights by rollout.weight_sync; 'auto': adapter unless the
    weights go by 'tensor' or the rollout is in-process."""
    weight_chunk_mb: int = 512
    """Bucket size of the distributed weight broadcast."""
    weight_load_format: Literal["auto", "tensors", "flattened_bucket"] = "auto"
    """How a bucket of the distributed broadcast travels: 'tensors' one broadcast per tensor (every SGLang),
    'flattened_bucket' one broadcast of the bucket's bytes (SGLang's load_format of that name; far fewer round trips
    with many tensors), 'auto' flattened for the built-in servers and per tensor for SGLang."""
    max_concurrent_rollouts: int = 0
    """Requests in flight per trainer process; 0 sends the whole batch at once."""
    max_server_restarts: int = 3
    """Restarts per run of launched servers that died or hung (they get the current weights); others are dropped."""
    max_head_offpolicyness: int = 0
    """Asynchronous RL (AReaL's name): 0 trains synchronously (generate, train, sync weights, repeat); k > 0 keeps
    generating while the trainer trains, and no trajectory enters a batch if the policy version that generated its first
    token is more than k versions behind the one being trained (new prompts wait for the trainer instead). Use with
    actor.use_decoupled_loss."""
    partial_rollout: bool = True
    """Asynchronous RL: a weight update pauses the requests in flight, which then continue with the new weights (every
    token keeps the version that produced it). false: an update waits until every request that may start under the
    current weights has finished, so each batch comes from one policy version and a run is reproducible, at some cost in
    speed."""
    weight_check_freq: int = -1
    """Check that the servers serve the trainer's weights after every N-th weight update (and at start): each server
    samples a short probe whose logprobs the trainer recomputes; a server that disagrees stops the run. -1: every
    update of a synchronous run, every 10th of an asynchronous one (where a check waits for the servers); 0: never."""
    weight_check_tol: float = 0.0
    """Largest mean |server - trainer| logprob of the probe's tokens that passes the check; 0: by the servers' dtype
    (1e-3 in float32, 0.2 in 16-bit: a stale or half-loaded model differs by far more, bf16 noise by less)."""
    mismatch_warn: float = 0.1
    """Train/inference mismatch (mean |behaviour - proximal| logprob of the tokens generated by the weights being
    trained) above which the run warns once, with the likely causes; 0: never."""
    mismatch_stop: float = 0.5
    """Train/inference mismatch above which the run stops: the servers no longer sample from the policy being trained
    (a failed weight update, another model); 0: never."""
    pause_generation_mode: Literal["retract", "abort"] = "retract"
    """Asynchronous RL: how servers pause for a weight update (SGLang's /pause_generation mode). 'retract' keeps each
    request's tokens on the server, which continues it after the update; 'abort' ends the requests and the trainer sends
    prompt + tokens so far again (servers without retract)."""
    workflow: str = ""
    """Agent workflow 'package.module:function': an async function (archon.rl.agent.workflow) that runs each sample as
    a multi-turn episode through an OpenAI endpoint and returns its reward; '' trains single-turn completions."""
    workflow_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments every episode's workflow call gets."""
    max_turns: int = 8
    """Requests one agent episode may make; one more ends it (truncation 'max_turns')."""
    max_total_tokens: int = 0
    """Ids one agent episode may hold (prompts, tool results, sampled); 0: train_dataset.max_length +
    max_turns * gconfig.max_new_tokens."""
    workflow_timeout_s: float = 600.0
    """Seconds an agent episode may run before it is cancelled (truncation 'timeout', reward 0)."""


@dataclass
class SGLangConfig:
    model_path: str = ""
    """Model the servers start from; empty uses `actor.path`."""
    random_seed: int = 1
    """Server-side sampling seed."""
    dtype: str = "bfloat16"
    """Inference dtype."""
    context_length: int = 0
    """Maximum context of a request; 0 is the model's own (SGLang refuses more, so larger values are clamped to it)."""
    mem_fraction_static: float = 0.8
    """Fraction of GPU memory SGLang reserves for weights and KV cache; 0.5 unless set when rollout.colocate is on (the
    trainer's resident state needs the rest)."""
    dp_size: int = 1
    """SGLang's internal data parallel inside one server (with enable_dp_attention); never changes GPU counts."""
    ep_size: int = 1
    """SGLang's internal expert parallel inside one server; never changes GPU counts."""
    enable_dp_attention: bool = False
    """Data-parallel attention inside one server (large MoE)."""
    disable_cuda_graph: bool = False
    """Turn off CUDA graphs (debugging)."""
    max_running_requests: int = 0
    """Cap on concurrent requests per server; 0 keeps SGLang's default."""
    attention_backend: str = ""
    """SGLang attention backend; empty keeps SGLang's default."""
    enable_deterministic_inference: bool = False
    """Batch-invariant kernels and seeded sampling; without it SGLang ignores the per-request sampling_seed. The
    built-in servers (local:, inprocess:) honour it too: one request per forward, so logprobs do not depend on arrival
    order."""
    log_level: str = "warning"
    """SGLang server log level."""
    python: str = ""
    """Interpreter that runs launched SGLang servers (e.g. the `bin/python` of SGLang's own virtual environment, since
    SGLang pins its own torch and transformers); empty: the trainer's interpreter."""
    extra_args: list[str] = field(default_factory=list)
    """Further raw arguments appended to `python -m sglang.launch_server`."""


@dataclass
class VLLMConfig:
    model: str = ""
    """Model the servers start from; empty uses `actor.path`."""
    seed: int = 1
    """Server seed (server i gets seed + i); requests carry their own sampling seed."""
    dtype: str = "bfloat16"
    """Inference dtype."""
    max_model_len: int = 0
    """Maximum context of a request; 0 is the model's own (vLLM refuses more, so larger values are clamped to it)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM uses for weights, activations and KV cache; 0.5 unless set when rollout.colocate is
    on (the trainer's resident state needs the rest)."""
    max_num_seqs: int = 0
    """Cap on concurrent requests per server; 0 keeps vLLM's default."""
    enforce_eager: bool = False
    """Turn off CUDA graphs (debugging, faster start)."""
    batch_invariant: bool = False
    """VLLM_BATCH_INVARIANT=1: logits that do not depend on the batch, so seeded rollouts replay exactly."""
    python: str = ""
    """Interpreter that runs launched vLLM servers (e.g. the `bin/python` of vLLM's own virtual environment, since vLLM
    pins its own torch and transformers); empty: the trainer's interpreter."""
    extra_args: list[str] = field(default_factory=list)
    """Further raw arguments appended to the vLLM server command (`python -m vllm.entrypoints.openai.api_server`)."""


@dataclass
class RewardConfig:
    fn: str = "math"
    """Reward function: 'math', 'exact_match', or 'package.module:function'."""
    timeout_s: float = 15.0
    """Seconds before one reward call counts as failed (reward 0)."""
    n_workers: int = 2
    """Reward worker processes; 0 calls the function in the trainer (no timeout or crash protection)."""
    max_failure_frac: float = 0.5
    """Stop the run when more than this fraction of a step's reward calls fail (raise, hang, non-number); 1: never."""


@dataclass
class SaverConfig:
    freq_steps: int = 0
    """Save a resumable checkpoint every N steps (0: not by steps); a run always saves at its end."""
    freq_secs: float = 3600.0
    """Save a resumable checkpoint after this many seconds of training since the last one (AReaL's name), so that an
    interrupted run loses at most that much; 0: not by time."""
    keep_last: int = 2
    """Complete checkpoints kept on disk (older ones are deleted once a newer one is complete)."""
    export_hf: bool = True
    """Export the final actor as a Hugging Face folder under output_dir/hf."""


@dataclass
class Config:
    experiment_name: str = "archon"
    """Name of the experiment (groups trials)."""
    trial_name: str = "trial0"
    """Name of this trial."""
    output_dir: str = ""
    """Run directory for metrics.jsonl and checkpoints; empty means outputs/<experiment_name>/<trial_name>."""
    seed: int = 1
    """Seed of data order, initialisation and sampling; results never depend on the allocation."""
    total_train_steps: int = 100
    """Optimizer steps (RL steps) to run."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device type; auto: cuda for an SGLang/vLLM rollout or a machine with a GPU, else cpu (picks dtype/compile)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Cluster size used to check that the allocations fit."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Which launcher starts the run (AReaL's scheduler.type): torchrun here, or `python -m archon.launch ray|slurm`."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy model: training engine and PPO/GRPO options."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (used by adv_estimator = 'gae'). Every engine field it does not set is actor's: backend,
    path (with a warning: a critic usually starts from a value or reward model), model_config, dtype,
    grad_reduce_dtype, gradient_checkpointing, pad_to_maximum, optimizer, mb_spec, archon, lora (an empty backend or
    path inherits too; a partly set section such as critic.archon.ac_mode takes its other keys from actor's)."""
    ref: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    """Reference model for the KL terms. Every engine field it does not set is actor's: backend, path,
    model_config, dtype, grad_reduce_dtype, gradient_checkpointing, pad_to_maximum, optimizer, mb_spec, archon, lora
    (an empty backend or path inherits too; a partly set section takes its other keys from actor's)."""
    teacher: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    """Teacher for on-policy distillation (used when actor.kd_coef > 0; forward only). Every engine field it does
    not set is actor's: backend, path, model_config, dtype, grad_reduce_dtype, gradient_checkpointing,
    pad_to_maximum, optimizer, mb_spec, archon, lora (an empty backend or path inherits too; a partly set section takes
    its other keys from actor's)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout servers."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """Options passed to each SGLang server."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """Options passed to each vLLM server."""
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling of completions."""
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Training data."""
    valid_dataset: ValidDatasetConfig = field(default_factory=ValidDatasetConfig)
    """Evaluation prompts, train_dataset's fields (AReaL's name; empty path: no evaluation): every row, in order."""
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    """When and how the policy is evaluated on valid_dataset (greedy accuracy, sampled pass@k), logged as eval/*."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""
    saver: SaverConfig = field(default_factory=SaverConfig)
    """Checkpointing."""
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)
    """Experiment trackers fed each step's metrics.jsonl record from rank 0 (W&B, TensorBoard, MLflow)."""
    dynamic_filter: DynamicFilterConfig = field(default_factory=DynamicFilterConfig)
    """DAPO dynamic sampling: drop prompt groups with equal rewards and refill the batch."""

    @property
    def run_dir(self) -> Path:
        """Where this run writes metrics and checkpoints."""
        return Path(self.output_dir or f"outputs/{self.experiment_name}/{self.trial_name}")

    def allocations(self, sources: dict[str, str] | None = None) -> dict[str, ModelAllocation]:
        """The parsed allocation of every engine (critic/ref/teacher already inherited).

        The one place a config's ``backend`` strings are parsed: validation, the cluster plan and
        the launchers take these, and an engine gets its own from ``build_engine``.  A bad string
        is a ``ConfigError`` naming the key and where it came from (``sources``: key -> file or
        override).
        """
        allocs = {}
        for section in ALLOCATED_SECTIONS:
            key = f"{section}.backend"
            try:
                allocs[section] = ModelAllocation.from_str(getattr(self, section).backend)
            except AllocationError as exc:
                raise ConfigError(f"{key} (from {(sources or {}).get(key, 'the defaults')}): {exc}") from None
        return allocs


ALLOCATED_SECTIONS = ("rollout", "actor", "critic", "ref", "teacher")
"""Config sections with a ``backend`` allocation string, rollout first."""


# Engine fields critic/ref inherit from actor when the user did not set them.
INHERITED_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainEngineConfig))
