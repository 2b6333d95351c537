"""What a transformers causal LM computes, matched against Archon's shared decoder blocks.

``analyze(source)`` builds the model type's tiny probe model with transformers and finds, by
data flow in one forward (which module's output feeds which), the embedding, the blocks, the
final norm and head, and inside block 0 the attention, the MLP, their projections and the
role of every norm (before attention, after attention, before the MLP, after the MLP).  Names
and shapes of the matched parameters give the state-dict tables; whatever has no counterpart
in ``models/common`` becomes a ``probe.Point`` that fails, and each failing point is explained
by trying the usual variants (a ``(1 + weight)`` RMSNorm, a scaled embedding, another
activation, a post-norm).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common.args import DecoderArgs
from models.common.decoder import Decoder
from models.common.state_dict_adapter import TableStateDictAdapter
from models.model_args import RefusedSetting, allow_unimplemented
from models.state_dict_adapter import UnknownKeyError
from scaffold import probe
from scaffold.probe import Point, same
from scaffold.source import ScaffoldError, Source, make_tiny_config, refused_settings_of, tiny_config_kwargs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_M = TypeVar("_M", bound=nn.Module)

# Archon's parameter names inside a block, by role.
_ATTN = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo"}
_MLP = {"w1": "feed_forward.w1", "w3": "feed_forward.w3", "w2": "feed_forward.w2"}
_NORMS = {"pre_attention": "attention_norm", "pre_mlp": "ffn_norm"}
_HINTS = {
    "wq": ("q_proj", "query", "q", "wq"),
    "wk": ("k_proj", "key", "k", "wk"),
    "wv": ("v_proj", "value", "v", "wv"),
    "wo": ("o_proj", "out_proj", "dense", "o", "wo", "c_proj"),
    "w1": ("gate_proj", "gate", "w1"),
    "w3": ("up_proj", "up", "w3"),
    "w2": ("down_proj", "down", "w2"),
}
_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")
_STANDARD_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "intermediate_size",
    "max_position_embeddings",
)


@dataclass
class Analysis:
    """Everything the generator writes: tables, args, refused settings, the points and which of them differ."""

    source: Source
    tiny_kwargs: dict[str, Any]
    hf_class: str
    layer_prefix: str
    top_keys: dict[str, str]
    layer_keys: dict[str, str]
    key_aliases: dict[str, str]
    model_fields: dict[str, Any]
    """DecoderArgs fields fixed by the architecture (qkv_bias, o_bias, qk_norm)."""
    bias_key: str | None
    """Config key that switches the attention biases on (``attention_bias``), if any."""
    refused: list[RefusedSetting]
    shared_refusals: list[str]
    points: list[Point] = field(default_factory=list)
    """Every point the generated parity test checks one by one (the differences)."""
    notes: list[str] = field(default_factory=list)

    @property
    def differences(self) -> list[Point]:
        return self.points


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _tokens(name: str) -> set[str]:
    leaf = _leaf(name)
    return {leaf, *leaf.split("_")}


def _is_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        not isinstance(module, (nn.Linear, nn.Embedding))
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and not list(module.children())
    )


def _pick(role: str, candidates: dict[str, tuple[int, ...]], shape: tuple[int, ...], taken: set[str]) -> str | None:
    """The candidate of ``shape`` whose name fits ``role`` (or the only one of that shape)."""
    fits = [n for n, s in candidates.items() if s == shape and n not in taken]
    named = [n for n in fits if _tokens(n) & set(_HINTS[role])]
    if len(named) == 1:
        return named[0]
    return fits[0] if len(fits) == 1 and not named else None


@torch.no_grad()
def perturb_(model: _M, seed: int = 0) -> _M:
    """Give every parameter random, non-trivial values (norm weights near 1, biases non-zero)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() == 1 and not name.endswith("bias"):
            value = 1.0 + 0.2 * noise
        elif name.endswith("bias"):
            value = 0.2 * noise
        elif p.dim() == 2 and p.shape[0] >= 100 and "embed" in name:
            value = 0.5 * noise
        else:
            value = noise / math.sqrt(p.shape[-1])
        p.copy_(value)
    return model


def build_hf_model(source: Source, kwargs: dict[str, Any], seed: int = 0) -> PreTrainedModel:
    """The tiny transformers model (float32, eval, perturbed weights)."""
    config = make_tiny_config(source.model_type, kwargs)
    torch.manual_seed(seed)
    model = source.causal_lm_class._from_config(config, dtype=torch.float32)
    return perturb_(model, seed).eval()


def _module_path(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is target), None) if target is not None else None


