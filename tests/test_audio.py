"""Audio files of transcription and translation lines, without an engine: measured from their header, decoded and
resampled as the engine gets them, checked where a line is validated, and counted where its tokens are."""

from __future__ import annotations

import base64
import json
import sys
from dataclasses import replace

import numpy as np
import pytest

from conftest import validation_context, wav
from spark_llm.audio import Hearing, decode_clip, hearing, measure, resample
from spark_llm.engine_host.protocol import AudioClip, EngineTask
from spark_llm.errors import RequestError
from spark_llm.media import MediaPolicy
from spark_llm.validate import validate_line

WHISPER = Hearing(16_000, 160, 30.0)


def code(fn) -> str:
    with pytest.raises(RequestError) as err:
        fn()
    return err.value.code.value


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.argmax(spectrum) * rate / len(samples))


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_a_pcm_wav_is_measured_from_its_header_and_decoded_to_its_samples(width):
    data = wav(0.5, rate=16_000, hz=440.0, width=width)
    info = measure(data)
    assert (info.format, info.seconds, info.sample_rate, info.channels) == ("WAV", 0.5, 16_000, 1)
    samples, rate = decode_clip(AudioClip(data, 16_000))
    expected = 0.3 * np.sin(2 * np.pi * 440.0 * np.arange(8_000) / 16_000)
    assert rate == 16_000 and samples.dtype == np.float32 and len(samples) == 8_000
    assert np.max(np.abs(samples - expected)) < 2.0 / (1 << (8 * width - 1)) + 1e-6


def test_a_clip_is_resampled_to_its_models_rate_without_aliasing():
    stereo = wav(1.0, rate=44_100, hz=440.0, channels=2)
    assert measure(stereo)[1:] == (1.0, 44_100, 2)
    samples, _ = decode_clip(AudioClip(stereo, 16_000))
    assert len(samples) == 16_000 and abs(peak_hz(samples, 16_000) - 440.0) <= 1.0
    assert np.max(np.abs(samples)) == pytest.approx(0.3, abs=0.01)  # the channels' mean, not their sum
    # a 7 kHz tone is above 8 kHz audio's Nyquist frequency: it is gone, not folded down to 1 kHz
    high = np.sin(2 * np.pi * 7_000 * np.arange(44_100) / 44_100).astype(np.float32)
    assert np.max(np.abs(resample(high, 44_100, 8_000))) < 0.01
    assert resample(high, 44_100, 44_100) is high


def test_what_is_not_a_readable_audio_file_is_the_requests_error(monkeypatch):
    good = wav(0.25)
    assert code(lambda: measure(b"not audio at all")) == "invalid_audio_format"
    assert code(lambda: measure(good[:30])) == "audio_parse_error"  # its header cut short
    float_wav = good[:20] + (3).to_bytes(2, "little") + good[22:]  # IEEE float samples: not PCM
    assert code(lambda: measure(float_wav)) == "invalid_audio_format"
    monkeypatch.setitem(sys.modules, "soundfile", None)  # an executor without soundfile reads WAV only
    with pytest.raises(RequestError, match="pip install soundfile") as err:
        measure(b"fLaC" + bytes(60))
    assert err.value.code.value == "invalid_audio_format"


def test_how_a_model_hears_is_read_from_its_processor_config(tmp_path):
    extractor = {"sampling_rate": 16_000, "hop_length": 160, "chunk_length": 30, "feature_size": 80}
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "processor_config.json").write_text(json.dumps({"feature_extractor": extractor}))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "preprocessor_config.json").write_text(json.dumps({**extractor, "chunk_length": 20}))
    (tmp_path / "text").mkdir()
    assert hearing(str(tmp_path / "new")) == WHISPER
    assert hearing(str(tmp_path / "old")) == Hearing(16_000, 160, 20.0)
    assert hearing(str(tmp_path / "text")) is None
    assert WHISPER.tokens(2.0) == 200 and WHISPER.tokens(1.005) == 101  # log-mel frames, as vLLM counts them


def audio_line(custom_id: str, url: str = "/v1/audio/transcriptions", **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "tiny-llm", **body}}).encode()


