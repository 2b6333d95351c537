"""HF folders whose word embeddings are tied, made untied for servers that reload weights in place.

vLLM reloads a model layer by layer (``vllm/model_executor/model_loader/reload``, seen in the CPU
build 0.32): a tied LM head gets no tensor of its own from a tied checkpoint, so vLLM puts the LM
head's old tensors back ("ParallelLMHead: Failed to load weights") and, after every reload, samples
from the new body through the old LM head.  A model served untied has an LM head that loads a
tensor of its own, so Archon starts vLLM from an untied view of a tied model and unties every
folder it syncs to vLLM:

- ``lm_head.weight`` = the input embedding, in a file of its own (``lm_head.safetensors``);
- ``config.json`` says ``tie_word_embeddings: false`` (at the top and in a ``text_config``): vLLM
  re-ties a model whose config says tied when the two tensors are equal, as they are here;
- ``model.safetensors.index.json`` lists every tensor (written when the folder had none), so
  loaders that follow the index find the new file; a single ``model.safetensors`` is renamed
  ``model-00001-of-00001.safetensors``, since transformers reads that file alone when it exists.

The view of a start folder links every other file to the original: it costs one vocab x hidden
tensor of disk.  The served function is the same; only the LM head's memory is doubled.  For a
vLLM server you start yourself (``rollout.server_addrs``):
``python -m archon.rollout.tied_embeddings MODEL_DIR VIEW_DIR``, then serve ``VIEW_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

LM_HEAD = "lm_head.weight"
LM_HEAD_FILE = "lm_head.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARD_OF_ONE = "model-00001-of-00001.safetensors"
_EMBEDDING_SUFFIX = "embed_tokens.weight"
# Written into a view: the folder it was made from, so that a later launch reuses it only for the same model.
_SOURCE_MARKER = ".archon_untied_from"


def ties_word_embeddings(folder: str | Path) -> bool:
    """Whether the HF model in ``folder`` ties its LM head to its input embeddings (as transformers resolves it:
    a config may leave the key out and mean its model type's default).  False for a folder without config.json."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError, OSError):  # a model type this transformers does not know: the file says it
        raw = json.loads(path.read_text())
        return bool(raw.get("tie_word_embeddings") or (raw.get("text_config") or {}).get("tie_word_embeddings"))
    text = config.get_text_config()
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def _weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> file, from the index or from the safetensors files themselves (a single file as a shard)."""
    index = folder / INDEX_FILE
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    out: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            out.update(dict.fromkeys(fh.keys(), SHARD_OF_ONE if file.name == SINGLE_FILE else file.name))
    return out


def _file_of(folder: Path, name: str) -> Path:
    """Where ``name`` of a weight map lives in ``folder`` before any renaming."""
    return folder / SINGLE_FILE if name == SHARD_OF_ONE and not (folder / name).exists() else folder / name


def _embedding_name(weights: dict[str, str], folder: Path) -> str:
    names = [n for n in weights if n.endswith(_EMBEDDING_SUFFIX)]
    if len(names) != 1:
        raise ValueError(
            f"cannot untie the word embeddings of {folder}: expected one tensor named '*{_EMBEDDING_SUFFIX}', found "
            f"{names or 'none'}; serve this model from a folder with tie_word_embeddings = false and an lm_head.weight"
        )
    return names[0]


def _untie_config(src: Path, dst: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = False
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def _write_lm_head(src: Path, dst: Path) -> dict[str, str]:
    """``dst/lm_head.safetensors`` from ``src``'s embedding; the weight map including it."""
    weights = _weight_map(src)
    if LM_HEAD not in weights:
        name = _embedding_name(weights, src)
        with safe_open(str(_file_of(src, weights[name])), "pt") as fh:
            embedding = fh.get_tensor(name)
        save_file({LM_HEAD: embedding.contiguous()}, str(dst / LM_HEAD_FILE), metadata={"format": "pt"})
        weights[LM_HEAD] = LM_HEAD_FILE
    return weights


def _write_index(folder: Path, weights: dict[str, str]) -> None:
    total = sum((folder / f).stat().st_size for f in set(weights.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weights.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))


def untie_in_place(folder: str | Path) -> None:
    """Untie a folder Archon wrote (a weight-sync export): add the LM head, rewrite config and index."""
    folder = Path(folder)
    weights = _write_lm_head(folder, folder)
    if (folder / SINGLE_FILE).exists():
        os.rename(folder / SINGLE_FILE, folder / SHARD_OF_ONE)
    _write_index(folder, weights)
    _untie_config(folder, folder)


def untied_view(src: str | Path, dst: str | Path) -> Path:
    """``dst``: ``src`` untied, every other file a link to ``src``'s (reused when it was made from ``src``).

    Several launchers may make the same view at once (one per node): each builds its own copy next to
    ``dst`` and renames it into place; the first one wins and the others use it.
    """
    src, dst = Path(src).resolve(), Path(dst)
    marker = dst / _SOURCE_MARKER
    if marker.exists() and marker.read_text() == str(src):
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        for file in src.iterdir():
            if file.name not in ("config.json", INDEX_FILE, LM_HEAD_FILE):
                os.symlink(file, tmp / (SHARD_OF_ONE if file.name == SINGLE_FILE else file.name))
        _write_index(tmp, _write_lm_head(src, tmp))
        _untie_config(src, tmp)
        (tmp / _SOURCE_MARKER).write_text(str(src))
        if dst.exists():
            shutil.rmtree(dst)  # a view of another model (an earlier run in this directory)
        try:
            os.rename(tmp, dst)
        except OSError:
            if not (marker.exists() and marker.read_text() == str(src)):
                raise  # not another launcher's view of the same model
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="An untied view of an HF model folder, for vLLM servers that reload it"
    )
    parser.add_argument("model", help="HF model folder (tied word embeddings)")
    parser.add_argument("view", help="folder to write: links to the model's files, an untied config and the LM head")
    args = parser.parse_args(argv)
    if not ties_word_embeddings(args.model):
        print(f"{args.model} does not tie its word embeddings: serve it as it is")
        return 0
    print(f"serve {untied_view(args.model, args.view)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
