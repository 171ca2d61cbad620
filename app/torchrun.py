"""torchrun (torch.distributed.run, same arguments) without the second its interpreter spends ending.

Once its ranks are gone, torchrun's process still takes about 1 s to exit: the interpreter's last garbage
collection over torch's objects (py-spy shows gc_collect_main, after the atexit handlers). Measured with
two trivial ranks on the 2-core CPU machine: 1.06 s from torchrun's failure report to its exit, 0.06 s
when it ends with os._exit. Every Ctrl-C and every failed run of `launch` and `build` waited through it.
So this runs torchrun's own main() and then ends the process with os._exit, once the output is flushed:
by then torchrun has stopped its ranks and closed its rendezvous store, and nothing else is left to do.

A failed run prints torchrun's failure table (which rank, its exit code or signal, when) without the
Python traceback around it; the launcher's next line says that a rank failed.
"""

from __future__ import annotations

import os
import sys
import traceback

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main


def run() -> int:
    """torchrun's exit status: 0, 1 where a rank failed, argparse's 2 for a bad command line."""
    try:
        torchrun_main()
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
        return 1
    except ChildFailedError as error:
        print(error, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the same fast exit
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    status = run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
