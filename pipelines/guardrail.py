"""NVIDIA's Cosmos guardrail, used where the cosmos_guardrail package is installed.

diffusers' Cosmos pipelines refuse to run without it, and constructing it downloads its models from
the hub. ulysses-studio runs offline, so: installed -> it checks every prompt and every output;
not installed -> generation proceeds with one warning. The NVIDIA Open Model License asks users of
Cosmos checkpoints to keep such safeguards: the README says so.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np


class GuardrailRejection(ValueError):
    """The guardrail judged a prompt unsafe."""


class Guardrail:
    """Thin wrapper over cosmos_guardrail.CosmosSafetyChecker."""

    def __init__(self, checker) -> None:
        self._checker = checker

    @classmethod
    def load(cls) -> Guardrail | None:
        """The guardrail if its package is installed, else None (with a warning)."""
        if importlib.util.find_spec("cosmos_guardrail") is None:
            warnings.warn(
                "cosmos_guardrail is not installed: Cosmos outputs are not safety-checked "
                "(pip install cosmos_guardrail, with its models in the local Hugging Face cache, to enable it)",
                UserWarning,
                stacklevel=2,
            )
            return None
        from cosmos_guardrail import CosmosSafetyChecker

        try:
            return cls(CosmosSafetyChecker())
        except Exception as error:  # its constructor fetches models; offline that fails in many ways
            raise RuntimeError(
                f"cosmos_guardrail is installed but could not load its models ({error}); put them in the local "
                "Hugging Face cache, or uninstall cosmos_guardrail to run without it"
            ) from error

    def check_text(self, prompt: str) -> None:
        if not self._checker.check_text_safety(prompt):
            raise GuardrailRejection("the Cosmos guardrail rejected this prompt")

    def check_frames(self, frames: np.ndarray) -> np.ndarray:
        """Frames [T, H, W, 3] uint8, blurred by the guardrail where it finds unsafe content."""
        return self._checker.check_video_safety(frames)
