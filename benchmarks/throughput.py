"""Many-request throughput of tokenmill and its peers: `tokenmill bench --skip latency`.

python benchmarks/throughput.py [tokenmill bench options, e.g. --num-requests 64]
"""

import sys

from tokenmill.cli import main

if __name__ == "__main__":
    main(["bench", "--skip", "latency", *sys.argv[1:]])
