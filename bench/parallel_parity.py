"""Parallel layouts against one process: the same RL step's loss and gradients.

What: for each model's tiny preset (glm5, kimi, nemotron, qwen3-moe), one ``rl_step`` of
the trainer's own code over a fixed batch (packed rows with several samples, padding,
router replay for MoE models) in one process, and on gloo ranks with each layout:

* ``fsdp``: 2 ranks, FSDP2 over ``dp_shard`` (rows split, parameters sharded);
* ``ep``: 2 ranks, ``dp_shard 2 x ep 2`` (routed experts split, tokens dispatched);
* ``cp``: 2 ranks, ``cp 2`` (each row's tokens split, attention over the whole row);
* ``fsdp+ep+cp``: 4 ranks, ``dp_shard 2 x cp 2``, ``ep 2``.

Reports the largest relative error of the loss and of any parameter's full gradient
(FSDP gradients all-gathered, expert gradients gathered over the ep group) per layout,
over the models that support it; a model that refuses a layout (Nemotron's Mamba-2
layers cannot be split by context parallel) is listed with its one-line reason. The
target: every error below 1e-4.

    python bench/parallel_parity.py [--models glm5,kimi] [--layouts fsdp,ep]

Final JSON line: ``{"max_rel_err": {"fsdp": .., "ep": .., "cp": .., "fsdp+ep+cp": ..}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import time

LAYOUTS = {
    "fsdp": (2, {"dp_shard": 2}),
    "ep": (2, {"dp_shard": 2, "ep": 2}),
    "cp": (2, {"dp_shard": 1, "cp": 2}),
    "fsdp+ep+cp": (4, {"dp_shard": 2, "cp": 2, "ep": 2}),
}
MODELS = ("glm5", "kimi", "nemotron", "qwen3-moe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()

    from primerl_fsdp.parity import max_rel_err, step_on_layout
    from primerl_fsdp.ranks import run_on_ranks

    t0 = time.time()
    errors: dict[str, dict[str, float]] = {layout: {} for layout in args.layouts.split(",")}
    refused: dict[str, str] = {}
    for model in args.models.split(","):
        reference = run_on_ranks(1, step_on_layout, model, {}, True)[0]
        for layout in errors:
            ranks, parallel = LAYOUTS[layout]
            try:
                result = run_on_ranks(ranks, step_on_layout, model, parallel, True)[0]
            except RuntimeError as exc:
                reason = next((ln for ln in str(exc).splitlines()[::-1] if "PrimerlError" in ln), None)
                if reason is None:
                    raise
                refused[f"{model}/{layout}"] = reason.split("PrimerlError: ", 1)[-1]
                print(f"{model:10s} {layout:11s} refused: {refused[f'{model}/{layout}']}", flush=True)
                continue
            errors[layout][model] = max_rel_err(reference, result)
            print(f"{model:10s} {layout:11s} {ranks} ranks  max rel err {errors[layout][model]:.2e}  "
                  f"loss {result['loss']:.6f} (one process {reference['loss']:.6f})  [{time.time() - t0:.0f}s]",
                  flush=True)
    summary = {layout: max(per_model.values()) if per_model else None for layout, per_model in errors.items()}
    print(json.dumps({"max_rel_err": summary, "per_model": errors, "refused": refused,
                      "seconds": round(time.time() - t0)}))


if __name__ == "__main__":
    main()
