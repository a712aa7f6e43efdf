"""Run under torchrun on 2 GPUs: EP2 over NCCL vs one GPU, for the forward and the calibration.

Optional argv[2]: the device (cpu for a gloo smoke run). Writes one JSON line per rank to the path in argv[1] (rank 0 also writes the reference figures).
"""

import json
import sys
import time

import torch
import torch.distributed as dist

from qckpt.calib.calibrate import calibrate_model
from qckpt.calib.data import calibration_batches
from qckpt.models.build import build_model
from qckpt.parallel.mesh import Mesh, init_mesh
from qckpt.pipeline.model import build
from qckpt.recipe import recipe_from_dict


def main(out_path: str, device: str = "cuda") -> None:
    mesh = init_mesh(ep=2, timeout_s=30, device=device)
    sync = torch.cuda.synchronize if mesh.device.type == "cuda" else (lambda: None)
    r = recipe_from_dict(
        {"calibrate": {"data": {"num_samples": 16, "seq_len": 32, "batch_size": 4}}}
    )
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(3)).to(mesh.device)

    ref = build_model("tiny-moe", device=mesh.device)
    ref.config._experts_implementation = "eager"
    with torch.no_grad():
        ref_logits = ref(ids).logits
    ref_batches = calibration_batches(r.calibrate.data, vocab_size=256)
    ref_state, _ = calibrate_model(ref, ref_batches, r.quant, Mesh(device=mesh.device))

    model = build("tiny-moe", mesh, seeded=True).model  # seeded weights, this rank's experts
    mine = ids[mesh.data_rank :: mesh.data_parallel_size]
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(mine).logits
    sync()
    fwd_s = time.perf_counter() - t0
    batches = calibration_batches(
        r.calibrate.data,
        vocab_size=256,
        data_rank=mesh.data_rank,
        data_world=mesh.data_parallel_size,
    )
    state, report = calibrate_model(model, batches, r.quant, mesh)
    diffs = {
        k: abs(float(state.amax[k].max()) - float(v.max())) / max(float(v.max()), 1e-12)
        for k, v in ref_state.amax.items()
    }
    want = ref_logits[mesh.data_rank :: mesh.data_parallel_size]
    rec = {
        "rank": mesh.rank,
        "backend": mesh.backend,
        "logits_max_abs_diff": float((logits.float() - want.float()).abs().max()),
        "logits_bitwise_equal": bool(torch.equal(logits, want)),
        "amax_keys_equal": sorted(state.amax) == sorted(ref_state.amax),
        "amax_bitwise_equal": all(
            torch.equal(state.amax[k], ref_state.amax[k]) for k in ref_state.amax
        ),
        "amax_max_rel_diff": max(diffs.values()),
        "ep_forward_seconds": fwd_s,
        "sync_collectives": report["sync_collectives"],
    }
    with open(out_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:3])
    except BaseException:
        import os
        import traceback

        with open(sys.argv[1], "a") as f:
            rec = {"rank": int(os.environ.get("RANK", "0")), "error": traceback.format_exc()}
            f.write(json.dumps(rec) + "\n")
        raise
