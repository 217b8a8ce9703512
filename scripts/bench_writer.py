"""Shard writer throughput vs one-thread `safetensors.torch.save_file`, on the same data; and the
whole host side of an extract (assembler + writers + statistics + BLAKE3) fed step records.

    python scripts/bench_writer.py --dir /dev/shm/wb --dir .bench/wb          # tmpfs and disk
    python scripts/bench_writer.py --dir /dev/shm/wb --s3                     # + upload to a local S3 (moto)
    python scripts/bench_writer.py --dir .bench/wb --tail w-chat              # the end of a run (flush)
    python scripts/bench_writer.py --dir /dev/shm/wb --pipeline w-short,w-chat  # the host side, flat out

Data: samples of 27B-shaped rows ([T, 5, 5120] bf16, 51.2 KB per token). `save_file` gets each
shard's tensors already concatenated (its concatenation is not timed) and writes them one
shard after another on one thread. The shard writer gets the samples one by one, as the
assembler hands them over: each sample's rows with their per-row statistics and row sums, as
the capture ring brings them from the device (`--stats device`, what an extract does: made
once before the clock starts, they are the device's work), or without the sums, so its
threads reduce the rows themselves (`--stats host`, how the statistics were made before), or
with no statistics at all (`--stats off`); one copy into its arena, then written with
--threads threads; its time runs until every shard is durable (and, with --s3, uploaded).
Peak RSS is sampled.

--pipeline: a workload's prompts (bench.py's lengths) cut into engine steps as vLLM's scheduler
cuts them (--step-tokens a step), each step's rows in a slot of the real capture ring (pinned
host memory on a GPU host; filled once before the clock starts: the device's gather and copy
are not the host's work) and its StepRecord through the real AssemblerThread and ShardWriter
as fast as the host side takes them (the ring's backpressure included). GB/s of rows from the
first step to every shard durable, with the assembler's and writers' busy seconds.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib
import torch
from benchlib import RssPeak

sys.path.insert(0, str(benchlib.ROOT))  # the package of this checkout


def samples(total_bytes: int, k: int, h: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(4096, k, h, generator=g).to(torch.bfloat16)  # rows are views into this
    out, n, i = [], 0, 0
    while n < total_bytes:
        t = int(torch.randint(64, 2048, (1,), generator=g))
        out.append((i, torch.arange(t, dtype=torch.int64), src[:t]))
        n += t * k * h * 2
        i += 1
    return out


def bench_save_file(data, d: Path, shard_bytes: int) -> dict:
    from safetensors.torch import save_file

    groups, cur, size = [], [], 0
    for s in data:
        cur.append(s)
        size += s[2].numel() * 2
        if size >= shard_bytes:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    tensors = [{"hidden_states": torch.cat([s[2] for s in g]), "token_ids": torch.cat([s[1] for s in g])}
               for g in groups]
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    nbytes = sum(t["hidden_states"].numel() * 2 + t["token_ids"].numel() * 8 for t in tensors)
    t0 = time.perf_counter()
    for i, t in enumerate(tensors):
        p = d / f"s{i}.safetensors"
        save_file(t, str(p))
        with open(p, "rb+") as f:  # durable, as the shard writer's are
            os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    shutil.rmtree(d)
    return {"seconds": dt, "bytes": nbytes, "gb_per_s": nbytes / dt / 1e9, "shards": len(tensors)}


def ring_sums(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the capture ring brings with rows [T, C, H]: their per-row amax [T, C] and row sums
    [T, 2, C] (sum, centred sum of squares), made as the device makes them."""
    from vllm_hidden.format import quant
    from vllm_hidden.format.stats import RowSums

    t, c, h = hs.shape
    row_scale = torch.empty((t, c), dtype=torch.float32)
    quant.row_amax(hs, row_scale)
    sums = torch.empty((2, t, c), dtype=torch.float32)
    RowSums(c * h, False)(hs, sums[0], sums[1])
    return row_scale, sums.transpose(0, 1).contiguous()


