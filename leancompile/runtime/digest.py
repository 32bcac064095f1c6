"""A digest of the values of a module's weights, one integer per tensor, taken per kept call and per answer.

Version counters see every write autograd knows of, but not one through ``.data`` (Flow-Factory's reference and EMA
swaps, diffusers' ``EMAModel.copy_to``), a ``set_`` or a write into an alias: only the values themselves show those.

On the CPU each tensor's bytes are hashed by XXH3-64 (the ``xxhash`` package) where they lie: memory is read once,
at memory bandwidth, and any change of the bytes shows but with probability 2**-64 (a per-tensor norm would miss a
permutation and a sign flip).

CUDA has no such hash in torch: there a tensor's bytes are laid in rows of :data:`ROW` bytes (each tensor padded
to whole rows, so that a row belongs to one tensor) and multiplied, as int8, by a fixed random int8 matrix of
:data:`COLUMNS` columns whose entries are odd (``torch._int_mm``, int32 results: exact, a row's sums are below
``ROW * 128 * 127 < 2**31``). A row's digest is its products times random 64-bit weights, the first odd and the
others even; the tensor's, the sum of its rows' digests times random odd weights of the rows' places; both modulo
2**64 (integer arithmetic wraps: exact, and independent of the reduction's order). A change of one byte by ``d``
(``0 < |d| < 256``) moves the row's products by ``d`` times that byte's odd entries and its digest by ``d`` times
an odd number (an odd product plus even ones), never 0 modulo 2**64, and the row's change moves the tensor's by a
nonzero multiple of an odd weight: a single changed byte is always seen. Several changes cancel only where the
random entries satisfy an equation in every column at once, and then the weights modulo 2**64. The products read
each byte once and write 4 bytes a column per row; a row's digest reads and writes those few: about 1.2 bytes of
traffic per byte of weights (``benchmarks.weight_check``; the elementwise sums they replace moved 9). A device
without int8 products computes the same integers by float32 products of :data:`FLOAT_EXACT` bytes (exact:
every such sum is below 2**24), at about 9.
"""
from __future__ import annotations

import ctypes
import functools

import torch

ROW = 4096  # bytes a row (a multiple of 8, as CUDA's int8 products ask)
COLUMNS = 16  # int8 products a row
FLOAT_EXACT = 1024  # bytes whose products a float32 sum holds exactly (1024 * 128 * 127 < 2**24)
BUCKET = 1 << 28  # bytes copied into rows at once at most (a larger tensor alone)
IN_PLACE = 1 << 17  # bytes from which a tensor of whole rows is read where it lies
# Bytes of memory traffic a digest moves per byte of weights (tensors of whole rows, read where they lie), by device
TRAFFIC = {"cpu": 1, "cuda": 1.2}


class Unreadable(Exception):
    """A tensor whose storage does not hold its values (a framework freed it, as FSDP resharding does)."""


def digest(tensors: list[torch.Tensor], weighted: bool = False) -> torch.Tensor:
    """One int64 per tensor of ``tensors`` (on the first one's device), equal for two lists exactly when their
    values are (but for the odds above). A sharded DTensor is read by its local shard, a DeepSpeed ZeRO-3 parameter
    by its partition; tensors on several devices are digested on each. Raises :class:`Unreadable` for a tensor with
    no storage behind its values. ``weighted``: by CUDA's int8 products on the CPU too (tested there)."""
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
    """The tensors' bytes, padded, as int8 rows of :data:`ROW` bytes, one bucket at a time."""
    zeros = torch.zeros(ROW, dtype=torch.uint8, device=device)
    pieces, size = [], 0
    for flat, pad in zip(flats, pads):
        whole = not pad and flat.numel() >= IN_PLACE
        if pieces and (whole or size + flat.numel() + pad > BUCKET):
            yield _joined(pieces)
            pieces, size = [], 0
        if whole:  # read where it lies where aligned (_joined)
            yield _joined([flat])
            continue
        pieces += [flat, zeros[:pad]] if pad else [flat]
        size += flat.numel() + pad
    if pieces:
        yield _joined(pieces)


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces as rows: one piece read where it lies from a 16-byte boundary (int8 products on CUDA want their
    operands so aligned), else copied."""
    whole = pieces[0] if len(pieces) == 1 and pieces[0].data_ptr() % 16 == 0 else torch.cat(pieces)
    return whole.view(torch.int8).view(-1, ROW)


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Each row's products with the random int8 matrix times the column weights, summed modulo 2**64."""
    return _products(rows).to(torch.int64).mul_(_column_weights(rows.device)).sum(dim=1)


