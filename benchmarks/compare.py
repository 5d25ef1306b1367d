"""mhaextract beside its baselines: the same command as ``mhaextract bench``.

    python benchmarks/compare.py            # d in {4, 8, 16}, H in {1, 2, 3} (the README table)
    python benchmarks/compare.py --quick    # d in {4, 8}, H in {1, 2}

Writes benchmarks/out/bench.md and benchmarks/out/bench.png (``--out`` to change) and prints the
table; see ``mhaextract bench --help`` for every option.
"""

import sys

from mhaextract.tools.cli import app

if __name__ == "__main__":
    app(["bench", *sys.argv[1:]])
