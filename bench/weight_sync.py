"""Weight sync: time from new weights published to the engine serving them, vs a raw copy.

A GLM-5-architecture model of a few hundred MB (bigger than the tiny preset, so fixed
costs do not hide the copy) is served by the embedded engine, which keeps decoding a
batch of requests throughout. The "trainer" publishes new weights, then the update call
is timed until the engine has applied them between two decode steps and reports the
new version, which happens in the gap between two decode steps (the wait for that gap
is included). The first step with adopted weights is also timed against the next one, so
a slow first step after the swap would show (``shm_first_step_vs_next``). The floor is the raw copy of the same bytes, tensor by tensor, from memory
into the model's parameters, measured in the same run.

Channels: ``shm`` (one safetensors file in /dev/shm, the co-located channel) and
``filesystem`` (an HF checkpoint directory written by the adapter, as a trainer on
another node would). ``ratio_to_copy`` is the shm channel's.

    python bench/weight_sync.py        # final line: {"ratio_to_copy": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import torch


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from primerl_embedded.engine import Engine, SamplingParams
    from primerl_glm5.model import Glm5Config, Glm5ForCausalLM
    from primerl_glm5.presets import preset_config

    from primerl.registry import get_registry
    from primerl.weights import adopt, apply, stage, write_safetensors

    torch.set_grad_enabled(False)
    hf = {**preset_config("tiny"), "hidden_size": args.hidden, "num_hidden_layers": args.layers,
          "n_routed_experts": args.experts, "moe_intermediate_size": args.hidden, "intermediate_size": 2 * args.hidden,
          "q_lora_rank": args.hidden // 2, "kv_lora_rank": args.hidden // 4}
    hf.pop("indexer_types", None), hf.pop("mlp_layer_types", None), hf.pop("index_topk_pattern", None)

    def build(seed: int) -> Glm5ForCausalLM:
        m = Glm5ForCausalLM(Glm5Config.from_hf(hf))
        m.init_weights(seed)
        return m.eval()

    model, trained = build(0), build(1)
    nbytes = sum(t.numel() * t.element_size() for t in trained.state_dict().values())
    adapter = get_registry().load("model", "glm5")()

    # raw copy floor: the same bytes, memory to parameters
    targets = model.state_dict()
    source = {k: v.clone() for k, v in trained.state_dict().items()}
    t_copy = min(timed(lambda: [targets[k].copy_(v) for k, v in source.items()]) for _ in range(args.repeats))
    model.init_weights(0)

    engine = Engine(model, eos_token_ids=[0], max_batch_size=8, max_model_len=4096, kv_slots=8)
    engine.start()
    for i in range(8):  # keep decoding during the updates
        engine.submit([5 + i] * 8, SamplingParams(max_tokens=4000, temperature=1.0, ignore_eos=True))

    step_times: dict[str, list[float]] = {}

    def until_serving(update, label: str) -> float:
        """Seconds from the call until the engine serves the new weights (its next step uses
        them). Also records the first step with them against the one after, so a slow first
        step (page faults after adopting mapped tensors) would show."""
        before = engine.version
        t0 = time.perf_counter()
        update()  # returns once the weights are in place, between two steps
        t1 = time.perf_counter()
        marks = []
        for k in (1, 2):
            while not any(sum(v > before for v in s.versions) >= k for s in list(engine.running)):
                time.sleep(0.0002)
            marks.append(time.perf_counter())
        step_times.setdefault(label, []).append((marks[0] - t1) / max(marks[1] - marks[0], 1e-9))
        return t1 - t0

    shm_dir = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    disk_dir = Path(tempfile.mkdtemp())
    try:
        shm_file = shm_dir / "weights.safetensors"
        t_publish_shm = timed(lambda: write_safetensors(trained.state_dict(), shm_file))
        # what the server's admin call does for a file in /dev/shm: map + validate while the
        # engine decodes, then adopt the mapped tensors in its step gap
        t_shm = min(until_serving(lambda: engine.update_weights(partial(adopt, stage(model, shm_file, writable=True))),
                                  "shm") for _ in range(args.repeats))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())
        # the same file copied into the parameters instead (what a GPU engine must do)
        t_shm_copy = min(until_serving(lambda: engine.update_weights(partial(apply, stage(model, shm_file))), "copy")
                         for _ in range(args.repeats))
        t_publish_fs = timed(lambda: adapter.save_checkpoint(trained, disk_dir / "step_1"))
        t_fs = min(until_serving(lambda: engine.update_weights(lambda: adapter.load_checkpoint(model, disk_dir / "step_1")),
                                 "filesystem") for _ in range(args.repeats))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())
        versions = engine.version
    finally:
        engine.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)

    mb = nbytes / 2**20
    print(f"model: {mb:.0f} MiB; raw copy {t_copy * 1e3:.0f} ms ({mb / t_copy / 1024:.1f} GiB/s)")
    print(f"shm: publish {t_publish_shm * 1e3:.0f} ms, published->serving {t_shm * 1e3:.0f} ms "
          f"(copying instead of adopting: {t_shm_copy * 1e3:.0f} ms)")
    print(f"filesystem: publish {t_publish_fs * 1e3:.0f} ms, published->serving {t_fs * 1e3:.0f} ms")
    print(json.dumps({"bench": "weight_sync", "mib": round(mb), "updates_applied": versions,
                      "copy_ms": round(t_copy * 1e3, 1), "shm_ms": round(t_shm * 1e3, 1),
                      "filesystem_ms": round(t_fs * 1e3, 1), "shm_copy_ms": round(t_shm_copy * 1e3, 1),
                      "shm_first_step_vs_next": round(min(step_times["shm"]), 2),
                      "ratio_to_copy": round(t_shm / t_copy, 2),
                      "filesystem_ratio_to_copy": round(t_fs / t_copy, 2)}))


if __name__ == "__main__":
    main()
