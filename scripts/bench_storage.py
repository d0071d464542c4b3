#!/usr/bin/env python
"""What object storage costs: the same batch with its input and results on an S3 API server against local disk.

Starts the test suite's S3 server (moto's, on 127.0.0.1: ``scripts/s3_server.py``), writes one generated batch
(bench_scale's ``--mix``: chat, completions, Responses and embeddings lines), puts a copy in a bucket, and runs it
in pairs on one local Spark session: input and output on local disk, then both on S3 (``s3a://``), the order
swapped in every other pair so that the machine's drift falls on both. The engines are the stand-in
(``engine_standin``, ``free`` by default), so what is timed is the job's own reading, committing and writing.
Prints each run's seconds by stage, and last ``s3_over_local=`` (the median of the pairs' ratios).

    python scripts/bench_storage.py --lines 20000 --pairs 2

Read the ratio for what it is: moto answers from memory in a Python process on the same cores as the job (its CPU
is counted, a real store's is not), over loopback (no network latency, which a real store adds to every request).
On a cluster, run the same batch with ``--input``/``--output-dir`` on the bucket and on HDFS or local disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--engine-standin", default="free")
    p.add_argument("--max-tokens", type=int, default=4)
    args = p.parse_args(argv)

    from bench_scale import StageClock, _make_tiny_model, iter_mixed, write_input
    from s3_server import S3Server, environment

    server = S3Server().start()
    try:
        os.environ.update(environment(server))  # this process's own: the benchmark's, not a user's
        from spark_llm import BatchConfig
        from spark_llm.pipeline import run_batch
        from spark_llm.session import get_session

        work = Path(tempfile.mkdtemp(prefix="bench_storage."))
        model, embed = work / "tiny-llm", work / "tiny-embed"
        _make_tiny_model("--out", str(model))
        _make_tiny_model("--out", str(embed), "--kind", "embedding", "--base", str(model))
        client = server.client()
        client.create_bucket(Bucket="bench")
        inputs = {}
        for name, lines in (("warm", 200), ("in", args.lines)):
            inputs[name] = work / f"{name}.jsonl"
            write_input(inputs[name], iter_mixed(lines, 1, model.name, "tiny-embed", args.max_tokens), 0.0)
            client.upload_file(str(inputs[name]), "bench", f"batches/{name}.jsonl")

        conf = {"spark.ui.enabled": "false", **{f"spark.hadoop.{k}": v for k, v in server.hadoop_settings().items()}}
        spark = get_session(master=args.master, conf=conf)
        where = {"local": (str(work), str(work / "out")),
                 "s3": ("s3a://bench/batches", "s3a://bench/out")}
        seconds: dict[str, list[float]] = {"local": [], "s3": []}
        for pair in range(-1, args.pairs):  # pair -1: a small batch each way, untimed (the JVM's and caches' first use)
            for kind in (("local", "s3") if pair % 2 == 0 else ("s3", "local")):
                source, out = where[kind]
                source = f"{source}/{'warm' if pair < 0 else 'in'}.jsonl"
                cfg = BatchConfig(input=source, output_dir=f"{out}{pair}", batch_id=f"storage-{kind}{pair}",
                                  model=str(model),
                                  models=[{"name": "tiny-embed", "path": str(embed), "kind": "embed"}],
                                  max_model_len=2048, engine_standin=args.engine_standin)
                clock = StageClock()
                result = run_batch(spark, cfg, clock.listener)
                end = time.monotonic()
                if pair < 0:
                    continue
                seconds[kind].append(end - clock.t0)
                stages = ", ".join(f"{k} {v:.1f} s" for k, v in clock.stages(end).items())
                print(f"pair {pair} {kind:>5}: {end - clock.t0:6.1f} s ({result.completed} answered; {stages})",
                      flush=True)
        spark.stop()
    finally:
        server.stop()
    ratios = [s / l for s, l in zip(seconds["s3"], seconds["local"])]
    print(f"local_seconds={statistics.median(seconds['local']):.1f}")
    print(f"s3_seconds={statistics.median(seconds['s3']):.1f}")
    print(f"s3_over_local={statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
