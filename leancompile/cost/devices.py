"""Accelerators the planner knows, and the one this process runs on.

Figures are the vendors' datasheet values for dense math (no structured sparsity), per GPU, SXM form factor where
there are several. Memory capacities are in GiB as the cards report them (HBM stacks are binary-sized); bandwidths
and throughputs in decimal units as published. ``host_link`` is one direction of the host interconnect.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

GiB = 2 ** 30
_GB, _TB, _TFLOPS = 1e9, 1e12, 1e12
# An eager PyTorch operator costs a few microseconds of host dispatch even when the kernel is trivial.
_EAGER_LAUNCH = 5e-6


@dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes
    bandwidth: float  # memory bandwidth, bytes/s
    flops: tuple[tuple[str, float], ...]  # (dtype, dense FLOP/s) for the matmul-heavy work of a transformer
    host_link: float | None  # host <-> device bytes/s in one direction; None where memory is the host's
    launch: float = _EAGER_LAUNCH  # seconds of fixed cost per operator
    free: int | None = None  # bytes free now (a live device); the planner's default budget starts here
    source: str = ""

    def peak_flops(self, dtype: torch.dtype) -> float:
        table = dict(self.flops)
        name = {torch.bfloat16: "bf16", torch.float16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}[dtype]
        if name not in table:
            raise ValueError(f"device {self.name!r} lists no {name} throughput; listed: {sorted(table)}")
        return table[name]

    @property
    def available(self) -> int:
        return self.free if self.free is not None else self.memory


def _gpu(name, memory_gib, bandwidth, bf16, fp32, fp64, link, source) -> Device:
    return Device(name, memory_gib * GiB, bandwidth,
                  (("bf16", bf16 * _TFLOPS), ("fp32", fp32 * _TFLOPS), ("fp64", fp64 * _TFLOPS)), link, source=source)


# GA102 and AD102 (RTX A6000, L40S, RTX 4090) run FP64 at 1/64 of their FP32 rate (CUDA C++ Programming Guide,
# arithmetic instruction throughput for compute capability 8.6 and 8.9); their datasheets list no FP64 figure.
_CONSUMER_FP64 = 1 / 64


DEVICES: dict[str, Device] = {d.name: d for d in (
    _gpu("a100-40gb", 40, 1555 * _GB, 312, 19.5, 19.5, 32 * _GB,
         "NVIDIA A100 Tensor Core GPU datasheet: 40GB HBM2, 1,555 GB/s; BF16 312 TFLOPS, FP32 19.5, FP64 Tensor Core "
         "19.5; PCIe Gen4"),
    _gpu("a100-80gb", 80, 2039 * _GB, 312, 19.5, 19.5, 32 * _GB,
         "NVIDIA A100 Tensor Core GPU datasheet: 80GB HBM2e, 2,039 GB/s; BF16 312 TFLOPS, FP32 19.5, FP64 Tensor "
         "Core 19.5; PCIe Gen4"),
    _gpu("h100-80gb", 80, 3350 * _GB, 989, 67, 67, 64 * _GB,
         "NVIDIA H100 Tensor Core GPU datasheet (SXM): 80GB HBM3, 3.35 TB/s; BF16 989 TFLOPS, FP32 67, FP64 Tensor "
         "Core 67; PCIe Gen5"),
    _gpu("h200-141gb", 141, 4800 * _GB, 989, 67, 67, 64 * _GB,
         "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141GB HBM3e, 4.8 TB/s; BF16 989 TFLOPS, FP32 67, FP64 Tensor "
         "Core 67; PCIe Gen5"),
    _gpu("b200-180gb", 180, 8000 * _GB, 2250, 75, 37, 64 * _GB,
         "NVIDIA HGX B200 datasheet, per GPU: 180GB HBM3e, 8 TB/s; BF16 2.25 PFLOPS, FP32 75 TFLOPS, FP64 Tensor Core "
         "37; PCIe Gen5"),
    _gpu("rtx-a6000", 48, 768 * _GB, 154.8, 38.7, 38.7 * _CONSUMER_FP64, 32 * _GB,
         "NVIDIA RTX A6000 datasheet: 48GB GDDR6, 768 GB/s; BF16 tensor 154.8 TFLOPS, FP32 38.7; PCIe Gen4"),
    _gpu("l40s", 48, 864 * _GB, 362, 91.6, 91.6 * _CONSUMER_FP64, 32 * _GB,
         "NVIDIA L40S datasheet: 48GB GDDR6, 864 GB/s; BF16 tensor 362 TFLOPS, FP32 91.6; PCIe Gen4"),
    _gpu("rtx-4090", 24, 1008 * _GB, 165.2, 82.6, 82.6 * _CONSUMER_FP64, 32 * _GB,
         "NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: 24GB GDDR6X, 1,008 GB/s; BF16 tensor "
         "(FP32 accumulate) 165.2 TFLOPS, FP32 82.6; PCIe Gen4"),
)}


def get_device(name: str) -> Device:
    """A registered accelerator by name, or ``"cpu"`` / ``"cuda"`` for the live one."""
    if name in ("cpu", "cuda", "live"):
        return live_device("cuda" if name == "live" and torch.cuda.is_available() else
                           "cpu" if name == "live" else name)
    if name not in DEVICES:
        raise ValueError(f"gpu: unknown device {name!r}; known: {', '.join(sorted(DEVICES))}, cpu, cuda")
    return DEVICES[name]


def live_device(kind: str = "cpu") -> Device:
    """The device this process runs on, with its free memory read now."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("gpu='cuda': no CUDA device is available here; name a registered device instead")
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        known = _match(props.name, total)
        if known is None:  # an unlisted GPU: its memory is live, its throughput unknown, so measure it
            return Device(props.name, total, *_measure(torch.device("cuda")), free=free, source="measured here")
        return Device(known.name, total, known.bandwidth, known.flops, known.host_link, known.launch, free,
                      f"{props.name} (live memory); {known.source}")
    if kind != "cpu":
        raise ValueError(f"kind must be 'cpu' or 'cuda'; got {kind!r}")
    bandwidth, flops, launch = _calibrate_cpu()
    return Device("cpu", _meminfo("MemTotal"), bandwidth, flops, None, launch, _meminfo("MemAvailable"),
                  f"calibrated here ({torch.get_num_threads()} threads)")


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now (host memory for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return _meminfo("MemAvailable")


def _match(name: str, total: int) -> Device | None:
    lowered = name.lower().replace(" ", "")
    for key, device in DEVICES.items():
        model = key.split("-")[0] if not key.startswith("rtx") else key.replace("-", "")
        if model in lowered and abs(device.memory - total) < 0.15 * device.memory:
            return device
    return None


def _meminfo(field: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GiB  # no /proc (not Linux): a laptop's worth


@functools.cache
def _calibrate_cpu() -> tuple[float, tuple, float]:
    return _measure(torch.device("cpu"))


def _measure(device: torch.device) -> tuple[float, tuple, float]:
    """Bandwidth (a large copy), matmul throughput per dtype, and the fixed cost of a trivial operator."""
    def best(fn, repeats=5):
        fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    src = torch.empty(2 ** 24, device=device)  # 64 MiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / best(lambda: dst.copy_(src))
    flops = []
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64), ("bf16", torch.bfloat16)):
        a = torch.randn(512, 512, device=device).to(dtype)
        flops.append((name, 2 * 512 ** 3 * 4 / best(lambda: [a @ a for _ in range(4)])))
    one = torch.ones(1, device=device)
    launch = best(lambda: [one.add(one) for _ in range(200)]) / 200
    return bandwidth, tuple(flops), launch
