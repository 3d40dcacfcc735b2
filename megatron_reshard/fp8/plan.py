"""Where each linear weight of a block-FP8 refit is quantized, decided from the refit info.

Torch + stdlib only (the training side plans, the receiver reads the result). A block-FP8
generation model (vLLM's ``Fp8LinearMethod`` / ``Fp8MoEMethod`` with ``weight_block_size``
[128, 128]) holds each linear weight as ``float8_e4m3fn`` plus an fp32 ``weight_scale_inv``
with one entry per 128×128 tile. Embeddings, lm_head, norms, router and biases stay BF16.

``plan_block_fp8(info, stage_world)`` returns new refit info (``wire.RefitPayload``; the
records are frozen, the input is not changed) with the bulk entries planned:

- every generation rank's region of a linear weight must be made of whole tiles (a split
  that cuts a tile is refused here, before any collective: vLLM could not hold it either);
- where every training rank's region is made of whole tiles too, the weight is quantized
  on the sending side: its entry's wire dtype becomes ``float8_e4m3fn`` (``"gen_quant":
  "sender"``) and a scale entry ``<name>_scale_inv`` (fp32, same meshes, the placements in
  tiles, shape ``blockwise_scale_shape``) follows it; about half the bytes of BF16 travel, and a
  shard quantized on its own gives exactly the bytes of the same tiles of the full tensor
  (``quant.owns_whole_blocks``);
- otherwise the weight travels in BF16 (``"gen_quant": "receiver"``) and the receiver
  quantizes its region (whole tiles, checked above) into the FP8 storage.

vLLM's online block FP8 (``--quantization fp8_per_block``) is planned by
``plan_block_fp8_online`` (the trainer's ``gen_quant="block_fp8_online"``): every linear
weight travels in BF16 and the receiver quantizes it with vLLM's own function; a
sender-quantized weight is refused there (``receiver.online_quant``).

Wire forms whose tiles are not the HF tensor's tiles (q/k/v per KV group with rows per
group not a multiple of 128) are quantized on the receiver, which sees HF rows.

A scale entry's placements are the weight's with every explicit size along the last two
dims counted in tiles (``scale_placements``: a ``BlockShard``'s row blocks, e.g. q/k/v rows
of a KV group cut by training TP, become tile blocks); ``scale_layout_problems`` then checks,
rank by rank on both sides, that the scale region is exactly the tiles of the weight region.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Sequence

from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout.geometry import box_numel, rank_region
from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.placements import BlockShard, PaddedShard
from megatron_reshard.fp8.quant import BLOCK_FP8_TILE, blockwise_scale_shape, owns_whole_blocks
from megatron_reshard.vllm_layout.dense import is_qkv_per_group, per_group_as_hf_rows
from megatron_reshard.wire.records import ParamRecord, RefitPayload

FP8_WIRE_DTYPE = "torch.float8_e4m3fn"
SCALE_WIRE_DTYPE = "torch.float32"
SCALE_SUFFIX = "_scale_inv"
GEN_QUANT_FORMATS = ("block_fp8", "block_fp8_online", "mxfp8")
MXFP8_TILE = (1, 32)  # MXFP8: one E8M0 scale per 32 elements of a row

# linear weights vLLM quantizes (dense, fused parts, grouped experts); not router/gates/vocab
LINEAR_WEIGHT_RE = re.compile(r"\.(?:q|k|v|o|gate|up|down)_proj\.weight$")


class Fp8SplitError(BadInputError):
    """A generation split cuts a 128×128 FP8 tile (raised before any communication)."""


def scale_name(weight_name: str) -> str:
    """``...weight`` -> ``...weight_scale_inv`` (HF and vLLM block-FP8 naming)."""
    return weight_name + SCALE_SUFFIX


def is_quantizable(name: str, global_shape: Sequence[int]) -> bool:
    return len(global_shape) >= 2 and bool(LINEAR_WEIGHT_RE.search(name))


def _tiles_are_hf_tiles(name: str, shape: Sequence[int], tile: Sequence[int]) -> bool:
    """Whether the wire form's tiles over its last two dims are the HF tensor's tiles.

    q/k/v sent per KV group (``[groups, rows per group, H]``, a row-major reshape of HF
    rows) keep HF tiles only when a group's rows are whole tiles.
    """
    if is_qkv_per_group(name, shape):
        return int(shape[1]) % tile[0] == 0
    return True


def _regions(entry: ParamRecord, side: str) -> dict[int, tuple]:
    mesh, placements = entry.mesh(side), entry.placements(side)
    out = {}
    for rank in mesh.ranks():
        got = rank_region(entry.global_shape, mesh, placements, int(rank))
        if got is not None:
            out[int(rank)] = got[0]
    return out


def _cut(region: tuple, shape: Sequence[int], tile: Sequence[int]) -> Optional[str]:
    """Why ``region`` is not made of whole tiles of the last two dims (None when it is)."""
    for d, block in ((len(shape) - 2, tile[0]), (len(shape) - 1, tile[1])):
        a, b = region[d]
        if b > a and not owns_whole_blocks(a, b - a, int(shape[d]), block):
            return (f"dim {d} [{a}, {b}) of {int(shape[d])}: expected a start at a multiple of "
                    f"{block} and an end at a multiple of {block} or at {int(shape[d])}")
    return None


def _bound_in_tiles(bound: int, extent: int, block: int) -> Optional[int]:
    """A boundary of a dim of ``extent`` counted in tiles: None when it cuts a tile."""
    if bound % block == 0:
        return bound // block
    return -(-extent // block) if bound == extent else None


def _sizes_in_tiles(sizes: Sequence[int], extent: int, block: int, where: str) -> tuple:
    bounds, acc = [0], 0
    for n in sizes:
        acc += int(n)
        bounds.append(acc)
    if acc != extent:
        raise Fp8SplitError(f"{where}: block sizes {list(sizes)} add up to {acc}, expected the "
                            f"dim's {extent}")
    tiles = [_bound_in_tiles(b, extent, block) for b in bounds]
    for i, t in enumerate(tiles):
        if t is None:
            raise Fp8SplitError(f"{where}: block sizes {list(sizes)} of a dim of {extent} put a "
                                f"boundary at {bounds[i]} (after mesh coordinate {i - 1}), which "
                                f"cuts a {block}-element FP8 block: expected every boundary at a "
                                f"multiple of {block} or at {extent}")
    return tuple(b - a for a, b in zip(tiles, tiles[1:]))


def scale_placements(placements: Sequence, weight_shape: Sequence[int],
                     tile: Sequence[int] = BLOCK_FP8_TILE, where: str = "scale placements") -> list:
    """The placements of a weight's block scales (``blockwise_scale_shape``), from the weight's.

    ``Shard``/``Replicate`` stay: ``torch.chunk`` rules over whole tiles give the same split
    counted in tiles. Explicit sizes along the last two dims are converted: a ``BlockShard``'s
    block sizes (weight rows -> tiles), a ``PaddedShard``'s padded size. Leading dims (MoE
    experts) keep theirs. Instances stay instances, wire dicts stay dicts. A block boundary
    that cuts a tile raises ``Fp8SplitError`` (such a weight is not quantized on the sender).
    """
    ndim = len(weight_shape)
    tiled = {ndim - 2: int(tile[0]), ndim - 1: int(tile[1])}
    out = []
    for p in placements:
        if isinstance(p, dict):
            d = p.get("dim")
            if d is None or int(d) % ndim not in tiled:
                out.append(dict(p))
                continue
            d = int(d) % ndim
            block = tiled[d]
            if p.get("blocks") is not None:
                sizes = _sizes_in_tiles(p["blocks"], int(weight_shape[d]), block, f"{where} (dim {d})")
                out.append({**p, "blocks": list(sizes)})
            elif p.get("padded") is not None:
                out.append({**p, "padded": _padded_in_tiles(int(p["padded"]), block, where, d)})
            else:
                out.append(dict(p))
        elif isinstance(p, BlockShard) and int(p.dim) % ndim in tiled:
            d = int(p.dim) % ndim
            out.append(BlockShard(p.dim, _sizes_in_tiles(p.sizes, int(weight_shape[d]), tiled[d],
                                                          f"{where} (dim {d})")))
        elif isinstance(p, PaddedShard) and int(p.dim) % ndim in tiled:
            d = int(p.dim) % ndim
            out.append(PaddedShard(p.dim, _padded_in_tiles(int(p.padded_size), tiled[d], where, d)))
        elif isinstance(p, (Shard, Replicate, BlockShard, PaddedShard)):
            out.append(p)
        else:
            raise Fp8SplitError(f"{where}: unsupported placement {p!r} (expected Shard, Replicate, "
                                f"BlockShard, PaddedShard or their wire forms)")
    return out


def _padded_in_tiles(padded: int, block: int, where: str, d: int) -> int:
    if padded % block:
        raise Fp8SplitError(f"{where}: padded shard of dim {d} to {padded}, which is not whole "
                            f"{block}-element FP8 blocks: expected a multiple of {block}")
    return padded // block


def tile_box(region: Sequence, shape: Sequence[int], tile: Sequence[int] = BLOCK_FP8_TILE) -> tuple:
    """The tiles (last two dims; leading dims kept) that a whole-tile ``region`` covers; a
    bound that cuts a tile is None."""
    out = [tuple(r) for r in region[:-2]]
    for d, block in ((len(shape) - 2, tile[0]), (len(shape) - 1, tile[1])):
        out.append(tuple(_bound_in_tiles(x, int(shape[d]), block) for x in region[d]))
    return tuple(out)


def scale_layout_problems(weight: ParamRecord, scale: ParamRecord, stage_world: int,
                          tile: Sequence[int] = BLOCK_FP8_TILE) -> list[str]:
    """Ranks (both sides) whose region of the scale entry is not the tiles of their region of
    the weight entry, one line each (param, rank, expected, found); empty when all match."""
    problems = []
    w_shape, s_shape = weight.global_shape, scale.global_shape
    for side, label, offset in (("src", "training rank", 0), ("dst", "generation rank", stage_world)):
        mesh = weight.mesh(side)
        for rank in mesh.ranks():
            who = f"{scale.name}: {label} {int(rank) - offset}"
            w = rank_region(w_shape, mesh, weight.placements(side), int(rank))
            try:
                s = rank_region(s_shape, scale.mesh(side), scale.placements(side), int(rank))
            except ValueError as err:
                problems.append(f"{who}: its scale placements are invalid for scales of "
                                f"{list(s_shape)}: {err}")
                continue
            if w is None or s is None:
                if (w is None) != (s is None):
                    problems.append(f"{who}: is in the {side} mesh of only one of the weight and "
                                    f"its scales")
                continue
            if not box_numel(w[0]) or not box_numel(s[0]):
                found_empty, want_empty = not box_numel(s[0]), not box_numel(w[0])
                if found_empty != want_empty:
                    problems.append(f"{who}: holds weight region {[list(r) for r in w[0]]} but "
                                    f"scale region {[list(r) for r in s[0]]} of {list(s_shape)}")
                continue
            want = tile_box(w[0], w_shape, tile)
            if any(x is None for r in want for x in r) or tuple(s[0]) != want:
                problems.append(f"{who}: holds weight region {[list(r) for r in w[0]]} of "
                                f"{list(w_shape)}, so expected scale region "
                                f"{[list(r) for r in want]}, found {[list(r) for r in s[0]]} of "
                                f"{list(s_shape)}")
    return problems


def _placed_scales(weight: ParamRecord, scale: ParamRecord, shape: tuple, tile: Sequence[int],
                   stage_world: int) -> tuple[ParamRecord, list[str]]:
    """``scale`` with the weight's placements in tile units, and the problems found checking
    them rank by rank (the refusal is raised with every other problem)."""
    try:  # explicit sizes in weight rows -> tiles
        scale = dataclasses.replace(scale, **{
            f"{side}_placements": tuple(scale_placements(
                weight.placements(side), shape, tile, f"{scale.name}: {side} placements"))
            for side in ("src", "dst")})
    except Fp8SplitError as err:
        return scale, [str(err)]
    return scale, scale_layout_problems(weight, scale, stage_world, tile)


def plan_mxfp8(info: Any, stage_world: int) -> tuple[RefitPayload, dict]:
    """MXFP8 generation (vLLM ModelOpt MXFP8, NeMo-RL's ``is_mx``): every linear weight travels
    in BF16 and the receiver quantizes its region (32-element row blocks, E8M0 scales); a
    generation split that cuts a 32-element block is refused here. Returns the planned
    refit info and the counts, as ``plan_block_fp8``."""
    planned, counts = plan_block_fp8(info, stage_world, MXFP8_TILE, sender=False)
    return dataclasses.replace(planned, gen_quant={"format": "mxfp8",
                                                    "block": list(MXFP8_TILE)}), counts


def plan_block_fp8_online(info: Any, stage_world: int) -> tuple[RefitPayload, dict]:
    """vLLM's online block FP8 (``--quantization fp8_per_block``: vLLM quantizes the BF16
    weights itself while loading): every linear weight travels in BF16 and the receiver
    quantizes its region with vLLM's own ``per_block_cast_to_fp8`` (``receiver.online_quant``:
    there vLLM's function is the reference, and the trainer's quantizer gave other bytes on
    a GPU). A generation split that cuts a 128x128 block is refused here, as for
    ``plan_block_fp8``. Returns the planned refit info and the counts."""
    planned, counts = plan_block_fp8(info, stage_world, BLOCK_FP8_TILE, sender=False)
    return dataclasses.replace(planned, gen_quant={"format": "block_fp8",
                                                    "block": list(BLOCK_FP8_TILE),
                                                    "quantized_by": "receiver"}), counts


def plan_block_fp8(info: Any, stage_world: int, tile: tuple[int, int] = BLOCK_FP8_TILE,
                   train_fp8: frozenset = frozenset(), sender: bool = True
                   ) -> tuple[RefitPayload, dict]:
    """The refit ``info`` (records, or a dict parsed here) planned for a block-FP8
    generation model (see module doc), and the counts per decision.

    ``stage_world``: training ranks per PP stage (generation ranks follow them in each
    group; errors name generation ranks from 0). ``train_fp8``: names of the weights the
    training side already holds in blockwise FP8 (bytes + per-tile scales of each local
    shard): their bytes and scales travel as they are (``"gen_quant": "train_fp8"``), which
    needs every training shard to be whole tiles too.
    """
    info = RefitPayload.of(info)
    counts = {"sender": 0, "receiver": 0, "train_fp8": 0}
    problems: list[str] = []
    per_layer = dict(info.per_layer_params)
    for layer in info.layer_names:
        out: list[ParamRecord] = []
        for p in per_layer.get(layer, ()):
            if not is_quantizable(p.name, p.global_shape) or p.gen_quant:
                out.append(p)
                continue
            shape = p.global_shape
            per_group = is_qkv_per_group(p.name, shape)
            gen_cut = False
            for rank, region in sorted(_regions(p, "dst").items()):
                hf_shape, hf_region = (per_group_as_hf_rows(shape, region) if per_group
                                       else (shape, region))
                why = _cut(hf_region, hf_shape, tile)
                if why:
                    gen_cut = True
                    problems.append(f"{p.name}: generation rank {rank - stage_world} would hold "
                                    f"HF region {[list(r) for r in hf_region]} of {list(hf_shape)}, "
                                    f"which cuts a {tile[0]}x{tile[1]} FP8 block ({why})")
            src_cuts = {rank: why for rank, region in _regions(p, "src").items()
                        if (why := _cut(region, shape, tile))}
            src_whole = _tiles_are_hf_tiles(p.name, shape, tile) and not src_cuts
            if p.name in train_fp8 and not src_whole:
                rank, why = next(iter(sorted(src_cuts.items()))) if src_cuts else (0, (
                    f"rows per KV group {shape[1]} are not whole {tile[0]}-row blocks"))
                problems.append(f"{p.name}: held in blockwise FP8 for training, but training "
                                f"rank {rank} of its stage holds a shard that cuts a {tile[0]}x"
                                f"{tile[1]} block ({why}); its scales cannot be moved as they are")
                out.append(p)
                continue
            if not src_whole or not sender:
                out.append(dataclasses.replace(p, gen_quant="receiver"))
                counts["receiver"] += 1
                continue
            mode = "train_fp8" if p.name in train_fp8 else "sender"
            # the sender quantizes from the old wire dtype; FP8 bytes travel
            weight = dataclasses.replace(p, gen_quant=mode, wire_weight_dtype=p.dtype,
                                         dtype=FP8_WIRE_DTYPE)
            scale = dataclasses.replace(
                p, name=scale_name(p.name), global_shape=blockwise_scale_shape(shape, tile),
                dtype=SCALE_WIRE_DTYPE, gen_quant="scale", scale_of=p.name, weight_shape=shape,
                wire_weight_dtype=None)
            if not gen_cut:  # (a cut generation split is listed above already)
                scale, found = _placed_scales(weight, scale, shape, tile, stage_world)
                problems += found
            out += [weight, scale]
            counts[mode] += 1
        per_layer[layer] = out
    if problems:
        raise Fp8SplitError(f"FP8 generation layout refused (vLLM's FP8 linear layers hold whole "
                            f"{tile[0]}x{tile[1]} blocks on every rank):\n  - " + "\n  - ".join(problems))
    planned = info.with_params(info.layer_names, per_layer,
                               gen_quant={"format": "block_fp8", "block": list(tile)})
    return planned, counts


__all__ = [
    "FP8_WIRE_DTYPE", "Fp8SplitError", "GEN_QUANT_FORMATS", "MXFP8_TILE", "SCALE_SUFFIX",
    "SCALE_WIRE_DTYPE", "is_quantizable", "plan_block_fp8", "plan_block_fp8_online", "plan_mxfp8",
    "scale_layout_problems", "scale_name", "scale_placements", "tile_box",
]
