import multiprocessing.util
import os
import shutil
import tempfile

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from app.ranks.runtime import cpu_threads_per_rank

# Inductor's compiled-kernel cache stays the machine's (inductor finds it through the temporary directory, changed
# below), shared by the test processes and the ranks they start.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())

# This process's other temporary files go to a folder of its own: gradio_client, used here, leaves an empty folder in
# the temporary directory for each file it downloads (gradio_client 2.7's Client._download_file makes
# $TMPDIR/<40 hex digits> and never removes it) and downloads into $TMPDIR/gradio. The processes the tests start
# (servers, ranks) keep the machine's TMPDIR: what they leave there is theirs to clean, and tests check it. The folder
# is removed at the process's exit, after multiprocessing has removed its own pymp-* folder in it (exit priority -100;
# lower ones run later).
_TEMP = tempfile.mkdtemp(prefix="ulysses-studio-tests-")
tempfile.tempdir = _TEMP
multiprocessing.util.Finalize(None, shutil.rmtree, args=(_TEMP,), kwargs={"ignore_errors": True}, exitpriority=-200)


# Tests never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Test processes running side by side (pytest-xdist) share the cores, as ranks do: torch's default of one
# thread per core in each of them oversubscribes the machine, which made a one-process quality test 2.8x
# slower beside a busy process on the 2-core CI machine. Processes these tests start inherit the share.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_rank(_workers)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
