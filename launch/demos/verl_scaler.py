"""verl's FSDP2 optimizer step with torch's ShardedGradScaler, and with shardscale's.

    torchrun --standalone --nproc-per-node 2 launch/demos/verl_scaler.py

verl's real FSDP engine (a tiny Qwen2 in fp16 on 2 CPU ranks, gloo) takes a clean step, then a
step where rank 1's gradient shard alone holds an inf, through verl's own ``optimizer_step``:
``unscale_``, verl's FSDP2 clipping, ``step``, ``update``. Once per scaler and optimizer:

* torch's ``ShardedGradScaler(device="cpu")`` (verl builds it with the default ``"cuda"``,
  which on a CPU disables it: overflow steps would simply be taken);
* shardscale's, through ``shardscale.integrations.verl.use_shardscale(engine)``.

Printed per case and rank: what each step did, whether a parameter is NaN afterwards, the scales,
and the collectives each ``optimizer_step`` issued (the scaler's and verl's clipping's).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import verl_engine
from _common import leave
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

from shardscale import count_collectives

INIT_SCALE = 2.0**10


def run_case(model_path: str, scaler_name: str, fused: bool) -> dict[str, Any]:
    from shardscale.integrations.verl import use_shardscale

    engine = verl_engine.build_engine(model_path, "fsdp2", fused=fused)
    # The same start for both: 2**16 overflows this tiny model's first fp16 steps anyway.
    if scaler_name == "torch":
        engine.scaler = TorchShardedGradScaler("cpu", init_scale=INIT_SCALE, growth_interval=400)
    else:
        use_shardscale(engine, init_scale=INIT_SCALE)
    outcomes, collectives, nan_params = [], [], []
    scales = [engine.scaler.get_scale()]
    with engine.train_mode():
        for step, planted in ((0, False), (1, True)):  # a clean step, then rank 1 overflows
            verl_engine.forward_backward(engine, step)
            if planted and dist.get_rank() == 1:
                verl_engine.plant(engine, math.inf)
            before = verl_engine.local_params(engine)
            with count_collectives() as counts:
                try:
                    engine.optimizer_step()
                    outcome = None
                except Exception as error:  # torch's scaler with fused AdamW under FSDP2
                    outcome = f"raised: {str(error).splitlines()[0][:60]}"
            after = verl_engine.local_params(engine)
            stepped = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
            outcomes.append(outcome or ("stepped" if stepped else "skipped"))
            collectives.append(dict(counts))
            nan_params.append(any(not bool(torch.isfinite(p).all()) for p in after))
            scales.append(engine.scaler.get_scale())
    return {
        "rank": dist.get_rank(),
        "clean step": outcomes[0],
        "overflow step": outcomes[1],
        "nan_param": nan_params[-1],
        "scales": " -> ".join(f"{s:g}" for s in scales),
        "collectives": collectives,
    }


def _counts(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    detail = ", ".join(f"{n} {name.split('::')[-1]}" for name, n in sorted(counts.items()))
    return f"{total} ({detail})" if total else "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", help="where the tiny model is saved (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    verl_engine.prepare_verl_on_cpu()
    folder = args.folder or os.path.join(tempfile.gettempdir(), "shardscale-verl-demo")
    model_path = verl_engine.tiny_model(folder)
    rows = []
    for fused in (True, False):
        for scaler_name in ("torch", "shardscale"):
            results: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(results, run_case(model_path, scaler_name, fused))
            rows.append((scaler_name, fused, results))
    if dist.get_rank() == 0:
        print(
            "| scaler | AdamW | rank | clean step | step with an inf on rank 1 | NaN parameter "
            "after | scales | collectives per optimizer_step |"
        )
        print("|---|---|---:|---|---|---|---|---|")
        for scaler_name, fused, results in rows:
            for r in results:
                print(
                    f"| {scaler_name} | {'fused' if fused else 'for-loop'} | {r['rank']} | "
                    f"{r['clean step']} | {r['overflow step']} | "
                    f"{'YES' if r['nan_param'] else 'no'} | {r['scales']} | "
                    f"{' / '.join(_counts(c) for c in r['collectives'])} |"
                )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()  # past torch's C++ teardown, which may abort at exit (_common.py)
