"""Value checks without a host sync: the error slots the kernels write on bad input, and how the host reports them.

A CUDA kernel that reads an index or a timestep checks it on the device, where it reads it anyway: a bad row
writes NaN outputs (never an out-of-bounds access, never a clamp) and records itself in its call's *slot*:
`red.global.min.s64` of the row into the slot's device word (the first bad row, device memory) and plain
stores of row + 1 and the bound (the table's row count) into the slot's host-mapped words (pinned host memory,
which a kernel reaches through unified addressing and the host reads without any CUDA call). Nothing waits:
the check costs the kernel no extra pass and the caller no sync, and CUDA graph capture records it like the
rest of the launch.

The host reads the host-mapped words at the next `torch.ops.h3` call (the Python impls in
h3cute.ops._library, the C++ fast paths in h3cute.native) and in `h3cute.check_errors()`, which waits for the
device first. A set slot raises there, outside any capture, after a device sync (an error path), as an
`IndexError` / `ValueError` naming the op, the argument, the first bad row and the bound; the slot is then
cleared. So a bad index surfaces as a Python exception at the next h3 call the host makes after the GPU ran
the faulty one (or at `check_errors()`), and the CUDA context stays usable.

One slot per (op, argument) a caller can get wrong (SLOTS); calls with their check off (`check_indices=False`,
`check_range=False`) write the DISCARD slot, which nobody reads. Slots live per device, allocated on first use.
"""
from __future__ import annotations

import threading

import torch

# (op, argument, what the argument must hold); the index of a slot is its position here.
SLOTS = (
    ("timestep_sinusoid", "t", "timesteps in [0, 1] (t scaled by 1000? H3 takes t in [0, 1]; NaN is bad too)"),
    ("adaln_indices", "timestep_indices", "indices into the call's timesteps, [0, num_timesteps)"),
    ("adaln_indices", "token_tags", "modality tags, 0 video, 1 text, 2 audio"),
    ("adaln_row_gather", "adaln_indices", "rows of the (3T, 6H) table: 3 per timestep"),
    ("norm_modulate", "adaln_indices", "rows of the shift/scale tables: 3 per timestep"),
    ("gate_residual", "adaln_indices", "rows of the gate table: 3 per timestep"),
    ("gate_residual_norm_modulate", "adaln_indices", "rows of the gate/shift/scale tables: 3 per timestep"),
    ("final_adaln_out", "timestep_indices", "rows of the (T, 2H) projection: one per timestep"),
)
SLOT = {(op, arg): i for i, (op, arg, _) in enumerate(SLOTS)}
DISCARD = len(SLOTS)  # unchecked calls: written, never read
NUM_SLOTS = DISCARD + 1
NO_ROW = (1 << 63) - 1  # a device word with no bad row
HOST_WORDS = 2  # per slot in host-mapped memory: [bad row + 1 (0: none), bound]


class DeviceSlots:
    """The error slots of one CUDA device: `rows` (NUM_SLOTS,) int64 in device memory, `host` (NUM_SLOTS, 2) int64
    in pinned host memory (kernels write it through unified addressing)."""

    def __init__(self, device: int):
        self.device = device
        self.rows = _persistent_full((NUM_SLOTS,), NO_ROW, torch.device("cuda", device))
        self.host = torch.zeros((NUM_SLOTS, HOST_WORDS), dtype=torch.int64, pin_memory=True)
        self.flags = self.host.numpy()  # a view: reads the pinned words with no CUDA call

    def addresses(self, slot: int) -> tuple[int, int]:
        """(device word, host words) addresses of `slot`, the two Int64 arguments of a checking kernel."""
        return self.rows.data_ptr() + 8 * slot, self.host.data_ptr() + 8 * HOST_WORDS * slot

    def pending(self) -> bool:
        return bool(self.flags[:DISCARD, 0].any())


def _persistent_full(shape, value, device: torch.device) -> torch.Tensor:
    """A device tensor that lives as long as the process, allocated by a thread of its own: torch.compile's CUDA
    graphs (mode="reduce-overhead") warm up by running the graph once with the calling thread's allocations sent to
    the graphs' private pool, and a tensor that outlives the warm-up there fails the graphs' pool check. (Not inside
    a capture: the first h3 call of a process must run outside one, as its kernels' first load does.)"""
    made = []

    def allocate():
        made.append(torch.full(shape, value, dtype=torch.int64, device=device))
        torch.cuda.synchronize(device)  # filled before any stream of the caller reads it

    worker = threading.Thread(target=allocate, name="h3cute-check-slots")
    worker.start()
    worker.join()
    if not made:
        raise RuntimeError(f"h3cute: could not allocate the check slots on {device}")
    return made[0]


_slots: dict[int, DeviceSlots] = {}
_lock = threading.Lock()


def device_slots(device) -> DeviceSlots:
    index = device.index if isinstance(device, torch.device) else int(device)
    if index is None:
        index = torch.cuda.current_device()
    slots = _slots.get(index)
    if slots is None:
        with _lock:
            slots = _slots.get(index)
            if slots is None:
                slots = _slots[index] = DeviceSlots(index)
    return slots


def slot_addresses(device, op: str, argument: str, checked: bool = True) -> tuple[int, int]:
    """The kernel arguments (device word, host words) of (op, argument)'s slot, or of DISCARD when unchecked."""
    return device_slots(device).addresses(SLOT[(op, argument)] if checked else DISCARD)


def host_words(device: int) -> tuple[int, int]:
    """(address, slot count) of a device's host-mapped words, for the C++ layer's pending check: slot s is
    pending when the int64 at address + 16 s is non-zero (s < count)."""
    slots = device_slots(device)
    return slots.host.data_ptr(), DISCARD


def raise_pending() -> None:
    """Raises the first recorded bad input of any device (and clears its slot); nothing when none is recorded.
    Cheap when nothing is pending (a read of pinned host memory per device); never inside a CUDA graph
    capture (it would need a sync): the error then waits for the next call outside it."""
    for slots in tuple(_slots.values()):
        if slots.pending() and not torch.cuda.is_current_stream_capturing():
            _raise(slots)


def check_errors() -> None:
    """Waits for every device h3cute has checked inputs on, then raises the first bad input any h3 call
    recorded (see the module docstring). Call it where a sync is fine, e.g. after a step."""
    for slots in tuple(_slots.values()):
        torch.cuda.synchronize(slots.device)
    raise_pending()


def _raise(slots: DeviceSlots) -> None:
    torch.cuda.synchronize(slots.device)  # every recording kernel has finished: the device words are final
    rows = slots.rows.tolist()
    errors = []
    for slot in range(DISCARD):
        if slots.flags[slot, 0]:
            errors.append((slot, rows[slot], int(slots.flags[slot, 1])))
    slots.rows[:DISCARD].fill_(NO_ROW)
    slots.flags[:DISCARD] = 0
    torch.cuda.synchronize(slots.device)
    slot, row, bound = errors[0]
    op, argument, what = SLOTS[slot]
    others = "".join(f"; also h3::{SLOTS[s][0]}: {SLOTS[s][1]}[{r}]" for s, r, _ in errors[1:])
    where = (f"h3::{op}: {argument}[{row}] is outside [0, 1]" if op == "timestep_sinusoid"
             else f"h3::{op}: {argument}[{row}] is outside [0, {bound})")
    message = (f"{where} ({what}); the call wrote NaN for that row and was checked on the device without a host "
               f"sync, so this is raised at the next h3 call or h3cute.check_errors(){others}")
    raise (ValueError if op == "timestep_sinusoid" else IndexError)(message)
