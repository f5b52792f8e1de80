"""`python -m dsfuse.bench ...`: the command line of `dsfuse.bench.cli`."""

import sys

from dsfuse.bench.cli import main

sys.exit(main(prog="python -m dsfuse.bench"))
