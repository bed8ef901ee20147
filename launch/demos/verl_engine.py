"""verl's real FSDP engine on CPU ranks (gloo), for the verl demo (``verl_scaler.py``).

verl (0.9.1) runs on GPUs and NPUs. To run its ``FSDPEngineWithLMHead`` on CPU ranks, this module
registers the CPU platform verl lacks (it would fall back to CUDA), and works around what verl
assumes of GPUs: flash attention (eager here), FSDP1's ``sync_module_states`` with CPU modules,
moving an FSDP1 model "to the GPU" before saving, and an import of a class trl 1.16 no longer has.
None of it is needed on GPUs; none of it touches the scaler.

Call :func:`prepare_verl_on_cpu` before importing anything from ``verl.workers.engine``.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from functools import partial
from typing import Any

import _common
import torch
import torch.distributed as dist

VOCAB = 128


class _CPUDeviceModule:
    """``torch.cpu``, plus the few ``torch.cuda`` functions verl calls on its device module."""

    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)
    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)
    empty_cache = staticmethod(lambda: None)
    memory_allocated = staticmethod(lambda *args, **kwargs: 0)
    memory_reserved = staticmethod(lambda *args, **kwargs: 0)
    mem_get_info = staticmethod(lambda *args, **kwargs: (0, 0))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


def prepare_verl_on_cpu() -> None:
    """Register and select a CPU platform for verl, and apply the CPU workarounds."""
    import torch.distributed.fsdp._init_utils as fsdp_init
    import verl.models.transformers.monkey_patch as monkey_patch
    from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

    class PlatformCPU(PlatformBase):  # type: ignore[misc]
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: _CPUDeviceModule())

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: Any) -> None:
            pass

        def synchronize(self, device_index: Any = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: Any) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> Any:
            return nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    PlatformRegistry.register(platform="cpu")(PlatformCPU)
    set_platform(PlatformCPU())
    # verl asks sync_module_states=True of FSDP1, which refuses it for modules on the CPU
    fsdp_init._check_module_states_for_sync_module_states = lambda module_states: None
    monkey_patch.is_trl_available = lambda: False  # verl imports a class trl 1.16 dropped
    import verl.workers.engine.fsdp.transformer_impl as transformer_impl

    transformer_impl.load_fsdp_model_to_gpu = lambda module: None  # "cpu:cpu" on a CPU


def tiny_model(folder: str) -> str:
    """A tiny randomly initialised Qwen2 saved in ``folder`` (rank 0 writes; no download)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = os.path.join(folder, "tiny_qwen2")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        config = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            architectures=["Qwen2ForCausalLM"],
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    dist.barrier()
    return path


def build_engine(model_path: str, strategy: str, fused: bool, clip_grad: float = 1.0) -> Any:
    """verl's FSDP engine in fp16 (``strategy``: ``"fsdp2"`` or ``"fsdp"``), initialised."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp import FSDPEngineWithLMHead

    engine = FSDPEngineWithLMHead(
        model_config=HFModelConfig(
            path=model_path,
            load_tokenizer=False,
            override_config={"attn_implementation": "eager"},
            use_remove_padding=False,
        ),
        engine_config=FSDPEngineConfig(strategy=strategy, mixed_precision={"param_dtype": "fp16"}),
        optimizer_config=FSDPOptimizerConfig(
            lr=1e-3,
            total_training_steps=100,
            clip_grad=clip_grad,
            override_optimizer_config={"fused": fused},
        ),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def batch(step: int) -> Any:
    """Four variable-length sequences of this rank's data for ``step``, as verl takes them."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    lengths = [5, 7, 4, 6]

    def nested(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)

    tokens = [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]
    data = TensorDict(
        {
            "input_ids": nested(tokens),
            "position_ids": nested([torch.arange(n) for n in lengths]),
            "loss_mask": nested([torch.ones(n, dtype=torch.long) for n in lengths]),
        },
        batch_size=[len(lengths)],
    )
    tu.assign_non_tensor(
        data,
        use_remove_padding=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        temperature=1.0,
        global_batch_size=len(lengths) * dist.get_world_size(),
    )
    return data


def forward_backward(engine: Any, step: int) -> None:
    """verl's ``train_batch`` up to the optimizer step: zero, forward, scaled backward."""
    from verl.workers.utils.losses import sft_loss

    engine.optimizer_zero_grad()
    engine.forward_backward_batch(batch(step), loss_function=partial(sft_loss, None))


def plant(engine: Any, value: float) -> None:
    """Write ``value`` into one element of this rank's local gradient shard."""
    _common.plant(engine.module.parameters(), value)


def local_params(engine: Any) -> list[torch.Tensor]:
    """Copies of this rank's local parameter shards."""
    return [_common.local_shard(p).detach().clone() for p in engine.module.parameters()]