@torch.no_grad()
def analyze(source: Source) -> Analysis:
    kwargs = tiny_config_kwargs(source)
    try:
        hf = build_hf_model(source, kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds on odd configs
        raise ScaffoldError(
            f"transformers could not build a tiny {source.causal_lm_class.__name__} ({type(exc).__name__}: {exc})"
        ) from None
    config = hf.config
    refused, shared = refused_settings_of(source)
    analysis = Analysis(source, kwargs, type(hf).__name__, "", {}, {}, {}, {}, None, refused, shared)
    trace = probe.trace(hf, probe.probe_ids(config.vocab_size))

    # ---- where things are
    names = set(getattr(hf, "_no_split_modules", None) or [])
    lists = {n for n, m in hf.named_modules() if isinstance(m, nn.ModuleList)}
    block_paths = [n for n, m in hf.named_modules() if type(m).__name__ in names and n.rsplit(".", 1)[0] in lists]
    if not block_paths:
        raise ScaffoldError(
            f"{type(hf).__name__} has no list of the block classes it names in _no_split_modules "
            f"({sorted(names)}), so its transformer blocks cannot be found"
        )
    block0 = block_paths[0]
    prefix, index = block0.rsplit(".", 1)
    if index != "0":
        raise ScaffoldError(f"{type(hf).__name__}'s first block is {block0!r}, not a list entry '<prefix>.0'")
    analysis.layer_prefix = prefix
    block = hf.get_submodule(block0)
    children = dict(block.named_children())
    attn = next((n for n, m in children.items() if "attention" in type(m).__name__.lower() or "attn" in n), None)
    mlp = next(
        (n for n, m in children.items() if "mlp" in type(m).__name__.lower() or n in ("mlp", "feed_forward", "ffn")),
        None,
    )
    if attn is None or mlp is None:
        raise ScaffoldError(
            f"{type(block).__name__} has no recognisable attention and MLP submodules "
            f"(children: {list(children)}); Archon's shared block cannot express it"
        )
    embed = _module_path(hf, hf.get_input_embeddings())
    head = _module_path(hf, hf.get_output_embeddings())
    last = trace.records[f"{prefix}.{len(block_paths) - 1}"].out
    final_norm = next(
        (
            n
            for n, m in hf.named_modules()
            if _is_norm(m)
            and not n.startswith(prefix + ".")
            and n in trace.records
            and same(trace.records[n].inp, last, 0)
        ),
        None,
    )

    layer_keys: dict[str, str] = {}
    unmapped: dict[str, str] = {}  # HF param (layer 0 or top) -> why it has no counterpart
    rec = trace.records
    x, a, m = rec[block0], rec[f"{block0}.{attn}"], rec[f"{block0}.{mlp}"]

    # ---- norms inside the block, by what they read and feed
    roles: dict[str, str] = {}
    for name, module in block.named_modules():
        if not name or not _is_norm(module) or name.startswith(f"{attn}.") or name.startswith(f"{mlp}."):
            continue
        r = rec.get(f"{block0}.{name}")
        if r is None:
            continue
        if same(r.inp, x.inp, 0) and same(r.out, a.inp, 0):
            roles[name] = "pre_attention"
        elif same(r.out, m.inp, 0):
            roles[name] = "pre_mlp"
        elif same(r.inp, a.out, 0):
            roles[name] = "post_attention"
        elif same(r.inp, m.out, 0):
            roles[name] = "post_mlp"
        else:
            roles[name] = "unknown"
    for name, role in roles.items():
        if role in _NORMS:
            layer_keys[f"{name}.weight"] = f"{_NORMS[role]}.weight"
        else:
            unmapped[f"{block0}.{name}.weight"] = {
                "post_attention": f"extra norm '{name}': it normalises the attention output before the residual add "
                "(a post-attention norm), which the shared block does not have",
                "post_mlp": f"extra norm '{name}': it normalises the MLP output before the residual add (a post-MLP "
                "norm), which the shared block does not have",
                "unknown": f"extra norm '{name}' in a place the shared block has none",
            }[role]

    # ---- attention projections and q/k norms
    n_heads, n_kv = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    d = config.hidden_size
    attn_mod = block.get_submodule(attn)
    linears = {n: tuple(mod.weight.shape) for n, mod in attn_mod.named_modules() if isinstance(mod, nn.Linear)}
    shapes = {
        "wq": (n_heads * head_dim, d),
        "wk": (n_kv * head_dim, d),
        "wv": (n_kv * head_dim, d),
        "wo": (d, n_heads * head_dim),
    }
    taken: set[str] = set()
    for role in ("wq", "wk", "wv", "wo"):
        name = _pick(role, linears, shapes[role], taken)
        if name is None:
            continue
        taken.add(name)
        layer_keys[f"{attn}.{name}.weight"] = f"{_ATTN[role]}.weight"
        if attn_mod.get_submodule(name).bias is not None:
            layer_keys[f"{attn}.{name}.bias"] = f"{_ATTN[role]}.bias"
    qk_norm = False
    for name, module in attn_mod.named_modules():
        if not name or not _is_norm(module):
            continue
        which = "q_norm" if _tokens(name) & {"q", "query"} else "k_norm" if _tokens(name) & {"k", "key"} else None
        width = cast(torch.Tensor, module.weight).shape[0]  # a norm (_is_norm) has a weight
        if which and width == head_dim:
            layer_keys[f"{attn}.{name}.weight"] = f"attention.{which}.weight"
            qk_norm = True
        else:
            unmapped[f"{block0}.{attn}.{name}.weight"] = (
                f"{'query' if which == 'q_norm' else 'key' if which == 'k_norm' else 'an'} norm '{attn}.{name}' over "
                f"{width} features (the whole projection), where the shared attention normalises "
                f"each head ({head_dim})"
            )

    # ---- MLP projections (gate and up told apart by the function, if the names do not)
    mlp_mod = block.get_submodule(mlp)
    linears = {n: tuple(mod.weight.shape) for n, mod in mlp_mod.named_modules() if isinstance(mod, nn.Linear)}
    inter = config.intermediate_size
    taken = set()
    picked = {}
    for role, shape in (("w2", (d, inter)), ("w1", (inter, d)), ("w3", (inter, d))):
        name = _pick(role, linears, shape, taken)
        if name is not None:
            taken.add(name)
            picked[role] = name
    if {"w1", "w3"} <= set(picked) and "w2" in picked:
        gate, up, down = (mlp_mod.get_submodule(picked[r]) for r in ("w1", "w3", "w2"))
        u = m.inp
        if not same(down(F.silu(gate(u)) * up(u)), m.out) and same(down(F.silu(up(u)) * gate(u)), m.out):
            picked["w1"], picked["w3"] = picked["w3"], picked["w1"]
    for role, name in picked.items():
        layer_keys[f"{mlp}.{name}.weight"] = f"{_MLP[role]}.weight"

    # ---- everything else in the block (biases, extra weights) has no counterpart
    for name, param in block.named_parameters():
        if name not in layer_keys and f"{block0}.{name}" not in unmapped:
            kind = "bias" if name.endswith("bias") else "parameter"
            unmapped[f"{block0}.{name}"] = f"extra {kind} '{name}' {tuple(param.shape)}: the shared block has none"

    # ---- top level
    top_keys: dict[str, str] = {}
    if embed:
        top_keys[f"{embed}.weight"] = "tok_embeddings.weight"
    if final_norm:
        top_keys[f"{final_norm}.weight"] = "norm.weight"
    if head:
        top_keys[f"{head}.weight"] = "output.weight"
    for name, param in hf.named_parameters():
        if not name.startswith(prefix + ".") and name not in top_keys:
            unmapped[name] = f"extra parameter '{name}' {tuple(param.shape)} outside the blocks"
    analysis.top_keys, analysis.layer_keys = top_keys, layer_keys

    # ---- args
    cfg = source.config_dict
    analysis.key_aliases = _key_aliases(config, cfg)
    fields: dict[str, Any] = {"qk_norm": qk_norm}
    bias_q = f"{_ATTN['wq']}.bias" in layer_keys.values()
    bias_o = f"{_ATTN['wo']}.bias" in layer_keys.values()
    analysis.bias_key = "attention_bias" if "attention_bias" in cfg else None
    if analysis.bias_key:
        flipped = _meta_model(source, {**kwargs, "attention_bias": True})
        fb = flipped.get_submodule(f"{block0}.{attn}")
        names = {v: k for k, v in layer_keys.items()}
        bias_q = getattr(fb.get_submodule(names[f"{_ATTN['wq']}.weight"][len(attn) + 1 : -7]), "bias", None) is not None
        bias_o = getattr(fb.get_submodule(names[f"{_ATTN['wo']}.weight"][len(attn) + 1 : -7]), "bias", None) is not None
    fields["qkv_bias"], fields["o_bias"] = bias_q, bias_o
    analysis.model_fields = fields

    # ---- the points: build the shared decoder with these tables and compare module by module
    archon = _shared_decoder(analysis, hf, config, kwargs)
    adapter = archon._scaffold_adapter
    points = _points(analysis, hf, archon, trace, block0, attn, mlp, roles, unmapped, adapter)
    analysis.points = points
    return analysis


def _meta_model(source: Source, kwargs: dict[str, Any]) -> nn.Module:
    with torch.device("meta"):
        return source.causal_lm_class._from_config(make_tiny_config(source.model_type, kwargs))


def _key_aliases(config: Any, cfg: dict[str, Any]) -> dict[str, str]:
    """This config's own spelling -> the shared spelling, for the keys the shared reader needs."""
    aliases = {}
    attribute_map = getattr(config, "attribute_map", {}) or {}
    for key in _STANDARD_KEYS:
        if key not in cfg and attribute_map.get(key) in cfg:
            aliases[attribute_map[key]] = key
    if "rms_norm_eps" not in cfg:
        own = next((k for k in _EPS_KEYS if k in cfg), None)
        if own:
            aliases[own] = "rms_norm_eps"
    return aliases


def args_class(analysis: Analysis, unimplemented: tuple[str, ...] = ()) -> type:
    """A ``DecoderArgs`` subclass with the analysed fields (what the generated args.py writes)."""
    fields = dict(analysis.model_fields)
    bias_key = analysis.bias_key

    def model_fields(cls, cfg):
        out = dict(fields)
        if bias_key:
            on = bool(cfg.get(bias_key, False))
            out["qkv_bias"], out["o_bias"] = fields["qkv_bias"] and on, fields["o_bias"] and on
        return out

    return type(
        "ScaffoldArgs",
        (DecoderArgs,),
        {
            "__module__": __name__,
            "hf_model_type": analysis.source.model_type,
            "hf_architecture": analysis.hf_class,
            "hf_key_aliases": analysis.key_aliases,
            "refused_settings": tuple(analysis.refused),
            "unimplemented": unimplemented,
            "_model_fields_from_hf": classmethod(model_fields),
        },
    )


def adapter_class(analysis: Analysis) -> type:
    return type(
        "ScaffoldAdapter",
        (TableStateDictAdapter,),
        {"hf_layer_prefix": analysis.layer_prefix, "top_keys": analysis.top_keys, "layer_keys": analysis.layer_keys},
    )


@torch.no_grad()
def _shared_decoder(analysis: Analysis, hf: nn.Module, config: Any, kwargs: dict[str, Any]) -> nn.Module:
    """``models.common.Decoder`` built from the tiny config and filled through the derived tables."""

    with allow_unimplemented():
        args = args_class(analysis, unimplemented=("mlp",)).from_hf_config(config.to_dict())
    torch.manual_seed(0)
    model = Decoder(args)
    model.init_weights()
    adapter = adapter_class(analysis)(args)
    params = dict(model.named_parameters())
    for name, tensor in hf.state_dict().items():
        try:
            targets = adapter.hf_key_targets(name)
        except UnknownKeyError:
            continue
        for t in targets:
            if t.name in params and params[t.name].shape == tensor.shape:
                params[t.name].copy_(t.take(tensor))
    model.eval()
    model._scaffold_adapter = adapter
    return model


def _points(analysis: Analysis, hf, archon, trace, block0, attn, mlp, roles, unmapped, adapter) -> list[Point]:
    """The failing points, each explained; implied ones (a block that fails because a part does) are left out."""
    failing: list[Point] = []
    for hf_name, why in unmapped.items():
        failing.append(Point("hf_param", hf=hf_name, what=why))
    mapped = set(analysis.layer_keys.values()) | set(analysis.top_keys.values())
    for name in dict(archon.named_parameters()):
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue
        short = name.replace("layers.0.", "")
        if short in mapped or name in mapped or (name == "output.weight" and archon.embeddings_tied):
            continue
        failing.append(Point("archon_param", archon=name, what=_missing_why(name)))
    # Norms the tables mapped: same formula?
    norm_paths = {f"layers.0.{_NORMS[role]}": f"{block0}.{n}" for n, role in roles.items() if role in _NORMS}
    final = next((k for k, v in analysis.top_keys.items() if v == "norm.weight"), None)
    if final:
        norm_paths["norm"] = final[: -len(".weight")]
    for key, value in analysis.layer_keys.items():
        if value in ("attention.q_norm.weight", "attention.k_norm.weight"):
            norm_paths[f"layers.0.{value[:-7]}"] = f"{block0}.{key[:-7]}"
    for ours, theirs in norm_paths.items():
        point = Point("norm", archon=ours, hf=theirs)
        if probe.check(point, hf, archon, trace, adapter):
            failing.append(dataclasses.replace(point, what=_norm_why(theirs, hf, trace, archon.get_submodule(ours))))
    block_fails = bool(failing)
    attn_ok = not any(p.kind == "hf_param" and p.hf.startswith(f"{block0}.{attn}.") for p in failing)
    mlp_ok = all(f"{_MLP[r]}.weight" in analysis.layer_keys.values() for r in _MLP) and not any(
        p.kind == "hf_param" and p.hf.startswith(f"{block0}.{mlp}.") for p in failing
    )
    checks = [Point("embedding", hf=block0)]
    if mlp_ok:
        checks.append(Point("mlp", hf=f"{block0}.{mlp}"))
    if attn_ok:
        checks.append(Point("attention", hf=f"{block0}.{attn}"))
    for point in checks:
        if probe.check(point, hf, archon, trace, adapter):
            failing.append(dataclasses.replace(point, what=_why(point, hf, trace, archon)))
            block_fails = block_fails or point.kind != "embedding"
    if not block_fails and probe.check(Point("block", hf=block0), hf, archon, trace, adapter):
        failing.append(
            Point(
                "block",
                hf=block0,
                what="the block combines attention, MLP, norms and residuals "
                "differently from the shared pre-norm block (e.g. parallel "
                "attention and MLP)",
            )
        )
    if not failing and probe.check(Point("logits"), hf, archon, trace, adapter):
        failing.append(
            Point(
                "logits",
                what="the logits differ although every block matches: a transform after "
                "the last block or of the LM head output",
            )
        )
    return failing


def _missing_why(name: str) -> str:
    if name.endswith("attention_norm.weight"):
        return (
            "no norm before attention: transformers' block feeds its input to attention directly, the shared "
            "block normalises it first (attention_norm)"
        )
    if name.endswith("ffn_norm.weight"):
        return (
            "no norm before the MLP: transformers' block feeds the residual stream to the MLP directly, the "
            "shared block normalises it first (ffn_norm)"
        )
    if name == "norm.weight":
        return "no final norm after the last block (the shared decoder has one)"
    return f"no transformers parameter fills '{name}'"


@torch.no_grad()
def _norm_why(path: str, hf, trace, ours: nn.Module) -> str:
    module = hf.get_submodule(path)
    rec = trace.records[path]
    w = module.weight.float()
    eps = next((getattr(module, a) for a in ("eps", "variance_epsilon", "epsilon") if hasattr(module, a)), 1e-6)
    u = rec.inp.float()
    rms = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
    if same((rms * (1.0 + w)).to(rec.out.dtype), rec.out):
        return f"norm '{path}' is an RMSNorm that scales by (1 + weight) (a zero-centred weight, as in Gemma)"
    if same(F.layer_norm(u, (u.shape[-1],), w, getattr(module, "bias", None), eps), rec.out):
        return f"norm '{path}' is a LayerNorm (it subtracts the mean), not an RMSNorm"
    return f"norm '{path}' ({type(module).__name__}) computes a different normalisation"


@torch.no_grad()
def _why(point: Point, hf, trace, archon) -> str:
    config = hf.config
    if point.kind == "embedding":
        block_in = trace.records[point.hf].inp
        # A plain lookup of the embedding matrix, which is all the shared decoder does.
        lookup = F.embedding(trace.ids, hf.get_input_embeddings().weight)
        ratio = (block_in / lookup.where(lookup.abs() > 1e-6, torch.ones_like(lookup))).flatten()
        c = float(ratio.median())
        if same(lookup * c, block_in, 1e-4):
            sqrt_d = math.sqrt(config.hidden_size)
            name = f" (sqrt(hidden_size) = {sqrt_d:.4g})" if abs(c - sqrt_d) < 1e-3 * sqrt_d else ""
            return f"the embedding output is multiplied by {c:.4g}{name} before the first block"
        return "the embedding output is transformed before the first block"
    if point.kind == "mlp":
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        if act and act not in ("silu", "swish"):
            return f"activation {act!r} in the gated MLP, where the shared one uses SiLU"
        return "the MLP computes a different function from the shared gated SiLU MLP"
    if point.kind == "attention":
        hints = ("attn", "attention", "scal", "rope", "rotary")
        keys = sorted(k for k, v in config.to_dict().items() if any(t in k for t in hints) and v not in (None, False))
        return "attention computes a different function from the shared one on the same weights" + (
            f" (config keys to look at: {', '.join(keys)})" if keys else ""
        )
    return point.kind
