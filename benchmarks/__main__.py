"""`python -m benchmarks`: the bench command (benchmarks.cli), also run by `ulysses-studio bench`."""

from app.commands.cli import exit_with
from benchmarks.cli import main

exit_with(main())
