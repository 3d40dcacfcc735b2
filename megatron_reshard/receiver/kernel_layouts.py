"""How vLLM's post-load step stored each refit target, known before any byte moves.

Torch + stdlib only. On a GPU worker vLLM converts some layers after loading into the
kernel's byte order, in the same (checkpoint-shaped) storage. ``storage_orders(model)``
walks the live modules and answers, per param the refit may write:

- checkpoint order (absent from the result): unquantized linear and embedding layers, and
  unquantized MoE whose kernel keeps the order (Triton, batched Triton; CPU where its
  experts do not prepack the weights after loading, as on vLLM's real CPU platform they do);
- a value-independent rearrangement (a ``vllm_layout.kernel_order.KernelOrder`` in the
  result): unquantized MoE with FlashInfer CUTLASS or FlashInfer TRTLLM;
- block-FP8 layers named in ``staged``: written in checkpoint order, converted after each
  refit by vLLM's own code (``receiver.staged_conversion``);
- anything else (other quantized MoE and linear layers, the MoE backends
  whose conversion this file does not run: MoonEP, AITER, XPU, TPU, out-of-tree):
  ``KernelLayoutError`` naming the layer, its quant method, its kernel backend and the
  vLLM setting that selects a supported one. Never written blind.

The rearrangement is learned from vLLM's own conversion, not from a table kept here: the
MoE method's module (the one whose ``_setup_kernel`` vLLM runs after loading) holds
``convert_to_unquantized_kernel_format``; it runs once per (backend, shape) on a throwaway
pair of coded expert tensors (two experts; each element's index spelled in 13-bit digits
inside normal bf16 values, one fill per digit) and once more on another coding, which must
give the same placement (value independence). The result must be separable per dim
(``KernelOrder``); elements vLLM zeroed are its padding. Duck typing only: vLLM is reached
through the live objects, never imported here.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
from typing import Any, Callable, Optional

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.vllm_layout.kernel_order import PADDING, KernelOrder, is_checkpoint_order

# quant methods whose params stay in checkpoint order after vLLM's post-load step on GPUs
ORDER_KEEPING_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
UNQUANTIZED_MOE_METHOD = "UnquantizedFusedMoEMethod"
# unquantized MoE backends whose whole post-load change is vLLM's conversion function
# (XPU transposes before it, MoonEP replaces the params, AITER / TPU / OOT run elsewhere)
PROBED_MOE_BACKENDS = ("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "TRITON", "BATCHED_TRITON", "CPU")
MOE_SETTING = ("start vLLM with --moe-backend triton, flashinfer_cutlass or flashinfer_trtllm "
               "(KernelConfig.moe_backend)")
_DIGIT_BITS = 13
_CODE_BASE = 0x4000  # bf16 bit patterns 0x4000 + digit: positive normal numbers
_PROBE_EXPERTS = 2

_learned: dict[tuple, Any] = {}  # (backend, shapes, ...) -> tuple of terms per tensor, or why not


class KernelLayoutError(BadInputError):
    """A target's storage is in an order the refit does not know (raised before any communication)."""


def _name(obj: Any) -> str:
    return type(obj).__name__


def _backend_name(method: Any) -> str:
    backend = getattr(method, "unquantized_backend", None)
    return str(getattr(backend, "name", backend))


def refusal(layer: str, method: Any, backend: str, why: str, setting: str) -> KernelLayoutError:
    """The refusal of one layer: its name, quant method, kernel backend, why, what to set."""
    return KernelLayoutError(f"{layer}: quant method {_name(method)}, kernel backend {backend}: "
                             f"{why}; the refit refuses it rather than write bytes in an order "
                             f"vLLM does not read. To refit this model, {setting}")


