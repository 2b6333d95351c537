"""Datasets a user has: every file format and folder gives the same rows and samples; field names from the config."""

from __future__ import annotations

import json

import datasets
import pytest
from hf_fixtures import make_tiny_tokenizer

from archon.data import RLPromptDataset, SFTDataset
from archon.data.sources import load_rows
from archon.errors import DataError

ROWS = [
    {"question": "what is 2 + 2 ?", "answer": "2 + 2 = 4\n#### 4", "meta": {"level": 1, "tags": ["add"]}},
    {"question": "what is 10 + 8 ?", "answer": "#### 18", "meta": {"level": 2, "tags": []}},
    {"question": "what is 3 + 3 ?", "answer": "#### 6", "meta": {"level": 1, "tags": ["add", "small"]}},
]

HUB_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: other
  data_files:
  - split: train
    path: other/train-*
---
"""


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def write_every_format(root, rows):
    """``rows`` as jsonl, a json array, parquet, save_to_disk folders (one Dataset, a DatasetDict) and a folder laid
    out as a hub dataset repository (README configs, ``main/train-*.parquet``); the paths and the split to read."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "d.json").write_text(json.dumps(rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(root / "d.parquet"))
    ds.save_to_disk(str(root / "saved"))
    other = datasets.Dataset.from_list(rows[:1])
    datasets.DatasetDict({"train": other, "test": ds}).save_to_disk(str(root / "saved_dict"))
    hub = root / "hub"
    for folder, split, data in (("main", "train", other), ("main", "test", ds), ("other", "train", other)):
        (hub / folder).mkdir(parents=True, exist_ok=True)
        data.to_parquet(str(hub / folder / f"{split}-00000-of-00001.parquet"))
    (hub / "README.md").write_text(HUB_README)
    return {
        "jsonl": (root / "d.jsonl", {}),
        "json": (root / "d.json", {}),
        "parquet": (root / "d.parquet", {}),
        "save_to_disk": (root / "saved", {}),
        "save_to_disk_dict": (root / "saved_dict", {"split": "test"}),
        "hub_folder": (hub, {"split": "test", "subset": "main"}),
    }


def test_every_format_gives_the_same_rows_and_samples(tmp_path, tok):
    paths = write_every_format(tmp_path / "data", ROWS)
    reference = RLPromptDataset(ROWS, tok)
    for name, (path, options) in paths.items():
        assert load_rows(path, **options) == ROWS, name
        ds = RLPromptDataset(path, tok, **options)
        assert ds.samples == reference.samples, name
    assert reference[0].answer == "4" and reference[0].extra == {"meta": {"level": 1, "tags": ["add"]}}
    # The other split and subset of the folders are read when asked for.
    assert load_rows(paths["save_to_disk_dict"][0]) == ROWS[:1]
    assert load_rows(paths["hub_folder"][0], subset="other") == ROWS[:1]


def test_sft_reads_every_format(tmp_path, tok):
    rows = [{"prompt": "what is 2 + 2 ?", "completion": "4"}, {"prompt": "1 + 1", "completion": "the answer is 2"}]
    reference = SFTDataset(rows, tok)
    for name, (path, options) in write_every_format(tmp_path / "data", rows).items():
        assert SFTDataset(path, tok, **options).samples == reference.samples, name


