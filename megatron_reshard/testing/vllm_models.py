"""vLLM's own model classes on a CPU machine, per generation rank: the real-vLLM test fixture.

A generation rank here holds what a vLLM worker started with ``load_format="dummy"`` holds
before its first refit: vLLM's model class for the architecture, built under vLLM's own
parallel state (``init_distributed_environment`` + ``initialize_model_parallel`` over
gloo), filled by vLLM's dummy loader and post-processed by vLLM's
``process_weights_after_loading``. The oracle of the tests is a second instance on the same
rank, loaded by vLLM's ``load_weights`` from the full HF tensors and post-processed the same
way.

Every way in which this differs from a vLLM GPU worker is in ``_install_cpu_shims`` (one
place, each shim explained there):

- vLLM's CPU platform packs linear and expert weights after loading with kernels of
  ``vllm._C`` that the CUDA wheel lacks, and drops ``layer.weight``: a CPU inference layout
  that no refit can write into. The shims keep the canonical layout (what GPU backends
  hold for unquantized BF16 weights); the CPU experts keep vLLM's base post-load step (a
  no-op), which is how ``receiver.kernel_layouts`` tells them from vLLM's prepacking ones.
- MLA attention takes the portable ``CPU_MLA`` backend (hosts with AMX would pick
  ``AMX_MLA``, which packs ``W_UK``/``W_UV`` too). vLLM 0.25's CPU platform has no MLA
  backend: ``testing.vllm_oldest_shims`` builds its MLA layers, with the other 0.25-only
  differences of the tests (gpt-oss's stacked experts for the oracle).
- Each architecture's class is registered in-process: vLLM otherwise inspects every
  architecture once in a subprocess (10-22 s each on 2 cores) to keep CUDA out of the
  parent, which a CPU-only process does not need.
- vLLM 0.25's CPU MoE takes its older path (``UnquantizedFusedMoEMethod`` with
  ``cpu_fused_moe.CPUFusedMOE``, no ``CPUUnquantizedExperts``): without ``vllm._C``'s
  ``prepack_moe_weight`` (the CUDA wheel lacks it) and with ``VLLM_CPU_SGL_KERNEL`` off it
  keeps w13/w2 in checkpoint order and computes through views of them, so no shim is needed
  there (``receiver.kernel_layouts`` refuses the prepacking variants of that path).
- A FlashInfer unquantized MoE backend (``moe_backend="flashinfer_cutlass"`` /
  ``"flashinfer_trtllm"``, vLLM's ``--moe-backend``) is honoured on the CPU: vLLM's own
  backend choice would refuse it (no CUDA), so ``select_unquantized_moe_backend`` returns
  the requested backend, and the kernel object (CUDA code) is not built. Everything that
  decides the stored bytes is vLLM's own: the allocation with its padding
  (``maybe_roundup_sizes``) and the post-load conversion
  (``convert_to_unquantized_kernel_format``, FlashInfer's permutation helpers on CPU).

- vLLM's CPU platform is chosen through vLLM's own platform-plugin hook (entry-point group
  ``vllm.platform_plugins``; ``cpu_platform_plugin`` answers ``CpuPlatform`` when
  ``VLLM_TARGET_DEVICE=cpu``), declared by a metadata-only folder that
  ``set_vllm_cpu_environment`` puts on ``sys.path`` and ``PYTHONPATH``. vLLM 0.25 picks its
  CPU platform only for a CPU build (the installed version string holds "cpu") or macOS, and
  resolves the platform while ``import vllm`` runs: the CUDA wheel installed here would get
  ``UnspecifiedPlatform`` ("Failed to infer device type"). From 0.26 ``VLLM_TARGET_DEVICE``
  alone picks it; the plugin names the same class there.
- vLLM 0.34's x86 CPU platform refuses to configure without Triton
  (``CpuPlatform.check_and_update_config``: "vLLM on x86 CPUs requires Triton
  (triton-cpu)"; 0.33 and older only warned). triton-cpu is not on the package index, and
  nothing the tests run executes a Triton kernel (no forward pass: model classes are built,
  loaded and post-processed). That one check runs with ``vllm.triton_utils.HAS_TRITON``
  answered True, restored right after; every module that imported the flag keeps False
  (``cpu_platform_without_triton``, installed by ``set_vllm_cpu_environment``; nothing where
  the running vLLM has Triton).

- vLLM's Qwen3.5 module (``models/qwen3_5.py``, text classes and multimodal ones in one file)
  imports its vision model ``qwen3_vl``, which imports transformers'
  ``image_processing_qwen2_vl``, whose first lines run
  ``from torchvision.transforms.v2 import functional as tvF``. torchvision is not installed
  here (PyPI's wheel is CUDA-linked and does not load on this CPU torch). The import runs
  with that one module (and its parents) as empty stand-ins, removed again afterwards;
  ``tvF`` is used only inside the image processor's methods and string annotations, never
  by the text models, and transformers' "is torchvision available" answer (False) is
  cached before, so no other import takes a torchvision path. The text classes built and
  loaded are vLLM's own (``_vision_imports_without_torchvision``).

Imports vLLM lazily (inside functions): the module itself needs only torch.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import tempfile
from typing import Any, Mapping, Optional

import torch

from megatron_reshard.receiver.derived import DERIVED_ATTRIBUTES, mla_layers
from megatron_reshard.testing import vllm_oldest_shims as oldest_vllm

# architecture -> module of vllm.model_executor.models holding its class
ARCHITECTURE_MODULES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v2",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Qwen3NextForCausalLM": "qwen3_next",  # its Gated-DeltaNet layer imports compressed_tensors
    "Qwen3_5ForCausalLM": "qwen3_5",  # imported under _vision_imports_without_torchvision
    "Qwen3_5MoeForCausalLM": "qwen3_5",
}
_SHIMS_INSTALLED = False
CPU_EXPERTS_PREPACK = None  # vLLM's own post-load step of its CPU experts, kept aside by the shim
CPU_PLATFORM_CHECK = None  # vLLM's own CpuPlatform.check_and_update_config, kept aside by the shim


def set_vllm_cpu_environment() -> None:
    """Environment vLLM needs on a CPU-only machine, its CPU platform chosen through a
    platform plugin and configurable without triton-cpu (see the module docstring); call
    before the first vLLM import. Spawned processes and subprocesses inherit the first two."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # else: UnspecifiedPlatform
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    _declare_cpu_platform_plugin()
    try:  # every VllmConfig() of the process then configures the CPU platform (vLLM 0.34)
        cpu_platform_without_triton()
    except ModuleNotFoundError as exc:  # the main test venv: no vLLM
        if exc.name != "vllm":
            raise


