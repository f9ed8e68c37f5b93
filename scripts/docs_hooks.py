"""MkDocs hook: the reference pages, generated from the code at every build, and the results files.

`mkdocs build` (mkdocs.yml: `hooks: [scripts/docs_hooks.py]`) adds, without writing into docs/:

- reference/config.md: every field of every component's config dataclass (name, type, default,
  the documentation declared with the field), nested sections as they nest;
- reference/metrics.md: every standard metric of `arpo.learner.metrics` with its meaning;
- reference/wire.md: the wire format as `arpo.wire` states it, its message kinds and limits;
- reference/fleet.md: the fleets' records (`arpo_envs.fleet_records`): every record, every
  field with its type and documentation, the version;
- reference/cli.md: the commands (`arpo`, `arpo-actor`, `arpo-learner`, `arpo-envs`);
- results/files/*: every file of benchmarks/results (Markdown tables and plots, as measured),
  listed on results/index.md.

So the reference cannot drift from the code: a field, metric or record field added without
documentation shows up empty, and `tests/test_docs.py` fails on it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = [
    ("arpo train", "arpo.train:TrainConfig"),
    ("arpo-learner", "arpo.learner.learner:LearnerConfig"),
    ("arpo-actor", "arpo.actor.config:ActorConfig"),
    ("arpo eval", "arpo.pool.evaluate:EvalConfig"),
    ("arpo collect", "arpo.pool.collect:CollectConfig"),
    ("arpo select-tasks", "arpo.pool.select:SelectConfig"),
    ("arpo audit-tasks", "arpo.pool.audit:AuditConfig"),
    ("arpo sft", "arpo.offline.sft:SFTConfig"),
    ("arpo offline", "arpo.offline.offline:OfflineConfig"),
]
"""(command, config class): the configurations the reference page documents."""


def _load(ref: str) -> Any:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def config_fields(cls: type) -> list[tuple[str, str, Any, str]]:
    """(dotted name, type, default, doc) of every leaf field of a config dataclass."""
    from arpo.config import _type_name, to_dict

    out: list[tuple[str, str, Any, str]] = []

    def walk(c: type, prefix: str, values: dict[str, Any]) -> None:
        hints = typing.get_type_hints(c)
        for f in dataclasses.fields(c):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                walk(t, f"{prefix}{f.name}.", values[f.name])
            else:
                out.append((prefix + f.name, _type_name(t), values[f.name],
                            f.metadata.get("doc", "")))  # fmt: skip

    walk(cls, "", to_dict(cls()))
    return out


def config_page() -> str:
    lines = ["# Configuration reference", "",
             "Generated from the config dataclasses at every build of this site. Every field "
             "can be set in a TOML file (`--config run.toml`, tables for nested fields) or on "
             "the command line (`field=value`, dotted for nested fields, TOML values); "
             "`--show-config` prints the same list.", ""]  # fmt: skip
    for command, ref in CONFIGS:
        cls = _load(ref)
        lines += [f"## `{command}`: `{ref.replace(':', '.')}`", "",
                  _cell((cls.__doc__ or "").strip().splitlines()[0]) if cls.__doc__ else "", "",
                  "| field | type | default | meaning |", "|---|---|---|---|"]  # fmt: skip
        for name, tname, default, doc in config_fields(cls):
            lines.append(
                f"| `{name}` | `{_cell(tname)}` | `{_cell(repr(default))}` | {_cell(doc)} |"
            )
        lines.append("")
    return "\n".join(lines)


def metrics_page() -> str:
    from arpo.learner.metrics import STANDARD_METRICS

    lines = ["# Metrics reference", "",
             "Generated from `arpo.learner.metrics.STANDARD_METRICS`. The learner writes one "
             "JSON object per iteration to `<run_dir>/learner/metrics.jsonl` and the same "
             "scalars to TensorBoard (`<run_dir>/learner/tb/`); per-task metrics are "
             "`tasks/<task id>/...`.", "", "| metric | meaning |", "|---|---|"]  # fmt: skip
    for name, doc in STANDARD_METRICS.items():
        lines.append(f"| `{name}` | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


def wire_page() -> str:
    from arpo import wire

    kinds = sorted((v, k) for k, v in vars(wire).items() if k.startswith("KIND_"))
    limits = sorted((k, v) for k, v in vars(wire).items() if k.startswith("MAX_"))
    lines = ["# Wire format reference", "",
             "Generated from `arpo.wire`, the one encoder and decoder for everything that "
             "crosses a socket (wire version "
             f"{wire.WIRE_VERSION if hasattr(wire, 'WIRE_VERSION') else '?'}).", "",
             "```text", (wire.__doc__ or "").strip(), "```", "",
             "| kind | name |", "|---:|---|"]  # fmt: skip
    lines += [f"| {v} | `{k}` |" for v, k in kinds]
    lines += ["", "| limit | value |", "|---|---:|"]
    lines += [f"| `{k}` | {v} |" for k, v in limits]
    return "\n".join(lines) + "\n"


def record_fields(cls: type) -> list[tuple[str, str, str]]:
    """(name, type, doc) of every field of a fleet record, the doc being the string literal
    under the field's declaration."""
    from arpo_envs import fleet_records

    docs: dict[str, str] = {}
    (node,) = ast.parse(inspect.getsource(cls)).body
    assert isinstance(node, ast.ClassDef)
    for stmt, after in zip(node.body, [*node.body[1:], None], strict=True):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):  # fmt: skip
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return [(name, fleet_records.type_name(hint), docs.get(name, ""))
            for name, hint in fleet_records.hints(cls).items()]  # fmt: skip


