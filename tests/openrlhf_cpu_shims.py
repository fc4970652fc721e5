"""Every shim that lets OpenRLHF 0.11.2's own training loop run on a machine without a GPU, in one place.

OpenRLHF's learner and its weight sync call CUDA by name at a few lines; vLLM's CPU build packs its linear weights
so that an in-place reload cannot reach them. Each shim below names the line it stands in for and why. None changes
what is computed: they pick the CPU where OpenRLHF names the GPU, skip a CUDA synchronisation (the CPU has no
stream to wait on), carry the weight broadcast over gloo instead of NCCL (the same tensors, the same ranks), and
keep vLLM's CPU weights unpacked (the same matmul). DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``,
gloo); the engines run in float32 (the CPU build has no fast bfloat16 here), so the learner's bfloat16 weights are
widened on arrival, which is exact.

Where they run:
- ``install()``: in the process that launches and in every Ray worker (``worker_process_setup_hook``): the
  learner's ranks, the trainer actors, the engines' Ray actors.
- ``install_engine()``: in vLLM's own processes (its EngineCore and worker), which Ray's hook does not reach; vLLM
  loads it as a general plugin (entry point group ``vllm.general_plugins``) from the ``.dist-info`` folder that
  ``plugin_path()`` writes, put on ``PYTHONPATH`` by the harness.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shim:
    """One OpenRLHF (or vLLM) line this module stands in for: ``file`` relative to the package, its 1-based
    ``line``, the ``text`` that line holds in the pinned release (``test_openrlhf_training`` checks it), and why."""

    file: str
    line: int
    text: str
    why: str


SHIMS: tuple[Shim, ...] = (
    Shim("openrlhf/utils/deepspeed/deepspeed.py", 97, "torch.cuda.set_device(local_rank)", "no CUDA device to pick"),
    Shim(
        "openrlhf/utils/deepspeed/deepspeed.py",
        106,
        '"cuda", (dp_size, self.ring_attn_size, self.ds_tensor_parallel_size), mesh_dim_names=("dp", "sp", "tp")',
        "the device mesh is built on the CPU (gloo), the same shape",
    ),
    Shim(
        "openrlhf/utils/deepspeed/deepspeed.py",
        614,
        "data = data.to(torch.cuda.current_device())",
        "all_reduce's tensor stays on the CPU",
    ),
    Shim(
        "openrlhf/utils/deepspeed/deepspeed.py",
        634,
        "dist.all_gather(ret, data.to(torch.cuda.current_device()))",
        "all_gather's tensors stay on the CPU (and 633)",
    ),
    Shim("openrlhf/utils/distributed_util.py", 10, "torch.cuda.synchronize()", "a barrier without a CUDA sync"),
    Shim(
        "openrlhf/utils/distributed_util.py",
        25,
        "pynccl = PyNcclCommunicator(pg, device=device)",
        "the weight-sync group is a stateless gloo group (vLLM's), not NCCL: the same broadcast, rank 0 to engines",
    ),
    Shim(
        "openrlhf/utils/deepspeed/deepspeed_utils.py",
        189,
        "torch.cuda.synchronize()",
        "offloading DeepSpeed's states (--ds.enable_sleep): nothing to wait on (and 211: reloading them)",
    ),
    Shim("openrlhf/trainer/ray/launcher.py", 65, "torch.cuda.synchronize()", "empty_cache: nothing to wait on"),
    Shim(
        "openrlhf/trainer/ray/launcher.py",
        136,
        "device = torch.cuda.current_device()",
        "the reference model's inputs stay on the CPU (and 190: the reward model's)",
    ),
    Shim(
        "openrlhf/trainer/ray/ppo_actor.py",
        148,
        "master_address, master_port, 0, world_size, torch.cuda.current_device()",
        "rank 0 joins the weight-sync group from the CPU",
    ),
    Shim(
        "openrlhf/trainer/ray/ppo_actor.py",
        171,
        "device = torch.cuda.current_device()",
        "training batches stay on the CPU (and 627: the policy's forward for experiences)",
    ),
    Shim(
        "openrlhf/trainer/ray/ppo_actor.py",
        436,
        "self._model_update_group.broadcast(param.data, src=0, stream=torch.cuda.current_stream())",
        "no CUDA stream: the gloo broadcast is synchronous",
    ),
    Shim("openrlhf/trainer/ray/ppo_actor.py", 605, "torch.cuda.synchronize()", "reload_states: nothing to wait on"),
    Shim(
        "openrlhf/trainer/ray/ppo_critic.py",
        83,
        "device = torch.cuda.current_device()",
        "the critic's batches stay on the CPU (and 268)",
    ),
    Shim(
        "openrlhf/trainer/ppo_utils/replay_buffer.py",
        40,
        'self.target_device = torch.device(f"cuda:{torch.cuda.current_device()}")',
        "the replay buffer's experiences stay on the CPU (and 104-165: its step counts)",
    ),
    Shim(
        "openrlhf/trainer/ray/vllm_worker_wrap.py",
        39,
        'assert dtype == self.model_config.dtype, f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}"',
        "the CPU engine holds float32: the learner's bfloat16 weight is received as sent, then widened (exact)",
    ),
    Shim(
        "openrlhf/trainer/ray/vllm_worker_wrap.py",
        40,
        'weight = torch.empty(shape, dtype=dtype, device="cuda")',
        "the engine receives the weight on the CPU",
    ),
    Shim(
        "openrlhf/trainer/ray/vllm_engine.py",
        273,
        '"dtype": "bfloat16",',
        "OpenRLHF's own engines (--scheduler openrlhf) in float32, as the adapter's CPU engines are",
    ),
    Shim(
        "vllm/model_executor/layers/linear.py",
        215,
        "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)",
        "vLLM's CPU build packs each linear weight into a kernel's layout and drops the parameter's weight_loader, "
        "so OpenRLHF's in-place reload cannot reach it: kept unpacked, the same F.linear (and "
        "vocab_parallel_embedding.py 66: the output head)",
    ),
)

#: The modules whose ``torch`` name is the CPU view below (each one's CUDA lines are in ``SHIMS``).
CUDA_BY_NAME = (
    "openrlhf.utils.deepspeed.deepspeed",
    "openrlhf.utils.deepspeed.deepspeed_utils",
    "openrlhf.trainer.ray.launcher",
    "openrlhf.trainer.ray.ppo_actor",
    "openrlhf.trainer.ray.ppo_critic",
    "openrlhf.trainer.ppo_utils.replay_buffer",
)

#: What vLLM's CPU build needs of OpenRLHF's own engines (the adapter's engine builder sets the same on CPU).
ENGINE_CPU = {"dtype": "float32", "block_size": 32}


class _CudaOnCpu:
    """``torch.cuda`` as the shimmed lines see it: the CPU is the device, and there is nothing to synchronise."""

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def current_stream(device: Any = None) -> None:
        return None


class _TorchOnCpu:
    """The ``torch`` module with ``torch.cuda`` replaced by ``_CudaOnCpu``; everything else is torch's own."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self.cuda = _CudaOnCpu(torch.cuda)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._torch, name)

    def device(self, spec: Any, *args: Any) -> Any:
        """``torch.device("cuda:N")`` is the CPU (replay_buffer.py 40 builds it from ``current_device()``)."""
        if isinstance(spec, str) and spec.startswith("cuda"):
            return self._torch.device("cpu")
        return self._torch.device(spec, *args)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (torch_on_cpu, ())  # Ray ships a class by value with its module's globals: rebuilt there


