"""A colocated worker: prefill and decode on one engine, behind both worker services.

The baseline disaggregation is measured against. The gateway sends a request's
Prefill and Decode to the same process; the decode side finds the prompt's
full blocks in its own prefix cache (the prefill just computed them), so only
the partial last block travels, over loopback.
"""

from __future__ import annotations

from pdserve.engine.llm_engine import LLMEngine
from pdserve.decode_service.server import SERVICE_NAME as DECODE_SERVICE
from pdserve.decode_service.server import DecodeServicer
from pdserve.kv_transfer.config import TransferConfig
from pdserve.prefill_service.server import SERVICE_NAME as PREFILL_SERVICE
from pdserve.prefill_service.server import PrefillServicer
from pdserve.protos.pdserve.v1.internal import worker_pb2_grpc
from pdserve.service_common.security import TlsConfig
from pdserve.service_common.server import ServerConfig
from pdserve.service_common.worker import WorkerConfig, WorkerRuntime, WorkerServer


class ColocatedServer(WorkerServer):
    """One engine serving PrefillWorker and DecodeWorker."""

    def __init__(
        self,
        engine: LLMEngine,
        server_config: ServerConfig,
        worker_config: WorkerConfig,
        transfer: TransferConfig | None = None,
        advertise_host: str | None = None,
        kv_failure_policy: str = "recompute",
        client_tls: TlsConfig | None = None,
        metrics_port: int | None = None,
    ) -> None:
        super().__init__(WorkerRuntime(engine, worker_config), server_config, [PREFILL_SERVICE, DECODE_SERVICE],
                         advertise_host, metrics_port=metrics_port)
        transfer = transfer or TransferConfig()
        self.prefill = PrefillServicer(self.runtime, transfer)
        # The decode side fetches from this worker's own address: with TLS on, it needs client_tls too.
        self.decode = DecodeServicer(self.runtime, transfer, kv_failure_policy, client_tls)
        self.server.add_servicer(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, self.prefill)
        self.server.add_servicer(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, self.decode)

    async def close_servicer(self) -> None:
        await self.prefill.close()
        await self.decode.close()
