import os

# Tests never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
