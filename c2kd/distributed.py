"""The torchrun environment: this process's rank, the world size, its device, and collectives that
are no-ops when there is only one process."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from c2kd.errors import C2KDError


def dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment (0, 1, 0 when not launched by it)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def node_env() -> tuple[int, int, int, int]:
    """(node, nodes, rank on the node, processes on the node) from torchrun's GROUP_RANK,
    GROUP_WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE."""
    env = os.environ
    if not {"GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= set(env):
        raise C2KDError("--part node needs torchrun's GROUP_RANK, GROUP_WORLD_SIZE and LOCAL_WORLD_SIZE "
                        "(launch with torchrun --nnodes N, or give --part i/n)")
    return int(env["GROUP_RANK"]), int(env["GROUP_WORLD_SIZE"]), int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])


def is_main_process() -> bool:
    return dist_env()[0] == 0


def pick_device(name: str = "auto") -> torch.device:
    """auto: cuda:LOCAL_RANK when CUDA is available, else cpu; otherwise the named device, checked."""
    local_rank = dist_env()[2]
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise C2KDError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise C2KDError(f"--device {name}: CUDA is not available on this machine (use --device cpu or auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise C2KDError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise C2KDError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N")
    return device


def init(device: torch.device) -> bool:
    """Join the process group when launched with several processes; True when this call started it."""
    if dist_env()[1] > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return True
    return False


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """The element-wise sum over ranks (a copy on the CPU)."""
    if not dist.is_initialized():
        return values
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else values.device
    out = values.to(on)
    dist.all_reduce(out)
    return out.cpu()