def bench_writer(data, d: Path, shard_bytes: int, threads: int, k: int, h: int, upload: str | None = None,
                 endpoint: str | None = None, stats: str = "device") -> dict:
    from vllm_hidden.capture.records import Rows
    from vllm_hidden.config import ShardConfig
    from vllm_hidden.storage.shards import ShardWriter

    shutil.rmtree(d, ignore_errors=True)
    cfg = ShardConfig(output_dir=str(d), max_shard_bytes=shard_bytes, writer_threads=threads,
                      upload_uri=upload, s3_endpoint_url=endpoint, layer_stats=stats != "off")
    ring = [ring_sums(hs) for _, _, hs in data]  # the device's work: before the clock
    with RssPeak() as rss:
        w = ShardWriter(cfg, list(range(k)), h, torch.bfloat16)
        t0 = time.perf_counter()
        for (sid, tok, hs), (row_scale, mom) in zip(data, ring):
            slot = w.reserve(sid, tok)
            slot.place(0, Rows(hs, row_scale, mom if stats == "device" else None))
            w.commit(slot)
        t1 = time.perf_counter()
        shards = w.close()
        t2 = time.perf_counter()
        dt = t2 - t0
    nbytes = sum(s.bytes for s in shards)
    shutil.rmtree(d, ignore_errors=True)
    return {"statistics": stats, "seconds": dt, "bytes": nbytes, "gb_per_s": nbytes / dt / 1e9,
            "shards": len(shards), "tail_seconds": t2 - t1, "peak_rss_bytes": rss.peak, "stats": w.counters()}


def ring(k: int, h: int, budget: int, stats: str, slots: int = 2):
    """A capture ring whose host slots already hold a step of rows (pinned on a GPU host, as
    there): the device's gather and copy are not the host's work, so they happen once, here."""
    from vllm_hidden.capture.ring import StepTransfer

    tr = StepTransfer(budget, k, h, torch.bfloat16, torch.device("cpu"), slots, row_sums=stats == "device")
    if torch.cuda.is_available():
        tr._host_rows = [r.pin_memory() for r in tr._host_rows]
        views = [tr._views(r) for r in tr._host_rows]
        tr.host, tr.host_row_scale, tr.host_row_sums = ([v[i] for v in views] for i in range(3))
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(budget, h, generator=g).to(torch.bfloat16) for _ in range(k)]
    for slot in range(slots):
        tr.submit(layers, budget, tr.acquire())
        tr.release(slot)
    return tr