# the entry-point group of vLLM's platform plugins (vllm.platforms.PLATFORM_PLUGINS_GROUP)
PLATFORM_PLUGINS_GROUP = "vllm.platform_plugins"
CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"
_PLUGIN_SITE = "MEGATRON_RESHARD_VLLM_CPU_PLUGIN_SITE"  # env: the folder, made once per run


def cpu_platform_plugin() -> Optional[str]:
    """vLLM's platform plugin hook: its CPU platform, when ``VLLM_TARGET_DEVICE=cpu``."""
    return CPU_PLATFORM if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" else None


def _declare_cpu_platform_plugin() -> None:
    """A folder holding only the metadata of a distribution that declares
    ``cpu_platform_plugin`` in ``PLATFORM_PLUGINS_GROUP``, on ``sys.path`` and
    ``PYTHONPATH`` (vLLM reads plugins through ``importlib.metadata``)."""
    site = os.environ.get(_PLUGIN_SITE)
    if site is None:
        site = tempfile.mkdtemp(prefix="vllm-cpu-platform-")
        info = os.path.join(site, "megatron_reshard_test_cpu_platform-0.0.dist-info")
        os.mkdir(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: megatron-reshard-test-cpu-platform\n"
                    "Version: 0.0\n")
        with open(os.path.join(info, "entry_points.txt"), "w") as f:
            f.write(f"[{PLATFORM_PLUGINS_GROUP}]\n"
                    f"megatron_reshard_test_cpu = {__name__}:cpu_platform_plugin\n")
        os.environ[_PLUGIN_SITE] = site
    if site not in sys.path:
        sys.path.append(site)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if site not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (*paths, site) if p)


