#!/usr/bin/env python3
"""Times torch.distributed's all_to_all_single with the split matrix of nccl-rs's bench
(`bench all_to_all_v --splits zipf:S --seed N`), printing nccl-tests-like lines, so the two
can stand side by side. Needs only torch (NCCL backend, one GPU per process).

    torchrun --nproc_per_node 2 benches/torch_all_to_all_single.py -b 1M -e 512M -f 2 --splits zipf:1.1
    mpirun -np 2 python benches/torch_all_to_all_single.py -b 1M -e 512M -f 2 --splits even
    python benches/torch_all_to_all_single.py --self-test     # the generator only, no torch

Sizes, algbw and busbw are the bench's: size = each rank's send buffer (rounded down to n
elements), algbw = size / time, busbw = B / time with B the bytes the busiest rank sends to
or receives from the other ranks. Time: the bench's host method (one op and a wait, a
barrier, -n ops back to back until the stream is idle), mean over ranks. Buffers: as the
bench (and nccl-tests) moves them, one send and one receive buffer for every size, and
iteration i uses them from span * (i % (length / span)), span being the elements one call
touches; `--shift 0` keeps torch's usual fixed tensors per size instead (the L2 cache then
holds more of them, which shows at sizes where two rotations no longer fit).
"""
import argparse
import math
import os
import sys
import time

# Never NVLink multicast (the project's rule), set before NCCL initialises.
os.environ["NCCL_NVLS_ENABLE"] = "0"

M64 = (1 << 64) - 1

# The rows examples/bench/splits.rs asserts too (its EXPECTED).
EXPECTED = [
    ("zipf:1.1", 1000, 4, 1, 0, [151, 504, 235, 110]),
    ("zipf:1.1", 1000, 4, 1, 3, [110, 235, 151, 504]),
    ("zipf:2", 1048576, 4, 7, 1, [736561, 184140, 46035, 81840]),
    ("zipf:1.1", 8388608, 8, 1, 5, [339119, 1558184, 3340040, 568702, 997513, 392775, 465356, 726919]),
    ("even", 10, 4, 1, 2, [3, 3, 2, 2]),
]


def _next(state):
    """splitmix64, as examples/bench/splits.rs `next`."""
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def parse_splits(text):
    text = text.strip().lower()
    if text == "even":
        return None
    if not text.startswith("zipf:"):
        raise ValueError(f"--splits: expected even or zipf:S, got {text!r}")
    s = float(text[5:])
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"--splits: the exponent must be finite and >= 0, got {text!r}")
    return s


