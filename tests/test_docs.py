"""Every command in docs/ runs as written.

A shell block fenced as `bash runnable` is run and must exit 0; `bash runnable exit=N` must exit N (a
deliberately wrong plan being caught). The runnable blocks of one page run in order, in one empty folder,
with this environment's executables on PATH and the Hub offline. A line that is one `neuron-diffusers plan ...`
command runs in this process instead (`cli.main`, the program's own body: the same parser and command, minus an
interpreter start), its rank jobs on the session's gloo ranks (`pooled`), in the same folder; a line that is one
`torchrun --nproc_per_node=N -m neuron_diffusers ...` runs that body on N of those ranks (`cli_jobs.on_pool`: what
torchrun itself adds is tested with real launches elsewhere); the block stops at the first command that fails, as
`bash -e` does. Any other shell block (`bash needs=WHAT`: it needs hardware or a
download we do not have here) is not run, but its `neuron-diffusers` commands must parse.
"""

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import cli_jobs
import pytest

from neuron_diffusers.cli import _parser, main
from neuron_diffusers.tools.plan import verify

DOCS = sorted((Path(__file__).resolve().parent.parent / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SHELLS = {"bash", "sh", "shell", "console"}
#: `neuron-diffusers` commands run in this process (the `plan` tools: `plan verify` would spawn ranks of its own);
#: the others (`tiny`, torchrun's jobs) run in bash, as the installed program.
IN_PROCESS = {"plan"}
SHELL_SYNTAX = set("|&;<>$`\\*?()")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)")
TORCHRUN = re.compile(r"--nproc[_-]per[_-]node=(\d+)")
STATEFUL = re.compile(r"^\s*(cd|export|source|pushd|\.)\s|^\s*\w+=", re.M)


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


def _in_process(line: str) -> tuple[str, object] | None:
    """A line that is one `neuron-diffusers plan` command, as ("here", argv), or one torchrun launch of the package
    on one node, as ("ranks", (N, argv)); else None (bash runs it)."""
    if SHELL_SYNTAX & set(line):
        return None
    tokens = shlex.split(line)
    if len(tokens) > 1 and tokens[0] == "neuron-diffusers" and tokens[1] in IN_PROCESS:
        return "here", tokens[1:]
    if (len(tokens) > 4 and tokens[0] == "torchrun" and (match := TORCHRUN.fullmatch(tokens[1]))
            and tokens[2:4] == ["-m", "neuron_diffusers"]):
        return "ranks", (int(match.group(1)), tokens[4:])
    return None


def _steps(text: str) -> list[tuple[str, object]]:
    """A block in order, as ("bash", script) chunks and in-process commands (`_in_process`; never inside a
    here-document). A line continued with a backslash is one line."""
    steps, chunk, heredoc = [], [], None
    for line in text.replace("\\\n", " ").splitlines(keepends=True):
        command = None if heredoc else _in_process(line)
        if command is not None:
            steps += [("bash", "".join(chunk))] if chunk else []
            steps.append(command)
            chunk = []
            continue
        chunk.append(line)
        if heredoc:
            heredoc = None if line.strip() == heredoc else heredoc
        elif match := HEREDOC.search(line):
            heredoc = match.group(1)
    return steps + ([("bash", "".join(chunk))] if chunk else [])


def _run_here(argv: list[str], capsys) -> tuple[int, str]:
    """`neuron-diffusers ARGV` as `cli.run` runs it (argparse's exits included): its status and output."""
    try:
        code = main(argv)
    except SystemExit as leaving:
        code = leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)
    captured = capsys.readouterr()
    return code, f"{captured.out[-3000:]}\n{captured.err[-3000:]}"


def _run_block(block: Block, cwd: Path, env: dict, capsys, rank_pool) -> tuple[int, str]:
    steps = _steps(block.text)
    if len(steps) > 1:  # separate shells: nothing a line sets up may be meant to carry over to the next
        assert not STATEFUL.search(block.text), f"{block.where}: state set in one step would not reach the next"
    for kind, step in steps:
        if kind == "here":
            code, output = _run_here(step, capsys)
        elif kind == "ranks":
            ranks, argv = step
            launch = cli_jobs.on_pool(rank_pool, argv, ranks, cwd=cwd)
            code, output = launch["code"], f"{launch['out'][-3000:]}\n{launch['err'][-3000:]}"
        else:
            result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step], cwd=cwd, env=env,
                                    capture_output=True, text=True, timeout=600)
            code, output = result.returncode, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if code:
            break
    return code, output


@pytest.mark.parametrize("doc", [doc for doc in DOCS if _shell_blocks(doc, runnable=True)], ids=lambda doc: doc.name)
def test_runnable_blocks_run_as_written(doc, tmp_path, monkeypatch, capsys, pooled, rank_pool):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1"}
    monkeypatch.chdir(tmp_path)  # the folder the in-process commands run in too
    with pooled(verify):
        for block in _shell_blocks(doc, runnable=True):
            code, output = _run_block(block, tmp_path, env, capsys, rank_pool)
            assert code == block.expected_exit, (
                f"{block.where} exited {code}, expected {block.expected_exit}:\n{output}")


def test_a_block_splits_into_bash_and_in_process_steps():
    """A here-document's lines, other commands and lines with shell syntax stay in bash, in their order."""
    heredoc = "cat > x.py <<'EOF'\nneuron-diffusers plan check flux\nEOF\n"
    rest = "neuron-diffusers tiny flux f\nneuron-diffusers plan report --model flux | head\n"
    assert _steps(heredoc + "neuron-diffusers plan check x.py\n" + rest) == [
        ("bash", heredoc), ("here", ["plan", "check", "x.py"]), ("bash", rest)]
    launch = "torchrun --nproc_per_node=2 -m neuron_diffusers generate \\\n  --prompt 'a fox' --tp 2\n"
    two_nodes = "torchrun --nnodes=2 --nproc_per_node=2 -m neuron_diffusers generate --tp 2\n"
    assert _steps(launch + two_nodes) == [("ranks", (2, ["generate", "--prompt", "a fox", "--tp", "2"])),
                                          ("bash", two_nodes)]


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
