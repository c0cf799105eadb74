"""CI must install and test exactly as the README tells a newcomer to."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    first_block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in first_block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_commands_verbatim():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci_lines, f"README command not run verbatim by .ci/run: {command}"
