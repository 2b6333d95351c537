"""rollout.colocate, actor.offload and the inprocess backend: what the config accepts, refuses and defaults."""

from __future__ import annotations

import pytest

from archon.config import ConfigError, load_config

COLOCATED = ["rollout.colocate=true"]


def test_colocation_is_off_by_default_and_keeps_the_servers_memory_shares():
    cfg = load_config()
    assert (cfg.rollout.colocate, cfg.actor.offload) == (False, False)
    assert (cfg.sglang.mem_fraction_static, cfg.vllm.gpu_memory_utilization) == (0.8, 0.9)


def test_colocated_servers_leave_half_the_gpu_to_the_trainer_unless_set():
    cfg = load_config(overrides=[*COLOCATED, "rollout.backend=sglang:d2", "actor.backend=archon:d2"])
    assert (cfg.sglang.mem_fraction_static, cfg.vllm.gpu_memory_utilization) == (0.5, 0.5)
    cfg = load_config(
        overrides=[
            *COLOCATED,
            "sglang.mem_fraction_static=0.7",
            "vllm.gpu_memory_utilization=0.6",
            "actor.offload=true",
        ]
    )
    assert (cfg.sglang.mem_fraction_static, cfg.vllm.gpu_memory_utilization, cfg.actor.offload) == (0.7, 0.6, True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.backend=sglang:d2t2", "actor.backend=archon:d8"],
            r"rollout.backend = 'sglang:d2t2' \(from the command line, 4 GPUs\) must use as many GPUs as actor.backend "
            r"= 'archon:d8' \(8\); change the d of rollout.backend, e.g. 'sglang:d4t2'",
        ),
        (
            ["rollout.backend=vllm:d1t4", "actor.backend=archon:d2"],
            r"\(2\); change the d of rollout.backend \(and t\*p to a divisor of the actor's\)",
        ),
        (
            ["rollout.backend=sglang:d1", "rollout.server_addrs=['h:1']"],
            "rollout.server_addrs .* lists servers started elsewhere, which cannot be placed",
        ),
        (["rollout.backend=inprocess:d1"], "'inprocess:d1' .* starts no server .*; set rollout.colocate = false"),
    ],
)
def test_colocated_layouts_that_cannot_run_are_refused_in_one_sentence(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*COLOCATED, *overrides])


def test_a_colocated_sft_run_has_no_servers_to_match():
    cfg = load_config(overrides=[*COLOCATED, "rollout.backend=sglang:d1", "actor.backend=archon:d4"], job="sft")
    assert cfg.rollout.colocate


def test_offload_without_colocation_is_refused():
    with pytest.raises(ConfigError, match="actor.offload = true .* only helps with rollout.colocate = true"):
        load_config(overrides=["actor.offload=true"])


def test_the_in_process_backend_takes_a_plain_archon_actor_of_the_same_d():
    cfg = load_config(overrides=["rollout.backend=inprocess:d2", "actor.backend=archon:d2"])
    assert cfg.allocations()["rollout"].backend == "inprocess"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.backend=fsdp:d1"], "runs Archon's built-in generator .* write 'archon:d1'"),
        (["actor.backend=archon:d1t2", "rollout.backend=inprocess:d1"], "splits it \\(t, p, c or e\\)"),
        (["actor.backend=archon:d2"], "its d must equal the actor's: write 'inprocess:d2'"),
        (["rollout.server_addrs=['h:1']"], "generates inside the trainer and uses none"),
        (["rollout.max_head_offpolicyness=1"], "rollout.max_head_offpolicyness = 1 .* generates on the weights"),
        (["rollout.backend=inprocess:d1t2"], "tensor parallel 't' is not supported by backend 'inprocess'"),
    ],
)
def test_in_process_layouts_that_cannot_run_are_refused_in_one_sentence(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["rollout.backend=inprocess:d1", *overrides])


def test_colocated_runs_hand_weights_over_by_reference_and_refuse_what_cannot_take_turns():
    base = ["rollout.backend=local:d1", "actor.backend=archon:d1", "rollout.colocate=true"]
    assert load_config(None, base).rollout.weight_sync == "tensor"
    assert load_config(None, [*base, "rollout.weight_sync=disk"]).rollout.weight_sync == "disk"
    with pytest.raises(ConfigError, match="cannot share a GPU under NCCL"):
        load_config(None, [*base, "rollout.weight_sync=distributed"])
    with pytest.raises(ConfigError, match="take turns on the same GPUs"):
        load_config(None, [*base, "rollout.max_head_offpolicyness=1"])
    with pytest.raises(ConfigError, match="only colocated servers are"):
        load_config(None, ["rollout.backend=local:d1", "actor.backend=archon:d1", "rollout.weight_sync=tensor"])
    with pytest.raises(ConfigError, match="keeps it there all the time"):
        load_config(None, [*base, "actor.offload=true", "actor.archon.offload_params=true"])
