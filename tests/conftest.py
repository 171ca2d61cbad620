import os
import sys
from pathlib import Path

# Tests never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