def _codes(numel: int, digit: int, reverse: bool = False) -> torch.Tensor:
    """bf16 values whose bits spell digit ``digit`` of each element's index (base 2^13)."""
    index = torch.arange(numel, dtype=torch.int64)
    if reverse:
        index = numel - 1 - index
    bits = _CODE_BASE + (index >> (_DIGIT_BITS * digit)) % (1 << _DIGIT_BITS)
    return bits.to(torch.int16).view(torch.bfloat16)


def _read_codes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.int16).to(torch.int64).cpu() & 0xFFFF


def _run_coded(convert: Callable, shapes: list[tuple[int, ...]], device, digit: int,
               reverse: bool = False) -> list[torch.Tensor]:
    ins = [_codes(math.prod(s), digit, reverse).reshape(s).to(device) for s in shapes]
    outs = convert(*ins)
    if len(outs) != len(shapes) or any(tuple(o.shape) != s for o, s in zip(outs, shapes)):
        raise BadInputError(f"the conversion returned shapes {[tuple(o.shape) for o in outs]} "
                         f"for {shapes} (not checkpoint-shaped storage)")
    return [_read_codes(o) for o in outs]


def learn_order(convert: Callable, shapes: list[tuple[int, ...]], device=None
                ) -> list[tuple[torch.Tensor, ...]]:
    """Per tensor, the separable terms of where ``convert`` (tensors in checkpoint order ->
    the same-shaped tensors it stores) puts each element; raises ``ValueError`` where the
    conversion computes values, is not value-independent, or is not separable."""
    numels = [math.prod(s) for s in shapes]
    digits = max(1, math.ceil(math.log2(max(numels)) / _DIGIT_BITS))
    fills = [_run_coded(convert, shapes, device, d) for d in range(digits)]
    check = _run_coded(convert, shapes, device, 0, reverse=True)
    out = []
    for k, (shape, numel) in enumerate(zip(shapes, numels)):
        got = [f[k] for f in fills]
        zero = got[0] == 0
        for g in got + [check[k]]:
            if not torch.equal(g == 0, zero) or bool(((g[~zero] < _CODE_BASE)
                                                      | (g[~zero] >= _CODE_BASE + (1 << _DIGIT_BITS))).any()):
                raise BadInputError(f"tensor {k}: the conversion computes values (not a "
                                 f"rearrangement of the elements)")
        source = sum((g - _CODE_BASE) << (_DIGIT_BITS * d) for d, g in enumerate(got))
        source = torch.where(zero, torch.full_like(source, -1), source)
        placed = source[~zero]
        if bool((placed >= numel).any()) or placed.unique().numel() != placed.numel():
            raise BadInputError(f"tensor {k}: the conversion duplicates or invents elements")
        expected = (_CODE_BASE + (numel - 1 - placed) % (1 << _DIGIT_BITS))
        if not torch.equal(check[k][~zero], expected):
            raise BadInputError(f"tensor {k}: another coding of the values lands elsewhere "
                             f"(the order depends on the values)")
        where = torch.full((numel,), PADDING, dtype=torch.int64)
        where[placed] = torch.nonzero(~zero).view(-1)
        out.append(_separate(where.view(shape), k))
    return out