def _products(rows: torch.Tensor) -> torch.Tensor:
    """``rows @ matrix`` in exact int32: by int8 products where the device has them, else in float32."""
    matrix = _matrix(rows.device)
    if _int8_products(rows.device):
        if rows.shape[0] > 16:
            return torch._int_mm(rows, matrix)
        # CUDA's int8 product takes more than 16 rows: zero rows pad a bucket of fewer (their products are 0)
        return torch._int_mm(torch.cat([rows, rows.new_zeros(17 - rows.shape[0], ROW)]), matrix)[:rows.shape[0]]
    # float32 is exact while every sum is below 2**24: per stretch of FLOAT_EXACT bytes, summed in int32 after
    parts = rows.view(-1, ROW // FLOAT_EXACT, FLOAT_EXACT).transpose(0, 1).to(torch.float32)
    stretches = matrix.view(ROW // FLOAT_EXACT, FLOAT_EXACT, COLUMNS).to(torch.float32)
    return torch.bmm(parts, stretches).to(torch.int32).sum(0, dtype=torch.int32)


@functools.lru_cache(maxsize=8)
def _int8_products(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` runs on ``device`` (an older GPU's cuBLAS may refuse it)."""
    try:
        rows = torch.ones(17, ROW, dtype=torch.int8, device=device)
        return bool((torch._int_mm(rows, _matrix(device)) == _matrix(device).sum(0, dtype=torch.int32)).all())
    except RuntimeError:
        return False


class _Layout:
    """Per tensor: the bytes padding it to whole rows; per row: its tensor and its place's weight."""

    def __init__(self, sizes: tuple[int, ...], device: torch.device):
        counts = [max(-(-n // ROW), 1) for n in sizes]
        self.pads = tuple(c * ROW - n for c, n in zip(counts, sizes))
        self.owner = torch.repeat_interleave(torch.arange(len(sizes), device="cpu"),
                                             torch.tensor(counts, device="cpu")).to(device)
        total = sum(counts)
        self.places = _weights(1 << (total - 1).bit_length(), device, seed=1)[:total]


@functools.lru_cache(maxsize=64)
def _layout(sizes: tuple[int, ...], device: torch.device) -> _Layout:
    return _Layout(sizes, device)


@functools.lru_cache(maxsize=8)
def _matrix(device: torch.device) -> torch.Tensor:
    """The ``(ROW, COLUMNS)`` random int8 matrix the rows are multiplied by: odd entries in [-127, 127]."""
    generator = torch.Generator().manual_seed(0x1EA5 + 2)
    drawn = torch.randint(-64, 64, (ROW, COLUMNS), generator=generator, dtype=torch.int64, device="cpu")
    return (drawn * 2 + 1).to(torch.int8).to(device)


@functools.lru_cache(maxsize=8)
def _column_weights(device: torch.device) -> torch.Tensor:
    """The products' weights in a row's digest: the first odd, the others even, so that each byte's (its odd
    entries times them, summed) is odd."""
    weights = _weights(COLUMNS, device, seed=0).clone()
    weights[1:] -= 1
    return weights


@functools.lru_cache(maxsize=32)
def _weights(n: int, device: torch.device, seed: int) -> torch.Tensor:
    """``n`` random odd 64-bit integers, drawn on the CPU from a fixed seed (every device and process
    agrees); the rows' places take a power of two of them, so that a few draws serve every layout."""
    generator = torch.Generator().manual_seed(0x1EA5 + seed)
    drawn = torch.randint(-(1 << 62), 1 << 62, (n,), generator=generator, dtype=torch.int64, device="cpu")
    return (drawn * 2 + 1).to(device)
