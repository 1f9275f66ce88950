"""Batch-1 latency of tokenmill and its peers: `tokenmill bench --skip throughput`.

python benchmarks/latency.py [tokenmill bench options, e.g. --runs 5 --peers none]
"""

import sys

from tokenmill.cli import main

if __name__ == "__main__":
    main(["bench", "--skip", "throughput", *sys.argv[1:]])
