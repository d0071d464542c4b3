"""Property-based: arbitrary bytes and mixtures of valid and broken lines never make validation raise, and every
non-blank line comes out as exactly one row."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import chat_line, completion_line, validation_context
from spark_llm.schemas import VALIDATED_FIELDS
from spark_llm.validate import validate_batches, validate_line

CTX = validation_context(max_line_bytes=4096, max_raw_line_chars=64)
CODES = {"invalid_encoding", "line_too_large", "invalid_json", "invalid_custom_id", "invalid_method",
         "unsupported_endpoint", "invalid_request", "unsupported_parameter", "model_not_found"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)


@st.composite
def mutated_requests(draw) -> bytes:
    """A valid request with one part replaced by an arbitrary JSON value (or left valid)."""
    line = draw(st.sampled_from([chat_line("x"), completion_line("y")]))
    line = json.loads(json.dumps(line))
    where = draw(st.sampled_from(["none", "custom_id", "method", "url", "body", "model", "messages", "prompt",
                                  "temperature", "max_tokens", "n", "stop", "logprobs", "extra"]))
    value = draw(json_values)
    if where in ("custom_id", "method", "url", "body"):
        line[where] = value
    elif where != "none":
        line["body"][where] = value
    return json.dumps(line).encode()


lines = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    json_values.map(lambda v: json.dumps(v).encode()),
    mutated_requests(),
    st.binary(min_size=4097, max_size=5000),
)


def _check_row(row: dict, raw: bytes) -> None:
    assert set(row) == set(VALIDATED_FIELDS)
    if row["error_code"] is None:
        assert row["custom_id"] and row["kind"] in ("chat", "completion", "responses") and row["request"]
        json.loads(row["prompt_json"]), json.loads(row["sampling_json"])
        assert row["max_tokens"] >= 1
    else:
        assert row["error_code"] in CODES and row["error_message"]
        assert row["raw_line"] is None or len(row["raw_line"]) <= CTX.max_raw_line_chars
    for value in row.values():  # everything must be storable as UTF-8 by Arrow
        if isinstance(value, str):
            value.encode("utf-8")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=lines)
def test_any_line_gives_one_row_or_is_blank(raw):
    row = validate_line(raw, "f", 1, CTX)
    stripped = raw.removeprefix(b"\xef\xbb\xbf").removesuffix(b"\r")
    if row is None:
        assert not stripped.strip()
    else:
        _check_row(row, raw)


@settings(max_examples=60, deadline=None)
@given(batch=st.lists(lines, max_size=40))
def test_batches_conserve_every_non_blank_line(batch):
    import pandas as pd

    pdf = pd.DataFrame({"value": batch, "file": ["f"] * len(batch), "line_number": range(1, len(batch) + 1)})
    out = pd.concat(list(validate_batches(iter([pdf]), CTX)))
    blank = {i + 1 for i, raw in enumerate(batch)
             if not raw.removeprefix(b"\xef\xbb\xbf").removesuffix(b"\r").strip()}
    assert sorted(out["line_number"]) == [n for n in range(1, len(batch) + 1) if n not in blank]
