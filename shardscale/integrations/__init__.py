"""Adapters for frameworks whose hooks need more than swapping the scaler object.

Import the one you use; each imports its framework, which shardscale itself never needs:
`shardscale.integrations.lightning` (Fabric and Trainer precision plugins),
`shardscale.integrations.accelerate` (accelerate, and the transformers/TRL Trainer),
`shardscale.integrations.verl` (verl's FSDP and Megatron engines),
`shardscale.integrations.torchtitan` (torchtitan's trainer), `shardscale.integrations.megatron`
(Megatron-core's fp16 optimizers).
Frameworks that call torch's scaler protocol and nothing more need no adapter: set the scaler
(docs/index.md, the frameworks table).
"""
