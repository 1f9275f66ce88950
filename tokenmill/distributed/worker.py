"""`python -m tokenmill.distributed.worker`: one rank > 0 of a parallel run on this
machine, started by rank 0 (runtime.Runtime) as a process of its own.

A fresh interpreter that imports only tokenmill: the user's script is never imported
again (multiprocessing's spawn re-imports `__main__`, so a script without an
`if __name__ == "__main__":` guard started a second engine in the child, which died,
and rank 0 waited a minute for it). The arguments are rank 0's, not a user's:

    --rank R --world N --port P   its rank, the number of ranks, the rendezvous port
    --control-fd FD               its pipe to rank 0 (`h` joining, `r` ready, `d` per step)
    --spec JSON                   the ParallelSpec every rank builds its part from

The arguments and the model's path are checked before torch is imported (seconds on a
busy machine), so such a failure reaches rank 0 at once.
"""

from __future__ import annotations

import argparse
import json
import os


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tokenmill.distributed.worker",
        description="one rank > 0 of a parallel tokenmill run (started by rank 0)",
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--spec", type=json.loads, required=True)
    args = parser.parse_args(argv)
    path = args.spec.get("model_path", "")
    if not os.access(path, os.R_OK):
        parser.exit(1, f"rank {args.rank}: cannot read the model at {path!r}\n")

    from tokenmill.distributed.runtime import ParallelSpec, worker_main

    spec = ParallelSpec(**args.spec)
    worker_main(args.rank, args.world, args.port, spec, control_fd=args.control_fd)


if __name__ == "__main__":
    main()
