"""GPU probe: can FLUX's double-stream blocks compute their text and image streams' projections
as ONE grouped GEMM, and does that pay more on a ring-2 rank (2048 image + 256 text rows) than on
1 GPU (4096 + 512)?

    python scripts/probe_grouped_gemm.py [--out result.json]

A double-stream block projects its image and text tokens with different weights of the same
shape. The text GEMMs are small (256 rows a rank: 24 tiles of 128x256 on 132 SMs), so they do not
halve with the rows; in one grouped GEMM (torch._grouped_mm) their tiles would fill the image
GEMM's last wave instead. Times (CUDA-graph replays, median of 20 replays of 20 calls, us), per
shape (K -> N) of the block's GEMMs:
- image alone, text alone, both one after the other (what the engines run now), both on two streams;
- grouped: torch._grouped_mm over the joined rows, the stacked weights as views of the Linear
  weights (column-major), without and with the two biases added, and copied row-major;
- one cuBLAS GEMM over the joined rows with one weight (a floor: no grouping overhead);
and the grouped result's largest difference from the separate GEMMs.
cuBLAS runs without its workspace, as the engines set it on GPUs (engines.distributed).
"""

from __future__ import annotations

import json

from engines.distributed import use_cublas_without_workspace

use_cublas_without_workspace()  # before the first cuBLAS call

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from probe_attention_beside import beside  # noqa: E402  (this folder: run as scripts/probe_grouped_gemm.py)
from probe_attention_split import probe_output, replay_us, write_result  # noqa: E402


def main() -> None:
    out = probe_output(__doc__)
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for image_rows, text_rows in ((2048, 256), (4096, 512)):
        for k, n in ((3072, 3072), (3072, 12288), (12288, 3072)):
            x = torch.randn(text_rows + image_rows, k, **bf16)
            x_text, x_image = x[:text_rows], x[text_rows:]
            w = torch.randn(2, n, k, **bf16) * 0.02  # (text, image) weights as nn.Linear holds them
            b = torch.randn(2, n, **bf16)
            offsets = torch.tensor([text_rows, text_rows + image_rows], device="cuda", dtype=torch.int32)
            w_t = w.transpose(1, 2)  # (2, K, N): a view of the Linear weights (column-major)
            reference = torch.cat([F.linear(x_text, w[0], b[0]), F.linear(x_image, w[1], b[1])])
            row_bias = torch.cat([b[0].expand(text_rows, n), b[1].expand(image_rows, n)])

            def grouped() -> torch.Tensor:
                return torch._grouped_mm(x, w_t, offs=offsets)

            def grouped_bias() -> torch.Tensor:
                out = torch._grouped_mm(x, w_t, offs=offsets)
                out[:text_rows] += b[0]
                out[text_rows:] += b[1]
                return out

            times = {
                "image": replay_us(lambda: F.linear(x_image, w[1], b[1])),
                "text": replay_us(lambda: F.linear(x_text, w[0], b[0])),
                "separate": replay_us(lambda: (F.linear(x_text, w[0], b[0]), F.linear(x_image, w[1], b[1]))),
                "two streams": replay_us(lambda: beside(side, lambda: F.linear(x_image, w[1], b[1]),
                                                        lambda: F.linear(x_text, w[0], b[0]), other_first=False)),
                "one GEMM, joined rows": replay_us(lambda: F.linear(x, w[1], b[1])),
            }
            errors = {}
            try:
                times["grouped"] = replay_us(grouped)
                times["grouped + biases"] = replay_us(grouped_bias)
                errors["grouped + biases vs separate"] = (grouped() + row_bias - reference).abs().max().item()
            except RuntimeError as error:  # the kernel's requirements, as this torch states them
                times["grouped"] = f"failed: {error}"
            try:  # the stacked weights made contiguous as (2, K, N): row-major
                w_rows = w_t.contiguous()
                times["grouped, row-major weights"] = replay_us(lambda: torch._grouped_mm(x, w_rows, offs=offsets))
            except RuntimeError as error:
                times["grouped, row-major weights"] = f"failed: {error}"
            key = f"{image_rows}+{text_rows} rows, {k}->{n}"
            result["shapes"][key] = {"us": times, "max_abs_diff": errors}
            print(key, json.dumps(times), errors, flush=True)
    write_result(result, out)


if __name__ == "__main__":
    main()