def _install_cpu_shims() -> None:
    """The CPU-only deviations listed in the module docstring (idempotent)."""
    global _SHIMS_INSTALLED
    if _SHIMS_INSTALLED:
        return
    import torch.nn.functional as F
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.models.registry import ModelRegistry

    def keep_canonical_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        # vLLM would pack layer.weight for its CPU GEMM and (remove_weight) drop it
        layer.cpu_linear = lambda x, weight, bias=None: F.linear(x, weight, bias)

    layer_utils.dispatch_cpu_unquantized_gemm = keep_canonical_weight
    # the CPU experts would prepack w13/w2 into a kernel-specific layout: they keep vLLM's
    # base step instead (a no-op), which the receiver recognises as checkpoint order
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    global CPU_EXPERTS_PREPACK
    if hasattr(cpu_moe, "CPUUnquantizedExperts"):  # vLLM 0.25: the old CPU path, see above
        CPU_EXPERTS_PREPACK = cpu_moe.CPUUnquantizedExperts.process_weights_after_loading
        cpu_moe.CPUUnquantizedExperts.process_weights_after_loading = \
            FusedMoEExperts.process_weights_after_loading
    cpu_platform_without_triton()
    oldest_vllm.mla_without_cpu_backend()
    _honour_flashinfer_moe_backend()
    _honour_block_fp8_kernels()
    for arch, module in ARCHITECTURE_MODULES.items():
        with _vision_imports_without_torchvision():
            cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), arch)
        ModelRegistry.register_model(arch, cls)
    _SHIMS_INSTALLED = True


def cpu_platform_without_triton() -> None:
    """Let vLLM's CPU platform configure a ``VllmConfig`` without triton-cpu (see the module
    docstring); idempotent, and nothing where Triton is there."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    global CPU_PLATFORM_CHECK
    check = CpuPlatform.check_and_update_config
    if triton_utils.HAS_TRITON or getattr(check, "without_triton", False):
        return
    CPU_PLATFORM_CHECK = check

    def check_without_triton(cls, vllm_config) -> None:
        triton_utils.HAS_TRITON = True
        try:
            check.__func__(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    check_without_triton.without_triton = True
    CpuPlatform.check_and_update_config = classmethod(check_without_triton)


# the torchvision modules transformers' Qwen2-VL image processor imports at module level
TORCHVISION_STAND_INS = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                         "torchvision.transforms.v2.functional")


@contextlib.contextmanager
def _vision_imports_without_torchvision():
    """Empty stand-ins for ``TORCHVISION_STAND_INS`` while vLLM's Qwen3.5 module imports (see
    the module docstring); nothing when torchvision imports or is already imported."""
    import importlib.machinery
    import types

    try:
        importlib.import_module("torchvision")
    except ImportError:  # not installed (this machine); a broken install raises on, unchanged
        pass
    else:
        yield
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # caches False before the stand-ins exist
    import_utils.is_torchvision_v2_available()
    added = []
    for name in TORCHVISION_STAND_INS:
        if name in sys.modules:
            continue
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        sys.modules[name] = module
        added.append(name)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


# vLLM's --moe-backend values whose conversion runs on the CPU (FlashInfer's helpers do)
CPU_FLASHINFER_MOE_BACKENDS = ("flashinfer_cutlass", "flashinfer_trtllm")


class _NoCudaKernel:
    """Stands for the FlashInfer MoE kernel object, which needs CUDA to build; the
    post-load step only asks its experts to finish loading (a no-op for FlashInfer)."""

    class fused_experts:  # noqa: N801 (vLLM's attribute name)
        consumes_expert_mask = False

        @staticmethod
        def process_weights_after_loading(layer) -> None:
            return None

        @staticmethod
        def keep_constants(layer) -> None:  # vLLM 0.34: no kernel built, nothing it allocated
            return None


class _NoCudaExperts:
    """The kernel class the shim gives vLLM's online FP8 MoE methods for a backend it chose
    (their post-load step asserts one); ``make_fp8_moe_kernel`` then builds ``_NoCudaKernel``."""


def _honour_flashinfer_moe_backend() -> None:
    """Let ``UnquantizedFusedMoEMethod`` take a FlashInfer backend on the CPU (see the
    module docstring); other backends go through vLLM's own choice unchanged."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle

    if not hasattr(method.UnquantizedFusedMoEMethod, "_init_moe_kernel"):
        return  # vLLM 0.25: the FlashInfer-on-CPU checks run on the newest vLLM only
    choose = method.select_unquantized_moe_backend
    build = method.UnquantizedFusedMoEMethod._init_moe_kernel
    flashinfer = {oracle.UnquantizedMoeBackend.FLASHINFER_CUTLASS,
                  oracle.UnquantizedMoeBackend.FLASHINFER_TRTLLM}

    def select(moe_config):
        if moe_config.moe_backend in CPU_FLASHINFER_MOE_BACKENDS:
            return oracle.map_unquantized_backend(moe_config.moe_backend), None
        return choose(moe_config)

    def init_kernel(self, layer) -> None:
        if self.unquantized_backend in flashinfer:
            self.moe_quant_config = self.get_fused_moe_quant_config(layer)
            self.moe_kernel = _NoCudaKernel()
            return
        build(self, layer)

    method.select_unquantized_moe_backend = select
    method.UnquantizedFusedMoEMethod._init_moe_kernel = init_kernel


