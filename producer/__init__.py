"""redbatch producer: the wire protocol and the Python client for redbatch workers."""

from producer.async_client import AsyncClient
from producer.client import Client
from producer.errors import Overloaded, RedbatchError, RequestFailed, ResultTimeout
from producer.protocol import ErrorCode

__all__ = ["AsyncClient", "Client", "ErrorCode", "Overloaded", "RedbatchError", "RequestFailed",
           "ResultTimeout"]
