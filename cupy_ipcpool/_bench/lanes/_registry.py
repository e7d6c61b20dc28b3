"""The handoff lanes in report order, and choosing them by name."""

from __future__ import annotations

from collections.abc import Sequence

from ..interface import Lane
from ._classic import HostStagingLane, LegacyIpcLane
from ._floors import InProcessFloorLane, OrderedFloorLane, SocketFloorLane, SocketGpuFloorLane
from ._frameworks import CudaCoreLane, TorchQueueLane
from ._ipcpool import CupyIpcPoolAheadLane, CupyIpcPoolAheadSpinLane, CupyIpcPoolLane

#: The handoff lanes, in report order.
ALL_LANES: tuple[Lane, ...] = (
    CupyIpcPoolLane(),
    CupyIpcPoolAheadLane(),
    CupyIpcPoolAheadSpinLane(),
    HostStagingLane(),
    LegacyIpcLane(),
    TorchQueueLane(),
    CudaCoreLane(),
    SocketFloorLane(),
    SocketGpuFloorLane(),
    OrderedFloorLane(),
    InProcessFloorLane(),
)

LANE_NAMES: tuple[str, ...] = tuple(lane.name for lane in ALL_LANES)


def get_lanes(names: Sequence[str] | None = None) -> list[Lane]:
    """The lanes called ``names`` (all when None), in report order.

    Raises
    ------
    ValueError
        An unknown lane name (the message lists the known ones).
    """
    if names is None:
        return list(ALL_LANES)
    unknown = [n for n in names if n not in LANE_NAMES]
    if unknown:
        raise ValueError(
            f"unknown lane(s) {', '.join(unknown)}; choose from {', '.join(LANE_NAMES)}"
        )
    return [lane for lane in ALL_LANES if lane.name in names]