def bench_generate_wave(d: Path, workload: str, requests: int, max_tokens: int, threads: int, k: int, h: int,
                        budget: int, stats: str, pool: bool, waves: int = 2) -> dict:
    """extract --generate's host side: `waves` waves, one after the other, each of `requests` of
    a workload's prompts prefilled in steps of `budget` tokens, then `max_tokens` decode steps
    of one row per request (EOS ignored, as bench_generate.py's), every response of the wave
    ending at the same step, each end told by the driver right after its last row. `pool` off:
    every request's staging buffer is fresh (as before they were kept). Reported, for the last
    wave: seconds per decode step on the assembler thread, and the burst: from its last step
    handed over to every shard durable."""
    from vllm_hidden.capture import assembler as asm_mod
    from vllm_hidden.capture.records import NewRequest, Segment, StepRecord
    from vllm_hidden.config import ShardConfig
    from vllm_hidden.storage.shards import ShardWriter

    lengths = [len(p) for p in benchlib.make_prompts(benchlib.WORKLOADS[workload], 248320)][:requests]
    tr = ring(k, h, budget, stats, 2)
    shutil.rmtree(d, ignore_errors=True)
    w = ShardWriter(ShardConfig(output_dir=str(d), writer_threads=threads, layer_stats=stats != "off",
                                generate=True), list(range(k)), h, torch.bfloat16)
    a = asm_mod.Assembler(tr, w)
    if not pool:
        a._stages.cap_bytes = 0
    t0 = time.perf_counter()
    for wave in range(waves):
        first = wave * len(lengths)  # the wave's sample ids and input lines
        thread = asm_mod.AssemblerThread(a)
        for step in steps_of(lengths, budget, taper=False):  # prefill
            segs, new, row = [], {}, 0
            for i, pos, c in step:
                rid = str(first + i)
                if pos == 0:
                    new[rid] = NewRequest(first + i, list(range(lengths[i])), rows=lengths[i] + max_tokens,
                                          line=first + i, generate=True)
                segs.append(Segment(rid, row, c, pos))
                row += c
            thread.put(StepRecord(tr.acquire(), row, segs, new))
        thread.close()  # prefill done: the decode steps are timed on their own
        prefill_busy = thread.busy_s
        thread = asm_mod.AssemblerThread(a)
        t1 = time.perf_counter()
        for j in range(max_tokens):
            segs = [Segment(str(first + i), i, 1, n + j) for i, n in enumerate(lengths)]
            thread.put(StepRecord(tr.acquire(), len(lengths), segs))
        thread.close()
        t2 = time.perf_counter()
        ends = [{"line": first + i, "turn": 0, "rows": n + max_tokens, "token_ids": list(range(n + max_tokens)),
                 "loss_spans": None, "num_prompt": n, "record": "{}\n"} for i, n in enumerate(lengths)]
        thread = asm_mod.AssemblerThread(a)
        thread.put(StepRecord(None, 0, [], ends=ends))
        thread.close()  # the next wave starts at once, as the scheduler admits it: the writers still busy
    shards = w.close()
    t4 = time.perf_counter()
    shutil.rmtree(d, ignore_errors=True)
    rows = waves * (sum(lengths) + len(lengths) * max_tokens)
    return {"workload": workload, "requests": len(lengths), "waves": waves, "max_tokens": max_tokens,
            "statistics": stats, "stage_pool": pool, "threads": threads, "rows": rows,
            "bytes": sum(s.bytes for s in shards), "last_wave_prefill_assembler_busy_s": round(prefill_busy, 3),
            "decode_steps": max_tokens, "decode_assembler_s_per_step": round((t2 - t1) / max_tokens, 5),
            "burst_seconds": round(t4 - t2, 3), "seconds": round(t4 - t0, 3), "writer": w.counters()}


def bench_pipeline(d: Path, workload: str, threads: int, k: int, h: int, budget: int, stats: str,
                   slots: int = 2, gb: float | None = None) -> dict:
    """The host side of an extract flat out: steps of a workload through the real ring slots,
    AssemblerThread and ShardWriter (module docstring); `gb`: only its first prompts, up to
    that many GB of rows (the output must fit in --dir)."""
    from vllm_hidden.capture.assembler import Assembler, AssemblerThread
    from vllm_hidden.capture.records import NewRequest, Segment, StepRecord
    from vllm_hidden.config import ShardConfig
    from vllm_hidden.storage.shards import ShardWriter

    lengths = [len(p) for p in benchlib.make_prompts(benchlib.WORKLOADS[workload], 248320)]
    if gb is not None:
        cum = itertools.accumulate(n * k * h * 2 for n in lengths)
        lengths = lengths[: max(1, sum(1 for c in cum if c <= gb * 1e9))]
    steps = steps_of(lengths, budget, taper=False)
    tr = ring(k, h, budget, stats, slots)
    shutil.rmtree(d, ignore_errors=True)
    w = ShardWriter(ShardConfig(output_dir=str(d), writer_threads=threads, layer_stats=stats != "off"),
                    list(range(k)), h, torch.bfloat16)
    thread = AssemblerThread(Assembler(tr, w))
    tokens = [list(range(n)) for n in lengths]
    t0 = time.perf_counter()
    for step in steps:
        slot = tr.acquire()  # blocks while the host side is behind: the engine would wait here
        segs, new, row = [], {}, 0
        for i, pos, c in step:
            if pos == 0:
                new[str(i)] = NewRequest(i, tokens[i], line=i)
            segs.append(Segment(str(i), row, c, pos))
            row += c
        thread.put(StepRecord(slot, row, segs, new))
    t1 = time.perf_counter()
    thread.close()
    shards = w.close()
    t2 = time.perf_counter()
    shutil.rmtree(d, ignore_errors=True)
    rows = sum(lengths)
    row_bytes = k * h * 2
    return {"workload": workload, "statistics": stats, "threads": threads, "pinned_ring": torch.cuda.is_available(),
            "samples": len(lengths), "rows": rows, "steps": len(steps), "row_bytes": row_bytes,
            "seconds": t2 - t0, "steps_seconds": t1 - t0, "gb_per_s": rows * row_bytes / (t2 - t0) / 1e9,
            "rows_per_s": rows / (t2 - t0), "assembler_busy_s": round(thread.busy_s, 3),
            "assembler_wait_copy_s": round(thread.assembler.wait_copy_s, 3), "bytes": sum(s.bytes for s in shards),
            "writer": w.counters()}


