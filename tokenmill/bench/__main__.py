"""`python -m tokenmill.bench SPEC`: the tokenmill worker of `tokenmill bench`."""

import sys

from tokenmill.bench.worker import serve

if __name__ == "__main__":
    serve(*sys.argv[1:])
