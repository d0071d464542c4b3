"""/v1/audio/transcriptions and /v1/audio/translations in one batch on a Whisper-shaped model (make_tiny_model.py
--kind whisper) in vLLM: the audio by path, data: URL, at another rate and in stereo; bad files as error rows; the
answers in openai-python's types, the text the model's own for what it heard, and queryable in SQL."""

from __future__ import annotations

import base64
import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import WHISPER_MODEL, wav, write_jsonl

TRANSCRIBE, TRANSLATE = "/v1/audio/transcriptions", "/v1/audio/translations"
#: Each clip's file and how long it is.
CLIPS = {"tone.wav": (wav(2.0), 2.0), "noise.wav": (wav(2.0, noise_seed=7), 2.0),
         "stereo-44k.wav": (wav(3.0, rate=44_100, hz=300.0, channels=2), 3.0), "long.wav": (wav(31.0, rate=8_000), 31),
         "not-audio.wav": (b"RIFX this is no audio", 0), "cut.wav": (wav(1.0)[:30], 0)}
DATA_URL = "data:audio/wav;base64," + base64.b64encode(wav(1.5, hz=880.0)).decode()


def line(custom_id: str, url: str = TRANSCRIBE, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": WHISPER_MODEL, **body}}


def lines(clips: Path) -> dict[str, tuple[dict, str]]:
    """Each line and what it ends as: ok, or its error code."""
    at = {name: str(clips / name) for name in CLIPS}
    return {
        "tone": (line("tone", file_url=at["tone.wav"], language="en"), "ok"),
        "noise": (line("noise", file_url=at["noise.wav"], language="en"), "ok"),
        "stereo-44k": (line("stereo-44k", file_url=at["stereo-44k.wav"]), "ok"),  # the model writes the language
        "inline": (line("inline", file_url=DATA_URL, language="zh", prompt="你好"), "ok"),
        "translate": (line("translate", TRANSLATE, file_url=at["tone.wav"], language="de"), "ok"),
        "long": (line("long", file_url=at["long.wav"]), "audio_too_large"),
        "not-audio": (line("not-audio", file_url=at["not-audio.wav"]), "invalid_audio_format"),
        "cut": (line("cut", file_url=at["cut.wav"]), "audio_parse_error"),
        "chat": ({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": WHISPER_MODEL, "messages": [{"role": "user", "content": "hi"}]}},
                 "unsupported_endpoint"),
    }


@pytest.fixture(scope="module")
def heard(spark, whisper_model, tmp_path_factory):
    from spark_llm import BatchConfig, run_batch

    root = tmp_path_factory.mktemp("transcriptions")
    clips = root / "clips"
    clips.mkdir()
    for name, (data, _) in CLIPS.items():
        (clips / name).write_bytes(data)
    expected = lines(clips)
    write_jsonl(root / "in.jsonl", [ln for ln, _ in expected.values()])
    # float32: the answers are compared with transformers' own greedy decoding of the same model
    cfg = BatchConfig(input=str(root / "in.jsonl"), output_dir=str(root / "out"), batch_id="b-audio",
                      model=whisper_model, served_model_name=WHISPER_MODEL, dtype="float32", max_model_len=448,
                      max_num_seqs=8, enforce_eager=True, kv_cache_memory_bytes=64 << 20, num_task_slots=2,
                      allowed_media_paths=str(clips))
    return run_batch(spark, cfg), expected, clips


def outputs(spark, result) -> dict:
    return {r["custom_id"]: r for r in spark.read.format("delta").load(result.outputs_table).collect()}


@functools.lru_cache(maxsize=1)
def _whisper(model_dir: str):
    """The model and its processor, loaded once for the module's comparisons (float32)."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    return (WhisperProcessor.from_pretrained(model_dir),
            WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval())


def greedy_text(model_dir: str, audio: np.ndarray, prompt: str) -> str:
    """What the model writes for ``audio`` (16 kHz) after ``prompt``, greedily, by transformers (float32), one
    token a step on its cache of the tokens before."""
    import torch

    processor, model = _whisper(model_dir)
    tokenizer = processor.tokenizer
    features = processor.feature_extractor(audio, sampling_rate=16_000, return_tensors="pt").input_features
    step = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    written: list[int] = []
    past = None
    with torch.no_grad():
        heard_ = model.model.encoder(features).last_hidden_state
        while len(written) < 224:
            out = model(encoder_outputs=(heard_,), decoder_input_ids=step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            written.append(int(out.logits[0, -1].argmax()))
            if written[-1] == tokenizer.eos_token_id:
                break
            step = torch.tensor([[written[-1]]])
    return tokenizer.decode(written, skip_special_tokens=True).strip()


@pytest.mark.engine
def test_every_line_once_answered_in_openais_shapes(spark, heard):
    from openai.types.audio import Transcription, Translation

    result, expected, _ = heard
    rows = outputs(spark, result)
    errors = {r["custom_id"]: r["code"] for r in spark.read.format("delta").load(result.errors_table).collect()}
    assert {**{cid: "ok" for cid in rows}, **errors} == {cid: want for cid, (_, want) in expected.items()}
    bodies = {cid: json.loads(r["response_body"]) for cid, r in rows.items()}
    for cid, seconds in (("tone", 2.0), ("noise", 2.0), ("stereo-44k", 3.0), ("inline", 1.5)):
        parsed = Transcription.model_validate(bodies[cid])
        assert parsed.usage.type == "duration" and parsed.usage.seconds == math.ceil(seconds), cid
        assert parsed.text == rows[cid]["text"]
    assert Translation.model_validate(bodies["translate"]).text == rows["translate"]["text"]
    assert "usage" not in bodies["translate"]


@pytest.mark.engine
def test_the_text_is_what_the_model_writes_for_what_it_heard(spark, heard, whisper_model):
    from spark_llm.audio import decode_clip
    from spark_llm.engine_host.protocol import AudioClip

    result, _, clips = heard
    rows = outputs(spark, result)

    def audio(name: str) -> np.ndarray:
        return decode_clip(AudioClip((clips / name).read_bytes(), 16_000))[0]
    english = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    tone, noise = greedy_text(whisper_model, audio("tone.wav"), english), greedy_text(whisper_model,
                                                                                      audio("noise.wav"), english)
    assert tone != noise  # the audio reaches the encoder: another sound, another text
    assert (rows["tone"]["text"], rows["noise"]["text"]) == (tone, noise)
    # 44.1 kHz stereo heard at 16 kHz mono; no language: the model writes it
    assert rows["stereo-44k"]["text"] == greedy_text(whisper_model, audio("stereo-44k.wav"), "<|startoftranscript|>")
    assert rows["translate"]["text"] == greedy_text(whisper_model, audio("tone.wav"),
                                                    "<|startoftranscript|><|de|><|translate|><|notimestamps|>")


@pytest.mark.engine
def test_bad_audio_says_what_to_change_and_the_text_answers_sql(spark, heard):
    result, _, _ = heard
    messages = {r["custom_id"]: r["message"]
                for r in spark.read.format("delta").load(result.errors_table).collect()}
    assert "31.0 s long" in messages["long"] and "at most 30 s" in messages["long"]
    assert "send WAV" in messages["not-audio"] and "broken audio file" in messages["cut"]
    assert "speech-to-text model" in messages["chat"] and TRANSCRIBE in messages["chat"]
    spark.read.format("delta").load(result.outputs_table).createOrReplaceTempView("heard")
    texts = {r["custom_id"]: r["text"] for r in spark.sql(
        f"SELECT custom_id, text FROM heard WHERE endpoint IN ('{TRANSCRIBE}', '{TRANSLATE}')").collect()}
    bodies = {cid: json.loads(r["response_body"])["text"] for cid, r in outputs(spark, result).items()}
    assert texts == bodies and len(texts) == 5
