"""A digest of the values of a module's weights, one integer per tensor, taken per kept call and per answer.

Version counters see every write autograd knows of, but not one through ``.data`` (Flow-Factory's reference and EMA
swaps, diffusers' ``EMAModel.copy_to``), a ``set_`` or a write into an alias: only the values themselves show those.

On the CPU each tensor's bytes are hashed by XXH3-64 (the ``xxhash`` package) where they lie: memory is read once,
at memory bandwidth, and any change of the bytes shows but with probability 2**-64 (a per-tensor norm would miss a
permutation and a sign flip).

CUDA has no such hash in torch: there a tensor's bytes are read as 32-bit words, laid in rows of :data:`ROW` words
(each tensor padded to whole rows, so that a row belongs to one tensor). Each row's digest is the sum of its words
times random odd 64-bit weights; the tensor's, the sum of its rows' digests times random odd weights of the rows'
places; all modulo 2**64 (integer arithmetic wraps: exact, and independent of the reduction's order). A change of
one word by ``d`` (``0 < |d| < 2**32``) moves its row's digest by ``d * w``, never 0 modulo 2**64 for an odd ``w``,
and the row's change moves the tensor's by a nonzero multiple of an odd weight: a single changed word is always
seen. Several changes cancel only where the random weights satisfy an equation: a change of the words' top bits
``2**31 * s_k`` only where ``sum(s_k w_k)`` is 0 modulo 2**33, at odds near 2**-33. The small tensors' bytes are
copied into rows (in buckets of :data:`BUCKET` bytes; a tensor of whole rows from :data:`IN_PLACE` bytes is read
where it lies), widened to 64-bit words (read 4, written 8 bytes a word), the products written and read once more
and summed: about 36 bytes of traffic a 32-bit word, 9 times the weights' bytes (``benchmarks.weight_check``
measures it).
"""
from __future__ import annotations

import ctypes
import functools

import torch

ROW = 256  # 32-bit words a row
BUCKET = 1 << 28  # bytes copied into rows at once at most (a larger tensor alone)
IN_PLACE = 1 << 16  # bytes from which a tensor of whole rows is read where it lies
# Bytes of memory traffic a digest moves per byte of weights (tensors of whole rows, read where they lie), by device
TRAFFIC = {"cpu": 1, "cuda": 9}


class Unreadable(Exception):
    """A tensor whose storage does not hold its values (a framework freed it, as FSDP resharding does)."""


def digest(tensors: list[torch.Tensor], weighted: bool = False) -> torch.Tensor:
    """One int64 per tensor of ``tensors`` (on the first one's device), equal for two lists exactly when their
    values are (but for the odds above). A sharded DTensor is read by its local shard, a DeepSpeed ZeRO-3 parameter
    by its partition; tensors on several devices are digested on each. Raises :class:`Unreadable` for a tensor with
    no storage behind its values. ``weighted``: by CUDA's weighted sums on the CPU too (tested there)."""
    sources = [_source(t) for t in tensors]
    if not sources:
        return torch.zeros(0, dtype=torch.int64, device="cpu")
    by_device: dict[torch.device, list[int]] = {}
    for i, source in enumerate(sources):
        by_device.setdefault(source.device, []).append(i)
    if len(by_device) == 1:
        return _on_one_device(sources, sources[0].device, weighted)
    out = torch.zeros(len(sources), dtype=torch.int64, device=sources[0].device)
    for device, indices in by_device.items():
        part = _on_one_device([sources[i] for i in indices], device, weighted).to(out.device)
        out.index_copy_(0, torch.tensor(indices, device=out.device), part)
    return out


def _on_one_device(sources: list[torch.Tensor], device: torch.device, weighted: bool) -> torch.Tensor:
    if device.type == "cpu" and not weighted:
        return _hashed(sources)
    flats = [_bytes(s) for s in sources]
    layout = _layout(tuple(f.numel() for f in flats), device)
    sums = torch.cat([_row_sums(rows) for rows in _rows(flats, layout.pads, device)])
    return torch.zeros(len(flats), dtype=torch.int64, device=device).index_add_(0, layout.owner,
                                                                                sums.mul_(layout.places))


