"""The pieces of a trainer step, one by one: the step's normalisers, one forward's loss record
and loss (the correction first), the figures gathered over forwards and ranks, and the
metrics.jsonl line a step writes."""

import random

import pytest
import torch

from primerl.algorithms import build_correction, build_loss
from primerl.samples import RolloutBatch, Sample
from primerl.trainer.main import StepTimes, load_parallelism, step_record
from primerl.trainer.packing import pack
from primerl.trainer.step import StepMetrics, StepTotals, forward_loss, loss_inputs


def _samples():
    rng = random.Random(0)
    out = []
    for prompt, completion in ((3, 4), (2, 1), (5, 0), (1, 6)):  # the third has no loss token
        n = prompt + completion
        out.append(Sample(tokens=[rng.randrange(50) for _ in range(n)], loss_mask=[0] * prompt + [1] * completion,
                          logprobs=[0.0] * prompt + [-rng.random() for _ in range(completion)],
                          advantage=rng.uniform(-1, 1)))
    return out


def test_the_step_totals_count_loss_tokens_per_sample_and_the_samples_that_have_any():
    totals = StepTotals.of(pack(_samples(), seq_len=16))
    assert totals.loss_tokens == 11 and totals.samples == 3
    assert totals.per_sample.tolist() == [4.0, 1.0, 0.0, 6.0]


def test_one_forwards_record_and_loss_with_and_without_a_correction():
    packed = pack(_samples(), seq_len=16)
    totals = StepTotals.of(packed)
    row = packed.rows(0, packed.num_rows)
    real = row["sample_index"] >= 0
    mask = row["loss_mask"] & real
    own = (row["inference_logprobs"] + 0.1 * mask).requires_grad_()  # the trainer moved a little
    x = loss_inputs(row, own, mask, real, totals, max_tokens=8, corrected=False)
    assert x.logprobs.shape == x.sample_ids.shape == (int(real.sum()),) and x.step_loss_tokens == 11
    assert torch.equal(x.old_logprobs, x.inference_logprobs)  # the ratio against the engine
    loss, metrics = forward_loss(x, build_loss("default"), None)
    assert set(metrics) == {"mismatch_kl", "masked_fraction"}
    k3 = (torch.tensor(0.1).exp() - 0.1 - 1) * 11  # every loss token 0.1 apart: k3 summed
    assert float(metrics["mismatch_kl"]) == pytest.approx(float(k3), rel=1e-5)
    corrected = loss_inputs(row, own, mask, real, totals, max_tokens=8, corrected=True)
    assert torch.equal(corrected.old_logprobs, corrected.logprobs.detach())
    _, metrics = forward_loss(corrected, build_loss("default"), build_correction("tis", {"cap": 1.05}))
    assert {"is_weight/mean", "is_weight/max", "is_masked_fraction", "mismatch_kl"} <= set(metrics)
    assert float(metrics["is_weight/max"]) == pytest.approx(1.05)  # rho = e^0.1 = 1.105, truncated
    loss.backward()
    assert own.grad is not None and bool(own.grad[mask].ne(0).any())


def test_the_step_metrics_add_over_forwards_and_divide_by_the_steps_loss_tokens():
    m = StepMetrics()
    m.add(torch.tensor(0.5), {"masked_fraction": 2.0, "is_weight/max": 1.5})
    m.add(torch.tensor(0.25), {"masked_fraction": 1.0, "is_weight/max": 1.2})
    own = torch.tensor([[[[0, 1]], [[2, 3]]]])  # [k=1, m=2, L=1, top_k=2]
    m.add_routing(own, torch.tensor([[[[1, 0]], [[2, 4]]]]), torch.tensor([[True, True]]))
    stats = m.totals(load_parallelism("single"), loss_tokens=4.0, grad_norm=0.7)
    assert stats == {"masked_fraction": 0.75, "is_weight/max": 1.5, "mismatch_kl": 0.0, "loss": 0.75,
                     "grad_norm": 0.7, "routing_agreement": 0.5, "routing_agreement/layer_0": 0.5}


def test_a_steps_metrics_line_keeps_its_names_and_order():
    samples = _samples()
    packed = pack(samples, seq_len=16)
    batch = RolloutBatch(step=3, samples=samples, metrics={"reward/mean": 0.5, "dropped_stale": 0})
    times = StepTimes(waiting=1.0, started=1.5, publishing=2.5, ended=3.0, previous_end=0.5, checkpoint_s=0.2)
    record = step_record(3, batch, packed, {"masked_fraction": 0.0, "loss": 0.1, "grad_norm": 1.0}, 1e-3, times)
    assert list(record) == [
        "reward/mean", "dropped_stale", "step", "policy_version", "masked_fraction", "loss", "grad_norm", "lr",
        "time/step", "throughput/sampled_tokens_per_s", "time/train", "time/wait", "time/publish", "time/checkpoint",
        "time/end", "trainer/tokens_per_s", "trainer/tokens", "trainer/shared_tokens", "trainer/loss_tokens",
        "trainer/rows"]
    assert (record["time/step"], record["time/train"], record["time/wait"], record["time/publish"]) == (2.5, 1.5, 0.5, 0.5)
    assert record["throughput/sampled_tokens_per_s"] == 11 / 2.5 and record["trainer/loss_tokens"] == 11
    assert record["trainer/shared_tokens"] == 0 and record["time/checkpoint"] == 0.2
    first = StepTimes(waiting=1.0, started=1.5, publishing=2.5, ended=3.0, previous_end=None, checkpoint_s=0.0)
    assert first.wall == 2.0  # the first step of a process: from its wait
