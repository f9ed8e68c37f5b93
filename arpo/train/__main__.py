"""`python -m arpo.train [--config FILE] [field=value ...]`: the same as `arpo train`."""

import sys

from arpo.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