def fleet_page() -> str:
    from arpo_envs import fleet_records as fr

    lines = ["# Fleet records reference", "",
             "Generated from `arpo_envs.fleet_records`, the typed records of both fleets' "
             "state files and of the VM fleet's control API, and their one encoder and "
             f"decoder (records version {fr.VERSION}).", "",
             "```text", (fr.__doc__ or "").strip(), "```", ""]  # fmt: skip

    def table(cls: type) -> None:
        name = getattr(cls, "RECORD", None)
        title = f"`{cls.__name__}`" + (f' (`"record": "{name}"`)' if name else "")
        lines.extend([f"### {title}", "", _cell(inspect.cleandoc(cls.__doc__ or "")), "",
                      "| field | type | meaning |", "|---|---|---|"])  # fmt: skip
        for field_name, tname, doc in record_fields(cls):  # a | in a code span splits no cell
            lines.append(f"| `{field_name}` | `{tname}` | {_cell(doc)} |")
        lines.append("")

    lines += ["## Messages", "",
              "A message's JSON object names it (`\"record\"`) and carries `version`.", ""]  # fmt: skip
    for cls in fr.MESSAGES:
        table(cls)
    lines += ["## Parts", "",
              "Objects inside a message, read as the type of the field that holds them.", ""]  # fmt: skip
    for cls in fr.PARTS:
        table(cls)
    return "\n".join(lines)


def _help(args: list[str]) -> str:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)  # fmt: skip
    return (p.stdout or p.stderr).strip()


def cli_page() -> str:
    from arpo.cli import COMMANDS, TOOLS

    lines = ["# Command reference", "",
             "Generated from the command-line parsers. Every `arpo` command takes "
             "`[--config FILE] [--show-config] [field=value ...]`; its fields are on the "
             "[configuration reference](config.md).", "",
             "| command | what it does | configuration |", "|---|---|---|"]  # fmt: skip
    for name, (help_text, ref, _) in COMMANDS.items():
        lines.append(f"| `arpo {name}` | {_cell(help_text)} | `{ref.replace(':', '.')}` |")
    for name, (help_text, _) in TOOLS.items():
        lines.append(f"| `arpo {name}` | {_cell(help_text)} | its own options, below |")
    lines += ["", "`arpo-learner` and `arpo-actor` take the same `[--config FILE] [field=value "
              "...]` with `LearnerConfig` and `ActorConfig`.", ""]  # fmt: skip
    helps = [("arpo " + name, ["-m", "arpo.cli", name, "--help"]) for name in TOOLS]
    helps += [("arpo-envs", ["-m", "arpo_envs.cli", "--help"]),
              ("arpo-envs vm up", ["-m", "arpo_envs.cli", "vm", "up", "--help"])]  # fmt: skip
    for command, args in helps:
        lines += [f"## `{command}`", "", "```text", _help(args), "```", ""]
    return "\n".join(lines)


def results_files() -> list[Path]:
    return sorted(p for p in (ROOT / "benchmarks" / "results").iterdir()
                  if p.suffix in (".md", ".png"))  # fmt: skip


def results_index() -> str:
    lines = ["# Results files", "",
             "Every benchmark and experiment result committed under `benchmarks/results/`, as "
             "measured (each file names the command that produced it, the machine and the "
             "commit).", ""]  # fmt: skip
    lines += [f"- [{p.stem}](files/{p.name})" for p in results_files() if p.suffix == ".md"]
    return "\n".join(lines) + "\n"


def on_files(files: Files, config: Any) -> Files:
    pages = {
        "reference/config.md": config_page(),
        "reference/metrics.md": metrics_page(),
        "reference/wire.md": wire_page(),
        "reference/fleet.md": fleet_page(),
        "reference/cli.md": cli_page(),
        "results/index.md": results_index(),
    }
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    for p in results_files():
        files.append(File.generated(config, f"results/files/{p.name}", abs_src_path=str(p)))
    return files