def _separate(where: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Terms per dim with ``where == sum(terms)`` at every placed element."""
    origin = int(where.reshape(-1)[0])
    if origin < 0:
        raise BadInputError(f"tensor {k}: its first element is not kept")
    terms = []
    for d in range(where.dim()):
        axis = where[tuple(slice(None) if i == d else 0 for i in range(where.dim()))]
        terms.append(torch.where(axis >= 0, axis - origin if d else axis, torch.full_like(axis, PADDING)))
    for d in range(1, where.dim()):  # offsets >= 0 in every dim but the first: -1 is padding only
        axis = where[tuple(slice(None) if i == d else 0 for i in range(where.dim()))]
        low = int((axis[axis >= 0] - origin).min())
        if low < 0:
            terms[d] = torch.where(axis >= 0, axis - origin - low, terms[d])
            terms[0] = torch.where(terms[0] >= 0, terms[0] + low, terms[0])
    total = torch.zeros((), dtype=torch.int64)
    valid = torch.ones((), dtype=torch.bool)
    for d, t in enumerate(terms):
        shape = [1] * where.dim()
        shape[d] = -1
        total = total + t.view(shape)
        valid = valid & (t.view(shape) != PADDING)
    placed = where >= 0
    if not torch.equal(placed, valid.expand_as(where)) or \
            not torch.equal(where[placed], total.expand_as(where)[placed]):
        raise BadInputError(f"tensor {k}: the order is not separable per dim")
    return tuple(terms)


def _expert_terms(probe: tuple[torch.Tensor, ...], num_experts: int, device) -> tuple[torch.Tensor, ...]:
    """Probe terms (two experts) widened to the layer's experts: each expert rearranged
    inside its own slot (checked on the probe)."""
    per_expert = math.prod(t.numel() for t in probe[1:])
    origin = int(probe[0][0])  # where expert 0's first element went: into the next dim's term
    if not torch.equal(probe[0] - origin, torch.arange(probe[0].numel(), dtype=torch.int64) * per_expert):
        raise BadInputError("experts are not kept in their own slots")
    experts = torch.arange(num_experts, dtype=torch.int64) * per_expert
    rows = torch.where(probe[1] == PADDING, probe[1], probe[1] + origin)
    return tuple(t.to(device) for t in (experts, rows) + tuple(probe[2:]))


def _experts_finish_loading(method: Any) -> bool:
    """Whether the MoE kernel's experts run a post-load step of their own (one that
    overrides their root class's, a no-op in vLLM 0.33) after the conversion."""
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if experts is None:
        return False
    cls = experts if isinstance(experts, type) else type(experts)
    roots = [c for c in reversed(cls.__mro__) if "process_weights_after_loading" in vars(c)]
    return bool(roots) and getattr(cls, "process_weights_after_loading") is not \
        vars(roots[0])["process_weights_after_loading"]


def _layer_argument(convert: Callable) -> dict:
    """``layer=None`` where vLLM's conversion takes the layer (0.33: MoonEP reads it),
    nothing where it does not (0.25.1's takes the backend, config and weights only)."""
    try:
        takes = "layer" in inspect.signature(convert).parameters
    except (TypeError, ValueError):  # no signature to read: call it as the newer vLLM does
        takes = True
    return {"layer": None} if takes else {}


def _moe_orders(layer_name: str, module: torch.nn.Module, method: Any,
                params: dict[str, torch.Tensor]) -> dict[str, KernelOrder]:
    backend = _backend_name(method)
    if backend not in PROBED_MOE_BACKENDS:
        raise refusal(layer_name, method, backend, "this backend's post-load step changes the "
                      "expert storage in ways the refit does not run (it is not vLLM's "
                      "convert_to_unquantized_kernel_format alone)", MOE_SETTING)
    if backend == "CPU" and _experts_finish_loading(method):
        raise refusal(layer_name, method, backend, "vLLM's CPU experts prepack w13/w2 into "
                      "their own layout after loading (vllm._C)", "refit a GPU worker")
    convert = getattr(sys.modules.get(type(method).__module__), "convert_to_unquantized_kernel_format", None)
    config = getattr(module, "moe_config", None)
    w13, w2 = params.get("w13_weight"), params.get("w2_weight")
    if convert is None or config is None or w13 is None or w2 is None:
        raise refusal(layer_name, method, backend, "vLLM's conversion function, the layer's "
                      "moe_config or its w13/w2 weights were not found where vLLM 0.33 keeps "
                      "them", MOE_SETTING)
    shapes = [(min(_PROBE_EXPERTS, w13.shape[0]),) + tuple(w13.shape[1:]),
              (min(_PROBE_EXPERTS, w2.shape[0]),) + tuple(w2.shape[1:])]
    key = (backend, tuple(shapes), w13.dtype, w13.device.type, bool(getattr(config, "is_act_and_mul", True)),
           getattr(config, "intermediate_size_per_partition_unpadded", None),
           getattr(config, "intermediate_size_per_partition", None))
    if key not in _learned:
        extra = _layer_argument(convert)

        def run(a: torch.Tensor, b: torch.Tensor):
            a, b = a.to(w13.dtype), b.to(w2.dtype)
            with torch.no_grad():  # a throwaway copy of the config: the TRTLLM path writes it
                return convert(method.unquantized_backend, copy.copy(config), a, b, **extra)
        try:
            _learned[key] = learn_order(run, shapes, w13.device)
        except Exception as exc:  # vLLM's code failed or did not rearrange: refuse, say why
            _learned[key] = f"{type(exc).__name__}: {exc}"
    learned = _learned[key]
    if isinstance(learned, str):
        raise refusal(layer_name, method, backend, f"its conversion could not be learned "
                      f"({learned})", MOE_SETTING)
    orders = {}
    for leaf, weight, probe in (("w13_weight", w13, learned[0]), ("w2_weight", w2, learned[1])):
        try:
            terms = _expert_terms(probe, weight.shape[0], weight.device)
        except ValueError as err:
            raise refusal(layer_name, method, backend, str(err), MOE_SETTING) from None
        if is_checkpoint_order(terms):
            continue
        if not weight.is_contiguous():
            raise refusal(layer_name, method, backend, f"{leaf} is not contiguous storage",
                          MOE_SETTING)
        orders[leaf] = KernelOrder(backend, terms)
    biases = [b for b in ("w13_bias", "w2_bias") if b in params]
    if orders and biases:
        raise refusal(layer_name, method, backend, f"the layer has {biases}, whose order under "
                      f"this backend the refit does not know", MOE_SETTING)
    return orders


def storage_orders(model: torch.nn.Module, skip: Any = (), staged: Any = ()) -> dict[str, KernelOrder]:
    """``{param name: KernelOrder}`` of the params vLLM stores out of checkpoint order;
    raises ``KernelLayoutError`` for a layer whose storage order is not known. ``skip``:
    param names the refit never writes (vLLM's derived weights); ``staged``: names of the
    layers the refit writes in checkpoint order and converts with vLLM's own code after
    each refit (``receiver.staged_conversion``)."""
    staged = set(staged)
    orders: dict[str, KernelOrder] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        params = {n: p for n, p in module.named_parameters(recurse=False)
                  if (f"{name}.{n}" if name else n) not in skip}
        if method is None or not params:
            continue
        prefix = f"{name}." if name else ""
        kind = _name(method)
        if kind in ORDER_KEEPING_METHODS or name in staged:
            continue
        if kind == UNQUANTIZED_MOE_METHOD:
            orders.update({prefix + leaf: o for leaf, o in
                           _moe_orders(name, module, method, params).items()})
            continue
        is_moe = "w13_weight" in params
        backend = str(getattr(getattr(method, "fp8_backend", None), "name", None)
                      or _name(getattr(method, "moe_kernel", None) or getattr(method, "kernel", None)
                               or method))
        raise refusal(name, method, backend,
                      "vLLM's post-load step of quantized layers may transpose, repack or "
                      "requantize weights and scales per kernel; no order is learned for them "
                      "(block-FP8 layers are converted by receiver.staged_conversion, which "
                      "the worker runs; no other quantized method is)",
                      "serve this model unquantized (drop --quantization)"
                      + (f", and {MOE_SETTING}" if is_moe else ""))
    return orders


def padding_rows(order: Optional[KernelOrder], dim: int) -> Optional[int]:
    """First padded index of ``dim`` inside its first run (None: no padding on that dim)."""
    if order is None:
        return None
    pad = torch.nonzero(order.terms[dim] == PADDING).view(-1)
    return int(pad[0]) if pad.numel() else None


__all__ = ["KernelLayoutError", "learn_order", "padding_rows", "refusal", "storage_orders"]
