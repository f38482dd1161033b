"""Python client of the InferScale memory service.

    from inferscale_client import MemoryClient
    with MemoryClient(memory_service="127.0.0.1:50051", token="...") as memory:
        memory.add_facts("maya", ["Maya keeps bees.", {"fact_id": "sister", "text": "Maya's sister lives in Porto."}])
        for hit in memory.search("maya", "family"):
            print(hit.rank, hit.fact.text)

`AsyncMemoryClient` has the same calls as coroutines. Settings not given come from INFERSCALE_* variables
(ClientSettings.from_env); failures raise InferScaleError (code, details, field, request_id)."""

from inferscale_client.aio import AsyncMemoryClient
from inferscale_client.client import MemoryClient
from inferscale_client.errors import InferScaleError
from inferscale_client.health import SERVING
from inferscale_client.settings import ClientSettings

__all__ = ["SERVING", "AsyncMemoryClient", "ClientSettings", "InferScaleError", "MemoryClient"]
