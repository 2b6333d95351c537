"""Security of the library source, of checkpoints on resume, and of the weight-update group's listener.

The source rule, checked on the syntax tree (so comments and strings never trigger it), for
every module of ``archon/``, ``models/``, ``parallel/``, ``pipeline/`` and ``scripts/``:

- nothing unpickles data: no ``pickle.load``/``loads``/``Unpickler`` (or ``dill``, ``shelve``,
  ``marshal``), except an ``Unpickler`` subclass that overrides ``find_class`` (an allowlist);
  no ``torch.load`` without a literal ``weights_only=True``; no ``allow_pickle=True``;
- no ``eval``/``exec``, no ``shell=True``, no ``os.system``/``os.popen``.

torch.distributed's object collectives (``broadcast_object_list``, ``all_gather_object``, ...)
pickle what they send.  Among a job's own training ranks that is not untrusted data: they run
the same code and rendezvous through the job's own store.  So they are allowed there, and
forbidden in the modules that face rollout servers' weight-update groups or HTTP clients
(``SERVER_FACING``), where a peer is another program.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import re
from pathlib import Path

import pytest
from dist_utils import find_free_port, run_distributed
from hf_fixtures import save_tiny_hf
from paths import REPO

LIBRARY = ("archon", "models", "parallel", "pipeline", "scripts")
UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "shelve", "marshal", "cloudpickle"}
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "recv_object_list",
    "send_object_list",
}
SERVER_FACING = {
    "archon/wire/weight_group.py",
    "archon/server/weight_update.py",
    "archon/server/app.py",
    "archon/server/generator.py",
    "archon/server/protocol.py",
}


def _dotted(node: ast.AST) -> str:
    """'a.b.c' for a Name/Attribute chain, '' otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _restricted_unpicklers(tree: ast.AST, aliases: set[str]) -> set[ast.ClassDef]:
    """Classes deriving from pickle.Unpickler that override find_class (an allowlist)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            _dotted(b) in {f"{a}.Unpickler" for a in aliases} for b in node.bases
        ):
            if any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body):
                found.add(node)
    return found


def unsafe_calls(source: str, path: str = "<snippet>") -> list[str]:
    """Every violation of the module docstring's rule in ``source``, as 'path:line: what'."""
    tree = ast.parse(source)
    problems: list[str] = []
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in UNPICKLING_MODULES:
                    aliases.add(a.asname or a.name)
                    if a.name.split(".")[0] != "pickle":
                        problems.append(f"{path}:{node.lineno}: imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNPICKLING_MODULES:
            for a in node.names:
                if a.name not in ("UnpicklingError", "PicklingError"):
                    problems.append(f"{path}:{node.lineno}: from {node.module} import {a.name}")
    allowed_bases = {id(b) for c in _restricted_unpicklers(tree, aliases) for b in c.bases}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _dotted(node.value) in aliases and id(node) not in allowed_bases:
            if node.attr not in ("UnpicklingError", "PicklingError"):
                problems.append(f"{path}:{node.lineno}: uses {_dotted(node)}")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        if name in ("eval", "exec"):
            problems.append(f"{path}:{node.lineno}: calls {name}()")
        if name in ("os.system", "os.popen"):
            problems.append(f"{path}:{node.lineno}: calls {name}() (a shell)")
        shell = keywords.get("shell")
        if shell is not None and not (isinstance(shell, ast.Constant) and shell.value is False):
            problems.append(f"{path}:{node.lineno}: passes shell={ast.unparse(shell)}")
        pickle_ok = keywords.get("allow_pickle")
        if pickle_ok is not None and not (isinstance(pickle_ok, ast.Constant) and pickle_ok.value is False):
            problems.append(f"{path}:{node.lineno}: passes allow_pickle={ast.unparse(pickle_ok)}")
        if name == "torch.load" or name.endswith(".torch.load"):
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                problems.append(f"{path}:{node.lineno}: torch.load without weights_only=True")
        if path in SERVER_FACING and name.split(".")[-1] in OBJECT_COLLECTIVES:
            problems.append(f"{path}:{node.lineno}: {name.split('.')[-1]} unpickles what a server-side peer sends")
    return problems


def test_the_rule_catches_each_unsafe_call_and_ignores_comments_and_strings():
    bad = {
        "import pickle\npickle.loads(b'')": "uses pickle.loads",
        "import pickle as p\nobj = p.load(f)": "uses p.load",
        "from pickle import loads": "from pickle import loads",
        "import dill": "imports dill",
        "import torch\ntorch.load('x')": "torch.load without weights_only=True",
        "import torch\ntorch.load('x', weights_only=False)": "torch.load without weights_only=True",
        "eval(user_text)": "calls eval()",
        "exec(code)": "calls exec()",
        "import subprocess\nsubprocess.run(cmd, shell=True)": "passes shell=True",
        "import os\nos.system('ls')": "calls os.system()",
        "import numpy as np\nnp.load(f, allow_pickle=True)": "passes allow_pickle=True",
        "import pickle\nclass U(pickle.Unpickler):\n    pass": "uses pickle.Unpickler",  # no allowlist
    }
    for source, what in bad.items():
        found = unsafe_calls(source)
        assert any(what in p for p in found), (source, found)
    assert any("unpickles" in p for p in unsafe_calls("dist.broadcast_object_list(x)", "archon/server/app.py"))
    fine = """
import pickle
import torch
# pickle.loads(x) and eval(x) in a comment; torch.load("x") in a string:
doc = "pickle.loads(data); eval(s); subprocess.run(c, shell=True)"
state = torch.load(path, weights_only=True)
model.eval()
subprocess.run(cmd, shell=False)
dist.broadcast_object_list(box, src=0)
class Safe(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(name)
"""
    assert unsafe_calls(fine, "archon/rl/trainer.py") == []


def test_library_source_never_unpickles_evaluates_or_spawns_a_shell():
    problems = []
    files = 0
    for top in LIBRARY:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            problems += unsafe_calls(path.read_text(), rel)
            files += 1
    assert files > 50  # the walk really covered the library
    assert problems == []


# ---- planted files in a checkpoint cannot run code -------------------------------------------------


class _Payload:
    """Unpickling this creates ``marker``: what a planted file would do instead."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _plant_and_load(model: str, folder: str, where: str) -> str:
    import torch.distributed.checkpoint as dcp
    from engine_utils import engine_config

    from archon.checkpoint.dcp import CheckpointError, dcp_state_dict
    from archon.engine.engine import ArchonEngine

    engine = ArchonEngine(engine_config(model, "archon:d1"), total_steps=2).initialize()
    path = Path(folder)
    engine.save(path, {"at": 0})
    marker = str(path / "code_ran")
    if where == "metadata":  # the DCP index DCP itself would pickle.load
        (path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    else:  # a model tensor replaced by an object DCP would torch.load(weights_only=False)
        state = dcp_state_dict(engine.checkpoint_states())
        state["model"][next(iter(state["model"]))] = _Payload(marker)
        dcp.save(state, checkpoint_id=str(path / "dcp"))  # pyright: ignore[reportPrivateImportUsage]
    try:
        engine.load(path)
        outcome = "loaded"
    except CheckpointError as exc:
        outcome = str(exc)
    return outcome + (" | CODE RAN" if os.path.exists(marker) else "")


@pytest.mark.parametrize("where", ["metadata", "item"])
def test_a_planted_checkpoint_file_cannot_run_code_on_resume(tmp_path, where):
    save_tiny_hf(tmp_path / "model", "qwen3", seed=6)
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Payload(str(control))))  # the payload is live: plain unpickling runs it
    assert control.is_dir()
    outcome = run_distributed(_plant_and_load, 1, str(tmp_path / "model"), str(tmp_path / "ckpt"), where, timeout=300)[
        0
    ]
    assert "CODE RAN" not in outcome and outcome != "loaded", outcome
    expected = "never contains" if where == "metadata" else "stores .* as a pickled object"
    assert re.search(expected, outcome), outcome


def test_engine_state_is_data_not_pickles(tmp_path):
    save_tiny_hf(tmp_path / "model", "qwen3", seed=6)
    run_distributed(_save_only, 1, str(tmp_path / "model"), str(tmp_path / "ckpt"), timeout=300)
    files = sorted(str(p.relative_to(tmp_path / "ckpt")) for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    assert files == ["dcp/.metadata", "dcp/__0_0.distcp", "engine_state.json", "rng_state.safetensors"]
    state = json.loads((tmp_path / "ckpt" / "engine_state.json").read_text())
    assert state["extra"] == {"at": 0} and state["step"] == 0 and state["allocation"] == "archon:d1"
    assert len(state["optimizer_param_groups"][0]["betas"]) == 2 and len(state["python_rng"][1]) == 625
    assert set(state) == {"step", "allocation", "lr_scheduler", "optimizer_param_groups", "python_rng", "extra"}


def _save_only(model: str, folder: str) -> None:
    from engine_utils import engine_config

    from archon.engine.engine import ArchonEngine

    ArchonEngine(engine_config(model, "archon:d1"), total_steps=2).initialize().save(folder, {"at": 0})


# ---- the weight-update group listens on the address it needs only ---------------------------------


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(addr)
    return found


def test_weight_update_group_store_listens_on_the_given_address_only():
    from archon.wire.weight_group import destroy_weight_update_group, init_weight_update_group

    port = find_free_port()
    pg = init_weight_update_group("127.0.0.1", port, 0, 1, "security_probe", "gloo", timeout_s=60)
    try:
        # 127.0.0.1 in /proc's little-endian hex; never 0.0.0.0 (00000000) or :: (all zeros).
        assert _listeners(port) == ["0100007F"], _listeners(port)
    finally:
        destroy_weight_update_group(pg)
