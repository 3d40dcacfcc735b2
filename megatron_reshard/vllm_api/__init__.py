"""vLLM's weight-transfer API, both sides: the ``megatron_reshard`` backend.

The only package of the library that imports vLLM, and only in its modules (importing this
package imports nothing of vLLM, so vLLM's plugin loader pays for nothing else):

- ``plugin``: ``register()``, the ``vllm.general_plugins`` entry point
  (``megatron_reshard.vllm_api.plugin:register``); registers both engines below under the
  name ``megatron_reshard``.
- ``backend``: the worker side, ``MegatronReshardWeightTransferEngine`` (what
  ``WeightTransferConfig(backend="megatron_reshard")`` builds in each vLLM worker), over
  ``receiver.worker_state.RefitWorkerState``.
- ``trainer``: the trainer side, ``MegatronReshardTrainerWeightTransferEngine`` (what
  ``WeightTransferTrainerFactory.trainer_init`` returns), over ``megatron.sender.RefitSender``.

The ``collective_rpc`` worker extension (``worker_extension_cls=
"megatron_reshard.receiver.MegatronReshardWorkerExtension"``) imports no vLLM and stays in
``receiver``.
"""
