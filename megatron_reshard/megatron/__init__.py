"""Train side: meshes from ``parallel_state``, Megatron → HF names, local views, wire payload.

A training loop, on every train rank, after ``initialize_model_parallel`` and model
construction::

    from megatron_reshard.megatron import MegatronRefitSource

    source = MegatronRefitSource(model, gen_parallelism={"tp_size": 2, "ep_size": 1, "pp_size": 1},
                                 gen_world_size=2, family="qwen3", vocab_size=tokenizer_vocab)
    payload: bytes = source.payload_bytes()             # identical on every train rank
    param_map = source.build_hf_to_local_param_map()    # HFToLocalParamMap of live views
    others = source.gather_other_params()               # {hf_name: full tensor}, this stage
    hf_config = source.hf_config                        # plain dict, keys in source.HF_CONFIG_KEYS
    plan = source.plan                                  # the frozen TrainSidePlan behind them all
    sender = RefitSender(source, group)                 # megatron.sender; takes the source or plan

The source is a thin face over ``train_plan.build_train_side_plan`` (a chain of plain
functions returning one frozen ``TrainSidePlan``).

Submodules import ``megatron.core`` only when used. The payload's codec is
``megatron_reshard.wire.codec`` (the receiver decodes payloads without Megatron);
``decode_payload`` / ``encode_payload`` here are its functions.
"""

from __future__ import annotations

__all__ = ["MegatronRefitSource", "HF_CONFIG_KEYS", "TrainSidePlan", "build_train_side_plan",
           "decode_payload", "encode_payload"]


# Lazy on purpose (optional dependencies, not a cycle): importing this package must not
# import megatron.core (``source``). Each name loads its module on use.
def __getattr__(name: str):
    if name == "MegatronRefitSource":
        from megatron_reshard.megatron import source

        return source.MegatronRefitSource
    if name in ("TrainSidePlan", "build_train_side_plan"):
        from megatron_reshard.megatron import train_plan

        return getattr(train_plan, name)
    if name == "HF_CONFIG_KEYS":
        from megatron_reshard.megatron import model_info

        return model_info.HF_CONFIG_KEYS
    if name in ("decode_payload", "encode_payload"):
        from megatron_reshard.wire import codec

        return getattr(codec, name)
    raise AttributeError(name)
