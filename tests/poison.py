"""NaN-poisoned CUDA memory for the tests: an output element that no kernel writes reads NaN, never a value that
an earlier call left in the same bytes.

torch's caching allocator keeps freed blocks and hands them out again: requests of at most 1 MiB from the small
pool (2 MiB segments), larger ones from the large pool. Freeing one big NaN tensor poisons only the large pool,
and a cached block that already fits a request (an earlier output of the same size) is reused before any NaN
block. `poison_allocator` therefore fills every free block of both pools of the default memory pool on the
current stream with 0xFF bytes (NaN in FP32 and BF16, -1 in int64), then adds fresh poisoned segments to both
pools for allocations that fit no cached block. Call it right before the call under test (never inside graph
capture: graphs allocate from their own pool, so their tests fill the static outputs with NaN instead).
"""
import torch

POISON_BYTE = 0xFF
SMALL_REQUEST = 1 << 20  # the largest request the small pool serves
FRESH_SMALL = 256 << 20  # fresh small-pool segments: 128 x 2 MiB
FRESH_LARGE = 2 << 30  # one fresh large-pool segment, capped at a quarter of the free device memory


def _free_blocks(device: int, stream: int):
    """(pool, size) of every free block of the default memory pool on (device, stream)."""
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device) != device or seg["stream"] != stream:
            continue
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):  # a graph's private pool
            continue
        for block in seg["blocks"]:
            if block["state"] == "inactive":
                yield seg["segment_type"], block["size"]


def _filled(nbytes: int, device: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(POISON_BYTE)


def poison_allocator() -> None:
    """Fill the free blocks of both caching-allocator pools (current device and stream) with 0xFF bytes and add
    fresh 0xFF segments to both pools, so that the next allocations are carved from NaN memory."""
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream().cuda_stream
    # The last call's fresh segments go back to the driver first: without this the cache grows by them at every
    # call (a session of poisoned tests ran the H200 out of memory).
    torch.cuda.empty_cache()
    held = []
    # Largest first, each request the size of a free block (small-pool pieces capped at what that pool serves):
    # best fit then takes exactly the blocks seen. A request that found no block opened a new segment whose rest
    # the next round fills.
    for _ in range(8):
        blocks = sorted(_free_blocks(device, stream), key=lambda b: -b[1])
        if not blocks:
            break
        for pool, size in blocks:
            held.append(_filled(min(size, SMALL_REQUEST) if pool == "small" else size, device))
    free, _ = torch.cuda.mem_get_info(device)
    held.append(_filled(min(FRESH_LARGE, free // 4), device))
    held += [_filled(SMALL_REQUEST, device) for _ in range(FRESH_SMALL // SMALL_REQUEST)]
    del held  # back into the pools (not to the driver), poisoned
