"""Adapter-only weight sync (``rollout.lora_sync``): the built-in server loads a PEFT folder and then serves what the
merged model serves; ``AdapterWeightSync`` from a trained LoRA engine makes the server follow each version; the
client names the adapter in SGLang's and vLLM's spelling; 'auto' resolves as documented; launched servers get
their LoRA flags."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from dist_utils import run_distributed
from engine_utils import engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf

from archon.config import ConfigError, load_config
from archon.config.lora import LoRAConfig
from archon.config.lora_sync import resolved_lora_sync
from archon.launch.servers import build_launch_specs
from archon.rollout.adapter_weight_sync import AdapterWeightSync
from archon.rollout.client import RolloutClient
from archon.rollout.server_api import BuiltinServerAPI, ServerAPI
from archon.rollout.vllm import VLLMAPI
from archon.rollout.weight_sync import weight_sync_for
from archon.server.app import serve_in_thread
from archon.server.generator import Generator

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
LORA = LoRAConfig(enabled=True, rank=4, alpha=8, target_modules=["all-linear"])
TOL = 1e-5


@pytest.fixture(scope="module")
def base_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf(folder, "qwen3", seed=3)
    return str(folder)


def _engine(path: str, steps: int) -> Any:
    from archon.engine.engine import ArchonEngine

    return ArchonEngine(engine_config(path, "archon:d1", lora=LORA), total_steps=steps).initialize()


def _train_and_export(path: str, out: str) -> None:
    engine = _engine(path, 3)
    for step in range(3):
        engine.train_batch(make_batch(step), sft_loss, sft_weight)
    assert engine.export_peft(Path(out) / "adapter")
    engine.export_hf(Path(out) / "merged")


def _outputs(client: RolloutClient) -> list[tuple[list[int], list[float], str]]:
    return [(r.output_ids, r.output_logprobs, r.weight_version) for r in client.generate_many(PROMPTS, GREEDY)]


def _assert_same(got: list, want: list) -> None:
    for (ids, lps, _), (want_ids, want_lps, _) in zip(got, want, strict=True):
        assert ids == want_ids
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) <= TOL


def _max_diff(a: list, b: list) -> float:
    return max(abs(x - y) for (_, la, _), (_, lb, _) in zip(a, b) for x, y in zip(la, lb))


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _serve(folder: str, model_path: str | None = None) -> Any:
    return serve_in_thread(Generator.from_hf(folder, random_seed=0), model_path=model_path or folder)


def test_the_built_in_server_serves_a_loaded_adapter_as_the_merged_model(base_path, tmp_path):
    run_distributed(_train_and_export, 1, base_path, str(tmp_path))
    base, merged = _serve(base_path), _serve(str(tmp_path / "merged"))
    try:
        with RolloutClient([base.url], api=BuiltinServerAPI()) as client, RolloutClient([merged.url]) as ref:
            before = _outputs(client)
            want = _outputs(ref)
            assert _max_diff(before, want) > 1e-3  # the adapter matters, so the comparisons below can fail
            client.load_lora_adapter("step-3", str(tmp_path / "adapter"), "3")
            after = _outputs(client)
            _assert_same(after, want)
            assert {v for _, _, v in after} == {"3"}  # the load carried the weight version
            status, body = _post(base.url, "/generate", {"input_ids": [5, 6], "lora_path": "step-2"})
            assert status == 400 and "'step-2'" in body["error"]["message"]
            client.unload_lora_adapter()
            _assert_same(_outputs(client), before)
            status, body = _post(base.url, "/generate", {"input_ids": [5, 6], "lora_path": "step-3"})
            assert status == 400 and "no adapter is loaded" in body["error"]["message"]
            status, body = _post(base.url, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
            assert status == 400 and "visible to this server" in body["message"]
    finally:
        base.stop()
        merged.stop()


def _sync_two_versions(path: str, run_dir: str) -> dict[str, Any]:
    engine = _engine(path, 4)
    server = _serve(path)
    client = RolloutClient([server.url], api=BuiltinServerAPI())
    sync = AdapterWeightSync(engine, client, Path(run_dir) / "lora_sync")
    sync.setup()
    out: dict[str, Any] = {}
    try:
        for version in (1, 2):
            for step in range(2):
                engine.train_batch(make_batch(2 * version + step), sft_loss, sft_weight)
            sync.sync(version)
            out[f"served{version}"] = _outputs(client)
            out[f"names{version}"] = list(client.lora_names.values())
            engine.export_hf(Path(run_dir) / f"merged{version}")
            reference = _serve(str(Path(run_dir) / f"merged{version}"))
            with RolloutClient([reference.url]) as ref:
                out[f"merged{version}"] = _outputs(ref)
            reference.stop()
        out["folders"] = sorted(p.name for p in (Path(run_dir) / "lora_sync").iterdir())
    finally:
        client.close()
        server.stop()
    return out


def test_adapter_weight_sync_makes_the_server_follow_each_version(base_path, tmp_path):
    out = run_distributed(_sync_two_versions, 1, base_path, str(tmp_path))[0]
    for version in (1, 2):
        _assert_same(out[f"served{version}"], out[f"merged{version}"])
        assert {v for _, _, v in out[f"served{version}"]} == {str(version)}
    assert _max_diff(out["merged1"], out["merged2"]) > 1e-3  # version 2 differs, so following it is checked
    assert out["names1"] == ["archon-v1"] and out["names2"] == ["archon-v2"]
    assert out["folders"] == ["v1", "v2"]  # keep_last 2: the adapter being replaced stays readable


def test_generate_requests_name_the_adapter_in_each_servers_spelling():
    assert "lora_path" not in ServerAPI().generate_payload([1], {}, True, "r")
    assert ServerAPI().generate_payload([1], {}, True, "r", lora_name="archon-v3")["lora_path"] == "archon-v3"
    vllm = VLLMAPI().generate_payload([1], {"max_new_tokens": 4}, True, "r", lora_name="archon-v3")
    assert vllm["model"] == "archon-v3"
    assert "model" not in VLLMAPI().generate_payload([1], {"max_new_tokens": 4}, True, "r")
    sglang = ServerAPI().load_lora_adapter("archon-v3", "/run/lora_sync/v3", "3")
    assert [(c.path, c.payload) for c in sglang] == [
        ("/load_lora_adapter", {"lora_name": "archon-v3", "lora_path": "/run/lora_sync/v3"}),
        ("/update_weight_version", {"new_version": "3", "abort_all_requests": False}),
    ]
    assert [c.path for c in VLLMAPI().load_lora_adapter("a", "/p", "3")] == [
        "/v1/load_lora_adapter",
        "/update_weight_version",
    ]
    assert VLLMAPI().unload_lora_adapter("a")[0].path == "/v1/unload_lora_adapter"
    assert ServerAPI().unload_lora_adapter("a")[0].payload == {"lora_name": "a"}


def _cfg(*overrides: str) -> Any:
    return load_config(None, ["actor.path=/models/tiny", *overrides])


def test_lora_sync_auto_resolves_to_adapters_only_where_servers_can_load_them(tmp_path):
    lora = "actor.lora.enabled=true"
    assert resolved_lora_sync(_cfg()) == "merged"  # no adapters
    assert resolved_lora_sync(_cfg(lora)) == "adapter"
    assert resolved_lora_sync(_cfg(lora, "actor.backend=fsdp:d1")) == "adapter"
    assert resolved_lora_sync(_cfg(lora, "rollout.weight_sync=tensor", "rollout.colocate=true")) == "merged"
    assert resolved_lora_sync(_cfg(lora, "rollout.backend=inprocess:d1")) == "merged"
    assert resolved_lora_sync(_cfg(lora, "actor.archon.moe_load_balance=aux_free")) == "merged"
    assert resolved_lora_sync(_cfg(lora, "rollout.lora_sync=merged")) == "merged"
    with pytest.raises(ConfigError, match="actor.lora.enabled is false"):
        _cfg("rollout.lora_sync=adapter")
    with pytest.raises(ConfigError, match="set rollout.lora_sync = 'merged'"):
        _cfg(lora, "rollout.lora_sync=adapter", "rollout.backend=inprocess:d1")
    sync = weight_sync_for(_cfg(lora, f"output_dir='{tmp_path}'"), object(), None, "cpu")  # type: ignore[arg-type]
    assert isinstance(sync, AdapterWeightSync) and sync.folders.folder == tmp_path / "lora_sync"


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_launched_servers_get_lora_flags_only_with_adapter_sync(tmp_path):
    lora = ["actor.lora.enabled=true", "actor.lora.rank=4"]
    (sg,) = build_launch_specs(
        _cfg(*lora, "rollout.backend=sglang:d1", "actor.lora.target_modules=['q_proj','v_proj']"), tmp_path, ports=[1]
    )
    assert "--enable-lora" in sg.cmd and _flag(sg.cmd, "--max-lora-rank") == "4"
    assert sg.cmd[sg.cmd.index("--lora-target-modules") + 1 :][:2] == ["q_proj", "v_proj"]
    (sg_all,) = build_launch_specs(
        _cfg(*lora, "rollout.backend=sglang:d1", "actor.lora.target_modules=['all-linear']"), tmp_path, ports=[1]
    )
    assert _flag(sg_all.cmd, "--lora-target-modules") == "all"
    (vl,) = build_launch_specs(_cfg(*lora, "rollout.backend=vllm:d1", "rollout.weight_sync=disk"), tmp_path, ports=[1])
    assert "--enable-lora" in vl.cmd and _flag(vl.cmd, "--max-lora-rank") == "8"  # vLLM's smallest rank >= 4
    assert vl.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    merged = _cfg(*lora, "rollout.backend=vllm:d1", "rollout.weight_sync=disk", "rollout.lora_sync=merged")
    (plain,) = build_launch_specs(merged, tmp_path, ports=[1])
    assert "--enable-lora" not in plain.cmd and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env
