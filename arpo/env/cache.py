"""Local file cache for the files OSWorld tasks download (setup `download`, getter `cloud_file`).

Nothing here touches the network: the machine running the benchmark may be offline. A URL is
looked up in the cache directory in this order:

1. `index.json` in the cache directory: `{"<url>": "<path relative to the cache dir>"}`;
2. OSWorld's own cache name `<uuid5(NAMESPACE_URL, url)>_<basename of the VM path>`, so a cache
   directory filled by OSWorld's `SetupController` works as is;
3. the URL's path after `/resolve/main/` (the layout of OSWorld's Hugging Face file cache:
   `<domain>/<task id>/<file name>`);
4. the URL's file name at the top of the cache directory.

A miss raises `FileCacheMiss` naming the URL and where to put the file.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlparse

from arpo.errors import FileCacheMiss

INDEX_NAME = "index.json"


def cache_name(url: str, file_name: str) -> str:
    """OSWorld's cache name for `url` saved as `file_name` (its SetupController's key):
    `<uuid5(NAMESPACE_URL, url)>_<file name>`."""
    return f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{file_name}"


class FileCache:
    """Read-only view of a directory of cached task files."""

    def __init__(self, root: str | Path | None) -> None:
        self.root = Path(root) if root is not None else None
        self._index: dict[str, str] | None = None

    def _load_index(self) -> dict[str, str]:
        if self._index is None:
            self._index = {}
            if self.root is not None and (self.root / INDEX_NAME).is_file():
                raw = json.loads((self.root / INDEX_NAME).read_text(encoding="utf-8"))
                if not isinstance(raw, dict):
                    raise FileCacheMiss(f"{self.root / INDEX_NAME} must map URLs to file paths")
                self._index = {str(k): str(v) for k, v in raw.items()}
        return self._index

    @staticmethod
    def _url_relpath(url: str) -> str | None:
        path = unquote(urlparse(url).path)
        marker = "/resolve/main/"
        if marker in path:
            return path.split(marker, 1)[1]
        return None

    @staticmethod
    def _url_filename(url: str) -> str:
        return PurePosixPath(unquote(urlparse(url).path)).name

    def candidates(self, url: str, dest_name: str | None = None) -> list[Path]:
        """Paths where `url` may be cached, in lookup order (existing or not)."""
        if self.root is None:
            return []
        out: list[Path] = []
        mapped = self._load_index().get(url)
        if mapped is not None:
            out.append(self.root / mapped)
        if dest_name:
            out.append(self.root / cache_name(url, dest_name))
        rel = self._url_relpath(url)
        if rel:
            out.append(self.root / rel)
        name = self._url_filename(url)
        if name:
            out.append(self.root / name)
        return out

    def lookup(self, url: str, dest_name: str | None = None) -> Path:
        """The cached file for `url`; `dest_name` is the file's name on the VM (OSWorld's key)."""
        for cand in self.candidates(url, dest_name):
            if cand.is_file():
                return cand
        if self.root is None:
            raise FileCacheMiss(
                f"task needs {url} but no file cache directory is configured and downloads are "
                "not made here; set the runner's cache_dir to a directory holding the file"
            )
        rel = self._url_relpath(url) or self._url_filename(url)
        raise FileCacheMiss(
            f"{url} is not in the file cache {self.root}; download it elsewhere and put it at "
            f"{self.root / rel}, or add {json.dumps({url: rel})} to {self.root / INDEX_NAME}"
        )
