"""Swap files for ZeRO-Infinity: tensors written to and read from a local disk (NVMe) by worker threads.

Every process gets a fresh private directory under ``--nvme-path`` and removes it when it closes: swap
files are scratch, a restarted run never reads an old one (checkpoints copy the states out). Reads and
writes return futures, so a caller can read the next piece while it computes on this one and write the
previous one behind it. An I/O error (a full disk, a failing device) is raised as ``SwapError`` naming
the file, when the caller waits for that transfer.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class SwapError(RuntimeError):
    """A swap file could not be written or read; the message names the file and the cause."""


def check_swap_directory(path: str, needed_bytes: int, flag: str = "--nvme-path") -> None:
    """Refuse a swap root that is missing, not a writable directory, or without ``needed_bytes`` free."""
    if not path:
        raise ValueError(f"NVMe offload needs {flag} DIR: the directory that will hold the swap files")
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {path} does not exist or is not a directory: create it on a local disk")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} is not writable by this user: choose a directory you can write")
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise ValueError(f"{flag} {path} has {free / 2**30:.2f} GiB free but the swapped states need "
                         f"{needed_bytes / 2**30:.2f} GiB: free space or choose a larger disk")


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a numpy view (which would pin its storage's size)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("swap transfers need a contiguous CPU tensor")
    raw = (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
    return memoryview(raw).cast("B")


class SwapSpace:
    """A private directory of swap files and the threads that move tensors in and out of them.

    Owns the directory (created empty, removed by ``close``) and its files; counts the bytes on disk.
    Never keeps a tensor once its transfer is done, and never touches a file outside its directory.
    A tensor handed to ``write`` or ``read`` must not be used by the caller until the future is done.
    """

    def __init__(self, root: str, label: str, workers: int = 2):
        check_swap_directory(root, 0)
        self.directory = tempfile.mkdtemp(prefix=f"{label}-", dir=root)
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="swap")
        self._descriptors: dict[str, int] = {}
        self._sizes: dict[str, int] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _descriptor(self, name: str) -> int:
        if name not in self._descriptors:
            self._descriptors[name] = os.open(self.path(name), os.O_RDWR | os.O_CREAT, 0o600)
        return self._descriptors[name]

    @property
    def bytes(self) -> int:
        """Bytes held in the files."""
        return sum(self._sizes.values())

    def write(self, name: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Write ``tensor``'s bytes (a contiguous CPU tensor) to file ``name`` at byte ``offset``."""
        descriptor = self._descriptor(name)
        self._sizes[name] = max(self._sizes.get(name, 0), offset + tensor.numel() * tensor.element_size())
        return self._threads.submit(self._transfer, name, os.pwrite, descriptor, tensor, offset)

    def read(self, name: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Fill ``tensor`` (a contiguous CPU tensor) from file ``name`` at byte ``offset``."""
        return self._threads.submit(self._transfer, name, os.preadv, self._descriptor(name), tensor, offset)

    def _transfer(self, name: str, operation, descriptor: int, tensor: torch.Tensor, offset: int) -> None:
        data, done = _as_bytes(tensor), 0  # the tensor stays referenced until its transfer is done
        try:
            while done < len(data):  # both calls may move fewer bytes than asked
                moved = operation(descriptor,
                                  data[done:] if operation is os.pwrite else [data[done:]], offset + done)
                if moved == 0:
                    raise OSError(f"the file ends {offset + done} bytes in; a swap file is never "
                                  "shorter than "
                                  "what was written to it")
                done += moved
        except OSError as error:
            verb = "writing" if operation is os.pwrite else "reading"
            raise SwapError(f"NVMe offload stopped: {verb} {self.path(name)} failed ({error}). The run stops "
                            "here; checkpoints are not touched by swap files") from error

    def close(self) -> None:
        """Wait for the transfers in flight, then remove the directory and everything in it."""
        self._threads.shutdown(wait=True)
        for descriptor in self._descriptors.values():
            os.close(descriptor)
        self._descriptors.clear()
        shutil.rmtree(self.directory, ignore_errors=True)
