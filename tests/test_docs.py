"""Every command in docs/ runs as written.

A shell block fenced as `bash runnable` is run and must exit 0; `bash runnable exit=N` must exit N (a
deliberately wrong plan being caught). The runnable blocks of one page run in order, in one empty folder,
with this environment's executables on PATH and the Hub offline. Any other shell block (`bash needs=WHAT`:
it needs hardware or a download we do not have here) is not run, but its `neuron-diffusers` commands must
parse.
"""

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from neuron_diffusers.cli import _parser

DOCS = sorted((Path(__file__).resolve().parent.parent / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SHELLS = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    where: str
    lang: str
    tags: tuple[str, ...]
    text: str

    @property
    def expected_exit(self) -> int:
        return next((int(tag.partition("=")[2]) for tag in self.tags if tag.startswith("exit=")), 0)


def _blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    return [Block(f"{doc.name}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1), tuple(m.group(2).split()),
                  m.group(3)) for m in FENCE.finditer(text)]


def _shell_blocks(doc: Path, runnable: bool) -> list[Block]:
    return [b for b in _blocks(doc) if b.lang in SHELLS and ("runnable" in b.tags) == runnable]


@pytest.mark.parametrize("doc", [doc for doc in DOCS if _shell_blocks(doc, runnable=True)], ids=lambda doc: doc.name)
def test_runnable_blocks_run_as_written(doc, tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1"}
    for block in _shell_blocks(doc, runnable=True):
        result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == block.expected_exit, (
            f"{block.where} exited {result.returncode}, expected {block.expected_exit}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def _commands(text: str):
    """The argument lists of `neuron-diffusers ...` / `-m neuron_diffusers ...` invocations, one per line."""
    for line in text.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        for start, token in enumerate(tokens):
            if token == "neuron-diffusers" or (token == "neuron_diffusers" and tokens[start - 1] == "-m"):
                yield tokens[start + 1:]
                break


def test_commands_not_run_here_still_parse():
    commands = [(b.where, args) for doc in DOCS for b in _shell_blocks(doc, runnable=False)
                for args in _commands(b.text)]
    assert any(where.startswith("usage.md") for where, _ in commands), "the Trainium example was not found"
    for where, args in commands:
        try:
            _parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{where}: `neuron-diffusers {shlex.join(args)}` does not parse")


def test_python_blocks_compile():
    """Whole snippets, or excerpts of a plan's entries (`"rule": style,` lines), must be valid Python."""
    for block in (b for doc in DOCS for b in _blocks(doc) if b.lang == "python"):
        try:
            compile(block.text, block.where, "exec")
        except SyntaxError:
            compile(f"{{\n{block.text}}}", block.where, "eval")


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", doc.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_links_between_pages_resolve():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            if not linked.exists() or (anchor and anchor not in _anchors(linked)):
                broken.append(f"{doc.name}: {target}")
    assert not broken, broken