# vLLM's block-FP8 linear kernel a GPU worker would pick, by class name (the CPU shim builds
# it directly: vLLM's choice on this CPU finds none, its AMX kernel needing Sapphire Rapids)
FP8_LINEAR_KERNEL = "CutlassFp8BlockScaledMMKernel"
FP8_LINEAR_KERNEL_MODULES = {"CutlassFp8BlockScaledMMKernel": "cutlass",
                             "TritonFp8BlockScaledMMKernel": "triton",
                             "DeepGemmFp8BlockScaledMMKernel": "deep_gemm",
                             "CutlassFP8ScaledMMLinearKernel": "cutlass"}
# the per-tensor / per-channel FP8 linear kernel a CUDA worker with CUTLASS picks
FP8_PER_TENSOR_LINEAR_KERNEL = "CutlassFP8ScaledMMLinearKernel"


def _honour_block_fp8_kernels() -> None:
    """FP8 layers on the CPU as a GPU worker builds them: ``Fp8LinearMethod`` gets the
    kernel object ``FP8_LINEAR_KERNEL`` names (``FP8_PER_TENSOR_LINEAR_KERNEL`` for
    per-tensor / per-channel weights; its post-load step is vLLM's), and ``Fp8MoEMethod``
    the FP8 MoE backend ``--moe-backend`` asks for (vLLM's own choice on the CPU would take
    its CPU experts), its CUDA kernel object not built. vLLM's online FP8 methods
    (``--quantization fp8_per_tensor`` / ``fp8_per_block``, and ``fp8`` on a BF16
    checkpoint) get the same choices, so that they build here (their post-load
    quantization is vLLM's: per-tensor needs ``vllm._C``, absent here; per-block runs), the
    online MoE kernel object (CUDA) not built either. Allocation, loading
    and the post-load conversion (``convert_to_fp8_moe_kernel_format``) are vLLM's."""
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as oracle
    from vllm.model_executor.layers.quantization import fp8 as method
    from vllm.model_executor.layers.quantization.online import fp8 as online

    # vLLM 0.25 builds the MoE kernel in _setup_kernel (make_fp8_moe_kernel, from fp8.py's
    # names), asserting a kernel class first: the online methods' path below
    old = not hasattr(method.Fp8MoEMethod, "_init_moe_kernel")
    choose = method.select_fp8_moe_backend
    build = None if old else method.Fp8MoEMethod._init_moe_kernel

    def init_linear_kernel(activation_quant_key, weight_quant_key, input_dtype, out_dtype,
                           weight_shape, force_kernel=None, module_name=None):
        from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
            FP8ScaledMMLinearLayerConfig)

        block = activation_quant_key.scale.group_shape.is_per_group()
        name = FP8_LINEAR_KERNEL if block else FP8_PER_TENSOR_LINEAR_KERNEL
        module = importlib.import_module("vllm.model_executor.kernels.linear.scaled_mm."
                                         + FP8_LINEAR_KERNEL_MODULES[name])
        config = FP8ScaledMMLinearLayerConfig(
            weight_quant_key=weight_quant_key, activation_quant_key=activation_quant_key,
            input_dtype=input_dtype, out_dtype=out_dtype, weight_shape=weight_shape)
        cls = getattr(module, name)
        if block:
            return cls(config)
        # its constructor asserts CUTLASS FP8 support (CUDA): asked of the class, answered
        # yes for this one construction
        supported = vars(cls)["is_supported"]
        cls.is_supported = classmethod(lambda c, compute_capability=None: (True, None))
        try:
            return cls(config, layer_param_names=[  # as vLLM builds it
                "weight", "weight_scale", "input_scale", "input_scale_ub"])
        finally:
            cls.is_supported = supported

    def select(config, weight_key, activation_key, allow_vllm_cutlass=False):
        if config.moe_backend not in (None, "auto"):
            return oracle.map_fp8_backend(config.moe_backend), None
        return choose(config=config, weight_key=weight_key, activation_key=activation_key,
                      allow_vllm_cutlass=allow_vllm_cutlass)

    def init_kernel(self, layer) -> None:
        if self.experts_cls is None:  # a backend the shim chose: its kernel needs CUDA
            self.moe_quant_config = self.get_fused_moe_quant_config(layer)
            self.moe_kernel = _NoCudaKernel()
            return
        build(self, layer)

    make_kernel = oracle.make_fp8_moe_kernel

    def online_select(config, weight_key, activation_key, allow_vllm_cutlass=False):
        # vLLM's online MoE methods assert a kernel class before building the kernel
        backend, experts = select(config, weight_key, activation_key, allow_vllm_cutlass)
        return backend, (_NoCudaExperts if experts is None else experts)

    def make_online_kernel(moe_quant_config, moe_config, experts_cls, fp8_backend,
                           routing_tables=None, **layer):  # vLLM 0.25 passes layer=
        if experts_cls is _NoCudaExperts:
            return _NoCudaKernel()
        return make_kernel(moe_quant_config, moe_config, experts_cls, fp8_backend, routing_tables,
                           **layer)

    method.init_fp8_linear_kernel = init_linear_kernel
    if old:
        method.select_fp8_moe_backend = online_select
        method.make_fp8_moe_kernel = make_online_kernel
    else:
        method.select_fp8_moe_backend = select
        method.Fp8MoEMethod._init_moe_kernel = init_kernel
    online.init_fp8_linear_kernel = init_linear_kernel
    online.select_fp8_moe_backend = online_select
    oracle.make_fp8_moe_kernel = make_online_kernel  # online._setup_kernel imports it per call


