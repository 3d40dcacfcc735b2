"""A refit from a real megatron-core model into vLLM's own model classes, checked by vLLM.

One pool job (``vllm_refit_job``) plays a whole launch: ranks below ``cfg.train_world`` are
Megatron training ranks (``tools.e2e.run_training_rank``: the real ``RefitSender``), the
others are generation ranks, each running vLLM's own parallel state and model class
(``testing.vllm_models``) and receiving through the real worker extension.

After every refit each generation rank builds the oracle: a second instance of the same
vLLM model on the same rank, loaded by vLLM's ``load_weights`` from the full HF tensors
(gathered by the training side's reference, ``testing.megatron_reference``) and
post-processed by vLLM. Every parameter and buffer must be bit-equal, the tensors vLLM
derives after loading included, and each param must still live at the address vLLM gave
it (CUDA graphs capture addresses). The stand-in's expected shards (``testing.vllm_like``,
published by the training side as digests) are checked against the same live storage, so
the stand-in is shown to agree with vLLM on names, shapes and bytes.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from datetime import timedelta
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_reshard.tools.e2e import ModuleWorker, run_training_rank, tensor_digest
from megatron_reshard.tools.run_config import RefitRunConfig


def publish_full_hf(ctx: dict) -> None:
    """Training side, after each refit: rank 0 publishes the full HF tensors (the reference
    gather, a collective over the training world) as ``full/{step}``."""
    from megatron_reshard.testing.megatron_mamba import gather_nemotron_h_hf_state_dict
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict

    if ctx["family"] == "nemotron_h":  # a MambaModel: its own oracle (testing.megatron_mamba)
        full = gather_nemotron_h_hf_state_dict(ctx["model"], ctx["spec"].vocab_size)
    else:
        full = gather_full_hf_state_dict(ctx["model"], family=ctx["family"],
                                         vocab_size=ctx["spec"].vocab_size)
    if ctx["rank"] == 0:
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in full.items()}, buf)
        ctx["control"].set(f"full/{ctx['step']}", buf.getvalue())


def _plant_fault(model: torch.nn.Module, oracle: torch.nn.Module) -> list[str]:
    """The comparison's own check: one bit flipped in one param must be reported (by name
    and alone); the param is restored afterwards."""
    from megatron_reshard.testing.vllm_models import bitwise_differences

    name, param = max(model.named_parameters(), key=lambda np: np[1].numel())
    flat = param.data.view(-1).view(torch.uint8)
    flat[0] ^= 1
    try:
        return bitwise_differences(model, oracle) + [f"planted:{name}"]
    finally:
        flat[0] ^= 1


def _copy_derived_weights(model: torch.nn.Module) -> int:
    """Give MLA's absorbed weights storage of their own, as vLLM does for an FP8 ``kv_b_proj``
    (with BF16 they are views of it, so a refit in place would update them by itself)."""
    from megatron_reshard.receiver.derived import mla_layers

    copied = 0
    for _, holder, kv_b_proj in mla_layers(model):
        for attr in ("W_UK_T", "W_UV"):
            param = getattr(holder, attr)
            param.data = param.data.clone()
            copied += param.untyped_storage().data_ptr() != kv_b_proj.weight.untyped_storage().data_ptr()
    return copied


def _plant_order_error():
    """A mapping error on purpose: the receiver's storage orders with two rows of the first
    kernel-ordered target exchanged (the comparison with vLLM must see it)."""
    from megatron_reshard.receiver import worker_state as worker_module  # calls storage_orders
    from megatron_reshard.vllm_layout.kernel_order import KernelOrder

    learned = worker_module.storage_orders

    def planted(model, skip=(), staged=()):
        orders = dict(learned(model, skip=skip, staged=staged))
        name = min(orders)
        terms = list(orders[name].terms)
        rows = terms[1].clone()
        rows[[0, 1]] = rows[[1, 0]]
        terms[1] = rows
        orders[name] = KernelOrder(orders[name].backend, tuple(terms))
        return orders

    return worker_module, learned, planted


def _plant_staged_error():
    """A mapping error on purpose for a staged layer: the first FP8 expert layer is taken
    as stored in checkpoint order (its conversion skipped), as a refit that did not know
    vLLM's FP8 post-load would write it; the comparison with vLLM must see it."""
    from megatron_reshard.receiver import worker_state as worker_module

    learned = worker_module.staged_layers

    def planted(model, skip=()):
        layers = learned(model, skip=skip)
        moe = next(layer for layer in layers if "MoE" in layer.method)  # checkpoint or online
        moe.run = lambda ins: ins
        return layers

    return worker_module, learned, planted


