"""Subscribers on other machines through UCX (UCXX), and a relay that fans out locally.

Needs the remote extra of the CUDA major in use (from the source tree,
``python3 -m pip install -e '.[remote-cu13]'``, or ``'.[remote-cu12]'`` for CUDA
12); importing this package does not, the first session does.  See ``docs/remote.md``.
"""

from ._errors import AuthenticationError, RemoteUnavailableError
from ._host import HostChannelPublisher, HostChannelSubscriber, HostFrame
from ._memory import DeviceSlots, HostSlots, SlotMemory
from ._relay import Relay, relay
from ._server import RemoteInfo, RemoteServer
from ._source import DeviceSource, serve
from ._subscriber import RemoteFrame, RemoteSubscriber, subscribe
from ._ucx import available
from ._wire import is_remote_address, parse_address

__all__ = [
    "AuthenticationError",
    "DeviceSlots",
    "DeviceSource",
    "HostChannelPublisher",
    "HostChannelSubscriber",
    "HostFrame",
    "HostSlots",
    "Relay",
    "RemoteFrame",
    "RemoteInfo",
    "RemoteServer",
    "RemoteSubscriber",
    "RemoteUnavailableError",
    "SlotMemory",
    "available",
    "is_remote_address",
    "parse_address",
    "relay",
    "serve",
    "subscribe",
]
