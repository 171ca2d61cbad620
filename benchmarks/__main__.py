"""`python -m benchmarks`: the bench command (benchmarks.cli), also run by `ulysses-studio bench`."""

import sys

from benchmarks.cli import main

sys.exit(main())