@contextlib.contextmanager
def _planted_mamba_split_error(on: bool):
    """A mapping error on purpose while it is active: Nemotron-H's ``in_proj`` sent with each
    rank's B and C rows exchanged, as streams (exact path) or whole (``megatron.mamba``); the
    comparison with vLLM must see it. Restored on exit."""
    from megatron_reshard.megatron import mamba

    right_full, right_views = mamba.in_proj_full, mamba.stream_views

    def planted_full(chunks, d):
        z, x, b, c, dt = d.in_proj_rows(len(chunks))
        swapped = [torch.cat([t.split([z, x, b, c, dt])[i] for i in (0, 1, 3, 2, 4)]) for t in chunks]
        return right_full(swapped, d)

    def planted_views(hf_name, tensor, d, tp):
        views = right_views(hf_name, tensor, d, tp)
        names = list(views)
        if len(names) == len(mamba.IN_PROJ_STREAMS):  # in_proj: z, x, B, C, dt
            views[names[2]], views[names[3]] = views[names[3]], views[names[2]]
        return views

    if on:
        mamba.in_proj_full, mamba.stream_views = planted_full, planted_views
    try:
        yield
    finally:
        mamba.in_proj_full, mamba.stream_views = right_full, right_views


@contextlib.contextmanager
def _planted_interleave_error(on: bool):
    """A mapping error on purpose while it is active: gpt-oss's training-side views read
    Megatron's ``[gate ; up]`` rows as if they were interleaved already (the comparison with
    vLLM must see it). Restored on exit: pool workers run later jobs."""
    from megatron_reshard.megatron import gpt_oss

    right = gpt_oss.wire_view

    def planted(kind: str, tensor: torch.Tensor) -> torch.Tensor:
        if kind in ("oss_fc1", "oss_fc1_bias"):
            return tensor.view(tensor.shape[0] // 2, 2, *tensor.shape[1:])
        return right(kind, tensor)

    gpt_oss.wire_view = planted if on else right
    try:
        yield
    finally:
        gpt_oss.wire_view = right


@contextlib.contextmanager
def _patched_block_quantizer(on: bool):
    """While active, vLLM's ``per_block_cast_to_fp8`` as its online FP8 layers call it (the
    name in vLLM's ``quantization.online.fp8`` module) is a variant whose result differs in
    one element of every matrix (byte [0, 0] one step away, never NaN); yields
    ``{"calls": n}``. vLLM's own online loading (the oracle) and a receiver that calls
    vLLM's function both take the variant; anything else does not. Restored on exit."""
    calls = {"calls": 0}
    if not on:
        yield calls
        return
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8

    right = online_fp8.per_block_cast_to_fp8

    def variant(x, block_size=None, use_ue8m0=False):
        q, s = right(x, block_size=block_size, use_ue8m0=use_ue8m0)
        first = q.view(torch.uint8).view(-1)[:1]
        first ^= 1 if int(first) & 0x7F != 0x7E else 2  # 0x7F would be NaN
        calls["calls"] += 1
        return q, s

    online_fp8.per_block_cast_to_fp8 = variant
    try:
        yield calls
    finally:
        online_fp8.per_block_cast_to_fp8 = right


def _vllm_gen_rank(gen_rank: int, cfg: RefitRunConfig, control, hf_config: Mapping[str, Any],
                   vllm_port: int, plant_fault: bool, copy_derived: bool,
                   keep_as_loaded: Optional[list] = None,
                   moe_backend: Optional[str] = None, plant_order_error: bool = False,
                   as_moe_backend: Optional[str] = None, plant_staged_error: bool = False,
                   quantization: Optional[str] = None,
                   plant_interleave_error: bool = False,
                   write_outside: Optional[tuple[int, str]] = None,
                   patch_block_quantizer: bool = False) -> dict:
    from megatron_reshard.wire.codec import decode_payload
    from megatron_reshard.receiver.coverage import UncoveredParamsError
    from megatron_reshard.testing import vllm_models as vm

    t0 = time.perf_counter()
    payload = decode_payload(control.get("payload"))
    model_dir = vm.write_model_dir(hf_config)
    # one config per model instance: vLLM registers each attention layer in its config
    new_config = lambda: vm.vllm_config_for(model_dir, cfg.gen_tp, ep=cfg.gen_ep > 1,  # noqa: E731
                                            moe_backend=moe_backend, quantization=quantization)
    config = new_config()
    out: dict[str, Any] = {"role": "gen", "rank": gen_rank, "refits": [], "differences": [],
                           "stand_in_differences": [], "moved": [], "planted": None,
                           "patched_calls_in_refits": []}
    with _patched_block_quantizer(patch_block_quantizer) as patched, \
            vm.vllm_parallel_state(config, gen_rank, cfg.gen_world, vllm_port):
        model = vm.dummy_loaded_model(config)
        if as_moe_backend:  # the backend another platform would have selected (after loading)
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if hasattr(method, "unquantized_backend"):
                    method.unquantized_backend = type(method.unquantized_backend)[as_moe_backend]
                if hasattr(method, "fp8_backend"):  # vLLM's Fp8MoeBackend names
                    method.fp8_backend = type(method.fp8_backend)[as_moe_backend]
        out["copied_derived"] = _copy_derived_weights(model) if copy_derived else 0
        addresses = {n: t.data_ptr() for n, t in vm.model_tensors(model).items()}
        worker = ModuleWorker(model)
        worker.init_refit_groups(cfg.host, list(cfg.ports[1:1 + cfg.train_pp]), None,
                                 cfg.stage_world + cfg.gen_world, cfg.backend, cfg.timeout_s)
        options = {"verify_checksums": cfg.verify, "staging_bytes": cfg.staging_bytes}
        if keep_as_loaded is not None:
            options["keep_as_loaded"] = list(keep_as_loaded)
        if plant_order_error:
            module, learned, planted = _plant_order_error()
            module.storage_orders = planted
        if plant_staged_error:
            staged_module, staged_learned, staged_planted = _plant_staged_error()
            staged_module.staged_layers = staged_planted
        try:
            out["summary"] = worker.prepare_refit(payload, options)
        except UncoveredParamsError as exc:  # the case under test; the training ranks raise it too
            out["prepare_error"] = f"{type(exc).__name__}: {exc}"
            time.sleep(2)  # keep the process's groups up while the peers read the board
            return out
        finally:
            if plant_order_error:
                module.storage_orders = learned
            if plant_staged_error:
                staged_module.staged_layers = staged_learned
        session = worker.refit_worker_state.require_session()
        out["kernel_orders"] = {n: o.backend for n, o in session.targets.orders.items()}
        out["setup_s"] = time.perf_counter() - t0
        # params the payload leaves as loaded (the user's list): no oracle loads them, so
        # they are compared with what they held before the refits
        kept = out["summary"]["kept_as_loaded"]
        # an FP8 model's KV-cache scales: no refit target, no checkpoint value (vm.KV_CACHE_SCALES)
        kv_scales = {n: tensor_digest(t) for n, t in vm.model_tensors(model).items()
                     if n.endswith(vm.KV_CACHE_SCALES)}
        out["kv_scales_changed"] = []
        live = dict(model.named_parameters())
        before = {n: tensor_digest(live[n]) for n in kept}
        out["kept_changed"] = []
        for step in range(cfg.refits):
            if write_outside is not None and step == write_outside[0]:
                with torch.no_grad():  # two elements written outside the refits
                    flat = live[write_outside[1]].view(-1)
                    flat[7:9] = flat[7:9] * 2 + 1
            calls = patched["calls"]
            stats = worker.refit()
            out["patched_calls_in_refits"].append(patched["calls"] - calls)
            worker.check_refit_weights_consistent()
            out["refits"].append(stats)
            full = torch.load(io.BytesIO(control.get(f"full/{step}")), weights_only=True)
            if "quantization_config" in hf_config:  # vLLM loads the block-FP8 checkpoint
                full = vm.fp8_checkpoint(full)
            oracle = vm.loaded_model(new_config(), full, may_miss=kept)
            out["differences"].append([n for n in vm.bitwise_differences(model, oracle)
                                       if n not in kept and n not in kv_scales])
            out["kv_scales_changed"].append(sorted(n for n, t in vm.model_tensors(model).items()
                                                   if n in kv_scales and tensor_digest(t) != kv_scales[n]))
            out["kept_changed"].append(sorted(n for n in kept if tensor_digest(live[n]) != before[n]))
            out["moved"].append(sorted(n for n, t in vm.model_tensors(model).items()
                                       if addresses.get(n) != t.data_ptr()))
            if cfg.verify:  # the stand-in's expected shards against the same live storage
                expected = json.loads(control.get(f"expected/{step}/{gen_rank}"))
                out["stand_in_differences"].append(_stand_in_differences(
                    model, expected, skip=set(kept) | set(out["kernel_orders"])))
            if plant_fault and step == cfg.refits - 1 and gen_rank == 0:
                out["planted"] = _plant_fault(model, oracle)
            del oracle
        out["weights"] = worker.refit_weights_state()
        out["report"] = worker.report()
        worker.destroy_refit_groups(cfg.timeout_s)
    return out


def _stand_in_differences(model: torch.nn.Module, expected: Mapping[str, str],
                          skip=()) -> list[str]:
    """Where the stand-in's expected shards (``{vLLM name: digest}``) and vLLM's live storage
    disagree: a name vLLM does not have, other bytes, or a vLLM param (not derived) that the
    stand-in lacks. The stand-in names experts flat (``mlp.experts.w13_weight``, older
    vLLM); vLLM 0.33 nests them (``mlp.experts.routed_experts.w13_weight``). ``skip``: params
    vLLM keeps in a kernel's order (the stand-in holds checkpoint order)."""
    from megatron_reshard.receiver.derived import derived_param_names

    live = dict(model.named_parameters())
    as_vllm = {}
    for name, digest in expected.items():
        nested = name.replace(".mlp.experts.", ".mlp.experts.routed_experts.")
        as_vllm[name if name in live or nested not in live else nested] = digest
    as_vllm = {n: d for n, d in as_vllm.items() if n not in skip}
    bad = sorted(n for n, digest in as_vllm.items()
                 if n not in live or tensor_digest(live[n]) != digest)
    derived = derived_param_names(model)
    bad += sorted(f"{n} (not in the stand-in)" for n in live
                  if n not in derived and n not in as_vllm and n not in skip)
    return bad


def vllm_refit_job(job, cfg: RefitRunConfig, hf_config: Mapping[str, Any],
                   model_builder=None, plant_fault: bool = False, copy_derived: bool = False,
                   keep_as_loaded: Optional[list] = None,
                   moe_backend: Optional[str] = None, plant_order_error_on: Optional[int] = None,
                   as_moe_backend: Optional[str] = None,
                   plant_staged_error_on: Optional[int] = None,
                   quantization: Optional[str] = None,
                   plant_interleave_error: bool = False,
                   write_outside_on: Optional[tuple[int, int, str]] = None,
                   plant_mamba_split_error: bool = False,
                   patch_block_quantizer: bool = False) -> dict:
    """Pool job (``WorkerPool.run(..., num_ports=cfg.train_pp + 2)``): process ``job.rank`` of
    a launch of ``train_world + gen_world``; the last port is vLLM's generation world.
    ``plant_fault``: gen rank 0 checks that the comparison sees a flipped bit;
    ``copy_derived``: MLA's absorbed weights get storage of their own before the refits;
    ``keep_as_loaded``: prepare_refit's option (an ``UncoveredParamsError`` at prepare is
    returned as the gen rank's ``prepare_error``);
    ``moe_backend``: vLLM's ``--moe-backend`` of the generation model (FlashInfer on the CPU:
    ``testing.vllm_models``); ``plant_order_error_on``: that gen rank's receiver takes a
    wrong kernel order (two rows exchanged), which the comparison must report;
    ``as_moe_backend``: the generation models' MoE layers report that backend (a name of
    vLLM's ``UnquantizedMoeBackend``, or ``Fp8MoeBackend`` for FP8 layers) to the receiver; ``plant_staged_error_on``: that gen
    rank skips vLLM's conversion of its first FP8 expert layer (``hf_config`` with a
    ``quantization_config``: vLLM's block-FP8 model, the oracle loading the block-FP8
    checkpoint of the full tensors); ``quantization``: vLLM's ``--quantization`` of the
    generation models (``"fp8_per_block"``: vLLM quantizes the BF16 weights online, the
    oracle loading the BF16 tensors); ``plant_interleave_error``: the training ranks send
    gpt-oss's gate/up rows uninterleaved (``_planted_interleave_error``);
    ``plant_mamba_split_error``: they send Nemotron-H's in_proj with B and C exchanged
    (``_planted_mamba_split_error``);
    ``write_outside_on``: (gen rank, refit index, vLLM param name): before that refit, that
    gen rank writes two elements of the param outside the refits (a delta's base no longer
    what was committed);
    ``patch_block_quantizer``: every generation rank runs with vLLM's online FP8 quantizer
    replaced by a variant one element off (``_patched_block_quantizer``): the refit and the
    oracle must still agree, and ``patched_calls_in_refits`` counts the receiver's calls."""
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": tuple(job.ports[: 1 + cfg.train_pp])})
    control = dist.TCPStore(cfg.host, cfg.ports[0], cfg.train_world + cfg.gen_world, job.rank == 0,
                            timeout=timedelta(seconds=cfg.timeout_s))
    if job.rank < cfg.train_world:
        with _planted_interleave_error(plant_interleave_error), \
                _planted_mamba_split_error(plant_mamba_split_error):
            return run_training_rank(job.rank, cfg, control, torch.device("cpu"), model_builder,
                                     after_each_refit=publish_full_hf)
    gen_rank = job.rank - cfg.train_world
    return _vllm_gen_rank(gen_rank, cfg, control, hf_config, job.ports[1 + cfg.train_pp],
                          plant_fault, copy_derived, keep_as_loaded, moe_backend,
                          plant_order_error_on == gen_rank, as_moe_backend,
                          plant_staged_error_on == gen_rank, quantization,
                          write_outside=write_outside_on[1:] if write_outside_on and
                          write_outside_on[0] == gen_rank else None,
                          patch_block_quantizer=patch_block_quantizer)




def kernel_orders_job(job, hf_config: Mapping[str, Any], moe_backend: str,
                      as_backends: tuple = ()) -> dict:
    """Pool job (one process, ``num_ports=1``): vLLM's model built with ``moe_backend`` and
    post-processed by vLLM; what ``receiver.kernel_layouts.storage_orders`` says of it, then
    of the same live layers with their backend set to each of ``as_backends`` (names of
    vLLM's ``UnquantizedMoeBackend``, as another platform would select them): the refusal
    message, or None if not refused."""
    from megatron_reshard.receiver.derived import mla_layers
    from megatron_reshard.receiver.kernel_layouts import KernelLayoutError, storage_orders
    from megatron_reshard.testing import vllm_models as vm

    config = vm.vllm_config_for(vm.write_model_dir(hf_config), 1, moe_backend=moe_backend)
    out: dict[str, Any] = {"refused": {}}
    with vm.vllm_parallel_state(config, 0, 1, job.ports[0]):
        model = vm.dummy_loaded_model(config)
        out["orders"] = {n: o.backend for n, o in storage_orders(model).items()}
        out["mla_layers"] = [n for n, _, _ in mla_layers(model)]
        methods = [m.quant_method for m in model.modules()
                   if type(getattr(m, "quant_method", None)).__name__ == "UnquantizedFusedMoEMethod"]
        chosen = methods[0].unquantized_backend
        for name in as_backends:
            for method in methods:
                method.unquantized_backend = type(chosen)[name]
            try:
                storage_orders(model)
                out["refused"][name] = None
            except KernelLayoutError as err:
                out["refused"][name] = str(err)
        for method in methods:
            method.unquantized_backend = chosen
        out["quantized"] = _quantized_refusals(model, storage_orders, KernelLayoutError)
        out["cpu_prepack"] = _cpu_prepack_refusal(config.model_config.model, storage_orders,
                                                  KernelLayoutError)
    return out


def _cpu_prepack_refusal(model_dir: str, storage_orders, error) -> Optional[str]:
    """The default (CPU) backend's model, its experts' own post-load step (vLLM's prepack,
    set aside by the CPU shim) put back: the refusal message, or None."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    from megatron_reshard.testing import vllm_models as vm

    model = vm.dummy_loaded_model(vm.vllm_config_for(model_dir, 1))
    shim = cpu_moe.CPUUnquantizedExperts.process_weights_after_loading
    cpu_moe.CPUUnquantizedExperts.process_weights_after_loading = vm.CPU_EXPERTS_PREPACK
    try:
        storage_orders(model)
        return None
    except error as err:
        return str(err)
    finally:
        cpu_moe.CPUUnquantizedExperts.process_weights_after_loading = shim


def _quantized_refusals(model: torch.nn.Module, storage_orders, error) -> dict:
    """The refusal of block-FP8 layers: vLLM's ``Fp8MoEMethod`` (its backend set to FlashInfer
    CUTLASS, Hopper's EP default) on the first expert layer, then ``Fp8LinearMethod`` on the
    first linear layer, each in turn in place of the live method: the learned orders alone
    refuse them (the worker's staged path converts them); ``{"moe" | "linear": message or None}``."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod

    def first(kind: str):
        return next(m for m in model.modules()
                    if type(getattr(m, "quant_method", None)).__name__ == kind
                    and any(True for _ in m.parameters(recurse=False)))

    out = {}
    for key, layer, cls in (("moe", first("UnquantizedFusedMoEMethod"), Fp8MoEMethod),
                            ("linear", first("UnquantizedLinearMethod"), Fp8LinearMethod)):
        live, method = layer.quant_method, cls.__new__(cls)
        if key == "moe":  # vLLM's MoE methods are modules: held here as a plain attribute
            object.__setattr__(method, "fp8_backend", Fp8MoeBackend.FLASHINFER_CUTLASS)
        child = layer._modules.pop("quant_method", None)
        object.__setattr__(layer, "quant_method", method)
        try:
            storage_orders(model)
            out[key] = None
        except error as err:
            out[key] = str(err)
        finally:
            object.__delattr__(layer, "quant_method")
            if child is not None:
                layer._modules["quant_method"] = child
            else:
                layer.quant_method = live
    return out


__all__ = ["kernel_orders_job", "publish_full_hf", "vllm_refit_job"]
