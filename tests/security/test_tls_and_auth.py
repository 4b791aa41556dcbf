"""TLS, mutual TLS and bearer-token auth across in-process servers, with certificates made at test time."""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from pdserve.cli import main
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc
from pdserve.service_common.security import (
    BearerTokenInterceptor,
    TlsConfig,
    bearer_metadata,
    channel_credentials,
    load_auth_token,
    open_channel,
    server_credentials,
    server_ssl_context,
)
from pdserve.service_common.server import ServerConfig, channel_options
from tests.conftest import StartInProcessCluster
from tests.support.cluster import ClusterOptions, InProcessCluster

TOKEN = "s3cret-token"
OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = pdserve-test
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
[client]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
"""


@dataclass(frozen=True)
class Pki:
    """A throwaway CA with one server certificate (127.0.0.1, localhost) and one client certificate."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def server(self, require_client_cert: bool = False) -> TlsConfig:
        ca = self.ca if require_client_cert else None
        return TlsConfig(self.server_cert, self.server_key, ca, require_client_cert=require_client_cert)

    def client(self, with_cert: bool = False) -> TlsConfig:
        if with_cert:
            return TlsConfig(self.client_cert, self.client_key, self.ca)
        return TlsConfig(ca_file=self.ca)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    (directory / "openssl.cnf").write_text(OPENSSL_CONFIG)
    new_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-config", "openssl.cnf")
    _openssl("req", "-x509", *new_key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=pdserve-test-ca", "-extensions", "ca", cwd=directory)
    for serial, name in enumerate(("server", "client"), start=1):
        _openssl("req", "-new", *new_key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=pdserve-test-{name}", cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", str(serial),
                 "-days", "1", "-out", f"{name}.pem", "-extfile", "openssl.cnf", "-extensions", name, cwd=directory)
    path = lambda name: str(directory / name)  # noqa: E731
    return Pki(path("ca.pem"), path("server.pem"), path("server.key"), path("client.pem"), path("client.key"))


NUM_KV_BLOCKS = 32


def _generate_request(max_tokens: int) -> generation_pb2.GenerateRequest:
    params = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return generation_pb2.GenerateRequest(prompt_token_ids=list(range(10, 30)), sampling_params=params)


async def _generate(stub: generation_pb2_grpc.GenerationStub, max_tokens: int, metadata=()) -> list:  # noqa: ANN001
    return [r async for r in stub.Generate(_generate_request(max_tokens), timeout=30, metadata=metadata)]


async def _start_cluster(
    start_inprocess_cluster: StartInProcessCluster,
    checkpoint: Path,
    worker: ServerConfig,
    gateway: ServerConfig,
    client_tls: TlsConfig | None,
) -> InProcessCluster:
    """Prefill, decode and gateway servers with these ports' and channels' security, started."""
    options = ClusterOptions(num_kv_blocks=NUM_KV_BLOCKS, worker_server=worker, gateway_server=gateway,
                             client_tls=client_tls)
    return await start_inprocess_cluster(checkpoint, options)


@pytest.mark.asyncio
async def test_tls_everywhere_serves_end_to_end_and_refuses_plaintext(
    llama_checkpoint: Path, pki: Pki, start_inprocess_cluster: StartInProcessCluster
) -> None:
    # Internal ports with mutual TLS: the gateway's and the decode worker's channels present the client cert.
    cluster = await _start_cluster(
        start_inprocess_cluster, llama_checkpoint, ServerConfig(tls=pki.server(require_client_cert=True)),
        ServerConfig(tls=pki.server()), client_tls=pki.client(with_cert=True),
    )
    decode, target = cluster.decode, cluster.gateway_address
    assert target is not None
    async with open_channel(target, pki.client(), channel_options()) as channel:
        responses = await _generate(generation_pb2_grpc.GenerationStub(channel), max_tokens=6)
    assert sum(len(r.token_ids) for r in responses) == 6
    assert (responses[-1].usage.prompt_tokens, responses[-1].usage.completion_tokens) == (20, 6)
    # The KV crossed the decode -> prefill TLS channel; it was not recomputed.
    assert (decode.servicer.kv_transfers, decode.servicer.kv_recomputes) == (1, 0)

    async with open_channel(target, None, channel_options()) as plaintext:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _generate(generation_pb2_grpc.GenerationStub(plaintext), max_tokens=2)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # The name override: a certificate checked against "localhost" while dialling 127.0.0.1.
    async with open_channel(target, pki.client(), channel_options(), server_name_override="localhost") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = await stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10)
    assert info.vocab_size == 512


