"""Showing a config: TOML text, the allocation table, documented keys, and the CLI.

``python -m archon.config --config x.toml [overrides]`` prints the resolved config and the
allocation table; ``--describe SECTION`` prints the documented keys of a section.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any

from archon.config.device_defaults import describe_device_choice
from archon.config.loading import did_you_mean, load_config
from archon.config.schema import Config, ConfigError
from archon.field_docs import field_docs


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain dicts/lists (TOML-ready)."""
    out = dataclasses.asdict(cfg)

    def fix(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, tuple):
            return [fix(x) for x in v]
        return v

    return fix(out)


def to_toml(cfg: Any) -> str:
    import tomli_w

    return tomli_w.dumps(to_dict(cfg))


def allocation_table(cfg: Config):
    """A rich Table with one row per engine: backend, dims, world size."""
    from rich.table import Table

    table = Table(title="Allocation")
    for col in ("engine", "backend", "allocation", "dp", "tp", "pp", "cp", "ep", "etp", "world size"):
        table.add_column(
            col, justify="right" if col not in ("engine", "backend", "allocation") else "left", no_wrap=True
        )
    for engine, alloc in cfg.allocations().items():
        p = alloc.parallel
        table.add_row(
            engine,
            alloc.backend,
            str(alloc),
            str(p.dp_size),
            str(p.tp_size),
            str(p.pp_size),
            str(p.cp_size),
            str(p.ep_size),
            str(p.etp_size),
            str(alloc.world_size),
        )
    return table


def describe_section(section: str) -> str:
    """Documented keys of a section such as 'actor.archon' (default values and one-line docs)."""
    cls: Any = Config
    obj: Any = Config()
    for part in [p for p in section.split(".") if p]:
        names = {f.name for f in dataclasses.fields(cls)}
        if part not in names:
            raise ConfigError(f"unknown config section '{section}'{did_you_mean(part, names)}")
        cls = typing.get_type_hints(cls)[part]
        obj = getattr(obj, part)
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"'{section}' is a key, not a section")
    docs = field_docs(typing.cast(type, cls))
    lines = []
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        shown = "{...}" if dataclasses.is_dataclass(value) else repr(value)
        lines.append(f"{(section + '.' if section else '') + f.name} = {shown}\n    {docs.get(f.name, '')}")
    return "\n".join(lines)


def main(
    argv: typing.Sequence[str] | None = None, check: typing.Callable[[Config, str], list[str]] | None = None
) -> int:
    """The CLI; ``check(cfg, job)`` (``__main__`` passes the preflight) runs after loading and its lines are
    printed (it is passed in because the preflight imports the data layer, which imports this package)."""
    from rich.console import Console
    from rich.syntax import Syntax

    parser = argparse.ArgumentParser(
        prog="python -m archon.config", description="Print the resolved Archon config and its allocation table."
    )
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--describe", metavar="SECTION", help="list the documented keys of a section ('' = top level)")
    parser.add_argument(
        "--job",
        choices=("rl", "sft"),
        default="rl",
        help="the run's kind for the cluster check: sft starts no rollout server",
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    # Off a terminal rich assumes 80 columns and would truncate long (hybrid MoE) allocation strings.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        if args.describe is not None:
            console.print(describe_section(args.describe), highlight=False)
            return 0
        cfg = load_config(args.config, args.overrides, job=args.job)
        checked = check(cfg, args.job) if check is not None else [describe_device_choice(cfg)]
    except ConfigError as exc:
        Console(stderr=True).print(f"[bold red]config error:[/] {exc}", highlight=False)
        return 2
    console.print(Syntax(to_toml(cfg), "toml", theme="ansi_dark", background_color="default"))
    console.print(allocation_table(cfg))
    console.print("Checked:\n" + "\n".join(f"  {line}" for line in checked), highlight=False)
    return 0
