"""Weight sync: the time a weight update takes to publish-to-serve, vs a raw copy.

A GLM-5-architecture model of a few hundred MB (bigger than the tiny preset, so fixed
costs do not hide the copy) is served by the embedded engine, which keeps decoding a
batch of requests throughout. The "trainer" publishes new weights, then each update is
timed in its two parts: the caller's (mapping and checking the file while the engine
decodes) and the engine's (applying the weights in the gap between two decode steps,
while it does not decode). Their sum is the update's time. The wait for that gap (the
rest of the decode step in flight when the call comes, anywhere from zero to one step)
is reported apart, as is the call-to-serving time that includes it: it depends on where
in a step the call lands, not on the channel. The first step with adopted weights is
also timed against the next one, so a slow first step after the swap would show
(``shm_first_step_vs_next``). The floor is the raw copy of the same bytes, tensor by
tensor, from memory into the model's parameters, measured in the same run.

Channels: ``shm`` (one safetensors file in /dev/shm, the co-located channel) and
``filesystem`` (an HF checkpoint directory written by the adapter, as a trainer on
another node would). ``ratio_to_copy`` is the shm channel's.

    python bench/weight_sync.py        # final line: {"ratio_to_copy": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def build_models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The served model (seed 0) and the "trained" one (seed 1) of the bench's shape."""
    from primerl_glm5.model import Glm5Config, Glm5ForCausalLM
    from primerl_glm5.presets import preset_config

    hf = {**preset_config("tiny"), "hidden_size": args.hidden, "num_hidden_layers": args.layers,
          "n_routed_experts": args.experts, "moe_intermediate_size": args.hidden, "intermediate_size": 2 * args.hidden,
          "q_lora_rank": args.hidden // 2, "kv_lora_rank": args.hidden // 4}
    hf.pop("indexer_types", None), hf.pop("mlp_layer_types", None), hf.pop("index_topk_pattern", None)

    def build(seed: int) -> Glm5ForCausalLM:
        m = Glm5ForCausalLM(Glm5Config.from_hf(hf))
        m.init_weights(seed)
        return m.eval()

    return build(0), build(1)


class Updates:
    """Times weight updates into a decoding engine: each part, and the first steps after."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.times: dict[str, list[dict[str, float]]] = {}
        self.step_ratios: dict[str, list[float]] = {}

    def run(self, label: str, prepare: Callable[[], Callable[[], object]]) -> None:
        """``prepare`` runs in the caller while the engine decodes and returns what runs in the
        engine's step gap. Records the update's time (caller's part + the gap's), the wait for
        the gap and the call-to-serving time; then waits for two steps on the new weights and
        records the first one's time over the second's (page faults after adopting)."""
        engine, before, marks = self.engine, self.engine.version, {}
        t0 = time.perf_counter()
        in_gap = prepare()
        t_call = time.perf_counter()

        def apply() -> object:
            marks["gap"] = time.perf_counter()
            return in_gap()

        engine.update_weights(apply)  # returns once the weights are in place, between two steps
        gap = engine.stats.last_update_seconds  # the engine's time in the gap: applying, forgetting prefixes
        self.times.setdefault(label, []).append({
            "update": t_call - t0 + gap, "wait": marks["gap"] - t_call, "served": marks["gap"] + gap - t0})
        steps = []
        for k in (1, 2):
            while not any(sum(v > before for v in s.versions) >= k for s in list(engine.running)):
                time.sleep(0.0002)
            steps.append(time.perf_counter())
        first = steps[0] - (marks["gap"] + gap)
        self.step_ratios.setdefault(label, []).append(first / max(steps[1] - steps[0], 1e-9))

    def best(self, label: str, part: str = "update") -> float:
        return min(t[part] for t in self.times[label])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from primerl_embedded.engine import Engine, SamplingParams

    from primerl.registry import get_registry
    from primerl.weights import adopt, apply, stage, write_safetensors

    torch.set_grad_enabled(False)
    model, trained = build_models(args)
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
    updates = Updates(engine)
    shm_dir = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    disk_dir = Path(tempfile.mkdtemp())
    try:
        shm_file = shm_dir / "weights.safetensors"
        t_publish_shm = timed(lambda: write_safetensors(trained.state_dict(), shm_file))
        for _ in range(args.repeats):  # what the server's admin call does for a file in /dev/shm: map and
            # validate while the engine decodes, then adopt the mapped tensors in its step gap
            updates.run("shm", lambda: partial(adopt, stage(model, shm_file, writable=True)))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())
        for _ in range(args.repeats):  # the same file copied into the parameters instead (what a GPU engine must do)
            updates.run("copy", lambda: partial(apply, stage(model, shm_file)))
        t_publish_fs = timed(lambda: adapter.save_checkpoint(trained, disk_dir / "step_1"))
        for _ in range(args.repeats):  # the adapter reads, converts and copies, all in the gap
            updates.run("filesystem", lambda: partial(adapter.load_checkpoint, model, disk_dir / "step_1"))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())
        versions = engine.version
    finally:
        engine.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    report(updates, nbytes, t_copy, t_publish_shm, t_publish_fs, versions)


def report(updates: Updates, nbytes: int, t_copy: float, t_publish_shm: float, t_publish_fs: float,
           versions: int) -> None:
    mb, ms = nbytes / 2**20, lambda s: round(s * 1e3, 1)
    t_shm, t_shm_copy, t_fs = (updates.best(c) for c in ("shm", "copy", "filesystem"))
    waits = [t["wait"] for ts in updates.times.values() for t in ts]
    print(f"model: {mb:.0f} MiB; raw copy {t_copy * 1e3:.0f} ms ({mb / t_copy / 1024:.1f} GiB/s)")
    print(f"shm: publish {t_publish_shm * 1e3:.0f} ms, update {t_shm * 1e3:.0f} ms "
          f"(copying instead of adopting: {t_shm_copy * 1e3:.0f} ms)")
    print(f"filesystem: publish {t_publish_fs * 1e3:.0f} ms, update {t_fs * 1e3:.0f} ms")
    print(f"wait for the step gap: {[ms(w) for w in waits]} ms")
    print(json.dumps({"bench": "weight_sync", "mib": round(mb), "updates_applied": versions,
                      "copy_ms": ms(t_copy), "shm_ms": ms(t_shm), "filesystem_ms": ms(t_fs),
                      "shm_copy_ms": ms(t_shm_copy), "shm_served_ms": ms(updates.best("shm", "served")),
                      "gap_wait_ms": ms(statistics.median(waits)),
                      "shm_first_step_vs_next": round(min(updates.step_ratios["shm"]), 2),
                      "ratio_to_copy": round(t_shm / t_copy, 2),
                      "filesystem_ratio_to_copy": round(t_fs / t_copy, 2)}))


if __name__ == "__main__":
    main()
