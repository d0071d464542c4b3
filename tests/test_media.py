"""Images in requests without an engine: where an image may come from, how it is measured, how a request's image parts
are checked and kept out of the tables' request column."""

from __future__ import annotations

import base64
import io
import json
from dataclasses import replace

import pytest

from conftest import validation_context
from spark_llm.errors import RequestError
from spark_llm.media import MediaPolicy, check_url, decode, label, measure, read_media, without_data_urls
from spark_llm.validate import validate_line


def png(width: int = 40, height: int = 30, mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (width, height), "red" if mode == "RGB" else 0).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def code(call) -> str:
    with pytest.raises(RequestError) as err:
        call()
    return err.value.code.value


@pytest.fixture
def policy(tmp_path) -> MediaPolicy:
    return MediaPolicy(allowed_media_paths=(str(tmp_path / "images"),), allowed_media_domains=("example.com",),
                       max_image_bytes=100_000, max_image_pixels=1_000_000)


def test_where_an_image_may_come_from(policy, tmp_path):
    inside = str(tmp_path / "images" / "a.png")
    assert check_url(inside, policy, "x") == inside
    assert check_url("file:" + inside, policy, "x")
    assert check_url(data_url(png()), policy, "x").startswith("data:image/png")
    assert check_url("https://cdn.example.com/a.png", policy, "x")  # a subdomain of an allowed host
    for refused in (str(tmp_path / "other.png"), str(tmp_path / "images" / ".." / "secret.png"), "/etc/passwd",
                    "https://evil.test/a.png", "http://example.com.evil.test/a.png", "ftp://example.com/a.png",
                    "data:image/png,notbase64"):
        assert code(lambda u=refused: check_url(u, policy, "x")) == "invalid_image_url", refused
    assert code(lambda: check_url(123, policy, "x")) == "invalid_request"
    big = data_url(b"\0" * 150_000)
    assert code(lambda: check_url(big, policy, "x")) == "image_too_large"  # counted from the URL, not decoded


def test_storage_prefixes_compare_across_scheme_spellings():
    s3 = MediaPolicy(allowed_media_paths=("s3://bucket/images/",))
    assert check_url("s3a://bucket/images/cat.png", s3, "x")
    assert code(lambda: check_url("s3a://bucket/images/../private/cat.png", s3, "x")) == "invalid_image_url"
    assert code(lambda: check_url("s3a://bucket/imagesX/cat.png", s3, "x")) == "invalid_image_url"


