#!/usr/bin/env python
"""The batch service against the command line, in one run, through the real openai-python client.

(a) created -> completed of a small batch (default 15 lines) on a warm server (its session and engines up), the
    median of ``--repeat`` batches;
(b) created -> completed of a large batch (default 2,000 lines) on the warm server, alternating with a cold
    ``spark-llm run`` of the same file (a whole process: session start, engines, the run), ``--repeat`` pairs;
    ``service_vs_cli=`` is the median of the pairs' cli/service ratios (above 1: the service is faster);
(c) ``--queued`` small batches created at once: ``batches_per_minute=`` from the first create to the last batch done;
(d) a small batch with ``metadata={"priority": "high"}`` created while a ``--priority-large``-line batch runs (the
    server runs one batch at a time, and one high-priority batch beside): ``high_priority_vs_idle=`` is its
    created -> completed over the median of (a) (goal: at most 2).

Same model, engine settings, engines and torch threads per engine for the server and the command line.

``--servers N`` measures the service alone instead: ``--burst`` small batches created by 20 concurrent clients
against one server, then against N servers on one PostgreSQL database (scripts/postgres_server.py) and one
storage root, each client on one server; ``batches_per_minute=`` and ``requests_per_second=`` from the first create
to the last batch done, per configuration, and ``servers_vs_one=`` their ratio.

    python scripts/bench_service.py                                  # CPU, the tiny model built on the fly
    python scripts/bench_service.py --repeat 5 --queued 50
    python scripts/bench_service.py --servers 2 --burst 200
    # on a GPU node (ordinary vllm installed), an 8B model, one engine per GPU:
    python scripts/bench_service.py --model /models/llama-3.1-8b --large 20000 --max-num-seqs 256 \\
        --master local[8] --slots 8 --no-enforce-eager
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_peers import timed, write_requests  # noqa: E402

FINAL = ("completed", "failed", "expired", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_batch_through(client, file_id: str, poll: float = 0.05) -> float:
    """Seconds from batches.create to the batch seen completed."""
    t0 = time.monotonic()
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in FINAL:
        time.sleep(poll)
        batch = client.batches.retrieve(batch.id)
    if batch.status != "completed":
        sys.exit(f"batch {batch.id} ended {batch.status}: {batch.errors}")
    return time.monotonic() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", type=int, default=15)
    p.add_argument("--large", type=int, default=2000)
    p.add_argument("--queued", type=int, default=50)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default=None, help="model directory (default: build the tiny model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--slots", type=int, default=2, help="engines (task slots), of the server and the command line")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (OMP_NUM_THREADS)")
    p.add_argument("--priority-large", type=int, default=20000, help="lines of the batch (d)'s runs beside")
    p.add_argument("--skip", choices=["small", "large", "queued", "priority"], action="append", default=[])
    p.add_argument("--servers", type=int, default=0, help="measure 1 against this many servers on PostgreSQL")
    p.add_argument("--burst", type=int, default=200, help="batches the 20 clients create (with --servers)")
    p.add_argument("--clients", type=int, default=20)
    args = p.parse_args(argv)
    import openai

    from spark_llm.engine_host import apply_worker_env
    from spark_llm.session import LOCAL_ENV

    apply_worker_env()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    work = Path(tempfile.mkdtemp(prefix="bench_service."))
    model = args.model
    if model is None:
        from make_tiny_model import build_model

        model = str(build_model(work / "tiny-llm"))
    name = Path(model).name
    small, large = work / "small.jsonl", work / "large.jsonl"
    write_requests(small, args.small, name, args.max_tokens, "short")
    write_requests(large, args.large, name, args.max_tokens, "short", seed=1)
    conf = work / "bench.yaml"
    conf.write_text(f"spark:\n  spark.executorEnv.OMP_NUM_THREADS: '{args.threads}'\n  spark.ui.enabled: 'false'\n")
    shared = ["--model", model, "--master", args.master, "--num-task-slots", str(args.slots), "--dtype", args.dtype,
              "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
              "--default-max-tokens", str(args.max_tokens), "--config", str(conf),
              "--enforce-eager" if args.enforce_eager else "--no-enforce-eager"]
    spark_llm = str(Path(sys.executable).parent / "spark-llm")
    if args.servers:
        return servers_bench(args, [spark_llm, "serve", *shared], small, work)
    port = free_port()
    log = open(work / "server.log", "wb")
    server = subprocess.Popen([spark_llm, "serve", "--storage", str(work / "service"), "--port", str(port), *shared],
                              stdout=log, stderr=subprocess.STDOUT, cwd=work, start_new_session=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        started = time.monotonic()
        while True:
            try:
                client.batches.list(limit=1)
                break
            except openai.APIConnectionError:
                if server.poll() is not None or time.monotonic() - started > 300:
                    sys.exit(f"the server did not start; see {work / 'server.log'}")
                time.sleep(0.2)
        small_id = client.files.create(file=small.open("rb"), purpose="batch").id
        warm = run_batch_through(client, small_id)  # the first batch: the engines finish loading
        print(f"first batch on a new server ({args.small} lines): {warm:.2f} s")
        if "small" not in args.skip:
            walls = [run_batch_through(client, small_id) for _ in range(args.repeat)]
            print(f"(a) {args.small} lines, warm server, created -> completed: median {statistics.median(walls):.2f} s "
                  f"(runs {', '.join(f'{w:.2f}' for w in walls)})")
        if "large" not in args.skip:
            large_id = client.files.create(file=large.open("rb"), purpose="batch").id
            pairs = []
            for n in range(args.repeat):
                service = run_batch_through(client, large_id, poll=0.2)
                cli = timed([spark_llm, "run", "--input", str(large), "--output-dir", str(work / f"cli.{n}"),
                             "--batch-id", "bench", *shared], dict(os.environ), work / f"cli.{n}.log")
                pairs.append((service, cli))
                print(f"    pair {n + 1}: service {service:.1f} s, spark-llm run {cli:.1f} s")
            ratio = statistics.median(c / s for s, c in pairs)
            print(f"(b) {args.large} lines: service median {statistics.median(s for s, _ in pairs):.1f} s, spark-llm "
                  f"run median {statistics.median(c for _, c in pairs):.1f} s\nservice_vs_cli={ratio:.3f}")
        if "queued" not in args.skip:
            t0 = time.monotonic()
            ids = [client.batches.create(input_file_id=small_id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id for _ in range(args.queued)]
            while any(client.batches.retrieve(i).status not in FINAL for i in ids):
                time.sleep(0.5)
            minutes = (time.monotonic() - t0) / 60
            print(f"(c) {args.queued} batches of {args.small} lines queued at once: all done in {minutes * 60:.1f} s\n"
                  f"batches_per_minute={args.queued / minutes:.1f}")
        if "priority" not in args.skip:
            big = work / "priority-large.jsonl"
            write_requests(big, args.priority_large, name, args.max_tokens, "short", seed=2)
            big_batch = client.batches.create(input_file_id=client.files.create(file=big.open("rb"),
                                                                                purpose="batch").id,
                                              endpoint="/v1/chat/completions", completion_window="24h")
            while client.batches.retrieve(big_batch.id).status == "validating":
                time.sleep(0.2)
            time.sleep(2.0)  # in progress: its first waves are submitted and hold the task slots
            t0 = time.monotonic()
            urgent = client.batches.create(input_file_id=small_id, endpoint="/v1/chat/completions",
                                           completion_window="24h", metadata={"priority": "high"})
            while (state := client.batches.retrieve(urgent.id)).status not in FINAL:
                time.sleep(0.05)
            waited = time.monotonic() - t0
            idle = statistics.median(walls) if "small" not in args.skip else warm
            big_state = client.batches.retrieve(big_batch.id)
            print(f"(d) {args.small} high-priority lines while a {args.priority_large}-line batch runs: {waited:.2f} s "
                  f"({state.status}; the large batch then {big_state.status}, {big_state.request_counts.completed} "
                  f"of {big_state.request_counts.total} done)")
            print(f"high_priority_vs_idle={waited / idle:.2f}")
            if big_state.status == "in_progress":
                client.batches.cancel(big_batch.id)
            else:  # the small batch waited for the large one's engines: the goal (at most 2) is missed
                print("    (the large batch ended before the high-priority one)")
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=120)
    print(f"work directory: {work}")
    return 0


class Serving:
    """``count`` servers of one database and storage root (``database``: None for one server's own SQLite)."""

    def __init__(self, command: list[str], work: Path, count: int, database: str | None):
        self.procs, self.ports = [], []
        for n in range(count):
            port = free_port()
            extra = ["--database-url", database, "--server-id", f"s{n}"] if database else []
            log = open(work / f"server-{n}.log", "wb")
            self.procs.append(subprocess.Popen([*command, "--storage", str(work / "service"), "--port", str(port),
                                                *extra], stdout=log, stderr=subprocess.STDOUT, cwd=work,
                                               start_new_session=True))
            self.ports.append(port)

    def clients(self) -> list:
        import openai

        return [openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="none", max_retries=3) for p in self.ports]

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + 300
        for port, proc in zip(self.ports, self.procs):
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit("a server did not become ready; see its log")
                time.sleep(0.3)

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, 15)
            except ProcessLookupError:  # it died already (its log says why)
                pass
        for proc in self.procs:
            proc.wait(timeout=120)