def write_model_dir(hf_config: Mapping[str, Any], root: Optional[str] = None) -> str:
    """A folder with ``config.json`` (``architectures`` and ``model_type`` included), as
    vLLM reads a model; returns its path."""
    folder = tempfile.mkdtemp(prefix="vllm-model-", dir=root)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(hf_config), f)
    return folder


def vllm_config_for(model_dir: str, tp_size: int, ep: bool = False, dtype: str = "bfloat16",
                    quantization: Optional[str] = None, moe_backend: Optional[str] = None):
    """vLLM's ``VllmConfig`` of a dummy-loaded generation model on the CPU; ``moe_backend``
    is vLLM's ``--moe-backend`` (``KernelConfig.moe_backend``), default vLLM's own choice."""
    set_vllm_cpu_environment()
    from vllm.config import (AttentionConfig, DeviceConfig, KernelConfig, LoadConfig,
                             ModelConfig, ParallelConfig, VllmConfig)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    _install_cpu_shims()
    from vllm.config.quantization import resolve_quantization_config

    # what vLLM's EngineArgs passes for an online --quantization shorthand (fp8_per_block);
    # vLLM 0.25 reads the online quantization's args only from there
    online = resolve_quantization_config(quantization, None)
    model = ModelConfig(model=model_dir, dtype=dtype, runner="generate", skip_tokenizer_init=True,
                        enforce_eager=True, max_model_len=64, quantization=quantization,
                        **({"quantization_config": online} if online is not None else {}))
    cpu_mla = getattr(AttentionBackendEnum, "CPU_MLA", None)  # vLLM 0.25: none (the shim)
    attention = AttentionConfig(backend=cpu_mla) if model.use_mla and cpu_mla else AttentionConfig()
    kernel = {"kernel_config": KernelConfig(moe_backend=moe_backend)} if moe_backend else {}
    return VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"),
                      load_config=LoadConfig(load_format="dummy"), attention_config=attention,
                      **kernel,
                      parallel_config=ParallelConfig(tensor_parallel_size=tp_size,
                                                     enable_expert_parallel=ep))


@contextlib.contextmanager
def vllm_parallel_state(config, rank: int, world: int, port: int):
    """vLLM's own distributed environment (gloo, loopback) for one generation rank, torn down
    on exit so that the next job of a pooled process can build another layout."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(config):
        ps.init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        try:
            ps.initialize_model_parallel(config.parallel_config.tensor_parallel_size, 1)
            yield
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


def build_model(config) -> torch.nn.Module:
    """vLLM's model class for ``config``, built in the model dtype on the CPU (inside
    ``vllm_parallel_state``), its params not yet filled."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype), \
            torch.device("cpu"):
        return initialize_model(config).eval()