def torch_on_cpu() -> _TorchOnCpu:
    import torch

    return _TorchOnCpu(torch)


class GlooBroadcast:
    """The weight-sync group (OpenRLHF: a ``PyNcclCommunicator`` over vLLM's ``StatelessProcessGroup``) as a stateless
    gloo group from vLLM's ``stateless_init_torch_distributed_process_group``: rank 0 is the learner, 1.. the engines'
    workers. It does not touch the process's default group, which DeepSpeed or vLLM made."""

    def __init__(self, host: str, port: int, rank: int, world_size: int) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.rank, self.world_size = rank, world_size
        self.group = stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend="gloo")

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        self.group.broadcast(tensor, src).wait()


def stateless_init_process_group(master_address: str, master_port: int, rank: int, world_size: int, device: Any):
    return GlooBroadcast(master_address, master_port, rank, world_size)


def _barrier_only() -> None:
    import torch

    torch.distributed.barrier()


def _device_mesh_on_cpu(init_device_mesh: Any) -> Any:
    @functools.wraps(init_device_mesh)
    def build(device_type: str, *args: Any, **kwargs: Any) -> Any:
        return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    return build


def _engine_on_cpu(init: Any) -> Any:
    @functools.wraps(init)
    async def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.update(ENGINE_CPU)
        await init(self, *args, **kwargs)

    return __init__


