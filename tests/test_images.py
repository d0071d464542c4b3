"""Images in chat and Responses lines on the tiny vision-language model (make_tiny_model.py --kind vision, a LLaVA
with a 2-layer CLIP tower: 16 tokens an image), in one run: data: URLs, paths, two images in a message, an image
in an earlier turn; every bad image one error row with its code; prompt tokens as the engine counts them; a few
hundred image lines in balanced partitions; the tables' request column without the images' bytes."""

from __future__ import annotations

import base64
import io
import json

import pytest

from conftest import VISION_MODEL, engine_settings, write_jsonl

pytestmark = pytest.mark.engine

IMAGE_TOKENS = 16  # (56 / 14)^2 patches of the tiny CLIP tower
MANY = 300  # image lines besides the cases below, for the partition balance


def picture(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), (seed * 37 % 256, 90, 200))
    ImageDraw.Draw(img).rectangle((2, 2, width // 2, height // 2), fill=(250, seed % 256, 0))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat(custom_id: str, *parts, history: list | None = None, **body) -> dict:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": p[0]}}
               for p in parts]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": VISION_MODEL, "messages": [*(history or []), {"role": "user", "content": content}],
        "max_tokens": 4, "temperature": 0, **body}}


@pytest.fixture(scope="module")
def image_run(spark, vision_model, tmp_path_factory):
    from spark_llm import BatchConfig, run_batch

    root = tmp_path_factory.mktemp("images")
    images = root / "images"
    images.mkdir()
    (images / "red.png").write_bytes(picture(80, 60))
    (images / "wide.jpg").write_bytes(picture(200, 50, "JPEG"))
    (images / "text.png").write_text("not a picture\n")
    (images / "cut.png").write_bytes(picture(80, 60)[:70])  # a PNG's chunks are checked: found when counted
    (images / "cut.jpg").write_bytes(picture(300, 300, "JPEG")[:400])  # a JPEG's are not: found when decoded
    (images / "huge.png").write_bytes(picture(3000, 2000))
    (images / "heavy.png").write_bytes(picture(400, 400, "BMP"))  # over max_image_bytes below
    (images / "a.tiff").write_bytes(picture(20, 20, "TIFF"))
    red = data_url((images / "red.png").read_bytes())
    earlier = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": red}}]},
               {"role": "assistant", "content": "A red picture."}]
    cases = [
        (chat("data-url", "What is this?", (red,)), None),
        (chat("path", "Describe", (str(images / "red.png"),)), None),
        (chat("two-images", "Compare", (red,), (f"file:{images / 'wide.jpg'}",)), None),
        (chat("earlier-turn", "And now?", history=earlier), None),
        ({"custom_id": "responses", "method": "POST", "url": "/v1/responses", "body": {
            "model": VISION_MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What?"}, {"type": "input_image", "image_url": red}]}]}}, None),
        (chat("text-only", "Hello"), None),
        (chat("not-an-image", (str(images / "text.png"),)), "invalid_image_format"),
        (chat("tiff", (str(images / "a.tiff"),)), "invalid_image_format"),
        (chat("cut-png", (str(images / "cut.png"),)), "image_parse_error"),
        (chat("cut-jpeg", (str(images / "cut.jpg"),)), "image_parse_error"),
        (chat("huge", (str(images / "huge.png"),)), "image_too_large"),
        (chat("heavy", (str(images / "heavy.png"),)), "image_too_large"),
        (chat("missing", (str(images / "missing.png"),)), "invalid_image_url"),
        (chat("outside", ("/etc/hostname",)), "invalid_image_url"),
        (chat("refused-domain", ("https://example.com/cat.png",)), "invalid_image_url"),
        (chat("data-not-base64", ("data:image/png,abc",)), "invalid_image_url"),
    ]
    many = [chat(f"many-{i}", "Describe " + "in detail " * (i % 7), (data_url(picture(40 + i % 50, 40, seed=i)),))
            for i in range(MANY)]
    write_jsonl(root / "in.jsonl", [line for line, _ in cases] + many)
    settings = {**engine_settings(vision_model), "served_model_name": VISION_MODEL, "lora_modules": {},
                "tool_call_parser": None, "target_tokens_per_partition": 2000, "max_model_len": 512,
                "max_image_bytes": 300_000, "max_image_pixels": 4_000_000}
    cfg = BatchConfig(input=str(root / "in.jsonl"), output_dir=str(root / "out"), batch_id="b-images", **settings)
    return run_batch(spark, cfg), cases, cfg


def rows_of(spark, table: str) -> dict:
    return {r["custom_id"]: r.asDict() for r in spark.read.format("delta").load(table).collect()}


def test_every_line_once_and_every_bad_image_an_error_row_that_names_it(spark, image_run):
    result, cases, _ = image_run
    outputs, errors = rows_of(spark, result.paths.outputs_table), rows_of(spark, result.paths.errors_table)
    assert len(outputs) + len(errors) == len(cases) + MANY and not set(outputs) & set(errors)
    assert result.status == "completed" and result.completed == len(outputs)
    for line, expected in cases:
        cid = line["custom_id"]
        if expected is None:
            assert cid in outputs, errors.get(cid)
        else:
            assert errors[cid]["code"] == expected, errors.get(cid) or outputs.get(cid)
    assert "image 1 of 1 (" in errors["cut-png"]["message"] and "cut.png" in errors["cut-png"]["message"]
    assert "--allowed-media-domains" in errors["refused-domain"]["message"]
    assert "--allowed-media-paths" in errors["outside"]["message"]
    assert all(f"many-{i}" in outputs for i in range(MANY))


def test_prompt_tokens_are_the_engine_s_and_count_each_image(spark, image_run):
    from spark_llm.media import MediaPolicy
    from spark_llm.models import resolve
    from spark_llm.tokenizers import get_tokenizer
    from spark_llm.tokens import TokenContext, count_rows
    from spark_llm.validate import ValidationContext, validate_line

    result, cases, cfg = image_run
    outputs = rows_of(spark, result.paths.outputs_table)
    resolved = resolve(cfg)
    vctx = ValidationContext.of_models([resolved])
    tctx = TokenContext(tokenizer=resolved.tokenizer, max_model_len=resolved.max_model_len,
                        context_overflow="error", model=resolved.model, media=MediaPolicy.of(resolved))
    tokenizer = get_tokenizer(resolved.tokenizer)
    counted = {}
    for line, expected in cases:
        if expected is None:
            row = validate_line(json.dumps(line).encode(), "f", 1, vctx)
            images = json.loads(row["options_json"]).get("images")
            [res] = count_rows(tokenizer, [(row["kind"], row["prompt_json"], row["sampling_json"], images)], tctx)
            counted[line["custom_id"]] = res["prompt_tokens"]
            engine = outputs[line["custom_id"]]["prompt_tokens"]
            assert res["prompt_tokens"] == engine, line["custom_id"]  # as planned = as the engine counted
            body = json.loads(outputs[line["custom_id"]]["response_body"])
            usage = body["usage"].get("prompt_tokens", body["usage"].get("input_tokens"))
            assert usage == engine
    # each image is its 16 tokens: the same question with two pictures is 16 more than with one and its own text
    assert counted["two-images"] - counted["data-url"] > IMAGE_TOKENS - 8
    assert counted["text-only"] < counted["path"] - IMAGE_TOKENS + 4


def test_image_lines_balance_their_partitions_and_the_tables_hold_no_image_bytes(spark, image_run):
    result, _, _ = image_run
    plan = result.batch.partition_plan
    assert plan.num_partitions >= 4 and plan.balance_ratio < 1.05, plan
    requests = [r["request"] for r in spark.read.format("delta").load(result.paths.outputs_table)
                .where("custom_id like 'many-%' or custom_id = 'data-url'").select("request").collect()]
    assert requests and all("base64,<" in r and "iVBOR" not in r for r in requests)  # no PNG bytes
    first = json.loads(next(line for line in open(result.paths.output_dir + "/output.jsonl")))
    assert first["response"]["status_code"] == 200
