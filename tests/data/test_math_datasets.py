"""GSM8K and DAPO-Math-17k rows, in the layouts their hub repositories have, scored by the math reward as they come.

The rows are made up here (nothing is downloaded); their columns are the datasets' own: GSM8K's hub folder holds
``main/train-*.parquet`` (and ``socratic/``) with ``question`` and a worked ``answer`` ending in ``#### <number>``;
DAPO-Math-17k (verl's RL layout) has ``data_source``, ``prompt`` (a list of chat messages), ``ability``,
``reward_model`` {``ground_truth``, ``style``} and ``extra_info`` {``index``}.
"""

from __future__ import annotations

import datasets
import pytest
from hf_fixtures import make_tiny_tokenizer

from archon.config.dataset import DatasetConfig
from archon.data.from_config import build_rl_dataset
from archon.rl.rewards import RewardComputer
from archon.rl.rollout_batch import Completion
from archon.rl.scoring import CompletionScorer

GSM8K = [
    {
        "question": "Tom has 3 boxes of 4 pens and buys 5 more pens. How many pens does he have?",
        "answer": "The boxes hold 3 * 4 = <<3*4=12>>12 pens.\nWith 5 more he has 12 + 5 = <<12+5=17>>17 pens.\n#### 17",
    },
    {
        "question": "A farm sells 1,200 eggs a week at $2 a dozen. How many dollars a week is that?",
        "answer": "1,200 / 12 = <<1200/12=100>>100 dozen.\n100 * 2 = <<100*2=200>>200 dollars.\n#### 200",
    },
]

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put your "
    'answer on its own line after "Answer:".'
)
DAPO = [
    {
        "data_source": "math_dapo",
        "prompt": [
            {"content": DAPO_INSTRUCTION.format("Find the sum of the roots of x^2 - 9x + 14 = 0."), "role": "user"}
        ],
        "ability": "MATH",
        "reward_model": {"ground_truth": "9", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "3f2a-0001"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_INSTRUCTION.format("How many primes are less than 20?"), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "8", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "3f2a-0002"},
    },
]

GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
"""


@pytest.fixture(scope="module")
def tok():
    words = ["the", "answer", "is", "so", "he", "has", "pens", "Answer", ":", "dollars", "$", "#"]
    t = make_tiny_tokenizer(vocab=words + [str(i) for i in range(300)])
    return t


@pytest.fixture(scope="module")
def scorer(tok):
    # max_failure_frac 0: a reward call that raises (e.g. a row field colliding with an argument) fails the test.
    rewards = RewardComputer("math", n_workers=0, max_failure_frac=0.0)
    yield CompletionScorer(rewards, tok)
    rewards.close()


def completion(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Completion(prompt_ids=[], output_ids=ids, output_logprobs=[0.0] * len(ids), finish_reason="stop")


def test_gsm8k_hub_folder_scores_right_and_wrong_answers(tmp_path, tok, scorer):
    folder = tmp_path / "gsm8k"
    for subset in ("main", "socratic"):
        (folder / subset).mkdir(parents=True)
        datasets.Dataset.from_list(GSM8K).to_parquet(str(folder / subset / "train-00000-of-00001.parquet"))
    (folder / "README.md").write_text(GSM8K_README)
    ds = build_rl_dataset(DatasetConfig(path=str(folder), subset="main", max_length=4096), tok)
    assert [s.answer for s in ds.samples] == ["17", "200"]
    assert ds[1].prompt == GSM8K[1]["question"] and ds[1].solution == GSM8K[1]["answer"]
    prompts = [ds[0], ds[0], ds[1], ds[1]]
    texts = ["so he has 17 pens", "so he has 16 pens", "the answer is $ 200", "#### 2000"]
    assert scorer(prompts, [completion(tok, t) for t in texts]) == [1.0, 0.0, 1.0, 0.0]


def test_dapo_math_parquet_scores_right_and_wrong_answers(tmp_path, tok, scorer):
    path = tmp_path / "dapo-math-17k.parquet"
    datasets.Dataset.from_list(DAPO).to_parquet(str(path))
    ds = build_rl_dataset(DatasetConfig(path=str(path), max_length=4096), tok)
    assert [s.answer for s in ds.samples] == ["9", "8"]
    # The prompt is the chat its row holds, rendered by the tokenizer's template with the generation prompt.
    expected = tok.apply_chat_template(DAPO[0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ds[0].input_ids == list(expected)
    assert ds[0].extra["reward_model"] == DAPO[0]["reward_model"] and ds[0].extra["messages"] == DAPO[0]["prompt"]
    prompts = [ds[0], ds[0], ds[1], ds[1]]
    texts = ["so the answer is\nAnswer: 9", "Answer: 14", "Answer: 8", "Answer: 9"]
    assert scorer(prompts, [completion(tok, t) for t in texts]) == [1.0, 0.0, 1.0, 0.0]
