"""HF checkpoint directories <-> primerl models, through a declarative, invertible name map.

A checkpoint is ``config.json`` plus ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (and tokenizer files). It is read one shard at a time,
one tensor at a time, straight into the model's parameters: the whole checkpoint is
never materialised, and no HF model is built.

Our models keep HF's *in-memory* names (transformers v5 state dicts), which differ from
the *published* layout in two declarative ways, each described by a :class:`HFFormat`:

* prefixes: Nemotron-H ships ``backbone.`` where the model says ``model.``; renames inside
  a name: MiniMax-M2 ships ``.block_sparse_moe.`` where the model says ``.mlp.``;
* fused experts: the model holds each MoE layer's experts as 3D tensors
  (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) while
  checkpoints hold one linear per expert and projection (``experts.{e}.gate_proj.weight``
  ...). :class:`FusedExperts` names the parts, in the order they are stacked.

:func:`to_hf` and :func:`from_hf` are inverse: a round trip is bit-exact (tested). The
loader also accepts the fused layout as is, and skips layers past ``num_layers`` (GLM-5
and DeepSeek ship multi-token-prediction layers after the last decoder layer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "FusedExperts",
    "HFFormat",
    "fp8_block_size",
    "has_chat_template",
    "load_checkpoint",
    "read_config",
    "save_checkpoint",
    "shard_files",
    "to_hf",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@attrs.frozen
class FusedExperts:
    """A fused 3D expert tensor ``<...>.experts.<param>`` [E, sum(rows of parts), in] and the
    per-expert linears it is stacked from, ``<...>.experts.{e}.<part>.weight``, in order."""

    param: str
    parts: tuple[str, ...]


@attrs.frozen
class HFFormat:
    """How a model's state-dict names map to its published HF checkpoint names."""

    prefixes: tuple[tuple[str, str], ...] = ()  # (published, model) prefix pairs
    renames: tuple[tuple[str, str], ...] = ()  # (published, model) pairs of parts inside a name
    experts: tuple[FusedExperts, ...] = (
        FusedExperts("gate_up_proj", ("gate_proj", "up_proj")),
        FusedExperts("down_proj", ("down_proj",)),
    )
    layer_pattern: str = r"(?:model|backbone)\.layers\.(\d+)\."

    def to_model_name(self, name: str) -> str:
        for published, ours in self.prefixes:
            if name.startswith(published):
                name = ours + name[len(published):]
                break
        for published, ours in self.renames:
            name = name.replace(published, ours)
        return name

    def to_published_name(self, name: str) -> str:
        for published, ours in self.prefixes:
            if name.startswith(ours):
                name = published + name[len(ours):]
                break
        for published, ours in self.renames:
            name = name.replace(ours, published)
        return name

    def expert_key(self) -> re.Pattern[str]:
        parts = "|".join(sorted({p for f in self.experts for p in f.parts}))
        return re.compile(rf"(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<part>{parts})\.weight")


def to_hf(state: Iterable[tuple[str, Any]], fmt: HFFormat, *, skip: tuple[str, ...] = ()
          ) -> Iterator[tuple[str, Any]]:
    """(published name, tensor) of a model state dict's items: fused experts split into
    per-expert views (no copies), prefixes renamed. ``skip``: names to leave out (a tied lm_head)."""
    fused = {f.param: f for f in fmt.experts}
    for name, t in state:
        if name in skip:
            continue
        head, _, param = name.rpartition(".")
        spec = fused.get(param) if head.endswith(".experts") and t.dim() == 3 else None
        if spec is None:
            yield fmt.to_published_name(name), t
            continue
        pieces = t.chunk(len(spec.parts), dim=1)  # [E, rows, in] each
        for e in range(t.shape[0]):
            for part, piece in zip(spec.parts, pieces, strict=True):
                yield fmt.to_published_name(f"{head}.{e}.{part}.weight"), piece[e]