def steps_of(lengths: list[int], budget: int, taper: bool) -> list[list[tuple[int, int, int]]]:
    """The prompts cut into engine steps as vLLM's scheduler does under chunked prefill (FCFS,
    `budget` tokens a step; with `taper`, the end of the run as engine.scheduler shapes it):
    per step, (sample, first position, rows) segments."""
    from vllm_hidden.engine.scheduler import taper_budget

    left = sum(lengths)
    steps, cur = [], []
    room = taper_budget(left, budget) if taper else budget
    for i, n in enumerate(lengths):
        pos = 0
        while pos < n:
            c = min(n - pos, room)
            cur.append((i, pos, c))
            pos, room, left = pos + c, room - c, left - c
            if room == 0:
                steps.append(cur)
                cur, room = [], taper_budget(left, budget) if taper else budget
    if cur:
        steps.append(cur)
    return steps


def bench_tail(d: Path, workload: str, threads: int, k: int, h: int, tok_per_s: float, budget: int,
               taper: bool) -> dict:
    """The end of a run without an engine: a workload's rows arrive step by step at the GPU's
    pace (a step of n rows every n / tok_per_s seconds) and go through the real shard writer
    as the assembler places them; flush = from the last step's rows placed to every shard
    durable (what `flush_seconds` measures in an extract, less the engine's last step)."""
    from vllm_hidden.capture.records import Rows
    from vllm_hidden.config import ShardConfig
    from vllm_hidden.storage.shards import ShardWriter

    # the lengths bench.py's 27B runs had
    lengths = [len(p) for p in benchlib.make_prompts(benchlib.WORKLOADS[workload], 248320)]
    steps = steps_of(lengths, budget, taper)
    src = torch.randn(budget, k, h).to(torch.bfloat16)  # the ring slot
    row_scale = torch.ones(budget, k)
    shutil.rmtree(d, ignore_errors=True)
    w = ShardWriter(ShardConfig(output_dir=str(d), writer_threads=threads), list(range(k)), h, torch.bfloat16)
    slots: dict[int, object] = {}
    t0 = time.perf_counter()
    due = t0
    for step in steps:
        rows = sum(c for _, _, c in step)
        due += rows / tok_per_s
        time.sleep(max(0.0, due - time.perf_counter()))  # the GPU computes the step
        row = 0
        for i, pos, c in step:
            if pos == 0:
                slots[i] = w.reserve(i, torch.zeros(lengths[i], dtype=torch.int64))
            slots[i].place(pos, Rows(src[row : row + c], row_scale[row : row + c]))
            row += c
            if pos + c == lengths[i]:
                w.commit(slots.pop(i))
    t1 = time.perf_counter()
    shards = w.close()
    t2 = time.perf_counter()
    shutil.rmtree(d, ignore_errors=True)
    return {"workload": workload, "taper": taper, "steps": len(steps),
            "last_steps_rows": [sum(c for _, _, c in st) for st in steps[-6:]],
            "rows": sum(lengths), "bytes": sum(s.bytes for s in shards), "seconds": t2 - t0, "flush_seconds": t2 - t1,
            "stats": w.counters()}