def burst(clients: list, source: Path, batches: int, threads: int, lines: int) -> tuple[float, float]:
    """``batches`` batches of ``source`` created by ``threads`` concurrent clients (client k on server k mod n), all
    waited for: (batches a minute, requests a second) from the first create to the last batch done."""
    from concurrent.futures import ThreadPoolExecutor

    files = [c.files.create(file=source.open("rb"), purpose="batch").id for c in clients]
    for client, file_id in zip(clients, files):  # every server's engines up
        run_batch_through(client, file_id)
    t0 = time.monotonic()

    def create(n: int) -> tuple[int, str]:
        k = n % len(clients)
        return k, clients[k].batches.create(input_file_id=files[k], endpoint="/v1/chat/completions",
                                            completion_window="24h").id
    with ThreadPoolExecutor(threads) as pool:
        created = list(pool.map(create, range(batches)))
        pending = set(created)
        while pending:
            time.sleep(0.5)
            states = dict(zip(pending, pool.map(lambda kb: clients[kb[0]].batches.retrieve(kb[1]).status, pending)))
            failed = [kb for kb, s in states.items() if s in FINAL and s != "completed"]
            if failed:
                sys.exit(f"batch {failed[0][1]} ended {states[failed[0]]}")
            pending = {kb for kb, s in states.items() if s not in FINAL}
    seconds = time.monotonic() - t0
    return batches / seconds * 60, batches * lines / seconds


def servers_bench(args, command: list[str], small: Path, work: Path) -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    from postgres_server import Postgres

    figures = {}
    for count in (1, args.servers):
        database = Postgres().start() if count > 1 else None
        home = work / f"servers-{count}"
        home.mkdir()
        serving = Serving(command, home, count, database.url if database else None)
        try:
            serving.wait_ready()
            per_minute, per_second = burst(serving.clients(), small, args.burst, args.clients, args.small)
        finally:
            try:
                serving.stop()
            finally:
                if database:
                    database.stop()
        figures[count] = per_minute
        print(f"{count} server(s): {args.burst} batches of {args.small} lines from {args.clients} clients: "
              f"batches_per_minute={per_minute:.1f} requests_per_second={per_second:.1f}")
    print(f"servers_vs_one={figures[args.servers] / figures[1]:.3f}")
    print(f"work directory: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
