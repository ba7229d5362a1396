"""torch.distributed integration. torch is imported only when used."""

from __future__ import annotations

from . import _C


class TorchGroupBootstrap(_C.Bootstrap):
    """A moelink Bootstrap over a torch.distributed ProcessGroup.

    Its all_gather is ``torch.distributed.all_gather_object`` on that group
    (gloo or nccl; with nccl the current CUDA device must be set). The rank
    and world size are the process's rank in the group and the group's size,
    so Config.rank / world_size must use the same numbering."""

    def __init__(self, group=None):
        super().__init__()
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "moelink: TorchGroupBootstrap needs torch.distributed.init_process_group() first")
        if group is None:
            group = dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"moelink: group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("moelink: this process is not a member of the given process group")
        self._dist = dist
        self.group = group
        self._rank = rank
        self._world_size = dist.get_world_size(group)

    def rank(self) -> int:
        return self._rank

    def world_size(self) -> int:
        return self._world_size

    def all_gather(self, data: bytes) -> bytes:
        out = [None] * self._world_size
        self._dist.all_gather_object(out, bytes(data), group=self.group)
        return b"".join(out)


def is_process_group(obj) -> bool:
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return False
    return isinstance(obj, dist.ProcessGroup)