def install() -> None:
    """The learner-side shims (and the placeholder ``flash_attn`` its modules import), in this process."""
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        raise RuntimeError("the CPU training shims need DS_ACCELERATOR=cpu (DeepSpeed's CPU accelerator, gloo)")
    import flash_attn_placeholder

    flash_attn_placeholder.install()
    cpu_torch = torch_on_cpu()
    for name in CUDA_BY_NAME:
        importlib.import_module(name).torch = cpu_torch
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import openrlhf.trainer.ray.vllm_engine as vllm_engine
    import openrlhf.utils.deepspeed.deepspeed as ds
    import openrlhf.utils.distributed_util as distributed_util

    if not getattr(ds.init_device_mesh, "_rlhfless_cpu", False):
        ds.init_device_mesh = _device_mesh_on_cpu(ds.init_device_mesh)
        ds.init_device_mesh._rlhfless_cpu = True
    for module in (ds, ppo_actor, distributed_util):
        module.torch_dist_barrier_and_cuda_sync = _barrier_only
    ppo_actor.stateless_init_process_group = stateless_init_process_group
    distributed_util.stateless_init_process_group = stateless_init_process_group
    actor = vllm_engine.RolloutRayActor.__ray_actor_class__
    if not hasattr(actor.__init__, "__wrapped__"):
        actor.__init__ = _engine_on_cpu(actor.__init__)


def _receive_weight(self: Any, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> None:
    """``WorkerWrap.update_weight`` (vllm_worker_wrap.py 33-49) with lines 39-40 on the CPU: the weight is received
    in the dtype the learner sends and loaded into the engine's (the parameter's own loader widens it)."""
    import torch

    weight = torch.empty(shape, dtype=dtype, device="cpu")
    self._model_update_group.broadcast(weight, src=0, stream=None)
    self.model_runner.model.load_weights(weights=[(name, weight.to(self.model_config.dtype))])
    del weight


def _unpacked_gemm(layer: Any, remove_weight: bool) -> None:
    import torch

    layer.cpu_linear = torch.nn.functional.linear


def install_engine() -> None:
    """The engine-side shims, in a vLLM process (vLLM calls this as a general plugin)."""
    import openrlhf.trainer.ray.vllm_worker_wrap as worker_wrap
    import openrlhf.utils.distributed_util as distributed_util
    import vllm.model_executor.layers.utils as layer_utils

    layer_utils.dispatch_cpu_unquantized_gemm = _unpacked_gemm
    distributed_util.stateless_init_process_group = stateless_init_process_group
    worker_wrap.WorkerWrap.update_weight = _receive_weight


def plugin_path(folder: Path) -> Path:
    """Write, under ``folder``, the metadata that makes vLLM load ``install_engine`` as a general plugin in each
    of its processes (those with ``folder`` and this file's folder on ``sys.path``); returns ``folder``."""
    info = Path(folder) / "rlhfless_cpu_shims-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlhfless-cpu-shims\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nrlhfless_cpu_shims = openrlhf_cpu_shims:install_engine\n"
    )
    return Path(folder)