def shard_files(directory: Path) -> list[Path]:
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / WEIGHTS_NAME).exists():
        return [directory / WEIGHTS_NAME]
    raise FileNotFoundError(f"{directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def read_config(directory: str | Path, model_type: str | tuple[str, ...]) -> dict[str, Any]:
    """A checkpoint's ``config.json``, checked to be of ``model_type`` (or one of them)."""
    allowed = (model_type,) if isinstance(model_type, str) else model_type
    path = Path(directory) / CONFIG_NAME
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {directory} has no {CONFIG_NAME}") from None
    if hf.get("model_type") not in allowed:
        raise ValueError(f"{path} is a {hf.get('model_type')!r} model, not {' or '.join(allowed)}")
    return hf


def has_chat_template(directory: str | Path) -> bool:
    """Whether a checkpoint's tokenizer carries a chat template (``chat_template`` in
    ``tokenizer_config.json``, or ``chat_template.jinja`` / ``chat_template.json``)."""
    d = Path(directory)
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def fp8_block_size(hf: dict[str, Any]) -> int | None:
    """The block size of a block-FP8 checkpoint (``quantization_config``), or None."""
    q = hf.get("quantization_config") or {}
    if not q:
        return None
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(
            f"quantization {q.get('quant_method')!r} is not supported: dequantise the checkpoint to bf16 "
            "first (block-scaled FP8 e4m3, DeepSeek's format, is read directly)"
        )
    rows, cols = q.get("weight_block_size", [128, 128])
    if rows != cols:
        raise ValueError(f"FP8 weight_block_size {[rows, cols]} is not square")
    return int(rows)


def load_checkpoint(model: Any, directory: str | Path, fmt: HFFormat, *, num_layers: int,
                    tied: bool = False, fp8_block: int = 128) -> None:
    """Copy an HF checkpoint into ``model`` shard by shard (strict: every tensor once).

    Tensors are cast to the dtype of the parameter they fill and moved to its device.
    Block-FP8 weights (``X.weight`` float8_e4m3fn with ``X.weight_scale_inv``) are
    dequantised as they are read. ``tied``: the model's ``lm_head.weight`` is the
    embedding and need not be in the file.
    """
    directory = Path(directory)
    files = shard_files(directory)
    load = _CheckpointLoad(model, fmt, num_layers=num_layers, tied=tied, fp8_block=fp8_block,
                           scales=_fp8_scales(files))
    for path in files:
        load.shard(path)
    load.check(directory)


def _fp8_scales(files: list[Path]) -> dict[str, Any]:
    """Every ``*_scale_inv`` tensor of the shards: FP8 scales are tiny (1/16384 of their
    weight), so they are read first and kept."""
    from safetensors import safe_open

    scales: dict[str, Any] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key.endswith("_scale_inv"):
                    scales[key] = f.get_tensor(key)
    return scales


class _CheckpointLoad:
    """One :func:`load_checkpoint`: the model's tensors to fill and what has been filled."""

    def __init__(self, model: Any, fmt: HFFormat, *, num_layers: int, tied: bool, fp8_block: int,
                 scales: dict[str, Any]) -> None:
        self.fmt, self.num_layers, self.fp8_block, self.scales = fmt, num_layers, fp8_block, scales
        self.used_scales: set[str] = set()
        self.targets: dict[str, Any] = dict(model.state_dict(keep_vars=True))
        self.required = set(self.targets) - ({"lm_head.weight"} if tied else set())
        self.filled: set[str] = set()
        self.parts_seen: dict[str, set[tuple[int, str]]] = {}  # fused param -> {(expert, part)}
        self.unexpected: list[str] = []
        self.layer_key, self.expert_key = re.compile(fmt.layer_pattern), fmt.expert_key()

    def past_last_layer(self, key: str) -> bool:
        """A multi-token-prediction layer's tensor (after the last decoder layer): not part of the model."""
        layer = self.layer_key.match(key)
        return bool(layer) and int(layer.group(1)) >= self.num_layers

    def read(self, f: Any, key: str) -> Any:
        """The tensor ``key`` of the open shard ``f``, dequantised when it is block-FP8."""
        import torch

        from primerl.models.fp8 import FP8, dequantize_blockwise

        t = f.get_tensor(key)
        if t.dtype == FP8:
            scale = key + "_scale_inv"
            if scale not in self.scales:
                raise ValueError(f"{key} is float8 but the checkpoint has no {scale}")
            self.used_scales.add(scale)
            return dequantize_blockwise(t, self.scales[scale], torch.float32, self.fp8_block)
        return t

    @staticmethod
    def copy(name: str, dst: Any, src: Any) -> None:
        import torch

        if dst.shape != src.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src)

    def shard(self, path: Path) -> None:
        """Every tensor of one shard file into its place (a parameter, or an expert's rows of
        a fused one)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key in self.scales or self.past_last_layer(key):
                    continue
                name = self.fmt.to_model_name(key)
                if name in self.targets:
                    self.copy(key, self.targets[name], self.read(f, key))
                    self.filled.add(name)
                elif not self.expert(f, key, name):
                    self.unexpected.append(key)

    def expert(self, f: Any, key: str, name: str) -> bool:
        """One expert's linear ``...experts.{e}.<part>.weight`` into its rows of the fused
        3D tensor; False when ``name`` is no such part of the model."""
        m = self.expert_key.fullmatch(name)
        spec = next((s for s in self.fmt.experts if m and m["part"] in s.parts
                     and f"{m['prefix']}.{s.param}" in self.targets), None)
        if spec is None:
            return False
        target = f"{m['prefix']}.{spec.param}"
        e, part = int(m["expert"]), m["part"]
        dst = self.targets[target][e]  # [sum of part rows, in]
        rows = dst.shape[0] // len(spec.parts)
        i = spec.parts.index(part)
        self.copy(key, dst[i * rows:(i + 1) * rows], self.read(f, key))
        self.parts_seen.setdefault(target, set()).add((e, part))
        return True

    def check(self, directory: Path) -> None:
        """Strict: every tensor of the model filled, every tensor of the file used."""
        fused = {f.param: f for f in self.fmt.experts}
        for target, seen in self.parts_seen.items():
            spec = fused[target.rpartition(".")[2]]
            if seen == {(e, p) for e in range(self.targets[target].shape[0]) for p in spec.parts}:
                self.filled.add(target)
        unexpected = self.unexpected + sorted(k for k in set(self.scales) - self.used_scales
                                              if not self.past_last_layer(k))
        missing = sorted(self.required - self.filled)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {directory} does not match the model: "
                f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
            )


def save_checkpoint(model: Any, directory: str | Path, hf_config: dict[str, Any], fmt: HFFormat | None, *,
                    tokenizer: Any = None, tied: bool = False, max_shard_bytes: int = 5 * 2**30,
                    state: Iterable[tuple[str, Any]] | None = None,
                    published: Iterable[tuple[str, Any]] | None = None) -> Path:
    """Write ``model`` as an HF checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads.

    ``config.json`` (``hf_config`` with the model's dtype), ``model.safetensors`` (or shards
    of at most ``max_shard_bytes`` with ``model.safetensors.index.json``) and, when given,
    the tokenizer's files. Returns the directory.

    ``state``: the ``(name, tensor)`` pairs to write, in ``model.state_dict()``'s names,
    instead of the model's own: a sharded trainer passes the tensors it gathers unit by
    unit, and each shard file is written as soon as it is full, so no more than one shard
    and one unit are held at once.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = {**hf_config, "dtype": str(model.dtype).removeprefix("torch.")}
    hf.pop("torch_dtype", None)
    hf.pop("quantization_config", None)  # we write plain (dequantised) weights
    if tokenizer is not None:
        ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
               "bos_token_id": tokenizer.bos_token_id}  # an HF tokenizer's special ids (None: it has none)
        for key, value in ids.items():
            if hf.get(key) is None and value is not None:
                hf[key] = value
    (directory / CONFIG_NAME).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")

    for stale in [directory / INDEX_NAME, *directory.glob("model-*-of-*.safetensors"), directory / WEIGHTS_NAME]:
        stale.unlink(missing_ok=True)
    # Shards in order, each under max_shard_bytes (a larger tensor gets a shard of its own),
    # written as they fill; named model-i-of-N once N is known.
    written: list[tuple[Path, list[str]]] = []
    pending: dict[str, Any] = {}
    size = total = 0

    def flush() -> None:
        nonlocal size
        if pending:
            path = directory / f".shard-{len(written) + 1:05d}.safetensors"
            save_file(pending, str(path), metadata={"format": "pt"})
            written.append((path, list(pending)))
            pending.clear()
        size = 0

    if published is None:
        pairs = model.state_dict().items() if state is None else state
        published = to_hf(pairs, fmt, skip=("lm_head.weight",) if tied else ())
    for name, t in published:
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > max_shard_bytes:
            flush()
        pending[name] = t.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    flush()

    weight_map: dict[str, str] = {}
    for i, (path, names) in enumerate(written):
        fname = WEIGHTS_NAME if len(written) == 1 else f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        path.rename(directory / fname)
        weight_map.update(dict.fromkeys(names, fname))
    if len(written) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory
