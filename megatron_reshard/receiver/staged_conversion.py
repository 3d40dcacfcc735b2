"""Layers whose vLLM post-load step computes values: received in checkpoint order, then
converted by vLLM's own code, layer by layer, in the storage vLLM holds.

Torch + stdlib only. Block-FP8 layers (``Fp8MoEMethod`` / ``Fp8LinearMethod`` with
``weight_block_size``) are converted after loading per kernel: FlashInfer CUTLASS swaps
w13 and its scales to [up; gate] and clamps every block scale to at least 1e-10; TRTLLM
also shuffles the weights into a block-major 4-D layout of as many elements; DeepGEMM
requantizes to power-of-two
(E8M0) scales and lays the scales out for TMA; Triton and the CUTLASS / Triton block-FP8
linear kernels keep checkpoint order. A coded-value probe (``kernel_layouts.learn_order``)
cannot prove such a conversion value-independent (coded values never reach a clamp at
1e-10), so every block-FP8 layer takes this path:

1. ``staged_layers(model)`` (at ``prepare_refit``, before any byte moves) finds each FP8
   layer, its backend and vLLM's conversion of it, and runs that conversion once on a
   throwaway copy (one expert of an MoE layer) to show it runs on this device and returns
   the params' own shapes and dtypes; anything else is a ``KernelLayoutError`` naming the
   layer, quant method, backend and the vLLM setting that selects a supported one.
2. The refit writes those params in checkpoint order into vLLM's storage itself (no
   ``KernelOrder``; where vLLM re-allocated a param in a kernel's own shape, through a
   checkpoint-shaped view of it): the storage is the staging area, so no second copy of
   the layer exists while bytes arrive.
3. ``StagedConversions.convert()`` (after the refit's receive) runs vLLM's conversion of
   each layer on that storage and copies the result back into the same addresses, one layer
   at a time; the extra memory is what vLLM's conversion allocates for one layer (its peak
   is reported, overall and per layer: ``report()["per_layer"]``). Each layer converts
   once per refit: a second call finds it converted.

vLLM's online block FP8 (``--quantization fp8_per_block``: a BF16 checkpoint quantized by
vLLM while loading, ``Fp8PerBlockOnline{Linear,MoE}Method``) holds after loading exactly
what a block-FP8 checkpoint layer holds: ``weight`` ``float8_e4m3fn`` of the (per-rank)
checkpoint shape and ``weight_scale_inv`` fp32 ``[ceil(N/128), ceil(K/128)]`` (experts:
``[E, ...]`` of each), taken from vLLM's ``per_block_cast_to_fp8`` (no UE8M0), then the
same kernel conversion (``convert_to_fp8_moe_kernel_format`` / the linear kernel's post-load
step). Such layers take this same path, with one difference: their bytes are vLLM's own
function's (``receiver.online_quant``; ``StagedLayer.quantizer``): the payload, planned with
``gen_quant="block_fp8_online"``, sends their weights in BF16 and the receiver quantizes
them with that function (``check_online_payload`` refuses a BF16 payload or training FP8
bytes; ``fp8_targets`` refuses a weight the sender quantized, by name).

Per-tensor FP8 and the other online methods (``--quantization fp8_per_tensor``, or ``fp8``
on a BF16 checkpoint, which vLLM 0.33 maps to it; per channel, MXFP8, ...) are refused at
``prepare_refit``: their conversion quantizes with ``vllm._C.scaled_fp8_quant`` (absent
from every CPU build, so no oracle checks it here) or from scales over the whole tensor.

Duck typing only: vLLM's functions are found through the live quant method's module.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Optional

import torch

from megatron_reshard.groups.faults import RefitError
from megatron_reshard.receiver.bounded_cache import BoundedCache
from megatron_reshard.receiver.kernel_layouts import KernelLayoutError, refusal
from megatron_reshard.receiver.online_quant import (ONLINE_GEN_QUANT, VllmBlockQuantizer,
                                                     find_block_quantizer)
from megatron_reshard.wire.records import RefitPayload

FP8_MOE_METHOD = "Fp8MoEMethod"
FP8_LINEAR_METHOD = "Fp8LinearMethod"
STAGED_METHODS = (FP8_MOE_METHOD, FP8_LINEAR_METHOD)
# FP8 MoE backends whose conversion (``convert_to_fp8_moe_kernel_format``) returns new
# tensors and leaves the layer alone (HUMMING re-registers the layer's params, MARLIN / CPU
# / XPU / AITER repack with device ops of their platform; the dry run decides the rest)
STAGED_FP8_MOE_BACKENDS = ("FLASHINFER_CUTLASS", "FLASHINFER_TRTLLM", "TRITON", "BATCHED_TRITON",
                           "DEEPGEMM", "BATCHED_DEEPGEMM")
FP8_MOE_SETTING = ("start vLLM with --moe-backend flashinfer_cutlass, flashinfer_trtllm or "
                   "triton (KernelConfig.moe_backend), or serve it unquantized")
FP8_LINEAR_SETTING = ("let vLLM pick the CUTLASS or Triton block-FP8 linear kernel (on "
                      "Hopper/Blackwell: VLLM_USE_DEEP_GEMM=0), or serve it unquantized "
                      "(drop --quantization)")
# per-tensor FP8 (a checkpoint's, or vLLM's online quantization of a BF16 one): what a
# user changes to refit the model
PER_TENSOR_SETTING = ("serve the policy in BF16 (drop --quantization), or give vLLM a "
                      "block-FP8 quantization_config (weight_block_size [128, 128]) and refit "
                      "with gen_quant=\"block_fp8\" (the trainer quantizes)")
# vLLM's online quantization methods (their layers are allocated on the meta device and
# quantized by vLLM while loading), by base class name
# (vLLM 0.25.1 names the linear one ``_Fp8OnlineLinearBase``)
ONLINE_BASES = ("OnlineLinearBase", "_Fp8OnlineLinearBase", "OnlineMoEMethodBase")
# the online methods whose layers hold block FP8 after loading (``--quantization fp8_per_block``)
ONLINE_BLOCK_LINEAR_METHOD = "Fp8PerBlockOnlineLinearMethod"
ONLINE_BLOCK_MOE_METHOD = "Fp8PerBlockOnlineMoEMethod"
MOE_METHODS = (FP8_MOE_METHOD, ONLINE_BLOCK_MOE_METHOD)
ONLINE_SETTING = ("serve it with --quantization fp8_per_block and refit with "
                  f"gen_quant=\"{ONLINE_GEN_QUANT}\" (BF16 sent, quantized by vLLM's own "
                  "function here), or serve the policy in BF16 (drop --quantization)")
_MOE_LEAVES = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
_LINEAR_LEAVES = ("weight", "weight_scale_inv")


class StagedConversionError(RefitError):
    """vLLM's conversion of a refitted layer failed or could not be put back in place."""


@dataclass
class StagedLayer:
    """One layer converted after each refit: its params (full names, in the order the
    conversion takes and returns them) over vLLM's live storage, and the conversion.
    ``received_as``: the same storage in checkpoint shape, where the refit writes (the
    params themselves where vLLM keeps checkpoint shapes)."""

    name: str
    method: str
    backend: str
    params: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    run: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]
    received_as: tuple[torch.Tensor, ...] = ()
    # the dry run found vLLM's conversion of this kind of layer to hand back its inputs,
    # bytes unchanged (Triton experts, the block linear kernels): the storage keeps the
    # bytes as they arrived, so it stays a base for delta refits
    identity: bool = False
    # an online block-FP8 layer's quantizer (vLLM's own function, receiver.online_quant):
    # its FP8 weights are received in BF16 and written through it
    quantizer: Optional[VllmBlockQuantizer] = None

    def __post_init__(self) -> None:
        if not self.received_as:
            self.received_as = tuple(t.data for t in self.tensors)

    @property
    def nbytes(self) -> int:
        """The bytes vLLM holds for this layer's converted params."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def receive_views(self) -> dict[str, torch.Tensor]:
        """``{param name: checkpoint-shaped view}`` where vLLM holds another shape."""
        return {n: v for n, v, t in zip(self.params, self.received_as, self.tensors)
                if tuple(v.shape) != tuple(t.shape)}


def _fp8_moe_layer(name: str, module: torch.nn.Module, method: Any) -> StagedLayer:
    backend = str(getattr(getattr(method, "fp8_backend", None), "name", None))
    kind = type(method).__name__
    if getattr(method, "weight_block_size", None) is None:
        raise refusal(name, method, backend, "per-tensor FP8 experts are requantized per "
                      "expert after loading to one scale over w1 and w3 (vllm._C's "
                      "scaled_fp8_quant, which no CPU build of vLLM 0.33 has, so no oracle "
                      "checks a refit of it here); only block FP8 is converted by the refit",
                      PER_TENSOR_SETTING)
    if backend not in STAGED_FP8_MOE_BACKENDS:
        raise refusal(name, method, backend, "this backend's conversion repacks the experts "
                      "with its own device kernels or replaces the layer's params, which the "
                      "refit does not run", FP8_MOE_SETTING)
    # the checkpoint method's module imports it; the online one imports it per call, from
    # the module that defines the backends
    convert = next((f for f in (getattr(sys.modules.get(type(owner).__module__),
                                        "convert_to_fp8_moe_kernel_format", None)
                                for owner in (method, getattr(method, "fp8_backend", None)))
                    if f is not None), None)
    tensors = tuple(getattr(module, leaf, None) for leaf in _MOE_LEAVES)
    if convert is None or any(not isinstance(t, torch.Tensor) for t in tensors):
        raise refusal(name, method, backend, "vLLM's convert_to_fp8_moe_kernel_format or the "
                      f"layer's {list(_MOE_LEAVES)} were not found where vLLM 0.33 keeps them",
                      FP8_MOE_SETTING)
    received_as = _checkpoint_views(name, module, method, backend, tensors)
    if any(getattr(module, b, None) is not None for b in ("w13_bias", "w2_bias", "w13_input_scale")):
        raise refusal(name, method, backend, "the layer has expert biases or static input "
                      "scales, whose conversion the refit does not run", FP8_MOE_SETTING)

    def run(ins: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        w13, w2, s13, s2 = ins
        with torch.no_grad():
            out = convert(method.fp8_backend, module, w13, w2, s13, s2, None, None)
        return (out[0], out[1], out[2], out[3])

    prefix = f"{name}." if name else ""
    return StagedLayer(name, kind, backend, tuple(prefix + leaf for leaf in _MOE_LEAVES), tensors,
                       run, received_as)


def _checkpoint_views(name: str, module: torch.nn.Module, method: Any, backend: str,
                      tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The experts' storage in checkpoint shape: the params themselves, or, where vLLM
    re-allocated them in a kernel's own shape (TRTLLM's block-major 4-D experts), a view of
    that contiguous storage with the checkpoint's shape and as many elements: the refit
    writes checkpoint order there, vLLM's conversion reads it (the dry run checks that the
    conversion of that shape gives exactly the shape vLLM holds)."""
    w13, w2 = tensors[0], tensors[1]
    experts = w13.shape[0]
    # vLLM's RoutedExperts keeps both sizes (after its own round-up); else w2's own shape
    hidden = int(getattr(module, "hidden_size", 0) or (w2.shape[1] if w2.dim() == 3 else 0))
    inter = int(getattr(module, "intermediate_size_per_partition", 0)
                or (w2.shape[2] if w2.dim() == 3 else 0))
    shards = int(getattr(getattr(method, "moe", None), "w13_num_shards", 2))
    shapes = ((experts, shards * inter, hidden), (experts, hidden, inter))
    views = []
    for leaf, t, shape in zip(_MOE_LEAVES, (w13, w2), shapes):
        if tuple(t.shape) == shape:
            views.append(t.data)
            continue
        if t.numel() != experts * shape[1] * shape[2] or not t.is_contiguous():
            raise refusal(name, method, backend, f"vLLM holds {leaf} as {list(t.shape)} after "
                          f"loading: neither the checkpoint's {list(shape)} nor contiguous "
                          f"storage of as many elements the refit could receive into",
                          FP8_MOE_SETTING)
        views.append(t.data.view(shape))
    return tuple(views) + tuple(t.data for t in tensors[2:])


def _fp8_linear_layer(name: str, module: torch.nn.Module, method: Any) -> StagedLayer:
    kernel = getattr(method, "fp8_linear", None)
    backend = type(kernel).__name__ if kernel is not None else "None"
    kind = type(method).__name__
    if getattr(method, "weight_block_size", None) is None:
        raise refusal(name, method, backend, "per-tensor FP8 linear weights are requantized "
                      "after loading to one scale over their fused parts (vllm._C's "
                      "scaled_fp8_quant, which no CPU build of vLLM 0.33 has, so no oracle "
                      "checks a refit of it here) and transposed; only block FP8 is "
                      "converted by the refit", PER_TENSOR_SETTING)
    if (getattr(method, "use_marlin", False) or "Marlin" in backend
            or not callable(getattr(kernel, "process_weights_after_loading", None))):
        raise refusal(name, method, backend, "the Marlin kernel repacks the weight with its own "
                      "device kernel", FP8_LINEAR_SETTING)
    tensors = tuple(getattr(module, leaf, None) for leaf in _LINEAR_LEAVES)
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        raise refusal(name, method, backend, f"the layer's {list(_LINEAR_LEAVES)} were not "
                      f"found where vLLM 0.33 keeps them", FP8_LINEAR_SETTING)

    def run(ins: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # the kernel's post-load step replaces the layer's params: it gets a shell holding
        # the layer's attributes and these tensors, never the live layer
        shell = torch.nn.Module()
        shell.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")
                               and k != "training"})
        for leaf, t in zip(_LINEAR_LEAVES, ins):
            shell.register_parameter(leaf, torch.nn.Parameter(t.data, requires_grad=False))
        shell.input_scale = None
        with torch.no_grad():
            kernel.process_weights_after_loading(shell)
        return tuple(getattr(shell, leaf).data for leaf in _LINEAR_LEAVES)

    prefix = f"{name}." if name else ""
    return StagedLayer(name, kind, backend, tuple(prefix + leaf for leaf in _LINEAR_LEAVES), tensors, run)


# (method, backend, shapes, dtypes, device) -> (why not, or None; whether an identity).
# Kept for the process: the verdict depends only on the key and on vLLM's conversion code,
# which does not change while the process runs; bounded, as it is keyed by shapes
_dry_runs: BoundedCache = BoundedCache(limit=256)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def _dry_run(layer: StagedLayer) -> None:
    """vLLM's conversion once on a throwaway copy (one expert of an MoE layer): it must run
    here and give back the params' shapes and dtypes. Also learns whether it is an identity
    (each input handed back, bytes unchanged: ``StagedLayer.identity``). Cached per layer
    kind and shape."""
    moe = layer.method in MOE_METHODS
    copies = tuple((t[:1] if moe else t).clone() for t in layer.received_as)
    held = [((1,) + tuple(t.shape[1:]) if moe else tuple(t.shape), t.dtype) for t in layer.tensors]
    key = (layer.method, layer.backend, tuple(tuple(c.shape) for c in copies),
           tuple(c.dtype for c in copies), tuple(held), copies[0].device.type)
    if key not in _dry_runs:
        before = tuple(c.clone() for c in copies)
        versions = [c._version for c in copies]
        try:
            outs = layer.run(copies)
            bad = [(tuple(o.shape), o.dtype) for o, h in zip(outs, held) if (tuple(o.shape), o.dtype) != h]
            # handed back as they came: no new tensor, no in-place op, not a byte changed
            identity = not bad and all(
                _same_tensor(o, c) and c._version == v and torch.equal(c.view(torch.uint8), b.view(torch.uint8))
                for o, c, b, v in zip(outs, copies, before, versions))
            _dry_runs[key] = ((f"it returned {bad} where vLLM holds {held} (not the storage "
                               f"vLLM holds)") if bad else None, identity)
        except Exception as exc:  # vLLM's code does not run here: refuse, say why
            _dry_runs[key] = (f"it does not run on this {copies[0].device.type} device "
                              f"({type(exc).__name__}: {exc})", False)
    why, layer.identity = _dry_runs[key]
    if why is not None:
        setting = FP8_MOE_SETTING if moe else FP8_LINEAR_SETTING
        raise KernelLayoutError(f"{layer.name}: quant method {layer.method}, kernel backend "
                                f"{layer.backend}: vLLM's conversion after loading cannot be "
                                f"re-run for the refit: {why}; the refit refuses it rather than "
                                f"write bytes vLLM does not read. To refit this model, {setting}")


def _is_online(method: Any) -> bool:
    return any(c.__name__ in ONLINE_BASES for c in type(method).__mro__)


def _online_refusal(name: str, method: Any) -> KernelLayoutError:
    """vLLM's online quantization other than per block (``--quantization fp8_per_tensor``,
    ``fp8`` on a BF16 checkpoint, per channel, MXFP8, ...): the layer holds what vLLM computed
    from BF16 weights while loading, scales from the whole tensor across its TP ranks
    included."""
    kernel = getattr(method, "fp8_backend", None) or getattr(method, "fp8_linear", None)
    backend = (str(getattr(kernel, "name", None) or type(kernel).__name__) if kernel is not None
               else "None")
    return refusal(name, method, backend, "vLLM quantizes this layer's BF16 weights while "
                   "loading (online quantization: the layer holds vLLM's quantized bytes "
                   "and scales, not the checkpoint's); the refit would have to receive BF16 "
                   "apart from vLLM's storage and re-run that quantization (per-tensor: "
                   "vllm._C's scaled_fp8_quant and an all-reduce of the scale over vLLM's "
                   "TP group), which it does only for online block FP8", ONLINE_SETTING)


