"""Quiet the log lines torchao's import prints that concern no run of this app; torch-free, so that the launcher's
checks (which load family code through pipelines.family.load) can call it without importing torch."""

from __future__ import annotations

import logging


class _TorchaoImportNoise(logging.Filter):
    """Drops the log records torchao's import makes that concern no run of this app, and no others.

    transformers and diffusers import torchao whenever it is installed (their quantizers' availability checks),
    so every run hears these, --fp8 or not, and they read like a broken install:
    - torchao: "Failed to load .../torchao/_C_*.so": optional prebuilt kernels (MX FP8 built for another
      Python, CUTLASS for sm90a GPUs) that this module's FP8 GEMMs (torch._scaled_mm) never call;
    - torch.utils._pytree: register_constant() on torchao's Enums is deprecated: torchao's business, one per enum;
    - diffusers: "Unable to import `torchao` Tensor objects": for loading checkpoints that torchao serialized,
      which this app never loads (it quantizes at load time).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            message = record.getMessage()
            return not (message.startswith("Failed to load ") and "torchao/_C" in message)
        if record.name == "torch.utils._pytree":
            subject = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return not ("register_constant() on Enum subclasses is deprecated" in str(record.msg)
                        and getattr(subject, "__module__", "").startswith("torchao"))
        return not str(record.msg).startswith("Unable to import `torchao` Tensor objects")


_IMPORT_NOISE = _TorchaoImportNoise()
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")


def quiet_torchao_import() -> None:
    """Before diffusers or transformers is imported (they import torchao): keep torchao's import from printing
    what concerns no run of this app (_TorchaoImportNoise); every other record of those loggers still shows."""
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).addFilter(_IMPORT_NOISE)  # adding the same filter twice keeps one
