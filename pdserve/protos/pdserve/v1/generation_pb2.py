"""The public API's messages: generated into the client package (``pdserve_client.v1``), which installs
on its own; this name stays so the services import them as before. One module, one set of classes."""

from pdserve_client.v1.generation_pb2 import *  # noqa: F401,F403
from pdserve_client.v1.generation_pb2 import DESCRIPTOR  # noqa: F401
