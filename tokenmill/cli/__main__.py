"""`python -m tokenmill.cli ARGS`: the `tokenmill` command, also where no script is
installed (torchrun starts each rank this way: `torchrun ... -m tokenmill.cli serve`)."""

from tokenmill.cli import main

main()
