"""The ranks of one tensor-parallel engine as a torch.distributed process group, with a timeout on every collective.

No global ``init_process_group``: a process may host several engines (tests, the
offline ``LLM``) and KV transports build groups of their own, so the group is a
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` object over a ``TCPStore`` that rank 0
hosts on an ephemeral loopback port.

Two groups on GPU: commands and step inputs (small int64 tensors) are broadcast
over a gloo group on the CPU, and only the all-reduces and KV moves use NCCL,
so a follower rank can wait for rank 0's next command as long as the server
stays idle without NCCL's watchdog tearing it down (vLLM keeps a CPU group for
the same reason). On CPU one gloo group does both.

Timeouts: every collective inside a step waits at most ``timeout_s``; a rank that
died makes its peers' collectives fail at once (gloo sees the socket close) or at
the timeout. The one wait without a bound is a follower rank waiting for rank 0's
next command (an idle server sends none); those ranks watch their parent instead
(``workers``). On GPU, NCCL's async error handling tears a timed-out rank down
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, set before the group is built).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# A follower waiting for the next command: effectively unbounded (see the module docstring).
IDLE_TIMEOUT = datetime.timedelta(days=365)


class TensorParallelError(RuntimeError):
    """A rank died, a collective timed out, or the ranks disagree: the engine cannot continue."""


class TensorParallelGroup:
    """Rank ``rank`` of ``world_size``; ``backend`` gloo (CPU tensors) or nccl (CUDA tensors)."""

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float, device: torch.device
    ) -> None:
        self.rank, self.world_size, self.backend, self.device = rank, world_size, backend, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        prefix_store = dist.PrefixStore("pdserve_tp/", store)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = max(self.timeout, IDLE_TIMEOUT)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        # Commands and step inputs: always gloo, on the CPU (see the module docstring).
        self._control = dist.ProcessGroupGloo(prefix_store, rank, world_size, options)
        if backend == "gloo":
            self._group = self._control
        elif backend == "nccl":
            if not dist.is_nccl_available():
                raise TensorParallelError("tensor parallelism on CUDA needs NCCL, and this torch has none")
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = self.timeout
            self._group = dist.ProcessGroupNCCL(
                dist.PrefixStore("pdserve_tp_nccl/", store), rank, world_size, nccl_options
            )
        else:
            raise ValueError(f"tensor parallel backend must be gloo or nccl, got {backend!r}")

    def broadcast(self, tensor: torch.Tensor, *, idle: bool = False) -> None:
        """Rank 0's CPU ``tensor`` into every rank's (in place), over the control group.
        ``idle``: a follower waiting for a command (no timeout: it watches rank 0 instead)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = IDLE_TIMEOUT if idle else self.timeout
        self._wait(self._control.broadcast([tensor], options), "broadcast")

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place; every rank gets the same bits."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        options.timeout = self.timeout
        self._wait(self._group.allreduce([tensor], options), "all_reduce")

    def send(self, tensor: torch.Tensor, rank: int, tag: int = 0) -> None:
        self._wait(self._group.send([tensor], rank, tag), "send", self.timeout)

    def recv(self, tensor: torch.Tensor, rank: int, tag: int = 0) -> None:
        self._wait(self._group.recv([tensor], rank, tag), "recv", self.timeout)

    def _wait(self, work: dist.Work, name: str, timeout: datetime.timedelta | None = None) -> None:
        try:
            if timeout is None:
                work.wait()  # bounded by the options' timeout
            else:
                work.wait(timeout)
        except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise RuntimeError subclasses of their own
            raise TensorParallelError(
                f"tensor-parallel {name} failed on rank {self.rank} of {self.world_size} "
                f"(a rank died or timed out): {exc}"
            ) from exc
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