def split(exponent, total, n, seed, row):
    """examples/bench/splits.rs `split`, line by line (exponent None: even)."""
    if n == 0:
        return []
    if exponent is None:
        return [total // n + (1 if j < total % n else 0) for j in range(n)]
    state = (seed ^ (((row + 1) * 0xD1B54A32D192ED03) & M64)) & M64
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        state, r = _next(state)
        j = r % (i + 1)
        order[i], order[j] = order[j], order[i]
    weights = [0] * n
    for k, dest in enumerate(order):
        # float ** float is the C library's pow, as Rust's powf.
        weights[dest] = int(math.floor(4294967296.0 / float(k + 1) ** exponent))
    total_w = sum(weights)
    parts = [total * w // total_w for w in weights]
    left = total - sum(parts)
    by_remainder = sorted(range(n), key=lambda j: (-(total * weights[j] % total_w), j))
    for j in by_remainder[:left]:
        parts[j] += 1
    return parts


def self_test():
    for splits, total, n, seed, row, want in EXPECTED:
        got = split(parse_splits(splits), total, n, seed, row)
        assert got == want, f"{splits} total {total} n {n} seed {seed} row {row}: {got} != {want}"


def size_arg(text):
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def sizes(args):
    out, size = [], args.minbytes
    while size <= args.maxbytes:
        out.append(size)
        nxt = size * args.stepfactor if args.stepfactor > 1 else size + args.stepbytes
        if nxt <= size:
            break
        size = nxt
    return out


def env_rank():
    for r, w, l in [("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")]:
        if r in os.environ and w in os.environ:
            return int(os.environ[r]), int(os.environ[w]), int(os.environ.get(l, os.environ[r]))
    sys.exit("launch with torchrun or mpirun (no RANK/WORLD_SIZE in the environment)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=size_arg, default=32 << 20)
    p.add_argument("-e", "--maxbytes", type=size_arg, default=32 << 20)
    p.add_argument("-i", "--stepbytes", type=size_arg, default=1 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=1)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-c", "--check", type=int, default=1, help="check the received data (0: off)")
    p.add_argument("-d", "--datatype", default="float", choices=["float", "half", "bfloat16", "double", "int32", "int8"])
    p.add_argument("--splits", default="even")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--shift", type=int, default=1, choices=[0, 1],
                   help="1: move the buffers per iteration as the bench does (default); 0: fixed tensors")
    p.add_argument("--self-test", action="store_true", help="check the generator against EXPECTED and exit")
    args = p.parse_args()
    self_test()
    if args.self_test:
        print("split generator matches examples/bench/splits.rs")
        return
    exponent = parse_splits(args.splits)

    import torch
    import torch.distributed as dist

    rank, world, local = env_rank()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
    dtype = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
             "double": torch.float64, "int32": torch.int32, "int8": torch.int8}[args.datatype]
    elem = torch.tensor([], dtype=dtype).element_size()
    n = world
    stream = torch.cuda.current_stream()

    def mean_over_ranks(value):
        t = torch.tensor([value], dtype=torch.float64, device="cuda")
        dist.all_reduce(t)
        return t.item() / n

    if rank == 0:
        print(f"# torch {torch.__version__} all_to_all_single, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{n} ranks, splits {args.splits} seed {args.seed}, NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}")
        print("# busbw = bytes the busiest rank sends to or receives from the others / time")
        print(f"# {'size':>10}  {'count':>12}  {'type':>8}  {'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}")
        print(f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}")

    def layout(size):
        """The bench's layout of one size: (per_rank, total, split matrix, span)."""
        per_rank = size // elem // n
        total = per_rank * n
        matrix = [split(exponent, total, n, args.seed, row) for row in range(n)]
        recv_total = sum(matrix[i][rank] for i in range(n))
        return per_rank, total, matrix, max(total, recv_total)

    # The bench's buffer length: the largest size, or more where Zipf splits make a rank
    # receive more than a size's total.
    length = max([args.maxbytes // elem] + [layout(size)[3] for size in sizes(args)] + [1])
    if args.shift:
        send_all = torch.ones(length, dtype=dtype, device="cuda")
        recv_all = torch.empty(length, dtype=dtype, device="cuda")
    failed = False
    for size in sizes(args):
        per_rank = size // elem // n
        total = per_rank * n
        matrix = [split(exponent, total, n, args.seed, row) for row in range(n)]
        send_splits = matrix[rank]
        recv_splits = [matrix[i][rank] for i in range(n)]
        busiest = max(max(sum(matrix[r]) - matrix[r][r], sum(row[r] for row in matrix) - matrix[r][r])
                      for r in range(n))
        span = layout(size)[3]
        if args.shift:
            steps = max(length // span, 1) if span else 1
            views = [(send_all[k * span:k * span + total], recv_all[k * span:k * span + sum(recv_splits)])
                     for k in range(steps)]
        else:
            views = [(torch.ones(total, dtype=dtype, device="cuda"),
                      torch.empty(sum(recv_splits), dtype=dtype, device="cuda"))]
        send, recv = views[0]

        def op(i=0):
            s, r = views[i % len(views)]
            dist.all_to_all_single(r, s, recv_splits, send_splits)

        for i in range(args.warmup_iters):
            op(i)
        op()
        stream.synchronize()
        dist.barrier()
        stream.synchronize()
        start = time.perf_counter()
        for i in range(args.iters):
            op(i)
        stream.synchronize()
        local_us = (time.perf_counter() - start) * 1e6 / args.iters
        time_us = mean_over_ranks(local_us)
        wrong = 0
        if args.check:
            # Rank i's element k is (i * 7 + k) % 97 + 1: exact in every type listed.
            base = torch.arange(total, device="cuda", dtype=torch.int64)
            send.copy_(((rank * 7 + base) % 97 + 1).to(dtype))
            recv.zero_()
            op()
            want = []
            for i in range(n):
                start_i = sum(matrix[i][:rank])
                k = torch.arange(start_i, start_i + matrix[i][rank], device="cuda", dtype=torch.int64)
                want.append((i * 7 + k) % 97 + 1)
            want = torch.cat(want).to(dtype) if want else recv
            local_wrong = int((recv != want).sum().item())
            wrong = int(round(mean_over_ranks(local_wrong) * n))
            failed |= wrong > 0
        algbw = total * elem / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0
        busbw = busiest * elem / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0
        if rank == 0:
            print(f"  {total * elem:>10}  {per_rank:>12}  {args.datatype:>8}  {time_us:7.2f}  {algbw:6.2f}  {busbw:6.2f}  {wrong:>6}",
                  flush=True)
    dist.destroy_process_group()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