def post_process(model: torch.nn.Module, config) -> None:
    """vLLM's ``process_weights_after_loading`` over the whole model, as its loader runs it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(config):
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))


def dummy_loaded_model(config) -> torch.nn.Module:
    """What a worker started with ``load_format="dummy"`` holds: vLLM's dummy weights,
    post-processed."""
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    model = build_model(config)
    DummyModelLoader(config.load_config).load_weights(model, config.model_config)
    post_process(model, config)
    return model


def loaded_model(config, full_hf: Mapping[str, torch.Tensor], may_miss=()) -> torch.nn.Module:
    """The oracle: vLLM's ``load_weights`` of the full HF tensors, then its post-processing.
    ``may_miss``: vLLM params the HF tensors do not cover (kept as loaded by the refit)."""
    from vllm.config import set_current_vllm_config

    model = build_model(config)
    # the params as built: vLLM's online quantization adds its scales while loading
    built = {n for n, _ in model.named_parameters()}
    if oldest_vllm.loads_gpt_oss_experts_stacked(model):
        full_hf = oldest_vllm.stacked_gpt_oss_experts(full_hf)
    with set_current_vllm_config(config):
        loaded = model.load_weights(iter(full_hf.items()))
    reported = set(loaded or ())
    # vLLM 0.25's MoE runner reports its experts' params one level up (without routed_experts)
    reported |= {n.replace(".mlp.experts.", ".mlp.experts.routed_experts.") for n in reported}
    missing = sorted(n for n in built - reported - set(may_miss)
                     if not n.endswith(KV_CACHE_SCALES))
    if loaded is not None and missing:
        raise AssertionError(f"vLLM's load_weights left params unloaded: {missing}")
    post_process(model, config)
    return model


# an FP8 model's KV-cache scales: not in a checkpoint that has none (vLLM keeps its default),
# randomised by the dummy loader, unused with --kv-cache-dtype auto; never refit targets
KV_CACHE_SCALES = tuple(f".attn.{s}" for s in ("q_scale", "k_scale", "v_scale", "prob_scale",
                                               "_q_scale", "_k_scale", "_v_scale", "_prob_scale"))


def fp8_quantization_config(ignored_layers=()) -> dict:
    """The ``quantization_config`` of a block-FP8 checkpoint (DeepSeek-V3's / Qwen3-FP8's);
    ``ignored_layers``: modules kept unquantized (the MoE routers)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [128, 128], "ignored_layers": list(ignored_layers)}


def fp8_checkpoint(full_hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block-FP8 checkpoint of full HF tensors (``testing.fp8_reference``'s independent
    tile quantizer): ``<name>`` in float8_e4m3fn and ``<name>_scale_inv`` per linear weight."""
    from megatron_reshard.testing.fp8_reference import quantize_full_hf

    quantized, scales, plain = quantize_full_hf(full_hf)
    out = dict(plain)
    for name, q in quantized.items():
        out[name] = q.view(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scales[name]
    return out


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name (tied ones under each name), and the
    MLA weights vLLM derives after loading where they are plain attributes (vLLM 0.25:
    ``<layer>.W_UK_T`` / ``W_UV``; 0.34 registers them as parameters, the same names)."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    for name, holder, _ in mla_layers(model):
        prefix = name if holder is model.get_submodule(name) else f"{name}.impl"
        for attr in DERIVED_ATTRIBUTES:
            tensor = getattr(holder, attr, None)
            if isinstance(tensor, torch.Tensor):
                out.setdefault(f"{prefix}.{attr}", tensor)
    return out


def bitwise_differences(actual: torch.nn.Module, expected: torch.nn.Module) -> list[str]:
    """Names of the params and buffers that differ in presence, shape, dtype or any bit."""
    a, e = model_tensors(actual), model_tensors(expected)
    bad = sorted(set(a) ^ set(e))
    for name in sorted(set(a) & set(e)):
        x, y = a[name].detach(), e[name].detach()
        if x.shape != y.shape or x.dtype != y.dtype or not _same_bits(x, y):
            bad.append(name)
    return bad


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.numel() == 0:
        return True
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(x), as_bytes(y))


__all__ = ["ARCHITECTURE_MODULES", "CPU_FLASHINFER_MOE_BACKENDS", "bitwise_differences", "build_model",
           "cpu_platform_plugin", "cpu_platform_without_triton", "dummy_loaded_model",
           "KV_CACHE_SCALES", "fp8_checkpoint", "fp8_quantization_config",
           "loaded_model", "model_tensors", "post_process", "set_vllm_cpu_environment",
           "vllm_config_for", "vllm_parallel_state", "write_model_dir"]
