"""The test images the quick start draws overlays of: as many different cars (id prefixes) as there are.

    python -m scripts.quickstart_samples data/test/imgs 8

Prints up to COUNT image paths, one a line: the first image of each prefix group (``--split-by prefix``'s groups,
Carvana's car ids), then the second of each, and so on, so that eight overlays show eight cars where there are eight.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from utils.datasets.splits import groups_of


def overlay_samples(folder: Path, count: int) -> list[Path]:
    """Up to ``count`` files of ``folder`` (hidden ones left out), taken round-robin across their prefix groups."""
    files = sorted(path for path in folder.iterdir() if path.is_file() and not path.name.startswith("."))
    groups = groups_of([path.stem for path in files])
    chosen = [files[group[k]] for k in range(max(map(len, groups), default=0)) for group in groups if k < len(group)]
    return chosen[:count]


def main(argv: Sequence[str] | None = None) -> int:
    folder, count = sys.argv[1:] if argv is None else argv
    print("\n".join(str(path) for path in overlay_samples(Path(folder), int(count))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
