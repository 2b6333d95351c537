"""The agentic CPU demo: a tiny model learns from reward alone to call a calculator and copy its answer.

An episode has two turns, run by ``calculator_agent`` (an ordinary agent workflow, ``rollout.workflow``) through
Archon's recording OpenAI endpoint:

1. The user message is a sum of two digits below ten, ``"3+4"``.  The policy's reply is the tool call: the
   expression it wants the calculator to evaluate, then EOS.
2. The calculator's result (``archon.rl.agent.calculator``; ``"?"`` for what it cannot parse) comes back as a tool
   message, ``"7"``.  The policy's reply is its final answer, then EOS.

The agent returns one reward per turn: half a point for the call (the fraction of the question's characters it
wrote in place, halved unless it stopped right after them) and half for the answer (the same against the true
sum).  Only a call with the right expression brings back the right sum, so the model must learn both: call the tool
with what it was asked, and copy what the tool said.  A randomly initialised model does neither.

The chat template is three rules over characters: a user or tool message is its text and ``|``, an assistant
message its text and EOS, no generation prompt; so the second turn's prompt is ``3+4|3+4<eos>7|``, the
recorded ids of turn one plus the tool message's.

    python -m archon.demos.calculator_agent make-assets outputs/demo_agent/assets

writes, without downloading anything:

    OUT_DIR/model/            tiny Qwen3 + character-level tokenizer with the chat template
    OUT_DIR/data/train.jsonl  prompts ``{"prompt", "answer"}``: the sum and its value
    OUT_DIR/data/test.jsonl   held-out sums (none appears in train.jsonl)
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from archon.demos.digits import DigitsAssets, char_tokenizer, write_assets
from archon.demos.first_letter import EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, TinyQwen3
from archon.rl.agent.tools import calculator

CHARACTERS = "0123456789+|?"
"""Every non-special token: one per character ('|' ends a user or tool message, '?' is the tool's error)."""
MESSAGE_END = "|"
TOOL_ERROR = "?"
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ m['content'] }}{{ eos_token }}"
    "{%- else -%}{{ m['content'] }}|{%- endif -%}"
    "{%- endfor -%}"
)
"""User and tool messages end with '|', assistant messages with EOS; there is no generation prompt."""
WORKFLOW = "archon.demos.calculator_agent:calculator_agent"
"""The agent the demo config names (``rollout.workflow``)."""
CALL_TOKENS = 4
"""Most ids a tool call may take: the question (3 characters) and EOS; a call that does not stop is cut one later."""
ANSWER_TOKENS = 2
"""Most ids a final answer may take: the sum (one digit) and EOS."""


@dataclass(frozen=True)
class CalculatorTask:
    """The sums asked: ``a+b`` of digits whose sum is at most ``max_sum``."""

    max_sum: int = 9
    """Largest sum asked (one-digit answers; longer calls and answers made the learning several times slower)."""
    n_train: int = 4096
    """Training prompts (sums repeat: there are 55 of them for max_sum 9)."""
    n_test: int = 10
    """Held-out sums, disjoint from the training ones."""
    seed: int = 0
    """Seed of the data."""


def vocabulary() -> list[str]:
    """Every token, in id order: specials first (pad, EOS, unk), then the characters."""
    return [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, *CHARACTERS]


def copy_score(reply_ids: Sequence[int], target: str) -> float:
    """Fraction of ``target``'s characters that the reply's ids have in place, halved unless the reply stopped with
    EOS right after them (judged on ids: a text cannot tell EOS from padding or an unknown id)."""
    vocab = vocabulary()
    tokens = [vocab[i] if 0 <= i < len(vocab) else UNK_TOKEN for i in reply_ids]
    right = sum(a == b for a, b in zip(tokens, target)) / len(target)
    stopped = len(tokens) == len(target) + 1 and tokens[-1] == EOS_TOKEN
    return right if stopped else 0.5 * right


