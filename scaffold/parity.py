"""The checks a generated parity test runs: an Archon model package against transformers' own model.

``ParityCase`` builds a tiny random checkpoint of the model type with transformers (sizes and
settings written into the test), saves it, and compares the registered Archon package with it:
logits of whole and packed rows, a strict load, a save that transformers loads back, refusals
of unsupported settings, and each difference ``scripts/add_model.py`` listed (``probe.Point``).
"""

from __future__ import annotations

import tempfile
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from models import get_model_spec, load_hf_weights, read_hf_config, save_hf
from models.model_args import HFConfigError, allow_unimplemented
from scaffold import probe
from scaffold.analysis import perturb_


class ParityCase:
    """One tiny checkpoint of ``model_type`` and the Archon package that serves it."""

    def __init__(self, model_type: str, tiny_config: dict[str, Any], folder: str | Path, seed: int = 0):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_type = model_type
        self.folder = Path(folder)
        config = AutoConfig.for_model(model_type, **tiny_config)
        torch.manual_seed(seed)
        self.hf = perturb_(AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed).eval()
        self.hf.save_pretrained(self.folder)
        self.spec = get_model_spec(model_type)
        self.trace = probe.trace(self.hf, probe.probe_ids(config.vocab_size))

    def _args(self, is_critic: bool = False):
        with allow_unimplemented():
            return self.spec.model_args_class.from_hf_config(read_hf_config(self.folder), is_critic=is_critic)

    def load(self, strict: bool = True) -> torch.nn.Module:
        """The Archon model filled from the tiny checkpoint (``strict``: every tensor used, every parameter filled)."""
        args = self._args()
        with torch.device("meta"):
            model = self.spec.model_class(args)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()  # pyright: ignore[reportCallIssue]  (a Decoder-like model class)
        load_hf_weights(model, self.folder, self.spec.state_dict_adapter_class(args), strict=strict)
        return model.eval()

    @cached_property
    def model(self) -> torch.nn.Module:
        """The model as far as the package maps the checkpoint (what the difference probes compare)."""
        return self.load(strict=False)

    # ------------------------------------------------------------------ checks
    @torch.no_grad()
    def check_logits(self) -> None:
        ids = torch.randint(0, self.hf.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
        ours, theirs = self.load()(ids), self.hf(input_ids=ids).logits
        assert probe.same(ours, theirs, 1e-4), f"logits differ from transformers: {probe.max_diff(ours, theirs)}"

    @torch.no_grad()
    def check_packed(self) -> None:
        model = self.load()
        g = torch.Generator().manual_seed(2)
        a, b = (torch.randint(0, self.hf.config.vocab_size, (1, n), generator=g) for n in (7, 5))
        cu = torch.tensor([0, 7, 12], dtype=torch.int32)
        packed = model(torch.cat([a, b], dim=1), cu_seqlens=cu)
        alone = torch.cat([self.hf(input_ids=a).logits, self.hf(input_ids=b).logits], dim=1)
        assert probe.same(packed, alone, 1e-4), f"packed rows differ: {probe.max_diff(packed, alone)}"

    def check_load(self) -> None:
        self.load(strict=True)

    @torch.no_grad()
    def check_save(self) -> None:
        from transformers import AutoModelForCausalLM

        model = self.load()
        with tempfile.TemporaryDirectory() as out:
            save_hf(model, out)
            back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            ids = probe.probe_ids(self.hf.config.vocab_size, seed=3)
            ours, theirs = model(ids), back(input_ids=ids).logits
        assert probe.same(ours, theirs, 1e-4), (
            f"the saved folder loads with other logits: {probe.max_diff(ours, theirs)}"
        )

    def check_refuses(self, key: str, value: Any, mention: str = "") -> None:
        cfg = read_hf_config(self.folder)
        cfg[key] = value
        try:
            with allow_unimplemented():
                self.spec.model_args_class.from_hf_config(cfg)
        except HFConfigError as exc:
            assert (mention or key) in str(exc), f"the refusal does not mention {mention or key}: {exc}"
            return
        raise AssertionError(f"{key}={value!r} was accepted, but the package does not implement it")

    def check_point(self, point: probe.Point) -> None:
        adapter = self.spec.state_dict_adapter_class(self.model.args)
        problem = probe.check(point, self.hf, self.model, self.trace, adapter)
        assert problem is None, f"{point.what} ({problem})"
