#!/usr/bin/env python
"""Bandwidth of the compshard bucket-copy kernels against torch baselines.

For every kernel, bucket size and parameter count it reports GB/s of the
Triton kernel and of the torch baseline, their ratio, and the kernel's share
of the device's measured device-to-device copy bandwidth (a plain large
``Tensor.copy_``).  GB/s always counts bytes read + bytes written (so a copy
of N bytes moves 2N), for the kernels, the baselines and the reference copy alike.

Kernels (P = --param-dtype, C = --comm-dtype, W = --world-size):
  ag_in   shards (P) -> all-gather input (C)        baseline: torch.cat(shards).to(C)
  ag_out  all-gather output (C) -> params (C), out= baseline: torch.split_with_sizes_copy(out=...)
  rs_in   grads (C) -> reduce-scatter input (C) / W baseline: torch.cat(dim=1) + div_
  rs_out  reduce-scatter output (C) -> shards (P)   baseline: torch._foreach_copy_
"Bucket MiB" is the size of the flat collective buffer the kernel writes or
reads, in C.  Parameter sizes vary (ratio 1:7) and are multiples of W * 8
elements (16-byte aligned shards) unless --unaligned.

Timing (CUDA): CUDA events around a loop of calls, median over --repeats.
Before each timed loop the GPU is given a head start (torch.cuda._sleep) long
enough for the host to queue the whole loop, so the numbers are device time
even when Python launch overhead is larger than the copy; the host time per
call is reported separately ("host us").

With --cpu the same sweep runs on the CPU at the sizes asked for, through the
path compshard takes there (the pure-torch reference; TRITON_INTERPRET unset),
timed call by call (median over --repeats), against a plain CPU copy of
--d2d-mb MiB instead of the D2D copy, with --threads intra-op threads (the
benchmarks' training runs give each of 2 ranks on 2 cores one thread).

    python benchmarks/bench_kernels.py                  # full sweep on a GPU
    python benchmarks/bench_kernels.py --cpu --sizes-mb 1 16 64 --comm-dtype fp32   # the CPU path
    python benchmarks/bench_kernels.py --cpu-smoke      # seconds, on CPU: proves the script runs
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cli import make_parser

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPE_NAMES = ("fp32", "bf16", "fp16")
KERNELS = ("ag_in", "ag_out", "rs_in", "rs_out")


def parse_args(argv=None):
    p = make_parser(__doc__)
    p.add_argument(
        "--out", default=str(REPO_ROOT / "benchmarks" / "results" / "kernels.json"), help="JSON results path"
    )
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024], help="bucket sizes in MiB")
    p.add_argument("--params", type=int, nargs="+", default=[1, 10, 100, 1000], help="parameters per bucket")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--world-size", type=int, default=8, help="simulated world size (power of two)")
    p.add_argument("--param-dtype", choices=DTYPE_NAMES, default="fp32")
    p.add_argument("--comm-dtype", choices=DTYPE_NAMES, default="bf16")
    p.add_argument("--unaligned", action="store_true", help="odd shard lengths (no 16-byte vector accesses)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats; the median is reported")
    p.add_argument("--target-ms", type=float, default=20.0, help="approximate length of one timed loop")
    p.add_argument(
        "--d2d-mb",
        type=float,
        default=1024,
        help="size (MiB) of the reference copy (device-to-device; with --cpu a CPU copy)",
    )
    p.add_argument("--block-bytes", type=int, default=None, help="override the kernel block size (tuning)")
    p.add_argument("--num-warps", type=int, default=None, help="override the kernel's num_warps (tuning)")
    p.add_argument("--no-check", action="store_true", help="skip the bitwise check against the baseline")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="measure the CPU path (the torch reference) at the sizes given, against a CPU copy",
    )
    p.add_argument("--threads", type=int, default=None, help="with --cpu: torch's intra-op threads (default: torch's)")
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny sizes on CPU (reference path, or the Triton interpreter if TRITON_INTERPRET=1): "
        "checks that the script runs, numbers are meaningless",
    )
    args = p.parse_args(argv)
    if args.threads is not None and (args.threads < 1 or not args.cpu):
        p.error("--threads needs --cpu and must be at least 1")
    if args.world_size < 1 or args.world_size & (args.world_size - 1):
        p.error("--world-size must be a power of two (so that the baselines' division is exact)")
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help and a bad option answer at once

import torch  # noqa: E402

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import compshard.kernels as K  # noqa: E402
from compshard.kernels import _triton_launch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(DTYPES) == DTYPE_NAMES
MiB = 1 << 20


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- timing


class CudaTimer:
    def __init__(self, repeats: int, target_ms: float) -> None:
        self.repeats = repeats
        self.target_s = target_ms / 1e3
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.cycles_per_s = cycles / (start.elapsed_time(end) / 1e3)

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float]:
        """(median device seconds per call, host seconds per call)."""
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        estimate = (time.perf_counter() - t0) / 3
        iters = max(1, min(500, int(self.target_s / max(estimate, 1e-6))))
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host = (time.perf_counter() - t0) / iters
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.repeats):
            head_start = min(1.25 * host * iters + 1e-4, 2.0)
            torch.cuda._sleep(int(head_start * self.cycles_per_s))
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        return statistics.median(times), host


class CpuTimer:
    def __init__(self, repeats: int, target_ms: float) -> None:
        self.repeats = repeats

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float]:
        fn()
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        return median, median


# --------------------------------------------------------------------------- cases


def layout(elements: int, num_params: int, align: int) -> list[int]:
    """Per-rank shard lengths L (sum close to `elements`), sizes varying 1:7, multiples of `align`."""
    weights = [1 + (i * 5) % 7 for i in range(num_params)]
    total = sum(weights)
    lengths = [max(align, elements * w // total // align * align) for w in weights]
    if align == 1:  # unaligned: make every other shard odd-sized
        lengths = [n + (i % 2) if n > 1 else n for i, n in enumerate(lengths)]
    return lengths


def make_case(kind: str, bucket_bytes: int, num_params: int, args, device: torch.device):
    """Inputs plus (ours, baseline, check, bytes moved) for one benchmark row."""
    P, C, W = DTYPES[args.param_dtype], DTYPES[args.comm_dtype], args.world_size
    align = 1 if args.unaligned else 8
    shard_side = kind in ("ag_in", "rs_out")
    elements = bucket_bytes // C.itemsize // (1 if shard_side else W)
    lengths = layout(elements, num_params, align)
    S = sum(lengths)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(n, generator=gen, device=device).to(dtype)

    if kind == "ag_in":
        shards = [randn(n, P) for n in lengths]
        ours = lambda: K.all_gather_copy_in(shards, lengths, C)  # noqa: E731
        baseline = (lambda: torch.cat(shards).to(C)) if P != C else (lambda: torch.cat(shards))  # noqa: E731
        check = lambda: torch.equal(ours(), baseline())  # noqa: E731
        moved = S * (P.itemsize + C.itemsize)
    elif kind == "ag_out":
        gathered = randn(W * S, C)
        shapes = [(W * n,) for n in lengths]
        outs = [torch.empty(s, dtype=C, device=device) for s in shapes]
        views = [o.view(W, n) for o, n in zip(outs, lengths)]
        ours = lambda: K.all_gather_copy_out(gathered, lengths, shapes, W, out=outs)  # noqa: E731
        baseline = lambda: torch.split_with_sizes_copy(gathered.view(W, S), lengths, dim=1, out=views)  # noqa: E731

        def check() -> bool:
            expected = [t.clone() for t in (baseline() or outs)]
            return all(torch.equal(a, b) for a, b in zip(ours(), expected))

        moved = 2 * W * S * C.itemsize
    elif kind == "rs_in":
        grads = [randn(W * n, C) for n in lengths]
        views = [g.view(W, n) for g, n in zip(grads, lengths)]
        ours = lambda: K.reduce_scatter_copy_in(grads, lengths, W, C, divide_by=W)  # noqa: E731
        baseline = lambda: torch.cat(views, dim=1).div_(W)  # noqa: E731
        check = lambda: torch.equal(ours(), baseline().view(-1))  # noqa: E731  (exact: W is a power of two)
        moved = 2 * W * S * C.itemsize
    elif kind == "rs_out":
        reduced = randn(S, C)
        dsts = [torch.empty(n, dtype=P, device=device) for n in lengths]
        splits = list(reduced.split(lengths))
        ours = lambda: K.reduce_scatter_copy_out(reduced, lengths, lengths, P)  # noqa: E731
        baseline = lambda: torch._foreach_copy_(dsts, splits)  # noqa: E731

        def check() -> bool:
            baseline()
            return all(torch.equal(a, b) for a, b in zip(ours(), dsts))

        moved = S * (C.itemsize + P.itemsize)
    else:
        raise ValueError(kind)
    return ours, baseline, check, moved, S


def d2d_bandwidth(nbytes: int, timer, device: torch.device) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds, _ = timer(lambda: dst.copy_(src))
    return 2 * nbytes / seconds / 1e9


# --------------------------------------------------------------------------- main


def main(args) -> int:
    if args.cpu:
        if K.select_backend(torch.device("cpu")) != "reference":
            log("bench_kernels.py: --cpu measures the CPU path compshard trains with; unset TRITON_INTERPRET")
            return 2
        device = torch.device("cpu")
        if args.threads:
            torch.set_num_threads(args.threads)
        timer = CpuTimer(args.repeats, args.target_ms)
    elif args.cpu_smoke:
        device = torch.device("cpu")
        small = 0.25
        if K.select_backend(device) == "interpreter":  # Triton's interpreter is slow: tiny buckets, packed programs
            small = 1 / 256
            _triton_launch.INTERPRET_ROWS_ABOVE = 0
        args.sizes_mb = [s for s in args.sizes_mb if s <= small] or [small / 4, small]
        args.params = [n for n in args.params if n <= 100] or [1, 10, 100]
        args.repeats, args.d2d_mb = min(args.repeats, 3), 16
        timer = CpuTimer(args.repeats, args.target_ms)
    else:
        if not torch.cuda.is_available():
            log(
                "bench_kernels.py: no CUDA device is available; this benchmark measures GPU bandwidth.\n"
                "Run it on a machine with an NVIDIA GPU, pass --cpu to measure the CPU path, or --cpu-smoke to check "
                "that the script runs."
            )
            return 2
        device = torch.device("cuda")
        timer = CudaTimer(args.repeats, args.target_ms)
    if args.block_bytes:
        _triton_launch.BLOCK_BYTES = args.block_bytes
    if args.num_warps:
        _triton_launch.NUM_WARPS = args.num_warps
    backend = K.select_backend(device)
    device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    )
    log(f"device: {device_name}; kernels run via: {backend}")

    copy_name = "D2D" if device.type == "cuda" else "CPU"
    log(f"measuring the {copy_name} copy bandwidth ({args.d2d_mb:g} MiB) ...")
    d2d = d2d_bandwidth(int(args.d2d_mb * MiB), timer, device)
    log(f"  {copy_name} copy: {d2d:.1f} GB/s")

    configs = [(k, s, n) for k in args.kernels for s in args.sizes_mb for n in args.params]
    rows, failures = [], []
    for index, (kind, size_mb, num_params) in enumerate(configs, 1):
        log(f"[{index}/{len(configs)}] {kind} {size_mb:g} MiB, {num_params} params ...")
        ours, baseline, check, moved, S = make_case(kind, int(size_mb * MiB), num_params, args, device)
        ok = None
        if not args.no_check:
            ok = bool(check())
            if not ok:
                failures.append((kind, size_mb, num_params))
                log("  MISMATCH between the kernel and the baseline")
        t_ours, host_ours = timer(ours)
        t_base, host_base = timer(baseline)
        row = {
            "kernel": kind,
            "bucket_mb": size_mb,
            "params": num_params,
            "shard_elements": S,
            "bytes_moved": moved,
            "ours_gbps": moved / t_ours / 1e9,
            "torch_gbps": moved / t_base / 1e9,
            "speedup": t_base / t_ours,
            "pct_of_d2d": 100 * moved / t_ours / 1e9 / d2d,
            "ours_us": t_ours * 1e6,
            "torch_us": t_base * 1e6,
            "ours_host_us": host_ours * 1e6,
            "torch_host_us": host_base * 1e6,
            "matches_baseline": ok,
        }
        rows.append(row)
        log(
            f"  ours {row['ours_gbps']:.1f} GB/s ({row['pct_of_d2d']:.0f}% of {copy_name} copy), "
            f"torch {row['torch_gbps']:.1f} GB/s, x{row['speedup']:.2f}"
        )
        del ours, baseline, check
        if device.type == "cuda":
            torch.cuda.empty_cache()

    from tabulate import tabulate

    table = [
        [
            r["kernel"],
            f"{r['bucket_mb']:g}",
            r["params"],
            f"{r['ours_gbps']:.1f}",
            f"{r['torch_gbps']:.1f}",
            f"{r['speedup']:.2f}",
            f"{r['pct_of_d2d']:.0f}",
            f"{r['ours_us']:.1f}",
            f"{r['torch_us']:.1f}",
            f"{r['ours_host_us']:.1f}",
            {True: "ok", False: "MISMATCH", None: "-"}[r["matches_baseline"]],
        ]
        for r in rows
    ]
    headers = [
        "kernel",
        "bucket MiB",
        "params",
        "ours GB/s",
        "torch GB/s",
        "speedup",
        f"% {copy_name}",
        "ours us",
        "torch us",
        "host us",
        "check",
    ]
    print(
        f"device: {device_name} | backend: {backend} | {copy_name} copy: {d2d:.1f} GB/s | "
        f"world size {args.world_size} | "
        f"param {args.param_dtype}, comm {args.comm_dtype}{' | unaligned' if args.unaligned else ''}"
    )
    print(tabulate(table, headers=headers, tablefmt="github"))

    result = {
        "device": device_name,
        "backend": backend,
        "cpu_smoke": args.cpu_smoke,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "world_size": args.world_size,
        "param_dtype": args.param_dtype,
        "comm_dtype": args.comm_dtype,
        "unaligned": args.unaligned,
        "repeats": args.repeats,
        "block_bytes": _triton_launch.BLOCK_BYTES,
        "num_warps": _triton_launch.NUM_WARPS,
        "d2d_gbps": d2d,
        "gbps_counts": "bytes read + bytes written",
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    if failures:
        log(f"{len(failures)} configuration(s) did not match the baseline: {failures}")
        return 1
    return 0


def _triton_version() -> str | None:
    if not K.triton_available():
        return None
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main(ARGS))