def _hashed(sources: list[torch.Tensor]) -> torch.Tensor:
    """XXH3-64 of each CPU tensor's bytes, read where they lie (a copy where not contiguous), as int64 on the CPU."""
    import xxhash  # imported with the first digest, not with leancompile

    flats = [s if s.is_contiguous() else _bytes(s) for s in sources]  # alive while their memory is read
    hashes = [xxhash.xxh3_64_intdigest(_buffer(flat)) for flat in flats]
    return torch.tensor([h - (1 << 64) if h >> 63 else h for h in hashes], dtype=torch.int64, device="cpu")


def _buffer(t: torch.Tensor):
    """The bytes of the contiguous ``t`` as a buffer over its memory. Not ``numpy()``: a storage a NumPy array has
    viewed can no longer be resized, and FSDP frees a gathered parameter by resizing its storage to 0."""
    return (ctypes.c_char * t.nbytes).from_address(t.data_ptr()) if t.nbytes else b""


def _source(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory holds ``t``'s values on this rank."""
    t = t.detach() if getattr(t, "ds_tensor", None) is None else _zero3_partition(t)
    if hasattr(t, "to_local"):  # FSDP2's DTensor: each rank digests its own shard
        t = t.to_local()
    if t.numel() and t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
        raise Unreadable(f"a tensor of shape {tuple(t.shape)} has no storage behind its values")
    return t


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a flat tensor of bytes (a copy where ``t`` is not contiguous)."""
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    return t.contiguous().reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _zero3_partition(param: torch.Tensor) -> torch.Tensor:
    """A DeepSpeed ZeRO-3 parameter's own partition on this rank (``ds_tensor``), which the optimizer writes: the
    parameter's data is empty outside the modules' calls and, while gathered, a buffer freed after them. Raises
    :class:`Unreadable` where the partition is not in memory (swapped out to NVMe)."""
    partition = param.ds_tensor
    if partition.status.name == "NOT_AVAILABLE" or partition.numel() != partition.ds_numel:
        raise Unreadable(f"a ZeRO-3 parameter of shape {tuple(param.ds_shape)} holds no partition in memory")
    return partition.detach()


def _rows(flats: list[torch.Tensor], pads: tuple[int, ...], device: torch.device):
    """The tensors' bytes, padded, as rows of 32-bit words, one bucket at a time."""
    zeros = torch.zeros(4 * ROW, dtype=torch.uint8, device=device)
    pieces, size = [], 0
    for flat, pad in zip(flats, pads):
        whole = not pad and flat.numel() >= IN_PLACE and flat.storage_offset() % 4 == 0
        if pieces and (whole or size + flat.numel() + pad > BUCKET):
            yield _joined(pieces)
            pieces, size = [], 0
        if whole:  # read where it lies, not copied
            yield _joined([flat])
            continue
        pieces += [flat, zeros[:pad]] if pad else [flat]
        size += flat.numel() + pad
    if pieces:
        yield _joined(pieces)


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    # one piece is read in place where its bytes start on a word
    whole = pieces[0] if len(pieces) == 1 and pieces[0].storage_offset() % 4 == 0 else torch.cat(pieces)
    return whole.view(torch.int32).view(-1, ROW)


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Each row's words times the row weights, summed modulo 2**64."""
    return rows.to(torch.int64).mul_(_weights(ROW, rows.device, seed=0)).sum(dim=1)


class _Layout:
    """Per tensor: the bytes padding it to whole rows; per row: its tensor and its place's weight."""

    def __init__(self, sizes: tuple[int, ...], device: torch.device):
        row = 4 * ROW
        counts = [max(-(-n // row), 1) for n in sizes]
        self.pads = tuple(c * row - n for c, n in zip(counts, sizes))
        self.owner = torch.repeat_interleave(torch.arange(len(sizes), device="cpu"),
                                             torch.tensor(counts, device="cpu")).to(device)
        total = sum(counts)
        self.places = _weights(1 << (total - 1).bit_length(), device, seed=1)[:total]


@functools.lru_cache(maxsize=64)
def _layout(sizes: tuple[int, ...], device: torch.device) -> _Layout:
    return _Layout(sizes, device)


@functools.lru_cache(maxsize=32)
def _weights(n: int, device: torch.device, seed: int) -> torch.Tensor:
    """``n`` random odd 64-bit integers, drawn on the CPU from a fixed seed (every device and process
    agrees); the rows' places take a power of two of them, so that a few draws serve every layout."""
    generator = torch.Generator().manual_seed(0x1EA5 + seed)
    drawn = torch.randint(-(1 << 62), 1 << 62, (n,), generator=generator, dtype=torch.int64, device="cpu")
    return (drawn * 2 + 1).to(device)