def main_generate_wave(a, k: int, h: int, modes: list[str]) -> None:
    if a.stage_pool != "both":  # one run, in this process (see below)
        r = bench_generate_wave(Path(a.dir[0]), "w-chat", a.generate_wave, 256, a.threads, k, h, a.step_tokens,
                                modes[0], a.stage_pool == "on")
        print("RESULT " + json.dumps(r), flush=True)
        return
    runs = []
    for _ in range(a.repeat):
        for pool in ("off", "on"):  # each in a process of its own: the allocator's state is not carried over
            args = ["--dir", a.dir[0], "--generate-wave", str(a.generate_wave), "--threads", str(a.threads),
                    "--step-tokens", str(a.step_tokens), "--stats", modes[0], "--stage-pool", pool]
            out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                                 check=True).stdout
            r = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
            runs.append(r)
            print(f"generate: {r['waves']} waves of {r['requests']} (w-chat prompts, 256 tokens), stage pool "
                  f"{pool}: {r['decode_assembler_s_per_step'] * 1e3:.2f} ms per decode step "
                  f"on the assembler, burst "
                  f"{r['burst_seconds']} s, last prefill's assembler busy {r['last_wave_prefill_assembler_busy_s']} s",
                  flush=True)
    path = benchlib.result_path(a.result, f"writer-generate-{benchlib.stamp()}.json")
    benchlib.write_json(path, {"command": benchlib.command_line(__file__), "cpus": os.cpu_count(),
                               "versions": benchlib.versions("torch", "blake3", "safetensors"), "runs": runs})
    print(f"wrote {path}")


def main_pipeline(a, k: int, h: int, modes: list[str]) -> None:
    runs = []
    for _ in range(a.repeat):
        for workload in a.pipeline.split(","):
            for mode in modes:
                gc.collect()  # the last run's arenas (slots and arenas refer to each other) go first
                r = bench_pipeline(Path(a.dir[0]), workload, a.threads, k, h, a.step_tokens, mode,
                                   gb=a.pipeline_gb)
                runs.append(r)
                print(f"{workload} statistics={mode} threads={a.threads}: {r['gb_per_s']:.2f} GB/s "
                      f"({r['rows_per_s']:.0f} rows/s), assembler busy {r['assembler_busy_s']} s of "
                      f"{r['seconds']:.2f}, writers busy {r['writer']['writer_busy_s']} s "
                      f"(statistics {r['writer']['writer_stats_s']} s)", flush=True)
    path = benchlib.result_path(a.result, f"writer-pipeline-{benchlib.stamp()}.json")
    benchlib.write_json(path, {"command": benchlib.command_line(__file__), "cpus": os.cpu_count(),
                               "versions": benchlib.versions("torch", "blake3", "safetensors"),
                               "runs": runs})
    print(f"wrote {path}")


