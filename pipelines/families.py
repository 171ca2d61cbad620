"""The model families this product runs, in the order they are listed: one folder each, with its record
(pipelines/<family>/record.py; pipelines.family says what a record holds). The registry registers them."""

from __future__ import annotations

from pipelines.cosmos.record import COSMOS
from pipelines.cosmos3.record import COSMOS3
from pipelines.flux.record import FLUX
from pipelines.flux2.record import FLUX2
from pipelines.flux3.record import FLUX3
from pipelines.qwen_image.record import QWEN_IMAGE
from pipelines.wan.record import WAN, WAN22

BUILT_IN = (FLUX, COSMOS, COSMOS3, FLUX2, WAN, QWEN_IMAGE, FLUX3, WAN22)
