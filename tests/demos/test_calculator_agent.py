"""The agentic CPU demo: its tokenizer and chat template, data, rewards and tool, and one episode of its agent
through the recording proxy and a real built-in server (the ids of each turn, the tool's message between them)."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

import models
from archon.demos.calculator_agent import (
    TOOL_ERROR,
    WORKFLOW,
    CalculatorTask,
    calculator_agent,
    copy_score,
    main,
    make_assets,
    make_rows,
    run_calculator,
    vocabulary,
)
from archon.demos.first_letter import EOS_TOKEN
from archon.rl.agent import RecordingProxy, Trajectory, load_workflow, run_episode
from archon.rollout.client import BuiltinServerAPI, RolloutClient
from archon.server.app import serve_in_thread
from archon.server.generator import Generator
from archon.server.weight_update import read_eos_token_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TASK = CalculatorTask(n_train=64, n_test=8)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("calculator") / "assets", TASK)


@pytest.fixture(scope="module")
def tok(assets):
    return AutoTokenizer.from_pretrained(assets.model)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_tokenizer_and_chat_template(tok):
    assert tok.convert_ids_to_tokens(ids(tok, "37+4|?")) == list("37+4|?")
    assert tok.decode(ids(tok, "99+9|108")) == "99+9|108"
    messages = [
        {"role": "user", "content": "37+4"},
        {"role": "assistant", "content": "37+4"},
        {"role": "tool", "content": "41"},
        {"role": "assistant", "content": "41"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"37+4|37+4{EOS_TOKEN}41|41{EOS_TOKEN}"
    assert tok.convert_ids_to_tokens(ids(tok, text))[9] == EOS_TOKEN  # EOS is one id, not five characters


def test_rows_are_deterministic_disjoint_and_correct():
    rows = make_rows(TASK)
    assert rows == make_rows(TASK) and rows != make_rows(CalculatorTask(n_train=64, n_test=8, seed=1))
    assert len(rows["train"]) == 64 and len(rows["test"]) == 8
    assert not {r["prompt"] for r in rows["test"]} & {r["prompt"] for r in rows["train"]}
    for row in rows["train"] + rows["test"]:
        a, b = row["prompt"].split("+")
        assert int(row["answer"]) == int(a) + int(b) and int(row["answer"]) <= 9


def test_scores_and_tool_on_hand_written_cases(tok):
    eos = tok.eos_token_id
    assert copy_score([*ids(tok, "37+4"), eos], "37+4") == 1.0
    assert copy_score(ids(tok, "37+4+"), "37+4") == 0.5  # right characters, but no EOS after them
    assert copy_score([*ids(tok, "31+4"), eos], "37+4") == 0.75
    assert copy_score([*ids(tok, "4"), eos], "41") == 0.25  # one of two right, stopped too early: halved
    assert copy_score([], "41") == 0.0
    assert run_calculator("37+4") == "41" and run_calculator("9+") == TOOL_ERROR and run_calculator("") == TOOL_ERROR
    assert set(run_calculator("99+9")) <= set(vocabulary()[3:])  # the tool's answers are in the vocabulary


def test_the_agent_runs_two_recorded_turns_with_the_tool_between_them(assets, tok):
    assert load_workflow(WORKFLOW) is calculator_agent
    folder = assets.model
    gen = Generator(models.load_hf_model(folder), eos_token_ids=read_eos_token_ids(folder), context_length=64)
    server = serve_in_thread(gen, model_path=str(folder))
    client = RolloutClient([server.url], api=BuiltinServerAPI(), retries=0)
    sample = {"prompt": "3+4", "answer": "7"}

    async def episode() -> Trajectory:
        sampling = {"temperature": 1.0, "max_new_tokens": 6, "stop_token_ids": [tok.eos_token_id]}
        async with RecordingProxy(client, tok, sampling=sampling) as proxy:
            return await run_episode(calculator_agent, sample, proxy, seed=5)

    try:
        traj = asyncio.run(episode())
        again = asyncio.run(episode())
    finally:
        client.close()
        server.stop()
    assert traj.truncation is None and traj.n_turns == 2 and traj.turn_rewards is not None
    first, second = traj.turns
    assert first.context_ids == ids(tok, "3+4|")
    call = tok.decode(first.output_ids, skip_special_tokens=True)
    # The second turn appends what the calculator said about the sampled call, as a tool message.
    tool_text = tok.decode(second.context_ids, skip_special_tokens=False)
    closing = "" if first.output_ids[-1:] == [tok.eos_token_id] else EOS_TOKEN
    assert tool_text == f"{closing}{run_calculator(call)}|"
    answer = second.output_ids
    assert traj.turn_rewards == [0.5 * copy_score(first.output_ids, "3+4"), 0.5 * copy_score(answer, "7")]
    assert traj.metrics == {
        "tool_ok": float(run_calculator(call) != TOOL_ERROR),
        "call_right": float(traj.turn_rewards[0] == 0.5),
        "answer_right": float(traj.turn_rewards[1] == 0.5),
    }
    assert again.tokens().input_ids == traj.tokens().input_ids  # episode seeds make it repeat


def test_cli_writes_the_assets(tmp_path, capsys):
    assert main(["make-assets", str(tmp_path / "a")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "a" / "data" / "train.jsonl").read_text().splitlines()]
    assert rows and "calculator agent demo assets" in capsys.readouterr().out
    assert main(["make-assets", str(tmp_path / "a" / "data" / "train.jsonl")]) == 2  # a file, not a folder
