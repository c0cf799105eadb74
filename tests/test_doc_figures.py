"""Every figure in README.md and docs/*.md is found in a stored result (docs/*.json) its section names.

The rule (docs/verified.md, "Figures"), applied to the text outside code blocks, `code spans`, HTML comments and
link targets:

- A *figure* is a number followed by a unit: `x` (`0.99x`; spaced, `1.021 x`, only after a decimal number, since
  `1024 x 1024` and `2 x tp` are products), `%`, `s`, `ms`, `min`, `us`, `GiB`, `MiB`, `GB`, `MB`; both ends of a
  range (`0.48-0.58x`, `42 to 502 s`); both numbers of a count `N of M` / `N clean of M` (also passed, failed,
  verified, skipped, aborted); and, in a table row, every number with a decimal point. Versions in names
  (`Qwen-Image-2.1`, `Wan 2.1`) are not figures.
- It is *found* when some number in a JSON file under docs/ that the figure's section (its heading to the next
  one) names, as a link or a file name (a table a command writes beside its JSON, docs/NAME.md beside
  docs/NAME.json, names that file), rounds to it at the printed decimals: the value itself, or for `%` 100 v,
  100 (v - 1) or 100 (1 - v), for `GiB` / `MiB` / `GB` / `MB` also v bytes, for `ms` 1000 v seconds, for `min`
  v / 60 seconds; a table's number may also be v bytes in GiB, MiB or KiB.
- A setting or a test's bar is not a measurement: an `s`, `GiB`, `MiB` or `%` figure equal (in the forms above) to
  a default of a CLI option or one of `SETTINGS` (read from the code here, so the docs cannot drift from it) is
  found too.
- Others' published figures: the lines from a `<!-- figures: cited -->` line to a `<!-- figures: end -->` line (or
  the next heading) are skipped, and must link their sources (`http...`). Estimates set beside published figures
  in such a region go with them.
- A table a command writes whole beside its JSON (`GENERATED`) is that command's output, as a code block is.
- Every docs/*.json names the command that wrote it, the date, the machine and the package version.

This proves each figure has a stored source a reader can re-make, not that it is the right number of that file: the
section names the file, the reader checks the row.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STORED = sorted((ROOT / "docs").glob("*.json"))
#: Written before the writers put a header in; what made them is said in the prose beside their figures.
LEGACY = {"step.json": "bench step, 2026-12-03 (docs/benchmarks.md)",
          "vae.json": "bench vae --json, 2026-12-03 (docs/benchmarks.md)"}
#: Tables a command writes whole from the JSON beside them, cells it derives included (coverage.md's "0.037 x less
#: weight" is the difference of two stored ratios): the command's output, like a code block, not prose.
GENERATED = {"coverage.md": "neuron-diffusers plan draft --all, from coverage.json"}
#: Constants the docs quote as settings or as a test's bar, besides the CLI options' defaults ("file:NAME", a literal
#: assignment read from the file, so a changed constant fails here).
SETTINGS = ("neuron_diffusers/serve/liveness.py:BEAT_S", "neuron_diffusers/serve/liveness.py:EXIT_GRACE_S",
            "tests/test_cfg_parallel.py:PNG_SHARE", "neuron_diffusers/tools/bench/device.py:TINY_TOTAL_S",
            "neuron_diffusers/tools/bench/device.py:MIN_FAMILY_S",
            "neuron_diffusers/tools/bench/device_family.py:ACTIVATION_MARGIN_GIB",
            "tests/test_quantize.py:FP8_TP8_MAX_RATIO")

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
COMMENT = re.compile(r"<!--(?!\s*figures:).*?-->", re.S)
CODE = re.compile(r"`[^`\n]*`")
TARGET = re.compile(r"\]\([^)]*\)|https?://\S+")
NUM = r"\d+(?:\.\d+)?"
UNIT = r"(?:x(?!\w)|%|ms\b|min\b|us\b|s\b|GiB\b|MiB\b|GB\b|MB\b)"
UNIT_FIGURE = re.compile(rf"(?<![\w.\-])(?:({NUM})\s?(?:-|to|–)\s?)?({NUM})(\s?)({UNIT})")
COUNT = re.compile(r"(?<![\w.])(\d+) (?:(?:clean|passed|failed|verified|skipped|aborted) )?of (\d+)(?![\w.])")
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])")
JSON_NAME = re.compile(r"([\w./-]+\.json)\b")
CITED, END = "<!-- figures: cited -->", "<!-- figures: end -->"
#: Names with a version in them are not figures ("Qwen-Image-2.1", "Wan 2.1", "Python 3.11.7").
NAMES = re.compile(r"(?:-|\b(?:Wan|Python|torch|diffusers|CUDA|Llama) )\d+(?:\.\d+)+")


@dataclass(frozen=True)
class Figure:
    where: str
    text: str
    unit: str
    sources: tuple[str, ...]

    @property
    def value(self) -> float:
        return float(self.text)

    @property
    def slack(self) -> float:
        decimals = len(self.text.partition(".")[2])
        return 0.5 * 10 ** -decimals + 1e-9


def _blank(match: re.Match) -> str:
    return "\n" * match.group(0).count("\n")


def _sections(doc: Path) -> list[tuple[int, list[str]]]:
    """(first line number, lines) per heading, with code blocks blanked out (line numbers kept)."""
    lines = FENCE.sub(_blank, doc.read_text()).splitlines()
    sections, start = [], 0
    for number, line in enumerate(lines):
        if line.startswith("#") and number > start:
            sections.append((start + 1, lines[start:number]))
            start = number
    sections.append((start + 1, lines[start:]))
    return sections


def _sources(lines: list[str], folder: Path) -> tuple[str, ...]:
    names = {Path(name).name for line in lines for name in JSON_NAME.findall(line)}
    return tuple(sorted(name for name in names if (folder / name).is_file()))


def _line_figures(line: str) -> list[tuple[str, str]]:
    text = NAMES.sub(" ", TARGET.sub("]", CODE.sub(" ", COMMENT.sub(" ", line))))
    found, spans = [], []
    for match in UNIT_FIGURE.finditer(text):
        low, high, space, unit = match.groups()
        if unit == "x" and space and "." not in high:
            continue
        found += [(number, unit) for number in (low, high) if number]
        spans.append(match.span())
    for match in COUNT.finditer(text):
        found += [(match.group(1), "count"), (match.group(2), "count")]
    if text.lstrip().startswith("|"):
        found += [(m.group(0), "") for m in DECIMAL.finditer(text)
                  if not any(a <= m.start() < b for a, b in spans)]
    return found


def figures(doc: Path, folder: Path = ROOT / "docs") -> list[Figure]:
    """Every figure of one document, with the stored files (in `folder`) its section names."""
    found, beside = [], folder / f"{doc.stem}.json"  # a table a command wrote beside its JSON (memory.md)
    for first, lines in _sections(doc):
        sources, cited = tuple(sorted({*_sources(lines, folder), *([beside.name] if beside.is_file() else [])})), False
        for offset, line in enumerate(lines):
            if line.strip() in (CITED, END):
                cited = line.strip() == CITED
                continue
            if cited:
                continue
            where = f"{doc.name}:{first + offset}"
            found += [Figure(where, text, unit, sources) for text, unit in _line_figures(line)]
    return found


def cited_blocks(doc: Path) -> list[tuple[str, str]]:
    lines = doc.read_text().splitlines()
    blocks = []
    for number, line in enumerate(lines):
        if line.strip() == CITED:
            block = []
            for following in lines[number + 1:]:
                if following.strip() == END or following.startswith("#"):
                    break
                block.append(following)
            blocks.append((f"{doc.name}:{number + 1}", "\n".join(block)))
    return blocks


def _numbers(tree) -> list[float]:
    if isinstance(tree, bool) or tree is None:
        return []
    if isinstance(tree, (int, float)):
        return [float(tree)] if math.isfinite(tree) else []
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else ()
    return [number for item in items for number in _numbers(item)]


def _forms(value: float, unit: str) -> list[float]:
    forms = [value]
    if unit == "%":
        forms += [100 * value, 100 * (value - 1), 100 * (1 - value)]
    if unit in ("GiB", ""):
        forms.append(value / 2**30)
    if unit in ("MiB", ""):
        forms.append(value / 2**20)
    if unit == "":
        forms.append(value / 2**10)  # KiB in a table
    if unit == "GB":
        forms.append(value / 1e9)
    if unit == "MB":
        forms.append(value / 1e6)
    if unit == "ms":
        forms.append(1000 * value)
    if unit == "min":
        forms.append(value / 60)
    return forms


def _load(name: str) -> list[float]:
    return _numbers(json.loads((ROOT / "docs" / name).read_text()))


def _settings() -> list[float]:
    from neuron_diffusers.cli import _parser

    values, parsers = [], [_parser()]
    while parsers:
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
            elif isinstance(action.default, (int, float)) and not isinstance(action.default, bool):
                values.append(float(action.default))
    return values + [float(_literal(*setting.split(":"))) for setting in SETTINGS]


def _literal(path: str, name: str):
    """The literal a module-level `NAME = ...` (or `A, NAME = ..., ...`) assigns in `path`."""
    for node in ast.parse((ROOT / path).read_text()).body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts, strict=False)
                     if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) else [(target, node.value)])
            for named, value in pairs:
                if isinstance(named, ast.Name) and named.id == name:
                    return ast.literal_eval(value)
    raise AssertionError(f"SETTINGS: {path} assigns {name} no literal at module level")


def _found(figure: Figure, stored: dict[str, list[float]], settings: list[float]) -> bool:
    if figure.unit in ("s", "GiB", "MiB", "%") and any(abs(form - figure.value) <= figure.slack
                                                       for v in settings for form in _forms(v, figure.unit)):
        return True
    return any(abs(form - figure.value) <= figure.slack
               for name in figure.sources for value in stored[name] for form in _forms(value, figure.unit))


@pytest.mark.parametrize("doc", [doc for doc in DOCS if doc.name not in GENERATED], ids=lambda doc: doc.name)
def test_every_figure_is_found_in_a_stored_result_its_section_names(doc):
    stored = {path.name: _load(path.name) for path in STORED}
    settings = _settings()
    missing = [f"{f.where}: {f.text} {f.unit} (looked in: {', '.join(f.sources) or 'its section names no stored file'})"
               for f in figures(doc) if not _found(f, stored, settings)]
    assert not missing, (f"{len(missing)} figure(s) of {doc.name} not found in a stored result (rule: "
                         "tests/test_doc_figures.py, docs/verified.md):\n" + "\n".join(missing))


def test_every_stored_result_says_how_it_was_made():
    for path in STORED:
        if path.name in LEGACY:
            continue
        stored = json.loads(path.read_text())
        assert isinstance(stored, dict), f"{path.name}: a list without a header (command, date, machine, version)"
        missing = [key for key in ("command", "date", "machine") if not stored.get(key)]
        if not (stored.get("versions") or stored.get("neuron_diffusers")):
            missing.append("versions")
        assert not missing, f"{path.name} lacks {missing}: write it with `neuron-diffusers bench record`"


def test_cited_blocks_link_their_source():
    for doc in DOCS:
        for where, block in cited_blocks(doc):
            assert block and "http" in block, f"{where}: a cited block must link where its figures were published"


def test_the_rule_catches_an_unstored_figure(tmp_path):
    """The control: a figure no stored file holds, and one whose section names no file, are both reported."""
    (tmp_path / "run.json").write_text(json.dumps({"seconds": 3.5, "ratio": 0.5}))
    doc = tmp_path / "x.md"
    doc.write_text("# A\n\nSee [run](run.json): 0.50x, 0.123456x faster, 3.5 s.\n\n# B\n\nTook 3.5 s, `9.9 s` in code."
                   "\n\n<!-- figures: cited -->\nPaper (https://example.org): 7.7x.\n\n8.8x\n<!-- figures: end -->"
                   "\n| a | 1.25 |\n")
    found = figures(doc, tmp_path)
    assert [(f.text, f.unit) for f in found] == [("0.50", "x"), ("0.123456", "x"), ("3.5", "s"), ("3.5", "s"),
                                                 ("1.25", "")]
    stored = {"run.json": _numbers(json.loads((tmp_path / "run.json").read_text()))}
    assert [_found(f, stored, []) for f in found] == [True, False, True, False, False]


def test_bench_record_stores_a_commands_json_under_its_header(tmp_path):
    from neuron_diffusers.cli import main

    out = tmp_path / "report.json"
    assert main(["bench", "record", str(out), "--run", "plan report --model qwenimage21 --tp 2 --json"]) == 0
    stored = json.loads(out.read_text())
    assert stored["command"].startswith(f"neuron-diffusers bench record {out} --run ")
    assert stored["machine"]["cpus"] >= 1 and stored["versions"]["diffusers"] and stored["date"].endswith("UTC")
    (run,) = stored["runs"]
    assert run["command"] == "neuron-diffusers plan report --model qwenimage21 --tp 2 --json" and run["exit_code"] == 0
    assert run["result"]["tp"] == 2 and run["result"]["model_class"] == "QwenImage21Transformer2DModel"


def test_bench_record_refuses_a_bad_command_before_running_anything(tmp_path, capsys):
    from neuron_diffusers.cli import main
    from neuron_diffusers.tools.bench.record import parse_output

    assert main(["bench", "record", str(tmp_path / "x.json"), "--run", "bench nosuch --json"]) == 2
    assert "is not a valid neuron-diffusers command" in capsys.readouterr().err
    good = "plan report --model flux --tp 2 --json"
    assert main(["bench", "record", str(tmp_path / "no" / "x.json"), "--run", good]) == 2
    assert "is not a folder" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    assert parse_output('noise\n{"a": 1}\nmore\n') == {"a": 1}  # JSON lines among other output
    assert parse_output('| a table |\n{\n  "b": [1,\n 2]\n}\n') == {"b": [1, 2]}  # a document after a table
    with pytest.raises(ValueError, match="printed no JSON"):
        parse_output("a table, no JSON\n")
