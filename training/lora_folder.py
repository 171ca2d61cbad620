"""The files of a LoRA folder written by `python -m training lora` (training/lora.py writes them, training.evaluate and
tests/test_tiny_lora_quality.py read them): its diffusers file and the same LoRA in kohya's format."""

from __future__ import annotations

from pathlib import Path

from engines.options import LoraFile

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
KOHYA_FILE = "pytorch_lora_weights_kohya.safetensors"


def lora_files(folder: Path) -> tuple[LoraFile, LoraFile]:
    """The diffusers file of a LoRA folder written by `python -m training lora` as LoRA "lora", its kohya copy
    as "kohya" (engines.options.LoraFile, scale 1 each)."""
    return (LoraFile(name="lora", path=folder / DIFFUSERS_FILE), LoraFile(name="kohya", path=folder / KOHYA_FILE))
