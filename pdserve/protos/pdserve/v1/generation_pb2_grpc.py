"""The public API's service stubs: generated into the client package (``pdserve_client.v1``), which installs
on its own; this name stays so the services import them as before."""

from pdserve_client.v1.generation_pb2_grpc import *  # noqa: F401,F403
