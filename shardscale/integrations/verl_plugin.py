"""Importing this module runs [`verl.install()`][install]: every verl FSDP engine (and,
where megatron-core is installed, every Megatron engine) built in this process then uses
shardscale's scaler and checkpoints it.

It exists to be named where verl imports modules for you, in every process (Ray workers too):

```bash
export VERL_USE_EXTERNAL_MODULES=shardscale.integrations.verl_plugin
python -m verl.trainer.main_ppo ...
```

That import side effect is its only purpose; elsewhere, call `install()` yourself.
"""

from __future__ import annotations

from shardscale.integrations.verl import install

install()