def check_online_payload(layers: Collection[StagedLayer], payload: Any) -> None:
    """Online block-FP8 layers hold vLLM's quantization of BF16 weights: the refit writes
    them only from a payload planned for it (``gen_quant="block_fp8_online"``: BF16 sent,
    quantized on this rank with vLLM's own function). Raises ``KernelLayoutError`` (before
    any byte moves) for a BF16 payload or weights sent in their training FP8 bytes; a
    sender-quantized weight of a ``"block_fp8"`` plan is refused while mapping, by name
    (``fp8_targets``, ``online_quant.sender_quantized_refusal``)."""
    online = [layer for layer in layers if layer.quantizer is not None]
    if not online:
        return
    info = RefitPayload.of(payload)
    fmt = (info.gen_quant or {}).get("format")
    first = online[0]
    where = (f"{first.name}: quant method {first.method}, kernel backend {first.backend} "
             f"(vLLM's --quantization fp8_per_block, {len(online)} such layers)")
    if fmt != "block_fp8":
        raise KernelLayoutError(
            f"{where}: vLLM quantized this layer online from BF16 into block FP8, and the "
            f"refit payload is planned for {fmt or 'BF16'} (gen_quant={fmt!r}); to refit this "
            f"model, build the trainer's source with gen_quant=\"{ONLINE_GEN_QUANT}\" (BF16 "
            f"sent, quantized here by vLLM's own function), or serve the policy in BF16 (drop "
            f"--quantization)")
    trained = sorted(p.name for p in info.params() if p.gen_quant == "train_fp8")
    if trained:
        raise KernelLayoutError(
            f"{where}: the payload sends {trained[:3]}{' ...' if len(trained) > 3 else ''} "
            f"as their training FP8 bytes (power-of-two scales), but vLLM's online "
            f"quantization of the same values gives other bytes and scales; to refit this "
            f"model, serve it from a block-FP8 checkpoint (quantization_config "
            f"weight_block_size [128, 128]) or train in BF16")


def online_quantizers(layers: Collection[StagedLayer]) -> dict[str, VllmBlockQuantizer]:
    """``{FP8 weight param name: vLLM's quantizer}`` of the online block-FP8 layers."""
    return {n: layer.quantizer for layer in layers if layer.quantizer is not None
            for n in layer.params if n.endswith("weight")}


def staged_layers(model: torch.nn.Module, skip: Collection[str] = ()) -> list[StagedLayer]:
    """The layers the refit converts with vLLM's own code after each refit (block FP8);
    raises ``KernelLayoutError`` for an FP8 layer whose conversion cannot run here or is
    not re-run by the refit (per-tensor FP8, vLLM's online quantization)."""
    out = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kind = type(method).__name__
        online = _is_online(method)
        if kind not in STAGED_METHODS and not online:
            continue
        prefix = f"{name}." if name else ""
        if not any(prefix + n not in skip for n, _ in module.named_parameters(recurse=False)):
            continue
        if online and kind not in (ONLINE_BLOCK_LINEAR_METHOD, ONLINE_BLOCK_MOE_METHOD):
            raise _online_refusal(name, method)
        layer = (_fp8_moe_layer if kind in MOE_METHODS else _fp8_linear_layer)(name, module, method)
        if online:
            layer.quantizer, why = find_block_quantizer(name, module, method, (128, 128))
            if layer.quantizer is None:
                raise refusal(name, method, layer.backend, f"the refit quantizes this layer's "
                              f"BF16 weights with vLLM's own function, but {why}", ONLINE_SETTING)
        _dry_run(layer)
        out.append(layer)
    return out