def test_a_file_uri_in_any_of_its_spellings_is_its_local_path(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.png").write_bytes(png())
    for allowed in (str(images), f"file:{images}", f"file://{images}/"):
        policy = MediaPolicy(allowed_media_paths=(allowed,))
        for url in (str(images / "a.png"), f"file:{images}/a.png", f"file://{images}/a.png",
                    f"file://localhost{images}/a.png"):  # RFC 8089's forms of one local file
            assert read_media(url, policy) == (images / "a.png").read_bytes(), (allowed, url)
        with pytest.raises(RequestError, match="does not exist"):  # a missing file is said to be missing
            read_media(f"file://{images}/missing.png", policy)
        for outside in (f"file://{tmp_path}/other.png", f"file://otherhost{images}/a.png",
                        f"file://{images}/../other.png"):
            with pytest.raises(RequestError, match="outside the storage"):
                read_media(outside, policy)


def test_the_default_paths_are_the_input_s_directory():
    from spark_llm.config import BatchConfig

    cfg = BatchConfig(input="s3a://bucket/batches/day1.jsonl")
    assert MediaPolicy.of(cfg).allowed_media_paths == ("s3a://bucket/batches/",)
    both = BatchConfig(input="/data/in.jsonl", allowed_media_paths="/data/images, s3a://b/img/")
    assert MediaPolicy.of(both).allowed_media_paths == ("/data/images", "s3a://b/img/")


def test_reading_and_measuring_every_bad_image(policy, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "ok.png").write_bytes(png(40, 30))
    (images / "text.png").write_text("not an image at all\n")
    (images / "cut.png").write_bytes(png(40, 30)[:60])
    (images / "big.png").write_bytes(png(2000, 1000, "L"))  # 2 million pixels, a few KB
    (images / "heavy.bin").write_bytes(b"\0" * 100_001)
    from PIL import Image

    Image.new("RGB", (10, 10)).save(images / "a.tiff")
    ok = read_media(str(images / "ok.png"), policy)
    assert measure(ok, policy) == (30, 40)  # height, width
    assert read_media(data_url(ok), policy) == ok
    cases = {"text.png": "invalid_image_format", "a.tiff": "invalid_image_format", "cut.png": "image_parse_error",
             "big.png": "image_too_large"}
    for name, expected in cases.items():
        assert code(lambda n=name: measure(read_media(str(images / n), policy), policy)) == expected, name
    assert code(lambda: read_media(str(images / "heavy.bin"), policy)) == "image_too_large"
    assert code(lambda: read_media(str(images / "missing.png"), policy)) == "invalid_image_url"
    assert decode(ok).size == (40, 30)
    # where an uploaded image is stored is read as it is, outside the allowed paths
    uploaded = tmp_path / "service" / "file-xyz"
    uploaded.parent.mkdir()
    uploaded.write_bytes(ok)
    assert code(lambda: read_media(str(uploaded), policy)) == "invalid_image_url"
    assert read_media(str(uploaded), replace(policy, media_files=(("file-xyz", str(uploaded)),))) == ok
    assert code(lambda: decode(png()[:-30])) == "image_parse_error"  # a truncated file fails where it is decoded


def test_image_parts_of_chat_and_responses_lines(tmp_path):
    vision = replace(validation_context(), images=True,
                     media=MediaPolicy(allowed_media_paths=(str(tmp_path),)))
    url = data_url(png())
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "tiny-llm", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                         {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                                         {"type": "image_url", "image_url": {"url": str(tmp_path / "b.png")}}]}]}}
    row = validate_line(json.dumps(chat).encode(), "f", 1, vision)
    assert row["error_code"] is None, row
    assert json.loads(row["options_json"])["images"] == [url, str(tmp_path / "b.png")]
    assert json.loads(row["prompt_json"])["messages"][1]["content"] == [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]
    # the tables' copy of the request holds the data: URL's size and hash, not its bytes
    assert url not in row["request"] and "data:image/png;base64,<" in row["request"]
    assert json.loads(row["request"])["body"]["messages"][1]["content"][2]["image_url"]["url"] == str(tmp_path / "b.png")

    responses = {"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": {
        "model": "tiny-llm", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What?"}, {"type": "input_image", "image_url": url}]}]}}
    row = validate_line(json.dumps(responses).encode(), "f", 2, vision)
    assert row["error_code"] is None and json.loads(row["options_json"])["images"] == [url]

    def error(content, ctx=vision) -> str:
        line = {**chat, "body": {**chat["body"], "messages": [{"role": "user", "content": content}]}}
        return validate_line(json.dumps(line).encode(), "f", 3, ctx)["error_code"]
    assert error([{"type": "image_url", "image_url": {"url": url}}], validation_context()) == "image_not_supported"
    assert error([{"type": "image_url", "image_url": url}]) == "invalid_request"  # chat's image_url is an object
    assert error([{"type": "image_url", "image_url": {"url": url, "detail": "max"}}]) == "invalid_request"
    assert error([{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]) == "invalid_image_url"
    assert error([{"type": "image_url", "image_url": {"url": url}}, {"type": "input_audio"}]) == \
        "unsupported_parameter"
    # an uploaded image (the batch service's files of purpose vision) by its file id: the key's own only
    stored = str(tmp_path / "files" / "file-abc")
    owned = replace(vision, media=replace(vision.media, media_files=(("file-abc", stored),)))
    by_id = {**responses, "body": {**responses["body"], "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-abc"}]}]}}
    row = validate_line(json.dumps(by_id).encode(), "f", 4, owned)
    assert row["error_code"] is None and json.loads(row["options_json"])["images"] == [stored]
    other = validate_line(json.dumps(by_id).encode(), "f", 5, vision)  # not among this owner's files
    assert other["error_code"] == "invalid_image_url" and "purpose 'vision'" in other["error_message"]


def test_the_request_column_keeps_data_urls_out_and_the_rest_as_it_was():
    url = data_url(png())
    text = json.dumps({"custom_id": "x", "body": {"image": url, "text": "base64, not a URL"}})
    kept = json.loads(without_data_urls(text))
    assert kept["body"]["text"] == "base64, not a URL"
    size = len(base64.b64decode(url.split(",", 1)[1]))
    assert kept["body"]["image"].startswith(f"data:image/png;base64,<{size:,} bytes, sha256 ")
    plain = '{"custom_id": "y"}'
    assert without_data_urls(plain) is plain


def test_error_messages_name_the_image():
    assert label(0, 2, "/Volumes/imgs/cat.png") == "image 1 of 2 (/Volumes/imgs/cat.png)"
    assert label(1, 2, data_url(png())) == "image 2 of 2 (data:image/png;base64,…)"
