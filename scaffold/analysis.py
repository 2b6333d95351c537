"""What a transformers causal LM computes, matched against Archon's shared decoder blocks.

``analyze(source)`` builds the model type's tiny probe model with transformers and finds, by
data flow in one forward (which module's output feeds which), the embedding, the blocks, the
final norm and head, and inside block 0 the attention, the MLP, their projections and the
role of every norm (before attention, after attention, before the MLP, after the MLP).  A
projection is matched by that role and its name, never by its shape alone (``scaffold.roles``),
and the tables (``TableStateDictAdapter``) hold only one-to-one matches; a fused projection
(phi3's ``qkv_proj``) is split into the probe's decoder, checked there, and reported for a
hand-written adapter.  Whatever has no counterpart in ``models/common`` becomes a
``probe.Point`` that fails, and each failing point is explained by trying the usual variants
(``scaffold.explain``: a ``(1 + weight)`` RMSNorm, a scaled embedding, residual or logits,
another attention scale or activation, a post-norm).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common.args import DecoderArgs
from models.common.decoder import Decoder
from models.common.state_dict_adapter import TableStateDictAdapter
from models.model_args import RefusedSetting, allow_unimplemented
from models.state_dict_adapter import HFKeyTarget, UnknownKeyError
from scaffold import probe
from scaffold.explain import attention_scale, explain_point, fused_why, missing_why, norm_why
from scaffold.probe import Point, same
from scaffold.roles import (
    ATTN_ROLES,
    MLP_ROLES,
    NORM_ROLES,
    PROJECTIONS,
    Fused,
    fused_split,
    is_norm,
    linears_by_flow,
    name_tokens,
    order_gate_up_,
    pick_by_name,
    unplaced_projections,
)
from scaffold.source import (
    ScaffoldError,
    Source,
    kept_scalings,
    make_tiny_config,
    refused_settings_of,
    tiny_config_kwargs,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_M = TypeVar("_M", bound=nn.Module)

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
    fused: list[Fused] = field(default_factory=list)
    """transformers projections that stack several Archon ones (the tables cannot split them)."""
    kept: dict[str, Any] = field(default_factory=dict)
    """Multipliers and scalings the source switches on, kept in the probe config (key -> value)."""
    notes: list[str] = field(default_factory=list)

    @property
    def differences(self) -> list[Point]:
        return self.points


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
    analysis.kept = kept_scalings(source)
    try:
        trace = probe.trace(hf, probe.probe_ids(config.vocab_size))
    except Exception as exc:  # noqa: BLE001 - a tiny config transformers accepts but cannot run
        raise ScaffoldError(
            f"transformers' tiny {type(hf).__name__} failed its probe forward ({type(exc).__name__}: {exc}); "
            "the scaffold cannot probe this architecture, so add the model by hand (models/README.md)"
        ) from None

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
            if is_norm(m)
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
        if not name or not is_norm(module) or name.startswith(f"{attn}.") or name.startswith(f"{mlp}."):
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
        if role in NORM_ROLES:
            layer_keys[f"{name}.weight"] = f"{NORM_ROLES[role]}.weight"
        else:
            unmapped[f"{block0}.{name}.weight"] = {
                "post_attention": f"extra norm '{name}': it normalises the attention output before the residual add "
                "(a post-attention norm), which the shared block does not have",
                "post_mlp": f"extra norm '{name}': it normalises the MLP output before the residual add (a post-MLP "
                "norm), which the shared block does not have",
                "unknown": f"extra norm '{name}' in a place the shared block has none",
            }[role]

    # ---- attention and MLP projections: by role (what each reads and writes), then by name; never by shape alone
    n_heads, n_kv = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    d, inter = config.hidden_size, config.intermediate_size
    attn_mod, mlp_mod = block.get_submodule(attn), block.get_submodule(mlp)
    shapes = {
        "wq": (n_heads * head_dim, d),
        "wk": (n_kv * head_dim, d),
        "wv": (n_kv * head_dim, d),
        "wo": (d, n_heads * head_dim),
        "w1": (inter, d),
        "w3": (inter, d),
        "w2": (d, inter),
    }
    picked: dict[str, str] = {}  # role -> module path inside the block
    fused: list[Fused] = []
    for mod, path, (readers, writer) in (
        (attn_mod, attn, (("wq", "wk", "wv"), "wo")),
        (mlp_mod, mlp, (("w1", "w3"), "w2")),
    ):
        reads, writes = linears_by_flow(mod, f"{block0}.{path}", rec)
        taken: set[str] = set()
        for role in (writer, *readers):
            name = pick_by_name(role, writes if role == writer else reads, shapes[role], taken)
            if name is not None:
                taken.add(name)
                picked[role] = f"{path}.{name}"
        missing = [r for r in readers if r not in picked]
        for name, shape in reads.items():
            split = fused_split(name, shape, missing, shapes) if name not in taken else None
            if split is not None:
                fused.append(Fused(f"{path}.{name}", split))
                missing = []
    if {"w1", "w3", "w2"} <= set(picked):
        gate, up, down = (block.get_submodule(picked[r]) for r in ("w1", "w3", "w2"))
        u = m.inp
        if not same(down(F.silu(gate(u)) * up(u)), m.out) and same(down(F.silu(up(u)) * gate(u)), m.out):
            picked["w1"], picked["w3"] = picked["w3"], picked["w1"]
    for f in fused:
        if f.roles[0][0] in ("w1", "w3"):
            assert m.inp is not None and m.out is not None, "the probe forward reached the MLP"
            order_gate_up_(f, block, picked.get("w2"), m.inp, m.out)
    for role, path in picked.items():
        target = PROJECTIONS[role]
        layer_keys[f"{path}.weight"] = f"{target}.weight"
        if role in ATTN_ROLES and block.get_submodule(path).bias is not None:
            layer_keys[f"{path}.bias"] = f"{target}.bias"
    analysis.fused = fused

    qk_norm = False
    for name, module in attn_mod.named_modules():
        if not name or not is_norm(module):
            continue
        which = (
            "q_norm" if name_tokens(name) & {"q", "query"} else "k_norm" if name_tokens(name) & {"k", "key"} else None
        )
        width = cast(torch.Tensor, module.weight).shape[0]  # a norm (is_norm) has a weight
        if which and width == head_dim:
            layer_keys[f"{attn}.{name}.weight"] = f"attention.{which}.weight"
            qk_norm = True
        else:
            unmapped[f"{block0}.{attn}.{name}.weight"] = (
                f"{'query' if which == 'q_norm' else 'key' if which == 'k_norm' else 'an'} norm '{attn}.{name}' over "
                f"{width} features (the whole projection), where the shared attention normalises "
                f"each head ({head_dim})"
            )
    for f in fused:
        for suffix in ("weight", "bias"):
            if f"{f.hf}.{suffix}" in dict(block.named_parameters()):
                unmapped[f"{block0}.{f.hf}.{suffix}"] = ""  # explained once the probe has tried the split
    for path in unplaced_projections(block, attn, mlp, picked, fused):
        shape = tuple(cast(nn.Linear, block.get_submodule(path)).weight.shape)
        unmapped[f"{block0}.{path}.weight"] = (
            f"projection '{path}' {shape} has no role in the shared block: by what it reads and "
            "writes and by its name it is none of "
            + ("wq, wk, wv, wo" if path.startswith(f"{attn}.") else "w1 (gate), w3 (up), w2 (down)")
        )

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
    q_path = picked.get("wq") or next((f.hf for f in fused if f.roles[0][0] in ("wq", "wk", "wv")), None)
    o_path = picked.get("wo")

    def has_bias(model: nn.Module, path: str | None) -> bool:
        return path is not None and getattr(model.get_submodule(f"{block0}.{path}"), "bias", None) is not None

    bias_q, bias_o = has_bias(hf, q_path), has_bias(hf, o_path)
    analysis.bias_key = "attention_bias" if "attention_bias" in cfg else None
    if analysis.bias_key:
        flipped = _meta_model(source, {**kwargs, "attention_bias": True})
        bias_q, bias_o = has_bias(flipped, q_path), has_bias(flipped, o_path)
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
    """``models.common.Decoder`` built from the tiny config and filled through the derived tables.

    Fused projections are split into it as well (what a hand-written adapter would do), so the
    attention and MLP checks can tell whether the split is right.
    """

    with allow_unimplemented():
        args = args_class(analysis, unimplemented=("mlp",)).from_hf_config(config.to_dict())
    torch.manual_seed(0)
    model = Decoder(args)
    model.init_weights()
    adapter = adapter_class(analysis)(args)
    params = dict(model.named_parameters())
    splits = {
        f"{f.hf}.{suffix}": [(f"{PROJECTIONS[role]}.{suffix}", start, n) for role, start, n in f.roles]
        for f in analysis.fused
        for suffix in ("weight", "bias")
    }
    layer = re.compile(rf"^{re.escape(analysis.layer_prefix)}\.(\d+)\.(.+)$")
    for name, tensor in hf.state_dict().items():
        m = layer.match(name)
        if m and m.group(2) in splits:
            targets = [HFKeyTarget(f"layers.{m.group(1)}.{t}", None, (0, s, n)) for t, s, n in splits[m.group(2)]]
        else:
            try:
                targets = adapter.hf_key_targets(name)
            except UnknownKeyError:
                continue
        for t in targets:
            value = t.take(tensor)
            if t.name in params and params[t.name].shape == value.shape:
                params[t.name].copy_(value)
    model.eval()
    model._scaffold_adapter = adapter
    return model


def _points(analysis: Analysis, hf, archon, trace, block0, attn, mlp, roles, unmapped, adapter) -> list[Point]:
    """The failing points, each explained; implied ones (a block that fails because a part does) are left out."""
    fused_params = {k for k, reason in unmapped.items() if not reason}
    split_into = {f"layers.0.{PROJECTIONS[role]}.weight": (f, role) for f in analysis.fused for role, _, _ in f.roles}
    failing: list[Point] = []
    for hf_name, reason in unmapped.items():
        if hf_name not in fused_params:
            failing.append(Point("hf_param", hf=hf_name, what=reason))
    mapped = set(analysis.layer_keys.values()) | set(analysis.top_keys.values())
    for name in dict(archon.named_parameters()):
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue
        short = name.replace("layers.0.", "")
        if short in mapped or name in mapped or (name == "output.weight" and archon.embeddings_tied):
            continue
        if name not in split_into and not (name.endswith(".bias") and name[:-4] + "weight" in split_into):
            failing.append(Point("archon_param", archon=name, what=missing_why(name)))
    # Norms the tables mapped: same formula?
    norm_paths = {f"layers.0.{NORM_ROLES[role]}": f"{block0}.{n}" for n, role in roles.items() if role in NORM_ROLES}
    final = next((k for k, v in analysis.top_keys.items() if v == "norm.weight"), None)
    if final:
        norm_paths["norm"] = final[: -len(".weight")]
    for key, value in analysis.layer_keys.items():
        if value in ("attention.q_norm.weight", "attention.k_norm.weight"):
            norm_paths[f"layers.0.{value[:-7]}"] = f"{block0}.{key[:-7]}"
    for ours, theirs in norm_paths.items():
        point = Point("norm", archon=ours, hf=theirs)
        if probe.check(point, hf, archon, trace, adapter):
            failing.append(dataclasses.replace(point, what=norm_why(theirs, hf, trace, archon.get_submodule(ours))))
    block_fails = bool(failing)
    filled = mapped | {k.replace("layers.0.", "") for k in split_into}
    attn_ok = all(f"{ATTN_ROLES[r]}.weight" in filled for r in ATTN_ROLES) and not any(
        p.kind == "hf_param" and p.hf.startswith(f"{block0}.{attn}.") for p in failing
    )
    mlp_ok = all(f"{MLP_ROLES[r]}.weight" in filled for r in MLP_ROLES) and not any(
        p.kind == "hf_param" and p.hf.startswith(f"{block0}.{mlp}.") for p in failing
    )
    checks = [Point("embedding", hf=block0)]
    if mlp_ok:
        checks.append(Point("mlp", hf=f"{block0}.{mlp}"))
    if attn_ok:
        checks.append(Point("attention", hf=f"{block0}.{attn}"))
    if sorted(roles.values()) == ["pre_attention", "pre_mlp"]:
        # Pre-norm wiring (the shared block's): the residual adds can be compared on their own.
        checks.append(Point("residual", hf=block0, parts=(f"{block0}.{attn}", f"{block0}.{mlp}")))
    failed_ids = {p.id for p in failing}
    if final and "archon_param:output.weight" not in failed_ids:
        checks.append(Point("head", hf=final[: -len(".weight")]))
    checked: dict[str, str | None] = {}
    for point in checks:
        checked[point.kind] = probe.check(point, hf, archon, trace, adapter)
        if checked[point.kind]:
            failing.append(dataclasses.replace(point, what=explain_point(point, hf, trace, archon)))
            block_fails = block_fails or point.kind not in ("embedding", "head")
    attention_matches = checked.get("attention", "not checked") is None or (
        "attention" in checked and attention_scale(hf, trace, archon, f"{block0}.{attn}") is not None
    )
    for f in analysis.fused:
        if f.roles[0][0] in ATTN_ROLES:
            f.confirmed = attention_matches
        else:
            f.confirmed = f.confirmed and checked.get("mlp", "not checked") is None
    split_points = []
    for hf_name in (k for k in unmapped if k in fused_params):
        f = next(f for f in analysis.fused if hf_name.rsplit(".", 1)[0] == f"{block0}.{f.hf}")
        split_points.append(Point("hf_param", hf=hf_name, what=fused_why(f)))
    for name, (f, role) in split_into.items():
        if name in dict(archon.named_parameters()):
            what = (
                f"no checkpoint tensor fills '{name}' until the adapter splits rows {f.rows(role)} of the fused "
                f"'{f.hf}.weight' into it"
            )
            split_points.append(Point("archon_param", archon=name, what=what))
    failing[:0] = split_points
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