def main() -> None:
    ap = benchlib.parser(__doc__)
    ap.add_argument("--dir", action="append", required=True, help="target directory (repeat: tmpfs, disk)")
    ap.add_argument("--gb", type=float, default=3.0, help="data volume per measurement")
    ap.add_argument("--shard-bytes", type=int, default=1 << 30)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--s3", action="store_true", help="also upload to a local S3 endpoint (moto server)")
    ap.add_argument("--tail", default=None, help="only the end of a run: this workload (bench.py's) at --tok-per-s")
    ap.add_argument("--tok-per-s", type=float, default=11600.0)
    ap.add_argument("--step-tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--taper", choices=["on", "off", "both"], default="both",
                    help="the end of a run tapered (engine.scheduler)")
    ap.add_argument("--stats", default="device",
                    help="comma-separated: device (row sums come with the rows, as an extract's), host (the "
                         "writer reduces the rows, as before), off (no per-layer statistics)")
    ap.add_argument("--pipeline", default=None,
                    help="comma-separated workloads (bench.py's): the host side of an extract fed step records")
    ap.add_argument("--generate-wave", type=int, default=None,
                    help="extract --generate's host side: this many W-chat requests, 256 decode steps, ending "
                         "together; with fresh staging buffers, then with the pool")
    ap.add_argument("--stage-pool", choices=["on", "off", "both"], default="both",
                    help="--generate-wave: staging buffers kept (on), fresh (off), or each in a process of its own")
    ap.add_argument("--pipeline-gb", type=float, default=None,
                    help="--pipeline: only each workload's first prompts, up to this many GB of rows")
    ap.add_argument("--result", default=None)
    a = ap.parse_args()
    k, h = 5, 5120
    modes = a.stats.split(",")
    bad = [m for m in modes if m not in ("device", "host", "off")]
    if bad:
        raise SystemExit(f"--stats: unknown mode(s) {bad} (device, host, off)")
    if a.generate_wave:
        return main_generate_wave(a, k, h, modes)
    if a.pipeline:
        return main_pipeline(a, k, h, modes)
    if a.tail:
        runs = []
        for _ in range(a.repeat):
            for taper in {"on": [True], "off": [False], "both": [False, True]}[a.taper]:
                runs.append(bench_tail(Path(a.dir[0]), a.tail, a.threads, k, h, a.tok_per_s, a.step_tokens, taper))
                print(json.dumps(runs[-1]), flush=True)
        if a.result:
            benchlib.write_json(a.result, {"command": benchlib.command_line(__file__), "cpus": os.cpu_count(),
                                           "runs": runs})
        return
    data = samples(int(a.gb * 1e9), k, h)
    res = {"command": benchlib.command_line(__file__), "cpus": os.cpu_count(),
           "data_bytes": sum(s[2].numel() * 2 for s in data), "samples": len(data), "shard_bytes": a.shard_bytes,
           "threads": a.threads, "targets": {}}
    for d in a.dir:
        base = bench_save_file(data, Path(d) / "save_file", a.shard_bytes)
        res["targets"][d] = {"save_file_1_thread": base}
        for mode in modes:
            gc.collect()
            ours = bench_writer(data, Path(d) / "writer", a.shard_bytes, a.threads, k, h, stats=mode)
            res["targets"][d][f"shard_writer_stats_{mode}"] = ours
            res["targets"][d][f"speedup_stats_{mode}"] = round(ours["gb_per_s"] / base["gb_per_s"], 3)
            print(f"{d}: save_file {base['gb_per_s']:.2f} GB/s, shard writer ({a.threads} threads, statistics "
                  f"{mode}) {ours['gb_per_s']:.2f} GB/s = {ours['gb_per_s'] / base['gb_per_s']:.2f}x", flush=True)
    if a.s3:
        import boto3

        sys.path.insert(0, str(benchlib.ROOT / "tests"))
        from s3_server import MotoServer, set_s3_env

        set_s3_env()
        server = MotoServer()
        try:
            boto3.client("s3", endpoint_url=server.url).create_bucket(Bucket="bench")
            d = Path(a.dir[0]) / "stage"
            up = bench_writer(data, d, a.shard_bytes, a.threads, k, h, upload="s3://bench/run", endpoint=server.url,
                              stats=modes[0])
            res["s3_local_moto"] = {"staging": str(d), **up}
            print(f"s3 (moto on 127.0.0.1, staging {d}): write + upload {up['gb_per_s']:.2f} GB/s", flush=True)
        finally:
            server.stop()
    path = benchlib.result_path(a.result, f"writer-{benchlib.stamp()}.json")
    benchlib.write_json(path, res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
