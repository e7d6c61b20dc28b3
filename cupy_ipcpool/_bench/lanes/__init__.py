"""The lanes of the comparative benchmark: ways of handing a GPU frame to another process.

Every lane writes each frame on the GPU with the same trivial kernel (fill with
the frame's value, :class:`GpuWork`), hands it over, and the consumer verifies
it with the same check (:mod:`._common`).  The lanes come in families, one
module each: cupy_ipcpool's own (:mod:`._ipcpool`), the classic ways
(:mod:`._classic`: host staging, legacy CUDA IPC), what the frameworks offer
(:mod:`._frameworks`: torch.multiprocessing, cuda.core) and the floors that no
handoff can beat (:mod:`._floors`); :mod:`._registry` lists them in report order.

No lane waits for the GPU per frame unless its own correctness needs it; each
lane's :attr:`~cupy_ipcpool._bench.interface.Lane.sync_note` says which
synchronisation it keeps and why (and the report prints it).  A host
synchronisation that waits for the other process's kernel pays GPU context
switches (two processes' kernels are time-sliced without MPS), which would
measure the GPU scheduler, not the handoff.

Lanes import CuPy, torch, cuda.core and the channel layer of cupy_ipcpool only
inside the spawned processes, so this package imports on machines without them.
"""

from ._classic import HostStagingLane, LegacyIpcLane
from ._common import (
    CHECK_SAMPLES,
    FILL_MAX_BLOCKS,
    FILL_THREADS,
    KERNEL_SOURCE,
    GpuWork,
    MismatchCounter,
    check_frame,
    count_mismatches,
    external_stream,
    fill_blocks,
    frame_shape_ok,
    sample_indices,
)
from ._floors import (
    InProcessFloorLane,
    OrderedFloorLane,
    SocketFloorLane,
    SocketGpuFloorLane,
    ring_position,
    wire_sizes,
)
from ._frameworks import CudaCoreLane, TorchQueueLane, ipc_api_missing
from ._ipcpool import (
    AttachScanLane,
    CupyIpcPoolAheadLane,
    CupyIpcPoolAheadSpinLane,
    CupyIpcPoolLane,
)
from ._registry import ALL_LANES, LANE_NAMES, get_lanes

__all__ = [
    "ALL_LANES",
    "CHECK_SAMPLES",
    "FILL_MAX_BLOCKS",
    "FILL_THREADS",
    "KERNEL_SOURCE",
    "LANE_NAMES",
    "AttachScanLane",
    "CudaCoreLane",
    "CupyIpcPoolAheadLane",
    "CupyIpcPoolAheadSpinLane",
    "CupyIpcPoolLane",
    "GpuWork",
    "HostStagingLane",
    "InProcessFloorLane",
    "LegacyIpcLane",
    "MismatchCounter",
    "OrderedFloorLane",
    "SocketFloorLane",
    "SocketGpuFloorLane",
    "TorchQueueLane",
    "check_frame",
    "count_mismatches",
    "external_stream",
    "fill_blocks",
    "frame_shape_ok",
    "get_lanes",
    "ipc_api_missing",
    "ring_position",
    "sample_indices",
    "wire_sizes",
]