def test_columnar_files_fill_absent_fields_with_none(tmp_path):
    rows = [{"prompt": "a", "answer": "1", "level": 3}, {"prompt": "b", "answer": "2"}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    assert load_rows(tmp_path / "d.json") == [rows[0], {**rows[1], "level": None}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_rows(tmp_path / "d.jsonl") == rows  # jsonl rows stay exactly as written


def test_paths_splits_and_subsets_that_are_not_there(tmp_path):
    paths = write_every_format(tmp_path / "data", ROWS)
    with pytest.raises(DataError, match=r"'.*nope.parquet' does not exist; set train_dataset.path to a .jsonl"):
        load_rows(tmp_path / "nope.parquet")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"'.*d.csv' is not .jsonl, .json, .parquet"):
        load_rows(tmp_path / "d.csv")
    with pytest.raises(DataError, match=r"has no split 'valid' \(it has: train, test\); set train_dataset.split"):
        load_rows(paths["save_to_disk_dict"][0], split="valid")
    with pytest.raises(DataError, match=r"Config name is missing.*train_dataset.subset"):
        load_rows(paths["hub_folder"][0])
    with pytest.raises(DataError, match=r"split 'valid', subset 'main'\): Unknown split \"valid\""):
        load_rows(paths["hub_folder"][0], split="valid", subset="main")
    (tmp_path / "broken.json").write_text('[{"a": 1}, {"a": ')
    with pytest.raises(DataError, match=r"cannot read dataset '.*broken.json'"):
        load_rows(tmp_path / "broken.json")


# ---------------------------------------------------------------------------------------
# field names
# ---------------------------------------------------------------------------------------


def test_prompt_and_answer_keys_read_named_and_nested_fields(tok):
    rows = [{"problem": "what is 2 + 2 ?", "sol": {"final": 4, "steps": "2 + 2"}, "answer": "x", "id": 7}]
    with pytest.raises(DataError, match="has a 'answer' field besides the fields it was read from"):
        RLPromptDataset(rows, tok, prompt_key="problem", answer_key="sol.final")
    rows[0].pop("answer")
    ds = RLPromptDataset(rows, tok, prompt_key="problem", answer_key="sol.final")
    s = ds[0]
    assert (s.prompt, s.answer, s.solution) == ("what is 2 + 2 ?", "4", "4")
    # The nested object the answer was read from stays for reward functions; the prompt's field does not.
    assert s.extra == {"sol": {"final": 4, "steps": "2 + 2"}, "id": 7}
    assert s.input_ids == RLPromptDataset([{"prompt": "what is 2 + 2 ?", "answer": "4"}], tok)[0].input_ids
    # A column whose own name has a dot is found before a nested field.
    dotted = RLPromptDataset([{"q": "2", "a.b": "5", "a": {"b": "6"}}], tok, prompt_key="q", answer_key="a.b")
    assert dotted[0].answer == "5"


def test_sft_completion_key(tok):
    rows = [{"question": "what is 2 + 2 ?", "answer": "4"}]
    ds = SFTDataset(rows, tok, completion_key="answer")
    assert ds.samples == SFTDataset([{"prompt": "what is 2 + 2 ?", "completion": "4"}], tok).samples


def test_a_missing_field_is_one_sentence_naming_the_fields_the_row_has(tok):
    rows = [{"question": "2 + 2", "answer": "4"}, {"problem": "3", "reward_model": {"ground_truth": "3", "style": "r"}}]
    with pytest.raises(DataError) as err:
        RLPromptDataset(rows, tok)
    assert str(err.value) == (
        "the given rows row 2 has neither 'prompt' nor 'question' (its fields: problem, reward_model.ground_truth, "
        'reward_model.style); RL rows look like {"prompt": ..., "answer": ...}, GSM8K\'s {"question": ..., "answer": '
        '...} or chat rows {"messages": [...], "answer": ...}; name the field that holds it with '
        "train_dataset.prompt_key (a dotted name reaches into nested objects)"
    )
    with pytest.raises(
        DataError, match=r"row 1 has no 'solution' \(its fields: answer, question\); every RL.*answer_key"
    ):
        RLPromptDataset(rows[:1], tok, answer_key="solution")
    with pytest.raises(DataError, match=r"row 1 has no 'answer' \(nor verl's 'reward_model.ground_truth'\)"):
        RLPromptDataset([{"prompt": "2", "reward_model": {"style": "rule"}}], tok)
    with pytest.raises(
        DataError, match=r"row 1 has no 'completion' \(its fields: answer, question\); SFT rows.*completion_key"
    ):
        SFTDataset(rows[:1], tok)