@pytest.mark.asyncio
async def test_mutual_tls_worker_refuses_a_client_without_a_certificate(
    llama_checkpoint: Path, pki: Pki, start_inprocess_cluster: StartInProcessCluster
) -> None:
    options = ClusterOptions(num_kv_blocks=NUM_KV_BLOCKS, decode_workers=0, gateway=False,
                             worker_server=ServerConfig(tls=pki.server(require_client_cert=True)))
    address = (await start_inprocess_cluster(llama_checkpoint, options)).prefill_addresses[0]
    async with open_channel(address, pki.client(with_cert=False), channel_options()) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await worker_pb2_grpc.PrefillWorkerStub(channel).Load(worker_pb2.LoadRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    async with open_channel(address, pki.client(with_cert=True), channel_options()) as channel:
        report = await worker_pb2_grpc.PrefillWorkerStub(channel).Load(worker_pb2.LoadRequest(), timeout=10)
    assert (report.worker_id, report.role) == ("p0", "prefill")


@pytest.mark.asyncio
async def test_gateway_bearer_auth_refuses_missing_and_wrong_tokens_but_not_health(
    llama_checkpoint: Path, start_inprocess_cluster: StartInProcessCluster
) -> None:
    cluster = await _start_cluster(
        start_inprocess_cluster, llama_checkpoint, ServerConfig(), ServerConfig(auth_token=TOKEN), client_tls=None
    )
    assert cluster.gateway_address is not None
    async with open_channel(cluster.gateway_address, None, channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for metadata in ((), bearer_metadata("wrong-token"), (("authorization", TOKEN),)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _generate(stub, max_tokens=2, metadata=metadata)
            assert (caught.value.code(), caught.value.details()) == (
                grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token"
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

        responses = await _generate(stub, max_tokens=3, metadata=bearer_metadata(TOKEN))
        assert sum(len(r.token_ids) for r in responses) == 3
        info = await stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10, metadata=bearer_metadata(TOKEN))
        assert info.vocab_size == 512
        # Load balancers probe health without credentials.
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.asyncio
async def test_bearer_auth_refuses_a_bidirectional_stream_too() -> None:
    # Reflection is a stream-stream method: closed here by narrowing the open prefixes to health.
    interceptor = BearerTokenInterceptor(TOKEN, open_method_prefixes=("/grpc.health.v1.Health/",))
    server = grpc.aio.server(interceptors=[interceptor])
    reflection.enable_server_reflection([reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [r async for r in stub.ServerReflectionInfo(iter([ask]), timeout=10)]
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call = stub.ServerReflectionInfo(iter([ask]), timeout=10, metadata=bearer_metadata(TOKEN))
            answers = [r async for r in call]
            assert answers[0].list_services_response.service[0].name == reflection.SERVICE_NAME
    finally:
        await server.stop(None)


def test_unreadable_or_non_pem_files_fail_with_the_flag_named(tmp_path: Path, pki: Pki) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match=f"--tls-cert {missing}: cannot read it: No such file"):
        server_credentials(TlsConfig(missing, pki.server_key))
    with pytest.raises(ValueError, match=f"--tls-ca {missing}: cannot read it"):
        channel_credentials(TlsConfig(ca_file=missing))
    not_pem = tmp_path / "key.txt"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="--tls-client-key .*key.txt: not a PEM file"):
        channel_credentials(TlsConfig(pki.client_cert, str(not_pem), pki.ca))
    with pytest.raises(ValueError, match="--tls-client-ca"):
        TlsConfig(pki.server_cert, pki.server_key, require_client_cert=True)


def test_the_cli_reports_a_missing_certificate_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = str(tmp_path / "gateway.pem")
    status = main(["gateway", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--port", "0",
                   "--tls-cert", missing, "--tls-key", missing])
    assert status == 2
    assert f"--tls-key {missing}: cannot read it" in capsys.readouterr().err
    assert main(["gateway", "--prefill", "127.0.0.1:1", "--port", "0", "--tls-client-ca", missing]) == 2
    assert "TLS needs both --tls-cert and --tls-key" in capsys.readouterr().err


def test_auth_token_comes_from_the_file_first_then_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    assert load_auth_token(str(token_file), "from-env", "PDSERVE_AUTH_TOKEN") == TOKEN
    assert load_auth_token(None, " from-env ", "PDSERVE_AUTH_TOKEN") == "from-env"
    assert load_auth_token(None, None, "PDSERVE_AUTH_TOKEN") is None
    token_file.write_text("\n")
    with pytest.raises(ValueError, match="the bearer token is empty"):
        load_auth_token(str(token_file), None, "PDSERVE_AUTH_TOKEN")
    with pytest.raises(ValueError, match="PDSERVE_AUTH_TOKEN: the bearer token must be printable ASCII"):
        load_auth_token(None, "two words", "PDSERVE_AUTH_TOKEN")


def _https_client_context(pki: Pki, with_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki.ca)
    if with_cert:
        context.load_cert_chain(pki.client_cert, pki.client_key)
    return context


async def _http_completion(url: str, ssl_context: ssl.SSLContext | None) -> tuple[int, dict]:
    body = {"model": "m", "prompt": list(range(10, 30)), "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body, ssl=ssl_context,
                                headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            return response.status, await response.json()


@pytest.mark.asyncio
@pytest.mark.parametrize("mutual", [False, True])
async def test_the_openai_http_port_serves_tls_with_the_gateway_certificate_and_refuses_plain_http(
    llama_checkpoint: Path, pki: Pki, start_inprocess_cluster: StartInProcessCluster, mutual: bool
) -> None:
    options = ClusterOptions(num_kv_blocks=NUM_KV_BLOCKS, http=True,
                             gateway_server=ServerConfig(tls=pki.server(require_client_cert=mutual), auth_token=TOKEN))
    gateway = (await start_inprocess_cluster(llama_checkpoint, options)).gateway
    assert gateway is not None and gateway.http_port is not None
    url = f"https://127.0.0.1:{gateway.http_port}"

    status, answer = await _http_completion(url, _https_client_context(pki, with_cert=mutual))
    assert status == 200
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (20, 5)
    assert answer["choices"][0]["finish_reason"] == "length"

    with pytest.raises(aiohttp.ClientError):  # plaintext HTTP to the TLS port: the handshake never happens
        await _http_completion(f"http://127.0.0.1:{gateway.http_port}", None)
    if mutual:
        with pytest.raises(aiohttp.ClientError):  # a client without a certificate is refused in the handshake
            await _http_completion(url, _https_client_context(pki, with_cert=False))


def test_a_key_that_does_not_match_its_certificate_fails_the_https_port_naming_the_flags(pki: Pki) -> None:
    with pytest.raises(ValueError, match="--tls-cert/--tls-key"):
        server_ssl_context(TlsConfig(pki.server_cert, pki.client_key))
