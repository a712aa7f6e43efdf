"""ModelOpt 0.47 exports (its default recipes, its own max calibration) of a shared quality
model, calibrated on the same 128 x 512 bytes of calib.bin as qckpt's benchmark, on CPU:

    python3 -m venv /tmp/mo && /tmp/mo/bin/pip install torch==2.13.0 nvidia-modelopt==0.47.0 \
        transformers==5.24.0 accelerate requests
    /tmp/mo/bin/python bench/peers/modelopt_export.py MODEL_DIR OUT_ROOT FP8,FP8_PCPT,NVFP4
"""

import copy
import sys
from pathlib import Path

import modelopt.torch.quantization as mtq
import torch
from modelopt.torch.export import export_hf_checkpoint
from transformers import AutoModelForCausalLM

Q = Path(__file__).resolve().parents[3] / "shared" / "quality"


def main() -> None:

    model_dir, out_root = Path(sys.argv[1]), Path(sys.argv[2])
    names = sys.argv[3].split(",")
    raw = (Q / "calib.bin").read_bytes().decode("utf-8", errors="replace").encode("utf-8")
    ids = torch.frombuffer(bytearray(raw[: 128 * 512]), dtype=torch.uint8).long().reshape(128, 512)
    CFG = {
        "FP8": mtq.FP8_DEFAULT_CFG,
        "FP8_PCPT": mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG,
        "NVFP4": mtq.NVFP4_DEFAULT_CFG,
        "NVFP4_AWQ": getattr(mtq, "NVFP4_AWQ_LITE_CFG", None),
    }
    for name in names:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        cfg = copy.deepcopy(CFG[name])

        def loop(m):
            with torch.no_grad():
                for i in range(0, 128, 16):
                    m(ids[i : i + 16])

        mtq.quantize(model, cfg, forward_loop=loop)
        out = out_root / f"modelopt-{name.lower()}"
        with torch.no_grad():
            export_hf_checkpoint(model, export_dir=str(out))
        print("wrote", out, flush=True)


if __name__ == "__main__":
    main()