def run_calculator(call: str) -> str:
    """The tool's message for a call: the calculator's value, or ``TOOL_ERROR``."""
    try:
        return calculator(call) if call else TOOL_ERROR
    except ValueError:
        return TOOL_ERROR


async def calculator_agent(
    sample: dict[str, Any], client: openai.AsyncOpenAI, **_: Any
) -> tuple[list[float], dict[str, float]]:
    """One episode (see the module docstring); per-turn rewards (the call's half point, then the answer's) and
    the episode's metrics: the tool answered (``tool_ok``), the call was the question, the answer the sum."""
    question = str(sample["prompt"])
    messages: list[Any] = [{"role": "user", "content": question}]
    call = await client.chat.completions.create(model="policy", messages=messages, max_tokens=CALL_TOKENS)
    call_text = call.choices[0].message.content or ""
    tool = run_calculator(call_text)
    messages += [{"role": "assistant", "content": call_text}, {"role": "tool", "content": tool}]
    answer = await client.chat.completions.create(model="policy", messages=messages, max_tokens=ANSWER_TOKENS)
    call_ids: list[int] = call.choices[0].model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]
    answer_ids: list[int] = answer.choices[0].model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]
    call_score, answer_score = copy_score(call_ids, question), copy_score(answer_ids, str(sample["answer"]))
    metrics = {"tool_ok": float(tool != TOOL_ERROR), "call_right": float(call_score == 1.0)}
    metrics["answer_right"] = float(answer_score == 1.0)
    return [0.5 * call_score, 0.5 * answer_score], metrics


def make_rows(task: CalculatorTask = CalculatorTask()) -> dict[str, list[dict[str, str]]]:
    """``train`` and ``test`` rows ``{"prompt", "answer"}``; no test sum is a training sum."""
    rng = random.Random(f"archon-demo-calculator:{task.seed}")
    sums = [(a, b) for a in range(10) for b in range(10) if a + b <= task.max_sum]
    rng.shuffle(sums)
    test, rest = sums[: task.n_test], sums[task.n_test :]
    train = [rest[i % len(rest)] for i in range(task.n_train)]
    return {
        name: [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in rows]
        for name, rows in (("train", train), ("test", test))
    }


def build_tokenizer(max_length: int = TinyQwen3.max_position_embeddings):
    """A character-level tokenizer (``char_tokenizer``) with the demo's chat template; no BOS."""
    tokenizer = char_tokenizer(vocabulary(), max_length)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


_DEFAULT_SPEC = TinyQwen3()
"""``make_assets``'s default model (frozen, so one shared instance is safe)."""


def make_assets(
    out_dir: str | Path, task: CalculatorTask = CalculatorTask(), spec: TinyQwen3 = _DEFAULT_SPEC
) -> DigitsAssets:
    """Write model, tokenizer (and chat template) and data into ``out_dir`` (overwriting earlier files there);
    returns where each went (``root``, ``model``, ``train``, ``test``)."""
    return write_assets(out_dir, build_tokenizer(spec.max_position_embeddings), spec, make_rows(task))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m archon.demos.calculator_agent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-assets", help="write the demo's tokenizer, tiny model and data into OUT_DIR")
    make.add_argument("out_dir", metavar="OUT_DIR")
    make.add_argument("--seed", type=int, default=0, help="seed of the data and of the model initialisation")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        assets = make_assets(args.out_dir, CalculatorTask(seed=args.seed), TinyQwen3(seed=args.seed))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    example = make_rows(CalculatorTask(seed=args.seed))["test"][0]
    print(
        f"calculator agent demo assets in {assets.root}: model {assets.model}, data {assets.train.parent}\n"
        f"task: call the calculator with the question, then copy its answer "
        f"(e.g. {example['prompt']!r} -> call {example['prompt']!r}, tool {example['answer']!r}, "
        f"answer {example['answer']!r})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