@dataclass
class StagedConversions:
    """Runs each staged layer's conversion once per refit, in place (see the module doc)."""

    layers: list[StagedLayer]
    converted: dict[str, int] = field(default_factory=dict)  # layer -> refits converted
    _pending: set = field(default_factory=set)
    stats: dict = field(default_factory=lambda: {"conversions": 0, "peak_staging_bytes": 0,
                                                 "convert_s": 0.0, "max_layer_s": 0.0})
    # layer -> its own figures: bytes it holds, staging of its last and largest conversion,
    # time of its last conversion and over all of them
    per_layer: dict = field(default_factory=dict)
    # the last convert() changed some layer's bytes (not every conversion an identity)
    rewrote: bool = False

    @property
    def param_names(self) -> set[str]:
        return {n for layer in self.layers for n in layer.params}

    def received(self, written: Collection[torch.Tensor]) -> None:
        """The refit wrote these tensors in checkpoint order: their layers need converting.
        A layer written only in part cannot be converted (the rest is in kernel order)."""
        at = {t.data_ptr() for t in written}
        for layer in self.layers:
            hit = [n for n, t in zip(layer.params, layer.tensors) if t.data_ptr() in at]
            if hit and len(hit) != len(layer.params):
                raise StagedConversionError(
                    f"{layer.name}: the refit wrote {hit} but not the rest of "
                    f"{list(layer.params)}; vLLM's {layer.backend} conversion needs the whole "
                    f"layer in checkpoint order")
            if hit:
                self._pending.add(layer.name)

    def convert(self) -> list[str]:
        """Convert every layer received since its last conversion, layer by layer; returns
        their names. A converted layer is never converted again until it is received again."""
        done, rewrote = [], False
        for layer in self.layers:
            if layer.name not in self._pending:
                continue
            t0 = time.perf_counter()
            try:
                extra, kept = self._convert(layer)
            except BaseException:
                self.rewrote = True  # whatever it left, it is no base
                raise
            rewrote = rewrote or not kept
            self._pending.discard(layer.name)
            self.converted[layer.name] = self.converted.get(layer.name, 0) + 1
            dt = time.perf_counter() - t0
            self.stats["conversions"] += 1
            self.stats["convert_s"] += dt
            self.stats["max_layer_s"] = max(self.stats["max_layer_s"], dt)
            self.stats["peak_staging_bytes"] = max(self.stats["peak_staging_bytes"], extra)
            own = self.per_layer.setdefault(layer.name, {
                "backend": f"{layer.method}:{layer.backend}", "layer_bytes": layer.nbytes,
                "conversions": 0, "staging_bytes": 0, "peak_staging_bytes": 0,
                "convert_s": 0.0, "total_convert_s": 0.0})
            own["conversions"] += 1
            own["staging_bytes"], own["convert_s"] = extra, dt
            own["peak_staging_bytes"] = max(own["peak_staging_bytes"], extra)
            own["total_convert_s"] += dt
            done.append(layer.name)
        self.rewrote = rewrote
        return done

    @staticmethod
    def _convert(layer: StagedLayer) -> tuple[int, bool]:
        """vLLM's conversion on the live storage; results copied back into it. Returns the
        bytes the conversion held apart from the storage (this layer's staging) and whether
        the bytes are kept as they arrived: a conversion the dry run found to be an identity
        that again handed back every input with no in-place write (version counters)."""
        versions = [t._version for t in layer.received_as]
        try:
            outs = layer.run(layer.received_as)
        except Exception as exc:
            raise StagedConversionError(f"{layer.name}: vLLM's {layer.backend} conversion "
                                        f"failed after the refit: {type(exc).__name__}: {exc}") from exc
        live_storage = {t.untyped_storage().data_ptr() for t in layer.tensors}
        extra = 0
        staged = []
        for name, live, out in zip(layer.params, layer.tensors, outs):
            if tuple(out.shape) != tuple(live.shape) or out.dtype != live.dtype:
                raise StagedConversionError(f"{name}: vLLM's {layer.backend} conversion returned "
                                            f"{tuple(out.shape)} {out.dtype}, vLLM holds "
                                            f"{tuple(live.shape)} {live.dtype}")
            same = out.data_ptr() == live.data_ptr() and out.stride() == live.stride()
            if not same and out.untyped_storage().data_ptr() in live_storage:
                out = out.clone()  # a view of the storage it is about to overwrite
            extra += 0 if same else out.numel() * out.element_size()
            staged.append((live, out, same))
        kept = (layer.identity and all(same for _, _, same in staged)
                and all(_same_tensor(o, t) and t._version == v
                         for o, t, v in zip(outs, layer.received_as, versions)))
        with torch.no_grad():
            for live, out, same in staged:
                if not same:
                    live.copy_(out)
        return extra, kept

    def report(self) -> dict:
        return {"layers": [layer.name for layer in self.layers],
                "backends": sorted({f"{layer.method}:{layer.backend}" for layer in self.layers}),
                **self.stats, "per_layer": {n: dict(v) for n, v in self.per_layer.items()}}


__all__ = ["STAGED_METHODS", "StagedConversionError", "StagedConversions", "StagedLayer",
           "check_online_payload", "online_quantizers", "staged_layers"]