def test_transcription_and_translation_lines_are_checked_field_by_field(tmp_path):
    clip = tmp_path / "a.wav"
    ctx = replace(validation_context(), tasks=(EngineTask.TRANSCRIBE,), hearing=WHISPER,
                  media=MediaPolicy(allowed_media_paths=(str(tmp_path),),
                                    media_files=(("file-audio", str(tmp_path / "files" / "file-audio")),)))

    def row(line: bytes, context=ctx) -> dict:
        return validate_line(line, "f", 1, context)

    ok = row(audio_line("t", file_url=str(clip), language="EN", temperature=0.2))
    assert ok["error_code"] is None, ok
    assert json.loads(ok["prompt_json"]) == "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    assert json.loads(ok["options_json"]) == {"audio": str(clip), "sample_rate": 16_000}
    assert json.loads(ok["sampling_json"]) == {"max_tokens": 224, "temperature": 0.2}
    earlier = row(audio_line("p", file_url=str(clip), prompt="Hello again."))
    # no language: the model writes it
    assert json.loads(earlier["prompt_json"]) == "<|startofprev|>Hello again.<|startoftranscript|>"
    translated = row(audio_line("r", "/v1/audio/translations", file_url=str(clip), language="de"))
    assert json.loads(translated["prompt_json"]) == "<|startoftranscript|><|de|><|translate|><|notimestamps|>"
    uploaded = row(audio_line("u", file="file-audio"))
    assert json.loads(uploaded["options_json"])["audio"] == str(tmp_path / "files" / "file-audio")
    data_url = "data:audio/wav;base64," + base64.b64encode(wav(0.1)).decode()
    inline = row(audio_line("d", file_url=data_url))
    assert inline["error_code"] is None and data_url not in inline["request"]  # the table keeps its size and hash

    refused = {
        "both": (audio_line("both", file_url=str(clip), file="file-audio"), "invalid_request", "exactly one"),
        "neither": (audio_line("neither"), "invalid_request", "body.file_url"),
        "outside": (audio_line("outside", file_url="/etc/passwd"), "invalid_audio_url", "--allowed-media-paths"),
        "not-base64": (audio_line("nb", file_url="data:audio/wav,abc"), "invalid_audio_url", "base64"),
        "not-owned": (audio_line("no", file="file-other"), "invalid_audio_url", "purpose 'user_data'"),
        "language": (audio_line("l", file_url=str(clip), language="xx"), "invalid_request", "ISO-639-1"),
        "srt": (audio_line("s", file_url=str(clip), response_format="srt"), "unsupported_parameter", "timestamps"),
        "words": (audio_line("w", file_url=str(clip), timestamp_granularities=["word"]), "unsupported_parameter",
                  "timestamp_granularities"),
        "hot": (audio_line("h", file_url=str(clip), temperature=1.5), "invalid_request", "temperature"),
        "field": (audio_line("f", file_url=str(clip), max_tokens=5), "unsupported_parameter", "max_tokens"),
        "translate-unsaid": (audio_line("tu", "/v1/audio/translations", file_url=str(clip)), "invalid_request",
                             "body.language is required"),
        "chat": (json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}]}}).encode(), "unsupported_endpoint",
            "speech-to-text model"),
    }
    for name, (line, want, said) in refused.items():
        got = row(line)
        assert (got["error_code"], said in (got["error_message"] or "")) == (want, True), (name, got["error_message"])
    on_text_model = row(audio_line("x", file_url=str(clip)), validation_context())
    assert on_text_model["error_code"] == "unsupported_endpoint" and "text generation model" in \
        on_text_model["error_message"]
    deaf = row(audio_line("x", file_url=str(clip)), replace(ctx, hearing=None))
    assert deaf["error_code"] == "unsupported_endpoint" and "feature extractor" in deaf["error_message"]


def test_a_clips_cost_is_its_decoders_prompt_and_its_encoders_frames(tmp_path, whisper_model):
    from spark_llm.tokenizers import get_tokenizer
    from spark_llm.tokens import TokenContext, count_rows

    (tmp_path / "two.wav").write_bytes(wav(2.0))
    (tmp_path / "long.wav").write_bytes(wav(31.0, rate=8_000))
    ctx = TokenContext(tokenizer=whisper_model, max_model_len=448, context_overflow="error", model=whisper_model,
                       media=MediaPolicy(allowed_media_paths=(str(tmp_path),)))
    prompt = json.dumps("<|startoftranscript|><|en|><|transcribe|><|notimestamps|>")
    sampling = json.dumps({"max_tokens": 224, "temperature": 0.0})
    rows = [("transcription", prompt, sampling, None, str(tmp_path / name)) for name in ("two.wav", "long.wav",
                                                                                         "gone.wav")]
    two, long, gone = count_rows(get_tokenizer(whisper_model), rows, ctx)
    tokenizer = get_tokenizer(whisper_model)
    assert two["prompt_token_ids"] == [tokenizer.convert_tokens_to_ids(
        ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"])]
    # the encoder's 200 frames count in the plan, not in the decoder's 448 positions (4 + 224 fit)
    assert (two["prompt_tokens"], two["est_tokens"], two["error_code"]) == (204, 428, None)
    assert long["error_code"] == "audio_too_large" and "31.0 s long" in long["error_message"]
    assert gone["error_code"] == "invalid_audio_url" and "does not exist" in gone["error_message"]
