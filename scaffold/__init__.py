"""``scripts/add_model.py``'s logic: read an architecture from transformers, write an Archon model package.

    from scaffold import scaffold_model
    result = scaffold_model("llama")       # or an HF folder; writes models/llama/ and its parity test
    print(result.report)

The package has the layout of every model package (``models/qwen3/``) and is registered by
being there (``models.import_model_packages``); what differs from ``models/common`` is listed
in the report, at the top of the generated ``model.py``, and as failing parity-test cases.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from pathlib import Path

from models import get_model_spec, import_model_packages, supported_model_types
from scaffold.analysis import analyze
from scaffold.render import render_package, render_test, report_lines, write_files
from scaffold.source import ScaffoldError, resolve_source

REPO = Path(__file__).resolve().parents[2]

__all__ = ["ScaffoldError", "ScaffoldResult", "scaffold_model"]


@dataclass
class ScaffoldResult:
    """What ``scaffold_model`` wrote and found."""

    name: str
    model_type: str
    package: Path
    test: Path
    files: list[Path]
    differences: list[str]
    """Ids of the points that differ from models/common (empty: the package is exact)."""
    refused: list[str]
    """Config keys the package refuses when set."""
    report: str


def scaffold_model(
    source: str, name: str | None = None, models_dir: str | Path | None = None, tests_dir: str | Path | None = None
) -> ScaffoldResult:
    """Write ``<models_dir>/<name>/`` and ``<tests_dir>/test_<name>_parity.py`` for ``source`` and register it.

    ``source`` is a transformers model_type or an HF folder; ``name`` defaults to the model type.
    ``models_dir`` other than ``models/`` must be on ``$ARCHON_MODELS_PATH`` for other processes.
    """

    models_dir = Path(models_dir) if models_dir is not None else REPO / "models"
    tests_dir = Path(tests_dir) if tests_dir is not None else REPO / "tests" / "models"
    src = resolve_source(source)
    name = name or re.sub(r"\W", "_", src.model_type)
    if not name.isidentifier() or keyword.iskeyword(name) or not name.islower():
        raise ScaffoldError(
            f"--name {name!r} is not a lower-case Python identifier; pick one such as "
            f"'{re.sub(r'[^a-z0-9_]', '_', name.lower())}'"
        )
    package = models_dir / name
    test = tests_dir / f"test_{name}_parity.py"
    for path in (package, test):
        if path.exists():
            raise ScaffoldError(f"'{path}' exists already; pick another --name or delete it first")
    if src.model_type in supported_model_types():
        raise ScaffoldError(
            f"model_type '{src.model_type}' is served already by the registered spec "
            f"'{get_model_spec(src.model_type).name}'; there is nothing to add"
        )
    analysis = analyze(src)
    files = write_files(package, render_package(analysis, name))
    files += write_files(tests_dir, {test.name: render_test(analysis, name)})
    import_model_packages(models_dir)
    registered = get_model_spec(src.model_type).name == name
    lines = [f"Archon model package '{name}' for " + report_lines(analysis)[0]]
    lines += [f"  wrote {f}" for f in files]
    lines.append(
        f"  registered: `import models` serves model_type '{src.model_type}'"
        if registered
        else f"  NOT registered: add {models_dir} to $ARCHON_MODELS_PATH"
    )
    if models_dir.resolve() != (REPO / "models").resolve():
        lines.append(f"  (other processes find it with ARCHON_MODELS_PATH={models_dir})")
    lines += ["", *report_lines(analysis)[1:], "", f"Next: python -m pytest {test}"]
    return ScaffoldResult(
        name,
        src.model_type,
        package,
        test,
        files,
        [p.id for p in analysis.points],
        [s.key for s in analysis.refused],
        "\n".join(lines),
    )
