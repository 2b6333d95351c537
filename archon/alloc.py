"""The allocation grammar: how one string lays an engine over devices.

    <backend>[<name>]:<dims>                       archon:d4p2t2, sglang:d4t2, local:d1
    <backend>:(attn:<dims>|ffn:<dims>)             archon:(attn:d1p4t2c2|ffn:d1p4t1e4)
    <component>+<component>[+...]                 sglang:d4t4+archon:d4

Dims are ``d`` (data), ``t`` (tensor), ``p`` (pipeline), ``c`` (context) and ``e`` (expert),
each followed by a positive size, in any order, at most once; missing dims are 1.  An
engine needs ``d*t*p*c`` devices; ``e`` borrows ranks inside one pipeline stage and adds
none.  The hybrid MoE form gives attention and experts their own layouts over the same
ranks (MoE parallel folding): the attention strategy is the mesh, the ffn ``e`` is the
expert-parallel size and the ffn ``t`` the expert-tensor-parallel size.

Pure Python on purpose: the config, the launcher and ``parallel/`` use it without torch.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from archon.errors import ArchonError

INFERENCE_BACKENDS: dict[str, str] = {"sglang": "dt", "vllm": "dtp", "local": "d", "inprocess": "d"}
"""Inference backends and the dims they accept (``local`` is Archon's built-in server; ``inprocess`` its engine inside
the trainer, on the actor's weights: ``archon.rl.inprocess``)."""
TRAINING_BACKENDS: dict[str, str] = {"fsdp": "dtc", "megatron": "dtpce", "archon": "dtpce"}
"""Training backends and the dims they accept."""
BACKENDS: dict[str, str] = {**INFERENCE_BACKENDS, **TRAINING_BACKENDS}
HYBRID_BACKENDS = ("megatron", "archon")
"""Backends that accept the ``(attn:...|ffn:...)`` MoE form."""

_DIM_NAMES = {"d": "data", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}
_CANONICAL_ORDER = "dptce"
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


class AllocationError(ArchonError, ValueError):
    """An allocation string a user wrote is wrong; the message quotes it and says how to fix it."""


@dataclass(frozen=True)
class ParallelStrategy:
    """Sizes of the five parallel dimensions of one training or inference engine."""

    dp_size: int = 1
    """Data parallel: model replicas (FSDP shards for training, server instances for inference)."""
    tp_size: int = 1
    """Tensor parallel: ranks that split each matmul."""
    pp_size: int = 1
    """Pipeline parallel: stages the layers are split into."""
    cp_size: int = 1
    """Context parallel (Ulysses): ranks that split the sequence."""
    ep_size: int = 1
    """Expert parallel: ranks that split the experts; borrowed from dp*cp*tp, adds no ranks."""
    etp_size: int = 1
    """Expert tensor parallel: ranks that split each expert (the ffn ``t`` of the hybrid form)."""

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size * self.pp_size * self.cp_size

    @property
    def ranks_per_stage(self) -> int:
        """Ranks inside one pipeline stage (what ep*etp folds into)."""
        return self.dp_size * self.cp_size * self.tp_size


@dataclass(frozen=True)
class ModelAllocation:
    """One engine's allocation: backend, optional name, and parallel strategy."""

    backend: str
    """Backend name, e.g. 'archon' or 'sglang'."""
    parallel: ParallelStrategy
    """The strategy (for the hybrid form: the attention side, with ep/etp from ffn)."""
    name: str | None = None
    """Component name from ``backend[name]:...``, if given."""
    ffn: ParallelStrategy | None = field(default=None, compare=True)
    """The expert (ffn) side of the hybrid form: dp, tp (=etp), pp, ep; None for the plain form."""

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def is_inference(self) -> bool:
        return self.backend in INFERENCE_BACKENDS

    @property
    def is_training(self) -> bool:
        return self.backend in TRAINING_BACKENDS

    @property
    def is_hybrid(self) -> bool:
        return self.ffn is not None

    @classmethod
    def from_str(cls, text: str) -> ModelAllocation:
        """Parse one component such as ``archon:d4p2t2``; chains belong to AllocationMode."""
        if not isinstance(text, str):
            raise AllocationError(f"an allocation must be a string such as 'archon:d4', got {text!r}")
        components = _Parser(text).parse_mode()
        if len(components) > 1:
            raise AllocationError(
                f"allocation '{text}' has {len(components)} components joined by '+', but one "
                f"engine takes a single allocation such as '{components[-1]}'"
            )
        return components[0]

    def to_str(self) -> str:
        prefix = self.backend + (f"[{self.name}]" if self.name else "") + ":"
        p = self.parallel
        if self.ffn is None:
            dims = {"d": p.dp_size, "p": p.pp_size, "t": p.tp_size, "c": p.cp_size, "e": p.ep_size}
            return prefix + _format_dims(dims, always="d")
        attn = _format_dims({"d": p.dp_size, "p": p.pp_size, "t": p.tp_size, "c": p.cp_size}, always="dpt")
        f = self.ffn
        ffn = _format_dims({"d": f.dp_size, "p": f.pp_size, "t": f.tp_size, "e": f.ep_size}, always="dpte")
        return f"{prefix}(attn:{attn}|ffn:{ffn})"

    def __str__(self) -> str:
        return self.to_str()


def _format_dims(dims: dict[str, int], always: str) -> str:
    return "".join(f"{k}{dims[k]}" for k in _CANONICAL_ORDER if k in dims and (dims[k] > 1 or k in always))


class AllocationMode:
    """A ``+`` chain of allocations, e.g. rollout servers plus a training engine."""

    def __init__(self, components: list[ModelAllocation], text: str = ""):
        self.components = components
        self.text = text or "+".join(map(str, components))

    @classmethod
    def from_str(cls, text: str) -> AllocationMode:
        if not isinstance(text, str):
            raise AllocationError(f"an allocation must be a string such as 'sglang:d4+archon:d4', got {text!r}")
        return cls(_Parser(text).parse_mode(), text)

    def __iter__(self) -> Iterator[ModelAllocation]:
        return iter(self.components)

    def __len__(self) -> int:
        return len(self.components)

    def __getitem__(self, name: str) -> ModelAllocation:
        for comp in self.components:
            if comp.name == name:
                return comp
        names = [c.name for c in self.components if c.name]
        raise KeyError(
            f"allocation '{self.text}' has no component named '{name}'"
            + (f"; its names are {', '.join(names)}" if names else "; name components as backend[name]:dims")
        )

    def _one(self, inference: bool) -> ModelAllocation | None:
        matches = [c for c in self.components if c.is_inference == inference]
        if len(matches) > 1:
            kind = "inference" if inference else "training"
            raise AllocationError(
                f"allocation '{self.text}' has {len(matches)} {kind} components; pick one by "
                f"name with mode['<name>'] instead of .{'gen' if inference else 'train'}"
            )
        return matches[0] if matches else None

    @property
    def gen(self) -> ModelAllocation | None:
        """The inference component (None if there is none)."""
        return self._one(True)

    @property
    def train(self) -> ModelAllocation | None:
        """The training component (None if there is none)."""
        return self._one(False)

    @property
    def world_size(self) -> int:
        return sum(c.world_size for c in self.components)

    @property
    def gen_world_size(self) -> int:
        return sum(c.world_size for c in self.components if c.is_inference)

    @property
    def train_world_size(self) -> int:
        return sum(c.world_size for c in self.components if not c.is_inference)

    def __str__(self) -> str:
        return "+".join(map(str, self.components))

    def __repr__(self) -> str:
        return f"AllocationMode({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AllocationMode) and self.components == other.components


# --------------------------------------------------------------------------------------
# Parser: a small hand-written scanner so every error can point at its part of the string.
# --------------------------------------------------------------------------------------


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    # ---- errors -----------------------------------------------------------------------
    def fail(self, what: str, fix: str, at: int | None = None) -> AllocationError:
        at = self.pos if at is None else at
        where = f" at position {at}" if 0 <= at < len(self.text) else ""
        return AllocationError(f"invalid allocation '{self.text}'{where}: {what}; {fix}")

    # ---- scanning ---------------------------------------------------------------------
    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        self.skip_ws()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, char: str, fix: str) -> None:
        if self.peek() != char:
            found = f"'{self.peek()}'" if self.peek() else "the end of the string"
            raise self.fail(f"expected '{char}' but found {found}", fix)
        self.pos += 1

    def word(self) -> str:
        self.skip_ws()
        m = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*").match(self.text, self.pos)
        if not m:
            return ""
        self.pos = m.end()
        return m.group(0)

    # ---- grammar ----------------------------------------------------------------------
    def parse_mode(self) -> list[ModelAllocation]:
        text = self.text
        if not text.strip():
            raise AllocationError(
                "the allocation string is empty; write one such as 'archon:d4' or 'sglang:d4t2+archon:d4'"
            )
        self._reject_legacy()
        components = [self.parse_component()]
        while self.peek() == "+":
            self.pos += 1
            components.append(self.parse_component())
        if self.peek():
            raise self.fail(
                f"unexpected '{self.text[self.pos :]}'",
                "join components with '+' and write dims as letters with sizes, e.g. 'sglang:d4t2+archon:d4'",
            )
        self._check_chain(components)
        return components

    def _reject_legacy(self) -> None:
        stripped = self.text.strip()
        if ":" not in stripped and re.fullmatch(r"(\s*[dtpce]\s*\d+\s*)+", stripped):
            raise AllocationError(
                f"allocation '{self.text}' has no backend; a backend prefix is required: write "
                f"'archon:{stripped.replace(' ', '')}' for training or "
                f"'sglang:{stripped.replace(' ', '')}' for inference"
            )
        m = re.fullmatch(r"\s*(sglang|vllm)\.([dtp\d]+)\s*(?:\+\s*([dtpce\d]+))?\s*", self.text)
        if m:
            backend, gen_dims, train_dims = m.groups()
            if backend == "sglang":
                sizes = dict(re.findall(r"([dtp])(\d+)", gen_dims))
                gen_dims = "".join(f"{k}{v}" for k, v in re.findall(r"([dtp])(\d+)", gen_dims) if k != "p")
                if int(sizes.get("p", "1")) > 1:
                    backend, gen_dims = "vllm", m.group(2)
            modern = f"{backend}:{gen_dims}" + (f"+archon:{train_dims}" if train_dims else "")
            raise AllocationError(
                f"the dotted allocation form '{self.text}' is no longer accepted; write "
                f"'{modern}' (backend, colon, dims; every component needs its backend)"
            )

    def parse_component(self) -> ModelAllocation:
        start = self.pos
        self.skip_ws()
        start = self.pos
        backend = self.word()
        if not backend:
            found = self.text[self.pos : self.pos + 1] or "nothing"
            raise self.fail(
                f"expected a backend name but found '{found}'",
                f"start each component with a backend ({', '.join(BACKENDS)}), e.g. 'archon:d4'",
            )
        if backend not in BACKENDS:
            if re.fullmatch(r"([dtpce]\d+)+", backend):
                raise self.fail(
                    f"'{backend}' has no backend",
                    f"a backend prefix is required: write "
                    f"'archon:{backend}' for training or 'sglang:{backend}' for inference",
                    at=start,
                )
            near = difflib.get_close_matches(backend, list(BACKENDS), n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            raise self.fail(f"unknown backend '{backend}'", f"{hint}known backends are {', '.join(BACKENDS)}", at=start)
        name = None
        if self.peek() == "[":
            self.pos += 1
            self.skip_ws()
            name_start = self.pos
            name = self.word()
            if not name or not _NAME_RE.fullmatch(name):
                raise self.fail(
                    "expected a component name inside '[...]'",
                    "names start with a letter or '_', e.g. 'sglang[rollout]:d2'",
                    at=name_start,
                )
            self.expect("]", f"close the name with ']', e.g. '{backend}[{name}]:d2'")
        if self.peek() != ":":
            raise self.fail(
                f"backend '{backend}' is not followed by ':'", f"write the dims after a colon, e.g. '{backend}:d2'"
            )
        self.pos += 1
        if self.peek() == "(":
            return self.parse_hybrid(backend, name, start)
        dims = self.parse_dims(backend, allowed=BACKENDS[backend], section=None)
        strategy = ParallelStrategy(
            dp_size=dims.get("d", 1),
            tp_size=dims.get("t", 1),
            pp_size=dims.get("p", 1),
            cp_size=dims.get("c", 1),
            ep_size=dims.get("e", 1),
        )
        if strategy.ep_size > 1 and strategy.ranks_per_stage % strategy.ep_size:
            grow = strategy.ep_size // math.gcd(strategy.ep_size, strategy.ranks_per_stage)
            fixed = ModelAllocation(backend, replace(strategy, dp_size=strategy.dp_size * grow), name)
            raise self.fail(
                f"expert parallel e{strategy.ep_size} must divide d*c*t = {strategy.ranks_per_stage} "
                "(EP borrows ranks inside one pipeline stage and adds none)",
                f"raise d, e.g. '{fixed}' ({fixed.world_size} ranks), or pick e from the divisors of d*c*t",
                at=start,
            )
        return ModelAllocation(backend, strategy, name)

    def parse_dims(self, backend: str, allowed: str, section: str | None) -> dict[str, int]:
        dims: dict[str, int] = {}
        self.skip_ws()
        begin = self.pos
        while True:
            ch = self.peek()
            if not ch or ch in "+|)":
                break
            at = self.pos
            if ch not in "dtpce":
                example = f"{backend}:d2" if section is None else f"{section}:d2"
                raise self.fail(
                    f"'{ch}' is not a dimension", f"dims are d, t, p, c, e followed by a size, e.g. '{example}'"
                )
            self.pos += 1
            self.skip_ws()
            m = re.compile(r"\d+").match(self.text, self.pos)
            if not m:
                raise self.fail(f"dimension '{ch}' has no size", f"write a positive integer after it, e.g. '{ch}2'")
            self.pos = m.end()
            size = int(m.group(0))
            if size < 1:
                raise self.fail(f"dimension '{ch}{m.group(0)}' has size 0", "sizes must be at least 1", at=at)
            if ch in dims:
                raise self.fail(f"dimension '{ch}' appears twice", "give each dimension once", at=at)
            if ch not in allowed:
                raise self.fail(*self._not_allowed(ch, backend, allowed, section), at=at)
            dims[ch] = size
        if not dims:
            where = f"section '{section}'" if section else f"backend '{backend}'"
            raise self.fail(f"{where} has no dims", f"write at least one, e.g. '{backend}:d1'", at=begin)
        return dims

    @staticmethod
    def _not_allowed(ch: str, backend: str, allowed: str, section: str | None) -> tuple[str, str]:
        name = _DIM_NAMES[ch]
        if section == "attn" and ch == "e":
            return ("expert parallel 'e' is not allowed in the attn section", "put 'e' in the ffn section")
        if section == "ffn" and ch == "c":
            return ("context parallel 'c' is not allowed in the ffn section", "put 'c' in the attn section")
        accepted = ", ".join(allowed)
        fix = f"{backend} accepts {accepted}"
        if ch in "pe" and backend in ("fsdp",):
            fix += "; use 'archon:' for pipeline or expert parallel"
        elif ch == "p" and backend == "sglang":
            fix += "; use 'vllm:' for pipeline parallel inference"
        return (f"{name} parallel '{ch}' is not supported by backend '{backend}'", fix)

    def parse_hybrid(self, backend: str, name: str | None, start: int) -> ModelAllocation:
        if backend not in HYBRID_BACKENDS:
            raise self.fail(
                f"backend '{backend}' does not take the (attn:...|ffn:...) form",
                f"use {' or '.join(HYBRID_BACKENDS)} for MoE parallel folding",
                at=start,
            )
        self.pos += 1  # '('
        sections: dict[str, dict[str, int]] = {}
        for expected, sep in (("attn", "|"), ("ffn", ")")):
            self.skip_ws()
            at = self.pos
            label = self.word()
            if label not in ("attn", "ffn"):
                raise self.fail(
                    f"expected section '{expected}:' but found '{label or self.peek() or 'the end'}'",
                    f"write '{backend}:(attn:<dims>|ffn:<dims>)'",
                    at=at,
                )
            if label != expected:
                raise self.fail(
                    f"section '{label}' is in the wrong place",
                    f"write attn first, then ffn: '{backend}:(attn:<dims>|ffn:<dims>)'",
                    at=at,
                )
            self.expect(":", f"write '{label}:' followed by its dims")
            allowed = "dtpc" if label == "attn" else "dtpe"
            sections[label] = self.parse_dims(backend, allowed=allowed, section=label)
            self.expect(
                sep,
                "the hybrid form is '(attn:<dims>|ffn:<dims>)'"
                if sep == "|"
                else "close the hybrid form with ')' after the ffn dims",
            )
        attn, ffn = sections["attn"], sections["ffn"]
        pp = attn.get("p", 1)
        if "p" in ffn and ffn["p"] != pp:
            raise self.fail(
                f"pipeline size differs between attn (p{pp}) and ffn (p{ffn['p']})",
                "p must be identical in both sections (or omitted in ffn)",
                at=start,
            )
        world = attn.get("d", 1) * attn.get("t", 1) * pp * attn.get("c", 1)
        ftp, ep = ffn.get("t", 1), ffn.get("e", 1)
        if "d" in ffn:
            fdp = ffn["d"]
        else:
            per = pp * ftp * ep
            if world % per:
                raise self.fail(
                    f"the ffn dp cannot be derived: attn world size {world} is not divisible by p*t*e = {per} of ffn",
                    "choose ffn sizes whose product divides the attn world size, or give ffn 'd' explicitly",
                    at=start,
                )
            fdp = world // per
        fworld = fdp * pp * ftp * ep
        if fworld != world:
            raise self.fail(
                f"world sizes differ: attn d*p*t*c = {world} but ffn d*p*t*e = {fworld}",
                "make both sections cover the same ranks (omit ffn 'd' to derive it)",
                at=start,
            )
        strategy = ParallelStrategy(
            dp_size=attn.get("d", 1),
            tp_size=attn.get("t", 1),
            pp_size=pp,
            cp_size=attn.get("c", 1),
            ep_size=ep,
            etp_size=ftp,
        )
        ffn_strategy = ParallelStrategy(dp_size=fdp, tp_size=ftp, pp_size=pp, ep_size=ep, etp_size=ftp)
        return ModelAllocation(backend, strategy, name, ffn_strategy)

    def _check_chain(self, components: list[ModelAllocation]) -> None:
        names = [c.name for c in components]
        if len(components) >= 3 and not all(names):
            unnamed = [str(c) for c in components if not c.name]
            raise AllocationError(
                f"invalid allocation '{self.text}': with {len(components)} components every one "
                f"needs a name, but {', '.join(repr(u) for u in unnamed)} has none; write e.g. "
                "'sglang[rollout]:d2+archon[actor]:d2+archon[critic]:d2'"
            )
        seen = set()
        for n in names:
            if n is not None and n in seen:
                raise AllocationError(
                    f"invalid allocation '{self.text}': the name '{n}' is used twice; give every component its own name"
                )
            seen.add(n)
        if len(components) == 2 and not any(names):
            kinds = [c.is_inference for c in components]
            if kinds[0] == kinds[1]:
                kind = "inference" if kinds[0] else "training"
                raise AllocationError(
                    f"invalid allocation '{self.text}': both components are {kind} backends and "
                    "unnamed, so it is ambiguous which is which; name them, e.g. "
                    f"'{components[0].backend}[a]:...+{components[1].backend}[b]:...'"
                )


def megatron_refusal(key: str, alloc: ModelAllocation) -> str:
    """Why a ``megatron:`` training allocation is refused, and what to write instead (one sentence)."""
    dims = str(alloc).split(":", 1)[1]
    return (
        f"{key} = '{alloc}' asks for Megatron-Core, which Archon does not bundle; write 'archon:{dims}' "
        "(Archon's models: qwen2, qwen3, qwen3_moe and any added with scripts/add_model.py; every dim) "
        "or, for any other transformers model, 'fsdp:' with d, t and c only"
    )


def allocation_rows(allocs: dict[str, ModelAllocation]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Header and rows (engine, backend, allocation, dp, tp, pp, cp, ep, etp, world size) for printing."""
    header = ("engine", "backend", "allocation", "dp", "tp", "pp", "cp", "ep", "etp", "world size")
    rows = []
    for engine, a in allocs.items():
        p = a.parallel
        rows.append(
            (
                engine,
                a.backend,
                str(a),
                *(str(x) for x in (p.dp_size, p.tp_size, p.pp_size, p.cp_size, p.ep_size, p.etp_size, a.world_size)),
            )
        )
    return header, rows
