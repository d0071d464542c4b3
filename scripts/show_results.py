#!/usr/bin/env python
"""Show what a batch run wrote: the batch summary and a few rows of the outputs and errors Delta tables via SQL.

    python scripts/show_results.py demo_output
"""

import json
import sys
from pathlib import Path

from spark_llm.session import get_session


def main(out_dir: str) -> int:
    batch = json.loads(Path(out_dir, "batch.json").read_text())
    print(json.dumps({k: batch[k] for k in ("id", "status", "request_counts", "usage")}, indent=2))
    spark = get_session()
    base = Path(out_dir).resolve()
    spark.read.format("delta").load(str(base / "delta/outputs")).createOrReplaceTempView("outputs")
    spark.read.format("delta").load(str(base / "delta/errors")).createOrReplaceTempView("errors")
    spark.sql("SELECT custom_id, finish_reason, prompt_tokens, completion_tokens, left(text, 40) AS text "
              "FROM outputs ORDER BY line_number").show(10, truncate=False)
    spark.sql("SELECT code, count(*) AS n FROM errors GROUP BY code ORDER BY n DESC").show(truncate=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "demo_output"))
