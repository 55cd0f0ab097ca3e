"""`python -m hype.cli` (and `torchrun -m hype.cli train ...`) runs the `hype` command."""

from hype.cli import main

main()
