"""The PNGs behind `response_format: "url"` when the server has `--out DIR`: rank 0 keeps the last `--keep` of them
there, and `GET /v1/images/files/{name}` serves them (OpenAI's URLs, too, expire).

Names are random (`secrets.token_hex`), so one client cannot guess another's images, and checked against one pattern
before any path is built, so no name reaches outside the folder. The bound counts the folder's earlier images too
(oldest first by modification time), so restarts do not let it grow without limit. Each file is written to a
temporary name and renamed, so a reader never sees half an image.
"""

from __future__ import annotations

import collections
import os
import re
import secrets
import threading
from pathlib import Path

NAME = re.compile(r"^[0-9a-f]{32}\.png$")


class ImageFiles:
    def __init__(self, folder: Path, keep: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.keep = folder, keep
        self._lock = threading.Lock()
        earlier = sorted((path for path in folder.iterdir() if NAME.match(path.name)), key=lambda p: p.stat().st_mtime)
        self._names = collections.deque(path.name for path in earlier)
        self._drop_beyond_bound()

    def add(self, png: bytes) -> str:
        """Write `png`, drop the oldest beyond the bound; the new file's name."""
        name = f"{secrets.token_hex(16)}.png"
        staged = self.folder / f".{name}.tmp"
        staged.write_bytes(png)
        os.replace(staged, self.folder / name)
        with self._lock:
            self._names.append(name)
            self._drop_beyond_bound()
        return name

    def path(self, name: str) -> Path | None:
        """The file of `name` if it is one of ours and still kept, else None."""
        if not NAME.match(name):
            return None
        path = self.folder / name
        return path if path.is_file() else None

    def _drop_beyond_bound(self) -> None:
        while len(self._names) > self.keep:
            (self.folder / self._names.popleft()).unlink(missing_ok=True)
